"""What an online rule found: :class:`AnomalyEvent`, :class:`AnomalyStop` and the event file.

An event is one anomaly of one step on one rank: the first anomalous row of its kind
(``nonfinite`` or ``spike``) in execution order, with how many rows of that kind the step had.
So a step with 300 NaN rows is one event, not 300 (at most one event per kind per step).

Every event is appended to ``<output_dir>/rank_<r>/anomaly_events.jsonl`` (JSON Lines, whole
lines only after a kill; :mod:`trainprobe.engine.jsonl`)::

    {"step": 7, "rank": 0, "table": "weight_grad", "scope": "unreduced", "name": "fc.weight",
     "micro_step": null, "vpp_stage": 0, "op": "norm", "value": "nan", "kind": "nonfinite",
     "reference": null, "rows": 4, "line": "step 7, rank 0, weight_grad/unreduced fc.weight: norm = nan (NaN/inf)",
     "actions": ["log", "stop"]}

``line`` is worded exactly as ``trainprobe diagnose`` words the same row (one definition,
:meth:`trainprobe.engine.anomaly.finding.Anomaly.describe`). Non-finite values are written as the
strings ``"nan"``, ``"inf"``, ``"-inf"``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainprobe.engine.anomaly.finding import Anomaly
from trainprobe.engine.jsonl import append_line, is_step, keep_before, read_lines
from trainprobe.engine.log import warn_once

EVENT_FILE = "anomaly_events.jsonl"


@dataclass(frozen=True, slots=True)
class AnomalyEvent:
    """One anomaly (see the module docstring).

    Attributes:
        step: the step it happened in.
        rank: the rank that saw it.
        table: the monitor table (``module``, ``weight_grad``, ``optimizer``, ``param``).
        scope: the row's scope (``unreduced``, ``reduced``, ``exp_avg``, a module's
            ``input.0``/``output``...).
        name: the module or parameter name.
        op: the statistic (``norm``, ``max``, ``nans``...).
        value: its value.
        kind: ``"nonfinite"`` or ``"spike"``.
        reference: for a spike, what the value was compared with (the rule's running median,
            early max, mean or EMA), else None.
        rows: how many rows of this kind the step had on this rank (this one included).
        micro_step, vpp_stage: as in the row.
        position: the row's place among its monitor's rows of the step (execution order).
        rule: the spike rule's name (None for a non-finite row).
    """

    step: int
    rank: int
    table: str
    scope: str
    name: str
    op: str
    value: float
    kind: str
    reference: float | None = None
    rows: int = 1
    micro_step: int | None = None
    vpp_stage: int = 0
    position: int = 0
    rule: str | None = None

    def as_anomaly(self) -> Anomaly:
        """The same row as ``trainprobe diagnose`` finds it (its wording, its order)."""
        return Anomaly(
            kind=self.kind,
            step=self.step,
            rank=self.rank,
            table=self.table,
            scope=self.scope,
            name=self.name,
            micro_step=self.micro_step,
            vpp_stage=self.vpp_stage,
            op=self.op,
            value=self.value,
            median=self.reference,
            position=self.position,
            source="online",
            spike_rule=self.rule if self.kind == "spike" else None,
        )

    def line(self) -> str:
        """The row as ``trainprobe diagnose`` describes it."""
        return self.as_anomaly().describe()

    def order_key(self) -> tuple[int, ...]:
        """Its execution-order key (the one diagnose sorts by)."""
        return self.as_anomaly().order_key()

    def to_json(self) -> dict[str, Any]:
        """The event file's object (non-finite numbers as strings)."""
        return {
            "step": self.step,
            "rank": self.rank,
            "table": self.table,
            "scope": self.scope,
            "name": self.name,
            "micro_step": self.micro_step,
            "vpp_stage": self.vpp_stage,
            "op": self.op,
            "value": _number(self.value),
            "kind": self.kind,
            "reference": None if self.reference is None else _number(self.reference),
            "rows": self.rows,
            "rule": self.rule,
            "line": self.line(),
        }


class AnomalyStop(RuntimeError):
    """Raised at the step boundary by a monitor whose ``anomaly.actions`` has ``stop``.

    With ``before_update`` it is raised from ``optimizer.step()`` before any parameter moved:
    the model and the optimizer are as after the last healthy step, ready to checkpoint. The
    monitor has written every row of the step and closed its files before raising.

    Attributes:
        events: the events that stopped the run (this rank's, or an empty tuple on a rank that
            stops because another rank saw an anomaly).
        step: the step the run stopped at.
        ranks: the ranks that saw an anomaly at that step (all ranks' answer).
    """

    def __init__(self, step: int, events: tuple[AnomalyEvent, ...], ranks: tuple[int, ...]) -> None:
        self.step = step
        self.events = events
        self.ranks = ranks
        first = events[0].line() if events else f"an anomaly on rank(s) {', '.join(map(str, ranks))}"
        super().__init__(f"trainprobe stopped the run at step {step}: {first}")


class EventLog:
    """The event file of one rank folder; a failed write is logged once and turns it off."""

    def __init__(self, folder: Path, first_step: int) -> None:
        self.path = folder / EVENT_FILE
        self.enabled = True
        try:
            keep_before(self.path, first_step)
        except OSError as exc:
            self._fail(exc)

    def record(self, event: AnomalyEvent, actions: tuple[str, ...]) -> None:
        """Append ``event`` (with the actions taken)."""
        if not self.enabled:
            return
        try:
            append_line(self.path, {**event.to_json(), "actions": list(actions)})
        except OSError as exc:
            self._fail(exc)

    def _fail(self, exc: OSError) -> None:
        self.enabled = False
        warn_once(f"event-log:{self.path}", f"trainprobe: {self.path}: anomaly events cannot be written ({exc})")


def read_events(folder: Path) -> list[dict[str, Any]]:
    """The events of one rank folder's event file, in order (torn or foreign lines left out)."""
    return [e for e in read_lines(folder / EVENT_FILE) if is_step(e.get("step"))]


def _number(value: float) -> float | str:
    return value if math.isfinite(value) else ("nan" if math.isnan(value) else ("inf" if value > 0 else "-inf"))
