"""TensorBoard output of every monitor: one event per batch, written by the one event writer
(:class:`~trainprobe.engine.sinks.events.EventWriter`: native CRC with a fallback, no thread
tracebacks).

:class:`TensorBoardSink` takes the records of both kinds of front door:

* :class:`~trainprobe.engine.records.StepBatch` (Monitor V1's statistics rows): every value of the batch
  is a float32 scalar at the batch's step, all in one ``Summary``. The tag of each value comes
  from ``tag_of(table, key, op)``, so each dialect names its tags itself. Rows of the tables
  named in ``histogram_tables`` are not statistics but histograms laid out as
  :data:`HISTOGRAM_HEAD` followed by the bucket counts, the buckets splitting ``[min, max]``
  into equal widths; each is one histogram value tagged ``tag_of(table, key, HISTOGRAM_OP)``; a
  row with no finite value (``num`` 0) is skipped.
* :class:`~trainprobe.engine.records.ScalarBatch` (the training metrics' named scalars): the scalars
  whose formats include ``tensorboard`` in one ``Summary`` at the step, their ``-vs-samples``
  twins (``vs_samples``) in one at the samples count; text entries as TEXT at step 0.

The event files are ``<log_dir>/events.out.tfevents.*`` (needs the ``tensorboard`` package:
``pip install trainprobe[tensorboard]``); a write error (disk full) is reported by trainprobe
in one line, never as a traceback from TensorBoard's writer thread.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.records import RowKey, ScalarBatch, StepBatch
from trainprobe.engine.sinks.events import EventWriter, quiet_writer_thread

__all__ = ["HISTOGRAM_HEAD", "HISTOGRAM_OP", "SAMPLES_SUFFIX", "TensorBoardSink", "quiet_writer_thread"]

HISTOGRAM_HEAD = ("min", "max", "num", "sum", "sum_squares")
"""The first values of a histogram row (over the finite values only); the bucket counts follow."""
HISTOGRAM_OP = "histogram"
"""The ``op`` passed to ``tag_of`` for a histogram row."""
SAMPLES_SUFFIX = "-vs-samples"
"""Tag suffix of a named scalar's twin drawn against the samples count."""
TENSORBOARD = "tensorboard"


def _missing_for_monitors(exc: ImportError) -> ConfigError:
    return ConfigError(
        f"format: 'tensorboard' needs the tensorboard package ({exc}); install it with "
        "`pip install tensorboard` (or trainprobe[tensorboard]), or use format 'csv'"
    )


class TensorBoardSink:
    """Records into TensorBoard event files (see the module docstring).

    Args:
        log_dir: folder of the event files.
        ops: monitor or table → op names (value order), looked up with ``table_of``
            (:class:`StepBatch` records only).
        table_of: the table of a row.
        tag_of: the tag of ``(table, key, op)``.
        histogram_tables: tables whose rows are histograms (see the module docstring).
        max_queue: events TensorBoard queues before writing.
        purge_step: for a resumed run, the first step it writes (TensorBoard hides the earlier
            run's events from there on).
        missing: the ConfigError for a missing tensorboard package (default: Monitor V1's
            ``format`` field).
        field: the config field that named ``log_dir`` (see :class:`EventWriter`).

    Raises:
        ConfigError: the tensorboard package is missing (at construction, never in training).
    """

    def __init__(
        self,
        log_dir: Path,
        ops: Mapping[str, tuple[str, ...]] | None = None,
        table_of: Callable[[str, RowKey], str] | None = None,
        tag_of: Callable[[str, RowKey, str], str] | None = None,
        histogram_tables: Collection[str] = (),
        *,
        max_queue: int = 10,
        purge_step: int | None = None,
        missing: Callable[[ImportError], Exception] = _missing_for_monitors,
        field: str = "output_dir",
    ) -> None:
        self._writer = EventWriter(log_dir, max_queue=max_queue, purge_step=purge_step, missing=missing, field=field)
        self.log_dir = log_dir
        self.ops = dict(ops or {})
        self.table_of = table_of
        self.tag_of = tag_of
        self.histogram_tables = frozenset(histogram_tables)

    def write(self, batch: StepBatch | ScalarBatch) -> None:
        if isinstance(batch, ScalarBatch):
            self._write_scalars(batch)
        else:
            self._write_rows(batch)

    def _write_rows(self, batch: StepBatch) -> None:
        assert self.table_of is not None and self.tag_of is not None, "StepBatch records need table_of and tag_of"
        w = self._writer
        values: list[Any] = []
        for key, row in batch.rows():
            table = self.table_of(batch.monitor, key)
            if table in self.histogram_tables:
                histogram = self._histogram(self.tag_of(table, key, HISTOGRAM_OP), row)
                if histogram is not None:
                    values.append(histogram)
                continue
            values.extend(w.scalar(self.tag_of(table, key, op), value) for op, value in zip(self.ops[table], row))
        w.write(batch.step, values)

    def _histogram(self, tag: str, values: Sequence[float]) -> Any:
        head = len(HISTOGRAM_HEAD)
        lo, hi, num, total, squares = values[:head]
        counts = list(values[head:])
        if not num or not counts or not (math.isfinite(lo) and math.isfinite(hi)):
            return None
        if hi > lo:
            width = (hi - lo) / len(counts)
            limits = [lo + width * (i + 1) for i in range(len(counts))]
            limits[-1] = hi
        else:
            limits, counts = [hi], [num]
        return self._writer.histogram(tag, lo, hi, num, total, squares, limits, counts)

    def _write_scalars(self, batch: ScalarBatch) -> None:
        """One event per x value: the step's scalars at ``step``, their ``-vs-samples`` twins at
        ``samples``; text entries one event each at step 0."""
        w = self._writer
        for tag, body in batch.texts:
            w.write(0, [w.text(tag, body)])
        shown = [m for m in batch.scalars if TENSORBOARD in m.formats]
        w.write(batch.step, [w.scalar(m.tag, m.value) for m in shown])
        if batch.samples is not None:
            w.write(batch.samples, [w.scalar(m.tag + SAMPLES_SUFFIX, m.value) for m in shown if m.vs_samples])

    def flush(self) -> None:
        """Push pending events to disk."""
        self._writer.flush()

    def close(self, reached: int | None = None) -> None:
        self._writer.close()
