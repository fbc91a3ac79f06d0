"""The reading state of ``trainprobe report``: each file's rows handed over as one block per
group (targets as ids, model order), digested and kept while the group is small, the targets of
larger groups picked and their files read again, and alerts given their CSV row's position."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from trainprobe.engine.execution_order import V2_DEFAULT_TABLE, V2_TABLE_OF, row_positions
from trainprobe.tools.anomalies.analyser import AnomalyEvent
from trainprobe.tools.reporting.cells import compact, real_rows, target_ids
from trainprobe.tools.reporting.digest import Digest, digest_block
from trainprobe.tools.reporting.events import bare_target, event_group, event_target
from trainprobe.tools.reporting.groups import pick_targets
from trainprobe.tools.reporting.read import FileRows
from trainprobe.tools.reporting.rows import Block, table_phase
from trainprobe.tools.reporting.run import TopShares
from trainprobe.tools.reporting.types import GRADIENT_TABLES, MAX_TARGETS
from trainprobe.tools.runs.files import RunFile
from trainprobe.tools.runs.layout import V1_DATA_TYPES


@dataclass
class Reading:
    """Reading state: per group its V1 table, target ids (model order), each target's peak and
    NaN/inf flag; per (group, rank) the digest and the rows kept; the targets of sampled groups."""

    tables: dict[str, str] = field(default_factory=dict)
    names: dict[str, dict[str, int]] = field(default_factory=dict)
    peaks: dict[str, np.ndarray] = field(default_factory=dict)
    bad: dict[str, np.ndarray] = field(default_factory=dict)
    digests: dict[tuple[str, int], Digest] = field(default_factory=dict)
    blocks: dict[tuple[str, int], list[Block]] = field(default_factory=dict)
    sampled: dict[str, np.ndarray] = field(default_factory=dict)  # group → drawn ids (empty until picked)
    #: (rank, table, step, micro-step, vpp_stage, target) → indices of the alerts of that row, by call_id
    alert_rows: dict[tuple[int, str, int, int, int, str], list[int]] = field(default_factory=dict)
    alert_positions: dict[int, int] = field(default_factory=dict)  # alert index → its CSV row's position

    def add(self, name: str, table: str, rank: int, block: Block) -> None:
        """Digest ``block`` and keep its rows while its group has at most :data:`MAX_TARGETS` targets."""
        self.tables.setdefault(name, table)
        digest = self.digests.get((name, rank))
        if digest is None:
            digest = self.digests[name, rank] = Digest(shares=TopShares() if table in GRADIENT_TABLES else None)
        digest_block(self, name, rank, block, digest)
        if len(self.names[name]) <= MAX_TARGETS:
            self.blocks.setdefault((name, rank), []).append(_slim(block))
        elif name not in self.sampled:
            self.sampled[name] = np.zeros(0, dtype=np.int64)
            self.blocks = {key: kept for key, kept in self.blocks.items() if key[0] != name}

    def reread_sampled(self, read: Callable[[Sequence[RunFile]], Iterable[tuple[RunFile, FileRows]]],
                       files: Sequence[RunFile]) -> None:
        """Pick the targets each sampled group draws and read its files again (``read``: as the
        first pass read them) for their rows."""
        for name in self.sampled:
            self.sampled[name] = pick_targets(self.peaks[name], self.bad[name], MAX_TARGETS)
        wanted = {name.split("/")[0] for name in self.sampled}
        if not wanted:
            return
        for file, rows in read([f for f in files if f.data_type in wanted]):
            collect_file(file, rows, self, second=True)


def alerts_by_row(alerts: Sequence[AnomalyEvent]) -> dict[tuple[int, str, int, int, int, str], list[int]]:
    """The alerts by the CSV row they name (rank, table, step, micro-step, stage, bare target),
    each row's alerts in ``call_id`` order (a module called twice: its first call first)."""
    found: dict[tuple[int, str, int, int, int, str], list[int]] = {}
    for n in sorted(range(len(alerts)), key=lambda i: alerts[i].data["call_id"]):
        data, table = alerts[n].data, event_group(alerts[n])
        micro = 0 if alerts[n].once_per_step else data["micro_step"]  # once per step: no micro-step in the CSV
        key = (data["rank"], table, data["step"], micro, data["vpp_stage"])
        found.setdefault((*key, event_target(alerts[n])), []).append(n)
    return found


def _place_alerts(reading: Reading, file: RunFile, targets: list[str], columns: dict[str, np.ndarray]) -> None:
    """Give the alerts that name a row of ``file`` that row's position (see the module docstring):
    the k-th alert of a key takes the k-th row of that key."""
    wanted = {key[2] for key in reading.alert_rows if key[:2] == (file.rank, file.data_type)}
    if not wanted:
        return
    steps, micro, vpp, pos = (columns[k].tolist() for k in ("steps", "micro", "vpp", "pos"))
    taken: dict[tuple[int, str, int, int, int, str], int] = {}
    for row in (i for i, step in enumerate(steps) if step in wanted):
        target = bare_target(targets[row])
        once = table_phase(file.data_type, target)[1]
        key = (file.rank, file.data_type, steps[row], 0 if once else max(micro[row], 0), vpp[row], target)
        alerts = reading.alert_rows.get(key)
        if alerts is not None and taken.get(key, 0) < len(alerts):
            reading.alert_positions[alerts[taken.get(key, 0)]] = pos[row]
            taken[key] = taken.get(key, 0) + 1


def _group_of(file: RunFile, scope: str | None) -> tuple[str, str]:
    """(group name, V1 table) of a row."""
    if file.layout == "v1" or scope is None:
        return file.data_type, file.data_type if file.data_type in V1_DATA_TYPES else "other"
    table = V2_TABLE_OF.get((file.data_type, scope), V2_DEFAULT_TABLE.get(file.data_type, "other"))
    return f"{file.data_type}/{scope}", table


def collect_file(file: RunFile, table: FileRows, reading: Reading, second: bool = False) -> int:
    """Hand the complete rows of ``file`` (``table``) to ``reading`` as one block of numbers per
    group (targets as ids, in model order); returns the torn rows. The second pass keeps only
    the rows of the targets that sampled groups draw.

    Numbers come from the query layer (:func:`~trainprobe.tools.reporting.read.read_files`); the
    reference writer's trailing ``shape,dtype`` text columns are not ops. A row the reference
    wrote for a tensor that did not exist (every value and its ``shape`` ``nan``, e.g. the
    gradient of an input that needs none) is no row: it is neither drawn nor an anomaly.
    """
    n = len(table.steps)
    if not n:
        return table.torn
    values = table.values
    columns = {
        "steps": table.steps,
        "micro": table.micro,
        "vpp": table.vpp,
        "line": np.arange(n),
        "pos": row_positions(table.steps),
        "values": values,
    }
    keep = real_rows(table.shapes, values)
    if reading.alert_rows and not second and file.layout == "v1":
        _place_alerts(reading, file, table.targets, columns)
    scopes = table.scope_codes
    for code, scope in [(-1, None)] if scopes is None else _scopes_in_order(scopes, table.scope_names or []):
        name, v1_table = _group_of(file, scope)
        if second and name not in reading.sampled:
            continue
        index = reading.names.setdefault(name, {})
        mine = keep & (scopes == code) if scopes is not None else keep.copy()
        ids = target_ids(index, table.target_codes[mine], table.target_names)
        if not ids.size:
            continue
        if second:
            drawn = np.zeros(len(index), dtype=bool)
            drawn[reading.sampled[name]] = True
            mine[mine] = drawn[ids]
            ids = ids[drawn[ids]]
            if not ids.size:
                continue
        at = np.flatnonzero(mine)  # the mask counted once, not once per column
        block = Block(ops=table.ops, source=file.path, targets=ids, **{k: v[at] for k, v in columns.items()})
        if second:
            reading.blocks.setdefault((name, file.rank), []).append(_slim(block))
        else:
            reading.add(name, v1_table, file.rank, block)
    return table.torn


def _scopes_in_order(codes: np.ndarray, names: list[str]) -> list[tuple[int, str]]:
    """The (code, scope) pairs of a file's rows in the order the scopes first appear."""
    unique, first = np.unique(codes, return_index=True)
    return [(int(unique[i]), names[int(unique[i])]) for i in np.argsort(first).tolist()]


def _slim(block: Block) -> Block:
    """``block`` as kept for the matrices once digested: targets (int32), steps and values
    (float32, as drawn: :func:`~trainprobe.tools.reporting.cells.compact`) only (the micro-step, stage, line and position columns
    served the onsets and are dropped)."""
    none = np.zeros(0, dtype=np.int64)
    targets = block.targets.astype(np.int32)
    return replace(block, targets=targets, micro=none, vpp=none, line=none, pos=none, values=compact(block.values))
