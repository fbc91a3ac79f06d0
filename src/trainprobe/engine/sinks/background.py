"""The one writer thread of trainprobe: batches go from the training thread to a sink.

Used by every front door (the monitors' CSV/TensorBoard/memory sinks, the training metrics) and
by the precision dump (its ``.pt`` files). A failing write (disk full, permissions) is reported
once through ``on_error`` with the monitor's name; that monitor's later batches are dropped and
every other monitor keeps writing (a sink that reports its own faults, as the dump's does, never
raises). The pending work is bounded, by batch count or by a ``cost`` per batch (the dump: bytes
of tensor snapshots), so a slow disk slows training down a little instead of growing memory
without limit; a batch larger than the whole budget still goes when nothing else waits.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

ErrorCallback = Callable[[str, BaseException], None]


class Batch(Protocol):
    """What a writer reads of a batch: the monitor it belongs to and whether it holds anything
    (:class:`~trainprobe.engine.records.StepBatch` of the monitors, :class:`~trainprobe.engine.records.ScalarBatch`
    of the training metrics, a file of the dump)."""

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
    """Feeds batches to ``sink``, on a background thread when ``background`` is true.

    A sink with a ``prepare(batch)`` method (the CSV sink: it opens a new window's files there)
    has it called on the submitting thread, before the batch is queued: work that must happen in
    the training loop's order (a folder checked at the step that needs it, not whenever the
    writer thread gets to it). ``prepare`` must not raise; if it does, the batch's monitor is
    reported through ``on_error`` and dropped from then on, as for a failed write.

    Args:
        sink: where batches go (called on the writer thread only, in submission order).
        background: false writes each batch on the caller's thread (``submit`` returns after it).
        on_error: ``on_error(monitor, exc)`` when the sink raised writing one of its batches.
        max_pending: the budget of queued work: batches, or the sum of ``cost`` when given.
        cost: what one batch weighs against ``max_pending`` (default 1).
        idle_exit_s: the thread ends after this many idle seconds and the next ``submit`` starts
            a new one (None: it lives until :meth:`close`, started at once).
    """

    def __init__(
        self,
        sink: Sink[B],
        *,
        background: bool,
        on_error: ErrorCallback,
        max_pending: int = 256,
        cost: Callable[[B], int] | None = None,
        idle_exit_s: float | None = None,
    ) -> None:
        self.sink = sink
        self.on_error = on_error
        self.failed: set[str] = set()
        self.background = background
        self.max_pending = max_pending
        self._cost = cost
        self._idle_exit_s = idle_exit_s
        self._jobs: deque[tuple[B, int]] = deque()
        self._cond = threading.Condition()
        self._pending = 0  # cost of the queued and running batches
        self._outstanding = 0  # batches submitted and not yet written
        self._waiting = 0  # callers waiting for room or for a flush
        self._idle = False  # the thread sleeps for want of work
        self._closing = False
        self._thread: threading.Thread | None = None
        self._prepare: Callable[[B], None] | None = getattr(sink, "prepare", None)
        if background and idle_exit_s is None:
            self._start()

    # -- the training thread ---------------------------------------------------------------
    def submit(self, batch: B) -> None:
        """Queue a batch (or write it now in synchronous mode), after the sink's ``prepare``;
        waits while the budget is spent."""
        if batch.monitor in self.failed or not len(batch):
            return
        if self._prepare is not None:
            try:
                self._prepare(batch)
            except Exception as exc:  # noqa: BLE001 - a sink fault disables one monitor only
                self.failed.add(batch.monitor)
                self.on_error(batch.monitor, exc)
                return
        if not self.background:
            self._write(batch)
            return
        cost = 1 if self._cost is None else self._cost(batch)
        with self._cond:
            while self._pending and self._pending + cost > self.max_pending:
                self._wait()
            self._pending += cost
            self._outstanding += 1
            self._jobs.append((batch, cost))
            if self._thread is None:
                self._start()
            elif self._idle:  # wake the thread only when it sleeps: each wake-up hands the GIL over
                self._cond.notify_all()

    def flush(self) -> None:
        """Block until every batch submitted so far is written."""
        with self._cond:
            while self._outstanding:
                self._wait()

    def close(self, reached: int | None = None) -> None:
        """Write what is queued, stop the thread and close the sink's files."""
        thread = self._thread
        if thread is not None:
            with self._cond:
                self._closing = True
                self._cond.notify_all()
            thread.join()
        self.background = False  # anything submitted after closing is written at once
        try:
            self.sink.close(reached)
        except Exception as exc:  # noqa: BLE001 - reported, never raised into training
            self.on_error("writer", exc)

    def _wait(self) -> None:
        self._waiting += 1
        try:
            self._cond.wait()
        finally:
            self._waiting -= 1

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._drain, name="trainprobe-writer", daemon=True)
        self._thread.start()

    # -- the writer thread -----------------------------------------------------------------
    def _drain(self) -> None:
        while True:
            job = self._next()
            if job is None:
                return
            batch, cost = job
            job = None  # hold the batch no longer than its write (the dump's snapshots are large)
            try:
                if batch.monitor not in self.failed:
                    self._write(batch)
            finally:
                del batch
                with self._cond:
                    self._pending -= cost
                    self._outstanding -= 1
                    if self._waiting:
                        self._cond.notify_all()

    def _next(self) -> tuple[B, int] | None:
        """The next batch, or None when the thread must end (closing, or idle too long)."""
        with self._cond:
            while not self._jobs:
                if self._closing:
                    self._thread = None
                    return None
                self._idle = True
                woken = self._cond.wait(self._idle_exit_s)
                self._idle = False
                if not woken and not self._jobs and not self._closing:  # idle: end; submit restarts
                    self._thread = None
                    return None
            return self._jobs.popleft()

    def _write(self, batch: B) -> None:
        try:
            self.sink.write(batch)
        except Exception as exc:  # noqa: BLE001 - a write fault disables one monitor only
            self.failed.add(batch.monitor)
            self.on_error(batch.monitor, exc)
