"""The public data types of ``trainprobe report`` (what :func:`~trainprobe.tools.reporting.data.load_report_data`
returns: :class:`ReportData`, its :class:`Group` s and their :class:`RankMatrix` s) and the bounds
of what it keeps (:data:`MAX_TARGETS`, :data:`MAX_ONSETS`). :mod:`~trainprobe.tools.reporting.data`
re-exports them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from trainprobe.tools.anomalies.analyser import AnomalyEvent, order_events
from trainprobe.tools.reporting.run import Offenders, TrainingState

#: Targets drawn per data type (heatmap rows). Beyond it the report keeps every target with a
#: NaN/inf (first onset first), then the largest peaks of the default op (norm), and says
#: "K of M targets" on the page; counts, onsets and the global norm still cover every target.
MAX_TARGETS = 200
#: NaN/inf onsets kept (the timeline draws at most this many); the page says how many there were.
MAX_ONSETS = 2000
#: The V1 tables of gradients: their groups feed the training curves and the top offenders, in this
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
            (see :func:`~trainprobe.tools.reporting.groups.pick_targets`) when there are more.
        all_targets: how many targets the group has.
        steps: sorted steps present on any rank.
        ranks: rank → its matrix (rows: ``targets``).
        onset_targets: (rank, target) pairs with a NaN/inf row.
        first_onset_step: the step of the group's first NaN/inf row in execution order, or None.
        offenders: per rank, the top offenders of a gradient group (see
            :mod:`trainprobe.tools.reporting.run`); empty for other groups.
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
        skipped: rank → the steps GradScaler skipped there (``amp_skips.jsonl``; empty without).
        sharded: whether the run's ``tensor_layout.json`` files mark shards or replicas.
        tensors: ``"full"`` (a sharded run's parameter tables read as full tensors, each under
            the least rank holding it) or ``"rank-local"`` (every rank's rows as written).
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
    skipped: dict[int, list[int]] = field(default_factory=dict)
    sharded: bool = False
    tensors: str = "rank-local"

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
