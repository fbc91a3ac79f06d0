"""The groups of ``trainprobe report`` built from the reading state: their execution order, the
targets each draws, the default op, and each rank's matrix (cells, counts, global norm)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from trainprobe.engine.execution_order import PHASE_ORDER, table_rank
from trainprobe.tools.anomalies.analyser import AnomalyEvent, order_events
from trainprobe.tools.reporting.cells import compact, merge_cells
from trainprobe.tools.reporting.rows import Rows, join_blocks, table_phase
from trainprobe.tools.reporting.run import offenders_of
from trainprobe.tools.reporting.types import MAX_ONSETS, Group, RankMatrix

if TYPE_CHECKING:
    from trainprobe.tools.reporting.collect import Reading
    from trainprobe.tools.reporting.digest import Digest


def group_order(tables: dict[str, str]) -> list[str]:
    """Group names in execution order: per-micro-step groups, then once-per-step ones; phase,
    then the table's place (:data:`~trainprobe.engine.execution_order.TABLE_ORDER`)."""

    def key(name: str) -> tuple[bool, int, int, str]:
        phase, once = table_phase(tables[name])
        return once, PHASE_ORDER[phase], table_rank(tables[name]), name

    return sorted(tables, key=key)


def build_group(name: str, reading: Reading) -> tuple[Group, list[AnomalyEvent]]:
    """The group's matrices (of the targets :func:`pick_targets` keeps), its digests' counts and
    global norms, and its first :data:`MAX_ONSETS` NaN/inf onset events."""
    table = reading.tables[name]
    digests = sorted((rank, digest) for (group, rank), digest in reading.digests.items() if group == name)
    ops = tuple(dict.fromkeys(op for _, digest in digests for op in digest.ops))
    steps = np.array(sorted(set().union(*(digest.steps for _, digest in digests))), dtype=np.int64)
    all_targets = list(reading.names[name])
    chosen = reading.sampled.get(name, np.arange(len(all_targets)))
    position = np.full(len(all_targets), -1, dtype=np.int64)
    position[chosen] = np.arange(len(chosen))
    group = Group(name, table, table_phase(table)[0], ops, [all_targets[i] for i in chosen], steps, {})
    group.all_targets = len(all_targets)
    onsets: list[AnomalyEvent] = []
    for rank, digest in digests:
        parts = reading.blocks.pop((name, rank), [])
        rows = join_blocks(parts, ops) if parts else None
        group.ranks[rank] = _rank_matrix(rows, ops, position, len(chosen), steps, digest)
        onsets.extend(digest.onsets)
        group.onset_targets += len(digest.onset_ids)
        found = offenders_of(digest.shares, all_targets, name, rank) if digest.shares and digest.global_norm else None
        if found is not None:
            group.offenders[rank] = found
    onsets = order_events(onsets)[:MAX_ONSETS]
    group.first_onset_step = onsets[0].data["step"] if onsets else None
    return group, onsets


def pick_targets(peaks: np.ndarray, bad: np.ndarray, limit: int) -> np.ndarray:
    """Indices (ascending: model order) of the targets a group draws: all when there are at most
    ``limit``; else every target with a NaN/inf row first, then the largest ``peaks`` (the
    largest finite |value| of the default op), ``limit`` in all."""
    if len(peaks) <= limit:
        return np.arange(len(peaks))
    order = np.lexsort((-peaks, ~bad))  # bad first, then largest peak; stable: model order on ties
    return np.sort(order[:limit])


def default_op(ops: Sequence[str]) -> int:
    """Index of the op shown first and used to rank targets: ``norm`` where there is one, else the first."""
    return list(ops).index("norm") if "norm" in ops else 0


def _rank_matrix(
    rows: Rows | None, ops: tuple[str, ...], position: np.ndarray, n_targets: int, steps: np.ndarray, digest: Digest
) -> RankMatrix:
    """Cells of one rank (rows of the drawn targets: ``position`` ≥ 0): the value of largest
    magnitude where several micro-steps share a cell; counts and the global norm from ``digest``."""
    n_steps = len(steps)
    flags = np.zeros((n_targets * n_steps, len(ops)), dtype=bool)
    if rows is None:
        values = np.full(flags.shape, np.nan)
    else:
        step_index = np.searchsorted(steps, rows.steps)
        finite = np.isfinite(rows.values)
        drawn = position[rows.targets] >= 0
        if drawn.all():  # every target drawn (a group of at most MAX_TARGETS): no row to leave out
            keys = position[rows.targets] * n_steps + step_index
            known, kept, kept_finite = rows.known, rows.values, finite
        else:
            keys = position[rows.targets[drawn]] * n_steps + step_index[drawn]
            known, kept, kept_finite = rows.known[drawn], rows.values[drawn], finite[drawn]
        bad_rows, bad_ops = np.nonzero(known & ~kept_finite)
        flags[keys[bad_rows], bad_ops] = True
        values = merge_cells(keys, kept, kept_finite, n_targets * n_steps)
    global_value = np.array([digest.global_value.get(int(s), np.nan) for s in steps], dtype=np.float64)
    label = "global norm" if digest.global_norm else f"max |{ops[default_op(ops)]}|"
    return RankMatrix(
        values=compact(values).reshape(n_targets, n_steps, len(ops)),
        nonfinite=flags.reshape(n_targets, n_steps, len(ops)),
        rows=digest.rows,
        nonfinite_rows=digest.bad_rows,
        global_value=np.sqrt(global_value) if digest.global_norm else global_value,
        global_nonfinite=np.isin(steps, list(digest.global_bad)),
        global_label=label,
    )
