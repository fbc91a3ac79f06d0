"""Questions asked of the query layer's views, each defined once as SQL (DuckDB's dialect) and
run on DuckDB as it is or on Spark transpiled by sqlglot (:mod:`trainprobe.tools.engines.spark`).

Execution order is not defined here: the SQL is generated from
:mod:`trainprobe.engine.execution_order` (:data:`~trainprobe.engine.execution_order.TABLE_ORDER`,
the phases, the once-per-step tables, the pipeline-stage rule), so that a query orders rows
exactly as :func:`~trainprobe.engine.execution_order.execution_key` does. Per row,
:func:`order_columns_sql` gives the key's columns, smallest first:

``step``, ``x_once`` (1 for a table written once per step, after every micro-step),
``x_micro`` (the micro-step; 0 for once-per-step tables and an empty cell), ``x_phase``
(:data:`~trainprobe.engine.execution_order.PHASE_ORDER`), ``x_stage`` (``vpp_stage``; negated
outside the forward phase), ``x_table`` (the table's place in ``TABLE_ORDER``), ``x_position``
(:func:`~trainprobe.engine.execution_order.place` of ``position``, the row's place among the rows
of its step in its file, 0 first: ``row_positions``; negated for the weight gradients, which
backward computes from the last row written), ``rank``.

Standard library only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from trainprobe.engine.execution_order import (
    FORWARD,
    OTHER_TABLE,
    PHASE_ORDER,
    UNKNOWN,
    V2_DEFAULT_TABLE,
    V2_TABLE_OF,
    in_backward_order,
    phase_of_table,
    table_rank,
)
from trainprobe.engine.nonfinite import COUNT_OPS
from trainprobe.tools.sql.names import ident, text

KEY_COLUMNS: tuple[str, ...] = ("rank", "step", "micro_step", "vpp_stage", "name", "scope")
"""The key columns every view starts with, in this order."""
TEXT_COLUMNS: tuple[str, ...] = ("shape", "dtype")
"""Text columns describing the tensor (V1, where the files have them), after the ops."""
META_COLUMNS: tuple[str, ...] = ("file", "file_row")
"""Provenance columns every view ends with."""
ORDER_COLUMNS: tuple[str, ...] = ("step", "x_once", "x_micro", "x_phase", "x_stage", "x_table", "x_position", "rank")
"""The columns of the execution key (:func:`order_columns_sql`), in sort order."""
MG_DIRECTION = "%.mg_direction"
"""``name LIKE`` pattern of the ``mg_direction`` rows of the V1 ``other`` table (optimizer phase)."""


_sql_text = text


def _place(table: str, target: str = "") -> tuple[int, int, int, bool]:
    """``(once, phase, table rank, forward-like)`` of a row of V1 ``table`` (execution_order's rules)."""
    phase, once = phase_of_table(table, target)
    return int(once), PHASE_ORDER[phase], table_rank(table, target), phase in (FORWARD, UNKNOWN)


def _cases(view: str, scope: str = "scope", name: str = "name") -> list[tuple[str, str, str]]:
    """``(condition, V1 table, target)`` alternatives for the rows of ``view``: a V2 monitor's
    scopes map onto V1 tables; the ``other`` table splits on ``mg_direction`` names. The last
    alternative has condition ``""`` (ELSE). ``scope``, ``name``: the columns holding them."""
    if view in V2_DEFAULT_TABLE:
        scoped = [(f"{scope} = {_sql_text(s)}", table) for (m, s), table in V2_TABLE_OF.items() if m == view]
        tables = [*scoped, ("", V2_DEFAULT_TABLE[view])]
    else:
        tables = [("", view)]
    out: list[tuple[str, str, str]] = []
    for condition, table in tables:
        if table == OTHER_TABLE:
            mg = f"{name} LIKE {_sql_text(MG_DIRECTION)}"
            out.append((f"{condition} AND {mg}" if condition else mg, table, "x.mg_direction"))
        out.append((condition, table, ""))
    return out


def _case(view: str, value: Callable[[str, str], object], scope: str = "scope", name: str = "name") -> str:
    """A SQL expression over the columns ``scope``/``name`` giving ``value(table, target)`` for a row of ``view``."""
    alternatives = [(c, value(t, target)) for c, t, target in _cases(view, scope, name)]
    default = alternatives[-1][1]
    branches = [(c, v) for c, v in alternatives[:-1] if v != default]
    if not branches:
        return str(default)
    return "CASE " + " ".join(f"WHEN {c} THEN {v}" for c, v in branches) + f" ELSE {default} END"


def order_columns_sql(table: str) -> list[str]:
    """The execution-key columns (:data:`ORDER_COLUMNS` but ``step`` and ``rank``, which the
    view has) of a row of view ``table``, as SQL ``<expr> AS <name>`` items over the view's
    columns. ``position`` is a window over the view's rows of the row's file and step (the
    rows the SELECT reads: give it every row of a step)."""
    once = _case(table, lambda t, g: _place(t, g)[0])
    forward = _case(table, lambda t, g: "TRUE" if _place(t, g)[3] else "FALSE")
    position = "(row_number() OVER (PARTITION BY file, step ORDER BY file_row) - 1)"
    return [
        f"{once} AS x_once",
        f"CASE WHEN {once} = 1 THEN 0 ELSE coalesce(micro_step, 0) END AS x_micro",
        f"{_case(table, lambda t, g: _place(t, g)[1])} AS x_phase",
        f"CASE WHEN {forward} THEN vpp_stage ELSE -vpp_stage END AS x_stage",
        f"{_case(table, lambda t, g: _place(t, g)[2])} AS x_table",
        f"{position} AS position",
        f"{place_sql(table, position)} AS x_position",
    ]


def place_sql(table: str, position: str, scope: str = "scope", name: str = "name") -> str:
    """The SQL of :func:`~trainprobe.engine.execution_order.place` for a row of view ``table``:
    ``position`` (SQL of the row's place in its step as written) negated where the row is a
    weight gradient (:data:`~trainprobe.engine.execution_order.BACKWARD_ORDERED`, by its
    ``scope`` column for a V2 view), as is otherwise. The one backward-order rule of every
    query (``diagnose``, ``diff``, the query layer's first NaN/inf)."""
    backward = _case(table, lambda t, g: "TRUE" if in_backward_order(t) else "FALSE", scope, name)
    if backward == "FALSE":
        return position
    if backward == "TRUE":
        return f"-{position}"
    return f"CASE WHEN {backward} THEN -{position} ELSE {position} END"


def stage_sql(table: str, scope: str = "scope", name: str = "name") -> str:
    """The place of a row of ``table`` within its step, for a given micro-step and pipeline stage,
    as one integer SQL expression over its columns ``scope`` (and ``name``; ``diff``'s joined rows
    name them ``k_scope``, ``k_name``): ``once * 10000 + (phase + 1) * 100 + table rank + 1``,
    from :mod:`trainprobe.engine.execution_order`."""
    return _case(table, lambda t, g: _stage_number(*_place(t, g)[:3]), scope, name)


ONCE_STAGE = 10000
"""Stages from :data:`ONCE_STAGE` up are once-per-step tables (after every micro-batch)."""


def _stage_number(once: int, phase: int, rank: int) -> int:
    return once * ONCE_STAGE + (phase + 1) * 100 + rank + 1


def _stages() -> dict[tuple[str, str | None], int]:
    stages: dict[tuple[str, str | None], int] = {}
    for (monitor, scope), table in V2_TABLE_OF.items():
        stages[monitor, scope] = _stage_number(*_place(table)[:3])
    for monitor, table in V2_DEFAULT_TABLE.items():
        stages[monitor, None] = _stage_number(*_place(table)[:3])
    from trainprobe.engine.execution_order import PHASE_OF_SUFFIX

    for table in (*PHASE_OF_SUFFIX, OTHER_TABLE):
        stages.setdefault((table, None), _stage_number(*_place(table)[:3]))
    return stages


STAGES: Mapping[tuple[str, str | None], int] = _stages()
"""Stage number (:func:`stage_sql`) of a table (any scope: ``None``) or of one V2 monitor's
scope, derived from :mod:`trainprobe.engine.execution_order` (``other``: its collective calls)."""
LATE_STAGE = _stage_number(0, PHASE_ORDER[UNKNOWN], -1)
"""The stage of a table execution_order does not know: before the forward phase of its
micro-step, as there (the name is kept from when unknown tables came last)."""

INF = "CAST('inf' AS DOUBLE)"
"""Infinity, written so that DuckDB and Spark (through sqlglot) both read it."""


def is_nonfinite(column: str) -> str:
    """SQL true when ``column`` is NaN or infinite (``isinf`` has no Spark equivalent)."""
    return f"(isnan({ident(column)}) OR abs({ident(column)}) = {INF})"


def nonfinite_sql(ops: Sequence[str]) -> str:
    """True for a row with an op that is NaN or infinite (or a NaN count above 0): the rule of
    :mod:`trainprobe.engine.nonfinite`, as SQL."""
    tests = [is_nonfinite(op) for op in ops if op not in COUNT_OPS]
    tests += [f"{ident(op)} > 0" for op in ops if op in COUNT_OPS]
    return " OR ".join(tests) if tests else "FALSE"


def ops_of(columns: Sequence[str]) -> list[str]:
    """The op columns among a view's ``columns``."""
    return [c for c in columns if c not in KEY_COLUMNS and c not in TEXT_COLUMNS and c not in META_COLUMNS]


def bad_rows_sql(columns: Sequence[str]) -> str:
    """SQL true for the non-finite rows of a view with ``columns`` (the reference's "no tensor"
    rows, ``dtype = 'nan'``, aside)."""
    skip = " AND dtype IS DISTINCT FROM 'nan'" if "dtype" in columns else ""
    return f"COALESCE(({nonfinite_sql(ops_of(columns))}){skip}, FALSE)"


def first_bad_step_sql(views: Mapping[str, Sequence[str]]) -> str:
    """The first step with a non-finite row in any view (NULL when none): the first of the two
    queries of "first NaN/inf" (a filtered scan of ``step`` and the ops only)."""
    parts = [f"SELECT min(step) AS step FROM {ident(t)} WHERE {bad_rows_sql(cols)}" for t, cols in views.items()]
    return "SELECT min(step) AS step FROM (" + " UNION ALL ".join(parts) + ")"


def _keyed(table: str, extra: Sequence[str], where: str) -> str:
    """The rows of view ``table`` matching ``where`` with its name, stage, key columns, ``extra``
    items and the execution-key columns."""
    items = [f"{_sql_text(table)} AS tbl", f"{stage_sql(table)} AS stage", *(ident(c) for c in KEY_COLUMNS)]
    items += ["file", "file_row", *extra, *order_columns_sql(table)]
    return f"SELECT {', '.join(items)} FROM {ident(table)} WHERE {where}"


def _order_by() -> str:
    return ", ".join([*ORDER_COLUMNS, "tbl", "name"])


def ordered_rows_sql(views: Mapping[str, Sequence[str]], step: int | None = None) -> str:
    """Every row of ``views`` (of ``step`` only, when given) in execution order, as ``tbl, stage,
    rank, step, micro_step, vpp_stage, name, scope, file, file_row`` and the execution-key
    columns (:data:`ORDER_COLUMNS`); rows with equal keys by view and name."""
    where = "TRUE" if step is None else f"step = {int(step)}"
    rows = "\nUNION ALL\n".join(_keyed(t, [], where) for t in views)
    return f"SELECT * FROM ({rows})\nORDER BY {_order_by()}"


def first_nonfinite_sql(views: Mapping[str, Sequence[str]], step: int | None, limit: int = 1) -> str:
    """The first ``limit`` non-finite rows of ``step`` (from :func:`first_bad_step_sql`; None: that
    query nested, one query in all) in execution order (module docstring), as ``table, stage,
    step, micro_step, rank, vpp_stage, name, scope, op, value, file, position`` (``op``: the first
    non-finite op, ``value`` its value; ``position``: the row's place among its file's rows of
    that step, 0 first).

    ``views`` maps each view to its columns. Rows the reference V1 writer fills with ``nan``
    because there was no tensor (``dtype = 'nan'``) are not counted. Only rows of ``step`` are
    read (Parquet row groups of other steps are skipped by their statistics; the caller may also
    give views over the files of that step's window only, see
    :func:`trainprobe.tools.query.layer.first_nonfinite`).
    """
    at = f"step = {int(step)}" if step is not None else f"step = ({first_bad_step_sql(views)})"
    selects = []
    for table, columns in views.items():
        ops = ops_of(columns)
        value_ops = [op for op in ops if op not in COUNT_OPS] or list(ops)
        op_case = " ".join(f"WHEN {is_nonfinite(o)} THEN {text(o)}" for o in value_ops) or "WHEN FALSE THEN NULL"
        val_case = " ".join(f"WHEN {is_nonfinite(o)} THEN {ident(o)}" for o in value_ops) or "WHEN FALSE THEN NULL"
        extra = [
            f"{bad_rows_sql(columns)} AS bad",
            f"CASE {op_case} ELSE NULL END AS op",
            f"CAST(CASE {val_case} ELSE NULL END AS DOUBLE) AS val",
        ]
        selects.append(_keyed(table, extra, at))
    rows = "\nUNION ALL\n".join(selects)
    return f"""WITH all_rows AS ({rows})
SELECT tbl AS "table", stage, step, micro_step, rank, vpp_stage, name, scope, op, val AS value, file, position
FROM all_rows WHERE bad
ORDER BY {_order_by()}
LIMIT {int(limit)}"""
