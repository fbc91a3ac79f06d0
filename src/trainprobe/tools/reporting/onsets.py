"""The NaN/inf onsets and alerts of ``trainprobe report``: which rows are non-finite, each
target's first such row in execution order as an analyser event, and the events of the run's
``anomaly.json`` files."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from trainprobe.engine.execution_order import in_backward_order
from trainprobe.tools.anomalies.analyser import ANOMALY_FILE, ANOMALY_FOLDER, AnomalyEvent, load_anomalies
from trainprobe.tools.reporting.events import COUNT_OPS, describe_values
from trainprobe.tools.reporting.rows import Rows, table_phase
from trainprobe.tools.reporting.types import MAX_ONSETS, Group
from trainprobe.tools.runs.files import RunFile


def nonfinite_row_mask(values: np.ndarray, known: np.ndarray, ops: tuple[str, ...]) -> np.ndarray:
    """Per row: a NaN/inf value, or a count op (``nans``) above 0."""
    bad = (known & ~np.isfinite(values)).any(axis=1)
    for column, op in enumerate(ops):
        if op in COUNT_OPS:
            bad |= known[:, column] & (np.nan_to_num(values[:, column]) > 0)
    return bad


def first_onsets(
    group: Group, rank: int, rows: Rows, names: list[str], seen: set[int]
) -> tuple[list[AnomalyEvent], list[int]]:
    """The first non-finite row of each target of ``group`` on ``rank`` not in ``seen``, as
    analyser events (the first :data:`MAX_ONSETS` such targets in execution order), and the ids
    of every such target.

    Within one group and rank the execution key is (step, micro-step, pipeline stage: ascending
    in the forward phase, descending after, position = row among its step's in its file, counted
    from the last row for weight gradients: :func:`~trainprobe.engine.execution_order.place`), so the rows are sorted
    by it with numpy and only the kept ones become events."""
    bad = np.flatnonzero(nonfinite_row_mask(rows.values, rows.known, group.ops))
    if not bad.size:
        return [], []
    phase, once = table_phase(group.table)
    stage = rows.vpp[bad] if phase == "forward" else -rows.vpp[bad]
    micro = np.zeros(bad.size, dtype=np.int64) if once else rows.micro[bad]
    pos = -rows.pos[bad] if in_backward_order(group.table) else rows.pos[bad]  # execution_order.place
    order = bad[np.lexsort((pos, stage, micro, rows.steps[bad]))]
    ids, first = np.unique(rows.targets[order], return_index=True)  # each target's first row in that order
    new = ~np.isin(ids, np.fromiter(seen, dtype=np.int64, count=len(seen)))
    firsts = order[np.sort(first[new])][:MAX_ONSETS]
    return [_row_event(group, rank, rows, int(row), names) for row in firsts], ids[new].tolist()


def _row_event(group: Group, rank: int, rows: Rows, row: int, names: list[str]) -> AnomalyEvent:
    """A CSV row as an analyser event: ``call_id`` is the row's place in its file, ``position``
    its place among the rows of its step there."""
    target = names[int(rows.targets[row])]
    phase, once = table_phase(group.table, target)
    line = int(rows.line[row])
    data = {
        "rank": rank,
        "step": int(rows.steps[row]),
        "micro_step": max(int(rows.micro[row]), 0),
        "pp_stage": 0,
        "vpp_stage": int(rows.vpp[row]),
        "call_id": line,
        "tag_name": f"{target}/rank{rank}/{group.name}",
        "message": describe_values(group.ops, rows.values[row], rows.known[row]),
        "group_mates": [],
    }
    source = rows.sources[int(rows.source[row])]
    return AnomalyEvent(
        key=f"{source.name}:{line + 2}",
        data=data,
        source=source,
        phase=phase,
        once_per_step=once,
        position=int(rows.pos[row]),
    )


def read_alerts(root: Path, csvs: Sequence[RunFile]) -> tuple[list[Path], list[AnomalyEvent]]:
    """The events of ``root/anomaly_detected/rank*/anomaly.json`` in file order ([] without).
    When ``root`` is one V1 run folder, its parent's ``anomaly_detected`` and that rank's events."""
    folder, ranks = root / ANOMALY_FOLDER, None
    if not folder.is_dir() and [f.run for f in csvs] == [root.name] * len(csvs):
        folder, ranks = root.parent / ANOMALY_FOLDER, {f.rank for f in csvs}
    if not any(folder.glob(f"rank*/{ANOMALY_FILE}")):
        return [], []
    _, files, events = load_anomalies(folder)
    if ranks is not None:
        files = [f for f in files if f.parent.name in {f"rank{r}" for r in ranks}]
        events = [e for e in events if e.data["rank"] in ranks]
    return files, events
