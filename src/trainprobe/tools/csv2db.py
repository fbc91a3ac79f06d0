"""csv2db: load the CSV output of Monitor V1 or Monitor V2 into one SQLite database.

Python API (the spec's ``CSV2DBConfig``/``csv2db``, also importable from
``trainprobe.core.monitor.csv2db``)::

    from trainprobe.core.monitor.csv2db import CSV2DBConfig, csv2db
    result = csv2db(CSV2DBConfig("~/monitor_output", data_type_list=["grad_reduced"], step_partition=500))
    print(result.db_path, result.rows)

Command line::

    trainprobe csv2db MONITOR_PATH [--time-start T] [--time-end T] [--process-num N]
                      [--data-type TYPE ...] [-o OUTPUT_DIR] [--step-partition N]

Input and selection are those of :func:`trainprobe.tools.monitor_output.find_csv_files`: V1 run
folders ``<MonDD_HH-MM-SS>-rank<r>-<id>`` whose timestamp lies in ``[time_start, time_end]``
(``None`` = no bound), or a V2 ``output_dir`` with ``rank_<r>/`` folders; every data type,
``other`` (mg_direction, collectives) included.

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
* ``files(path, ...)``: the CSV files imported, with their size and mtime when read.

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
file; see :mod:`trainprobe.tools.monitor_output` for what else the reader accepts and refuses);
converting again later adds the rest. ``process_num > 1`` parses the files in that many worker
processes (forked on Linux, so no fresh import of trainprobe; spawned elsewhere, where scripts
need the ``if __name__ == "__main__":`` guard) while this process, the only writer, stores them.

The bulk load runs with ``journal_mode=OFF`` and ``synchronous=OFF``: a conversion killed
midway may leave a damaged database; delete it and convert again.

Every bad input raises :class:`~trainprobe.engine.errors.ConfigError`; the command line prints it on one
line and exits with 2.
"""

from __future__ import annotations

import argparse
import gc
import math
import multiprocessing
import sqlite3
import sys
import time
from array import array
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from itertools import chain, compress, repeat
from os import PathLike
from pathlib import Path
from typing import Any

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.log import warn_once
from trainprobe.engine.safe_files import INT_MAX
from trainprobe.tools.monitor_output import (
    MonitorCsv,
    check_data_types,
    find_csv_files,
    parse_time,
    read_table,
)
from trainprobe.tools.options import add_selection_arguments, check_process_num, output_folder, worker_warnings

COMMAND = "csv2db"
DB_NAME = "monitor_metrics.db"
SCHEMA_VERSION = "2"
#: Older schema versions opened and upgraded in place (version 1 had no ``targets.call_index``).
UPGRADABLE_VERSIONS = ("1",)
DEFAULT_STEP_PARTITION = 500
#: Primary key of every value table, in storage order.
KEY_COLUMNS: tuple[str, ...] = ("rank", "data_type_id", "step", "target_id")
NAN_MASK = "nan_mask"
VIEW = "metric_values"
#: Rows stored per transaction.
BATCH_ROWS = 500_000
#: CSV bytes per task handed to a worker process (small files travel together).
TASK_BYTES = 4 << 20
#: Rows per INSERT statement (fewer where SQLite allows fewer ``?``).
ROWS_PER_INSERT = 100
#: Ops whose metric_id is at least this have no nan_mask bit (SQLite integers are 64-bit).
NAN_BITS = 63

_TargetKey = tuple[str, int, "int | None", "str | None", int]  # (name, vpp_stage, micro_step, scope, call_index)


class RowsLostError(RuntimeError):
    """The database did not gain the rows that were read (a bug in csv2db): never hidden."""


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


@dataclass(frozen=True)
class ParsedFile:
    """One CSV file read into columns, ready for the writer (what a worker process returns).

    ``targets`` holds the file's distinct target keys (with the call index, see
    :func:`call_indices`) in first-seen order and ``target_index`` one index into it per row; ``steps`` one step per row; ``values`` one list per op (one float
    per row); ``nan_masks`` has bit ``i`` set where op ``i`` of the file is NaN, or is None when
    the file holds no NaN. Pickled compactly (the columns as arrays) for the trip from a worker.
    """

    file: MonitorCsv
    size: int
    mtime_ns: int
    ops: tuple[str, ...]
    targets: list[_TargetKey]
    target_index: list[int]
    steps: list[int]
    values: list[list[float]]
    nan_masks: list[int] | None
    torn: int
    warnings: tuple[str, ...] = ()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        packed = (
            array("q", self.target_index),
            array("q", self.steps),
            [array("d", column) for column in self.values],
            None if self.nan_masks is None else array("q", self.nan_masks),
        )
        head = (self.file, self.size, self.mtime_ns, self.ops, self.targets)
        return _unpack_parsed, (head, packed, self.torn, self.warnings)


def _unpack_parsed(head: tuple[Any, ...], packed: tuple[Any, ...], torn: int, warnings: tuple[str, ...]) -> ParsedFile:
    target_index, steps, values, masks = packed
    file, size, mtime_ns, ops, targets = head
    return ParsedFile(
        file,
        size,
        mtime_ns,
        ops,
        targets,
        target_index.tolist(),
        steps.tolist(),
        [column.tolist() for column in values],
        None if masks is None else masks.tolist(),
        torn,
        warnings,
    )


def csv2db(config: CSV2DBConfig, *, progress: bool = False) -> CSV2DBResult:
    """Convert the monitor CSVs that ``config`` selects into ``monitor_metrics.db``.

    ``progress`` shows a progress bar (tqdm) on stderr.

    Raises:
        ConfigError: no monitor output selected, or none of the selected files (all read this
            time) holds a complete row; a CSV file the reader refuses (see
            :mod:`trainprobe.tools.monitor_output`); an
            output folder that is a file or holds a ``monitor_metrics.db`` that is not one of
            ours (or was made with another ``step_partition``), a database that cannot be
            written (locked by another program, disk full).
        RowsLostError: the database did not gain every row read (see :meth:`MetricsDatabase.finish`).
    """
    started = time.perf_counter()
    files = find_csv_files(
        Path(config.monitor_path).expanduser(), config.time_start, config.time_end, config.data_type_list or None
    )
    db_path = output_folder(config.output_dirpath, COMMAND) / DB_NAME
    try:
        with _gc_paused(), MetricsDatabase(db_path, config.step_partition) as db:
            todo = [f for f in files if not db.holds(f)]
            rows = torn = 0
            with _progress_bar(todo, progress) as advance:
                for parsed in parse_files(todo, config.process_num):
                    for message in parsed.warnings:
                        warn_once(message, message)
                    rows += db.add(parsed)
                    torn += parsed.torn
                    advance(parsed.size)
            tables = db.finish()
    except sqlite3.OperationalError as exc:  # locked by another program, disk full ...
        raise ConfigError(f"output_dirpath: cannot write {str(db_path)!r}: {exc}") from None
    if todo and len(todo) == len(files) and rows == 0:
        raise ConfigError(
            f"monitor_path: the {len(files)} selected CSV file(s) under {str(config.monitor_path)!r} hold no "
            f"complete row (empty, or only a torn line: a run that is starting?); nothing converted"
        )
    return CSV2DBResult(
        db_path, rows, len(todo), len(files) - len(todo), torn, tables, time.perf_counter() - started, db.replaced
    )


def parse_file(file: MonitorCsv) -> ParsedFile:
    """Read ``file`` (complete rows only; an empty file gives no rows) into columns; see
    :class:`ParsedFile`.

    Raises:
        ConfigError: the header is not a monitor header.
    """
    stat = file.path.stat()
    table = read_table(file)
    rows = table.rows
    names = [row[table.target_col] for row in rows]
    scopes = [row[table.scope_col] or None for row in rows] if table.scope_col >= 0 else repeat(None)
    values = table.value_columns()
    steps = table.int_column(table.step_col)
    vpps, micros = table.int_column(table.vpp_col), table.micro_column()
    keys = list(zip(names, vpps, micros, scopes, repeat(0)))
    targets = list(dict.fromkeys(keys))
    position = {key: index for index, key in enumerate(targets)}
    index = list(map(position.__getitem__, keys))
    if _repeats(steps, index, len(targets)):  # a key repeats within a step: number the calls
        calls = call_indices(list(zip(steps, index)))
        keys = list(zip(names, vpps, micros, scopes, calls))
        targets = list(dict.fromkeys(keys))
        position = {key: i for i, key in enumerate(targets)}
        index = list(map(position.__getitem__, keys))
    return ParsedFile(
        file=file,
        size=stat.st_size,
        mtime_ns=stat.st_mtime_ns,
        ops=table.ops,
        targets=targets,
        target_index=index,
        steps=steps,
        values=values,
        nan_masks=_nan_masks(values, len(rows)),
        torn=table.torn,
    )


def call_indices(keys: Sequence[Hashable]) -> list[int]:
    """Per row, how many earlier rows of the same file had the same key (step and target):
    0 for a target's first row in a step, 1 for its second, ...: the ``call_index`` that keeps
    the rows of a module called twice in a step (or of micro-batches in a table without a
    ``micro_step`` column) apart. Rows are numbered in file order, the order they were written."""
    seen: dict[Hashable, int] = {}
    out = []
    for key in keys:
        count = seen.get(key, 0)
        seen[key] = count + 1
        out.append(count)
    return out


def _repeats(steps: list[int], index: list[int], distinct: int) -> bool:
    """Whether some ``(step, index)`` pair occurs twice. Fast path (C-level list compares) for
    the usual file: blocks of ``distinct`` rows holding every target once in the same order, one
    step per block, no step in two blocks; anything else takes a set of the pairs."""
    count = len(index)
    if distinct and count % distinct == 0 and index == list(range(distinct)) * (count // distinct):
        firsts = steps[0::distinct]
        blocks = chain.from_iterable(map(repeat, firsts, repeat(distinct, len(firsts))))
        if len(set(firsts)) == len(firsts) and steps == list(blocks):
            return False
    return len(set(zip(steps, index))) < count


def parse_files(files: Sequence[MonitorCsv], process_num: int = 1) -> Iterator[ParsedFile]:
    """:func:`parse_file` of each file, in order; with ``process_num > 1`` parsed ahead in that
    many worker processes, handed out in batches of about :data:`TASK_BYTES` of CSV (at most
    two batches per worker waiting to be taken)."""
    batches = _batches(files, TASK_BYTES)
    workers = min(process_num, len(batches))
    if workers <= 1:
        yield from map(parse_file, files)
        return
    with ProcessPoolExecutor(max_workers=workers, mp_context=_mp_context()) as pool:
        pending: deque[Future[list[ParsedFile]]] = deque()
        try:
            for batch in batches:
                pending.append(pool.submit(_parse_in_worker, batch))
                if len(pending) >= 2 * workers:
                    yield from pending.popleft().result()
            while pending:
                yield from pending.popleft().result()
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise


def _batches(files: Sequence[MonitorCsv], size: int) -> list[list[MonitorCsv]]:
    """Consecutive files grouped until a group holds ``size`` bytes (a bigger file alone)."""
    batches: list[list[MonitorCsv]] = []
    current: list[MonitorCsv] = []
    held = 0
    for file in files:
        current.append(file)
        held += file.path.stat().st_size
        if held >= size:
            batches.append(current)
            current, held = [], 0
    if current:
        batches.append(current)
    return batches


class MetricsDatabase:
    """``monitor_metrics.db`` opened for loading (see the module docstring for the schema).

    Use as a context manager: :meth:`holds` and :meth:`add` per file, then :meth:`finish`.

    Raises:
        ConfigError: the file exists and is not a csv2db database of this schema version, or
            was made with another ``step_partition``.
    """

    def __init__(self, path: Path, step_partition: int) -> None:
        self.path = path
        self.step_partition = step_partition
        self._in_transaction = 0  # rows since BEGIN
        try:
            self.conn = _connect(path)
        except sqlite3.DatabaseError as exc:
            raise ConfigError(f"output_dirpath: cannot open {str(path)!r} as a database ({exc})") from None
        try:
            _set_pragmas(self.conn)
            self._open_schema()
            self._load_ids()
        except (sqlite3.OperationalError, ConfigError):  # locked, ...: said by the caller
            self.conn.close()
            raise
        except sqlite3.DatabaseError as exc:
            self.conn.close()
            raise ConfigError(
                f"output_dirpath: {str(path)!r} is not a csv2db database ({exc}); delete it or choose another folder"
            ) from None
        self._key_ids: dict[_TargetKey, int] = {}
        self._sql: dict[tuple[str, tuple[str, ...], int], str] = {}
        self._max_variables = _max_variables(self.conn)
        self._rows_before = self._count_rows()
        self.added = 0  # rows read and stored by this connection
        self.replaced = 0  # of them, rows that replaced a stored row of the same key

    def __enter__(self) -> MetricsDatabase:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # keep what was stored (there is no journal to roll back); say the first error
            self.close()
        except sqlite3.Error:
            self.conn.close()

    def close(self) -> None:
        """Commit what was added and close the connection. Files stored without :meth:`finish`
        lack their index until the next conversion into this database finishes."""
        if self._in_transaction:
            self._in_transaction = 0
            self.conn.execute("COMMIT")
        self.conn.close()

    def holds(self, file: MonitorCsv) -> bool:
        """Whether the database holds ``file`` as it is now (same size and mtime as when read)."""
        stat = file.path.stat()
        return self._files.get(_file_key(file)) == (stat.st_size, stat.st_mtime_ns)

    def add(self, parsed: ParsedFile) -> int:
        """Store the rows of one parsed file (replacing rows with the same key); returns how many."""
        self._begin()
        file = parsed.file
        count = len(parsed.steps)
        if count:
            data_type_id = self._data_type_id(file.data_type, file.layout)
            metric_ids = [self._metric_id(op, file) for op in parsed.ops]
            target_ids = self._target_ids(parsed)
            masks = _remap_masks(parsed.nan_masks, metric_ids)
            if self._may_overlap(file, data_type_id, parsed.steps):
                self.replaced += self._stored_keys(file.rank, data_type_id, parsed.steps, target_ids)
            for first, rows in self._split(parsed.steps):
                columns: list[list[Any] | None] = [_pick(parsed.steps, rows), _pick(target_ids, rows)]
                columns += [_pick(column, rows) for column in parsed.values]
                columns.append(None if masks is None else _pick(masks, rows))
                flat = _interleave(file.rank, data_type_id, columns)
                self._insert(self._partition(first), parsed.ops, flat)
        self._record_file(parsed, count)
        self.added += count
        self._in_transaction += count + 1
        if self._in_transaction >= BATCH_ROWS:
            self.conn.execute("COMMIT")
            self._in_transaction = 0
        return count

    def finish(self) -> tuple[str, ...]:
        """Check that no row read was lost, commit, index every value table, rebuild the
        ``metric_values`` view and gather the planner's statistics; returns the value tables in
        step order.

        Raises:
            RowsLostError: the value tables do not hold ``rows before + rows added - rows
                replaced`` rows: some row read was dropped (or stored twice). A bug, never hidden.
        """
        if self._in_transaction:
            self.conn.execute("COMMIT")
            self._in_transaction = 0
        stored = self._count_rows()
        expected = self._rows_before + self.added - self.replaced
        if stored != expected:
            raise RowsLostError(
                f"csv2db: {str(self.path)!r} holds {stored} value rows, expected {expected} ({self._rows_before} "
                f"before + {self.added} read - {self.replaced} replacing stored rows of the same key): rows read "
                "were not all stored; please report this bug with the monitor output"
            )
        tables = tuple(name for _, name in sorted((first, name) for name, first in self._partitions.items()))
        self.conn.execute("BEGIN")
        for table in tables:
            self.conn.execute(f"CREATE INDEX IF NOT EXISTS {_q(table + '_by_target')} ON {_q(table)}(target_id, step)")
        self._create_view(tables)
        self.conn.execute("COMMIT")
        self.conn.execute("PRAGMA analysis_limit=1000")
        self.conn.execute("ANALYZE")
        return tables

    # -- schema -------------------------------------------------------------------------------

    def _count_rows(self) -> int:
        """Rows in all value tables (the smallest index is scanned: fast)."""
        return sum(self.conn.execute(f"SELECT count(*) FROM {_q(table)}").fetchone()[0] for table in self._partitions)

    def _may_overlap(self, file: MonitorCsv, data_type_id: int, steps: list[int]) -> bool:
        """Whether a stored row can have a key of ``file``'s rows: a file of the same rank and
        data type (``file`` itself read before included) covers some of its steps (those its name
        says and those its rows hold). Also records ``file``'s range for the files that follow."""
        low, high = min(file.first_step, min(steps)), max(file.last_step, max(steps))
        ranges = self._ranges.setdefault((file.rank, data_type_id), [])
        found = any(first <= high and low <= last for first, last in ranges)
        ranges.append((low, high))
        return found

    def _stored_keys(self, rank: int, data_type_id: int, steps: list[int], target_ids: list[int]) -> int:
        """How many of the keys ``(rank, data_type_id, step, target_id)`` the value tables hold."""
        conn = self.conn
        conn.execute(
            "CREATE TEMP TABLE IF NOT EXISTS incoming (step INTEGER, target_id INTEGER, PRIMARY KEY (step, target_id)) "
            "WITHOUT ROWID"
        )
        conn.execute("DELETE FROM incoming")
        conn.executemany("INSERT OR IGNORE INTO incoming VALUES (?, ?)", zip(steps, target_ids))
        return sum(
            conn.execute(
                f"SELECT count(*) FROM incoming i JOIN {_q(table)} v ON v.rank = ? AND v.data_type_id = ? "
                "AND v.step = i.step AND v.target_id = i.target_id",
                (rank, data_type_id),
            ).fetchone()[0]
            for table in self._partitions
        )

    def _open_schema(self) -> None:
        tables = {row[0] for row in self.conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not tables:
            self._create_schema()
            return
        if "meta" not in tables:
            raise sqlite3.DatabaseError("it has no meta table")
        meta = dict(self.conn.execute("SELECT key, value FROM meta"))
        if meta.get("schema_version") in UPGRADABLE_VERSIONS:
            self._upgrade_schema()
            meta["schema_version"] = SCHEMA_VERSION
        if meta.get("schema_version") != SCHEMA_VERSION:
            raise sqlite3.DatabaseError(f"schema_version {meta.get('schema_version')!r}, expected {SCHEMA_VERSION}")
        if meta.get("step_partition") != str(self.step_partition):
            raise ConfigError(
                f"step_partition: {str(self.path)!r} was made with step_partition {meta.get('step_partition')}, "
                f"not {self.step_partition}; use that or another output folder"
            )

    def _upgrade_schema(self) -> None:
        """Version 1 → 2: ``targets.call_index`` (0 for every stored target) joins the key."""
        self.conn.executescript(
            f"""
            BEGIN;
            ALTER TABLE targets ADD COLUMN call_index INTEGER NOT NULL DEFAULT 0;
            DROP INDEX IF EXISTS targets_key;
            CREATE UNIQUE INDEX targets_key ON targets(
                name, vpp_stage, ifnull(micro_step, -1), ifnull(scope, ''), call_index);
            UPDATE meta SET value = '{SCHEMA_VERSION}' WHERE key = 'schema_version';
            COMMIT;
            """
        )

    def _create_schema(self) -> None:
        self.conn.execute("PRAGMA page_size = 8192")
        self.conn.executescript(
            f"""
            BEGIN;
            CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT) WITHOUT ROWID;
            CREATE TABLE data_types (data_type_id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, layout TEXT);
            CREATE TABLE targets (
                target_id INTEGER PRIMARY KEY, name TEXT NOT NULL, vpp_stage INTEGER NOT NULL,
                micro_step INTEGER, scope TEXT, call_index INTEGER NOT NULL DEFAULT 0);
            CREATE UNIQUE INDEX targets_key ON targets(
                name, vpp_stage, ifnull(micro_step, -1), ifnull(scope, ''), call_index);
            CREATE TABLE metrics (metric_id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE);
            CREATE TABLE partitions (table_name TEXT PRIMARY KEY, first_step INTEGER, last_step INTEGER);
            CREATE TABLE files (
                path TEXT PRIMARY KEY, run TEXT, rank INTEGER, data_type_id INTEGER, first_step INTEGER,
                last_step INTEGER, size INTEGER, mtime_ns INTEGER, rows INTEGER, torn INTEGER);
            INSERT INTO meta VALUES ('schema_version', '{SCHEMA_VERSION}'), ('step_partition', '{self.step_partition}');
            CREATE VIEW {VIEW} AS SELECT NULL AS rank, NULL AS data_type_id, NULL AS step, NULL AS target_id,
                NULL AS {NAN_MASK} WHERE 0;
            COMMIT;
            """
        )

    def _load_ids(self) -> None:
        conn = self.conn
        self._data_types: dict[str, int] = dict(conn.execute("SELECT name, data_type_id FROM data_types"))
        self._metrics: dict[str, int] = dict(conn.execute("SELECT name, metric_id FROM metrics"))
        self._targets: dict[_TargetKey, int] = {
            tuple(row[:5]): row[5]
            for row in conn.execute("SELECT name, vpp_stage, micro_step, scope, call_index, target_id FROM targets")
        }
        self._partitions: dict[str, int] = dict(conn.execute("SELECT table_name, first_step FROM partitions"))
        self._files: dict[str, tuple[int, int]] = {
            path: (size, mtime) for path, size, mtime in conn.execute("SELECT path, size, mtime_ns FROM files")
        }
        self._ranges: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for rank, data_type_id, first, last in conn.execute(
            "SELECT rank, data_type_id, first_step, last_step FROM files"
        ):
            self._ranges.setdefault((rank, data_type_id), []).append((first, last))

    def _begin(self) -> None:
        if not self._in_transaction:
            self.conn.execute("BEGIN")
            self._in_transaction = 1

    def _data_type_id(self, name: str, layout: str) -> int:
        found = self._data_types.get(name)
        if found is None:
            found = _row_id(self.conn.execute("INSERT INTO data_types (name, layout) VALUES (?, ?)", (name, layout)))
            self._data_types[name] = found
        return found

    def _metric_id(self, op: str, file: MonitorCsv) -> int:
        found = self._metrics.get(op)
        if found is None:
            if op in KEY_COLUMNS or op == NAN_MASK:
                raise ConfigError(f"{file.path}: an op named {op!r} clashes with a key column of csv2db's value tables")
            found = len(self._metrics)
            self.conn.execute("INSERT INTO metrics (metric_id, name) VALUES (?, ?)", (found, op))
            for table in self._partitions:
                self.conn.execute(f"ALTER TABLE {_q(table)} ADD COLUMN {_q(op)} REAL")
            self._metrics[op] = found
            self._sql.clear()
        return found

    def _partition(self, first: int) -> str:
        last = min(first + self.step_partition - 1, INT_MAX)
        table = f"metrics_{first}_{last}"
        if table not in self._partitions:
            ops = sorted(self._metrics, key=self._metrics.__getitem__)
            columns = ", ".join(
                ["rank INTEGER", "data_type_id INTEGER", "step INTEGER", "target_id INTEGER"]
                + [f"{_q(op)} REAL" for op in ops]
                + [f"{NAN_MASK} INTEGER"]
            )
            self.conn.execute(
                f"CREATE TABLE {_q(table)} ({columns}, PRIMARY KEY ({', '.join(KEY_COLUMNS)})) WITHOUT ROWID"
            )
            self.conn.execute("INSERT INTO partitions VALUES (?, ?, ?)", (table, first, last))
            self._partitions[table] = first
        return table

    def _create_view(self, tables: Sequence[str]) -> None:
        if not tables:
            return
        ops = sorted(self._metrics, key=self._metrics.__getitem__)
        columns = ", ".join([*KEY_COLUMNS, *map(_q, ops), NAN_MASK])
        body = " UNION ALL ".join(f"SELECT {columns} FROM {_q(table)}" for table in tables)
        self.conn.execute(f"DROP VIEW IF EXISTS {VIEW}")
        self.conn.execute(f"CREATE VIEW {VIEW} AS {body}")

    # -- rows ---------------------------------------------------------------------------------

    def _target_ids(self, parsed: ParsedFile) -> list[int]:
        """The target_id of each row (new targets stored in first-seen order)."""
        ids = []
        for key in parsed.targets:
            found = self._key_ids.get(key)
            if found is None:
                found = self._key_ids[key] = self._target_id(key)
            ids.append(found)
        return list(map(ids.__getitem__, parsed.target_index))

    def _target_id(self, key: _TargetKey) -> int:
        found = self._targets.get(key)
        if found is None:
            found = _row_id(
                self.conn.execute(
                    "INSERT INTO targets (name, vpp_stage, micro_step, scope, call_index) VALUES (?, ?, ?, ?, ?)", key
                )
            )
            self._targets[key] = found
        return found

    def _split(self, steps: list[int]) -> Iterator[tuple[int, list[int] | None]]:
        """``(first step of the partition, row indices or None for all)`` per partition touched."""
        size = self.step_partition
        low, high = min(steps) // size, max(steps) // size
        if low == high:
            yield low * size, None
            return
        groups: dict[int, list[int]] = {}
        for index, step in enumerate(steps):
            groups.setdefault(step // size, []).append(index)
        for part in sorted(groups):
            yield part * size, groups[part]

    def _insert(self, table: str, ops: tuple[str, ...], flat: list[Any]) -> None:
        """Store rows given as one flat list of cells (key columns, ``ops``, nan_mask per row),
        many rows per INSERT statement: half the cost of one statement per row."""
        width = len(KEY_COLUMNS) + len(ops) + 1
        per_statement = max(1, min(ROWS_PER_INSERT, self._max_variables // width))
        step = per_statement * width
        whole = len(flat) // step * step
        if whole:
            sql = self._insert_sql(table, ops, per_statement)
            self.conn.executemany(sql, (flat[i : i + step] for i in range(0, whole, step)))
        if whole < len(flat):
            self.conn.execute(self._insert_sql(table, ops, (len(flat) - whole) // width), flat[whole:])

    def _insert_sql(self, table: str, ops: tuple[str, ...], rows: int) -> str:
        sql = self._sql.get((table, ops, rows))
        if sql is None:
            columns = [*KEY_COLUMNS, *map(_q, ops), NAN_MASK]
            row = f"({', '.join('?' * len(columns))})"
            sql = f"INSERT OR REPLACE INTO {_q(table)} ({', '.join(columns)}) VALUES {', '.join([row] * rows)}"
            self._sql[(table, ops, rows)] = sql
        return sql

    def _record_file(self, parsed: ParsedFile, rows: int) -> None:
        file = parsed.file
        data_type_id = self._data_type_id(file.data_type, file.layout)
        path = _file_key(file)
        self.conn.execute(
            "INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                path,
                file.run,
                file.rank,
                data_type_id,
                file.first_step,
                file.last_step,
                parsed.size,
                parsed.mtime_ns,
                rows,
                parsed.torn,
            ),
        )
        self._files[path] = (parsed.size, parsed.mtime_ns)


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
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Convert as the parsed arguments say and print a one-line summary; returns 0.

    Raises:
        ConfigError: bad arguments or input.
    """
    config = CSV2DBConfig(
        monitor_path=args.monitor_path,
        time_start=args.time_start,
        time_end=args.time_end,
        process_num=args.process_num,
        data_type_list=args.data_type_list,
        step_partition=args.step_partition,
        output_dirpath=args.output_dirpath,
    )
    result = csv2db(config, progress=sys.stderr.isatty())
    print(summary(result))
    return 0


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


def _connect(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None)


def _set_pragmas(conn: sqlite3.Connection) -> None:
    """Bulk-load settings: no rollback journal, no fsync, one connection, a 128 MiB cache."""
    for pragma in (
        "journal_mode = OFF",
        "synchronous = OFF",
        "locking_mode = EXCLUSIVE",
        "temp_store = MEMORY",
        "cache_size = -131072",
    ):
        conn.execute(f"PRAGMA {pragma}")


def _q(identifier: str) -> str:
    """``identifier`` quoted for SQL."""
    return '"' + identifier.replace('"', '""') + '"'


def _file_key(file: MonitorCsv) -> str:
    return str(file.path.absolute())


def _row_id(cursor: sqlite3.Cursor) -> int:
    """The id of the row an ``INSERT`` just added."""
    row_id = cursor.lastrowid
    assert row_id is not None, "an INSERT always sets lastrowid"
    return row_id


def _max_variables(conn: sqlite3.Connection) -> int:
    """How many ``?`` one statement may hold (999 in SQLite before 3.32)."""
    getlimit = getattr(conn, "getlimit", None)  # Python >= 3.11
    limit = getattr(sqlite3, "SQLITE_LIMIT_VARIABLE_NUMBER", None)  # Python >= 3.11
    return int(getlimit(limit)) if getlimit and limit is not None else 999


def _interleave(rank: int, data_type_id: int, columns: list[list[Any] | None]) -> list[Any]:
    """The cells of all rows in one flat list, row after row: ``rank``, ``data_type_id``, then
    one cell of each column (a None column: 0 in every row)."""
    count = len(columns[0] or ())
    width = 2 + len(columns)
    flat: list[Any] = [0] * (count * width)
    flat[0::width] = [rank] * count
    flat[1::width] = [data_type_id] * count
    for offset, column in enumerate(columns, start=2):
        if column is not None:
            flat[offset::width] = column
    return flat


def _pick(column: list[Any], rows: list[int] | None) -> list[Any]:
    return column if rows is None else [column[i] for i in rows]


def _nan_masks(values: list[list[float]], count: int) -> list[int] | None:
    """Per row, bit ``i`` set where ``values[i]`` is NaN; None when there is no NaN."""
    masks: list[int] | None = None
    for bit, column in enumerate(values[:NAN_BITS]):
        total = sum(column)
        if total == total:  # no NaN (a NaN or inf - inf makes the sum NaN)
            continue
        flags = list(map(math.isnan, column))
        if not any(flags):
            continue
        if masks is None:
            masks = [0] * count
        for index in compress(range(count), flags):
            masks[index] |= 1 << bit
    return masks


def _remap_masks(masks: list[int] | None, metric_ids: list[int]) -> list[int] | None:
    """File-op bits → metric_id bits."""
    if masks is None or metric_ids == list(range(len(metric_ids))):
        return masks
    memo: dict[int, int] = {}

    def remap(mask: int) -> int:
        found = memo.get(mask)
        if found is None:
            bits = (metric_ids[i] for i in range(len(metric_ids)) if mask >> i & 1)
            found = memo[mask] = sum(1 << b for b in bits if b < NAN_BITS)
        return found

    return list(map(remap, masks))


def _mp_context() -> Any:
    """fork where there is one (Linux): the workers need no fresh import of trainprobe."""
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if sys.platform == "linux" and "fork" in methods else "spawn")


def _parse_in_worker(files: list[MonitorCsv]) -> list[ParsedFile]:
    """:func:`parse_file` of each file in a worker: the warnings travel back with each file so
    the caller says them (once) where its logging is configured."""
    gc.disable()
    out = []
    shared: dict[_TargetKey, _TargetKey] = {}  # one object per key: pickled once per batch
    for file in files:
        with worker_warnings() as warnings:
            parsed = parse_file(file)
        targets = [shared.setdefault(key, key) for key in parsed.targets]
        out.append(replace(parsed, targets=targets, warnings=tuple(warnings)))
    return out


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
def _progress_bar(files: Sequence[MonitorCsv], show: bool) -> Iterator[Callable[[int], None]]:
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
