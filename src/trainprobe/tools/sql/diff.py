"""The SQL of ``trainprobe diff`` (DuckDB's dialect; standard library only).

Both runs' views live on one engine, the baseline's as side ``b``, the candidate's as ``c`` (and
a rerun's as ``n`` with ``--noise``): on DuckDB schemas (``b.module``), on Spark prefixed
temporary views (``ref`` arguments, :data:`Ref`); the queries are written once, in DuckDB's
dialect, and Spark reads them through :func:`trainprobe.tools.engines.spark.to_spark`. One table
is compared at a time by a FULL OUTER JOIN on the match key of :mod:`trainprobe.tools.rundiff.match`.

Per op, the normalised difference is

    ``max(|a − b| − q, 0) / max(|a|, |b|, S)``

with ``q`` the files' rounding (Monitor V1's CSVs have 6 decimals: 1e-6; 0 for V2) and ``S`` the
tensor's scale: for ``min``, ``max`` and ``mean`` the largest element of the tensor in either
run (the largest of ``|min|``, ``|max|``; the ``norm`` where the table lacks them), so that a
mean near 0 or a min near 0 is measured against the tensor, not against its own small value; for
``norm`` its own value; ``zeros`` (a fraction) 1. Equal values (NaN and NaN, inf and inf
included) differ by 0; NaN or ±inf against anything else, a value against an empty cell, or any
change of a NaN count, by +inf (always a divergence). A row diverges when some op's difference
is above its tolerance (:class:`Tolerance`).

Row statuses: :data:`EQUAL`, :data:`WITHIN`, :data:`DIVERGED`, :data:`ONLY_BASELINE`,
:data:`ONLY_CANDIDATE`. Execution order is the one of
:mod:`trainprobe.engine.execution_order` (its stages through ``stage_sql`` of
:mod:`trainprobe.tools.sql.questions`, see :data:`ORDER`): step; per micro-batch its forward,
backward and unreduced gradients, then the once-per-step tables; the row's position among its
file's rows of that step (weight gradients from the last: backward computes the last
parameters' gradients first, the one rule of :mod:`trainprobe.engine.execution_order`); rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from trainprobe.tools.rundiff.match import KEY, key_sql
from trainprobe.tools.sql.names import ident as quote
from trainprobe.tools.sql.names import text as literal
from trainprobe.tools.sql.questions import COUNT_OPS, ONCE_STAGE, place_sql, stage_sql

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
SCALED_OPS = ("min", "max", "mean")
"""Ops measured against the tensor's scale, not their own size (module docstring)."""
DTYPE_RTOL: dict[str, float] = {"float64": 5e-8, "float32": 1e-3, "float16": 1e-1, "bfloat16": 3e-1}
"""Default rtol per precision of the run: about 3·√ε (ε the dtype's machine epsilon; float32
3·3.45e-4 = 1.04e-3): half the digits agree, less a margin. Rounding-level reruns (thread count,
reduction or op order, fused kernels) of the demo GPT stay 3× (float32) to 5× (bf16 autocast)
below it after 12 steps; real changes go far above."""
DTYPE_MATCH_ORDER = ("bfloat16", "float16", "float64", "float32")
"""The order a ``dtype`` cell is matched in (``bfloat16`` before ``float16``, its suffix)."""
DEFAULT_DTYPE = "float32"
"""The precision assumed for rows without a dtype (Monitor V2's files have none)."""
V1_QUANTUM = 1e-6
"""Monitor V1's CSV rounding (6 decimals): a difference up to it is none."""
NOISE_MARGIN = 10.0
"""With ``--noise``, an op's tolerance is at least this many times the rerun's noise level."""
INF = "CAST('inf' AS DOUBLE)"
ZERO = "CAST(0 AS DOUBLE)"
ONE = "CAST(1 AS DOUBLE)"


def num(value: float) -> str:
    """A number as a DOUBLE literal (DuckDB reads ``0.001`` as a DECIMAL)."""
    return f"CAST({float(value)!r} AS DOUBLE)"

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
    left_out: str | None = None,
    by_name: bool = False,
) -> str:
    """One run's rows of ``table`` with the match key (``k_*``), the raw name (with a ``mapping``
    only), step, the file (its hash: 8 bytes a row in the join rather than the path), file row
    and the ``ops``; with ``steps`` (in the baseline's numbering) only those. With
    ``occurrence``, an occurrence number ``k_occ`` too (a key that appears twice in a run, a
    module called twice, pairs first with first): a window over every row, costly at 10^7 rows,
    so :func:`trainprobe.tools.rundiff.answer.diff` asks for it only when the join shows repeated keys.
    Occurrences are numbered in file order (the file's first step, then its path), then row
    order: the same on every engine and for both runs, so that a key repeated across files (a
    resumed run writing some steps again) pairs the baseline's earlier file with the
    candidate's earlier file, whatever the runs' folders are called. ``left_out``: a relation of
    rows not compared (:func:`left_out_sql`); ``by_name``: matched by global name, not rank and
    stage (:func:`~trainprobe.tools.rundiff.match.key_sql`), a pipeline chunk's own rows (``<stage>:.input.0``:
    a stage boundary, no tensor of the other split) left out."""
    where = ""
    if steps is not None:
        where = f"WHERE step + {int(offset)} BETWEEN {int(steps[0])} AND {int(steps[1])}"
    values = "".join(f", {quote(o)}" for o in ops)
    inner = (
        f"SELECT {key_sql(offset, mapping, micro, by_name)}, {'name, ' if mapping else ''}step, hash(file) AS file, "
        f"file_row{values}{', file AS path' if occurrence else ''} "
        f"FROM {ref(schema, table)} {where}"
    )
    if left_out is not None:
        inner = f"SELECT * FROM ({inner}) s WHERE NOT ({left_out_sql(table, left_out)})"
    if by_name:
        inner = f"SELECT * FROM ({inner}) WHERE k_name NOT LIKE '.%'"
    if not occurrence:
        return f"SELECT *, 1 AS k_occ FROM ({inner})"
    return (
        f"SELECT *, row_number() OVER (PARTITION BY {', '.join(KEY)} ORDER BY file_first, path, file_row) AS k_occ "
        f"FROM (SELECT *, min(step) OVER (PARTITION BY path) AS file_first FROM ({inner}))"
    )


LEFT_OUT_COLUMNS = (("lo_tbl", "VARCHAR"), ("lo_name", "VARCHAR"), ("lo_scope", "VARCHAR"))
"""The columns of a relation of rows left out of a comparison: table, normalised name (the match
key's ``k_name``), scope (NULL: every scope of that name)."""


def left_out_sql(table: str, left_out: str, alias: str = "s") -> str:
    """SQL true for a row of ``table`` (its key columns under ``alias``) that ``left_out`` names
    (:data:`LEFT_OUT_COLUMNS`): the rows a diff leaves out (rank-local rows of runs whose ranks
    differ, :func:`trainprobe.tools.rundiff.answer.diff`)."""
    return (
        f"EXISTS (SELECT 1 FROM {left_out} lo WHERE lo.lo_tbl = {literal(table)} AND lo.lo_name = {alias}.k_name "
        f"AND (lo.lo_scope IS NULL OR lo.lo_scope = {alias}.k_scope))"
    )


def _greatest(items: Sequence[str]) -> str:
    """``greatest`` of ``items`` (one item as it is: Spark's ``greatest`` needs two)."""
    return items[0] if len(items) == 1 else f"greatest({', '.join(items)})"


def _scale_sql(op: str, ops: Sequence[str]) -> str:
    """The tensor's scale a ``min``/``max``/``mean`` is measured against (module docstring):
    its largest element in either run when the table has ``min`` and ``max``, else its ``norm``,
    else 0 (the value's own size only); ``zeros`` (a fraction) 1; ``norm`` and any other op 0."""
    if op == "zeros":
        return ONE
    if op not in SCALED_OPS:
        return ZERO
    if "min" in ops and "max" in ops:
        parts = [f"abs({side}.{quote(o)})" for side in ("b", "c") for o in ("min", "max")]
    elif "norm" in ops:
        parts = [f"abs({side}.{quote('norm')})" for side in ("b", "c")]
    else:
        return ZERO
    largest = _greatest(parts)
    return f"CASE WHEN {_finite(largest)} THEN {largest} ELSE {ZERO} END"


def _unequal(a: str, b: str) -> str:
    """SQL true when a value is missing or non-finite on either side (its difference: +inf)."""
    return f"{a} IS NULL OR {b} IS NULL OR NOT {_finite(a)} OR NOT {_finite(b)}"


def rel_sql(op: str, scale: str, quantum: float = 0.0) -> str:
    """The normalised difference of ``op`` between ``b`` and ``c`` (module docstring): 0 when
    equal, +inf when non-finite or missing on one side (or any change of a count), else
    ``max(|a − b| − quantum, 0) / max(|a|, |b|, scale, ABS_FLOOR)``."""
    a, b = f"b.{quote(op)}", f"c.{quote(op)}"
    head = f"CASE WHEN {a} IS NOT DISTINCT FROM {b} THEN {ZERO} WHEN {_unequal(a, b)} THEN {INF} "
    if op in COUNT_OPS:
        return head + f"ELSE {INF} END"
    return head + (f"ELSE greatest(abs({a} - {b}) - {num(quantum)}, {ZERO}) / "
                   f"greatest(abs({a}), abs({b}), {scale}, {num(ABS_FLOOR)}) END")


def factor_sql(op: str, scale: str, tolerance: str, quantum: float = 0.0) -> str:
    """How many times larger than the smaller of the two values their difference makes the
    larger one: ``1 + |a − b| / max(min(|a|, |b|), floor)``, ``floor`` the smallest value the
    comparison resolves (the files' rounding ``quantum``, the tolerance times the scale):
    ``norm`` 1 vs 100 is ×100, 100 vs 1 ×100 too, 0 vs 1e-6 near the floor is not ×10⁶;
    1 when equal, +inf for a non-finite or missing value and any change of a count."""
    a, b = f"b.{quote(op)}", f"c.{quote(op)}"
    head = f"CASE WHEN {a} IS NOT DISTINCT FROM {b} THEN {ONE} WHEN {_unequal(a, b)} THEN {INF} "
    if op in COUNT_OPS:
        return head + f"ELSE {INF} END"
    floor = (f"greatest(least(abs({a}), abs({b})), {num(quantum)}, "
             f"{tolerance} * greatest(abs({a}), abs({b}), {scale}), {num(ABS_FLOOR)})")
    return head + f"ELSE {ONE} + abs({a} - {b}) / {floor} END"


def dtype_of(name: str | None) -> str | None:
    """The precision a ``dtype`` cell names (``torch.bfloat16`` → ``bfloat16``, MindSpore's
    ``Float16`` → ``float16``), None for an empty or unknown one (the reference's ``nan``)."""
    text = (name or "").strip().lower()
    return next((d for d in DTYPE_MATCH_ORDER if text.endswith(d)), None)


@dataclass(frozen=True)
class Tolerance:
    """How a matched row is judged (docs/diff.md, "Tolerance").

    ``exact``: bit-equal values only. Else each op's normalised difference (:func:`rel_sql`)
    against its tolerance: ``rtol``; with a rerun's noise (``noise`` in :func:`joined_sql`), at
    least ``margin`` times it. ``quantum``: the files' rounding (Monitor V1 writes 6 decimals:
    1e-6), a difference up to it is none."""

    rtol: float = DTYPE_RTOL[DEFAULT_DTYPE]
    quantum: float = 0.0
    exact: bool = False
    margin: float = NOISE_MARGIN


def joined_sql(
    table: str,
    ops: Sequence[str],
    *,
    tolerance: Tolerance,
    offset: int = 0,
    mapping: Sequence[tuple[str, str]] = (),
    steps: tuple[int, int] | None = None,
    micro: bool = True,
    occurrence: bool = False,
    ref: Ref = schema_ref,
    other: str = "c",
    noise: str | None = None,
    left_out: str | None = None,
    by_name: bool = False,
) -> str:
    """Every row of ``table`` in the baseline (side ``b``) or in side ``other`` (the candidate
    ``c``, or the rerun ``n`` whose noise is measured) with its status, per op both values
    (``b_<op>``, ``c_<op>``), the normalised difference ``r_<op>``, its tolerance ``t_<op>``,
    the factor ``f_<op>`` (:func:`factor_sql`); the worst op ``worst_op`` (the most beyond its
    tolerance; the largest difference with ``exact``), its ``rel``, ``tol`` and ``factor``.
    ``micro``: whether ``micro_step`` is part of the key (see :mod:`trainprobe.tools.rundiff.match`);
    ``occurrence``, ``ref``: see :func:`side_sql`, :data:`Ref`; ``noise``: the table of the
    rerun's noise levels (:func:`noise_sql`) that raises each op's tolerance; ``left_out``: rows of
    both sides not compared (:func:`left_out_sql`)."""
    b_side = side_sql("b", table, ops, steps=steps, micro=micro, occurrence=occurrence, ref=ref, left_out=left_out, by_name=by_name)
    c_side = side_sql(other, table, ops, offset=offset, mapping=mapping, steps=steps, micro=micro,
                      occurrence=occurrence, ref=ref, left_out=left_out, by_name=by_name)
    quantum = 0.0 if tolerance.exact else tolerance.quantum
    base = num(tolerance.rtol)
    noise_join = ""
    if noise is not None:
        noise_join = f" LEFT JOIN {noise} n ON n.k_scope = COALESCE(b.k_scope, c.k_scope)"
    inner = [f"COALESCE(b.{k}, c.{k}) AS {k}" for k in KEY]
    inner += ["b.k_rank IS NULL AS b_miss", "c.k_rank IS NULL AS c_miss", "b.k_name AS b_name",
              f"{'c.name' if mapping else 'c.k_name'} AS c_name", "b.step AS b_step", "c.step AS c_step",
              "b.file AS b_file", "b.file_row AS b_row", "c.file AS c_file", "c.file_row AS c_row"]
    middle, outer = [], []
    for o in ops:
        scale = _scale_sql(o, ops)
        fixed = tolerance.exact or o in COUNT_OPS
        tol = ZERO if fixed else base
        if noise is not None and not fixed:
            tol = f"greatest({tol}, {num(tolerance.margin)} * COALESCE(n.{quote('n_' + o)}, {ZERO}))"
        inner += [f"b.{quote(o)} AS {quote('b_' + o)}", f"c.{quote(o)} AS {quote('c_' + o)}",
                  f"{rel_sql(o, scale, quantum)} AS {quote('r_' + o)}", f"{tol} AS {quote('t_' + o)}",
                  f"{factor_sql(o, scale, tol, quantum)} AS {quote('f_' + o)}"]
        r, t = quote("r_" + o), quote("t_" + o)
        middle.append(f"CASE WHEN {r} = 0 THEN {ZERO} WHEN {t} <= 0 THEN {INF} ELSE {r} / {t} END AS {quote('e_' + o)}")
    key = "r_" if tolerance.exact else "e_"
    worst_all = _greatest([quote(key + o) for o in ops]) if ops else ZERO
    worst = " ".join(f"WHEN {quote(key + o)} = {worst_all} THEN {literal(o)}" for o in ops) or "WHEN FALSE THEN NULL"
    equal = " AND ".join(f"{quote('b_' + o)} IS NOT DISTINCT FROM {quote('c_' + o)}" for o in ops) or "TRUE"
    diverged = "TRUE" if tolerance.exact else f"{worst_all} > {ONE}"
    outer += [
        f"CASE WHEN b_miss THEN {ONLY_CANDIDATE} WHEN c_miss THEN {ONLY_BASELINE} WHEN {equal} THEN {EQUAL} "
        f"WHEN {diverged} THEN {DIVERGED} ELSE {WITHIN} END AS status",
        f"CASE WHEN b_miss OR c_miss THEN NULL ELSE CASE {worst} END END AS worst_op",
    ]
    picked = [(name, " ".join(f"WHEN worst_op = {literal(o)} THEN {quote(name + '_' + o)}" for o in ops))
              for name in ("r", "t", "f")]
    last = [f"CASE {cases or 'WHEN FALSE THEN NULL'} ELSE NULL END AS {alias}"
            for (_, cases), alias in zip(picked, ("rel", "tol", "factor"))]
    return (
        f"SELECT *, {', '.join(last)} FROM (SELECT *, {', '.join(outer)} FROM (SELECT *{''.join(', ' + m for m in middle)} "
        f"FROM (SELECT {literal(table)} AS tbl, {', '.join(inner)} FROM ({b_side}) b FULL OUTER JOIN ({c_side}) c "
        f"ON {' AND '.join(f'b.{k} = c.{k}' for k in (*KEY, 'k_occ'))}{noise_join})))"
    )


def noise_sql(joined: str, ops: Sequence[str]) -> str:
    """The noise levels of a rerun from its :func:`joined_sql` with the baseline: per scope, per
    op ``n_<op>``, the largest finite normalised difference of any tensor, rank and step (of the
    steps compared); ``min``, ``max`` and ``mean`` pooled (all three measure elements against the
    tensor's largest: one element's rounding shows in whichever of them it is). Rows in one run
    only, and a NaN the rerun has, measure nothing."""
    def finite_max(items: Sequence[str]) -> str:
        largest = _greatest(items)
        return f"max(CASE WHEN {largest} < {INF} THEN {largest} END)"

    pooled = [o for o in ops if o in SCALED_OPS]
    groups = {o: (pooled if o in pooled else [o]) for o in ops}
    levels = "".join(f", {finite_max([quote('r_' + x) for x in group])} AS {quote('n_' + o)}" for o, group in groups.items())
    return f"SELECT k_scope{levels} FROM ({joined}) GROUP BY k_scope"


def rows_sql(
    schema: str, table: str, offset: int = 0, steps: tuple[int, int] | None = None, ref: Ref = schema_ref,
    *, left_out: str | None = None, mapping: Sequence[tuple[str, str]] = (), micro: bool = True, by_name: bool = False,
) -> str:
    """How many rows of ``table`` one run has (in ``steps``; those ``left_out`` names not counted,
    the names as ``mapping`` makes them): with the join's counts, whether a key repeats (a
    matched row counted more than once)."""
    if left_out is not None or by_name:
        rows = side_sql(schema, table, [], offset=offset, mapping=mapping, steps=steps, micro=micro, ref=ref,
                        left_out=left_out, by_name=by_name)
        return f"SELECT count(*) FROM ({rows})"
    where = f"WHERE step + {int(offset)} BETWEEN {int(steps[0])} AND {int(steps[1])}" if steps else ""
    return f"SELECT count(*) FROM {ref(schema, table)} {where}"


def ordered_sql(table: str, source: str, ref: Ref = schema_ref) -> str:
    """``source`` (rows of :func:`joined_sql`, kept in a table) with ``stage`` and ``position``
    added: the row's place within its step in execution order
    (:func:`~trainprobe.tools.sql.questions.place_sql` of its place among its file's rows of its
    step: the baseline's file, the candidate's for a row only it has; weight gradients from the
    last row, as backward computes them)."""
    firsts = (
        f"SELECT 'b' AS side, hash(file) AS file, step, min(file_row) AS first FROM {ref('b', table)} "
        f"WHERE step IN (SELECT DISTINCT b_step FROM {source}) GROUP BY ALL UNION ALL "
        f"SELECT 'c', hash(file), step, min(file_row) FROM {ref('c', table)} "
        f"WHERE step IN (SELECT DISTINCT c_step FROM {source} WHERE b_file IS NULL) GROUP BY ALL"
    )
    return f"""SELECT * EXCLUDE (in_file), {stage_sql(table, "k_scope", "k_name")} AS stage,
  {place_sql(table, "in_file", "k_scope", "k_name")} AS position
FROM (SELECT d.*, COALESCE(d.b_row - fb.first, d.c_row - fc.first) AS in_file
FROM {source} d
LEFT JOIN ({firsts}) fb ON fb.side = 'b' AND fb.file = d.b_file AND fb.step = d.b_step
LEFT JOIN ({firsts}) fc ON fc.side = 'c' AND fc.file = d.c_file AND fc.step = d.c_step)"""


_MICRO = "greatest(coalesce(k_micro, 0), 0)"  # a table without micro_step (V1 grad_unreduced: -1) counts as 0
ORDER = (
    f"k_step, stage >= {ONCE_STAGE}, CASE WHEN stage >= {ONCE_STAGE} THEN 0 ELSE {_MICRO} END, "
    f"stage, {_MICRO}, position, k_rank, tbl, k_name"
)
"""Execution order of :func:`ordered_sql`'s rows, as :func:`trainprobe.engine.execution_order.execution_key`
orders them: step; per micro-batch (forward, backward, unreduced gradients), then the
once-per-step tables (reduced gradients, collectives, optimizer, parameters); the table's stage;
the row's position in its file's step (unreduced gradients from the last,
:data:`BACKWARD_FIRST_LAST`); rank."""


def fmt(value: float | None) -> str:
    """A value as the answer prints it (``1.23e-02``, ``nan``, ``inf``, ``NULL``)."""
    if value is None:
        return "NULL"
    if not math.isfinite(value):
        return str(value)
    return f"{value:.6g}" if value == int(value) and abs(value) < 1e6 else f"{value:.3e}"


def fmt_factor(value: float | None) -> str:
    """A factor (:func:`factor_sql`) as ``×N``: ``×1.0023``, ``×2.37``, ``×100``, ``×4,000``,
    ``×1.2e+07``, ``×inf``; two significant digits of the change below ×10."""
    if value is None:
        return ""
    if not math.isfinite(value):
        return f"×{value}"
    if value >= 1e6:
        return f"×{value:.2g}"
    if value >= 10:
        return f"×{value:,.0f}"
    change = value - 1
    if change <= 0:
        return "×1"
    if change < 1e-4:
        return f"×1+{change:.1e}"
    digits = max(2, 1 - math.floor(math.log10(change)))
    return "×" + f"{value:.{digits}f}".rstrip("0").rstrip(".")
