"""``trainprobe query RUN "SQL"`` and ``trainprobe convert RUN --to parquet``.

``query`` runs SQL against the views of :func:`trainprobe.tools.query.layer.connect` and prints the
result as an aligned table (``--csv``: CSV; ``--json``: one JSON object per row); ``--schema``
lists the views and their columns; ``--first-nonfinite`` prints the run's first NaN/inf in
execution order (:mod:`trainprobe.tools.sql.questions`). ``--engine spark`` runs the same SQL on
Apache Spark in local mode over the run's Parquet files (transpiled by sqlglot; the ``[spark]``
extra). Options may come before or after the run and the SQL.

The answer is **streamed**: rows are fetched :data:`BATCH_ROWS` at a time and printed as they
come, so the first rows appear before the query ends and memory is bounded by a batch, not by
the answer (``trainprobe query RUN "SELECT * FROM weight_grad" | head``). The aligned table
takes its column widths from the first batch (the header and up to :data:`BATCH_ROWS` rows) and
keeps them: a wider value later only widens its own line. When the reader of the output goes
away (``| head``), the command stops quietly (exit status 141, as every ``trainprobe`` command).

``-o FILE`` writes the answer to FILE instead, in the format of ``--csv``/``--json``/``--parquet``
or, without one, of FILE's suffix (``.csv``; ``.json`` or ``.jsonl``: JSON lines; ``.parquet``),
written by Python (the csv and json modules, pyarrow's ``ParquetWriter`` a batch at a time; the
DuckDB connection is locked and writes nothing) into a temporary file in FILE's folder that
replaces FILE when complete (:func:`~trainprobe.engine.sinks.files.write_atomically`), then
prints one line naming FILE and the rows written. A failed query leaves FILE as it was.

Every DuckDB, pyarrow or Spark error is one line on stderr and exit status 2, naming the file
where DuckDB names one. Names and values printed as a table go through
:func:`~trainprobe.engine.printable.printable` (control characters escaped, so a crafted module
name cannot rewrite the terminal); CSV printed to a terminal too; JSON escapes them itself; CSV
sent to a pipe or written with ``-o`` keeps the exact text.

``convert`` writes next to every CSV data file a Parquet file with the same name, columns and
rows (a torn last record left out), through DuckDB; ``--remove-csv`` deletes each CSV file once
its Parquet file is complete.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TextIO

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.printable import printable
from trainprobe.tools.query.layer import short_error
from trainprobe.tools.runs.options import add_engine_argument, add_output_argument, add_run_argument, intermixed

FIRST_COLUMNS = (
    "table", "stage", "step", "micro_step", "rank", "vpp_stage", "name", "scope", "op", "value", "file", "position"
)
"""The columns of ``--first-nonfinite``'s answer."""

BATCH_ROWS = 1000
"""Rows fetched and printed at a time; the aligned table's column widths come from the first batch."""

PARQUET_BATCH_ROWS = 1 << 16
"""Rows per Arrow batch (and Parquet row group) when ``-o`` writes Parquet."""

SUFFIX_FORMATS = {".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
"""The format ``-o FILE`` writes when no ``--csv``/``--json``/``--parquet`` is given."""

Batches = Iterator[list[tuple[Any, ...]]]


def add_parser(sub: Any) -> None:
    """Add the ``query`` and ``convert`` sub-commands to ``sub``."""
    query = sub.add_parser(
        "query",
        help="run SQL on a run's monitor output (CSV or Parquet, V1 or V2), no import step",
        description="Run SQL against one view per table of a run (weight_grad, module, optimizer, param, cc; "
        "V1's actv, grad_reduced, ...), columns rank, step, micro_step, vpp_stage, name, scope, one per op, "
        "file, file_row. The answer is streamed as it is computed. See docs/query.md. "
        "Needs: pip install 'trainprobe[query]'.",
    )
    intermixed(query)
    add_run_argument(query)
    query.add_argument("sql", nargs="?", help="the SQL to run (DuckDB's dialect)")
    what = query.add_mutually_exclusive_group()
    what.add_argument("--schema", action="store_true", help="list the views and their columns")
    what.add_argument(
        "--first-nonfinite", action="store_true", help="the first NaN/inf of the run in execution order"
    )
    form = query.add_mutually_exclusive_group()
    form.add_argument("--csv", action="store_true", help="CSV")
    form.add_argument("--json", action="store_true", help="one JSON object per line")
    form.add_argument("--parquet", action="store_true", help="Parquet (with -o only)")
    add_output_argument(
        query,
        "write the answer to FILE (atomically) instead of printing it; the format from --csv/--json/--parquet "
        "or FILE's suffix (.csv, .json/.jsonl: JSON lines, .parquet); prints the file and the rows written",
        metavar="FILE",
    )
    add_engine_argument(query, "duckdb (default) or spark (Parquet runs)")
    query.set_defaults(handler=_query_command)
    convert = sub.add_parser(
        "convert",
        help="convert a run's CSV files to Parquet (same names, columns and rows)",
        description="Write a .parquet file next to every monitor CSV file of RUN (either tool's layout). "
        "Needs: pip install 'trainprobe[query]'.",
    )
    add_run_argument(convert)
    convert.add_argument("--to", choices=("parquet",), default="parquet", help="target format (parquet)")
    convert.add_argument("--remove-csv", action="store_true", help="delete each CSV file once converted")
    convert.set_defaults(handler=_convert_command)


def _query_command(args: argparse.Namespace) -> int:
    if not args.schema and not args.first_nonfinite and not args.sql:
        raise ConfigError("query: give the SQL to run, or --schema, or --first-nonfinite")
    if args.sql and (args.schema or args.first_nonfinite):
        raise ConfigError(f"query: give the SQL or {'--schema' if args.schema else '--first-nonfinite'}, not both")
    flag = "csv" if args.csv else "json" if args.json else "parquet" if args.parquet else None
    if args.output is None:
        if flag == "parquet":
            raise ConfigError("--parquet: give the file to write with -o FILE (Parquet is not printed)")
        with open_answer(args.run, args.sql, schema=args.schema, first=args.first_nonfinite,
                         engine=args.engine) as answer:
            print_answer(answer, flag or "table", sys.stdout)
        return 0
    if "\0" in args.output:
        raise ConfigError("-o: the file name holds a NUL byte")
    target = Path(args.output).expanduser()
    _check_target(target, args.run)
    form = output_format(target, flag)
    with open_answer(args.run, args.sql, schema=args.schema, first=args.first_nonfinite,
                     engine=args.engine, arrow=form == "parquet") as answer:
        rows = write_answer(answer, form, target)
    print(f"wrote {rows} row{'s' if rows != 1 else ''} ({form}) to {printable(target)}")
    return 0


def output_format(target: Path, flag: str | None) -> str:
    """The format ``-o target`` writes: ``flag`` (``csv``, ``json``, ``parquet``) when given, else
    the one its suffix names (:data:`SUFFIX_FORMATS`).

    Raises:
        ConfigError: no flag and an unknown suffix, or a flag that the suffix contradicts
            (``--csv -o x.parquet``).
    """
    named = SUFFIX_FORMATS.get(target.suffix.lower())
    if flag is None:
        if named is None:
            raise ConfigError(
                f"-o {printable(target)}: say the format with --csv, --json or --parquet, "
                "or name the file .csv, .json, .jsonl or .parquet"
            )
        return named
    if named is not None and named != flag:
        raise ConfigError(f"-o {printable(target)}: the name says {named} but --{flag} was given")
    return flag


def _check_target(target: Path, run: str) -> None:
    """Refuse a folder, any data file of the run, and a monitor data file's name in the run's
    folders (the answer would replace monitor output, or be read as such next time)."""
    from trainprobe.engine.layout import V1_DATA_FILE, V1_RUN, V2_DATA_FILE, V2_RANK
    from trainprobe.tools.runs.files import NoRunFiles, find_run_files

    if target.is_dir():
        raise ConfigError(f"-o {printable(target)}: is a folder; give the file to write")
    resolved = target.resolve()
    root = Path(run).expanduser().resolve()
    folder = resolved.parent
    in_run = folder == root or (folder.parent == root and bool(V1_RUN.fullmatch(folder.name) or V2_RANK.fullmatch(folder.name)))
    if in_run and (V1_DATA_FILE.fullmatch(resolved.name) or V2_DATA_FILE.fullmatch(resolved.name)):
        raise ConfigError(f"-o {printable(target)}: a monitor data file's name in the run; choose another file")
    try:
        files = find_run_files(run, warn_links=False)
    except NoRunFiles:
        return  # the query itself says so
    if any(f.path.resolve() == resolved for f in files):
        raise ConfigError(f"-o {printable(target)}: is one of the run's data files; choose another file")


@dataclass
class Answer:
    """A query's answer, read while it is printed or written.

    Attributes:
        names: the column names.
        batches: the rows, a list of tuples at a time (at most :data:`BATCH_ROWS` each from
            DuckDB); None when ``arrow`` holds the answer.
        arrow: the answer as Arrow record batches (``-o`` Parquet from DuckDB), else None.
        schema: the Arrow schema of ``arrow``'s batches (None without ``arrow``).
    """

    names: list[str]
    batches: Batches | None = None
    arrow: Iterator[Any] | None = None
    schema: Any = None


def _duck_errors() -> tuple[type[BaseException], ...]:
    """The exception types DuckDB and pyarrow raise for bad SQL or bad files (pyarrow's only if
    it is imported already: nothing else can have raised one)."""
    errors: list[type[BaseException]] = []
    if "duckdb" in sys.modules:
        errors.append(sys.modules["duckdb"].Error)
    if "pyarrow" in sys.modules:
        errors.append(sys.modules["pyarrow"].ArrowException)
    return tuple(errors)


def _failed(exc: BaseException) -> ConfigError:
    return ConfigError(f"the SQL failed: {short_error(str(exc))}")


def _guarded(batches: Iterable[Any], also: tuple[type[BaseException], ...] = ()) -> Iterator[Any]:
    """``batches`` with each DuckDB/pyarrow error (and ``also``) raised while reading them as one
    ConfigError."""
    iterator = iter(batches)
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            return
        except (*_duck_errors(), *also) as exc:
            raise _failed(exc) from None
        yield batch


@contextmanager
def open_answer(
    run: str | Path,
    sql: str | None,
    *,
    schema: bool = False,
    first: bool = False,
    engine: str = "duckdb",
    arrow: bool = False,
) -> Iterator[Answer]:
    """The answer to ``sql`` on ``run`` (or the views with ``schema``, the first NaN/inf with
    ``first``), streamed while the context is open; ``arrow``: as Arrow batches
    (:attr:`Answer.arrow`, DuckDB SQL only) rather than Python rows.

    Raises:
        ConfigError: the SQL or a file of the run failed (one line: DuckDB's, pyarrow's or
            Spark's message, naming the file where DuckDB names one), or the engine is missing.
    """
    if engine == "spark":
        with _spark_answer(run, sql, schema=schema, first=first) as answer:
            yield answer
        return
    from trainprobe.tools.query.layer import require

    require("duckdb")  # or a ConfigError saying how to install it
    try:  # the answer is made here, and yielded outside: errors of the caller's body are its own
        answer = _duck_answer(run, sql, schema=schema, first=first, arrow=arrow)
    except _duck_errors() as exc:
        raise _failed(exc) from None
    yield answer


def _duck_answer(run: str | Path, sql: str | None, *, schema: bool, first: bool, arrow: bool) -> Answer:
    """:func:`open_answer` on DuckDB (its errors raised as they are)."""
    from trainprobe.tools.query.layer import connect, describe, first_nonfinite

    try:
        if first:  # no views of every file needed (a Parquet run: its footers only)
            found = first_nonfinite(run)
            return Answer(list(FIRST_COLUMNS), iter([[tuple(row.values()) for row in found]]))
        con = connect(run)
        if schema:
            described = describe(con, full=True)  # a sharded run's full-tensor views too
            rows = [(v, c, t) for v, cols in described.items() for c, t in cols]
            return Answer(["view", "column", "type"], iter([rows]))
    except _duck_errors() as exc:  # a file of the run, not the user's SQL
        raise ConfigError(f"cannot read the run: {short_error(str(exc))}") from None
    if arrow:
        relation = con.sql(str(sql))
        if relation is None:
            raise ConfigError("the SQL gives no answer to write")
        reader = relation.to_arrow_reader(PARQUET_BATCH_ROWS)  # DuckDB's errors come out of it as OSError
        return Answer(list(reader.schema.names), arrow=_guarded(reader, also=(OSError,)), schema=reader.schema)
    result = con.execute(str(sql))
    names = [d[0] for d in result.description or ()]
    return Answer(names, _guarded(iter(lambda: result.fetchmany(BATCH_ROWS), [])))


@contextmanager
def _spark_answer(run: str | Path, sql: str | None, *, schema: bool, first: bool) -> Iterator[Answer]:
    """:func:`open_answer` on Spark: the rows of ``toLocalIterator`` (a partition at a time)."""
    from trainprobe.tools.engines.spark import local_session, register_views

    with local_session() as session:
        views = register_views(session, run)
        if schema:
            rows = [(v, c, t) for v, cols in sorted(views.items()) for c, t in cols]
            yield Answer(["view", "column", "type"], iter([rows]))
            return
        yield _spark_rows(session, {v: [c for c, _ in cols] for v, cols in views.items()}, sql, first)


def _spark_failed(exc: Exception) -> ConfigError:
    return ConfigError(f"the SQL failed on Spark: {printable(' '.join(str(exc).split()))[:500]}")


def _spark_rows(session: Any, names: dict[str, list[str]], sql: str | None, first: bool) -> Answer:
    """The answer to ``sql`` (or the first NaN/inf) on ``session``, its rows streamed."""
    from trainprobe.tools.engines.spark import read_only, to_spark
    from trainprobe.tools.sql.questions import first_bad_step_sql, first_nonfinite_sql

    try:
        if first:
            step = session.sql(to_spark(first_bad_step_sql(names))).collect()[0][0]
            if step is None:
                return Answer(list(FIRST_COLUMNS), iter([]))
            frame = session.sql(to_spark(first_nonfinite_sql(names, step)))
        else:  # the user's SQL: one read-only query over the run's views (Spark has no file lock)
            frame = session.sql(to_spark(read_only(str(sql), names)))
        columns = list(frame.columns)
        rows = frame.toLocalIterator()
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - pyspark's errors share no base class worth naming
        raise _spark_failed(exc) from None

    def batches() -> Batches:
        batch: list[tuple[Any, ...]] = []
        try:
            for row in rows:
                batch.append(tuple(row))
                if len(batch) == BATCH_ROWS:
                    yield batch
                    batch = []
        except Exception as exc:  # noqa: BLE001 - as above
            raise _spark_failed(exc) from None
        if batch:
            yield batch

    return Answer(columns, batches())


def _row_batches(answer: Answer) -> Batches:
    """The answer's rows a batch at a time (from its Arrow batches when it has those)."""
    if answer.batches is not None:
        yield from answer.batches
    elif answer.arrow is not None:
        for batch in answer.arrow:
            yield list(zip(*(column.to_pylist() for column in batch.columns)))


def print_answer(answer: Answer, form: str, out: TextIO) -> int:
    """Print ``answer`` to ``out`` as ``form``: ``table`` (aligned, widths from the first batch,
    a last line ``(N rows)``, names and values through :func:`printable`), ``csv`` (control
    characters escaped when ``out`` is a terminal) or ``json`` (one object per line, NaN/inf as
    the strings ``nan``/``inf``); ``out`` is flushed after each batch. Returns the rows printed."""
    if form == "table":
        return _print_table(answer, out)
    escape = form == "csv" and _is_terminal(out)
    return _write_text(answer, form, out, escape=escape, flush=True)


def _is_terminal(out: TextIO) -> bool:
    try:
        return out.isatty()
    except (AttributeError, ValueError):  # a closed or unusual stream
        return False


def _print_table(answer: Answer, out: TextIO) -> int:
    """The rows as an aligned table (:class:`~trainprobe.tools.console.StreamedTable`), then ``(N rows)``."""
    from trainprobe.tools.console import StreamedTable

    table = StreamedTable(out, answer.names)
    for batch in _row_batches(answer):
        table.write([_cells(row) for row in batch])
    table.close()
    out.write(f"({table.rows} row{'s' if table.rows != 1 else ''})\n")
    out.flush()
    return table.rows


def _cells(row: Sequence[Any]) -> list[str]:
    """A row's values as text: NULL for None, ``repr`` for floats (``nan``, ``inf``, every digit)."""
    return ["NULL" if v is None else repr(v) if isinstance(v, float) else str(v) for v in row]


_JSON_AS_IS = frozenset({int, str, bool, type(None)})


def _write_text(answer: Answer, form: str, out: TextIO, *, escape: bool = False, flush: bool = False) -> int:
    """Write ``answer`` as CSV (a header line, NULL as ``NULL``; ``escape``: every cell through
    :func:`printable`) or JSON lines; ``flush``: ``out`` after each batch. Returns the rows."""
    count = 0
    if form == "csv":
        out.write(_csv_text([[printable(n) for n in answer.names] if escape else list(answer.names)]))
        for batch in _row_batches(answer):
            cells = [_cells(row) for row in batch]
            out.write(_csv_text([[printable(c) for c in row] for row in cells] if escape else cells))
            count += len(batch)
            if flush:
                out.flush()
        return count
    names = answer.names
    encode = json.JSONEncoder().encode  # ensure_ascii: control characters written as \u001b
    for batch in _row_batches(answer):
        out.write(
            "".join(
                encode({n: v if type(v) in _JSON_AS_IS else _json_value(v) for n, v in zip(names, row)}) + "\n"
                for row in batch
            )
        )
        count += len(batch)
        if flush:
            out.flush()
    return count


def _csv_text(rows: Sequence[Sequence[str]]) -> str:
    """``rows`` as CSV lines ending ``\\n``, a cell quoted when it holds ``,``, ``"``, ``\\n`` or
    ``\\r`` (the csv module, ending lines with ``\\n``, would leave a lone ``\\r`` unquoted, and
    readers would take it for a line end)."""
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerows(rows)
    text = buffer.getvalue()
    if "\r" not in text:
        return text
    lines = []
    for row in rows:  # rare: rows holding \r, written with \r\n line ends (which quotes \r) then cut
        buffer = io.StringIO()
        csv.writer(buffer, lineterminator="\r\n").writerow(row)
        lines.append(buffer.getvalue()[:-2] + "\n")
    return "".join(lines)


def write_answer(answer: Answer, form: str, target: Path) -> int:
    """Write ``answer`` to ``target`` as ``form`` (``csv``, ``json``: JSON lines, ``parquet``),
    atomically (:func:`~trainprobe.engine.sinks.files.write_atomically`: a temporary file in
    ``target``'s folder, renamed over it when complete; on an error it is removed and ``target``
    is left as it was). Returns the rows written."""
    from trainprobe.engine.sinks.files import write_atomically

    written = [0]

    def fill(handle: BinaryIO) -> None:
        if form == "parquet":
            written[0] = _write_parquet(answer, handle)
            return
        text = io.TextIOWrapper(handle, encoding="utf-8", newline="")  # type: ignore[arg-type]
        try:
            written[0] = _write_text(answer, form, text)
            text.flush()
        finally:
            text.detach()  # the handle stays open for write_atomically's fsync

    write_atomically(target, fill, field="-o")
    return written[0]


def _write_parquet(answer: Answer, handle: BinaryIO) -> int:
    """Write ``answer`` as Parquet into ``handle``: its Arrow batches one row group each; an
    answer of Python rows (``--schema``, ``--first-nonfinite``, Spark) is collected and its
    column types inferred by pyarrow."""
    from trainprobe.tools.query.layer import require

    pa, pq = require("pyarrow"), require("pyarrow.parquet")
    count = 0
    try:
        if answer.arrow is None:
            rows = [row for batch in _row_batches(answer) for row in batch]
            columns = [pa.array([row[i] for row in rows]) for i in range(len(answer.names))]
            table = pa.Table.from_arrays(columns, names=list(answer.names))
            pq.write_table(table, handle)
            return len(rows)
        with pq.ParquetWriter(handle, answer.schema) as writer:  # no rows: a file with the columns only
            for batch in answer.arrow:
                writer.write_batch(batch)
                count += batch.num_rows
    except pa.ArrowException as exc:
        raise ConfigError(f"writing Parquet failed: {short_error(str(exc))}") from None
    return count


def _json_value(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return str(value)


def _convert_command(args: argparse.Namespace) -> int:
    from trainprobe.tools.query.convert import convert_run

    done = convert_run(args.run, remove_csv=args.remove_csv)
    for path in done:
        print(f"wrote {printable(path)}")
    print(f"converted {len(done)} CSV file(s) to Parquet under {printable(args.run)}")
    return 0
