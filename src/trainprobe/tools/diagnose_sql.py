"""Spike detection of ``trainprobe diagnose`` as DuckDB SQL over the query layer's views.

The spike rule (documented in docs/diagnose.md, "The spike rule"): a row's op value ``v`` is a
spike when

    |v| > factor * median(|v'| over the previous ``window`` finite values of its series)

and its series already had at least ``warmup`` finite values before it, and that median is above
0. A *series* is one tensor's statistic over the steps: one (table, rank, name, scope,
micro_step, vpp_stage) and one op of :data:`SPIKE_OPS`. Only the steps the files hold count (a
run recorded every 10 steps has series of every 10th step).

Execution order is not defined here: the rows found are ordered by
:func:`trainprobe.tools.execution_order.execution_key` (:mod:`trainprobe.tools.diagnose`); the
non-finite rows come from the query layer's own :func:`~trainprobe.tools.query_sql.first_nonfinite_sql`.

Standard library only (the SQL is run by the caller).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from trainprobe.tools.query_sql import ops_of

DEFAULT_SPIKE_FACTOR = 10.0
"""``--spike-factor``'s default: a value 10 times its running median."""
DEFAULT_WINDOW = 20
"""The running median covers a series' previous 20 finite values."""
DEFAULT_WARMUP = 10
"""A series is checked once it has 10 earlier finite values (early steps move a lot)."""
SPIKE_OPS: tuple[str, ...] = ("norm", "max", "min")
"""The ops checked for spikes, by magnitude. ``mean`` is not (it crosses 0, so its median
magnitude can be near 0 without anything being wrong); counts (``nans``, ``zeros``) are not."""
SERIES: tuple[str, ...] = ("rank", "name", "scope", "micro_step", "vpp_stage")
"""The key columns of a series within one view."""


def _magnitude(op: str) -> str:
    """``|op|`` where it is finite, else NULL (a NaN/inf is the non-finite check's, and never
    enters a median)."""
    return f'CASE WHEN isfinite("{op}") THEN abs("{op}") END'


def spike_rows_sql(
    views: Mapping[str, Sequence[str]],
    factor: float = DEFAULT_SPIKE_FACTOR,
    window: int = DEFAULT_WINDOW,
    warmup: int = DEFAULT_WARMUP,
    last_step: int | None = None,
) -> str:
    """Every spike row of the views up to ``last_step`` (all steps when None), one row per
    (row, op), as ``table, rank, step, micro_step, vpp_stage, name, scope, op, value, median,
    file_row``. ``views`` maps each view to its columns; a view without any of
    :data:`SPIKE_OPS` gives nothing.

    One window pass per view (one sort by series and step; the medians of every op share it).
    Rows after ``last_step`` are not read: a median looks back only, so the answer up to
    ``last_step`` does not depend on them.
    """
    if warmup < 1 or window < warmup:
        raise ValueError(f"need 1 <= warmup ({warmup}) <= window ({window})")
    parts = []
    for table, columns in views.items():
        ops = [op for op in SPIKE_OPS if op in ops_of(columns)]
        if not ops:
            continue
        where = f"WHERE step <= {int(last_step)}" if last_step is not None else ""
        mags = ", ".join(f"{_magnitude(op)} AS a_{op}" for op in ops)
        frame = (
            f"PARTITION BY {', '.join(SERIES)} ORDER BY step, file_row "
            f"ROWS BETWEEN {int(window)} PRECEDING AND 1 PRECEDING"
        )
        stats = ", ".join(f"median(a_{op}) OVER w AS m_{op}, count(a_{op}) OVER w AS n_{op}" for op in ops)
        checks = []
        for op in ops:
            hit = f"n_{op} >= {int(warmup)} AND m_{op} > 0 AND a_{op} > {float(factor)!r} * m_{op}"
            checks.append(
                f"SELECT '{table}' AS \"table\", rank, step, micro_step, vpp_stage, name, scope, '{op}' AS op, "
                f'"{op}" AS value, m_{op} AS median, file_row FROM scored WHERE {hit}'
            )
        union = " UNION ALL ".join(checks)
        raw = ", ".join(f'"{o}"' for o in ops)
        parts.append(
            f"(WITH base AS (SELECT {', '.join(SERIES)}, step, file_row, {raw}, "
            f'{mags} FROM "{table}" {where}), '
            f"scored AS (SELECT *, {stats} FROM base WINDOW w AS ({frame})) {union})"
        )
    if not parts:
        return (
            'SELECT NULL::VARCHAR AS "table", NULL::BIGINT AS rank, NULL::BIGINT AS step, NULL::BIGINT AS micro_step, '
            "NULL::BIGINT AS vpp_stage, NULL::VARCHAR AS name, NULL::VARCHAR AS scope, NULL::VARCHAR AS op, "
            "NULL::DOUBLE AS value, NULL::DOUBLE AS median, NULL::BIGINT AS file_row WHERE FALSE"
        )
    return "\nUNION ALL\n".join(parts)


def first_spikes_sql(spikes: str, steps: int, limit: int) -> str:
    """From the table ``spikes`` (rows of :func:`spike_rows_sql`): the first spike of each
    (table, rank, step, micro_step, scope, vpp_stage) group, in its ``steps`` first steps with a
    spike, at most ``limit`` of them (earliest steps first): the candidates that execution order
    then sorts. Same columns, the op and value of the group's first row (an op order of
    :data:`SPIKE_OPS` within one row)."""
    op_rank = "CASE op " + " ".join(f"WHEN '{op}' THEN {i}" for i, op in enumerate(SPIKE_OPS)) + " END"
    return f"""WITH chosen AS (SELECT DISTINCT step FROM {spikes} ORDER BY step LIMIT {int(steps)})
SELECT "table", rank, step, micro_step, vpp_stage, scope,
  arg_min(name, (file_row, {op_rank})) AS name, arg_min(op, (file_row, {op_rank})) AS op,
  arg_min(value, (file_row, {op_rank})) AS value, arg_min(median, (file_row, {op_rank})) AS median,
  min(file_row) AS file_row
FROM {spikes} WHERE step IN (SELECT step FROM chosen)
GROUP BY "table", rank, step, micro_step, vpp_stage, scope
ORDER BY step, rank, "table", scope LIMIT {int(limit)}"""


def step_starts_sql(table: str, steps: Sequence[int]) -> str:
    """The first ``file_row`` and the file of each (rank, step) of ``table`` among ``steps``: a
    row's position in execution order is its ``file_row`` minus its step's first (one rank's
    rows of one step of one table are in one file)."""
    listed = ", ".join(str(int(s)) for s in steps) or "NULL"
    return (
        f'SELECT rank, step, min(file_row) AS first_row, arg_min(file, file_row) AS file FROM "{table}" '
        f"WHERE step IN ({listed}) GROUP BY rank, step"
    )


def first_anomaly_by_rank_sql(views: Mapping[str, Sequence[str]], spikes: str, nonfinite: Mapping[str, str]) -> str:
    """Each rank's first step with an anomaly (a spike in the table ``spikes``, or a row that
    ``nonfinite[view]`` (a SQL condition) calls non-finite), as ``rank, step``, by rank."""
    parts = [f"SELECT rank, min(step) AS step FROM {spikes} GROUP BY rank"]
    parts += [
        f'SELECT rank, min(step) AS step FROM "{table}" WHERE {nonfinite[table]} GROUP BY rank'
        for table in views
        if table in nonfinite
    ]
    return "SELECT rank, min(step) AS step FROM (" + " UNION ALL ".join(parts) + ") GROUP BY rank ORDER BY rank"
