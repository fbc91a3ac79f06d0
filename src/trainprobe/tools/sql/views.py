"""The SQL that maps one data file's columns onto a view's (DuckDB's dialect; Spark reads it
through :func:`~trainprobe.tools.engines.spark.to_spark`): the pieces the query layer
(:mod:`trainprobe.tools.query.layer`), the batched reader (:mod:`trainprobe.tools.runs.read`),
``convert`` and the Spark views are built from.

* :func:`read_csv_sql`: the typed ``read_csv`` of a literal file list;
* :func:`projection_sql`: the SELECT list that turns a file's columns (V1's ``name``, V2's
  ``module_name`` and ``scope``, the ops) into the view's columns
  (:data:`~trainprobe.tools.sql.questions.KEY_COLUMNS`, the ops, ``file``, ``file_row``);
* :func:`rank_from_sql`: the rank, from the file's path.

Standard library only. Example::

    >>> read_csv_sql(["/run/rank_0/module_step0-9.csv"], ("vpp_stage", "step"), ordinality=False)[:30]
    "read_csv(['/run/rank_0/module_"
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from trainprobe.tools.sql.names import file_list, ident, text
from trainprobe.tools.sql.questions import KEY_COLUMNS, META_COLUMNS, TEXT_COLUMNS

FILE_KEYS: dict[str, tuple[str, ...]] = {"v1": ("vpp_stage", "name", "step"), "v2": ("vpp_stage", "step", "module_name", "scope")}
"""The key columns a data file of each layout has (``micro_step`` where the table has one)."""
INT_COLUMNS: tuple[str, ...] = ("vpp_stage", "step", "micro_step")
"""A file's integer columns."""
RANK_PATTERN: dict[str, str] = {
    "v1": r"-rank([0-9]+)-[^/\\]*[/\\][^/\\]+$",
    "v2": r"[/\\]rank_([0-9]+)[/\\][^/\\]+$",
}
"""Per layout, the regular expression whose group 1 is the rank in a data file's path."""


def csv_type(column: str) -> str:
    """The SQL type a CSV data file's ``column`` is read as: ``BIGINT`` (:data:`INT_COLUMNS`),
    ``VARCHAR`` (names, scope, shape, dtype) or ``DOUBLE`` (an op)."""
    if column in INT_COLUMNS:
        return "BIGINT"
    if column in ("name", "module_name", "scope", *TEXT_COLUMNS):
        return "VARCHAR"
    return "DOUBLE"


def read_csv_sql(paths: Sequence[str], header: Sequence[str], ordinality: bool = True) -> str:
    """The typed ``read_csv`` of the files ``paths`` (a literal list, never a pattern), all with
    ``header`` (types of :func:`csv_type`; a ``filename`` column added); ``ordinality``: with a
    row number column (``WITH ORDINALITY``, which makes DuckDB read the scan on one thread)."""
    types = ", ".join(f"{text(h)}: {text(csv_type(h))}" for h in header)
    return (
        f"read_csv({file_list(paths)}, header=true, filename=true, auto_detect=false, delim=',', quote='\"', "
        f"escape='\"', columns={{{types}}})" + (" WITH ORDINALITY" if ordinality else "")
    )


def op_sql(column: str, nan_guard: bool) -> str:
    """An op column (quoted already) as DOUBLE; with ``nan_guard`` (Parquet) through a CASE that
    hides the column's statistics: pyarrow (per the Parquet spec) leaves NaN out of a column's
    min/max, and DuckDB 2.0 then prunes ``isnan(...)`` filters on them, so a NaN written by
    pyarrow was never found."""
    if not nan_guard:
        return f"CAST({column} AS DOUBLE)"
    return f"CASE WHEN isnan({column}) THEN CAST('nan' AS DOUBLE) ELSE CAST({column} AS DOUBLE) END"


def projection_sql(
    header: Iterable[str], layout: str, table: str, rank: str, file: str, row: str, nan_guard: bool = False
) -> str:
    """The SELECT list mapping a file's columns (``header``, checked by
    :func:`~trainprobe.tools.sql.names.check_columns`) onto view ``table``'s: ``rank``, ``file``
    and ``row`` are the SQL of the rank, the file's path and the row's number; V1's chunk prefix
    ``<vpp_stage>:`` is taken off its names; ``nan_guard``: see :func:`op_sql`."""
    header = list(header)
    if layout == "v2":
        name, scope = ident("module_name"), ident("scope")
    else:
        vpp = "CAST(vpp_stage AS VARCHAR) || ':'"
        name = f"CASE WHEN starts_with(name, {vpp}) THEN substr(name, length({vpp}) + 1) ELSE name END"
        scope = text(table)
    micro = "CAST(micro_step AS BIGINT)" if "micro_step" in header else "CAST(NULL AS BIGINT)"
    file_keys = {*FILE_KEYS[layout], "micro_step"}
    values = [
        f"{ident(h)}::VARCHAR AS {ident(h)}" if h in TEXT_COLUMNS else f"{op_sql(ident(h), nan_guard)} AS {ident(h)}"
        for h in header
        if h not in file_keys
    ]
    keys = [
        f"{rank} AS rank",
        "CAST(step AS BIGINT) AS step",
        f"{micro} AS micro_step",
        "CAST(vpp_stage AS BIGINT) AS vpp_stage",
        f"{name} AS name",
        f"{scope} AS scope",
    ]
    return ", ".join([*keys, *values, f"{file} AS file", f"{row} AS file_row"])


def rank_from_sql(column: str, layout: str) -> str:
    """The rank (BIGINT) in the path held by ``column`` (:data:`RANK_PATTERN`)."""
    return f"CAST(regexp_extract({column}, {text(RANK_PATTERN[layout])}, 1) AS BIGINT)"


def view_columns(header: Sequence[str], layout: str) -> list[str]:
    """The view's column names a file with ``header`` provides (keys, its ops, provenance)."""
    file_keys = {*FILE_KEYS[layout], "micro_step"}
    return [*KEY_COLUMNS, *(h for h in header if h not in file_keys), *META_COLUMNS]
