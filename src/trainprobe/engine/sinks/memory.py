"""In-memory output (Monitor V1 ``format: api``): the latest collected step of every monitor.

Nothing is written to disk. ``write`` only keeps a reference to each monitor's latest batch
(constant time, so keeping it costs training nothing); :meth:`MemorySink.latest` turns the
batches into ``{row key: {op: value}}`` for one table when asked. Memory stays bounded by one
step.

A session's memory is built with that session's ops; the memory of the next session of the same
run starts from it (``earlier=``), so the latest collected step stays readable across a
reconfiguration, each batch read with the ops it was written with.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import TypeAlias

from trainprobe.engine.records import RowKey, StepBatch

_Ops: TypeAlias = dict[str, tuple[str, ...]]


class MemorySink:
    """Keeps the latest batch of each monitor.

    Args:
        ops: table → its op names (value order).
        table_of: the table of a row, from its monitor and key.
        key_of: the dict key of a row (default: its name).
        earlier: the memory of the run's previous session: its latest batches are kept (with
            their own ops) until this one's monitors write theirs.
    """

    def __init__(
        self,
        ops: Mapping[str, tuple[str, ...]],
        table_of: Callable[[str, RowKey], str],
        key_of: Callable[[RowKey], str] = lambda key: key.name,
        *,
        earlier: MemorySink | None = None,
    ) -> None:
        self.ops: _Ops = dict(ops)
        self.table_of = table_of
        self.key_of = key_of
        self._batches: dict[str, tuple[StepBatch, _Ops]] = earlier.batches() if earlier is not None else {}
        self._lock = threading.Lock()

    def batches(self) -> dict[str, tuple[StepBatch, _Ops]]:
        """A copy of the latest batch of each monitor, with the ops it was written with."""
        with self._lock:
            return dict(self._batches)

    def write(self, batch: StepBatch) -> None:
        with self._lock:
            self._batches[batch.monitor] = (batch, self.ops)

    def latest(self, table: str) -> tuple[int | None, dict[str, dict[str, float]]]:
        """``(step, rows)`` of the latest step that wrote ``table`` (``(None, {})`` before any)."""
        with self._lock:
            batches = list(self._batches.values())
        found: dict[int, dict[str, dict[str, float]]] = {}
        for batch, ops in batches:
            for key, values in batch.rows():
                if self.table_of(batch.monitor, key) == table:
                    found.setdefault(batch.step, {})[self.key_of(key)] = dict(zip(ops[table], values))
        if not found:
            return None, {}
        step = max(found)
        return step, found[step]

    def close(self, reached: int | None = None) -> None:
        """Nothing to release; the values stay readable."""
