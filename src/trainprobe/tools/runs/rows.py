"""The Python row reader of monitor CSV files, kept only for what the one batched reader
(:mod:`trainprobe.tools.runs.read`, DuckDB) cannot read as csv2db and csv2tb need it
(:func:`trainprobe.tools.exports.sqlite_rows.parse_file`):

* a CSV file whose last record is torn (a run killed or still writing): DuckDB would refuse the
  file or read the torn record; this reader leaves it out, counts it and warns once;
* an empty CSV file, or one torn inside its header (a run that is starting);
* a file that is a link (checked to stay inside the run when opened: DuckDB would follow it), or
  one above :data:`MAX_CSV_BYTES`;
* every batch DuckDB refuses (a cell that is not a number, a row with the wrong number of cells,
  text that is not UTF-8): read again here, file by file, for the precise one-line error naming
  the file, the row and the column.

Every other file, and every tool other than csv2db and csv2tb, reads through DuckDB. The
layouts, data types, file selection and header roles are :mod:`trainprobe.tools.runs.layout`'s
and :mod:`trainprobe.tools.runs.selection`'s (their names are importable from here as before).

Reading (:func:`read_table`):
* files are read through :func:`trainprobe.engine.safe_files.read_text`: regular files only (a folder,
  FIFO or device named ``*.csv`` is skipped when found and refused when read), inside the folder
  given (a link to a file elsewhere is skipped when found and refused when read), at most
  :data:`MAX_CSV_BYTES`, UTF-8 with an optional byte-order mark;
* records are split by the csv module's rules, so a quoted name holding a line break, U+2028,
  U+0085 or a form feed reads back exactly;
* only the **last record of a file, when the file does not end with a line break**, is torn (a
  run killed or still writing): it is skipped, counted in :attr:`CsvTable.torn` and warned about
  once. Any other row that cannot be read (wrong number of cells, a value that is not a number,
  a step above 2**63) is an error naming the file, the row and the column: such a file was not
  written by a monitor.

Every problem is a :class:`~trainprobe.engine.errors.ConfigError` whose one-line message names the file.

Example::

    for file in find_csv_files("monitor_output", data_types=["grad_reduced"]):
        table = read_table(file)
        for record in table.records():
            print(file.rank, record.target, record.step, dict(zip(table.ops, record.values)))
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.log import warn_once
from trainprobe.engine.safe_files import INT_MAX, INT_MIN, bounded_int, read_text
from trainprobe.tools.runs.files import RunFile
from trainprobe.tools.runs.layout import (
    DATA_TYPES,
    KEY_COLUMNS,
    REFERENCE_V1_TABLES,
    TEXT_COLUMNS,
    V1_DATA_TYPES,
    V2_DATA_TYPES,
    ColumnRoles,
    Layout,
    check_data_types,
    column_roles,
    parse_time,
)
from trainprobe.tools.runs.selection import find_csv_files

__all__ = [
    "DATA_TYPES",
    "KEY_COLUMNS",
    "MAX_CSV_BYTES",
    "REFERENCE_V1_TABLES",
    "TEXT_COLUMNS",
    "V1_DATA_TYPES",
    "V2_DATA_TYPES",
    "ColumnRoles",
    "CsvTable",
    "Layout",
    "RunFile",
    "Record",
    "check_data_types",
    "column_roles",
    "convert_columns",
    "find_csv_files",
    "parse_time",
    "read_table",
    "split_records",
]

#: Largest CSV file read (bytes).
MAX_CSV_BYTES = 4 << 30
_BLOCK_ROWS = 2048  # rows converted at a time


@dataclass(frozen=True)
class Record:
    """One row: ``values`` follow :attr:`CsvTable.ops`; ``scope`` is None for V1 rows (the data
    type says it), ``micro_step`` None where the table has no such column or the cell is empty."""

    target: str
    vpp_stage: int
    step: int
    micro_step: int | None
    scope: str | None
    values: tuple[float, ...]


@dataclass
class CsvTable:
    """The complete rows of one file, checked and converted.

    ``header`` is the file's header; ``ops`` the op (number) columns in header order and
    ``op_cols`` their indices; ``target_col``, ``step_col``, ``vpp_col``, ``scope_col`` (-1 for
    V1) and ``micro_col`` (-1 when absent) index the key cells of ``rows`` (the text cells);
    ``torn`` counts the skipped torn last record (0 or 1). :meth:`int_column`,
    :meth:`micro_column` and :meth:`value_columns` give whole columns as numbers (converted and
    checked when the file was read).
    """

    file: RunFile
    header: tuple[str, ...]
    ops: tuple[str, ...]
    rows: list[list[str]]
    target_col: int
    step_col: int
    vpp_col: int
    scope_col: int
    micro_col: int
    torn: int
    op_cols: tuple[int, ...] = ()
    _columns: dict[int, list[Any]] = field(default_factory=dict, repr=False)

    def records(self) -> Iterator[Record]:
        """The rows as :class:`Record` with float values (``nan``/``inf`` kept)."""
        steps, vpps, micros = self.int_column(self.step_col), self.int_column(self.vpp_col), self.micro_column()
        values = self.value_columns()
        for index, row in enumerate(self.rows):
            yield Record(
                target=row[self.target_col],
                vpp_stage=vpps[index],
                step=steps[index],
                micro_step=micros[index],
                scope=row[self.scope_col] if self.scope_col >= 0 else None,
                values=tuple(column[index] for column in values),
            )

    def int_column(self, index: int) -> list[int]:
        """The cells of an integer key column (``step_col``, ``vpp_col``) as ints, one per row."""
        return self._columns[index] if self.rows else []

    def micro_column(self) -> list[int | None]:
        """The micro-step of each row: an int, or None without the column or for an empty cell."""
        if self.micro_col < 0 or not self.rows:
            return [None] * len(self.rows)
        return self._columns[self.micro_col]

    def text_column(self, name: str) -> list[str] | None:
        """The cells of a text column such as ``shape`` or ``dtype`` as written (``nan`` where the
        reference tool had no tensor), one per row; None when the file has no such column."""
        if name not in self.header:
            return None
        index = self.header.index(name)
        return [row[index] for row in self.rows]

    def value_columns(self) -> list[list[float]]:
        """The values as floats (``nan``/``inf`` kept): one list per op, in :attr:`ops` order,
        each with one float per row. The fast way to hand a whole table to sqlite or numpy."""
        return [self._columns[index] if self.rows else [] for index in self.op_cols]


def read_table(file: RunFile) -> CsvTable:
    """The complete rows of ``file``, checked and converted (see the module docstring). A torn
    last record is skipped, counted and warned about once. An empty file (just created by a run
    that is starting) or one holding only a torn header gives a table with no columns and no
    rows (warned about once).

    Raises:
        ConfigError: ``<file>: ...``: not a regular file, too large, not UTF-8, not CSV; the
            header lacks the layout's key columns or names a column twice; a row (other than a
            torn last one) has the wrong number of cells, a key that is not a 64-bit integer
            or a value that is not a number.
    """
    where = str(file.path)
    records, torn = split_records(read_text(file.path, max_bytes=MAX_CSV_BYTES, within=file.root), where)
    if torn:
        warn_once(f"torn:{file.path}", f"{file.path}: skipped 1 torn row(s) (a run killed while writing?)")
    if not records:  # empty, or a header cut short: a run that is starting (or was killed then)
        if not torn:
            warn_once(f"empty:{file.path}", f"{file.path}: empty (a run that is starting?), skipped")
        return CsvTable(file, (), (), [], -1, -1, -1, -1, -1, int(torn))
    header = tuple(records[0])
    roles = column_roles(header, file.layout, where)
    rows = records[1:]
    columns = convert_columns(rows, header, roles, where)
    return CsvTable(
        file=file,
        header=header,
        ops=tuple(header[i] for i in roles.op_cols),
        rows=rows,
        target_col=roles.target_col,
        step_col=roles.step_col,
        vpp_col=roles.vpp_col,
        scope_col=roles.scope_col,
        micro_col=roles.micro_col,
        torn=int(torn),
        op_cols=roles.op_cols,
        _columns=columns,
    )


def split_records(text: str, where: str) -> tuple[list[list[str]], bool]:
    """The records of CSV ``text`` by the csv module's rules (blank lines dropped) and whether
    the last one was torn (the text does not end with a line break, or ends inside a quoted
    cell) and so left out.

    Raises:
        ConfigError: ``<where>: row N is not CSV (...)`` for malformed quoting elsewhere.
    """
    if not text:
        return [], False
    ends_clean = text.endswith(("\n", "\r"))
    if '"' not in text and "\r" not in text:  # no quoting: exactly the csv module's records, 3x faster
        lines = text.split("\n")
        lines.pop()  # the empty string after the last "\n", or the torn last line
        return [line.split(",") for line in lines if line], not ends_clean
    records: list[list[str]] = []
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    try:
        records.extend(reader)
    except csv.Error as exc:
        if "unexpected end of data" not in str(exc):
            raise ConfigError(f"{where}: line {reader.line_num} is not CSV ({exc})") from None
        return [r for r in records if r], True  # the torn record (open quote at the end) is not in
    if not ends_clean:
        records.pop()
    return [r for r in records if r], not ends_clean


def convert_columns(
    rows: list[list[str]], header: tuple[str, ...], roles: ColumnRoles, where: str
) -> dict[int, list[Any]]:
    """The step, vpp_stage, micro_step and op columns of ``rows`` converted (column index →
    values), every row checked.

    Raises:
        ConfigError: naming the row (1 = the first after the header), the column and the cell.
    """
    width = len(header)
    for index, row in enumerate(rows):
        if len(row) != width:
            raise ConfigError(
                f"{where}: row {index + 1} has {len(row)} cells, the header {width}; "
                "not a monitor CSV (only a file's last line may be torn)"
            )
    converters: list[tuple[int, Callable[[list[str], int, str], list[Any]]]] = [
        (roles.step_col, _int_cells),
        (roles.vpp_col, _int_cells),
    ]
    if roles.micro_col >= 0:
        converters.append((roles.micro_col, _micro_cells))
    converters += [(col, _float_cells) for col in roles.op_cols]
    columns: dict[int, list[Any]] = {col: [] for col, _ in converters}
    for first in range(0, len(rows), _BLOCK_ROWS):  # blocks that stay in the CPU cache
        block = rows[first : first + _BLOCK_ROWS]
        for col, convert in converters:
            cells = [row[col] for row in block]
            try:
                columns[col] += convert(cells, col, header[col])
            except (ValueError, OverflowError):
                raise _cell_error(cells, first, header[col], convert, where) from None
    return columns


def _int_cells(cells: list[str], col: int, name: str) -> list[int]:
    values = list(map(int, cells))
    if values and (min(values) < INT_MIN or max(values) > INT_MAX):
        raise OverflowError(name)
    return values


def _micro_cells(cells: list[str], col: int, name: str) -> list[int | None]:
    if all(cells):
        return list(_int_cells(cells, col, name))
    return [None if not cell.strip() else _int_cells([cell], col, name)[0] for cell in cells]


def _float_cells(cells: list[str], col: int, name: str) -> list[float]:
    try:
        return list(map(float, cells))
    except ValueError:
        return [math.nan if not cell.strip() else float(cell) for cell in cells]


def _cell_error(
    cells: list[str], first: int, column: str, convert: Callable[[list[str], int, str], list[Any]], where: str
) -> ConfigError:
    """The error for the first cell of ``cells`` that ``convert`` refuses."""
    for offset, cell in enumerate(cells):
        try:
            convert([cell], 0, column)
        except (ValueError, OverflowError):
            row = f"{where}: row {first + offset + 1}, column {column!r}"
            if convert is _float_cells:
                shown = cell if len(cell) <= 40 else cell[:40] + "..."
                return ConfigError(f"{row}: {shown!r} is not a number")
            try:
                bounded_int(cell.strip(), "value", row)
            except ConfigError as exc:
                return exc
            return ConfigError(f"{row}: {cell!r} is not an integer")
    return ConfigError(f"{where}: column {column!r} could not be read")
