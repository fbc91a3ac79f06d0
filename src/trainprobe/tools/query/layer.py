"""One query layer over every run: a run folder in, a DuckDB connection out (public API).

:func:`connect` finds the data files of a run (:func:`~trainprobe.tools.runs.files.find_run_files`:
Monitor V2 ``output_dir`` or Monitor V1 ``MONITOR_OUTPUT_DIR``, trainprobe's or the reference
msProbe's files, CSV or Parquet, in any mix) and defines one view per table on a DuckDB
connection: ``weight_grad``, ``module``, ``optimizer``, ``param``, ``cc`` for V2; ``actv``,
``actv_grad``, ``grad_reduced``, ... for V1. Every view has the same columns:

==============  ========  ==============================================================
``rank``        BIGINT    the rank that wrote the row (from its folder's name)
``step``        BIGINT    the training step
``micro_step``  BIGINT    the micro-batch; NULL where the table has none (or the cell is empty)
``vpp_stage``   BIGINT    the virtual pipeline chunk (V2 writes -1 without chunks)
``name``        VARCHAR   the module or parameter (V2 ``module_name``; V1 ``name`` without the
                          ``<vpp_stage>:`` chunk prefix trainprobe's earlier V1 writer added)
``scope``       VARCHAR   V2: the row's scope (``forward``, ``reduced``, ...); V1: the table
<ops>           DOUBLE    one column per op in the files (``min``, ``max``, ``norm``, ``nans``,
                          ...): ``nan``/``inf`` kept, an empty cell NULL; a file without the
                          op gives NULL
``shape``       VARCHAR   V1 only, where the files have them (the reference's ``shape,dtype``)
``dtype``       VARCHAR
``file``        VARCHAR   the file the row was read from (provenance)
``file_row``    BIGINT    increases with the row's place in its file: compare it only between
                          rows of one file (Parquet: the row's index; CSV: a count over a few
                          consecutive files, read in parallel with other such groups)
==============  ========  ==============================================================

No import step: the files are scanned where they are, in parallel, with DuckDB's projection and
filter push-down (a filter on ``file`` skips whole files; Parquet row groups are skipped by their
statistics). A CSV file whose last record is torn (a run killed or still writing) is read without
that record: its complete part is copied once into a temporary table of the connection. Empty
files and files whose header line is not complete yet are left out.

The connection is DuckDB's own: ``con.sql(...).df()`` (pandas), ``.pl()`` (polars),
``.arrow()`` (Arrow) work as usual. Needs the ``[query]`` extra (``pip install 'trainprobe[query]'``).

Example::

    from trainprobe.tools.query.layer import connect
    con = connect("monitor_output")
    print(con.sql("SELECT step, max(norm) FROM weight_grad GROUP BY step ORDER BY step").df())
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.log import warn_once
from trainprobe.engine.printable import printable
from trainprobe.engine.sinks.parquet_summary import Summary, read_summary
from trainprobe.tools.engines.lock import is_locked, lock
from trainprobe.tools.runs.files import RunFile, check_unchanged, clean_length, csv_header, find_run_files, torn_tail
from trainprobe.tools.sql.names import check_columns, file_list
from trainprobe.tools.sql.names import ident as quote
from trainprobe.tools.sql.names import text as literal
from trainprobe.tools.sql.questions import (
    KEY_COLUMNS,
    META_COLUMNS,
    TEXT_COLUMNS,
    first_bad_step_sql,
    first_nonfinite_sql,
)
from trainprobe.tools.sql.views import (
    FILE_KEYS,
    csv_type,
    projection_sql,
    rank_from_sql,
    read_csv_sql,
    view_columns,
)

if TYPE_CHECKING:
    import duckdb

INSTALL_HINT = "pip install 'trainprobe[query]'"


def require(module: str = "duckdb") -> Any:
    """``module`` imported, or a ConfigError saying in one line how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"this needs {module}, part of trainprobe's [query] extra: {INSTALL_HINT}") from None


def connect(
    run: str | Path,
    connection: duckdb.DuckDBPyConnection | None = None,
    steps: tuple[int, int] | None = None,
    files: Sequence[RunFile] | None = None,
    *,
    locked: bool = True,
) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection (``connection``, else a new in-memory one) with one view per table of
    ``run`` (see the module docstring for the columns); with ``steps`` (first, last), over only
    the files whose window (from their names) meets that range; ``files``: the run's files, found
    already (:func:`~trainprobe.tools.runs.files.find_run_files`), else found here.

    A connection made here is **locked** to the run (:func:`~trainprobe.tools.engines.lock.lock`):
    it reads the run's files only, writes nothing and its settings are frozen, so SQL run on it
    (yours, or anything a crafted file might smuggle in) cannot read or change anything else.
    ``locked=False`` leaves it open (your own code may then ``COPY`` results where it likes); a
    ``connection`` you pass is never locked here.

    Raises:
        ConfigError: ``run`` holds no data file; a CSV header names a column twice or lacks the
            layout's key columns; DuckDB or PyArrow is not installed (the message says how to
            install them).
    """
    return _connect(run, connection, steps, files, locked=locked)[0]


def _connect(
    run: str | Path,
    connection: duckdb.DuckDBPyConnection | None = None,
    steps: tuple[int, int] | None = None,
    files: Sequence[RunFile] | None = None,
    headers: Mapping[Path, tuple[str, ...]] | None = None,
    locked: bool = True,
) -> tuple[duckdb.DuckDBPyConnection, dict[str, list[str]], list[RunFile]]:
    """:func:`connect`, also returning each view's columns (no ``DESCRIBE`` needed) and the run's
    files (before the ``steps`` selection; ``files``: those, already found; ``headers``: the
    columns of Parquet files, known from their summaries)."""
    duck = require("duckdb")
    con = connection if connection is not None else duck.connect()
    if not is_locked(con):
        con.execute("SET parquet_metadata_cache = true")  # the footers read for the views serve the queries
    found = list(files) if files is not None else find_run_files(run)
    chosen = found
    if steps is not None:
        chosen = [f for f in found if f.first_step <= steps[1] and steps[0] <= f.last_step]
    check_unchanged(chosen)  # DuckDB opens the paths as given: each must still be the file found, inside the run
    by_table: dict[str, list[RunFile]] = {}
    for f in chosen:
        by_table.setdefault(f.table, []).append(f)
    views: dict[str, list[str]] = {}
    for table, group in by_table.items():
        made = table_sql(con, table, group, headers)
        if made is not None:
            view, views[table] = made
            con.execute(f"CREATE OR REPLACE VIEW {quote(table)} AS {view}")
    if str(run) and views:
        from trainprobe.tools.sql.full import add_full_views

        add_full_views(con, Path(run).expanduser().absolute(), views)  # not in ``views``: the tools' SQL reads rank-local rows
    if connection is None and locked:
        lock(con, (f.path for f in found))
    return con, views, found


def short_error(text: str) -> str:
    """DuckDB's error message on one line, without its list of reader options (the file named)
    and without the SQL it quotes (``LINE 1: ...`` and its caret line: trainprobe's own query,
    no help to the reader), control characters escaped."""
    text = text.split("\nLINE ", 1)[0]
    flat = printable(" ".join(text.split()))
    marker = next((m for m in ("Possible solutions", "Possible fixes") if m in flat), None)
    if marker is None:
        return flat
    head = flat.split(marker)[0].strip()
    file = re.search(r" file = (\S+)", flat)
    return f"{head} (file {file[1]})" if file else head


def table_sql(
    con: duckdb.DuckDBPyConnection,
    table: str,
    files: Sequence[RunFile],
    headers: Mapping[Path, tuple[str, ...]] | None = None,
) -> tuple[str, list[str]] | None:
    """The SELECT of one view over ``files`` (all of one table) and the view's columns, or None
    when none has rows yet. ``headers``: the columns of Parquet files, known already (from their
    footers' summaries), so that their footers need not be read here."""
    parts: list[str] = []
    columns: list[str] = []
    csv_groups: dict[tuple[str, tuple[str, ...]], list[RunFile]] = {}
    for f in files:
        if f.format == "parquet":
            continue
        header = csv_header(f.path)
        if header is None:
            warn_once(f"query-empty:{f.path}", f"{f.path}: no complete header yet (a run that is starting?), skipped")
            continue
        _check_header(header, f)
        cut = clean_length(f.path)
        if cut is None:
            csv_groups.setdefault((f.layout, header), []).append(f)
        elif cut > len(",".join(header)) + 1:
            parts.append(_torn_part(con, f, header, cut))
            _merge(columns, view_columns(header, f.layout))
    pieces = CSV_PIECES_PER_THREAD * _threads(con) if csv_groups else 1
    for (layout, header), group in csv_groups.items():
        parts.append(_csv_part(group, header, layout, table, pieces))
        _merge(columns, view_columns(header, layout))
    by_layout: dict[tuple[str, tuple[str, ...] | None], list[RunFile]] = {}
    for f in files:
        if f.format == "parquet":
            known = headers.get(f.path) if headers is not None else None
            by_layout.setdefault((f.layout, known), []).append(f)
    for (layout, known), group in by_layout.items():
        part, names = _parquet_part(con, group, layout, table, known)
        parts.append(part)
        _merge(columns, names)
    if not parts:
        return None
    ops = [c for c in columns if c not in KEY_COLUMNS and c not in TEXT_COLUMNS and c not in META_COLUMNS]
    text = [c for c in TEXT_COLUMNS if c in columns]
    names = [*KEY_COLUMNS, *ops, *text, *META_COLUMNS]
    select = ", ".join(quote(c) for c in names)
    body = "\nUNION ALL BY NAME\n".join(f"({p})" for p in parts)
    return f"SELECT {select} FROM (\n{body}\n)", names


def _merge(columns: list[str], names: Iterable[str]) -> None:
    for name in names:
        if name not in columns:
            columns.append(name)


def _check_header(header: tuple[str, ...], f: RunFile) -> None:
    check_columns(header, f.path, allowed=(*FILE_KEYS[f.layout], "micro_step"))
    if len(set(header)) != len(header):
        twice = next(h for h in header if header.count(h) > 1)
        raise ConfigError(f"{f.path}: the header names column {twice!r} twice; a monitor file names each once")
    missing = [k for k in FILE_KEYS[f.layout] if k not in header]
    if missing:
        raise ConfigError(f"{f.path}: header {list(header)[:12]} lacks {missing}; is this a monitor file?")


#: CSV scans per DuckDB thread over the files of one view (see :func:`_csv_part`): 4 took the
#: spike scan of ``trainprobe diagnose`` (2 M rows, 128 files) from 3.0 s to 2.2 s on 2 cores,
#: its row-numbered scan from 0.78 s to 0.29 s.
CSV_PIECES_PER_THREAD = 4
#: ``file_row`` offset between two scans of one view: room for 2**40 rows a scan.
_PIECE_ROWS = 1 << 40


def _csv_part(group: Sequence[RunFile], header: tuple[str, ...], layout: str, table: str, pieces: int = 1) -> str:
    """The SELECT over CSV files ``group`` (one header), as up to ``pieces`` scans of consecutive
    files. A row number (``WITH ORDINALITY``) makes DuckDB read one scan on one thread; several
    scans are read side by side. ``file_row`` is a scan's row number plus the scan's index times
    :data:`_PIECE_ROWS`: it still grows in the order of the files listed and of their lines."""
    size = -(-len(group) // max(1, pieces))
    scans = []
    for index, first in enumerate(range(0, len(group), size)):
        source = read_csv_sql([str(f.path) for f in group[first : first + size]], header)
        row = f"ordinality - 1 + {index * _PIECE_ROWS}" if index else "ordinality - 1"
        select = projection_sql(header, layout, table, rank_from_sql("filename", layout), "filename", row)
        scans.append(f"SELECT {select} FROM {source}")
    return scans[0] if len(scans) == 1 else "\nUNION ALL\n".join(f"({scan})" for scan in scans)


def _threads(con: duckdb.DuckDBPyConnection) -> int:
    """DuckDB's threads on ``con`` (asked on a cursor of its own: ``con`` may be streaming a result)."""
    cursor = con.cursor()
    try:
        [(threads,)] = cursor.execute("SELECT current_setting('threads')").fetchall()
        return max(1, int(threads))
    finally:
        cursor.close()


def _torn_part(con: duckdb.DuckDBPyConnection, f: RunFile, header: tuple[str, ...], cut: int) -> str:
    """A temporary table holding the complete records (the first ``cut`` bytes) of a CSV file
    whose last one is torn. They are parsed in memory (pyarrow, the types of :func:`~trainprobe.tools.sql.views.csv_type`),
    so nothing is written to disk and the connection needs no file beyond the run's."""
    import io

    pa, csv = require("pyarrow"), require("pyarrow.csv")
    tail = torn_tail(f.path)
    if tail is not None and tail.quote_open and tail.lines > 1:  # not a torn record: a damaged file
        warn_once(f"torn:{f.path}", f"{f.path}: an unbalanced quote on or after line {tail.first_line} cut the file: "
                  f"{tail.lines} line(s) from there on left out")
    else:
        warn_once(f"torn:{f.path}", f"{f.path}: skipped 1 torn row(s) (a run killed while writing?)")
    kinds = {"BIGINT": pa.int64(), "VARCHAR": pa.string(), "DOUBLE": pa.float64()}
    with open(f.path, "rb") as handle:
        data = handle.read(cut)
    try:
        rows = csv.read_csv(
            io.BytesIO(data),
            parse_options=csv.ParseOptions(newlines_in_values=True),
            convert_options=csv.ConvertOptions(
                column_types={h: kinds[csv_type(h)] for h in header}, null_values=[""], strings_can_be_null=True
            ),
        )
    except pa.ArrowInvalid as exc:
        raise ConfigError(f"{f.path}: {' '.join(str(exc).split())[:300]}") from None
    rows = rows.append_column("ordinality", pa.array(range(1, rows.num_rows + 1), pa.int64()))
    name = f"__torn_{abs(hash(str(f.path)))}"
    source = f"{name}_rows"
    con.register(source, rows)
    try:
        select = projection_sql(header, layout=f.layout, table=f.table, rank=str(f.rank), file=literal(str(f.path)),
                             row="ordinality - 1")
        con.execute(f"CREATE OR REPLACE TEMP TABLE {quote(name)} AS SELECT {select} FROM {quote(source)}")
    finally:
        con.unregister(source)
    return f"SELECT * FROM {quote(name)}"


def _parquet_part(
    con: duckdb.DuckDBPyConnection,
    group: Sequence[RunFile],
    layout: str,
    table: str,
    header: tuple[str, ...] | None = None,
) -> tuple[str, list[str]]:
    """The SELECT over Parquet files ``group``; ``header``: their columns (all the same), known
    already; else read from their footers (the union of their columns)."""
    listed = file_list(str(f.path) for f in group)
    if header is None:
        source = f"read_parquet({listed}, union_by_name=true, filename=true, file_row_number=true)"
        described = con.execute(f"DESCRIBE SELECT * FROM read_parquet({listed}, union_by_name=true)").fetchall()
        header = tuple(str(row[0]) for row in described)
    else:
        source = f"read_parquet({listed}, filename=true, file_row_number=true)"
    _check_header(header, group[0])
    select = projection_sql(
        header, layout, table, rank_from_sql("filename", layout), "filename", "file_row_number", nan_guard=True
    )
    return f"SELECT {select} FROM {source}", view_columns(header, layout)


def describe(con: duckdb.DuckDBPyConnection, full: bool = False) -> dict[str, list[tuple[str, str]]]:
    """Every view of ``con``: name → its columns as ``(name, type)``, views in name order; the
    full-tensor views (:mod:`~trainprobe.tools.sql.full`) only with ``full``."""
    from trainprobe.tools.sql.full import FULL_COMMENT

    skip = "" if full else f" AND comment IS DISTINCT FROM {literal(FULL_COMMENT)}"
    views = [
        row[0]
        for row in con.execute(f"SELECT view_name FROM duckdb_views() WHERE NOT internal{skip} ORDER BY 1").fetchall()
    ]
    return {v: [(str(r[0]), str(r[1])) for r in con.execute(f"DESCRIBE {quote(v)}").fetchall()] for v in views}


def first_nonfinite(
    run: str | Path | duckdb.DuckDBPyConnection, limit: int = 1, files: Sequence[RunFile] | None = None
) -> list[dict[str, Any]]:
    """The first non-finite rows of a run in execution order, as dicts (empty when none), from
    the queries of :mod:`trainprobe.tools.sql.questions`: the first step with a non-finite row over
    every file, then that step's rows in order.

    Given the run's folder: a run of Parquet files trainprobe wrote (its sink or ``convert``)
    is answered from the summaries in their footers
    (:mod:`~trainprobe.engine.sinks.parquet_summary`): the first step is the smallest first
    non-finite step they name, and only the files naming that step are read, in one query (a
    summary whose file's row count differs, or which that query does not bear out, sends the
    run down the row path below). Other
    runs of Parquet files ask one query, the first step's query nested in the second (Parquet
    row groups of other steps are skipped by their statistics); when the run has CSV files, two
    queries, the second over views of the CSV files whose window holds that step only (CSV has
    no statistics to skip other steps by). Given a connection (views from :func:`connect`), two
    queries on that connection's views. ``files``: the run
    folder's files, found already (:func:`~trainprobe.tools.runs.files.find_run_files`)."""
    if hasattr(run, "execute"):
        con: duckdb.DuckDBPyConnection = run  # type: ignore[assignment]
        views = {v: [c for c, _ in cols] for v, cols in describe(con).items()}
        files = None  # a connection: no files to narrow the second query to
    else:
        files = list(files) if files is not None else find_run_files(run)  # type: ignore[arg-type]
        found = summaries(files) if all(f.format == "parquet" for f in files) else None
        answer = _first_nonfinite_from_summaries(found, files, limit) if found is not None else None
        if answer is not None:
            return answer
        con, views, files = _connect(run, files=files)  # type: ignore[arg-type]
    if not views:
        return []
    if files is not None and all(f.format == "parquet" for f in files):
        return _dicts(con.execute(first_nonfinite_sql(views, None, limit)))  # the first bad step nested
    [(step,)] = con.execute(first_bad_step_sql(views)).fetchall()
    if step is None:
        return []
    if files is not None and any(f.format == "csv" and f.first_step <= step <= f.last_step for f in files):
        con, views, _ = _connect(run, steps=(step, step), files=files)  # type: ignore[arg-type]
    return _dicts(con.execute(first_nonfinite_sql(views, step, limit)))


def summaries(files: Sequence[RunFile]) -> dict[Path, Summary] | None:
    """The summaries in the footers of Parquet ``files``
    (:func:`~trainprobe.engine.sinks.parquet_summary.read_summary`), or None when a file has
    none (not written by trainprobe, or by an older one, or rewritten since)."""
    out: dict[Path, Summary] = {}
    for f in files:
        summary = read_summary(f.path)
        if summary is None:
            return None
        out[f.path] = summary
    return out


def _first_nonfinite_from_summaries(
    found: Mapping[Path, Summary], files: Sequence[RunFile], limit: int
) -> list[dict[str, Any]] | None:
    """:func:`first_nonfinite` of a run of Parquet ``files`` with summaries ``found``: no DuckDB
    when no file names a non-finite step; else one query over the files naming the first such
    step (no other file has a non-finite row at that step). None when that query finds no
    non-finite row there or fails (a summary the file does not bear out: the caller reads every
    row)."""
    steps = [s.first_bad_step for s in found.values() if s.first_bad_step is not None]
    if not steps:
        return []
    step = min(steps)
    chosen = [f for f in files if found[f.path].first_bad_step == step]
    duck = require("duckdb")
    try:
        con, views, _ = _connect("", files=chosen, headers={f.path: found[f.path].columns for f in chosen})
        answer = _dicts(con.execute(first_nonfinite_sql(views, step, limit)))
    except (duck.Error, ConfigError):  # columns other than the summary's: the row path says what is wrong
        return None
    return answer or None  # None: a summary the rows do not bear out (a file changed since)


def _dicts(result: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
    names = [d[0] for d in result.description]
    return [dict(zip(names, row)) for row in result.fetchall()]
