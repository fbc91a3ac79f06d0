"""The SQL of ``trainprobe diff`` (DuckDB's dialect; standard library only).

Both runs' views live on one engine, the baseline's as side ``b``, the candidate's as ``c``:
on DuckDB two schemas (``b.module``), on Spark prefixed temporary views (``ref`` arguments,
:data:`Ref`); the queries are written once, in DuckDB's dialect, and Spark reads them through
:func:`trainprobe.tools.query_spark.to_spark`. One table is compared at a time by a FULL OUTER JOIN on the match key of
:mod:`trainprobe.tools.diff_match`. Per op, the relative difference is

    ``|a − b| / max(|a|, |b|, floor)``

with ``floor = max(ABS_FLOOR, SCALE_FRACTION × m)``, ``m`` the row's magnitude: the largest of
``|min|``, ``|max|`` in either run when the table has both ops (the largest element of the
tensor), else 0. Equal values (NaN and NaN, inf and inf included) differ by 0; NaN or ±inf
against anything else, or a value against an empty cell, by +inf (always a divergence).

Row statuses: :data:`EQUAL`, :data:`WITHIN`, :data:`DIVERGED`, :data:`ONLY_BASELINE`,
:data:`ONLY_CANDIDATE`. Execution order is the one of
:mod:`trainprobe.tools.execution_order` (its stages through ``stage_sql`` of
:mod:`trainprobe.tools.query_sql`, see :data:`ORDER`): step; per micro-batch its forward,
backward and unreduced gradients, then the once-per-step tables; the row's position among its
file's rows of that step; rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from trainprobe.tools.diff_match import KEY, key_sql
from trainprobe.tools.query_sql import COUNT_OPS, ONCE_STAGE, stage_sql
from trainprobe.tools.sql_names import ident as quote
from trainprobe.tools.sql_names import text as literal

EQUAL, WITHIN, DIVERGED, ONLY_BASELINE, ONLY_CANDIDATE = 0, 1, 2, 3, 4
STATUS_NAMES = {
    EQUAL: "equal",
    WITHIN: "within_tolerance",
    DIVERGED: "diverged",
    ONLY_BASELINE: "only_baseline",
    ONLY_CANDIDATE: "only_candidate",
}
ABS_FLOOR = 1e-12
"""The smallest denominator: below it two values are both zero for any training statistic."""
SCALE_FRACTION = 1e-3
"""The floor's share of the row's magnitude (see the module docstring)."""
COUNT_LIKE = (*COUNT_OPS, "zeros")
"""Ops that count elements (or their share): their floor is :data:`ABS_FLOOR` only."""
INF = "CAST('inf' AS DOUBLE)"

Ref = Callable[[str, str], str]
"""``(side, table)`` → the SQL name of that run's view: ``b.module`` on DuckDB (:func:`schema_ref`)."""


def schema_ref(side: str, table: str) -> str:
    """DuckDB's name of a run's view: the side's schema, the table (``b."module"``)."""
    return f"{side}.{quote(table)}"


def _finite(value: str) -> str:
    """Whether ``value`` is finite: ``abs(x) < inf`` rather than DuckDB's ``isfinite``, which
    Spark lacks (both order NaN above every number: false for NaN and ±inf, NULL for NULL)."""
    return f"abs({value}) < {INF}"


def side_sql(
    schema: str,
    table: str,
    ops: Sequence[str],
    *,
    offset: int = 0,
    mapping: Sequence[tuple[str, str]] = (),
    steps: tuple[int, int] | None = None,
    micro: bool = True,
    occurrence: bool = False,
    ref: Ref = schema_ref,
) -> str:
    """One run's rows of ``table`` with the match key (``k_*``), the raw name (with a ``mapping``
    only), step, the file (its hash: 8 bytes a row in the join rather than the path), file row
    and the ``ops``; with ``steps`` (in the baseline's numbering) only those. With
    ``occurrence``, an occurrence number ``k_occ`` too (a key that appears twice in a run, a
    module called twice, pairs first with first): a window over every row, costly at 10^7 rows,
    so :func:`trainprobe.tools.diff.diff` asks for it only when the join shows repeated keys.
    Occurrences are numbered in file order (the file's first step, then its path), then row
    order: the same on every engine and for both runs, so that a key repeated across files (a
    resumed run writing some steps again) pairs the baseline's earlier file with the
    candidate's earlier file, whatever the runs' folders are called."""
    where = ""
    if steps is not None:
        where = f"WHERE step + {int(offset)} BETWEEN {int(steps[0])} AND {int(steps[1])}"
    values = "".join(f", {quote(o)}" for o in ops)
    inner = (
        f"SELECT {key_sql(offset, mapping, micro)}, {'name, ' if mapping else ''}step, hash(file) AS file, "
        f"file_row{values}{', file AS path' if occurrence else ''} "
        f"FROM {ref(schema, table)} {where}"
    )
    if not occurrence:
        return f"SELECT *, 1 AS k_occ FROM ({inner})"
    return (
        f"SELECT *, row_number() OVER (PARTITION BY {', '.join(KEY)} ORDER BY file_first, path, file_row) AS k_occ "
        f"FROM (SELECT *, min(step) OVER (PARTITION BY path) AS file_first FROM ({inner}))"
    )


def rel_sql(op: str, scale: str | None) -> str:
    """The relative difference of ``op`` between ``b`` and ``c`` (module docstring)."""
    a, b = f"b.{quote(op)}", f"c.{quote(op)}"
    floor = str(ABS_FLOOR)
    if scale is not None and op not in COUNT_LIKE:
        floor = f"CASE WHEN {_finite(scale)} THEN greatest({ABS_FLOOR}, {SCALE_FRACTION} * {scale}) ELSE {ABS_FLOOR} END"
    return (
        f"CASE WHEN {a} IS NOT DISTINCT FROM {b} THEN 0.0 "
        f"WHEN {a} IS NULL OR {b} IS NULL OR NOT {_finite(a)} OR NOT {_finite(b)} THEN {INF} "
        f"ELSE abs({a} - {b}) / greatest(abs({a}), abs({b}), {floor}) END"
    )


def joined_sql(
    table: str,
    ops: Sequence[str],
    *,
    rtol: float,
    exact: bool,
    offset: int = 0,
    mapping: Sequence[tuple[str, str]] = (),
    steps: tuple[int, int] | None = None,
    micro: bool = True,
    occurrence: bool = False,
    ref: Ref = schema_ref,
) -> str:
    """Every row of ``table`` in either run with its status, its largest relative difference
    ``rel``, the op having it ``worst_op``, both values and the difference per op; ``micro``:
    whether ``micro_step`` is part of the key (see :mod:`trainprobe.tools.diff_match`);
    ``occurrence``, ``ref``: see :func:`side_sql`, :data:`Ref`."""
    b_side = side_sql("b", table, ops, steps=steps, micro=micro, occurrence=occurrence, ref=ref)
    c_side = side_sql(
        "c", table, ops, offset=offset, mapping=mapping, steps=steps, micro=micro, occurrence=occurrence, ref=ref
    )
    on = " AND ".join(f"b.{k} = c.{k}" for k in (*KEY, "k_occ"))
    scale = None
    if "min" in ops and "max" in ops:
        scale = 'greatest(abs(b."min"), abs(b."max"), abs(c."min"), abs(c."max"))'
    rels = [rel_sql(o, scale) for o in ops]
    rel = f"greatest({', '.join(rels)})" if rels else "CAST(0 AS DOUBLE)"
    equal = " AND ".join(f"b.{quote(o)} IS NOT DISTINCT FROM c.{quote(o)}" for o in ops) or "TRUE"
    diverged = "TRUE" if exact else f"rel > {float(rtol)!r}"
    keys = ", ".join(f"COALESCE(b.{k}, c.{k}) AS {k}" for k in KEY)
    values = "".join(f", b.{quote(o)} AS {quote('b_' + o)}, c.{quote(o)} AS {quote('c_' + o)}, r{i} AS {quote('r_' + o)}" for i, o in enumerate(ops))
    worst = " ".join(f"WHEN r{i} = rel_all THEN {literal(o)}" for i, o in enumerate(ops))
    per_op = "".join(f"{r} AS r{i}, " for i, r in enumerate(rels))
    return f"""SELECT {literal(table)} AS tbl, {keys}, {per_op}{rel} AS rel_all,
  CASE WHEN b.k_rank IS NULL THEN {ONLY_CANDIDATE} WHEN c.k_rank IS NULL THEN {ONLY_BASELINE}
       WHEN {equal} THEN {EQUAL} WHEN {diverged.replace("rel", "rel_all")} THEN {DIVERGED} ELSE {WITHIN} END AS status,
  CASE WHEN b.k_rank IS NULL OR c.k_rank IS NULL THEN NULL ELSE rel_all END AS rel,
  CASE WHEN b.k_rank IS NULL OR c.k_rank IS NULL THEN NULL ELSE CASE {worst or "WHEN FALSE THEN NULL"} END END AS worst_op,
  b.k_name AS b_name, {'c.name' if mapping else 'c.k_name'} AS c_name, b.step AS b_step, c.step AS c_step,
  b.file AS b_file, b.file_row AS b_row, c.file AS c_file, c.file_row AS c_row{values}
FROM ({b_side}) b FULL OUTER JOIN ({c_side}) c ON {on}"""


def rows_sql(
    schema: str, table: str, offset: int = 0, steps: tuple[int, int] | None = None, ref: Ref = schema_ref
) -> str:
    """How many rows of ``table`` one run has (in ``steps``): with the join's counts, whether a
    key repeats (a matched row counted more than once)."""
    where = f"WHERE step + {int(offset)} BETWEEN {int(steps[0])} AND {int(steps[1])}" if steps else ""
    return f"SELECT count(*) FROM {ref(schema, table)} {where}"


def ordered_sql(table: str, source: str, ref: Ref = schema_ref) -> str:
    """``source`` (rows of :func:`joined_sql`, kept in a table) with ``stage`` and ``position``
    added (the row's place among its file's rows of its step: the baseline's file, the
    candidate's for a row only it has)."""
    firsts = (
        f"SELECT 'b' AS side, hash(file) AS file, step, min(file_row) AS first FROM {ref('b', table)} "
        f"WHERE step IN (SELECT DISTINCT b_step FROM {source}) GROUP BY ALL UNION ALL "
        f"SELECT 'c', hash(file), step, min(file_row) FROM {ref('c', table)} "
        f"WHERE step IN (SELECT DISTINCT c_step FROM {source} WHERE b_file IS NULL) GROUP BY ALL"
    )
    return f"""SELECT * EXCLUDE (scope, name), {stage_sql(table)} AS stage FROM (
SELECT d.*, d.k_scope AS scope, d.k_name AS name, COALESCE(d.b_row - fb.first, d.c_row - fc.first) AS position
FROM {source} d
LEFT JOIN ({firsts}) fb ON fb.side = 'b' AND fb.file = d.b_file AND fb.step = d.b_step
LEFT JOIN ({firsts}) fc ON fc.side = 'c' AND fc.file = d.c_file AND fc.step = d.c_step)"""


_MICRO = "greatest(coalesce(k_micro, 0), 0)"  # a table without micro_step (V1 grad_unreduced: -1) counts as 0
ORDER = (
    f"k_step, stage >= {ONCE_STAGE}, CASE WHEN stage >= {ONCE_STAGE} THEN 0 ELSE {_MICRO} END, "
    f"stage, {_MICRO}, position, k_rank, tbl, k_name"
)
"""Execution order of :func:`ordered_sql`'s rows, as :func:`trainprobe.tools.execution_order.execution_key`
orders them: step; per micro-batch (forward, backward, unreduced gradients), then the
once-per-step tables (reduced gradients, collectives, optimizer, parameters); the table's stage;
the row's position in its file's step; rank."""


def fmt(value: float | None) -> str:
    """A value as the answer prints it (``1.23e-02``, ``nan``, ``inf``, ``NULL``)."""
    if value is None:
        return "NULL"
    if not math.isfinite(value):
        return str(value)
    return f"{value:.6g}" if value == int(value) and abs(value) < 1e6 else f"{value:.3e}"
