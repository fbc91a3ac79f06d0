"""csv2db's SQLite side: ``monitor_metrics.db`` opened, created or upgraded, loaded file by
file, checked and indexed (:class:`MetricsDatabase`). The schema is the one docs/csv2db.md and
:mod:`trainprobe.tools.exports.sqlite` describe; nothing here reads monitor files.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator, Sequence
from operator import itemgetter
from pathlib import Path
from typing import Any, NamedTuple

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.safe_files import INT_MAX
from trainprobe.tools.exports.sqlite_rows import NAN_BITS, ParsedFile, TargetKey
from trainprobe.tools.runs.files import RunFile

DB_NAME = "monitor_metrics.db"
PARTIAL_NAME = ".monitor_metrics.db.partial"
"""A new database is built under this name beside ``DB_NAME`` and renamed when finished."""
SCHEMA_VERSION = "2"
#: Older schema versions opened and upgraded in place (version 1 had no ``targets.call_index``).
UPGRADABLE_VERSIONS = ("1",)
#: Primary key of every value table, in storage order.
KEY_COLUMNS: tuple[str, ...] = ("rank", "data_type_id", "step", "target_id")
NAN_MASK = "nan_mask"
VIEW = "metric_values"
#: Rows stored per transaction.
BATCH_ROWS = 500_000
#: Rows per INSERT statement (fewer where SQLite allows fewer ``?``).
ROWS_PER_INSERT = 100
#: SQLite's page cache while loading (KiB).
CACHE_KIB = 131072
#: SQLite page size of a new database: 32 KiB pages took storing and indexing 3.2 M rows from
#: 3.6 s to 3.1 s (fewer pages to split and balance) against 8 KiB (bench: interleaved runs).
PAGE_BYTES = 32768
#: Worker threads sorting an index's entries (``PRAGMA threads``; 0: none), and the page cache
#: while indexing (KiB), which is also the size of each sorted run they share out.
SORT_THREADS = min(4, os.cpu_count() or 1)
SORT_RUN_KIB = 32768


class _Into(NamedTuple):
    """Where rows go: the value table, their rank and data type (the same for all rows of a
    file: written into the INSERT statement), the file's ops, and whether a nan_mask is bound
    per row (else 0, the file has no NaN)."""

    table: str
    rank: int
    data_type_id: int
    ops: tuple[str, ...]
    masks: bool


class RowsLostError(RuntimeError):
    """The database did not gain the rows that were read (a bug in csv2db): never hidden."""



class MetricsDatabase:
    """``monitor_metrics.db`` opened for loading (see the module docstring for the schema).

    Use as a context manager: :meth:`holds` and :meth:`add` per file, then :meth:`finish`.

    Raises:
        ConfigError: the file exists and is not a csv2db database of this schema version, or
            was made with another ``step_partition``.
    """

    def __init__(self, path: Path, step_partition: int, *, journal: bool = False, name: Path | None = None) -> None:
        """``name``: the database as the user knows it, for error messages, when ``path`` is the
        hidden file it is built in (renamed to ``name`` when finished; removed on an error)."""
        self.path = path
        self.name = name if name is not None else path
        self.step_partition = step_partition
        self._in_transaction = 0  # rows since BEGIN
        try:
            self.conn = _connect(path)
        except sqlite3.DatabaseError as exc:
            raise ConfigError(f"output_dirpath: cannot open {str(path)!r} as a database ({exc})") from None
        try:
            _set_pragmas(self.conn, journal)
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
        self._key_ids: dict[TargetKey, int] = {}
        self._sql: dict[tuple[_Into, str, int], str] = {}
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
        try:  # keep what was committed; say the first error
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
        fsync(self.path)

    def holds(self, file: RunFile) -> bool:
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
            span = parsed.span or (min(parsed.steps), max(parsed.steps))
            overlap = self._may_overlap(file, data_type_id, span)
            if overlap:
                self.replaced += self._stored_keys(file.rank, data_type_id, parsed.steps, target_ids)
            for first, rows in self._split(parsed.steps, span):
                columns = [_pick(parsed.steps, rows), _pick(target_ids, rows)]
                columns += [_pick(column, rows) for column in parsed.values]
                if masks is not None:
                    columns.append(_pick(masks, rows))
                into = _Into(self._partition(first), file.rank, data_type_id, parsed.ops, masks is not None)
                self._insert(into, _interleave(columns), replace=overlap)
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
                f"csv2db: {str(self.name)!r} holds {stored} value rows, expected {expected} ({self._rows_before} "
                f"before + {self.added} read - {self.replaced} replacing stored rows of the same key): rows read "
                "were not all stored; please report this bug with the monitor output"
            )
        tables = tuple(name for _, name in sorted((first, name) for name, first in self._partitions.items()))
        self._create_indexes(tables)
        self.conn.execute("BEGIN")
        self._create_view(tables)
        self.conn.execute("COMMIT")
        self.conn.execute("PRAGMA analysis_limit=1000")
        self.conn.execute("ANALYZE")
        return tables

    def _create_indexes(self, tables: Sequence[str]) -> None:
        """The ``_by_target`` index of each value table that lacks it. SQLite sorts the entries on
        :data:`SORT_THREADS` worker threads, which it uses only with temporary files on disk
        (``temp_store = FILE``) for sorted runs smaller than the page cache; should that fail (a
        temporary folder that is full), the indexes are dropped and made again the plain way: in
        memory, on this thread."""
        conn = self.conn
        if SORT_THREADS:
            for pragma in ("temp_store = FILE", f"threads = {SORT_THREADS}", f"cache_size = -{SORT_RUN_KIB}"):
                conn.execute(f"PRAGMA {pragma}")
            try:
                self._index_all(tables)
                return
            except sqlite3.OperationalError:
                conn.execute("COMMIT")
                conn.execute("BEGIN")
                for table in tables:
                    conn.execute(f"DROP INDEX IF EXISTS {_q(table + '_by_target')}")
                conn.execute("COMMIT")
            finally:
                for pragma in ("temp_store = MEMORY", "threads = 0", f"cache_size = -{CACHE_KIB}"):
                    conn.execute(f"PRAGMA {pragma}")
        self._index_all(tables)

    def _index_all(self, tables: Sequence[str]) -> None:
        self.conn.execute("BEGIN")
        for table in tables:
            self.conn.execute(f"CREATE INDEX IF NOT EXISTS {_q(table + '_by_target')} ON {_q(table)}(target_id, step)")
        self.conn.execute("COMMIT")

    # -- schema -------------------------------------------------------------------------------

    def _count_rows(self) -> int:
        """Rows in all value tables (the smallest index is scanned: fast)."""
        return sum(self.conn.execute(f"SELECT count(*) FROM {_q(table)}").fetchone()[0] for table in self._partitions)

    def _may_overlap(self, file: RunFile, data_type_id: int, span: tuple[int, int]) -> bool:
        """Whether a stored row can have a key of ``file``'s rows: a file of the same rank and
        data type (``file`` itself read before included) covers some of its steps (those its name
        says and those its rows hold). Also records ``file``'s range for the files that follow."""
        low, high = min(file.first_step, span[0]), max(file.last_step, span[1])
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
                f"step_partition: {str(self.name)!r} was made with step_partition {meta.get('step_partition')}, "
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
        self.conn.execute(f"PRAGMA page_size = {PAGE_BYTES}")
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
        self._targets: dict[TargetKey, int] = {
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

    def _metric_id(self, op: str, file: RunFile) -> int:
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
        index = parsed.target_index
        if len(index) < 2:  # itemgetter of one index gives the item, not a tuple
            return [ids[i] for i in index]
        return list(itemgetter(*index)(ids))  # one C call (a third of map's time)

    def _target_id(self, key: TargetKey) -> int:
        found = self._targets.get(key)
        if found is None:
            found = _row_id(
                self.conn.execute(
                    "INSERT INTO targets (name, vpp_stage, micro_step, scope, call_index) VALUES (?, ?, ?, ?, ?)", key
                )
            )
            self._targets[key] = found
        return found

    def _split(self, steps: list[int], span: tuple[int, int]) -> Iterator[tuple[int, list[int] | None]]:
        """``(first step of the partition, row indices or None for all)`` per partition touched
        (``span``: the smallest and largest of ``steps``)."""
        size = self.step_partition
        low, high = span[0] // size, span[1] // size
        if low == high:
            yield low * size, None
            return
        groups: dict[int, list[int]] = {}
        for index, step in enumerate(steps):
            groups.setdefault(step // size, []).append(index)
        for part in sorted(groups):
            yield part * size, groups[part]

    def _insert(self, into: _Into, flat: list[Any], replace: bool) -> None:
        """Store rows given as one flat list of cells (step, target_id, the ops, nan_mask if
        ``into.masks``, per row), many rows per INSERT statement (half the cost of one statement
        per row); ``rank`` and ``data_type_id`` are in the statement's text, not bound per row.

        Without ``replace`` (no stored row can have one of these keys) a plain INSERT, cheaper than
        INSERT OR REPLACE (no search before each row); should a key clash after all (rows of one
        file repeating a key: a bug that :meth:`finish` reports), the rows are stored again with
        INSERT OR REPLACE, which ends as if it had been used from the start (the failed statement's
        rows that were stored already are replaced by themselves: there is no journal to undo them)."""
        if not replace:
            try:
                self._insert_rows(into, flat, "INSERT")
                return
            except sqlite3.IntegrityError:
                pass
        self._insert_rows(into, flat, "INSERT OR REPLACE")

    def _insert_rows(self, into: _Into, flat: list[Any], verb: str) -> None:
        width = len(into.ops) + 2 + int(into.masks)
        per_statement = max(1, min(ROWS_PER_INSERT, self._max_variables // width))
        step = per_statement * width
        whole = len(flat) // step * step
        if whole:
            sql = self._insert_sql(into, verb, per_statement)
            self.conn.executemany(sql, (flat[i : i + step] for i in range(0, whole, step)))
        if whole < len(flat):
            self.conn.execute(self._insert_sql(into, verb, (len(flat) - whole) // width), flat[whole:])

    def _insert_sql(self, into: _Into, verb: str, rows: int) -> str:
        sql = self._sql.get((into, verb, rows))
        if sql is None:
            columns = [*KEY_COLUMNS, *map(_q, into.ops), NAN_MASK]
            cells = [str(int(into.rank)), str(int(into.data_type_id)), *["?"] * (len(into.ops) + 2)]
            cells.append("?" if into.masks else "0")
            row = f"({', '.join(cells)})"
            sql = f"{verb} INTO {_q(into.table)} ({', '.join(columns)}) VALUES {', '.join([row] * rows)}"
            self._sql[(into, verb, rows)] = sql
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



def _connect(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None)


def _set_pragmas(conn: sqlite3.Connection, journal: bool) -> None:
    """Bulk-load settings: one connection, a 128 MiB cache; with ``journal`` (a database that
    already holds conversions) a rollback journal and syncs at each commit, so that a conversion
    killed midway leaves the database as its last commit left it; without (a database built
    under a temporary name, renamed when finished), no journal and no fsync
    (:meth:`MetricsDatabase.close` syncs the file once).

    The index build at the end changes some of them (:meth:`MetricsDatabase._create_indexes`)."""
    for pragma in (
        "journal_mode = DELETE" if journal else "journal_mode = OFF",
        "synchronous = NORMAL" if journal else "synchronous = OFF",
        "locking_mode = EXCLUSIVE",
        "temp_store = MEMORY",
        f"cache_size = -{CACHE_KIB}",
    ):
        conn.execute(f"PRAGMA {pragma}")


def fsync(path: Path) -> None:
    """``path`` and its folder written through to the disk (the database is durable once
    :func:`~trainprobe.tools.exports.sqlite.csv2db` returns)."""
    for target, flags in ((path, os.O_RDONLY), (path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))):
        try:
            fd = os.open(target, flags)
        except OSError:
            continue
        try:
            os.fsync(fd)
        except OSError:  # a folder that cannot be synced (some file systems): the file was
            pass
        finally:
            os.close(fd)


def _q(identifier: str) -> str:
    """``identifier`` quoted for SQL."""
    return '"' + identifier.replace('"', '""') + '"'


def _file_key(file: RunFile) -> str:
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


def _interleave(columns: list[list[Any]]) -> list[Any]:
    """The cells of all rows in one flat list, row after row: one cell of each column."""
    count = len(columns[0])
    width = len(columns)
    flat: list[Any] = [0] * (count * width)
    for offset, column in enumerate(columns):
        flat[offset::width] = column
    return flat


def _pick(column: list[Any], rows: list[int] | None) -> list[Any]:
    return column if rows is None else [column[i] for i in rows]



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

