"""TensorBoard output: every statistic is a scalar event ``add_scalar(tag, value, step)``.

Event files are written by ``torch.utils.tensorboard.SummaryWriter`` (needs the ``tensorboard``
package: ``pip install trainprobe[tensorboard]``) into ``log_dir``; a write error (disk full) is
reported by trainprobe in one line, never as a traceback from TensorBoard's writer thread
(:func:`quiet_writer_thread`). The tag of each value comes
from ``tag_of(table, key, op)``, so each dialect names its tags itself.

Histograms: rows of the tables named in ``histogram_tables`` are not statistics but histograms
laid out as :data:`HISTOGRAM_HEAD` followed by the bucket counts, the buckets splitting
``[min, max]`` into equal widths. Each such row is one histogram event
(``add_histogram_raw``) tagged ``tag_of(table, key, HISTOGRAM_OP)``; a row with no finite value
(``num`` 0) is skipped.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from trainprobe.errors import ConfigError
from trainprobe.records import RowKey, StepBatch
from trainprobe.sinks.fast_crc import use_fast_crc

HISTOGRAM_HEAD = ("min", "max", "num", "sum", "sum_squares")
"""The first values of a histogram row (over the finite values only); the bucket counts follow."""
HISTOGRAM_OP = "histogram"
"""The ``op`` passed to ``tag_of`` for a histogram row."""


def _summary_writer_class() -> type:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:  # tensorboard not installed
        raise ConfigError(
            f"format: 'tensorboard' needs the tensorboard package ({exc}); install it with "
            "`pip install tensorboard` (or trainprobe[tensorboard]), or use format 'csv'"
        ) from None
    return SummaryWriter


class _QuietRecordWriter:
    """TensorBoard's record writer as its background thread sees it: an error raised on that
    thread is kept (for :func:`quiet_writer_thread`) instead of ending the thread with a raw
    ``Exception in thread`` traceback; later records are dropped. Calls from any other thread
    behave as before."""

    def __init__(self, inner: Any, worker: threading.Thread) -> None:
        self._inner = inner
        self._worker = worker
        self._failed = False

    def _call(self, method: str, *args: Any) -> None:
        if threading.current_thread() is not self._worker:
            getattr(self._inner, method)(*args)
            return
        if self._failed:
            return
        try:
            getattr(self._inner, method)(*args)
        except Exception as exc:  # noqa: BLE001 - handed to the caller's thread, not printed
            self._failed = True
            self._worker.exception = exc  # type: ignore[attr-defined] - the caller's next call raises it

    def write(self, data: bytes) -> None:
        self._call("write", data)

    def flush(self) -> None:
        self._call("flush")

    def close(self) -> None:
        self._inner.close()

    @property
    def closed(self) -> bool:
        return bool(self._inner.closed)


def quiet_writer_thread(writer: Any) -> bool:
    """Keep the background thread of ``writer`` (a ``SummaryWriter``) from printing a traceback
    when a write fails (disk full): the error is raised instead by the writer's next call on
    the caller's thread, where trainprobe reports it in one line. Returns whether the thread
    could be reached (TensorBoard's event writer internals: ``_async_writer._worker``); when it
    cannot, nothing changes."""
    try:
        async_writer = writer._get_file_writer().event_writer._async_writer
        worker = async_writer._worker
        inner = worker._record_writer
    except AttributeError:
        return False
    if isinstance(inner, _QuietRecordWriter):
        return True
    quiet = _QuietRecordWriter(inner, worker)
    worker._record_writer = quiet
    async_writer._writer = quiet
    return True


class TensorBoardSink:
    """Scalars into TensorBoard event files.

    Args:
        log_dir: folder of the event files.
        ops: monitor or table → op names (value order), looked up with ``table_of``.
        table_of: the table of a row.
        tag_of: the tag of ``(table, key, op)``.
        histogram_tables: tables whose rows are histograms (see the module docstring).

    Raises:
        ConfigError: the tensorboard package is missing (at construction, never in training).
    """

    def __init__(
        self,
        log_dir: Path,
        ops: Mapping[str, tuple[str, ...]],
        table_of: Callable[[str, RowKey], str],
        tag_of: Callable[[str, RowKey, str], str],
        histogram_tables: Collection[str] = (),
    ) -> None:
        writer_class = _summary_writer_class()
        log_dir.mkdir(parents=True, exist_ok=True)
        self._writer = writer_class(log_dir=str(log_dir))
        use_fast_crc(self._writer)
        quiet_writer_thread(self._writer)
        self.ops = dict(ops)
        self.table_of = table_of
        self.tag_of = tag_of
        self.histogram_tables = frozenset(histogram_tables)

    def write(self, batch: StepBatch) -> None:
        for key, values in batch.rows():
            table = self.table_of(batch.monitor, key)
            if table in self.histogram_tables:
                self._write_histogram(self.tag_of(table, key, HISTOGRAM_OP), values, batch.step)
                continue
            for op, value in zip(self.ops[table], values):
                self._writer.add_scalar(self.tag_of(table, key, op), value, batch.step)

    def _write_histogram(self, tag: str, values: Sequence[float], step: int) -> None:
        head = len(HISTOGRAM_HEAD)
        lo, hi, num, total, squares = values[:head]
        counts = list(values[head:])
        if not num or not counts or not (math.isfinite(lo) and math.isfinite(hi)):
            return
        if hi > lo:
            width = (hi - lo) / len(counts)
            limits = [lo + width * (i + 1) for i in range(len(counts))]
            limits[-1] = hi
        else:
            limits, counts = [hi], [num]
        self._writer.add_histogram_raw(tag, lo, hi, num, total, squares, limits, counts, global_step=step)

    def flush(self) -> None:
        """Push pending events to disk."""
        self._writer.flush()

    def close(self, reached: int | None = None) -> None:
        self._writer.flush()
        self._writer.close()
