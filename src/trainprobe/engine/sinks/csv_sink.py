"""CSV output: one file per table and window.

By default a table is a monitor and its file is ``<rank_dir>/<monitor>_step<a>-<b>.csv`` (Monitor
V2). A dialect may route one monitor's rows into several tables (``table_of``, e.g. by scope),
name the files its own way (``file_name``) and choose the key columns and the rounding of each
table (:class:`TableLayout`).

Each batch is formatted completely in memory and written with a single ``write`` per table on a
file opened in append mode, so a process killed at any moment leaves whole rows only. A window's
file is opened (and its folder checked, made again when removed) on the training thread, by
:meth:`CsvSink.prepare`, when the step that starts the window hands its rows over, so a folder
removed or replaced after a step never has that step's file opened later behind the training
loop's back; it is named by its whole window (``step_count_per_record`` steps), as the
reference names it, also when training or collection ends inside the window (steps 0-4 trained
with 2 steps a window: ``*_4-5.csv`` holds step 4). With ``append`` an existing file is
continued (no second header) instead of being truncated.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from itertools import chain, repeat
from pathlib import Path
from types import MappingProxyType

from trainprobe.engine.folders import make_output_folder
from trainprobe.engine.layout import V2_KEY_COLUMNS, v2_file_name
from trainprobe.engine.records import RowKey, StepBatch
from trainprobe.engine.schedule import Schedule
from trainprobe.engine.sinks.files import append_whole
from trainprobe.engine.stats.ops import COUNT_OPS, format_value

_NO_CHANGES: Mapping[RowKey, tuple[str, ...]] = MappingProxyType({})
"""No trailing cell differs (see :attr:`TableLayout.changed`)."""

_UNENCODABLE = "backslashreplace"
"""A name UTF-8 cannot encode (a lone surrogate such as ``"\\udc80"``) is written as that escape
text instead of failing the whole batch."""


@dataclass(frozen=True, slots=True)
class TableLayout:
    """Columns of one table: ``key_columns`` (``micro_step`` appended when ``with_micro_step``),
    then the ops; values rounded to ``ndigits`` decimals when it is set.

    Key columns understood: ``vpp_stage``, ``step``, ``module_name``/``name`` (the row's name,
    written as ``name_of(key.name)`` when ``name_of`` is set), ``scope``.

    ``trailing`` columns follow the ops; their cells are ``describe(key)`` (one text per trailing
    column), asked once per row key (the line template of a key is made once), except at a step
    where ``changed(step)`` gives other cells for the key (Monitor V1's ``shape,dtype`` of an
    activation whose shape changes from call to call: the cells of the call the row summarises).
    ``changed`` is asked once per table and batch, from the writer thread, in step order; it
    gives an empty mapping where nothing differs (the common case: the cached templates serve).
    """

    with_micro_step: bool
    ops: tuple[str, ...]
    key_columns: tuple[str, ...] = V2_KEY_COLUMNS
    ndigits: int | None = None
    name_of: Callable[[str], str] | None = None
    trailing: tuple[str, ...] = ()
    describe: Callable[[RowKey], tuple[str, ...]] | None = None
    changed: Callable[[int], Mapping[RowKey, tuple[str, ...]]] | None = None

    @property
    def header(self) -> list[str]:
        micro = ["micro_step"] if self.with_micro_step else []
        return list(self.key_columns) + micro + list(self.ops) + list(self.trailing)

    def cells(self, key: RowKey, step: int, values: list[float]) -> list[object]:
        """One CSV row for ``key`` at ``step``, as cells."""
        return (
            [self._key_value(column, key, step) for column in self._key_order()]
            + [format_value(op, v, self.ndigits) for op, v in zip(self.ops, values)]
            + list(self.trailing_cells(key, self.changes(step)))
        )

    def changes(self, step: int) -> Mapping[RowKey, tuple[str, ...]]:
        """The trailing cells that differ at ``step`` from ``describe`` (see the class doc)."""
        if self.changed is None or not self.trailing:
            return _NO_CHANGES
        return self.changed(step)

    def trailing_cells(self, key: RowKey, changed: Mapping[RowKey, tuple[str, ...]] = _NO_CHANGES) -> tuple[str, ...]:
        """The trailing cells of ``key``: ``changed``'s for it, else ``describe``'s."""
        found = changed.get(key) if changed else None
        if found is None:
            return self._trailing_cells(key)
        return tuple(found[i] if i < len(found) else "" for i in range(len(self.trailing)))

    def text(
        self,
        rows: Iterable[tuple[RowKey, list[float]]],
        step: int,
        changed: Mapping[RowKey, tuple[str, ...]] = _NO_CHANGES,
    ) -> str:
        """CSV text of ``rows`` at ``step``, one line each, every line ending in ``\\n``.

        Each line is what ``csv.writer`` (default dialect, ``QUOTE_MINIMAL``) writes for
        :meth:`cells`, ending in ``\\n`` instead of ``\\r\\n``: a cell is quoted, its quotes
        doubled, exactly when it holds a comma, a quote, ``\\r`` or ``\\n``, so
        ``csv.reader`` on the file (opened with ``newline=""``) gives every name back exactly,
        whatever it holds (other line separators such as U+2028, U+0085 or form feed are not
        quoted, as by ``csv.writer``: a reader must not split lines on them). Made about 4x
        faster because it runs on the writer thread, which shares the CPU with training: each
        key gets a ``%``-template of its whole line
        once (step as ``%d``, values as ``%r`` after ``round(v, ndigits)`` when ``ndigits`` is
        set, counts as ``%d``), filled with one operation per row of plain floats. A key in
        ``changed`` (:meth:`changes` of the step) is written row by row with its cells there.
        """
        templates = _LINE_TEMPLATES.setdefault(self, {})
        if len(templates) > _MAX_TEMPLATES:
            templates.clear()
        with_step = "step" in self.key_columns
        digits = self.ndigits
        counts = [op in COUNT_OPS for op in self.ops]
        lines = []
        for key, values in rows:
            line = None
            if changed and key in changed:
                lines.append(self._slow_line(key, step, values, changed[key]))
                continue
            if set(map(type, values)) == _FLOAT_ONLY:  # plain floats (not NumPy scalars, ints)
                if digits is not None:  # format_value's rounding; counts are printed as integers
                    values = [v if c else round(v, digits) for v, c in zip(values, counts)]
                template = templates.get(key)
                if template is None:
                    template = templates[key] = self._line_template(key)
                try:
                    line = template % ((step, *values) if with_step else tuple(values))
                except (ValueError, TypeError):  # a NaN count (no integer to print), a short row
                    line = None
            if line is None:
                line = self._slow_line(key, step, values)
            lines.append(line)
        return "".join(lines)

    def batch_template(self, keys: list[RowKey]) -> tuple[list[str], int] | None:
        """The line templates of ``keys`` joined and split where the step goes, with the number
        of values per row; None when a key's text holds the split marker (NUL)."""
        templates = _MARKED_TEMPLATES.setdefault(self, {})
        if len(templates) > _MAX_TEMPLATES:
            templates.clear()
        lines = []
        for key in keys:
            template = templates.get(key)
            if template is None:
                template = templates[key] = self._line_template(key, _STEP_MARK)
            lines.append(template)
        text = "".join(lines)
        if text.count(_STEP_MARK) != (len(keys) if "step" in self.key_columns else 0):
            return None
        return text.split(_STEP_MARK), len(self.ops)

    def fill_batch(self, parts: tuple[list[str], int], values: list[list[float]], step: int) -> str | None:
        """The text of a batch from :meth:`batch_template`'s ``parts``, or None when a row is not
        ``len(ops)`` plain floats or a count is NaN (then :meth:`text` writes it row by row)."""
        pieces, width = parts
        if set(map(len, values)) != {width}:
            return None
        flat = list(chain.from_iterable(values))
        if set(map(type, flat)) != _FLOAT_ONLY:
            return None
        if self.ndigits is not None:  # counts are whole numbers: rounding leaves them as they are
            flat = list(map(round, flat, repeat(self.ndigits, len(flat))))
        template = str(step).join(pieces) if len(pieces) > 1 else pieces[0]
        try:
            return template % tuple(flat)
        except (ValueError, TypeError, OverflowError):  # a NaN or infinite count
            return None

    def _key_order(self) -> tuple[str, ...]:
        return self.key_columns + (("micro_step",) if self.with_micro_step else ())

    def _line_template(self, key: RowKey, step_cell: str = "%d") -> str:
        head = [step_cell if c == "step" else self._key_cell(c, key, 0).replace("%", "%%") for c in self._key_order()]
        tail = "".join("," + _csv_text(t).replace("%", "%%") for t in self._trailing_cells(key))
        return ",".join(head) + "," + _value_template(self.ops) + tail + "\n"

    def _slow_line(
        self, key: RowKey, step: int, values: list[float], trailing: tuple[str, ...] | None = None
    ) -> str:
        head = [self._key_cell(column, key, step) for column in self._key_order()]
        tail = [_csv_text(format_value(op, v, self.ndigits)) for op, v in zip(self.ops, values)]
        cells = self.trailing_cells(key, {key: trailing} if trailing is not None else _NO_CHANGES)
        return ",".join(head + tail + [_csv_text(t) for t in cells]) + "\n"

    def _trailing_cells(self, key: RowKey) -> tuple[str, ...]:
        if not self.trailing:
            return ()
        found = self.describe(key) if self.describe is not None else ()
        return tuple(found[i] if i < len(found) else "" for i in range(len(self.trailing)))

    def _key_value(self, column: str, key: RowKey, step: int) -> object:
        if column in ("module_name", "name") and self.name_of is not None:
            return self.name_of(key.name)
        return _key_value(column, key, step)

    def _key_cell(self, column: str, key: RowKey, step: int) -> str:
        value = self._key_value(column, key, step)
        return _csv_text(value) if isinstance(value, str) else str(value)


_STEP_MARK = "\x00"
"""Where the step goes in a batch template (a line whose text holds it gets none)."""


_LINE_TEMPLATES: dict[TableLayout, dict[RowKey, str]] = {}
"""Per layout, the line template of each key seen (see :meth:`TableLayout.text`)."""
_MARKED_TEMPLATES: dict[TableLayout, dict[RowKey, str]] = {}
"""Per layout, the line template of each key with :data:`_STEP_MARK` where the step goes."""
_MAX_TEMPLATES = 1 << 17
_FLOAT_ONLY = {float}


@functools.lru_cache(maxsize=64)
def _value_template(ops: tuple[str, ...]) -> str:
    """``"%r,%r,%d"`` for ``("min", "max", "nans")``: what :func:`format_value` writes for floats."""
    return ",".join("%d" if op in COUNT_OPS else "%r" for op in ops)


def _key_value(column: str, key: RowKey, step: int) -> object:
    if column == "vpp_stage":
        return key.vpp_stage
    if column == "step":
        return step
    if column in ("module_name", "name"):
        return key.name
    if column == "micro_step":
        return "" if key.micro_step is None else key.micro_step
    return key.scope


@functools.lru_cache(maxsize=1 << 16)
def _csv_text(text: str) -> str:
    """``text`` as one CSV cell: quoted, with quotes doubled, only when it needs it."""
    if any(c in text for c in ',"\r\n'):
        return '"' + text.replace('"', '""') + '"'
    return text


file_name = v2_file_name
"""``weight_grad_step0-9.csv`` for ``("weight_grad", 0, 9)`` (see :mod:`trainprobe.engine.layout`)."""


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
        first_step: the first step this sink can see (a session started inside a window, such as
            Monitor V1's after a ``reload_xy`` or an ``ops`` change): its first file is named from
            there, not from the window's first step, so it never shares a name range with the
            file of the session before it.
        field: the config field that named the folder: it is created through
            :func:`~trainprobe.engine.folders.make_output_folder` when a file is opened (again
            after it was removed during training), whose ConfigError names ``field`` (also when
            the folder is replaced by a file between that check and the open).
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
        first_step: int = 0,
        field: str = "output_dir",
    ) -> None:
        self.rank_dir = rank_dir
        self.field = field
        self.first_step = first_step
        self.schedule = schedule
        self.layouts = dict(layouts)
        self.table_of = table_of
        self.name_file = name_file
        self.append = append
        self._open: dict[tuple[str, int], _OpenFile] = {}  # (table, window's first step) → its file
        self._lock = threading.Lock()  # _open is shared by prepare() (training) and write() (writer thread)
        self._prepared: dict[str, int] = {}  # monitor → first step of the window prepare() last opened
        self._broken: dict[str, tuple[int, BaseException]] = {}  # table → window whose file failed to open, why
        self._writing: dict[str, int] = {}  # table → first step of the window write() last wrote
        self._routes: dict[str, tuple[list[RowKey], list[tuple[str, list[int] | None]]]] = {}
        self._batch_templates: dict[str, tuple[list[RowKey], tuple[list[str], int] | None]] = {}
        self.rows_written: dict[str, int] = {}

    def write(self, batch: StepBatch) -> None:
        """Append the batch's rows to their tables' current window files (writer thread; raises
        OSError, or the ConfigError of a window's file :meth:`prepare` could not open)."""
        if not len(batch):
            return
        keys, values = batch.keys, batch.values()
        for table, picked in self._tables_of(batch.monitor, keys):
            layout = self.layouts[table]
            if picked is None:
                text = self._batch_text(table, layout, keys, values, batch.step)
            else:
                sub_keys = [keys[i] for i in picked]
                text = self._batch_text(table, layout, sub_keys, [values[i] for i in picked], batch.step)
            handle = self._file_for(table, batch.step)
            append_whole(handle.fd, text.encode("utf-8", _UNENCODABLE))
        self.rows_written[batch.monitor] = self.rows_written.get(batch.monitor, 0) + len(batch)

    def _tables_of(self, monitor: str, keys: list[RowKey]) -> list[tuple[str, list[int] | None]]:
        """The tables of a batch's rows, each with the indices of its rows (None: every row), in
        the order of their first rows; remembered for the monitor's last key list (a probe
        produces the same keys, the same objects, step after step)."""
        cached = self._routes.get(monitor)
        if cached is not None and cached[0] == keys:
            return cached[1]
        table_of = self.table_of
        by_table: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            by_table.setdefault(table_of(monitor, key), []).append(i)
        routes: list[tuple[str, list[int] | None]] = [
            (table, None if len(picked) == len(keys) else picked) for table, picked in by_table.items()
        ]
        self._routes[monitor] = (list(keys), routes)
        return routes

    def _batch_text(
        self, table: str, layout: TableLayout, keys: list[RowKey], values: list[list[float]], step: int
    ) -> str:
        """:meth:`TableLayout.text` of the rows, with one ``%`` operation for the whole batch when
        the table's keys are those of its last batch and every value is a plain float (the
        template of the batch's lines is remembered per table; the step is joined in). Rows
        whose trailing cells differ at this step (:meth:`TableLayout.changes`) go line by line."""
        changed = layout.changes(step)
        if changed and not changed.keys().isdisjoint(keys):
            return layout.text(zip(keys, values), step, changed)
        cached = self._batch_templates.get(table)
        if cached is None or cached[0] != keys:
            cached = self._batch_templates[table] = (list(keys), layout.batch_template(keys))
        parts = cached[1]
        if parts is not None:
            text = layout.fill_batch(parts, values, step)
            if text is not None:
                return text
        return layout.text(zip(keys, values), step)

    def prepare(self, batch: StepBatch) -> None:
        """Open the files of the window ``batch`` starts, on the caller's (the training) thread,
        before the batch is queued for the writer thread: a window's folder is checked (made
        again when it was removed) and its file opened at the step that starts the window, in
        the training loop's order, never later on the writer thread. So code that removes or
        replaces the folder after a step finds no file of that step's window still to be opened,
        and a window started after that sees the folder as the user left it. Never raises: a
        file that cannot be opened (a ConfigError naming ``field``, an OSError) is remembered and
        raised by :meth:`write` of the same window's batch, in the order of the batches, so the
        rows of the windows before it are still written. A table first seen in the middle of a
        window has its file opened by :meth:`write`."""
        if not len(batch):
            return
        first, last = self.schedule.file_window(batch.step, self.first_step)
        if self._prepared.get(batch.monitor) == first:
            return
        self._prepared[batch.monitor] = first
        for table, _ in self._tables_of(batch.monitor, batch.keys):
            with self._lock:
                if (table, first) in self._open or table in self._broken:
                    continue
                try:
                    self._open[(table, first)] = self._open_file(table, first, last)
                except Exception as exc:  # noqa: BLE001 - raised by write(), in the order of the batches
                    self._broken[table] = (first, exc)

    def _file_for(self, table: str, step: int) -> _OpenFile:
        """The open file of ``table``'s window holding ``step`` (opened here when
        :meth:`prepare` did not); the table's file of the window written before is closed (its
        batches are all written: batches come in step order). Writer thread only."""
        first, last = self.schedule.file_window(step, self.first_step)
        with self._lock:
            before = self._writing.get(table)
            if before is not None and before != first and (table, before) in self._open:
                self._close_file((table, before))
            self._writing[table] = first
            handle = self._open.get((table, first))
            if handle is not None:
                return handle
            broken = self._broken.get(table)
            if broken is not None and broken[0] <= first:
                raise broken[1]
            handle = self._open[(table, first)] = self._open_file(table, first, last)
            return handle

    def _open_file(self, table: str, first: int, last: int) -> _OpenFile:
        """Open ``table``'s file of window ``first``-``last``, its header written unless an
        existing file is continued (``append``). When the open fails, the folder is made (again,
        when it was removed during training) and the open tried once more: the folder's fault
        is then the ConfigError of :func:`~trainprobe.engine.folders.make_output_folder`, naming
        ``field`` (a folder replaced by a file: ``File exists``)."""
        path = self.rank_dir / self.name_file(table, first, last)
        continuing = self.append and path.is_file() and path.stat().st_size > 0
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if continuing else os.O_TRUNC)
        try:
            fd = os.open(path, flags, 0o644)
        except OSError:  # no folder (first file, or removed), a file in its place, not writable
            make_output_folder(self.rank_dir, self.field)  # made again, or the folder's ConfigError
            fd = os.open(path, flags, 0o644)
        if not continuing:
            try:
                append_whole(fd, (",".join(self.layouts[table].header) + "\n").encode("utf-8"))
            except BaseException:
                os.close(fd)
                raise
        return _OpenFile(fd, path, first, last)

    def _close_file(self, key: tuple[str, int]) -> None:
        handle = self._open.pop(key)
        os.close(handle.fd)

    def close(self, reached: int | None = None) -> None:
        """Close every file. Each keeps the name of its whole window, wherever training stopped
        (``reached``, the last step trained, changes no name: the reference's cut)."""
        with self._lock:
            for key in list(self._open):
                self._close_file(key)
