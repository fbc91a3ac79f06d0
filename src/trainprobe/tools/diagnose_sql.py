"""Spike detection of ``trainprobe diagnose`` as DuckDB SQL over the query layer's views.

The spike rule (documented in docs/diagnose.md, "The spike rule"): a row's op value ``v`` is a
spike when

    |v| > factor * median(|v'| over the previous ``window`` finite values of its series)

and its series already had at least ``warmup`` finite values before it, and that median is above
0. A *series* is one tensor's statistic over the steps: one (table, rank, name, scope,
micro_step, vpp_stage) and one op of :data:`SPIKE_OPS`. Only the steps the files hold count (a
run recorded every 10 steps has series of every 10th step).

Execution order is not defined here: the rows found are ordered by
:func:`trainprobe.engine.execution_order.execution_key` (:mod:`trainprobe.tools.diagnose`); the
non-finite rows come from the query layer's own :func:`~trainprobe.tools.query_sql.first_nonfinite_sql`.

Standard library only (the SQL is run by the caller).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from trainprobe.tools.query_sql import ops_of
from trainprobe.tools.sql_names import ident, text

DEFAULT_SPIKE_FACTOR = 10.0
"""``--spike-factor``'s default: a value 10 times its running median."""
DEFAULT_WINDOW = 20
"""The running median covers a series' previous 20 finite values."""
DEFAULT_WARMUP = 10
"""A series is checked once it has 10 earlier finite values (early steps move a lot)."""
SPIKE_OPS: tuple[str, ...] = ("norm", "max", "min")
"""The ops checked for spikes, as two series per tensor: ``norm``, and the largest magnitude
``max(|min|, |max|)`` (reported as ``max`` or ``min``, whichever it is). Not ``min`` or ``max``
alone: the small side of a tensor (the smallest element of ``exp_avg_sq``, of a positive
weight) is near 0 and jumps 10x from step to step without anything being wrong. Not ``mean``
(it crosses 0, so its median magnitude can be near 0 too); not counts (``nans``, ``zeros``)."""
SQUARED_SCOPES: tuple[str, ...] = ("exp_avg_sq",)
"""Scopes holding squares (Adam's ``exp_avg_sq``, a running mean of squared gradients): their
bar is ``factor ** 2``, the same spike in gradient units. Without it the clean tiny GPT's
``exp_avg_sq``, which grows from 0 as the squared gradients grow, came to 9.8x its median."""
SERIES: tuple[str, ...] = ("rank", "name", "scope", "micro_step", "vpp_stage")
"""The key columns of a series within one view."""


def _finite_abs(op: str) -> str:
    """``|op|`` where it is finite, else NULL. Written ``abs(x) < inf`` rather than DuckDB's
    ``isfinite``, which Spark lacks: both engines order NaN above every number, so the test is
    false for NaN and ±inf on both, NULL for NULL."""
    return f"CASE WHEN abs({ident(op)}) < CAST('inf' AS DOUBLE) THEN abs({ident(op)}) END"


def signals(ops: Sequence[str]) -> dict[str, tuple[str, str, str]]:
    """The spike series a view with ``ops`` has: name → (magnitude, value, op name) as SQL. A
    magnitude is NULL where the value is NaN/inf (that is the non-finite check's; it never
    enters a median)."""
    out = {}
    if "norm" in ops:
        out["norm"] = (_finite_abs("norm"), '"norm"', "'norm'")
    if "min" in ops and "max" in ops:
        low, high = _finite_abs("min"), _finite_abs("max")
        bigger = 'abs("min") > abs("max")'
        out["amax"] = (
            f"greatest({low}, {high})",
            f'CASE WHEN {bigger} THEN "min" ELSE "max" END',
            f"CASE WHEN {bigger} THEN 'min' ELSE 'max' END",
        )
    elif "max" in ops or "min" in ops:
        op = "max" if "max" in ops else "min"
        out["amax"] = (_finite_abs(op), ident(op), text(op))
    return out


def spike_rows_sql(
    views: Mapping[str, Sequence[str]],
    factor: float = DEFAULT_SPIKE_FACTOR,
    window: int = DEFAULT_WINDOW,
    warmup: int = DEFAULT_WARMUP,
    last_step: int | None = None,
) -> str:
    """Every spike row of the views up to ``last_step`` (all steps when None), one row per
    (row, series), as ``table, rank, step, micro_step, vpp_stage, name, scope, op, value, median,
    file_row``. ``views`` maps each view to its columns; a view without any of
    :data:`SPIKE_OPS` gives nothing.

    One window pass per view (one sort by series and step; the medians of both series share it).
    Rows after ``last_step`` are not read: a median looks back only, so the answer up to
    ``last_step`` does not depend on them.
    """
    if warmup < 1 or window < warmup:
        raise ValueError(f"need 1 <= warmup ({warmup}) <= window ({window})")
    parts = []
    for table, columns in views.items():
        series = signals(ops_of(columns))
        if not series:
            continue
        where = f"WHERE step <= {int(last_step)}" if last_step is not None else ""
        values = ", ".join(f"{m} AS a_{k}, {v} AS v_{k}, {o} AS o_{k}" for k, (m, v, o) in series.items())
        frame = (
            f"PARTITION BY {', '.join(SERIES)} ORDER BY step, file_row "
            f"ROWS BETWEEN {int(window)} PRECEDING AND 1 PRECEDING"
        )
        stats = ", ".join(f"median(a_{k}) OVER w AS m_{k}, count(a_{k}) OVER w AS n_{k}" for k in series)
        checks = []
        squared = ", ".join(text(scope) for scope in SQUARED_SCOPES)
        bar = f"CASE WHEN scope IN ({squared}) THEN {float(factor) ** 2!r} ELSE {float(factor)!r} END"
        for k in series:
            hit = f"n_{k} >= {int(warmup)} AND m_{k} > 0 AND a_{k} > {bar} * m_{k}"
            checks.append(
                f"SELECT {text(table)} AS \"table\", rank, step, micro_step, vpp_stage, name, scope, o_{k} AS op, "
                f"v_{k} AS value, m_{k} AS median, file_row FROM scored WHERE {hit}"
            )
        union = " UNION ALL ".join(checks)
        parts.append(
            f"(WITH base AS (SELECT {', '.join(SERIES)}, step, file_row, {values} FROM {ident(table)} {where}), "
            f"scored AS (SELECT *, {stats} FROM base WINDOW w AS ({frame})) {union})"
        )
    if not parts:
        return (
            'SELECT NULL::VARCHAR AS "table", NULL::BIGINT AS rank, NULL::BIGINT AS step, NULL::BIGINT AS micro_step, '
            "NULL::BIGINT AS vpp_stage, NULL::VARCHAR AS name, NULL::VARCHAR AS scope, NULL::VARCHAR AS op, "
            "NULL::DOUBLE AS value, NULL::DOUBLE AS median, NULL::BIGINT AS file_row WHERE FALSE"
        )
    return "\nUNION ALL\n".join(parts)


BACKWARD_ROWS: dict[str, str] = {"module": "scope = 'backward'", "weight_grad": "TRUE", "cc": "TRUE"}
"""Per V2 view, SQL true for its rows computed from the (scaled) backward pass; V1 tables by
their phase (:mod:`trainprobe.engine.execution_order`)."""


def backward_rows_sql(view: str) -> str | None:
    """SQL true for the rows of ``view`` that the backward pass computed (the ones a loss scale
    multiplies: activation and weight gradients, the collectives that reduce them), None for a
    view with none (``param``, ``optimizer``, V1 ``actv`` ...)."""
    from trainprobe.engine.execution_order import BACKWARD, OTHER_TABLE, PHASE_OF_SUFFIX

    if view in BACKWARD_ROWS:
        return BACKWARD_ROWS[view]
    if view == OTHER_TABLE:
        return "NOT suffix(name, '.mg_direction')"
    return "TRUE" if PHASE_OF_SUFFIX.get(view) == BACKWARD else None


def exempt_sql(view: str, skipped: Mapping[int, Sequence[int]]) -> str | None:
    """SQL true for the rows of ``view`` that GradScaler's skipped steps explain: backward rows
    (:func:`backward_rows_sql`) of a (rank, step) in ``skipped`` (rank → steps); None when
    there are none."""
    backward = backward_rows_sql(view)
    if backward is None or not skipped:
        return None
    ranks = []
    for rank, steps in sorted(skipped.items()):
        spans = " OR ".join(f"step = {a}" if a == b else f"step BETWEEN {a} AND {b}" for a, b in _runs(steps))
        ranks.append(f"(rank = {int(rank)} AND ({spans}))")
    return f"(({' OR '.join(ranks)}) AND {backward})"


def _runs(steps: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted steps as (first, last) runs of consecutive steps."""
    out: list[list[int]] = []
    for step in sorted({int(s) for s in steps}):
        if out and step == out[-1][1] + 1:
            out[-1][1] = step
        else:
            out.append([step, step])
    return [(a, b) for a, b in out]


def first_spikes_sql(spikes: str, steps: int, limit: int) -> str:
    """From the table ``spikes`` (rows of :func:`spike_rows_sql`): the first spike of each
    (table, rank, step, micro_step, scope, vpp_stage) group, in its ``steps`` first steps with a
    spike, at most ``limit`` of them (earliest steps first): the candidates that execution order
    then sorts. Same columns, the op and value of the group's first row (an op order of
    :data:`SPIKE_OPS` within one row)."""
    op_rank = "CASE op " + " ".join(f"WHEN {text(op)} THEN {i}" for i, op in enumerate(SPIKE_OPS)) + " END"
    return f"""WITH chosen AS (SELECT DISTINCT step FROM {spikes} ORDER BY step LIMIT {int(steps)})
SELECT "table", rank, step, micro_step, vpp_stage, scope,
  arg_min(name, (file_row, {op_rank})) AS name, arg_min(op, (file_row, {op_rank})) AS op,
  arg_min(value, (file_row, {op_rank})) AS value, arg_min(median, (file_row, {op_rank})) AS median,
  min(file_row) AS file_row
FROM {spikes} WHERE step IN (SELECT step FROM chosen)
GROUP BY "table", rank, step, micro_step, vpp_stage, scope
ORDER BY step, rank, "table", scope LIMIT {int(limit)}"""


def spiking_pieces_sql(merged: str, local: str) -> str:
    """Each rank's first step with a spike of a full-tensor row (table ``merged``, rows of
    :func:`spike_rows_sql` over full-tensor views) as ``rank, step``: the ranks whose own row of
    that tensor, step and micro-step spiked too (table ``local``, over the rank-local rows), or,
    where none did, the full-tensor row's rank."""
    same = (
        'l."table" = m."table" AND l.step = m.step AND l.name = m.name AND l.scope = m.scope '
        "AND l.micro_step IS NOT DISTINCT FROM m.micro_step AND l.vpp_stage IS NOT DISTINCT FROM m.vpp_stage"
    )
    return (
        f"SELECT rank, min(step) AS step FROM ("
        f"SELECT l.rank, l.step FROM {local} l JOIN {merged} m ON {same} "
        f"UNION ALL SELECT m.rank, m.step FROM {merged} m WHERE NOT EXISTS (SELECT 1 FROM {local} l WHERE {same})"
        ") GROUP BY rank ORDER BY rank"
    )


def step_starts_sql(table: str, steps: Sequence[int]) -> str:
    """The first ``file_row`` and the file of each (rank, step) of ``table`` among ``steps``: a
    row's position in execution order is its ``file_row`` minus its step's first (one rank's
    rows of one step of one table are in one file)."""
    listed = ", ".join(str(int(s)) for s in steps) or "NULL"
    return (
        f"SELECT rank, step, min(file_row) AS first_row, arg_min(file, file_row) AS file FROM {ident(table)} "
        f"WHERE step IN ({listed}) GROUP BY rank, step"
    )


def nonfinite_by_rank_sql(views: Mapping[str, Sequence[str]], nonfinite: Mapping[str, str]) -> str:
    """Each rank's first step with a row that ``nonfinite[view]`` (a SQL condition) calls
    non-finite, as ``rank, step``, by rank (one filtered scan; the run's first such step is the
    least of them)."""
    parts = [
        f"SELECT rank, min(step) AS step FROM {ident(table)} WHERE {nonfinite[table]} GROUP BY rank"
        for table in views
        if table in nonfinite
    ]
    if not parts:
        return "SELECT NULL::BIGINT AS rank, NULL::BIGINT AS step WHERE FALSE"
    return "SELECT rank, min(step) AS step FROM (" + " UNION ALL ".join(parts) + ") GROUP BY rank ORDER BY rank"
