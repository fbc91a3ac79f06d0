"""CSV output: one file per monitor and window, ``<rank_dir>/<monitor>_step<a>-<b>.csv``.

Each batch is formatted completely in memory and written with a single ``write`` on a file
opened in append mode, so a process killed at any moment leaves whole rows only. A window's
file is named when it is opened from the schedule's prediction of its last step; when training
stops inside a window the file is renamed to the last step actually reached.
"""

from __future__ import annotations

import csv
import io
import os
from dataclasses import dataclass
from pathlib import Path

from trainprobe.records import StepBatch
from trainprobe.schedule import Schedule
from trainprobe.stats.ops import format_value


@dataclass(frozen=True, slots=True)
class TableLayout:
    """Columns of one monitor's CSV: ``vpp_stage, step, module_name, scope[, micro_step], ops...``."""

    with_micro_step: bool
    ops: tuple[str, ...]

    @property
    def header(self) -> list[str]:
        base = ["vpp_stage", "step", "module_name", "scope"]
        return base + (["micro_step"] if self.with_micro_step else []) + list(self.ops)


def file_name(monitor: str, first: int, last: int) -> str:
    """``weight_grad_step0-9.csv`` for ``("weight_grad", 0, 9)``."""
    return f"{monitor}_step{first}-{last}.csv"


@dataclass
class _OpenFile:
    fd: int
    path: Path
    first: int
    last: int


class CsvSink:
    """Writes :class:`StepBatch` objects as CSV rows under ``rank_dir``."""

    def __init__(self, rank_dir: Path, schedule: Schedule, layouts: dict[str, TableLayout]) -> None:
        self.rank_dir = rank_dir
        self.schedule = schedule
        self.layouts = layouts
        self._open: dict[str, _OpenFile] = {}
        self.rows_written: dict[str, int] = {}

    def write(self, batch: StepBatch) -> None:
        """Append the batch's rows to its monitor's current window file (raises OSError)."""
        if not len(batch):
            return
        layout = self.layouts[batch.monitor]
        handle = self._file_for(batch.monitor, batch.step, layout)
        buf = io.StringIO()
        out = csv.writer(buf, lineterminator="\n")
        for key, values in batch.rows():
            head = [key.vpp_stage, batch.step, key.name, key.scope]
            if layout.with_micro_step:
                head.append("" if key.micro_step is None else key.micro_step)
            out.writerow(head + [format_value(op, v) for op, v in zip(layout.ops, values)])
        _write_all(handle.fd, buf.getvalue().encode("utf-8"))
        self.rows_written[batch.monitor] = self.rows_written.get(batch.monitor, 0) + len(batch)

    def _file_for(self, monitor: str, step: int, layout: TableLayout) -> _OpenFile:
        first, last = self.schedule.window(step)
        current = self._open.get(monitor)
        if current is not None and current.first == first:
            return current
        if current is not None:
            self._close_file(monitor, None)
        self.rank_dir.mkdir(parents=True, exist_ok=True)
        path = self.rank_dir / file_name(monitor, first, last)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        _write_all(fd, (",".join(layout.header) + "\n").encode("utf-8"))
        handle = _OpenFile(fd, path, first, last)
        self._open[monitor] = handle
        return handle

    def _close_file(self, monitor: str, reached: int | None) -> None:
        handle = self._open.pop(monitor)
        os.close(handle.fd)
        if reached is not None and reached < handle.last:
            last = max(handle.first, self._last_collected_at_or_before(reached))
            handle.path.rename(handle.path.with_name(file_name(monitor, handle.first, last)))

    def _last_collected_at_or_before(self, step: int) -> int:
        s = self.schedule
        if step < s.start_step:
            return s.start_step
        return s.start_step + ((step - s.start_step) // s.step_interval) * s.step_interval

    def close(self, reached: int | None = None) -> None:
        """Close every file; a window cut short at step ``reached`` is renamed to end there."""
        for monitor in list(self._open):
            self._close_file(monitor, reached)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]
