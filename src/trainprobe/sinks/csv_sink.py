"""CSV output: one file per table and window.

By default a table is a monitor and its file is ``<rank_dir>/<monitor>_step<a>-<b>.csv`` (Monitor
V2). A dialect may route one monitor's rows into several tables (``table_of``, e.g. by scope),
name the files its own way (``file_name``) and choose the key columns and the rounding of each
table (:class:`TableLayout`).

Each batch is formatted completely in memory and written with a single ``write`` per table on a
file opened in append mode, so a process killed at any moment leaves whole rows only. A window's
file is named when it is opened from the schedule's prediction of its last step; when training
stops inside a window the file is renamed to the last step actually reached. With ``append`` an
existing file is continued (no second header) instead of being truncated.
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from trainprobe.records import RowKey, StepBatch
from trainprobe.schedule import Schedule
from trainprobe.stats.ops import format_value

V2_KEY_COLUMNS: tuple[str, ...] = ("vpp_stage", "step", "module_name", "scope")


@dataclass(frozen=True, slots=True)
class TableLayout:
    """Columns of one table: ``key_columns`` (``micro_step`` appended when ``with_micro_step``),
    then the ops; values rounded to ``ndigits`` decimals when it is set.

    Key columns understood: ``vpp_stage``, ``step``, ``module_name``/``name`` (the row's name),
    ``scope``.
    """

    with_micro_step: bool
    ops: tuple[str, ...]
    key_columns: tuple[str, ...] = V2_KEY_COLUMNS
    ndigits: int | None = None

    @property
    def header(self) -> list[str]:
        return list(self.key_columns) + (["micro_step"] if self.with_micro_step else []) + list(self.ops)

    def cells(self, key: RowKey, step: int, values: list[float]) -> list[object]:
        """One CSV row for ``key`` at ``step``."""
        head: list[object] = []
        for column in self.key_columns:
            if column == "vpp_stage":
                head.append(key.vpp_stage)
            elif column == "step":
                head.append(step)
            elif column in ("module_name", "name"):
                head.append(key.name)
            else:
                head.append(key.scope)
        if self.with_micro_step:
            head.append("" if key.micro_step is None else key.micro_step)
        return head + [format_value(op, v, self.ndigits) for op, v in zip(self.ops, values)]


def file_name(monitor: str, first: int, last: int) -> str:
    """``weight_grad_step0-9.csv`` for ``("weight_grad", 0, 9)``."""
    return f"{monitor}_step{first}-{last}.csv"


def _by_monitor(monitor: str, key: RowKey) -> str:
    return monitor


@dataclass
class _OpenFile:
    fd: int
    path: Path
    first: int
    last: int


class CsvSink:
    """Writes :class:`StepBatch` objects as CSV rows under ``rank_dir``.

    Args:
        rank_dir: folder of this rank's files.
        schedule: gives each step's window (first and last step of a file).
        layouts: table name → layout.
        table_of: the table of a row, from its monitor and key (default: the monitor).
        name_file: file name of a table's window (default: :func:`file_name`).
        append: continue existing files instead of truncating them.
    """

    def __init__(
        self,
        rank_dir: Path,
        schedule: Schedule,
        layouts: Mapping[str, TableLayout],
        *,
        table_of: Callable[[str, RowKey], str] = _by_monitor,
        name_file: Callable[[str, int, int], str] = file_name,
        append: bool = False,
    ) -> None:
        self.rank_dir = rank_dir
        self.schedule = schedule
        self.layouts = dict(layouts)
        self.table_of = table_of
        self.name_file = name_file
        self.append = append
        self._open: dict[str, _OpenFile] = {}
        self.rows_written: dict[str, int] = {}

    def write(self, batch: StepBatch) -> None:
        """Append the batch's rows to their tables' current window files (raises OSError)."""
        if not len(batch):
            return
        buffers: dict[str, io.StringIO] = {}
        writers: dict[str, object] = {}
        for key, values in batch.rows():
            table = self.table_of(batch.monitor, key)
            out = writers.get(table)
            if out is None:
                buffers[table] = io.StringIO()
                out = writers[table] = csv.writer(buffers[table], lineterminator="\n")
            out.writerow(self.layouts[table].cells(key, batch.step, values))  # type: ignore[attr-defined]
        for table, buf in buffers.items():
            handle = self._file_for(table, batch.step, self.layouts[table])
            _write_all(handle.fd, buf.getvalue().encode("utf-8"))
        self.rows_written[batch.monitor] = self.rows_written.get(batch.monitor, 0) + len(batch)

    def _file_for(self, table: str, step: int, layout: TableLayout) -> _OpenFile:
        first, last = self.schedule.window(step)
        current = self._open.get(table)
        if current is not None and current.first == first:
            return current
        if current is not None:
            self._close_file(table, None)
        self.rank_dir.mkdir(parents=True, exist_ok=True)
        path = self.rank_dir / self.name_file(table, first, last)
        continuing = self.append and path.is_file() and path.stat().st_size > 0
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if continuing else os.O_TRUNC)
        fd = os.open(path, flags, 0o644)
        if not continuing:
            _write_all(fd, (",".join(layout.header) + "\n").encode("utf-8"))
        handle = _OpenFile(fd, path, first, last)
        self._open[table] = handle
        return handle

    def _close_file(self, table: str, reached: int | None) -> None:
        handle = self._open.pop(table)
        os.close(handle.fd)
        if reached is not None and reached < handle.last:
            last = max(handle.first, self._last_collected_at_or_before(reached))
            handle.path.rename(handle.path.with_name(self.name_file(table, handle.first, last)))

    def _last_collected_at_or_before(self, step: int) -> int:
        s = self.schedule
        if step < s.start_step:
            return s.start_step
        return s.start_step + ((step - s.start_step) // s.step_interval) * s.step_interval

    def close(self, reached: int | None = None) -> None:
        """Close every file; a window cut short at step ``reached`` is renamed to end there."""
        for table in list(self._open):
            self._close_file(table, reached)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]
