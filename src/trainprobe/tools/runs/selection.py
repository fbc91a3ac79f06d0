"""The data files an offline tool's selection keeps (csv2db, csv2tb, the Python row reader):
selections over the one walk of the run (:func:`trainprobe.tools.runs.files.walk_run`) by V1
timestamp and data type.

* :func:`find_monitor_files`: CSV and Parquet, as the readers read them (a window's ``.parquet``
  preferred to its ``.csv``: :func:`~trainprobe.tools.runs.files.readable`);
* :func:`find_csv_files`: the CSV files only, every one (the Python row reader's input).

V1 run folders are selected by their timestamp (``time_start``/``time_end``, closed range, format
``Dec03_21-34-40``); V2 folders carry no timestamp, so a time range does not filter them (said
once as a warning). Entries named like data files that are not regular files, and links to files
outside the folder, are skipped with one warning each (or named in the error when nothing is left).

Example::

    for f in find_csv_files("monitor_output", data_types=["grad_reduced"]):
        print(f.rank, f.data_type, f.first_step, f.path)
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import datetime
from pathlib import Path

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.layout import V1_RUN
from trainprobe.engine.log import warn_once
from trainprobe.tools.runs.files import NoRunFiles, RunFile, Walk, rank_order, readable, walk_run
from trainprobe.tools.runs.layout import check_data_types, parse_time

FIELD = "monitor_path"


def find_monitor_files(
    monitor_path: str | Path,
    time_start: str | None = None,
    time_end: str | None = None,
    data_types: Sequence[str] | None = None,
) -> list[RunFile]:
    """Every monitor CSV or Parquet file under ``monitor_path`` that the selection keeps, as the
    readers read them (:func:`~trainprobe.tools.runs.files.readable`), ordered by rank, data type
    and first step (:func:`~trainprobe.tools.runs.files.rank_order`). A Parquet file that is a
    link is left out (DuckDB would follow it; a CSV link goes to the Python reader, which checks it).

    Raises:
        NoRunFiles: nothing is selected (the message says what was looked for and what was skipped).
        ConfigError: the path does not exist or is not a folder; a timestamp is malformed or
            ``time_start`` is after ``time_end``; a data type is unknown; a rank or step in a
            folder or file name is above 2**63 - 1.
    """
    return _select(monitor_path, time_start, time_end, data_types, ("csv", "parquet"))


def find_csv_files(
    monitor_path: str | Path,
    time_start: str | None = None,
    time_end: str | None = None,
    data_types: Sequence[str] | None = None,
) -> list[RunFile]:
    """Every monitor CSV under ``monitor_path`` that the selection keeps (a Parquet twin beside
    it does not hide it), ordered by rank, data type and first step.

    Raises:
        NoRunFiles, ConfigError: as :func:`find_monitor_files`.
    """
    return _select(monitor_path, time_start, time_end, data_types, ("csv",))


def _select(
    monitor_path: str | Path,
    time_start: str | None,
    time_end: str | None,
    data_types: Sequence[str] | None,
    formats: Collection[str],
) -> list[RunFile]:
    lo = parse_time(time_start, "time_start") if time_start is not None else None
    hi = parse_time(time_end, "time_end") if time_end is not None else None
    if lo is not None and hi is not None and lo > hi:
        raise ConfigError(f"time_start: {time_start!r} is after time_end {time_end!r}; swap them")
    types = check_data_types(data_types)
    walk = walk_run(monitor_path, FIELD)
    files = [f for f in walk.files if f.format in formats and (types is None or f.table in types)]
    files = [f for f in files if _in_range(f, lo, hi)]
    if "parquet" in formats:
        files = [f for f in readable(files) if f.format == "csv" or not f.path.is_symlink()]
    if not files:
        raise NoRunFiles(_nothing_found(walk, types))
    walk.warn_irregular()
    walk.warn_outside()
    if (lo is not None or hi is not None) and any(f.layout == "v2" for f in files):
        warn_once(
            f"v2-time:{walk.root}",
            f"monitor output {str(walk.root)!r}: Monitor V2 folders carry no timestamp; the time range is ignored",
        )
    return sorted(files, key=rank_order)


def _in_range(f: RunFile, lo: datetime | None, hi: datetime | None) -> bool:
    """Whether ``f``'s V1 run folder's timestamp lies in ``[lo, hi]`` (a V2 file always does)."""
    if lo is None and hi is None:
        return True
    stamp = V1_RUN.fullmatch(f.run)
    if stamp is None:
        return True
    when = parse_time(stamp["stamp"], f"run folder {str(f.path.parent)!r}")
    return (lo is None or lo <= when) and (hi is None or when <= hi)


def _nothing_found(walk: Walk, types: tuple[str, ...] | None) -> str:
    """The message for a selection that kept no file."""
    wanted = f" of data types {list(types)}" if types else ""
    others = ""
    if walk.irregular:
        others += f"; skipped {len(walk.irregular)} entries that are not regular files: {list(walk.irregular[:3])}"
    if walk.outside:
        others += f"; skipped {len(walk.outside)} links to files outside the folder: {list(walk.outside[:3])}"
    return (
        f"{FIELD}: no monitor CSV{wanted} found under {str(walk.root)!r} (looked for V1 run folders "
        f"'<MonDD_HH-MM-SS>-rank<r>-<id>/' and V2 'rank_<r>/' folders{others})"
    )
