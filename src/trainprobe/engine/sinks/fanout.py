"""Several sinks (and record consumers such as alerts) behind one :class:`~trainprobe.engine.sinks.background.Writer`.

Each batch goes to every member in order (and, before it is queued, to the ``prepare`` of the
members that have one). A member that raises is reported once through
``on_error`` and skipped for the rest of the run; the others keep receiving batches.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Generic

from trainprobe.engine.folders import one_line_fault
from trainprobe.engine.log import error_once
from trainprobe.engine.sinks.background import B, Sink


class FanOut(Generic[B]):
    """A sink that forwards every batch to ``members``."""

    def __init__(
        self, members: Sequence[Sink[B]], on_error: Callable[[Sink[B], BaseException], None] | None = None
    ) -> None:
        self.members = list(members)
        self.on_error = on_error
        self._failed: set[int] = set()

    def write(self, batch: B) -> None:
        for i, member in enumerate(self.members):
            if i not in self._failed:
                self._call(i, member, functools.partial(member.write, batch))

    def prepare(self, batch: B) -> None:
        """Call ``prepare(batch)`` of each member that has one and has not failed (see
        :class:`~trainprobe.engine.sinks.background.Writer`; on the submitting thread). A member
        that raises there is reported and skipped, as when its ``write`` raises."""
        for i, member in enumerate(self.members):
            prepare = getattr(member, "prepare", None)
            if prepare is not None and i not in self._failed:
                self._call(i, member, functools.partial(prepare, batch))

    def close(self, reached: int | None = None) -> None:
        for i, member in enumerate(self.members):
            self._call(i, member, functools.partial(member.close, reached))

    def _call(self, i: int, member: Sink[B], fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - one failing member must not stop the others
            self._failed.add(i)
            if self.on_error is not None:
                self.on_error(member, exc)
            else:
                error_once(
                    f"fanout-{type(member).__name__}-{id(self)}",
                    f"trainprobe: the {type(member).__name__} output failed and is disabled ({type(exc).__name__}: {exc})",
                    traceback=not one_line_fault(exc),  # disk full, permissions, a folder gone: one line says it all
                )
