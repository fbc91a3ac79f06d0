"""PEP 562 lazy exports for package ``__init__`` modules.

A package lists its public names and the module defining each; a name's module is imported the
first time the name is looked up, then the name is cached in the package. So ``import trainprobe``
(and every tool under ``trainprobe.tools``) costs no torch import, and a package ``__init__``
never imports its own submodules at import time (which is what made import cycles possible).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, namespace: dict[str, Any], exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package`` (its ``globals()`` is ``namespace``),
    serving each name of ``exports`` (name → defining module) from its module on first use.

    Looking up a name not in ``exports`` raises the usual ``AttributeError``.
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__

