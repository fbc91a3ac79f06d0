"""The query layer on Apache Spark: the same views, columns and questions as on DuckDB
(:mod:`trainprobe.tools.query.layer`), over a run's Parquet files, for runs larger than one machine.

One definition of each query for both engines: queries and the views' column mappings are
written once in DuckDB's SQL dialect and transpiled to Spark SQL by sqlglot
(:func:`to_spark`); ``trainprobe query RUN "SQL" --engine spark`` transpiles the user's SQL the
same way. Spark reads Parquet only (``trainprobe convert RUN --to parquet`` first, or write
Parquet with ``"format": "parquet"``); a run's ``file`` column is the local path as on DuckDB
(Spark's ``file:`` URI prefix removed); ``file_row`` is the row's index in its Parquet file.

Needs the ``[spark]`` extra (``pip install 'trainprobe[spark]'``: pyspark, sqlglot) and Java
17 or later. :func:`spark_session` starts Spark in local mode; on a cluster pass your own session.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from trainprobe.engine.errors import ConfigError
from trainprobe.tools.runs.files import RunFile, find_run_files
from trainprobe.tools.sql.names import check_columns, hadoop_glob_literal
from trainprobe.tools.sql.names import ident as quote
from trainprobe.tools.sql.questions import KEY_COLUMNS, META_COLUMNS, TEXT_COLUMNS
from trainprobe.tools.sql.views import FILE_KEYS, projection_sql, rank_from_sql

SPARK_HINT = "pip install 'trainprobe[spark]'"


def _require(module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"--engine spark needs {module}, part of trainprobe's [spark] extra: {SPARK_HINT}") from None


def to_spark(sql: str) -> str:
    """``sql`` (DuckDB's dialect) as Spark SQL, by sqlglot, with four rewrites sqlglot does not
    make where Spark's SQL differs in meaning, not only in spelling (:func:`_spark_spelling`):

    * ``median(x)`` becomes ``percentile(x, 0.5)``: the same value (the mean of the two middle
      values for an even count), and unlike Spark's ``median`` usable over a window frame
      (``ROWS BETWEEN 10 PRECEDING AND 1 PRECEDING``, diagnose's spike rule);
    * a tuple ordering ``arg_min``/``arg_max`` (``arg_min(name, (file_row, k))``) becomes a
      ``struct``, which Spark compares field by field as DuckDB compares the tuple;
    * a ``regexp_replace`` replacement's groups ``\\1`` (RE2's, DuckDB's) become ``$1`` (Java's),
      a literal ``$`` becomes ``\\$`` (Spark's ``regexp_replace`` replaces every match, as DuckDB's
      with the ``'g'`` flag that sqlglot drops);
    * ``hash(x)`` becomes ``xxhash64(x)``: 64 bits like DuckDB's ``hash`` (Spark's ``hash`` has
      32, so keys made of it, such as ``trainprobe diff``'s file key, would collide far sooner).

    Raises:
        ConfigError: sqlglot cannot parse it (the message quotes sqlglot's).
    """
    sqlglot = _require("sqlglot")
    try:
        trees = sqlglot.parse(sql, read="duckdb")
    except sqlglot.errors.ParseError as exc:
        raise ConfigError(f"the SQL cannot be read: {' '.join(str(exc).split())}") from None
    return ";\n".join(tree.transform(_spark_spelling).sql(dialect="spark") for tree in trees if tree is not None)


def _spark_spelling(node: Any) -> Any:
    """One node of a DuckDB query as Spark must read it (see :func:`to_spark`)."""
    from sqlglot import exp

    if isinstance(node, exp.Median):
        return exp.Anonymous(this="percentile", expressions=[node.this.copy(), exp.Literal.number("0.5")])
    if isinstance(node, exp.Tuple) and isinstance(node.parent, (exp.ArgMin, exp.ArgMax)):
        return exp.Anonymous(this="struct", expressions=[e.copy() for e in node.expressions])
    if isinstance(node, exp.Anonymous) and str(node.this).lower() == "hash":
        return exp.Anonymous(this="xxhash64", expressions=[e.copy() for e in node.expressions])
    if isinstance(node, exp.Literal) and isinstance(node.parent, exp.RegexpReplace) and node.arg_key == "replacement":
        return exp.Literal.string(_java_replacement(node.this))
    return node


def _java_replacement(text: str) -> str:
    """An RE2 replacement (``\\1`` a group, ``\\\\`` a backslash) as Java's (``$1``, ``\\\\``, ``\\$``)."""
    import re

    def one(match: re.Match[str]) -> str:
        token = match.group(0)
        if token == "$":
            return "\\$"
        if token[1].isdigit():
            return "$" + token[1]
        return token  # \\ (a backslash) or \x: the same escape in Java

    return re.sub(r"\\.|\$", one, text)


#: Log4j 2 settings of the local sessions trainprobe starts (a file shipped with the package,
#: read by Spark's JVM; nothing is written): errors only, on stderr. Without them a start
#: prints Spark's startup warnings (the log4j profile in use, the host's loopback address,
#: Hadoop's native library) and its shell's advice on log levels (silenced by giving the shell's
#: loggers a level) on every ``--engine spark`` command. Errors still show.
LOG4J2 = Path(__file__).with_name("spark_log4j2.properties")


def spark_session(master: str = "local[2]") -> Any:
    """A Spark session in local mode (UI off, few shuffle partitions: small answers; its log
    errors only, :data:`LOG4J2`, when this call starts the JVM)."""
    sql = _require("pyspark.sql")
    session = (
        sql.SparkSession.builder.master(master)
        .appName("trainprobe-query")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile={LOG4J2.as_uri()}")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    return session


@contextmanager
def local_session() -> Iterator[Any]:
    """The process's active Spark session if there is one (left running), else one in local
    mode (:func:`spark_session`), stopped when the block ends: the command line's ``--engine
    spark`` never stops a session it did not start."""
    sql = _require("pyspark.sql")
    active = sql.SparkSession.getActiveSession()
    session = active if active is not None else spark_session()
    try:
        yield session
    finally:
        if active is None:
            session.stop()


def register_views(session: Any, run: str | Path, prefix: str = "") -> dict[str, list[tuple[str, str]]]:
    """One temporary view per table of ``run``'s Parquet files on ``session``, with the DuckDB
    views' columns; returns table → ``(column, Spark type)``. A table's view is named
    ``prefix + table`` (the table's name by default; ``trainprobe diff`` registers two runs, as
    ``__diff_b_module`` and ``__diff_c_module``).

    Raises:
        ConfigError: the run has CSV files only (the message says how to convert them).
    """
    files = find_run_files(run)
    parquet = [f for f in files if f.format == "parquet"]
    if not parquet:
        raise ConfigError(
            f"--engine spark reads Parquet files and {str(run)!r} has CSV only; convert it first: "
            f"trainprobe convert {run} --to parquet"
        )
    groups: dict[str, dict[str, list[RunFile]]] = {}
    for f in parquet:
        groups.setdefault(f.table, {}).setdefault(f.layout, []).append(f)
    out = {}
    for table, layouts in groups.items():
        frames = [_frame(session, table, layout, group, prefix) for layout, group in layouts.items()]
        frame = frames[0]
        for other in frames[1:]:
            frame = frame.unionByName(other, allowMissingColumns=True)
        frame = frame.select(*_ordered(frame.columns))
        frame.createOrReplaceTempView(prefix + table)
        out[table] = [(f.name, f.dataType.simpleString()) for f in frame.schema.fields]
    return out


def _ordered(columns: Sequence[str]) -> list[str]:
    ops = [c for c in columns if c not in KEY_COLUMNS and c not in TEXT_COLUMNS and c not in META_COLUMNS]
    return [*KEY_COLUMNS, *ops, *(c for c in TEXT_COLUMNS if c in columns), *META_COLUMNS]


def _frame(session: Any, table: str, layout: str, group: Sequence[RunFile], prefix: str = "") -> Any:
    raw = session.read.option("mergeSchema", "true").parquet(*[hadoop_glob_literal(str(f.path)) for f in group])
    header = list(raw.columns)
    check_columns(header, group[0].path, allowed=(*FILE_KEYS[layout], "micro_step"))
    raw = raw.selectExpr("*", "_metadata.file_path AS __file", "_metadata.row_index AS __row")
    source = f"__src_{prefix}{table}_{layout}"
    raw.createOrReplaceTempView(source)
    # Spark names a file by its URI: ``file:`` dropped, percent escapes (``run%5B1%5D``) decoded ('+' kept)
    file = "url_decode(replace(regexp_replace(__file, '^file:(//)?', ''), '+', '%2B'))"
    select = projection_sql(header, layout, table, rank_from_sql("__file", layout), file, "__row", nan_guard=True)
    return session.sql(to_spark(f"SELECT {select} FROM {quote(source)}"))


def spark_query(session: Any, run: str | Path, sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
    """Column names and rows of ``sql`` (DuckDB's dialect, transpiled) over ``run``'s views.

    Raises:
        ConfigError: ``sql`` is not one read-only query over the run's views (:func:`read_only`).
    """
    views = register_views(session, run)
    frame = session.sql(to_spark(read_only(sql, views)))
    return list(frame.columns), [tuple(row) for row in frame.collect()]


def spark_schema(session: Any, run: str | Path) -> list[tuple[Any, ...]]:
    """``(view, column, type)`` of every view of ``run`` on Spark."""
    return [(v, c, t) for v, cols in sorted(register_views(session, run).items()) for c, t in cols]


def read_only(sql: str, views: Iterable[str]) -> str:
    """``sql`` when it is one read-only query (``SELECT``, ``WITH``, ``VALUES``, set operations)
    whose tables are the run's ``views`` and the query's own ``WITH`` names; else a ConfigError.

    Spark has no setting that keeps SQL to a list of files (as DuckDB's ``allowed_paths``, see
    :mod:`~trainprobe.tools.engines.lock`), so user SQL is checked before it runs: no ``INSERT``,
    ``CREATE``, ``ADD JAR``, ``SET``; no ``parquet.`/path``` or other table outside the run. A
    result is written with ``-o/--output FILE``.

    Raises:
        ConfigError: one line saying what is refused.
    """
    sqlglot = _require("sqlglot")
    exp = sqlglot.exp
    try:
        statements = [s for s in sqlglot.parse(sql, read="duckdb") if s is not None]
    except sqlglot.errors.ParseError:
        try:  # Spark's own spelling (backquotes, ``parquet.`path```) is checked as Spark reads it
            statements = [s for s in sqlglot.parse(sql, read="spark") if s is not None]
        except sqlglot.errors.ParseError as exc:
            plain = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))  # sqlglot underlines the token in ANSI colour
            raise ConfigError(f"query: {' '.join(plain.split())[:300]}") from None
    if len(statements) != 1 or not isinstance(statements[0], exp.Query):
        raise ConfigError(
            "query: --engine spark runs one read-only query (SELECT, WITH ... SELECT, VALUES) over the run's views; "
            "write a result with -o/--output FILE"
        )
    known = set(views) | {cte.alias_or_name for cte in statements[0].find_all(exp.CTE)}
    for table in statements[0].find_all(exp.Table):
        if table.name and (table.db or table.catalog or table.name not in known):
            shown = table.sql(dialect="duckdb").encode("unicode_escape").decode("ascii")[:120]
            raise ConfigError(f"query: {shown} is not a view of this run (views: {', '.join(sorted(set(views)))})")
    return sql
