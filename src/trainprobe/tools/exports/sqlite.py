"""csv2db: load the output of Monitor V1 or Monitor V2 (CSV or Parquet) into one SQLite database.

This module is the public API and the command line; the work is done by
:mod:`~trainprobe.tools.runs.selection` (which files), :mod:`~trainprobe.tools.runs.read` (read
them through the query layer's DuckDB scans), :mod:`~trainprobe.tools.exports.sqlite_rows` (rows as
columns, target numbering, the Python reader for odd files) and
:mod:`~trainprobe.tools.exports.sqlite_schema` (the SQLite database).

Python API (the spec's ``CSV2DBConfig``/``csv2db``, also importable from
``trainprobe.core.monitor.csv2db``)::

    from trainprobe.core.monitor.csv2db import CSV2DBConfig, csv2db
    result = csv2db(CSV2DBConfig("~/monitor_output", data_type_list=["grad_reduced"], step_partition=500))
    print(result.db_path, result.rows)

Command line::

    trainprobe csv2db MONITOR_PATH [--time-start T] [--time-end T] [--process-num N]
                      [--data-type TYPE ...] [-o OUTPUT_DIR] [--step-partition N]

Input and selection are those of :func:`trainprobe.tools.runs.selection.find_monitor_files`: V1 run
folders ``<MonDD_HH-MM-SS>-rank<r>-<id>`` whose timestamp lies in ``[time_start, time_end]``
(``None`` = no bound), or a V2 ``output_dir`` with ``rank_<r>/`` folders; every data type,
``other`` (mg_direction, collectives) included; CSV and Parquet files (``"format": "parquet"``
output, ``trainprobe convert``) alike, the Parquet file where a window has both.

Output: ``<output_dirpath>/monitor_metrics.db`` (default folder ``<YYYYmmddHHMMSS>_csv2db`` in the
current folder, local time). Schema (see docs/csv2db.md for example queries):

* ``meta(key, value)``: ``schema_version``, ``step_partition``.
* ``data_types(data_type_id, name, layout)``: the V1 table or V2 monitor name, ``v1``/``v2``.
* ``targets(target_id, name, vpp_stage, micro_step, scope, call_index)``: one row per distinct
  target; ``micro_step`` NULL where the table has none, ``scope`` NULL for V1 (the data type says
  it); ``call_index`` 0 for the first row of that key in a step, 1 for the second... (a module
  called twice in a step, or micro-batches in a table without a ``micro_step`` column).
* ``metrics(metric_id, name)``: the ops (CSV value columns), ids from 0.
* ``partitions(table_name, first_step, last_step)``: the value tables.
* ``metrics_<a>_<b>`` (WITHOUT ROWID): the values of steps ``a`` to ``b``
  (``b - a + 1 = step_partition``), one row per ``(rank, data_type_id, step, target_id)`` (the
  primary key) with one REAL column per op and ``nan_mask``; index ``metrics_<a>_<b>_by_target``
  on ``(target_id, step)``.
* ``metric_values``: a view, the union of all value tables.
* ``files(path, ...)``: the files imported, with their size and mtime when read.

NaN: SQLite has no NaN (it stores NULL), so a NaN value is NULL in its op column and bit
``metric_id`` of ``nan_mask`` is set; ``nan_mask != 0`` finds every row with a NaN. ``inf`` and
``-inf`` are kept as REAL infinities. An op the file does not have is NULL with its bit clear.

Re-running into the same folder is idempotent: files unchanged since they were imported (same
size and mtime) are skipped, changed ones are read again and their rows replace the stored ones
(``INSERT OR REPLACE`` on the primary key), so no row is ever stored twice. No row read is lost:
rows that repeat a key inside a file get their own ``call_index``, and :meth:`MetricsDatabase.finish`
checks that the value tables grew by the rows read less the rows that replaced stored ones (a
changed file read again, a restarted run repeating steps); any other difference raises
:class:`RowsLostError`. A run still being
written is converted as far as it is complete (a torn last line is skipped, one warning per
file; see :mod:`trainprobe.tools.runs.rows` for what else the reader accepts and refuses);
converting again later adds the rest. The files are read by DuckDB (every core;
``process_num > 1`` sets its threads to that number) in batches of consecutive files, while this
process, the only writer, stores them; see :mod:`trainprobe.tools.runs.read`.

A killed conversion (``kill -9``, a power cut) damages nothing: a new database is built under
the hidden name ``.monitor_metrics.db.partial`` with no journal and no syncs while loading
(fast), synced and renamed to ``monitor_metrics.db`` when finished, so it appears whole or not
at all (the next conversion starts again). A database that exists already is extended with a
rollback journal (``journal_mode=DELETE``, ``synchronous=NORMAL``): a conversion killed midway
leaves it as its last commit left it, every file stored with all its rows or not at all, and
the next conversion adds the rest. The database is durable when :func:`csv2db` returns.

Every bad input raises :class:`~trainprobe.engine.errors.ConfigError`; the command line prints it on one
line and exits with 2.
"""

from __future__ import annotations

import argparse
import gc
import os
import sqlite3
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Any

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.log import warn_once
from trainprobe.engine.safe_files import INT_MAX
from trainprobe.tools.exports.sqlite_rows import ParsedFile, call_indices, parse_file
from trainprobe.tools.exports.sqlite_schema import DB_NAME, PARTIAL_NAME, MetricsDatabase, RowsLostError, fsync
from trainprobe.tools.runs.files import RunFile
from trainprobe.tools.runs.layout import check_data_types, parse_time
from trainprobe.tools.runs.options import (
    add_engine_argument,
    add_selection_arguments,
    check_engine,
    check_process_num,
    output_folder,
)
from trainprobe.tools.runs.read import parquet_only, read_ahead, read_files, spark_read_files
from trainprobe.tools.runs.selection import find_monitor_files

__all__ = [
    "CSV2DBConfig",
    "CSV2DBResult",
    "MetricsDatabase",
    "ParsedFile",
    "RowsLostError",
    "call_indices",
    "csv2db",
    "parse_file",
]

COMMAND = "csv2db"
DEFAULT_STEP_PARTITION = 500


@dataclass(frozen=True)
class CSV2DBConfig:
    """What :func:`csv2db` converts, checked when constructed.

    Attributes:
        monitor_path: the monitor output (V1 ``MONITOR_OUTPUT_DIR`` or run folder, V2 output_dir).
        time_start, time_end: V1 run folder timestamps such as ``"Dec03_21-34-40"``, a closed
            range; None = no bound. V2 folders carry no timestamp and are always taken.
        process_num: processes parsing the files (>= 1).
        data_type_list: data types (file prefixes: V1 tables such as ``grad_reduced`` or
            ``other``, V2 monitors such as ``weight_grad``); None or empty = all.
        step_partition: steps per value table (>= 1); must match an existing database's.
        output_dirpath: folder of ``monitor_metrics.db``; None = ``<YYYYmmddHHMMSS>_csv2db``.

    Raises:
        ConfigError: naming the field, for a value of the wrong type or out of range, a malformed
            timestamp, ``time_start`` after ``time_end`` or an unknown data type.
    """

    monitor_path: str | PathLike[str]
    time_start: str | None = None
    time_end: str | None = None
    process_num: int = 1
    data_type_list: Sequence[str] | None = None
    step_partition: int = DEFAULT_STEP_PARTITION
    output_dirpath: str | PathLike[str] | None = None

    def __post_init__(self) -> None:
        _check_path(self.monitor_path, "monitor_path")
        _check_time_range(self.time_start, self.time_end)
        check_process_num(self.process_num)
        check_data_types(self.data_type_list)
        partition = self.step_partition
        if isinstance(partition, bool) or not isinstance(partition, int) or partition < 1:
            raise ConfigError(f"step_partition: expected an integer >= 1, got {partition!r}")
        if partition > INT_MAX:
            raise ConfigError(f"step_partition: {partition} is above 2**63-1")
        if self.output_dirpath is not None:
            _check_path(self.output_dirpath, "output_dirpath")


@dataclass(frozen=True)
class CSV2DBResult:
    """What :func:`csv2db` did.

    Attributes:
        db_path: the database written.
        rows: value rows stored by this conversion (one per rank, data type, target and step).
        files: CSV files read.
        unchanged: CSV files skipped because the database holds them as they are.
        torn: torn rows skipped.
        tables: every value table of the database, in step order.
        seconds: wall time of the conversion.
        replaced: rows read that replaced a stored row of the same key (a changed file read
            again, or a restarted run repeating steps); every other row read added a row.
    """

    db_path: Path
    rows: int
    files: int
    unchanged: int
    torn: int
    tables: tuple[str, ...]
    seconds: float
    replaced: int = 0



def csv2db(config: CSV2DBConfig, *, progress: bool = False, engine: str = "duckdb") -> CSV2DBResult:
    """Convert the monitor CSVs that ``config`` selects into ``monitor_metrics.db``.

    ``progress`` shows a progress bar (tqdm) on stderr. ``engine="spark"``: the files (Parquet
    only) are read through Apache Spark (the process's active session, else one in local mode:
    :func:`~trainprobe.tools.runs.read.spark_read_files`), the same rows stored.

    Raises:
        ConfigError: no monitor output selected, or none of the selected files (all read this
            time) holds a complete row; a CSV file the reader refuses (see
            :mod:`trainprobe.tools.runs.rows`); an
            output folder that is a file or holds a ``monitor_metrics.db`` that is not one of
            ours (or was made with another ``step_partition``), a database that cannot be
            written (locked by another program, disk full).
        RowsLostError: the database did not gain every row read (see :meth:`MetricsDatabase.finish`).
    """
    started = time.perf_counter()
    check_engine(engine)
    files = find_monitor_files(
        Path(config.monitor_path).expanduser(), config.time_start, config.time_end, config.data_type_list or None
    )
    db_path = output_folder(config.output_dirpath, COMMAND) / DB_NAME
    fresh = not db_path.exists()
    build = db_path.with_name(PARTIAL_NAME) if fresh else db_path
    if fresh:
        build.unlink(missing_ok=True)  # left by a conversion killed before: start again
    done = False
    try:
        with _gc_paused(), MetricsDatabase(build, config.step_partition, journal=not fresh, name=db_path) as db:
            todo = [f for f in files if not db.holds(f)]
            rows = torn = 0
            with _progress_bar(todo, progress) as advance:
                threads = config.process_num if config.process_num > 1 else None
                for parsed in _read(todo, threads, engine):
                    for message in parsed.warnings:
                        warn_once(message, message)
                    rows += db.add(parsed)
                    torn += parsed.torn
                    advance(parsed.size)
            tables = db.finish()
        done = True
    except sqlite3.OperationalError as exc:  # locked by another program, disk full ...
        raise ConfigError(f"output_dirpath: cannot write {str(db_path)!r}: {exc}") from None
    finally:
        if fresh and not done:
            build.unlink(missing_ok=True)
    if fresh:
        os.replace(build, db_path)  # the database appears whole, or not at all
        fsync(db_path)  # the file and the folder entry that now names it
    if todo and len(todo) == len(files) and rows == 0:
        raise ConfigError(
            f"monitor_path: the {len(files)} selected CSV file(s) under {str(config.monitor_path)!r} hold no "
            f"complete row (empty, or only a torn line: a run that is starting?); nothing converted"
        )
    return CSV2DBResult(
        db_path, rows, len(todo), len(files) - len(todo), torn, tables, time.perf_counter() - started, db.replaced
    )


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``csv2db`` on ``subparsers`` (an ``add_subparsers()`` result)."""
    parser = subparsers.add_parser(
        COMMAND,
        help="load monitor CSV output (V1 or V2) into a SQLite database",
        description="Load monitor CSV output into <OUTPUT_DIR>/monitor_metrics.db: targets, metrics (ops) and "
        "the values in tables of --step-partition steps. Re-running adds what is new.",
    )
    add_selection_arguments(parser)
    parser.add_argument(
        "--step-partition",
        dest="step_partition",
        type=int,
        default=DEFAULT_STEP_PARTITION,
        metavar="N",
        help=f"steps per value table (default {DEFAULT_STEP_PARTITION})",
    )
    add_engine_argument(parser)
    parser.set_defaults(handler=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Convert as the parsed arguments say and print a one-line summary; returns 0.

    Raises:
        ConfigError: bad arguments or input.
    """
    config = CSV2DBConfig(
        monitor_path=args.run,
        time_start=args.time_start,
        time_end=args.time_end,
        process_num=args.process_num,
        data_type_list=args.data_type_list,
        step_partition=args.step_partition,
        output_dirpath=args.output_dirpath,
    )
    result = csv2db(config, progress=sys.stderr.isatty(), engine=args.engine)
    print(summary(result))
    return 0


def _read(files: Sequence[RunFile], threads: int | None, engine: str) -> Iterator[ParsedFile]:
    """The rows of ``files``, read ahead in a thread (DuckDB), or through Spark."""
    if engine == "duckdb":
        yield from read_ahead(read_files(files, threads))
        return
    from trainprobe.tools.engines.spark import local_session

    parquet_only(files)  # before Spark starts
    with local_session() as session:
        yield from spark_read_files(session, files)


def summary(result: CSV2DBResult) -> str:
    """One line: rows, files, tables, seconds and the database."""
    extra = "".join(
        [
            f", {result.unchanged} unchanged file(s) skipped" if result.unchanged else "",
            f", {result.torn} torn row(s) skipped" if result.torn else "",
            f", {result.replaced} row(s) replaced stored rows of the same key" if result.replaced else "",
        ]
    )
    return (
        f"csv2db: {result.rows} rows from {result.files} file(s) into {len(result.tables)} table(s) "
        f"in {result.seconds:.1f} s{extra} -> {result.db_path}"
    )


# -- helpers ----------------------------------------------------------------------------------


def _check_path(value: object, field: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (str, PathLike)) or not str(value):
        raise ConfigError(f"{field}: expected a path (a non-empty str or os.PathLike), got {value!r}")


def _check_time_range(time_start: object, time_end: object) -> None:
    stamps = {}
    for field, value in (("time_start", time_start), ("time_end", time_end)):
        if value is None:
            continue
        if not isinstance(value, str):
            raise ConfigError(f"{field}: expected a timestamp such as 'Dec03_21-34-40' or None, got {value!r}")
        stamps[field] = parse_time(value, field)
    if len(stamps) == 2 and stamps["time_start"] > stamps["time_end"]:
        raise ConfigError(f"time_start: {time_start!r} is after time_end {time_end!r}; swap them")



@contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic garbage collection while millions of short-lived lists come and go."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextmanager
def _progress_bar(files: Sequence[RunFile], show: bool) -> Iterator[Callable[[int], None]]:
    """A function to call with each file's size; with ``show``, a tqdm bar on stderr, made at the
    first call (after the worker processes are forked: tqdm runs a thread)."""
    bars: list[Any] = []

    def advance(size: int) -> None:
        if not bars:
            from tqdm import tqdm

            total = sum(f.path.stat().st_size for f in files)
            bars.append(tqdm(total=total, unit="B", unit_scale=True, desc=COMMAND, file=sys.stderr, leave=False))
        bars[0].update(size)

    try:
        yield advance if show and _has_tqdm() else (lambda size: None)
    finally:
        for bar in bars:
            bar.close()


def _has_tqdm() -> bool:
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return False
    return True
