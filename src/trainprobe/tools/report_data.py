"""The numbers behind ``trainprobe report``: monitor CSVs read into matrices, NaN/inf onsets and
anomaly events in execution order. Its helpers: :mod:`~trainprobe.tools.report_read` (the files,
read through the query layer), :mod:`~trainprobe.tools.report_cells` (the numpy work on a file's
rows), :mod:`~trainprobe.tools.report_events` (naming events),
:mod:`~trainprobe.tools.report_downsample` (the step buckets of the heatmaps and lines).

* A *group* is one V1 table (``grad_reduced``, ``actv`` ...) or one V2 monitor and scope
  (``weight_grad/reduced``, ``module/forward`` ...). Its targets are kept in model order, the order
  in which they first appear in the CSVs (rank 0 first).
* Rows of several micro-steps (activations) fall into one cell per (target, step): the cell holds
  the value of largest magnitude, so a spike in one micro-batch is not averaged away.
* A row is *non-finite* when one of its values is NaN or inf, or its ``nans`` count is above 0.
  For each (group, rank, target) the first such row in execution order is an *onset* event.
* Execution order is the one every tool uses (:mod:`trainprobe.tools.execution_order`, through
  :func:`trainprobe.tools.anomaly_analyse.execution_key`): CSV rows are turned into the same kind
  of event, with the V1 table name (V2 groups mapped to the equivalent table) deciding the phase
  and the table's place, and the row's place among the rows of its step in its file as the
  position. An alert of ``anomaly.json`` gets the position of its CSV row (same rank, table,
  step, micro-step, stage and target) so that alerts and CSV rows compare on one numbering; an
  alert whose row is not in the CSVs keeps its ``call_id``.
* Bounded: at most :data:`MAX_TARGETS` targets per group are drawn (NaN/inf ones first, then the
  largest peaks) and :data:`MAX_ONSETS` onsets kept. Files are read one at a time and digested
  (counts, per-target peaks, global norm per step, first onsets); rows are kept only for groups
  of at most :data:`MAX_TARGETS` targets, a larger group's files are read again for the rows of
  its drawn targets. The global norm assumes a target's micro-steps of one step share a file (as
  both V1 writers and V2 write them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from trainprobe.engine.errors import ConfigError
from trainprobe.tools.anomaly_analyse import (
    ANOMALY_FILE,
    ANOMALY_FOLDER,
    AnomalyEvent,
    load_anomalies,
    order_events,
    phase_of,
)
from trainprobe.tools.execution_order import (
    PHASE_ORDER,
    V2_DEFAULT_TABLE,
    V2_TABLE_OF,
    row_positions,
    table_rank,
)
from trainprobe.tools.monitor_layout import V1_DATA_TYPES
from trainprobe.tools.report_cells import (
    compact,
    grown,
    largest_per_key,
    merge_cells,
    real_rows,
    target_ids,
    unique_inverse,
)
from trainprobe.tools.report_downsample import bucket_size as bucket_size
from trainprobe.tools.report_downsample import downsample as downsample
from trainprobe.tools.report_events import (
    COUNT_OPS,
    bare_target,
    describe_values,
    event_group,
    event_target,
)
from trainprobe.tools.report_read import FileRows, ReportFile, connection, find_report_files, read_files
from trainprobe.tools.report_run import (
    Offenders,
    TopShares,
    TrainingState,
    find_event_files,
    find_training_state,
    offenders_of,
    read_event_files,
    read_training_state,
)

if TYPE_CHECKING:
    import duckdb

#: Targets drawn per data type (heatmap rows). Beyond it the report keeps every target with a
#: NaN/inf (first onset first), then the largest peaks of the default op (norm), and says
#: "K of M targets" on the page; counts, onsets and the global norm still cover every target.
MAX_TARGETS = 200
#: NaN/inf onsets kept (the timeline draws at most this many); the page says how many there were.
MAX_ONSETS = 2000
#: The V1 tables of gradients: their groups feed the Run section and the top offenders, in this
#: order of preference (the reduced gradient is the one the optimizer applies).
GRADIENT_TABLES = ("grad_reduced", "grad_unreduced")


@dataclass
class RankMatrix:
    """One rank's values of a group.

    Attributes:
        values: ``(targets, steps, ops)`` float32 (the precision the page draws; finite values
            clipped to float32's range); NaN where the cell is missing or non-finite.
        nonfinite: same shape; True where a value was NaN or inf.
        rows: complete CSV rows read.
        nonfinite_rows: rows with a NaN/inf value or a ``nans`` count above 0.
        global_value: per step, sqrt(sum of every target's norm²) (``norm`` op), or the largest
            |value| of the first op without a norm; NaN where no target has a value.
        global_nonfinite: per step, True where any target was non-finite.
        global_label: ``global norm`` or ``max |<op>|``.
    """

    values: np.ndarray
    nonfinite: np.ndarray
    rows: int
    nonfinite_rows: int
    global_value: np.ndarray
    global_nonfinite: np.ndarray
    global_label: str


@dataclass
class Group:
    """One V1 table or V2 monitor/scope across every rank.

    Attributes:
        name: ``grad_reduced`` (V1) or ``weight_grad/reduced`` (V2).
        table: the V1 table name that decides the phase (the name itself for V1).
        phase: ``forward``, ``backward`` or ``optimizer``.
        ops: value columns, in file order (the union over files).
        targets: the targets drawn, in model order: all of them, or :data:`MAX_TARGETS` picked
            (see :func:`pick_targets`) when there are more.
        all_targets: how many targets the group has.
        steps: sorted steps present on any rank.
        ranks: rank → its matrix (rows: ``targets``).
        onset_targets: (rank, target) pairs with a NaN/inf row.
        first_onset_step: the step of the group's first NaN/inf row in execution order, or None.
        offenders: per rank, the top offenders of a gradient group (see
            :mod:`trainprobe.tools.report_run`); empty for other groups.
    """

    name: str
    table: str
    phase: str
    ops: tuple[str, ...]
    targets: list[str]
    steps: np.ndarray
    ranks: dict[int, RankMatrix]
    all_targets: int = 0
    onset_targets: int = 0
    first_onset_step: int | None = None
    offenders: dict[int, Offenders] = field(default_factory=dict)

    @property
    def sampled(self) -> bool:
        """True when only some of the targets are drawn."""
        return len(self.targets) < self.all_targets

    @property
    def nonfinite_rows(self) -> int:
        """Non-finite rows on every rank."""
        return sum(m.nonfinite_rows for m in self.ranks.values())

    @property
    def rows(self) -> int:
        """Rows read on every rank."""
        return sum(m.rows for m in self.ranks.values())


@dataclass
class ReportData:
    """Everything the report shows.

    Attributes:
        root: the monitor output folder.
        layouts: ``v1`` and/or ``v2``.
        files: CSV files read.
        torn: torn rows skipped (a warning named each file once).
        groups: in execution order (phase, then table).
        onsets: first non-finite row of each (group, rank, target), in execution order (the
            first :data:`MAX_ONSETS`; ``onset_count`` says how many there are).
        alerts: the events of ``anomaly_detected/rank*/anomaly.json``, in execution order.
        anomaly_files: the ``anomaly.json`` files read.
        training: what the ``training_state.jsonl`` files hold (empty without them).
    """

    root: Path
    layouts: tuple[str, ...]
    files: int
    torn: int
    groups: list[Group]
    onsets: list[AnomalyEvent]
    alerts: list[AnomalyEvent]
    anomaly_files: list[Path] = field(default_factory=list)
    onset_count: int = 0
    training: TrainingState = field(default_factory=TrainingState)

    @property
    def steps(self) -> np.ndarray:
        """Every step of any group."""
        return np.unique(np.concatenate([g.steps for g in self.groups]))

    @property
    def ranks(self) -> list[int]:
        """Every rank of any group, ascending."""
        return sorted({r for g in self.groups for r in g.ranks})

    @property
    def gradient_groups(self) -> list[Group]:
        """The groups of gradients (V2 ``weight_grad/*``, V1 ``grad_*``) with a global norm,
        reduced before unreduced."""
        found = [g for g in self.groups if g.table in GRADIENT_TABLES and g.offenders]
        return sorted(found, key=lambda g: GRADIENT_TABLES.index(g.table))

    @property
    def first_nonfinite(self) -> AnomalyEvent | None:
        """The first NaN/inf row in execution order, or None."""
        return self.onsets[0] if self.onsets else None

    @property
    def timeline(self) -> list[AnomalyEvent]:
        """Onsets and alerts together, in execution order."""
        return order_events([*self.alerts, *self.onsets])


@dataclass
class _Block:
    """The rows of one file that belong to one group, as arrays (once digested and kept for the
    matrices, ``micro``, ``vpp``, ``line`` and ``pos`` are empty: :func:`_slim`)."""

    ops: tuple[str, ...]
    source: Path
    targets: np.ndarray  # ids into the group's target list
    steps: np.ndarray
    micro: np.ndarray
    vpp: np.ndarray
    line: np.ndarray
    pos: np.ndarray  # place among the rows of its step in its file (execution_order.row_positions)
    values: np.ndarray


@dataclass
class _Rows:
    """Every row of one group on one rank (blocks joined; values in the group's op order)."""

    targets: np.ndarray  # ids into the group's target list
    steps: np.ndarray
    micro: np.ndarray
    vpp: np.ndarray
    line: np.ndarray
    pos: np.ndarray
    values: np.ndarray
    known: np.ndarray
    source: np.ndarray
    sources: list[Path]


# --------------------------------------------------------------------------- reading


def load_report_data(
    monitor_dir: str | Path,
    training_state: str | Path | None = None,
    tensorboard: str | Path | None = None,
    files: list[ReportFile] | None = None,
) -> ReportData:
    """Read every monitor CSV and anomaly file under ``monitor_dir``, and the training metrics'
    ``training_state.jsonl`` files: those of ``training_state`` (the file, a ``rank_<id>``
    folder or the metrics' ``dump_path``), else any in ``monitor_dir``, its ``rank_<id>``
    folders or one level below (see :func:`~trainprobe.tools.report_run.find_training_state`);
    and the metrics' TensorBoard scalars (loss, learning rate, gradient norm) of ``tensorboard``
    (their ``tensorboard_dir``), else of event files in ``monitor_dir``'s ``rank_<id>`` folders
    (see :func:`~trainprobe.tools.report_run.find_event_files`). ``files``: the data files of
    ``monitor_dir`` when the caller found them already (:func:`~trainprobe.tools.report_read.find_report_files`).

    Memory is bounded by what is drawn, not by the number of rows: each file's rows are digested
    as they are read (counts, each target's peak and NaN/inf, the global norm per step, the first
    onsets) and kept only while their data type has at most :data:`MAX_TARGETS` targets; a data
    type with more is read a second time for the rows of the targets it draws.

    Raises:
        ConfigError: missing path, no monitor output, a foreign CSV header, no complete row at
            all (every file empty or torn), a malformed ``anomaly.json`` (the message names the file),
            a ``training_state`` that is missing or holds no ``training_state.jsonl``, a
            ``tensorboard`` that is missing or holds no event file (or an unreadable one).
    """
    root = Path(monitor_dir).expanduser()
    files = find_report_files(root) if files is None else files
    con = connection()
    training = read_training_state(find_training_state(root, training_state))
    read_event_files(find_event_files(root, tensorboard), training, required=tensorboard is not None)
    anomaly_files, alerts = _alerts(root, files)
    reading = _Reading(alert_rows=_alert_rows(alerts))
    torn = sum(_collect_file(file, rows, reading) for file, rows in read_files(con, files))
    if not reading.tables:
        raise ConfigError(
            f"monitor_path: the {len(files)} monitor file(s) under {str(root)!r} hold no complete row "
            "(all torn or header only); let the run write at least one step"
        )
    reading.reread_sampled(con, files)
    con.close()
    built = [_build_group(name, reading) for name in _group_order(reading.tables)]
    groups = [group for group, _ in built]
    onsets = order_events(event for _, events in built for event in events)[:MAX_ONSETS]
    alerts = order_events(
        replace(event, position=reading.alert_positions[n]) if n in reading.alert_positions else event
        for n, event in enumerate(alerts)
    )
    layouts = tuple(sorted({f.layout for f in files}))
    count = sum(g.onset_targets for g in groups)
    return ReportData(root, layouts, len(files), torn, groups, onsets, alerts, anomaly_files, count, training)


@dataclass
class _Digest:
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


@dataclass
class _Reading:
    """Reading state: per group its V1 table, target ids (model order), each target's peak and
    NaN/inf flag; per (group, rank) the digest and the rows kept; the targets of sampled groups."""

    tables: dict[str, str] = field(default_factory=dict)
    names: dict[str, dict[str, int]] = field(default_factory=dict)
    peaks: dict[str, np.ndarray] = field(default_factory=dict)
    bad: dict[str, np.ndarray] = field(default_factory=dict)
    digests: dict[tuple[str, int], _Digest] = field(default_factory=dict)
    blocks: dict[tuple[str, int], list[_Block]] = field(default_factory=dict)
    sampled: dict[str, np.ndarray] = field(default_factory=dict)  # group → drawn ids (empty until picked)
    #: (rank, table, step, micro-step, vpp_stage, target) → indices of the alerts of that row, by call_id
    alert_rows: dict[tuple[int, str, int, int, int, str], list[int]] = field(default_factory=dict)
    alert_positions: dict[int, int] = field(default_factory=dict)  # alert index → its CSV row's position

    def add(self, name: str, table: str, rank: int, block: _Block) -> None:
        """Digest ``block`` and keep its rows while its group has at most :data:`MAX_TARGETS` targets."""
        self.tables.setdefault(name, table)
        digest = self.digests.get((name, rank))
        if digest is None:
            digest = self.digests[name, rank] = _Digest(shares=TopShares() if table in GRADIENT_TABLES else None)
        _digest(self, name, rank, block, digest)
        if len(self.names[name]) <= MAX_TARGETS:
            self.blocks.setdefault((name, rank), []).append(_slim(block))
        elif name not in self.sampled:
            self.sampled[name] = np.zeros(0, dtype=np.int64)
            self.blocks = {key: kept for key, kept in self.blocks.items() if key[0] != name}

    def reread_sampled(self, con: duckdb.DuckDBPyConnection, files: Sequence[ReportFile]) -> None:
        """Pick the targets each sampled group draws and read its files again for their rows."""
        for name in self.sampled:
            self.sampled[name] = pick_targets(self.peaks[name], self.bad[name], MAX_TARGETS)
        wanted = {name.split("/")[0] for name in self.sampled}
        for file, rows in read_files(con, [f for f in files if f.data_type in wanted]):
            _collect_file(file, rows, self, second=True)


def _alert_rows(alerts: Sequence[AnomalyEvent]) -> dict[tuple[int, str, int, int, int, str], list[int]]:
    """The alerts by the CSV row they name (rank, table, step, micro-step, stage, bare target),
    each row's alerts in ``call_id`` order (a module called twice: its first call first)."""
    found: dict[tuple[int, str, int, int, int, str], list[int]] = {}
    for n in sorted(range(len(alerts)), key=lambda i: alerts[i].data["call_id"]):
        data, table = alerts[n].data, event_group(alerts[n])
        micro = 0 if alerts[n].once_per_step else data["micro_step"]  # once per step: no micro-step in the CSV
        key = (data["rank"], table, data["step"], micro, data["vpp_stage"])
        found.setdefault((*key, event_target(alerts[n])), []).append(n)
    return found


def _place_alerts(reading: _Reading, file: ReportFile, targets: list[str], columns: dict[str, np.ndarray]) -> None:
    """Give the alerts that name a row of ``file`` that row's position (see the module docstring):
    the k-th alert of a key takes the k-th row of that key."""
    wanted = {key[2] for key in reading.alert_rows if key[:2] == (file.rank, file.data_type)}
    if not wanted:
        return
    steps, micro, vpp, pos = (columns[k].tolist() for k in ("steps", "micro", "vpp", "pos"))
    taken: dict[tuple[int, str, int, int, int, str], int] = {}
    for row in (i for i, step in enumerate(steps) if step in wanted):
        target = bare_target(targets[row])
        once = _phase(file.data_type, target)[1]
        key = (file.rank, file.data_type, steps[row], 0 if once else max(micro[row], 0), vpp[row], target)
        alerts = reading.alert_rows.get(key)
        if alerts is not None and taken.get(key, 0) < len(alerts):
            reading.alert_positions[alerts[taken.get(key, 0)]] = pos[row]
            taken[key] = taken.get(key, 0) + 1


def _group_of(file: ReportFile, scope: str | None) -> tuple[str, str]:
    """(group name, V1 table) of a row."""
    if file.layout == "v1" or scope is None:
        return file.data_type, file.data_type if file.data_type in V1_DATA_TYPES else "other"
    table = V2_TABLE_OF.get((file.data_type, scope), V2_DEFAULT_TABLE.get(file.data_type, "other"))
    return f"{file.data_type}/{scope}", table


def _collect_file(file: ReportFile, table: FileRows, reading: _Reading, second: bool = False) -> int:
    """Hand the complete rows of ``file`` (``table``) to ``reading`` as one block of numbers per
    group (targets as ids, in model order); returns the torn rows. The second pass keeps only
    the rows of the targets that sampled groups draw.

    Numbers come from the query layer (:func:`~trainprobe.tools.report_read.read_files`); the
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
        block = _Block(ops=table.ops, source=file.path, targets=ids, **{k: v[mine] for k, v in columns.items()})
        if second:
            reading.blocks.setdefault((name, file.rank), []).append(_slim(block))
        else:
            reading.add(name, v1_table, file.rank, block)
    return table.torn


def _scopes_in_order(codes: np.ndarray, names: list[str]) -> list[tuple[int, str]]:
    """The (code, scope) pairs of a file's rows in the order the scopes first appear."""
    unique, first = np.unique(codes, return_index=True)
    return [(int(unique[i]), names[int(unique[i])]) for i in np.argsort(first).tolist()]


def _slim(block: _Block) -> _Block:
    """``block`` as kept for the matrices once digested: targets (int32), steps and values
    (float32, as drawn: :func:`compact`) only (the micro-step, stage, line and position columns
    served the onsets and are dropped)."""
    none = np.zeros(0, dtype=np.int64)
    targets = block.targets.astype(np.int32)
    return replace(block, targets=targets, micro=none, vpp=none, line=none, pos=none, values=compact(block.values))




def _digest(reading: _Reading, name: str, rank: int, block: _Block, digest: _Digest) -> None:
    """Fold one block into its group's per-target peaks and NaN/inf flags and into ``digest``:
    counts, steps, the global norm per step (each target's cell: its largest finite norm among
    the micro-steps of the file) and the first onsets."""
    rows, ops = _join([block], block.ops), block.ops
    size = len(reading.names[name])
    peaks = reading.peaks[name] = grown(reading.peaks.get(name), size, -1.0)
    bad = reading.bad[name] = grown(reading.bad.get(name), size, False)
    op = default_op(ops)
    finite = np.isfinite(rows.values)
    column, ok = rows.values[:, op], finite[:, op]
    np.maximum.at(peaks, rows.targets, np.where(ok, np.abs(column), -1.0))
    bad_rows = _bad_rows(rows.values, rows.known, ops)
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
        stub = Group(name, reading.tables[name], _phase(reading.tables[name])[0], ops, [], steps, {})
        events, new = _onsets(stub, rank, rows, list(reading.names[name]), digest.onset_ids)
        digest.onset_ids.update(new)
        digest.onsets = order_events([*digest.onsets, *events])[:MAX_ONSETS]


def _fold_global(
    digest: _Digest, steps: np.ndarray, step_index: np.ndarray, targets: np.ndarray, column: np.ndarray, ok: np.ndarray
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


def _phase(table: str, target: str = "") -> tuple[str, bool]:
    """(phase, once per step) of a row of V1 ``table`` (the analyser's rule)."""
    return phase_of(f"{target}/rank0/{table}")


def _group_order(tables: dict[str, str]) -> list[str]:
    """Group names in execution order: per-micro-step groups, then once-per-step ones; phase,
    then the table's place (:data:`~trainprobe.tools.execution_order.TABLE_ORDER`)."""

    def key(name: str) -> tuple[bool, int, int, str]:
        phase, once = _phase(tables[name])
        return once, PHASE_ORDER[phase], table_rank(tables[name]), name

    return sorted(tables, key=key)


# --------------------------------------------------------------------------- matrices


def _join(parts: list[_Block], ops: tuple[str, ...]) -> _Rows:
    """One rank's blocks of a group as one set of arrays; values NaN (and not known) where a file
    lacks an op."""
    values = np.full((sum(len(b.steps) for b in parts), len(ops)), np.nan)
    known = np.zeros(values.shape, dtype=bool)
    start = 0
    for block in parts:
        end = start + len(block.steps)
        columns = [ops.index(op) for op in block.ops]
        values[start:end, columns] = block.values
        known[start:end, columns] = True
        start = end
    return _Rows(
        targets=np.concatenate([b.targets for b in parts]),
        steps=np.concatenate([b.steps for b in parts]),
        micro=np.concatenate([b.micro for b in parts]),
        vpp=np.concatenate([b.vpp for b in parts]),
        line=np.concatenate([b.line for b in parts]),
        pos=np.concatenate([b.pos for b in parts]),
        values=values,
        known=known,
        source=np.concatenate([np.full(len(b.steps), n) for n, b in enumerate(parts)]),
        sources=[b.source for b in parts],
    )


def _build_group(name: str, reading: _Reading) -> tuple[Group, list[AnomalyEvent]]:
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
    group = Group(name, table, _phase(table)[0], ops, [all_targets[i] for i in chosen], steps, {})
    group.all_targets = len(all_targets)
    onsets: list[AnomalyEvent] = []
    for rank, digest in digests:
        parts = reading.blocks.pop((name, rank), [])
        rows = _join(parts, ops) if parts else None
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
    rows: _Rows | None, ops: tuple[str, ...], position: np.ndarray, n_targets: int, steps: np.ndarray, digest: _Digest
) -> RankMatrix:
    """Cells of one rank (rows of the drawn targets: ``position`` ≥ 0): the value of largest
    magnitude where several micro-steps share a cell; counts and the global norm from ``digest``."""
    n_steps = len(steps)
    values = np.full((n_targets * n_steps, len(ops)), np.nan)
    flags = np.zeros(values.shape, dtype=bool)
    if rows is not None:
        step_index = np.searchsorted(steps, rows.steps)
        finite = np.isfinite(rows.values)
        drawn = position[rows.targets] >= 0
        keys = position[rows.targets[drawn]] * n_steps + step_index[drawn]
        bad_rows, bad_ops = np.nonzero((rows.known & ~finite)[drawn])
        flags[keys[bad_rows], bad_ops] = True
        values = merge_cells(keys, rows.values[drawn], finite[drawn], n_targets * n_steps)
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


def _bad_rows(values: np.ndarray, known: np.ndarray, ops: tuple[str, ...]) -> np.ndarray:
    """Per row: a NaN/inf value, or a count op (``nans``) above 0."""
    bad = (known & ~np.isfinite(values)).any(axis=1)
    for column, op in enumerate(ops):
        if op in COUNT_OPS:
            bad |= known[:, column] & (np.nan_to_num(values[:, column]) > 0)
    return bad


# --------------------------------------------------------------------------- events


def _onsets(
    group: Group, rank: int, rows: _Rows, names: list[str], seen: set[int]
) -> tuple[list[AnomalyEvent], list[int]]:
    """The first non-finite row of each target of ``group`` on ``rank`` not in ``seen``, as
    analyser events (the first :data:`MAX_ONSETS` such targets in execution order), and the ids
    of every such target.

    Within one group and rank the execution key is (step, micro-step, pipeline stage: ascending
    in the forward phase, descending after, position = row among its step's in its file), so the rows are sorted
    by it with numpy and only the kept ones become events."""
    bad = np.flatnonzero(_bad_rows(rows.values, rows.known, group.ops))
    if not bad.size:
        return [], []
    phase, once = _phase(group.table)
    stage = rows.vpp[bad] if phase == "forward" else -rows.vpp[bad]
    micro = np.zeros(bad.size, dtype=np.int64) if once else rows.micro[bad]
    order = bad[np.lexsort((rows.pos[bad], stage, micro, rows.steps[bad]))]
    ids, first = np.unique(rows.targets[order], return_index=True)  # each target's first row in that order
    new = ~np.isin(ids, np.fromiter(seen, dtype=np.int64, count=len(seen)))
    firsts = order[np.sort(first[new])][:MAX_ONSETS]
    return [_row_event(group, rank, rows, int(row), names) for row in firsts], ids[new].tolist()


def _row_event(group: Group, rank: int, rows: _Rows, row: int, names: list[str]) -> AnomalyEvent:
    """A CSV row as an analyser event: ``call_id`` is the row's place in its file, ``position``
    its place among the rows of its step there."""
    target = names[int(rows.targets[row])]
    phase, once = _phase(group.table, target)
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


def _alerts(root: Path, csvs: Sequence[ReportFile]) -> tuple[list[Path], list[AnomalyEvent]]:
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




