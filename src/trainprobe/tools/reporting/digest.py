"""The digest of ``trainprobe report``: what is kept of a group's rows on one rank as each file
is read (counts, steps, each target's peak and NaN/inf flag, the global norm per step, the first
onsets), so that memory is bounded by what is drawn, not by the rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from trainprobe.tools.anomalies.analyser import AnomalyEvent, order_events
from trainprobe.tools.reporting.cells import grown, largest_per_key, unique_inverse
from trainprobe.tools.reporting.groups import default_op
from trainprobe.tools.reporting.onsets import first_onsets, nonfinite_row_mask
from trainprobe.tools.reporting.rows import Block, join_blocks, table_phase
from trainprobe.tools.reporting.run import TopShares
from trainprobe.tools.reporting.types import MAX_ONSETS, Group

if TYPE_CHECKING:
    from trainprobe.tools.reporting.collect import Reading


@dataclass
class Digest:
    """What is kept of one group's rows on one rank once read, for every target."""

    ops: dict[str, None] = field(default_factory=dict)
    rows: int = 0
    bad_rows: int = 0
    steps: set[int] = field(default_factory=set)
    global_value: dict[int, float] = field(default_factory=dict)  # step → sum of norm², or max |op|
    global_bad: set[int] = field(default_factory=set)
    global_norm: bool = True
    onset_ids: set[int] = field(default_factory=set)
    onsets: list[AnomalyEvent] = field(default_factory=list)
    shares: TopShares | None = None  # gradient groups: the top offenders' digest


def digest_block(reading: Reading, name: str, rank: int, block: Block, digest: Digest) -> None:
    """Fold one block into its group's per-target peaks and NaN/inf flags and into ``digest``:
    counts, steps, the global norm per step (each target's cell: its largest finite norm among
    the micro-steps of the file) and the first onsets."""
    rows, ops = join_blocks([block], block.ops), block.ops
    size = len(reading.names[name])
    peaks = reading.peaks[name] = grown(reading.peaks.get(name), size, -1.0)
    bad = reading.bad[name] = grown(reading.bad.get(name), size, False)
    op = default_op(ops)
    finite = np.isfinite(rows.values)
    column, ok = rows.values[:, op], finite[:, op]
    np.maximum.at(peaks, rows.targets, np.where(ok, np.abs(column), -1.0))
    bad_rows = nonfinite_row_mask(rows.values, rows.known, ops)
    bad[rows.targets[bad_rows]] = True
    digest.ops.update(dict.fromkeys(ops))
    digest.rows += len(rows.targets)
    digest.bad_rows += int(bad_rows.sum())
    steps, step_index = unique_inverse(rows.steps)
    digest.steps.update(steps.tolist())
    digest.global_bad.update(steps[np.unique(step_index[rows.known[:, op] & ~ok])].tolist())
    digest.global_norm = ops[op] == "norm"
    _fold_global(digest, steps, step_index, rows.targets, column, ok)
    if bad_rows.any():
        stub = Group(name, reading.tables[name], table_phase(reading.tables[name])[0], ops, [], steps, {})
        events, new = first_onsets(stub, rank, rows, list(reading.names[name]), digest.onset_ids)
        digest.onset_ids.update(new)
        digest.onsets = order_events([*digest.onsets, *events])[:MAX_ONSETS]


def _fold_global(
    digest: Digest, steps: np.ndarray, step_index: np.ndarray, targets: np.ndarray, column: np.ndarray, ok: np.ndarray
) -> None:
    """Add one block's per-step sum of norm² (or max |value|) to ``digest.global_value``."""
    n = len(steps)
    if digest.global_norm:
        cells, largest = largest_per_key(targets * n + step_index, column, ok)
        present = np.isfinite(largest)
        where = cells[present] % n
        sums = np.bincount(where, weights=largest[present] ** 2, minlength=n)
        if digest.shares is not None:
            squares = largest[present] ** 2
            fine = np.isfinite(squares)
            digest.shares.add(steps[where[fine]], cells[present][fine] // n, squares[fine])
        for step in np.unique(where).tolist():
            key = int(steps[step])
            digest.global_value[key] = digest.global_value.get(key, 0.0) + float(sums[step])
        return
    peak = np.full(n, -np.inf)
    np.maximum.at(peak, step_index[ok], np.abs(column[ok]))
    for step, value in zip(steps.tolist(), peak.tolist()):
        if value > -np.inf:
            digest.global_value[step] = max(digest.global_value.get(step, -np.inf), value)
