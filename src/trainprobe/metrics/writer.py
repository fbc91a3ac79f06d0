"""The writer thread: turns sealed payloads into metrics and hands them to the outputs.

A bounded queue keeps memory flat (a slow disk slows training a little rather than growing
memory). An exception in one output is logged once (one line for an ``OSError`` such as a full
disk, with a traceback for anything else) and disables that output only; an exception
while composing a step drops that step only. Nothing raised here reaches training.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from typing import Protocol

from trainprobe.log import error_once
from trainprobe.metrics.compose import Composer, Metric
from trainprobe.metrics.payload import StepPayload


class Output(Protocol):
    """What the writer needs from an output."""

    def write(self, step: int, samples: int | None, metrics: Sequence[Metric]) -> None: ...

    def text(self, entries: Sequence[tuple[str, str]]) -> None: ...

    def close(self) -> None: ...


_TextJob = tuple[tuple[str, str], ...]


class MetricsWriter:
    """Feeds payloads to ``outputs`` on a daemon thread."""

    def __init__(self, composer: Composer, outputs: Sequence[Output], max_pending: int = 64) -> None:
        self.composer = composer
        self.outputs = list(outputs)
        self._queue: queue.Queue[StepPayload | _TextJob | None] = queue.Queue(maxsize=max_pending)
        self._thread = threading.Thread(target=self._drain, name="trainprobe-metrics-writer", daemon=True)
        self._closed = False
        self._thread.start()

    def submit(self, payload: StepPayload) -> None:
        """Queue a sealed payload."""
        if not self._closed:
            self._queue.put(payload)

    def text(self, entries: Sequence[tuple[str, str]]) -> None:
        """Queue configuration text."""
        if not self._closed and entries:
            self._queue.put(tuple(entries))

    def flush(self) -> None:
        """Block until everything queued is written."""
        if not self._closed:
            self._queue.join()

    def close(self) -> None:
        """Write what is queued, stop the thread, close the outputs (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()
        for out in self.outputs:
            try:
                out.close()
            except Exception as exc:  # noqa: BLE001 - reported, never raised into training
                error_once(
                    f"metrics-close-{type(out).__name__}",
                    f"trainprobe: closing {type(out).__name__} failed ({type(exc).__name__}: {exc})",
                    traceback=not isinstance(exc, OSError),
                )

    def _drain(self) -> None:
        q = self._queue
        while True:
            job = q.get()
            try:
                if job is None:
                    return
                self._handle(job)
            finally:
                q.task_done()

    def _handle(self, job: StepPayload | _TextJob) -> None:
        if isinstance(job, tuple):
            self._each(lambda out: out.text(job))
            return
        try:
            metrics = self.composer.compose(job.values())
        except Exception:  # noqa: BLE001 - one step lost, training goes on
            error_once("metrics-compose", f"trainprobe: training metrics of step {job.step} could not be computed")
            return
        self._each(lambda out: out.write(job.step, job.samples, metrics))

    def _each(self, action) -> None:  # type: ignore[no-untyped-def]
        for out in list(self.outputs):
            try:
                action(out)
            except Exception as exc:  # noqa: BLE001 - that output is disabled, the others go on
                error_once(
                    f"metrics-output-{type(out).__name__}",
                    f"trainprobe: {type(out).__name__} failed and is disabled; the other outputs continue "
                    f"({type(exc).__name__}: {exc})",
                    traceback=not isinstance(exc, OSError),  # disk full, permissions: one line says it all
                )
                self.outputs.remove(out)
