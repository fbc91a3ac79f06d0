"""The report's reader: a run's data files found and read through the query layer
(:mod:`trainprobe.tools.query.layer`) by the one batched reader (:mod:`trainprobe.tools.runs.read`:
consecutive files of one header in one streamed scan), as numpy columns, one file at a time.

* Files: :func:`~trainprobe.tools.runs.files.find_run_files` (Monitor V1 and V2, both tools'
  layouts, CSV or Parquet in any mix; a link to a file outside the folder given is skipped unread
  with one warning; entries that are not regular files are left out).
* Rows: the query layer's view of the one file (DuckDB's CSV/Parquet reader, no Python row
  loop): the V1 ``<vpp_stage>:`` chunk prefix dropped from names, an empty ``micro_step`` cell
  -1, an empty op cell NaN. A CSV file whose last record is torn (a run killed or still writing)
  is read without it: one warning names the file, and :attr:`FileRows.torn` counts it.
* A file DuckDB cannot read (not UTF-8, a cell that is not a number, a wrong number of cells) is a
  :class:`~trainprobe.engine.errors.ConfigError` naming the file, on one line.

Needs the ``[query]`` extra (DuckDB); without it, one line says how to install it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from trainprobe.engine.errors import ConfigError
from trainprobe.tools.query.layer import quote, require, table_sql
from trainprobe.tools.runs.files import RunFile, clean_length, csv_header, find_run_files, rank_order, run_order
from trainprobe.tools.runs.read import StreamError, consecutive, stream_by_file
from trainprobe.tools.sql.questions import KEY_COLUMNS, META_COLUMNS, TEXT_COLUMNS

if TYPE_CHECKING:
    import duckdb


@dataclass
class FileRows:
    """The complete rows of one file, in file order.

    Attributes:
        ops: the op columns, in file order.
        steps, micro, vpp: int64 per row (``micro`` -1 where the file has none).
        values: ``(rows, ops)`` float64 (``nan``/``inf`` kept; an empty cell NaN).
        target_codes: per row, an index into ``target_names`` (the row's module or parameter).
        target_names: the distinct names of the file.
        scope_codes, scope_names: V2: the row's scope, the same way; V1: None.
        shapes: the reference V1 ``shape`` text per row where the file has that column, else None.
        torn: 1 when the file's torn last record was left out, else 0.
    """

    ops: tuple[str, ...]
    steps: np.ndarray
    micro: np.ndarray
    vpp: np.ndarray
    values: np.ndarray
    target_codes: np.ndarray
    target_names: list[str]
    scope_codes: np.ndarray | None
    scope_names: list[str] | None
    shapes: list[str] | None
    torn: int

    @property
    def targets(self) -> list[str]:
        """The row's module or parameter name, per row (a list of strings: for small uses only)."""
        return [self.target_names[c] for c in self.target_codes.tolist()]


def find_report_files(root: Path) -> list[RunFile]:
    """Every data file under ``root`` the report reads
    (:func:`~trainprobe.tools.runs.files.find_run_files`), by rank, data type, first step and
    folder (:func:`~trainprobe.tools.runs.files.rank_order`).

    Raises:
        NoRunFiles: no monitor file under ``root`` (the message says what was looked for and
            the links skipped).
        ConfigError: ``root`` missing or not a folder.
    """
    return sorted(find_run_files(root), key=rank_order)


def run_files(files: Sequence[RunFile]) -> list[RunFile]:
    """``files`` in the query layer's order (:func:`~trainprobe.tools.runs.files.run_order`)."""
    return sorted(files, key=run_order)


def connection(files: Sequence[RunFile]) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection for :func:`read_file`, locked to reading ``files``
    (:mod:`~trainprobe.tools.engines.lock`; ConfigError naming the ``[query]`` extra without DuckDB)."""
    from trainprobe.tools.engines.lock import lock

    con = require("duckdb").connect()
    lock(con, (f.path for f in files))
    return con  # type: ignore[no-any-return]


def read_file(con: duckdb.DuckDBPyConnection, file: RunFile) -> FileRows:
    """The complete rows of ``file`` (see the module docstring).

    Raises:
        ConfigError: ``<file>: ...`` on one line: a header naming a column twice or lacking the
            layout's key columns, text that is not UTF-8, a cell that is not a number.
    """
    import duckdb

    torn = _torn(file)
    try:
        made = table_sql(con, file.data_type, [file])
        if made is None:
            return _empty(torn)
        view, names = made
        ops = op_columns(names)
        got = con.sql(f"SELECT {_items(ops, names)} FROM ({view}) ORDER BY file_row").to_arrow_table()
    except duckdb.Error as exc:
        raise ConfigError(f"{file.path}: {_reason(str(exc))}") from None
    return file_rows(got, ops, file.layout == "v2", torn)


def read_files(con: duckdb.DuckDBPyConnection, files: Sequence[RunFile]) -> Iterator[tuple[RunFile, FileRows]]:
    """``(file, its rows)`` for each of ``files``, in their order, as :func:`read_file` reads
    them, but each run of consecutive CSV files of one table, layout and header (none of them
    torn) in one DuckDB scan, streamed by the one batched reader
    (:func:`~trainprobe.tools.runs.read.consecutive` and
    :func:`~trainprobe.tools.runs.read.stream_by_file`: batches of
    :data:`~trainprobe.tools.runs.read.STREAM_ROWS` rows, the next one scanned in a thread while
    the caller works on this file's rows; memory holds two batches and the file being assembled,
    not the run). The connection is free again once the iteration ends or is closed.

    Raises:
        ConfigError: as :func:`read_file` (a scan that fails is read again file by file, so
            that the message names the file).
    """
    for key, batch in consecutive(files, _bulk_key):
        if key is None or len(batch) == 1:
            for file in batch:
                yield file, read_file(con, file)
            continue
        done = 0
        try:
            for file, rows in _read_bulk(con, batch):
                done += 1
                yield file, rows
        except StreamError:
            pass  # read the rest file by file
        for file in batch[done:]:
            yield file, read_file(con, file)


def _bulk_key(file: RunFile) -> tuple[object, ...] | None:
    """What CSV files one scan reads together share (table, layout, header; none torn); None for
    a file read alone (Parquet, torn, no complete header)."""
    if file.format != "csv" or _torn(file):
        return None
    header = csv_header(file.path)
    return None if header is None else (file.data_type, file.layout, header)


def _read_bulk(con: duckdb.DuckDBPyConnection, batch: list[RunFile]) -> Iterator[tuple[RunFile, FileRows]]:
    """The files of one run of :func:`_bulk_key` through one streamed scan (see :func:`read_files`).

    Raises:
        StreamError: DuckDB failed, or the scan's rows are not file after file in order.
    """
    made = table_sql(con, batch[0].data_type, list(batch))
    if made is None:
        raise StreamError("no view")
    view, names = made
    ops = op_columns(names)
    yield from stream_file_rows(con, f"SELECT {_items(ops, names)}, file FROM ({view})", batch, ops)


def stream_file_rows(
    con: duckdb.DuckDBPyConnection, sql: str, batch: Sequence[RunFile], ops: tuple[str, ...]
) -> Iterator[tuple[RunFile, FileRows]]:
    """``(file, its rows)`` for each of ``batch`` (one table and layout) from ``sql``, a SELECT of
    :func:`select_items` and ``file`` whose rows come file after file in ``batch``'s order
    (:func:`~trainprobe.tools.runs.read.stream_by_file`; a file without a row: empty rows). Used
    for the rank-local rows and for the full tensors of a sharded run
    (:mod:`~trainprobe.tools.reporting.full`).

    Raises:
        StreamError: DuckDB failed, or the rows are not file after file in order.
    """
    v2 = batch[0].layout == "v2"
    return stream_by_file(con, sql, batch, lambda table: _empty(0) if table is None else file_rows(table, ops, v2, 0))


def torn_rows(file: RunFile) -> int:
    """1 when ``file`` is a CSV file whose last record is torn (the query layer leaves it out), else 0."""
    return _torn(file)


def _torn(file: RunFile) -> int:
    """1 when ``file`` is a CSV file whose last record is torn, else 0."""
    return int(file.format == "csv" and (clean_length(file.path) or 0) > 0)


def op_columns(names: Sequence[str]) -> tuple[str, ...]:
    """The op columns among a view's ``names`` (neither keys, nor text, nor ``file``/``file_row``)."""
    return tuple(c for c in names if c not in KEY_COLUMNS and c not in TEXT_COLUMNS and c not in META_COLUMNS)


def select_items(ops: Sequence[str], names: Sequence[str]) -> str:
    """The SELECT list of the report's columns (see :func:`_items`)."""
    return _items(ops, names)


def _items(ops: Sequence[str], names: Sequence[str]) -> str:
    """The SELECT list of the report's columns (empty micro-step -1, empty op cell NaN)."""
    items = [
        "step",
        "coalesce(micro_step, -1) AS micro",
        "vpp_stage",
        "coalesce(name, '') AS name",
        "coalesce(scope, '') AS scope",
        *(f"coalesce({quote(op)}, CAST('nan' AS DOUBLE)) AS {quote('op_' + op)}" for op in ops),
        *(["shape"] if "shape" in names else []),
    ]
    return ", ".join(items)


def _codes(column: object) -> tuple[np.ndarray, list[str]]:
    """A text column (Arrow) as (per row an index into the distinct texts, the distinct texts)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    encoded = pc.dictionary_encode(column)
    if isinstance(encoded, pa.ChunkedArray):
        encoded = encoded.combine_chunks() if encoded.num_chunks != 1 else encoded.chunk(0)
    codes = encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    return codes, [str(t) for t in encoded.dictionary.to_pylist()]


def file_rows(got: object, ops: tuple[str, ...], v2: bool, torn: int) -> FileRows:
    """An Arrow table of :func:`select_items`' columns (from any engine) as :class:`FileRows`."""
    import pyarrow as pa

    table: pa.Table = got  # type: ignore[assignment]
    n = table.num_rows
    values = np.empty((n, len(ops)), dtype=np.float64)
    for column, op in enumerate(ops):
        values[:, column] = table.column("op_" + op).to_numpy()

    def ints(name: str) -> np.ndarray:
        return np.asarray(table.column(name).to_numpy(), dtype=np.int64)

    target_codes, target_names = _codes(table.column("name"))
    scope_codes, scope_names = _codes(table.column("scope")) if v2 else (None, None)
    shapes = [str(s) for s in table.column("shape").to_pylist()] if "shape" in table.column_names else None
    return FileRows(
        ops,
        ints("step"),
        ints("micro"),
        ints("vpp_stage"),
        values,
        target_codes,
        target_names,
        scope_codes,
        scope_names,
        shapes,
        torn,
    )


def _empty(torn: int) -> FileRows:
    none = np.zeros(0, dtype=np.int64)
    return FileRows((), none, none, none, np.zeros((0, 0)), none, [], None, None, None, torn)


def _reason(message: str) -> str:
    """DuckDB's error as one short line: ``not UTF-8 text`` for an encoding error."""
    from trainprobe.tools.query.layer import short_error

    flat = short_error(message)
    if "unicode" in flat.lower() or "utf-8" in flat.lower() or "utf8" in flat.lower():
        return f"not UTF-8 text ({flat[:200]})"
    return f"not a monitor file DuckDB can read ({flat[:300]})"


#: What :func:`stream_file_rows` raises when its stream fails or is out of order.
STREAM_ERRORS = (StreamError,)
