"""The monitor files an offline tool's selection keeps (csv2db, csv2tb): CSV and Parquet.

:func:`find_monitor_files` is :func:`trainprobe.tools.runs.layout.find_csv_files` (same
selection by V1 timestamp and data type, same checks and messages) plus the Parquet files of
the same folders (``"format": "parquet"`` output, or ``trainprobe convert``), found as the query
layer finds them (:func:`trainprobe.tools.runs.files.find_run_files`). Where a window has both a
``.csv`` and a ``.parquet`` file, the Parquet file is taken (as the query layer does).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.layout import V1_RUN
from trainprobe.tools.runs.files import find_run_files
from trainprobe.tools.runs.layout import MonitorCsv, check_data_types, find_csv_files, parse_time


def find_monitor_files(
    monitor_path: str | Path,
    time_start: str | None = None,
    time_end: str | None = None,
    data_types: Sequence[str] | None = None,
) -> list[MonitorCsv]:
    """Every monitor CSV or Parquet file under ``monitor_path`` that the selection keeps, ordered
    by rank, data type and first step (:class:`MonitorCsv` whatever the format).

    Raises:
        ConfigError: as :func:`~trainprobe.tools.runs.layout.find_csv_files`; "no monitor
            CSV found" only when there is no Parquet file either.
    """
    root = Path(monitor_path).expanduser()
    try:
        csvs = find_csv_files(root, time_start, time_end, data_types)
        missing: ConfigError | None = None
    except ConfigError as exc:
        if "no monitor CSV" not in str(exc):
            raise
        csvs, missing = [], exc
    parquet = _parquet_files(root, time_start, time_end, check_data_types(data_types))
    if missing is not None and not parquet:
        raise missing
    converted = {f.path.with_suffix("") for f in parquet}
    files = [f for f in csvs if f.path.absolute().with_suffix("") not in converted] + parquet
    return sorted(files, key=lambda f: (f.rank, f.data_type, f.first_step, f.run))


def _parquet_files(
    root: Path, time_start: str | None, time_end: str | None, types: tuple[str, ...] | None
) -> list[MonitorCsv]:
    try:
        found = find_run_files(root, warn_links=False)  # find_csv_files warned already
    except ConfigError:
        return []
    lo = parse_time(time_start, "time_start") if time_start is not None else None
    hi = parse_time(time_end, "time_end") if time_end is not None else None
    out = []
    for f in found:
        if f.format != "parquet" or (types is not None and f.table not in types) or f.path.is_symlink():
            continue
        folder = f.path.parent
        stamp = V1_RUN.fullmatch(folder.name)
        if stamp is not None:
            when = parse_time(stamp["stamp"], f"run folder {str(folder)!r}")
            if (lo is not None and when < lo) or (hi is not None and when > hi):
                continue
        out.append(MonitorCsv(f.path, f.layout, f.rank, f.table, f.first_step, f.last_step, folder.name, root))
    return out
