"""Questions asked of the query layer's views, each defined once as SQL (DuckDB's dialect) and
run on DuckDB as it is or on Spark transpiled by sqlglot (:mod:`trainprobe.tools.query_spark`).

Execution order (the one place it is defined here; to be aligned with
``trainprobe.tools.execution_order``): rows are ordered by

1. ``step``;
2. the *stage* of the row's table and scope within a step (:data:`STAGES`): parameters before
   the step, forward activations, backward, unreduced gradients, collectives, reduced
   gradients, optimizer state, updated parameters;
3. ``micro_step`` (NULL first);
4. the row's position among that step's rows in its file (call order, as the monitors write);
5. ``rank``.

Standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

STAGES: Mapping[tuple[str, str | None], int] = {
    ("param_origin", None): 0,
    ("param", "param_origin"): 0,
    ("module", "forward"): 1,
    ("actv", None): 1,
    ("linear_hook", None): 1,
    ("attention_hook", None): 1,
    ("moe_router_weight_hook", None): 1,
    ("moe_router_logit_hook", None): 1,
    ("module", "backward"): 2,
    ("actv_grad", None): 2,
    ("weight_grad", "unreduced"): 3,
    ("grad_unreduced", None): 3,
    ("cc", None): 4,
    ("weight_grad", "reduced"): 5,
    ("grad_reduced", None): 5,
    ("optimizer", None): 6,
    ("exp_avg", None): 6,
    ("exp_avg_sq", None): 6,
    ("adam_update", None): 6,
    ("adam_ratio", None): 6,
    ("param", "param_updated"): 7,
    ("param", None): 7,
    ("param_updated", None): 7,
    ("other", None): 8,
}
"""Stage of a table (any scope: ``None``) or of one scope of a table, within a step."""
LATE_STAGE = 9
"""The stage of anything :data:`STAGES` does not name."""
KEY_COLUMNS: tuple[str, ...] = ("rank", "step", "micro_step", "vpp_stage", "name", "scope")
"""The key columns every view starts with, in this order."""
TEXT_COLUMNS: tuple[str, ...] = ("shape", "dtype")
"""Text columns describing the tensor (V1, where the files have them), after the ops."""
META_COLUMNS: tuple[str, ...] = ("file", "file_row")
"""Provenance columns every view ends with."""
COUNT_OPS: tuple[str, ...] = ("nans",)
"""Ops that count non-finite elements: a row with a count above 0 is non-finite too."""


def stage_sql(table: str) -> str:
    """The stage of a row of ``table`` as a SQL expression over its ``scope`` column."""
    scoped = [(scope, stage) for (t, scope), stage in STAGES.items() if t == table and scope is not None]
    default = STAGES.get((table, None), LATE_STAGE)
    if not scoped:
        return str(default)
    cases = " ".join(f"WHEN scope = '{scope}' THEN {stage}" for scope, stage in scoped)
    return f"CASE {cases} ELSE {default} END"


INF = "CAST('inf' AS DOUBLE)"
"""Infinity, written so that DuckDB and Spark (through sqlglot) both read it."""


def is_nonfinite(column: str) -> str:
    """SQL true when ``column`` is NaN or infinite (``isinf`` has no Spark equivalent)."""
    return f'(isnan("{column}") OR abs("{column}") = {INF})'


def nonfinite_sql(ops: Sequence[str]) -> str:
    """True for a row with an op that is NaN or infinite (or a NaN count above 0)."""
    tests = [is_nonfinite(op) for op in ops if op not in COUNT_OPS]
    tests += [f'"{op}" > 0' for op in ops if op in COUNT_OPS]
    return " OR ".join(tests) if tests else "FALSE"


def ops_of(columns: Sequence[str]) -> list[str]:
    """The op columns among a view's ``columns``."""
    return [c for c in columns if c not in KEY_COLUMNS and c not in TEXT_COLUMNS and c not in META_COLUMNS]


def _bad_rows(table: str, columns: Sequence[str]) -> str:
    """SQL true for the non-finite rows of ``table`` (the reference's "no tensor" rows aside)."""
    skip = " AND dtype IS DISTINCT FROM 'nan'" if "dtype" in columns else ""
    return f"COALESCE(({nonfinite_sql(ops_of(columns))}){skip}, FALSE)"


def first_bad_step_sql(views: Mapping[str, Sequence[str]]) -> str:
    """The first step with a non-finite row in any view (NULL when none): the first of the two
    queries of "first NaN/inf" (a filtered scan of ``step`` and the ops only)."""
    parts = [f'SELECT min(step) AS step FROM "{t}" WHERE {_bad_rows(t, cols)}' for t, cols in views.items()]
    return "SELECT min(step) AS step FROM (" + " UNION ALL ".join(parts) + ")"


def first_nonfinite_sql(views: Mapping[str, Sequence[str]], step: int, limit: int = 1) -> str:
    """The non-finite rows of ``step`` (from :func:`first_bad_step_sql`) in execution order
    (module docstring): the first one of each table, rank, stage and micro-step, earliest first,
    ``limit`` of them, as ``table, stage, step, micro_step, rank, vpp_stage, name, scope, op,
    value, file, position`` (``position``: the row's place among its file's rows of that step,
    0 first, comparable between ranks).

    ``views`` maps each view to its columns. Rows the reference V1 writer fills with ``nan``
    because there was no tensor (``dtype = 'nan'``) are not counted. Only rows of ``step`` are
    read (Parquet row groups of other steps are skipped by their statistics; the caller may also
    give views over the files of that step's window only, see
    :func:`trainprobe.tools.query.first_nonfinite`).
    """
    selects = []
    for table, columns in views.items():
        ops = ops_of(columns)
        value_ops = [op for op in ops if op not in COUNT_OPS] or list(ops)
        op_case = " ".join(f"WHEN {is_nonfinite(o)} THEN '{o}'" for o in value_ops)
        val_case = " ".join(f'WHEN {is_nonfinite(o)} THEN "{o}"' for o in value_ops)
        selects.append(
            f"SELECT '{table}' AS tbl, {stage_sql(table)} AS stage, step, micro_step, rank, vpp_stage, name, "
            f"scope, file, file_row, bad, "
            f"CASE WHEN bad THEN CASE {op_case or 'WHEN FALSE THEN NULL'} ELSE NULL END END AS op, "
            f"CAST(CASE WHEN bad THEN CASE {val_case or 'WHEN FALSE THEN NULL'} ELSE NULL END END AS DOUBLE) AS val "
            f"FROM (SELECT *, {_bad_rows(table, columns)} AS bad FROM \"{table}\" WHERE step = {int(step)})"
        )
    rows = "\nUNION ALL\n".join(selects)
    return f"""WITH all_rows AS ({rows}),
groups AS (
  SELECT tbl, rank, step, stage, micro_step,
    min(file_row) AS group_first,
    min(file_row) FILTER (WHERE bad) AS bad_row,
    arg_min(file, file_row) FILTER (WHERE bad) AS file,
    arg_min(vpp_stage, file_row) FILTER (WHERE bad) AS vpp_stage,
    arg_min(name, file_row) FILTER (WHERE bad) AS name,
    arg_min(scope, file_row) FILTER (WHERE bad) AS scope,
    arg_min(op, file_row) FILTER (WHERE bad) AS op,
    arg_min(val, file_row) FILTER (WHERE bad) AS val
  FROM all_rows GROUP BY tbl, rank, step, stage, micro_step
),
placed AS (
  SELECT *, bad_row - min(group_first) OVER (PARTITION BY tbl, rank, step) AS position FROM groups
)
SELECT tbl AS "table", stage, step, micro_step, rank, vpp_stage, name, scope, op, val AS value, file, position
FROM placed WHERE bad_row IS NOT NULL
ORDER BY step, stage, micro_step NULLS FIRST, position, rank, tbl, name
LIMIT {int(limit)}"""
