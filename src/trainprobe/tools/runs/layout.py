"""Monitor output as the offline tools see it: the layouts, data types and header roles, and the
selection of CSV files by V1 timestamp and data type (standard library only; no file is read).

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

The query layer (:mod:`trainprobe.tools.query.layer`) reads these files (and their Parquet twins);
:mod:`trainprobe.tools.runs.selection` selects CSV and Parquet files for csv2db and csv2tb.

Example::

    for file in find_csv_files("monitor_output", data_types=["grad_reduced"]):
        print(file.rank, file.data_type, file.first_step, file.path)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Literal

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
from trainprobe.engine.safe_files import bounded_int, is_inside, is_regular_file

Layout = Literal["v1", "v2"]
#: V1 tables only the reference tool writes (its MoE router features, forward hooks).
REFERENCE_V1_TABLES: tuple[str, ...] = ("moe_router_weight_hook", "moe_router_logit_hook")
V1_DATA_TYPES: tuple[str, ...] = V1_TABLES + tuple(t for t in REFERENCE_V1_TABLES if t not in V1_TABLES)
V2_DATA_TYPES: tuple[str, ...] = V2_MONITORS
DATA_TYPES: tuple[str, ...] = V1_DATA_TYPES + V2_DATA_TYPES
#: Columns that describe the tensor as text (the reference V1 writer's ``shape,dtype``).
TEXT_COLUMNS: tuple[str, ...] = ("shape", "dtype")
KEY_COLUMNS: dict[Layout, tuple[str, ...]] = {
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
    keys = KEY_COLUMNS[layout]
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
