"""Find and read the CSV output of Monitor V1 and Monitor V2: the one reader every tool shares.

Layouts recognised under ``monitor_path``:

* **Monitor V1**: ``<monitor_path>/<MonDD_HH-MM-SS>-rank<r>-<id>/<table>_<a>-<b>.csv`` with the
  header ``vpp_stage,name,step[,micro_step],<ops>``. ``monitor_path`` may also be one such run
  folder. Run folders are selected by their timestamp (``time_start``/``time_end``, closed range,
  format ``Dec03_21-34-40``).
* **Monitor V2**: ``<output_dir>/rank_<r>/<monitor>_step<a>-<b>.csv`` with the header
  ``vpp_stage,step,module_name,scope[,micro_step],<ops>``. V2 folders carry no timestamp, so a
  time range does not filter them (said once as a warning).

The *data type* of a file is its prefix: the V1 table (``actv``, ``grad_reduced``, ``other`` ...)
or the V2 monitor (``module``, ``weight_grad``, ``optimizer``, ``param``, ``cc``).

Rows of a killed run may end torn (a last line cut short, a wrong number of cells, a value that
is not a number): such rows are skipped and counted in :attr:`CsvTable.torn`, and a warning names
the file once.

Example::

    for file in find_csv_files("monitor_output", data_types=["grad_reduced"]):
        table = read_table(file)
        for record in table.records():
            print(file.rank, record.target, record.step, dict(zip(table.ops, record.values)))
"""

from __future__ import annotations

import csv
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from operator import itemgetter
from pathlib import Path
from typing import Any, Literal

from trainprobe.errors import ConfigError
from trainprobe.log import warn_once
from trainprobe.monitor_v1.output import STAMP_FORMAT, TABLES

Layout = Literal["v1", "v2"]
V1_DATA_TYPES: tuple[str, ...] = TABLES
V2_DATA_TYPES: tuple[str, ...] = ("module", "weight_grad", "optimizer", "param", "cc")
DATA_TYPES: tuple[str, ...] = V1_DATA_TYPES + V2_DATA_TYPES
_V1_RUN = re.compile(r"^(?P<stamp>[A-Z][a-z]{2}\d{2}_\d{2}-\d{2}-\d{2})-rank(?P<rank>\d+)-(?P<id>[^/]+)$")
_V2_RANK = re.compile(r"^rank_(?P<rank>\d+)$")
_V1_FILE = re.compile(r"^(?P<type>[a-z_0-9]+?)_(?P<first>\d+)-(?P<last>\d+)\.csv$")
_V2_FILE = re.compile(r"^(?P<type>[a-z_0-9]+?)_step(?P<first>\d+)-(?P<last>\d+)\.csv$")
_BLOCK_ROWS = 2048  # rows converted at a time
_KEY_COLUMNS: dict[Layout, tuple[str, ...]] = {
    "v1": ("vpp_stage", "name", "step"),
    "v2": ("vpp_stage", "step", "module_name", "scope"),
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
    """

    path: Path
    layout: Layout
    rank: int
    data_type: str
    first_step: int
    last_step: int
    run: str


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
    """The complete rows of one file, as text cells (fast to hand to sqlite or to convert).

    ``header`` is the file's header; ``ops`` the value columns after the key columns;
    ``target_col``, ``step_col``, ``vpp_col``, ``scope_col`` (-1 for V1) and ``micro_col`` (-1
    when absent) index the key cells; ``torn`` counts skipped rows. :meth:`int_column` and
    :meth:`value_columns` give whole columns as numbers (converted once, then cached).
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
    _columns: dict[int, list[Any]] | None = None

    @property
    def value_start(self) -> int:
        """Index of the first value cell."""
        return len(self.header) - len(self.ops)

    def records(self) -> Iterator[Record]:
        """The rows as :class:`Record` with float values (``nan``/``inf`` kept)."""
        start = self.value_start
        for row in self.rows:
            micro = row[self.micro_col] if self.micro_col >= 0 else ""
            yield Record(
                target=row[self.target_col],
                vpp_stage=int(row[self.vpp_col]),
                step=int(row[self.step_col]),
                micro_step=int(micro) if micro else None,
                scope=row[self.scope_col] if self.scope_col >= 0 else None,
                values=tuple(float(cell) for cell in row[start:]),
            )

    def int_column(self, index: int) -> list[int]:
        """The cells of an integer key column (``step_col``, ``vpp_col``) as ints, one per row."""
        return self._column(index, int)

    def value_columns(self) -> list[list[float]]:
        """The values as floats (``nan``/``inf`` kept): one list per op, in :attr:`ops` order,
        each with one float per row. The fast way to hand a whole table to sqlite or numpy."""
        return [self._column(index, float) for index in range(self.value_start, len(self.header))]

    def _column(self, index: int, convert: Any) -> list[Any]:
        if self._columns is None:
            self._columns = {}
        found = self._columns.get(index)
        if found is None:
            found = self._columns[index] = list(map(convert, map(itemgetter(index), self.rows)))
        return found


def parse_time(text: str, field: str) -> datetime:
    """A V1 folder timestamp such as ``Dec03_21-34-40``.

    Raises:
        ConfigError: naming ``field`` when the text does not have that form.
    """
    try:
        return datetime.strptime(text, STAMP_FORMAT)
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
    type and first step.

    Raises:
        ConfigError: the path does not exist or is not a folder; a timestamp is malformed or
            ``time_start`` is after ``time_end``; a data type is unknown; nothing is selected
            (the message says what was looked for).
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
    files = [f for run, layout, rank in _runs(root, lo, hi) for f in _files_of(run, layout, rank)]
    files = [f for f in files if types is None or f.data_type in types]
    if not files:
        wanted = f" of data types {list(types)}" if types else ""
        raise ConfigError(
            f"monitor_path: no monitor CSV{wanted} found under {str(root)!r} (looked for V1 run folders "
            f"'<MonDD_HH-MM-SS>-rank<r>-<id>/' and V2 'rank_<r>/' folders)"
        )
    return sorted(files, key=lambda f: (f.rank, f.data_type, f.first_step, f.run))


def _runs(root: Path, lo: datetime | None, hi: datetime | None) -> Iterator[tuple[Path, Layout, int]]:
    candidates = [root] + sorted(p for p in root.iterdir() if p.is_dir())
    v2_seen = False
    for folder in candidates:
        v1 = _V1_RUN.match(folder.name)
        v2 = _V2_RANK.match(folder.name)
        if v1 and _in_range(parse_time(v1["stamp"], "run folder"), lo, hi):
            yield folder, "v1", int(v1["rank"])
        elif v2:
            v2_seen = True
            yield folder, "v2", int(v2["rank"])
    if v2_seen and (lo is not None or hi is not None):
        warn_once(
            f"v2-time:{root}",
            f"monitor output {str(root)!r}: Monitor V2 folders carry no timestamp; the time range is ignored",
        )


def _in_range(when: datetime, lo: datetime | None, hi: datetime | None) -> bool:
    return (lo is None or lo <= when) and (hi is None or when <= hi)


def _files_of(run: Path, layout: Layout, rank: int) -> Iterator[MonitorCsv]:
    pattern = _V1_FILE if layout == "v1" else _V2_FILE
    known = V1_DATA_TYPES if layout == "v1" else V2_DATA_TYPES
    for path in sorted(run.glob("*.csv")):
        match = pattern.match(path.name)
        if match and match["type"] in known:
            yield MonitorCsv(path, layout, rank, match["type"], int(match["first"]), int(match["last"]), run.name)


def read_table(file: MonitorCsv) -> CsvTable:
    """The complete rows of ``file``; torn rows are skipped, counted and warned about once. An
    empty file (just created by a run that is starting) gives a table with no columns and no rows.

    Raises:
        ConfigError: the header lacks the layout's key columns.
    """
    with open(file.path, newline="", encoding="utf-8") as handle:
        text = handle.read()
    torn_tail = bool(text) and not text.endswith("\n")
    lines = text.splitlines()
    if torn_tail:
        lines.pop()
    rows = _split_rows(lines, text)
    if not rows:
        warn_once(f"empty:{file.path}", f"{file.path}: empty (a run that is starting?), skipped")
        return CsvTable(file, (), (), [], -1, -1, -1, -1, -1, int(torn_tail))
    header = tuple(rows[0])
    keys = _KEY_COLUMNS[file.layout]
    missing = [k for k in keys if k not in header]
    if missing:
        raise ConfigError(f"{file.path}: header {list(header)} lacks {missing}; is this a monitor CSV?")
    micro_col = header.index("micro_step") if "micro_step" in header else -1
    value_start = max(header.index(k) for k in keys) + 1 + (1 if micro_col >= 0 else 0)
    int_cols = (header.index("step"), header.index("vpp_stage"))
    columns = _convert_columns(rows[1:], len(header), value_start, int_cols)
    if columns is None:
        good, torn = _complete_rows(rows[1:], len(header), value_start, int_cols)
    else:
        good, torn = rows[1:], 0
    torn += int(torn_tail)
    if torn:
        warn_once(f"torn:{file.path}", f"{file.path}: skipped {torn} torn row(s) (a run killed while writing?)")
    return CsvTable(
        file=file,
        header=header,
        ops=header[value_start:],
        rows=good,
        target_col=header.index("name" if file.layout == "v1" else "module_name"),
        step_col=header.index("step"),
        vpp_col=header.index("vpp_stage"),
        scope_col=header.index("scope") if file.layout == "v2" else -1,
        micro_col=micro_col,
        torn=torn,
        _columns=columns,
    )


def _split_rows(lines: list[str], text: str) -> list[list[str]]:
    """The cells of each line: ``str.split`` when no cell is quoted (the same cells as the csv
    module's, three times faster), else the csv module."""
    if '"' in text:
        return list(csv.reader(lines))
    return [line.split(",") for line in lines]


def _convert_columns(
    rows: list[list[str]], width: int, value_start: int, int_cols: tuple[int, ...]
) -> dict[int, list[Any]] | None:
    """Fast path of the row check: when every row is complete (the same ``int``/``float`` test
    as :func:`_numeric`, column by column), the integer and value columns converted; else None."""
    if set(map(len, rows)) - {width}:
        return None
    converters = [(col, int) for col in int_cols] + [(col, float) for col in range(value_start, width)]
    columns: dict[int, list[Any]] = {col: [] for col, _ in converters}
    try:
        for first in range(0, len(rows), _BLOCK_ROWS):  # blocks that stay in the CPU cache
            block = rows[first : first + _BLOCK_ROWS]
            for col, convert in converters:
                columns[col] += map(convert, map(itemgetter(col), block))
    except ValueError:
        return None
    return columns


def _complete_rows(
    rows: list[list[str]], width: int, value_start: int, int_cols: tuple[int, ...]
) -> tuple[list[list[str]], int]:
    good: list[list[str]] = []
    torn = 0
    for row in rows:
        if len(row) == width and _numeric(row, value_start, int_cols):
            good.append(row)
        else:
            torn += 1
    return good, torn


def _numeric(row: list[str], value_start: int, int_cols: tuple[int, ...]) -> bool:
    try:
        for col in int_cols:
            int(row[col])
        for cell in row[value_start:]:
            float(cell)
        return True
    except ValueError:
        return False
