"""Find and read the CSV output of Monitor V1 and Monitor V2: the one reader every tool shares.

Layouts recognised under ``monitor_path``:

* **Monitor V1**: ``<monitor_path>/<MonDD_HH-MM-SS>-rank<r>-<id>/<table>_<a>-<b>.csv`` with the
  header ``vpp_stage,name,step[,micro_step],<ops>[,shape,dtype]``. Both V1 writers are read: the
  reference tool's (names without a chunk prefix, ``fc1.input``; trailing ``shape,dtype`` text
  columns) and trainprobe's earlier one (``0:fc1.input``, no ``shape``/``dtype``).
  ``monitor_path`` may also be one such run folder. Run folders are selected by their timestamp
  (``time_start``/``time_end``, closed range, format ``Dec03_21-34-40``).
* **Monitor V2**: ``<output_dir>/rank_<r>/<monitor>_step<a>-<b>.csv`` with the header
  ``vpp_stage,step,module_name,scope[,micro_step],<ops>`` (``\\r\\n`` or ``\\n`` line ends). V2
  folders carry no timestamp, so a time range does not filter them (said once as a warning).

The *data type* of a file is its prefix: the V1 table (``actv``, ``grad_reduced``, ``other`` ...)
or the V2 monitor (``module``, ``weight_grad``, ``optimizer``, ``param``, ``cc``).

Columns: the layout's key columns and ``micro_step`` (integers within 64 bits; an empty
``micro_step`` cell is "none"), the text columns :data:`TEXT_COLUMNS` (kept as text, never
converted), and every other column is an op whose cells are numbers (``nan``/``inf`` kept; an
empty cell reads as NaN). A header naming a column twice is an error.

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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.layout import (
    MICRO_COLUMN,
    V1_FILE,
    V1_KEY_COLUMNS,
    V1_RUN,
    V1_TABLES,
    V2_FILE,
    V2_KEY_COLUMNS,
    V2_MONITORS,
    V2_RANK,
    parse_stamp,
)
from trainprobe.engine.log import warn_once
from trainprobe.engine.safe_files import INT_MAX, INT_MIN, bounded_int, is_inside, is_regular_file, read_text

Layout = Literal["v1", "v2"]
#: V1 tables only the reference tool writes (its MoE router features, forward hooks).
REFERENCE_V1_TABLES: tuple[str, ...] = ("moe_router_weight_hook", "moe_router_logit_hook")
V1_DATA_TYPES: tuple[str, ...] = V1_TABLES + tuple(t for t in REFERENCE_V1_TABLES if t not in V1_TABLES)
V2_DATA_TYPES: tuple[str, ...] = V2_MONITORS
DATA_TYPES: tuple[str, ...] = V1_DATA_TYPES + V2_DATA_TYPES
#: Columns that describe the tensor as text (the reference V1 writer's ``shape,dtype``).
TEXT_COLUMNS: tuple[str, ...] = ("shape", "dtype")
#: Largest CSV file read (bytes).
MAX_CSV_BYTES = 4 << 30
_BLOCK_ROWS = 2048  # rows converted at a time
_KEY_COLUMNS: dict[Layout, tuple[str, ...]] = {
    "v1": V1_KEY_COLUMNS,
    "v2": V2_KEY_COLUMNS,
}


@dataclass(frozen=True)
class MonitorCsv:
    """One CSV file of monitor output.

    Attributes:
        path: the file.
        layout: ``"v1"`` or ``"v2"``.
        rank: the rank that wrote it.
        data_type: the file's prefix (V1 table or V2 monitor name).
        first_step, last_step: the steps named in the file name.
        run: the run folder's name (``Dec03_21-34-40-rank0-1a2b3c4d`` or ``rank_0``).
        root: the monitor output folder it was found in: :func:`read_table` reads the file only
            if it lies inside (no link leading elsewhere); None: no such check.
    """

    path: Path
    layout: Layout
    rank: int
    data_type: str
    first_step: int
    last_step: int
    run: str
    root: Path | None = None


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

    file: MonitorCsv
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


def parse_time(text: str, field: str) -> datetime:
    """A V1 folder timestamp such as ``Dec03_21-34-40`` (``Feb29`` included: stamps carry no
    year and are read as dates of a leap year).

    Raises:
        ConfigError: naming ``field`` when the text does not have that form.
    """
    try:
        return parse_stamp(text)
    except (TypeError, ValueError):
        raise ConfigError(
            f"{field}: {text!r} is not a monitor timestamp; use the run folder's form, e.g. 'Dec03_21-34-40'"
        ) from None


def check_data_types(data_types: Sequence[str] | None, field: str = "data_type_list") -> tuple[str, ...] | None:
    """The selected data types, checked; None selects all.

    Raises:
        ConfigError: an unknown data type (the message lists the known ones).
    """
    if data_types is None:
        return None
    if isinstance(data_types, str) or not isinstance(data_types, Sequence):
        raise ConfigError(f"{field}: expected a list of data types such as ['grad_reduced'], got {data_types!r}")
    unknown = [t for t in data_types if t not in DATA_TYPES]
    if unknown:
        raise ConfigError(f"{field}: unknown data type(s) {unknown}; known: {', '.join(DATA_TYPES)}")
    return tuple(data_types)


def find_csv_files(
    monitor_path: str | Path,
    time_start: str | None = None,
    time_end: str | None = None,
    data_types: Sequence[str] | None = None,
) -> list[MonitorCsv]:
    """Every monitor CSV under ``monitor_path`` that the selection keeps, ordered by rank, data
    type and first step. Entries named like monitor CSVs that are not regular files (a folder, a
    FIFO, a link to a device) are skipped with a warning.

    Raises:
        ConfigError: the path does not exist or is not a folder; a timestamp is malformed or
            ``time_start`` is after ``time_end``; a data type is unknown; a rank or step in a
            folder or file name is above 2**63 - 1; nothing is selected (the message says what
            was looked for).
    """
    root = Path(monitor_path).expanduser()
    if not root.exists():
        raise ConfigError(f"monitor_path: {str(root)!r} does not exist")
    if not root.is_dir():
        raise ConfigError(f"monitor_path: {str(root)!r} is not a folder")
    lo = parse_time(time_start, "time_start") if time_start is not None else None
    hi = parse_time(time_end, "time_end") if time_end is not None else None
    if lo is not None and hi is not None and lo > hi:
        raise ConfigError(f"time_start: {time_start!r} is after time_end {time_end!r}; swap them")
    types = check_data_types(data_types)
    skipped: list[str] = []
    outside: list[str] = []
    files = [
        f for run, layout, rank in _runs(root, lo, hi) for f in _files_of(run, layout, rank, root, skipped, outside)
    ]
    files = [f for f in files if types is None or f.data_type in types]
    if files and skipped:
        warn_once(
            f"irregular:{root}",
            f"{skipped[0]}: not a regular file (a folder, FIFO or device?), skipped"
            + (f", and {len(skipped) - 1} more such entries" if len(skipped) > 1 else ""),
        )
    if files and outside:
        warn_once(
            f"outside:{root}",
            f"{outside[0]}: a link to a file outside {str(root)!r}, skipped (not read)"
            + (f", and {len(outside) - 1} more such links" if len(outside) > 1 else ""),
        )
    if not files:
        wanted = f" of data types {list(types)}" if types else ""
        others = f"; skipped {len(skipped)} entries that are not regular files: {skipped[:3]}" if skipped else ""
        if outside:
            others += f"; skipped {len(outside)} links to files outside the folder: {outside[:3]}"
        raise ConfigError(
            f"monitor_path: no monitor CSV{wanted} found under {str(root)!r} (looked for V1 run folders "
            f"'<MonDD_HH-MM-SS>-rank<r>-<id>/' and V2 'rank_<r>/' folders{others})"
        )
    return sorted(files, key=lambda f: (f.rank, f.data_type, f.first_step, f.run))


def _runs(root: Path, lo: datetime | None, hi: datetime | None) -> Iterator[tuple[Path, Layout, int]]:
    try:
        children = sorted(p for p in root.iterdir() if p.is_dir())
    except OSError as exc:
        raise ConfigError(f"monitor_path: cannot list {str(root)!r}: {exc.strerror or exc}") from None
    v2_seen = False
    for folder in [root, *children]:
        v1 = V1_RUN.fullmatch(folder.name)
        v2 = V2_RANK.fullmatch(folder.name)
        if v1 and _in_range(parse_time(v1["stamp"], f"run folder {str(folder)!r}"), lo, hi):
            yield folder, "v1", bounded_int(v1["rank"], "rank", f"run folder {str(folder)!r}")
        elif v2:
            v2_seen = True
            yield folder, "v2", bounded_int(v2["rank"], "rank", f"rank folder {str(folder)!r}")
    if v2_seen and (lo is not None or hi is not None):
        warn_once(
            f"v2-time:{root}",
            f"monitor output {str(root)!r}: Monitor V2 folders carry no timestamp; the time range is ignored",
        )


def _in_range(when: datetime, lo: datetime | None, hi: datetime | None) -> bool:
    return (lo is None or lo <= when) and (hi is None or when <= hi)


def _files_of(
    run: Path, layout: Layout, rank: int, root: Path, skipped: list[str], outside: list[str]
) -> Iterator[MonitorCsv]:
    """The monitor CSVs of one run folder; entries that are not regular files go to ``skipped``,
    links to files outside ``root`` to ``outside`` (neither is opened)."""
    pattern = V1_FILE if layout == "v1" else V2_FILE
    known = V1_DATA_TYPES if layout == "v1" else V2_DATA_TYPES
    run_inside = is_inside(run, root)  # a plain file of the run folder is inside iff the folder is
    try:
        paths = sorted(run.glob("*.csv"))
    except OSError as exc:
        raise ConfigError(f"{run}: cannot list the folder: {exc.strerror or exc}") from None
    for path in paths:
        match = pattern.fullmatch(path.name)
        if not (match and match["type"] in known):
            continue
        if not is_regular_file(path):
            skipped.append(str(path))
            continue
        if not (run_inside and not path.is_symlink()) and not is_inside(path, root):
            outside.append(str(path))
            continue
        first = bounded_int(match["first"], "first step", str(path))
        last = bounded_int(match["last"], "last step", str(path))
        yield MonitorCsv(path, layout, rank, match["type"], first, last, run.name, root)


# --------------------------------------------------------------------------- reading


def read_table(file: MonitorCsv) -> CsvTable:
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


@dataclass(frozen=True)
class ColumnRoles:
    """What each column of a header is: key columns, micro-step, ops (numbers) and text."""

    target_col: int
    step_col: int
    vpp_col: int
    scope_col: int
    micro_col: int
    op_cols: tuple[int, ...]


def column_roles(header: tuple[str, ...], layout: Layout, where: str) -> ColumnRoles:
    """The roles of the columns of ``header`` for ``layout``.

    Raises:
        ConfigError: a column named twice, without a name or with a control character in its
            name, or a key column missing.
    """
    seen: set[str] = set()
    for name in header:
        if name in seen:
            raise ConfigError(f"{where}: the header names column {name!r} twice; a monitor CSV names each once")
        seen.add(name)
    if "" in seen:
        raise ConfigError(f"{where}: the header has a column without a name (column {header.index('') + 1})")
    odd = next((name for name in header if not name.isprintable()), None)
    if odd is not None:
        raise ConfigError(f"{where}: the header's column {odd!r} holds a control character; not a monitor CSV")
    keys = _KEY_COLUMNS[layout]
    missing = [k for k in keys if k not in seen]
    if missing:
        raise ConfigError(f"{where}: header {list(header)[:12]} lacks {missing}; is this a monitor CSV?")
    special = {*keys, MICRO_COLUMN, *TEXT_COLUMNS}
    return ColumnRoles(
        target_col=header.index("name" if layout == "v1" else "module_name"),
        step_col=header.index("step"),
        vpp_col=header.index("vpp_stage"),
        scope_col=header.index("scope") if layout == "v2" else -1,
        micro_col=header.index(MICRO_COLUMN) if MICRO_COLUMN in seen else -1,
        op_cols=tuple(i for i, name in enumerate(header) if name not in special),
    )


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
