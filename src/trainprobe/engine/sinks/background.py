"""Moves writing off the training thread: a daemon thread drains a bounded queue into a sink.

A failing write (disk full, permissions) is reported once through ``on_error`` with the
monitor's name; that monitor's later batches are dropped and every other monitor keeps writing.
The queue is bounded, so a slow disk slows training down a little instead of growing memory
without limit.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

ErrorCallback = Callable[[str, BaseException], None]


class Batch(Protocol):
    """What a writer reads of a batch: the monitor it belongs to and whether it holds anything
    (:class:`~trainprobe.engine.records.StepBatch` of the monitors, :class:`~trainprobe.engine.records.ScalarBatch`
    of the training metrics)."""

    @property
    def monitor(self) -> str: ...

    def __len__(self) -> int: ...


B = TypeVar("B", bound=Batch)
B_contra = TypeVar("B_contra", bound=Batch, contravariant=True)


class Sink(Protocol[B_contra]):
    """What a writer needs from a sink of batches of one kind."""

    def write(self, batch: B_contra) -> None: ...

    def close(self, reached: int | None = None) -> None: ...


class Writer(Generic[B]):
    """Feeds batches to ``sink``, on a background thread when ``background`` is true."""

    def __init__(self, sink: Sink[B], *, background: bool, on_error: ErrorCallback, max_pending: int = 256) -> None:
        self.sink = sink
        self.on_error = on_error
        self.failed: set[str] = set()
        self._queue: queue.Queue[B | None] | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._queue = queue.Queue(maxsize=max_pending)
            self._thread = threading.Thread(target=self._drain, name="trainprobe-writer", daemon=True)
            self._thread.start()

    def submit(self, batch: B) -> None:
        """Queue a batch (or write it now in synchronous mode)."""
        if batch.monitor in self.failed or not len(batch):
            return
        if self._queue is None:
            self._write(batch)
        else:
            self._queue.put(batch)

    def flush(self) -> None:
        """Block until every queued batch is written."""
        if self._queue is not None:
            self._queue.join()

    def close(self, reached: int | None = None) -> None:
        """Write what is queued, stop the thread and close the sink's files."""
        if self._queue is not None and self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._queue = None
        try:
            self.sink.close(reached)
        except Exception as exc:  # noqa: BLE001 - reported, never raised into training
            self.on_error("writer", exc)

    def _drain(self) -> None:
        assert self._queue is not None
        q = self._queue
        while True:
            batch = q.get()
            try:
                if batch is None:
                    return
                if batch.monitor not in self.failed:
                    self._write(batch)
            finally:
                q.task_done()

    def _write(self, batch: B) -> None:
        try:
            self.sink.write(batch)
        except Exception as exc:  # noqa: BLE001 - a write fault disables one monitor only
            self.failed.add(batch.monitor)
            self.on_error(batch.monitor, exc)
