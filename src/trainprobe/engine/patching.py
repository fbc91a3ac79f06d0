"""Replacing attributes of modules and classes, and putting back exactly what was there.

Every patch trainprobe makes while it monitors (collectives, ``Work.wait``, ``GradScaler.step``,
the precision dump's API wrappers) goes through :class:`AttrPatch`, so that stopping leaves
PyTorch (or MindSpore) as it found it: a module attribute gets back its original object, and a
class attribute the class only inherited is deleted again rather than copied into the class.
"""

from __future__ import annotations

import types
from typing import Any

_INHERITED = object()
"""Marks a class attribute that the class did not hold itself (it was inherited)."""


class AttrPatch:
    """Replaces attributes by wrappers and restores exactly what was there."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []

    def replace(self, owner: Any, attr: str, wrapper: Any) -> None:
        """Set ``owner.attr = wrapper``, remembering what ``owner`` held (for a class or an
        instance, only what its own ``__dict__`` held: an instance's method comes from its class,
        so restoring deletes the instance attribute again)."""
        held = getattr(owner, attr) if _keeps_value(owner) else vars(owner).get(attr, _INHERITED)
        self._saved.append((owner, attr, held))
        setattr(owner, attr, wrapper)

    def restore(self, owner: Any = None, attr: str | None = None) -> bool:
        """Put originals back (all, or only ``owner.attr``), newest first; returns whether
        anything was restored."""
        keep: list[tuple[Any, str, Any]] = []
        done = False
        for o, a, original in reversed(self._saved):
            if owner is None or (o is owner and a == attr):
                if original is _INHERITED:
                    delattr(o, a)
                else:
                    setattr(o, a, original)
                done = True
            else:
                keep.append((o, a, original))
        self._saved = list(reversed(keep))
        return done

    def __bool__(self) -> bool:
        return bool(self._saved)


def _keeps_value(owner: Any) -> bool:
    """Whether restoring puts back the value read (modules, objects without ``__dict__``) rather
    than only what the owner's own ``__dict__`` held (classes, instances)."""
    return isinstance(owner, types.ModuleType) or not hasattr(owner, "__dict__")
