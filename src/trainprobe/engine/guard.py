"""The one fault guard: monitoring code that runs inside training never raises into it.

:func:`guarded` wraps a hook or a gatherer: while ``off()`` is true it does nothing; an exception
it raises is handed to ``fail`` (which logs it once and switches the part off) and the call
returns None, so training goes on unchanged. The probes of Monitor V1/V2
(:meth:`trainprobe.engine.probes.base.Probe.guard`: the whole probe is disabled), the training
metrics (:class:`Fuses`: one gatherer is turned off, the others go on) and the precision dump
(``Collector.guarded``: dumping stops) all use it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from trainprobe.engine.log import error_once

F = TypeVar("F", bound=Callable[..., Any])


def guarded(fn: F, *, off: Callable[[], bool], fail: Callable[[Exception], None], wraps: bool = True) -> F:
    """``fn`` that never raises: skipped (returns None) while ``off()``; an exception goes to
    ``fail`` and the call returns None. ``wraps=False`` skips copying ``fn``'s name and docstring
    (for wrappers made by the thousand, such as the dump's gradient hooks)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        if off():
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a monitor must never break training
            fail(exc)
            return None

    if wraps:
        functools.update_wrapper(call, fn)
    return call  # type: ignore[return-value]


class Fuses:
    """Named parts of one monitor (gatherers), each turned off for the rest of the run by its
    first fault, reported in one line: ``trainprobe: <what> failed; it is turned off``."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.off: set[str] = set()

    def is_on(self, name: str) -> bool:
        """Whether ``name`` has not failed yet."""
        return name not in self.off

    def turn_off(self, name: str, message: str) -> None:
        """Turn ``name`` off and log ``message`` (once per part and owner)."""
        self.off.add(name)
        error_once(f"{self.owner}-{name}", message)

    def run(self, name: str, what: str, fn: Callable[[], object]) -> None:
        """Call ``fn`` under the guard of part ``name`` (``what`` says what it gathers)."""
        guarded(
            fn,
            off=lambda: name in self.off,
            fail=lambda exc: self.turn_off(name, f"trainprobe: gathering {what} failed; it is turned off"),
        )()
