"""The SQL of ``trainprobe diagnose`` over the query layer's views: each rank's first
non-finite step, GradScaler's exempt rows, the first spikes of the spike table (found by the
spike rule's replay, :mod:`trainprobe.tools.diagnosis.spikes`), their places in execution order.

Execution order is not defined here: the rows found are ordered by
:func:`trainprobe.engine.execution_order.execution_key` (:mod:`trainprobe.tools.diagnosis.answer`); the
non-finite rows come from the query layer's own :func:`~trainprobe.tools.sql.questions.first_nonfinite_sql`.

The SQL is run by the caller.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from trainprobe.engine.rules.series import SPIKE_OPS as SERIES_OPS
from trainprobe.tools.sql.names import ident, text

SPIKE_OPS: tuple[str, ...] = SERIES_OPS
"""The ops the two spike signals of a tensor are made of, ``norm`` and the largest magnitude
(:data:`trainprobe.engine.rules.series.SPIKE_OPS`; the series are cut there)."""
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
