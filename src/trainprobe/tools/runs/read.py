"""csv2db's reader: monitor files read by DuckDB through the query layer's typed scans
(:mod:`trainprobe.tools.query.layer`), one :class:`~trainprobe.tools.exports.sqlite_rows.ParsedFile` per file,
in the order given.

Consecutive files of one layout, format and header are read by one DuckDB query (at most
:data:`BATCH_BYTES` of files: memory is bounded by a few batches, not the run; the first queries
smaller, so that storing starts early), in a thread of its own, one batch ahead of the files
handed out; its Arrow result is cut into files (by DuckDB's ``file_index``) and turned into
columns with NumPy, the targets numbered from dictionary codes of their key columns (no key
text per row). CSV files go through the layer's typed
``read_csv`` (no type sniffing: keys BIGINT, ops DOUBLE, names VARCHAR; an empty op cell reads
as NaN, an empty ``micro_step`` or ``scope`` as none), Parquet files through ``read_parquet``.

Files DuckDB does not take are read by the Python reader
(:func:`~trainprobe.tools.exports.sqlite_rows.parse_file`), which gives the same rows and the precise
one-line error of :mod:`trainprobe.tools.runs.rows`: an empty CSV file, one whose last
record is torn (a run killed or still writing: its warning and torn count), a link, one above
:data:`~trainprobe.tools.runs.rows.MAX_CSV_BYTES`, and every batch DuckDB refuses (a cell
that is not a number, a row with the wrong number of cells, text that is not UTF-8 ...).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.layout import MICRO_COLUMN
from trainprobe.tools.engines.lock import lock
from trainprobe.tools.exports.sqlite_rows import NAN_BITS, BaseKey, ParsedFile, number_targets, parse_file
from trainprobe.tools.query.layer import require
from trainprobe.tools.runs.files import RunFile, check_unchanged, clean_length, csv_header
from trainprobe.tools.runs.layout import column_roles
from trainprobe.tools.runs.rows import MAX_CSV_BYTES
from trainprobe.tools.sql.names import file_list, hadoop_glob_literal
from trainprobe.tools.sql.names import ident as quote
from trainprobe.tools.sql.names import text as literal
from trainprobe.tools.sql.views import read_csv_sql

if TYPE_CHECKING:
    import duckdb
    import numpy as np
    import pyarrow as pa

#: CSV or Parquet bytes read by one DuckDB query.
BATCH_BYTES = 32 << 20
#: The first query's bytes; each next query's limit is twice the last, up to BATCH_BYTES (the
#: database starts storing rows while the first files are read, not after a whole batch).
FIRST_BATCH_BYTES = 4 << 20

_Group = tuple[str, str, tuple[str, ...]]  # (layout, format, header)
_T = TypeVar("_T")
_DONE = object()


def read_files(files: Sequence[RunFile], threads: int | None = None) -> Iterator[ParsedFile]:
    """Each of ``files`` read into columns, in the order given (see the module docstring);
    ``threads``: DuckDB's threads (None: its default, every core).

    The DuckDB queries run in a thread of their own, one batch ahead of the batch whose files are
    handed out (DuckDB releases the GIL): the next batch is read while the caller uses the files
    of this one, not after it.

    Raises:
        ConfigError: a file that is not a monitor file (the message names it); DuckDB, PyArrow
            or NumPy not installed (the message says how to install them).
    """
    duck = require("duckdb")
    require("pyarrow")
    con = duck.connect()
    con.execute("SET enable_progress_bar = false")
    con.execute("SET preserve_insertion_order = true")  # rows in the order of the files listed, and of their lines
    if threads is not None:
        con.execute(f"SET threads = {int(threads)}")
    lock(con, (f.path for f in files))
    ahead = read_ahead(_queried(con, _batches(files)), depth=1)
    try:
        for group, batch, found in ahead:
            if group is None:
                yield parse_file(batch[0])
            elif found is None:  # DuckDB refused the batch: the Python reader says which file and cell
                yield from map(parse_file, batch)
            else:
                yield from _files_of(group, batch, found)
    finally:
        ahead.close()  # the query thread ends (its query done) before its connection closes
        con.close()


def parquet_only(files: Sequence[RunFile]) -> None:
    """Check, before a Spark session is started, that Spark can read ``files``.

    Raises:
        ConfigError: a file is CSV (Spark reads Parquet files only; the message says how to convert).
    """
    csv = [f for f in files if f.format != "parquet"]
    if csv:
        raise ConfigError(
            f"--engine spark reads Parquet files and {len(csv)} selected file(s) are CSV (e.g. {csv[0].path}); "
            f"convert the run first: trainprobe convert RUN --to parquet"
        )


def spark_read_files(session: Any, files: Sequence[RunFile]) -> Iterator[ParsedFile]:
    """Each of ``files`` read through the Spark session ``session`` (``--engine spark``), in the
    order given, into the same :class:`ParsedFile` as :func:`read_files`: the same SELECT list
    (:func:`_select`, transpiled to Spark SQL), one Spark query per file, its rows in file order
    (Spark's ``_metadata.row_index``); memory bounded by one file.

    Raises:
        ConfigError: a file is CSV (Spark reads Parquet files only: the message says how to
            convert the run), has a foreign header, or Spark could not read it (one line naming it).
    """
    from trainprobe.tools.engines.spark import to_spark

    parquet_only(files)
    for file in files:
        group = _group_of(file)
        assert group is not None  # a Parquet file always has a group
        layout, _, header = group
        ops = [header[i] for i in column_roles(header, file.layout, str(file.path)).op_cols]
        check_unchanged([file])  # Spark opens the path as given: a file swapped since it was found is refused
        try:
            frame = session.read.parquet(hadoop_glob_literal(str(file.path)))
            frame.selectExpr("*", "_metadata.row_index AS __row").createOrReplaceTempView("__trainprobe_file")
            sql = f"SELECT {_select(layout, header, ops, '0')} FROM __trainprobe_file ORDER BY __row"
            table = session.sql(to_spark(sql)).toArrow()
        except Exception as exc:  # noqa: BLE001 (Py4J and Spark errors have no common base: one line)
            raise ConfigError(f"{file.path}: Spark could not read it: {str(exc).strip().splitlines()[0][:300]}") from None
        stat = file.path.stat()
        rows = _split_by_file(table).get(0)
        yield _parsed(file, stat.st_size, stat.st_mtime_ns, tuple(ops), *(rows or (None, None)))


_Found = tuple[dict[str, Any], "dict[int, tuple[pa.Table, np.ndarray[Any, Any]]]"]


def _queried(
    con: duckdb.DuckDBPyConnection, batches: Iterator[tuple[_Group | None, list[RunFile]]]
) -> Iterator[tuple[_Group | None, list[RunFile], _Found | None]]:
    """Each batch with what its DuckDB query found: the files' stats and their rows by position
    in the batch (:func:`_split_by_file`); None for a file of the Python reader, or a batch
    DuckDB refused."""
    for group, batch in batches:
        yield group, batch, (None if group is None else _query_batch(con, group, batch))


def _batches(files: Sequence[RunFile]) -> Iterator[tuple[_Group | None, list[RunFile]]]:
    """Runs of consecutive files DuckDB reads together (same layout, format, header; at most
    :data:`BATCH_BYTES`, the first ones less: :func:`consecutive`), and files for the Python
    reader alone (group None)."""
    yield from consecutive(files, _group_of, BATCH_BYTES, FIRST_BATCH_BYTES)  # type: ignore[misc]


def _group_of(file: RunFile) -> _Group | None:
    """The batch key of a file DuckDB reads, or None for the Python reader."""
    path = file.path
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            header = tuple(pq.read_schema(path).names)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{path}: not a Parquet file ({str(exc).splitlines()[0]})") from None
        column_roles(header, file.layout, str(path))
        return file.layout, "parquet", header
    if path.is_symlink() or path.stat().st_size > MAX_CSV_BYTES or clean_length(path) is not None:
        return None  # a link, too large, empty or torn: the Python reader checks and says it
    names = csv_header(path)
    if names is None or any('"' in h or not h.isprintable() for h in names):
        return None
    column_roles(names, file.layout, str(path))  # the same error as the Python reader's
    return file.layout, "csv", names


def _select(layout: str, header: tuple[str, ...], ops: list[str], file: str) -> str:
    """The SELECT list of a batch: ``file`` (the file's position in the batch), the keys, the ops."""
    micro = f"CAST({quote(MICRO_COLUMN)} AS BIGINT)" if MICRO_COLUMN in header else "CAST(NULL AS BIGINT)"
    name = quote("name" if layout == "v1" else "module_name")
    # an empty scope is none, as in the Python reader and the targets' key (a Parquet file can hold both)
    scope = f"NULLIF(CAST({quote('scope')} AS VARCHAR), '')" if layout == "v2" else "CAST(NULL AS VARCHAR)"
    values = ", ".join(f"CAST({quote(op)} AS DOUBLE) AS {quote('op_' + op)}" for op in ops)
    return (
        f"{file} AS file, CAST(step AS BIGINT) AS step, CAST(vpp_stage AS BIGINT) AS vpp_stage, "
        f"{micro} AS micro, CAST({name} AS VARCHAR) AS name, CAST({scope} AS VARCHAR) AS scope"
        + (f", {values}" if values else "")
    )


def _file_position(con: duckdb.DuckDBPyConnection, source: str, listed: list[str]) -> str:
    """A row's file as its position in ``listed`` (the files of ``source``): DuckDB's
    ``file_index`` where it has one (an integer per row, where ``filename`` is a string per row),
    else found from ``filename``."""
    duck = require("duckdb")
    try:
        con.execute(f"SELECT file_index FROM {source} LIMIT 0")
    except duck.Error:
        return "list_position([" + ", ".join(literal(p) for p in listed) + "], filename) - 1"
    return "CAST(file_index AS BIGINT)"


def _query_batch(con: duckdb.DuckDBPyConnection, group: _Group, files: list[RunFile]) -> _Found | None:
    """The rows of the files of one batch, read by one query, by file (None when DuckDB refuses
    the batch: the Python reader then reads its files, naming the file and cell that is wrong)."""
    layout, fmt, header = group
    roles = column_roles(header, layout, str(files[0].path))  # type: ignore[arg-type]
    ops = [header[i] for i in roles.op_cols]
    stats = {str(f.path): f.path.stat() for f in files}
    listed = [str(f.path) for f in files]
    if fmt == "csv":  # in file order (preserve_insertion_order): no row number needed (it costs 20% of the scan)
        source, order = read_csv_sql(listed, header, ordinality=False), ""
    else:
        source = f"read_parquet({file_list(listed)}, filename=true, file_row_number=true)"
        order = ", file_row_number AS row_order"
    duck = require("duckdb")
    check_unchanged(files)  # DuckDB opens the paths as given: a link swapped in since they were found is refused
    try:
        inner = _select(layout, header, ops, _file_position(con, source, listed))
        table = con.sql(f"SELECT {inner}{order} FROM {source}").to_arrow_table()
    except duck.Error as exc:
        if fmt == "parquet":
            raise ConfigError(f"{listed[0]}: DuckDB could not read it: {str(exc).splitlines()[0]}") from None
        return None
    return stats, _split_by_file(table)


def _files_of(group: _Group, files: list[RunFile], found: _Found) -> Iterator[ParsedFile]:
    """The files of one batch as :class:`ParsedFile`, from what its query found."""
    layout, _, header = group
    roles = column_roles(header, layout, str(files[0].path))  # type: ignore[arg-type]
    ops = tuple(header[i] for i in roles.op_cols)
    stats, by_file = found
    for position, file in enumerate(files):
        stat = stats[str(file.path)]
        rows = by_file.get(position)
        yield _parsed(file, stat.st_size, stat.st_mtime_ns, ops, *(rows or (None, None)))


def _split_by_file(table: pa.Table) -> dict[int, tuple[pa.Table, np.ndarray[Any, Any]]]:
    """The rows of each file of a batch (by its position in the batch), in the file's order, with
    their target codes (:func:`_target_codes`)."""
    import numpy as np
    import pyarrow as pa

    if table.num_rows == 0:
        return {}
    file_index = table.column("file").to_numpy()
    names = table.column_names
    row_order = table.column("row_order").to_numpy() if "row_order" in names else np.arange(table.num_rows)
    if not _in_order(file_index, row_order):
        order = np.lexsort((row_order, file_index))
        table, file_index = table.take(pa.array(order)), file_index[order]
    codes = _target_codes(table)
    starts = np.flatnonzero(np.diff(file_index, prepend=-1))
    ends = [*starts[1:].tolist(), table.num_rows]
    return {
        int(file_index[s]): (table.slice(int(s), int(e - s)), codes[s:e]) for s, e in zip(starts.tolist(), ends)
    }


def _in_order(file_index: np.ndarray[Any, Any], row_order: np.ndarray[Any, Any]) -> bool:
    """Whether the rows come file after file, each file's rows in their order."""
    import numpy as np

    step = np.diff(file_index)
    if np.any(step < 0):
        return False
    same = step == 0
    return not np.any(row_order[1:][same] <= row_order[:-1][same])


def _target_codes(table: pa.Table) -> np.ndarray[Any, Any]:
    """Per row, an integer naming its target key ``(name, vpp_stage, micro, scope)``: equal codes,
    equal keys (a null apart from every value)."""
    import numpy as np

    codes = np.zeros(table.num_rows, dtype=np.int64)
    distinct = 1
    for column in ("name", "vpp_stage", "micro", "scope"):
        width, indices = _dictionary_codes(table.column(column))
        if distinct * width >= 1 << 62:  # renumber densely before the product could overflow
            unique, codes = np.unique(codes, return_inverse=True)
            distinct = len(unique)
        codes = codes * width + indices
        distinct *= width
    return codes


def _dictionary_codes(column: pa.ChunkedArray) -> tuple[int, np.ndarray[Any, Any]]:
    """How many distinct values ``column`` has (null one of them) and each row's number for its
    value. The chunks are encoded as they are (one dictionary for all: no copy of the column);
    a pyarrow that gave each chunk its own dictionary gets the column in one chunk."""
    import numpy as np
    import pyarrow.compute as pc

    encoded = pc.dictionary_encode(column, null_encoding="encode")
    chunks = encoded.chunks
    if not chunks:
        return 1, np.zeros(0, dtype=np.int64)
    dictionary = chunks[-1].dictionary
    if any(chunk.dictionary is not dictionary and not chunk.dictionary.equals(dictionary) for chunk in chunks):
        whole = pc.dictionary_encode(column.combine_chunks(), null_encoding="encode")
        return len(whole.dictionary), whole.indices.to_numpy().astype(np.int64)
    indices = [chunk.indices.to_numpy().astype(np.int64) for chunk in chunks]
    return len(dictionary), np.concatenate(indices)


def _parsed(
    file: RunFile,
    size: int,
    mtime_ns: int,
    ops: tuple[str, ...],
    rows: pa.Table | None,
    codes: np.ndarray[Any, Any] | None,
) -> ParsedFile:
    """One file's rows (None: it has none) with their target codes as a :class:`ParsedFile`."""
    import numpy as np

    if rows is None or codes is None or rows.num_rows == 0:
        return ParsedFile(file, size, mtime_ns, ops, [], [], [], [[] for _ in ops], None, 0)
    steps = _keys(rows, "step", file)
    _keys(rows, "vpp_stage", file)
    _, first, dense = np.unique(codes, return_index=True, return_inverse=True)  # by code
    by_seen = np.argsort(first)  # the codes in first-seen order
    seen = first[by_seen]  # the first row of each target, in first-seen order
    local = np.empty(len(first), dtype=np.int64)
    local[by_seen] = np.arange(len(seen))
    index = local[dense.reshape(-1)]
    picked = rows.select(["name", "vpp_stage", "micro", "scope"]).take(seen)
    base: list[BaseKey] = list(
        zip(
            picked.column("name").to_pylist(),
            picked.column("vpp_stage").to_pylist(),
            picked.column("micro").to_pylist(),
            picked.column("scope").to_pylist(),
        )
    )
    step_list = steps.tolist()
    if _repeats(steps, index):  # a key repeats within a step: number the calls (the slow, rare path)
        targets, index_list = number_targets([base[i] for i in index.tolist()], step_list)
    else:
        targets = [(*key, 0) for key in base]  # type: ignore[misc]
        index_list = index.tolist()
    values = [rows.column("op_" + op).to_numpy() for op in ops]
    return ParsedFile(
        file=file,
        size=size,
        mtime_ns=mtime_ns,
        ops=ops,
        targets=targets,  # type: ignore[arg-type]
        target_index=index_list,
        steps=step_list,
        values=[column.tolist() for column in values],
        nan_masks=_nan_masks(values),
        torn=0,
        span=(int(steps.min()), int(steps.max())),
    )


def _keys(rows: pa.Table, column: str, file: RunFile) -> np.ndarray[Any, Any]:
    """A key column as int64, refused when a cell is empty (a Parquet file may hold nulls)."""
    data = rows.column(column)
    if data.null_count:
        raise ConfigError(f"{file.path}: column {column!r} has {data.null_count} empty cell(s); not a monitor file")
    return data.to_numpy()


def _repeats(steps: np.ndarray[Any, Any], index: np.ndarray[Any, Any]) -> bool:
    """Whether some ``(step, target)`` pair occurs twice."""
    import numpy as np

    targets = int(index.max()) + 1
    low, high = int(steps.min()), int(steps.max())
    if (high - low + 1) * targets <= 1 << 24:  # the usual file: count each pair in one pass
        return bool(np.bincount((steps - low) * targets + index).max() > 1)
    order = np.lexsort((index, steps))
    s, t = steps[order], index[order]
    return bool(np.any((s[1:] == s[:-1]) & (t[1:] == t[:-1])))


def _nan_masks(values: list[np.ndarray[Any, Any]]) -> list[int] | None:
    """Per row, bit ``i`` set where op ``i`` is NaN (or empty); None when there is no NaN."""
    import numpy as np

    masks = None
    for bit, column in enumerate(values[:NAN_BITS]):
        flags = np.isnan(column)
        if flags.any():
            if masks is None:
                masks = np.zeros(len(column), dtype=np.int64)
            masks |= flags.astype(np.int64) << bit
    return None if masks is None else masks.tolist()



def read_ahead(items: Iterator[_T], depth: int = 2) -> Generator[_T, None, None]:
    """``items`` produced by a background thread, at most ``depth`` ahead of the consumer (DuckDB
    and SQLite both release the GIL: reading the next batch overlaps storing this one). An
    exception of the producer is raised here, where the consumer is; closing this generator
    stops the producer after its current item."""
    handoff: queue.Queue[Any] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in items:
                if stop.is_set():
                    return
                handoff.put((True, item))
            handoff.put((True, _DONE))
        except BaseException as exc:  # noqa: BLE001 (handed to the consumer, raised there)
            handoff.put((False, exc))
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()

    worker = threading.Thread(target=produce, name="csv2db-reader", daemon=True)
    worker.start()
    try:
        while True:
            ok, item = handoff.get()
            if not ok:
                raise item
            if item is _DONE:
                return
            yield item
    finally:
        stop.set()
        while worker.is_alive():  # unblock a producer waiting on a full queue
            try:
                handoff.get(timeout=0.05)
            except queue.Empty:
                pass
        worker.join()


# -- the batching and the streamed scan every batched reader shares (csv2db, csv2tb, the report) --

#: Rows per Arrow batch of a streamed scan (:func:`stream_by_file`).
STREAM_ROWS = 262144


class StreamError(Exception):
    """A streamed many-file scan failed, or did not give its files one after the other in order:
    the caller reads its files again one at a time (so that an error names the file)."""


def consecutive(
    files: Sequence[RunFile],
    key: Callable[[RunFile], object | None],
    limit: int | None = None,
    first_limit: int | None = None,
) -> Iterator[tuple[object | None, list[RunFile]]]:
    """``files`` cut into runs of consecutive files that one query reads together: the same
    ``key`` (not None), at most ``limit`` bytes of files (None: no limit; the first run at most
    ``first_limit``, each next one twice the last, up to ``limit``: storing starts early); a
    file whose key is None comes alone (its reader reads it by itself). Yields ``(key, files)``."""
    current: list[RunFile] = []
    group: object | None = None
    held = 0
    cap = first_limit if first_limit is not None else limit
    for file in files:
        found = key(file)
        if current and (found != group or (cap is not None and held >= cap)):
            yield group, current
            current, held = [], 0
            if cap is not None and limit is not None:
                cap = min(2 * cap, limit)
        if found is None:
            yield None, [file]
            group = None
            continue
        group = found
        current.append(file)
        if cap is not None:
            held += file.path.stat().st_size
    if current:
        yield group, current


def stream_by_file(
    con: duckdb.DuckDBPyConnection,
    sql: str,
    batch: Sequence[RunFile],
    rows_of: Callable[[pa.Table | None], _T],
) -> Iterator[tuple[RunFile, _T]]:
    """``(file, rows_of(its rows))`` for each of ``batch`` from ``sql``: a SELECT with a ``file``
    column (the path) whose rows come file after file in ``batch``'s order, each file's in file
    order; streamed in Arrow batches of :data:`STREAM_ROWS` rows, the next batch scanned in a
    thread (:func:`read_ahead`) while the caller works on this one; a file without a row gives
    ``rows_of(None)``. Memory: two batches and the file being assembled, not the run.

    Raises:
        StreamError: DuckDB failed, or the rows are not file after file in order (nothing of
            the file in progress has been handed out).
    """
    import duckdb
    import pyarrow as pa

    index = {str(f.path): n for n, f in enumerate(batch)}
    pending: list[pa.RecordBatch] = []
    current = 0
    ahead: Generator[pa.RecordBatch, None, None] | None = None
    try:
        ahead = read_ahead(iter(con.sql(sql).to_arrow_reader(STREAM_ROWS)), depth=1)
        for record in ahead:
            for start, end, name in _file_runs(record.column("file")):
                at = index.get(name, -1)
                if at < current:
                    raise StreamError(name)
                if at > current:
                    if pending:
                        yield batch[current], rows_of(pa.Table.from_batches(pending))
                        current += 1
                    while current < at:  # files without a row
                        yield batch[current], rows_of(None)
                        current += 1
                    pending = []
                pending.append(record.slice(start, end - start))
    except (duckdb.Error, pa.ArrowException, OSError) as exc:  # a failure in the stream comes as an Arrow OSError
        raise StreamError(str(exc)) from None
    finally:
        if ahead is not None:
            ahead.close()  # its thread has stopped: the connection is free for a file-by-file read
    if pending:
        yield batch[current], rows_of(pa.Table.from_batches(pending))
        current += 1
    for file in batch[current:]:
        yield file, rows_of(None)


def _file_runs(column: object) -> list[tuple[int, int, str]]:
    """A batch's ``file`` column (Arrow strings) as runs of one file: ``(start, end, file)``."""
    import numpy as np
    import pyarrow.compute as pc

    files: pa.Array = column  # type: ignore[assignment]
    n = len(files)
    if n < 2:
        return [(0, n, str(files[0].as_py()))] if n else []
    change = pc.not_equal(files.slice(1), files.slice(0, n - 1)).to_numpy(zero_copy_only=False)
    cuts = np.r_[0, np.flatnonzero(change) + 1, n].tolist()
    return [(a, b, str(files[a].as_py())) for a, b in zip(cuts[:-1], cuts[1:])]
