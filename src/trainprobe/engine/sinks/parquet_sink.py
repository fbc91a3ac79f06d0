"""Parquet output (``"format": "parquet"``, an extension of the specs, whose default is CSV): one
file per table and window, the CSV layout's names with ``.parquet``
(``rank_0/weight_grad_step0-9.parquet``; V1 ``grad_reduced_0-4.parquet``) and its columns in its
order (:class:`~trainprobe.engine.sinks.csv_sink.TableLayout`): ``vpp_stage``, ``step``,
``micro_step`` int64 (``micro_step`` null where the row has none), names, scope and trailing
text (``shape``, ``dtype``) string, every op float64 (counts too), rounded as the CSV file
would be. The footer carries the file's summary for the query layer
(:mod:`~trainprobe.engine.sinks.parquet_summary`: its first step with a non-finite row, its
columns).

A window's rows are buffered on the writer thread and written into ``.<name>.partial`` in row
groups of up to :data:`ROW_GROUP_ROWS` rows (so memory holds at most one row group per table);
the file gets its name when the window closes: when the first row of a later window arrives, or at
:meth:`ParquetSink.close` (named then from the last step reached, as the CSV sink renames a
window cut short). So every ``*.parquet`` file is complete and readable; a run killed (even by
``kill -9``) loses only its open windows, whose ``.partial`` files no reader picks up.

pyarrow is imported when the first file is opened (the engine imports nothing beyond NumPy at
module level); without it the sink's first write raises ImportError, which the writer reports
once, naming the ``[query]`` extra.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.folders import make_output_folder
from trainprobe.engine.layout import PARQUET_SUFFIX, v2_file_name
from trainprobe.engine.records import RowKey, StepBatch
from trainprobe.engine.schedule import Schedule
from trainprobe.engine.sinks.csv_sink import TableLayout
from trainprobe.engine.sinks.parquet_summary import SUMMARY_KEY, Summary, encode, op_flags, row_is_bad
from trainprobe.engine.stats.ops import COUNT_OPS

ROW_GROUP_ROWS = 1 << 16
"""Rows buffered per table before they are written as one row group."""
_INT_COLUMNS = ("vpp_stage", "step", "micro_step")
_INF = float("inf")
INSTALL_HINT = "Parquet output needs pyarrow: pip install 'trainprobe[query]'"


def require_pyarrow(field_name: str) -> None:
    """Raise a ConfigError naming ``field_name`` when pyarrow (Parquet output) is not installed:
    the config is refused at start, not at the first write."""
    import importlib.util

    if importlib.util.find_spec("pyarrow") is None:
        raise ConfigError(f"{field_name}: 'parquet' needs pyarrow; pip install 'trainprobe[query]', or use 'csv'")


def parquet_file_name(table: str, first: int, last: int) -> str:
    """``weight_grad_step0-9.parquet`` (V2's name with the Parquet suffix)."""
    return v2_file_name(table, first, last, PARQUET_SUFFIX)


@dataclass
class _OpenFile:
    partial: Path
    first: int
    last: int
    layout: TableLayout
    columns: dict[str, list[Any]]
    writer: Any = None
    schema: Any = None
    rows: int = 0
    pending: int = field(default=0)
    first_bad: int | None = None


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401  (loads the submodule)
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    return pyarrow


class ParquetSink:
    """Writes :class:`StepBatch` objects as Parquet under ``rank_dir`` (see the module docstring).

    Args:
        rank_dir: folder of this rank's files.
        schedule: gives each step's window.
        layouts: table name → layout (the CSV sink's: same columns).
        table_of: the table of a row, from its monitor and key (default: the monitor).
        name_file: file name of a table's window, with the ``.parquet`` suffix.
        first_step: the first step this sink can see (as the CSV sink's).
        field: the config field that named the folder: it is created through
            :func:`~trainprobe.engine.folders.make_output_folder` when a file is opened (again
            after it was removed during training), whose ConfigError names ``field``.
    """

    def __init__(
        self,
        rank_dir: Path,
        schedule: Schedule,
        layouts: Mapping[str, TableLayout],
        *,
        table_of: Callable[[str, RowKey], str] | None = None,
        name_file: Callable[[str, int, int], str] = parquet_file_name,
        first_step: int = 0,
        field: str = "output_dir",
    ) -> None:
        self.rank_dir = rank_dir
        self.field = field
        self.schedule = schedule
        self.layouts = dict(layouts)
        self.table_of = table_of
        self.name_file = name_file
        self.first_step = first_step
        self._open: dict[str, _OpenFile] = {}
        self.rows_written: dict[str, int] = {}

    def write(self, batch: StepBatch) -> None:
        """Add the batch's rows to their tables' open windows (raises OSError, ImportError)."""
        if not len(batch):
            return
        values = batch.values()
        by_table: dict[str, list[int]] = {}
        for i, key in enumerate(batch.keys):
            table = self.table_of(batch.monitor, key) if self.table_of is not None else batch.monitor
            by_table.setdefault(table, []).append(i)
        for table, picked in by_table.items():
            handle = self._file_for(table, batch.step)
            self._add(handle, [batch.keys[i] for i in picked], [values[i] for i in picked], batch.step)
        self.rows_written[batch.monitor] = self.rows_written.get(batch.monitor, 0) + len(batch)

    def _add(self, handle: _OpenFile, keys: list[RowKey], values: list[list[float]], step: int) -> None:
        layout = handle.layout
        cols = handle.columns
        ops = layout.ops
        digits = layout.ndigits
        suspect = False  # a NaN, an infinity or a count above 0: the batch may hold a non-finite row
        for key, row in zip(keys, values):
            for column in layout.key_columns:
                cols[column].append(self._key(layout, column, key, step))
            if layout.with_micro_step:
                cols["micro_step"].append(key.micro_step)
            for op, value in zip(ops, row):
                v = float(value)
                if v == v and abs(v) != _INF:
                    if op in COUNT_OPS:
                        if v > 0:
                            suspect = True
                    elif digits is not None:
                        v = round(v, digits)
                else:
                    suspect = True
                cols[op].append(v)
            if layout.trailing:
                found = layout.describe(key) if layout.describe is not None else ()
                for i, name in enumerate(layout.trailing):
                    cols[name].append(found[i] if i < len(found) else "")
        if suspect and (handle.first_bad is None or step < handle.first_bad) and _has_bad_row(layout, keys, values):
            handle.first_bad = step
        handle.pending += len(keys)
        if handle.pending >= ROW_GROUP_ROWS:
            self._flush(handle)

    @staticmethod
    def _key(layout: TableLayout, column: str, key: RowKey, step: int) -> Any:
        if column == "vpp_stage":
            return key.vpp_stage
        if column == "step":
            return step
        if column in ("module_name", "name"):
            return layout.name_of(key.name) if layout.name_of is not None else key.name
        return key.scope

    def _file_for(self, table: str, step: int) -> _OpenFile:
        first, last = self.schedule.file_window(step, self.first_step)
        current = self._open.get(table)
        if current is not None and current.first == first:
            return current
        if current is not None:
            self._finish(table, None)
        make_output_folder(self.rank_dir, self.field)  # removed during training: made again, or a fault
        layout = self.layouts[table]
        partial = self.rank_dir / f".{self.name_file(table, first, last)}.partial"
        handle = _OpenFile(partial, first, last, layout, {name: [] for name in layout.header})
        self._open[table] = handle
        return handle

    def _flush(self, handle: _OpenFile) -> None:
        if not handle.pending:
            return
        pa = _pyarrow()
        if handle.schema is None:
            handle.schema = pa.schema([(name, _type(pa, name, handle.layout)) for name in handle.layout.header])
            handle.writer = pa.parquet.ParquetWriter(str(handle.partial), handle.schema)
        try:
            table = pa.table({n: pa.array(v, type=handle.schema.field(n).type) for n, v in handle.columns.items()})
        except (UnicodeEncodeError, pa.ArrowInvalid):  # a name UTF-8 cannot encode: as its escape text, as in CSV
            table = pa.table({n: pa.array(_encodable(v), type=handle.schema.field(n).type) for n, v in handle.columns.items()})
        handle.writer.write_table(table)
        handle.rows += handle.pending
        handle.pending = 0
        for column in handle.columns.values():
            column.clear()

    def _finish(self, table: str, reached: int | None) -> None:
        """Complete the open window of ``table`` and give it its name."""
        handle = self._open.pop(table)
        self._flush(handle)
        if handle.writer is None:
            return
        handle.writer.add_key_value_metadata({SUMMARY_KEY: encode(Summary(handle.first_bad, tuple(handle.layout.header), handle.rows))})
        handle.writer.close()
        last = self.schedule.file_end(handle.first, handle.last, reached)
        os.replace(handle.partial, self.rank_dir / self.name_file(table, handle.first, last))

    def close(self, reached: int | None = None) -> None:
        """Complete every open window; a window cut short at step ``reached`` is named to end there."""
        for table in list(self._open):
            self._finish(table, reached)


def _has_bad_row(layout: TableLayout, keys: list[RowKey], values: list[list[float]]) -> bool:
    """Whether a row of the batch is non-finite by the query layer's rule
    (:func:`~trainprobe.engine.sinks.parquet_summary.row_is_bad`; rounding to ``ndigits`` keeps a
    value finite or not), tested for the whole batch at once with NumPy; only the rows it flags
    are looked at one by one (a reference-style ``dtype`` of ``'nan'`` is never non-finite).
    Called only for a batch :meth:`ParquetSink._add` saw a suspect value in."""
    flags = op_flags(layout.ops)
    table = np.asarray(values, dtype=np.float64) if values else np.empty((0, len(flags)))
    if table.ndim != 2 or table.shape[1] != len(flags):  # ragged rows: one at a time
        candidates: Any = range(len(values))
    else:
        value_ops = [i for i, f in enumerate(flags) if f == 1]
        count_ops = [i for i, f in enumerate(flags) if f == 2]
        mask = np.zeros(len(values), dtype=bool)
        if value_ops:
            mask |= ~np.isfinite(table[:, value_ops]).all(axis=1)
        if count_ops:
            counts = table[:, count_ops]
            mask |= ((counts > 0) | np.isnan(counts)).any(axis=1)
        candidates = np.flatnonzero(mask).tolist()
    dtype_at = layout.trailing.index("dtype") if "dtype" in layout.trailing else -1
    for i in candidates:
        dtype = None
        if dtype_at >= 0 and layout.describe is not None:
            found = layout.describe(keys[i])
            dtype = found[dtype_at] if dtype_at < len(found) else ""
        if row_is_bad(flags, values[i], dtype):
            return True
    return False


def _type(pa: Any, name: str, layout: TableLayout) -> Any:
    if name in _INT_COLUMNS:
        return pa.int64()
    if name in layout.ops:
        return pa.float64()
    return pa.string()


def _encodable(values: list[Any]) -> list[Any]:
    """Text values UTF-8 can encode (a lone surrogate as its backslash escape), others as they are."""
    return [v.encode("utf-8", "backslashreplace").decode("utf-8") if isinstance(v, str) else v for v in values]
