"""The online rules: each step's rows judged as they are written, as ``trainprobe diagnose``
judges the files.

:class:`OnlineRules` keeps one spike-rule state per series (one tensor's ``norm`` or largest
magnitude over the steps, :mod:`trainprobe.engine.rules.series`) and is given each monitor's
rows of a step in the order the monitor produced them. A row is

* non-finite by :func:`trainprobe.engine.nonfinite.first_nonfinite_op`, the query layer's rule;
* a spike by the configured rule of :mod:`trainprobe.engine.rules` (the one
  ``trainprobe diagnose --rule`` replays over the files), fed the same values in the same
  step order.

The backward rows of a step that GradScaler skipped are not anomalies (their inf is the
scaler's calibration), as in ``diagnose``; they do not enter the spike series either.

A step's events are at most one per kind (:class:`~trainprobe.engine.anomaly.events.AnomalyEvent`,
its first row in execution order and the count of such rows). Pure Python: no framework.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainprobe.engine.anomaly.config import AnomalyConfig
from trainprobe.engine.anomaly.events import AnomalyEvent
from trainprobe.engine.execution_order import BACKWARD, phase_of_table, table_of
from trainprobe.engine.nonfinite import first_nonfinite_op
from trainprobe.engine.records import RowKey
from trainprobe.engine.rules.series import is_squared

SeriesKey = tuple[str, str, str, int | None, int, str]
"""(table, name, scope, micro_step, vpp_stage, signal)."""


@dataclass
class _StepFindings:
    """The anomalous rows of one step on this rank, by kind (events not yet built)."""

    first: dict[str, AnomalyEvent] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, event: AnomalyEvent) -> None:
        self.counts[event.kind] = self.counts.get(event.kind, 0) + 1
        kept = self.first.get(event.kind)
        if kept is None or event.order_key() < kept.order_key():
            self.first[event.kind] = event


class OnlineRules:
    """Judges the rows of one rank (see the module docstring).

    Example::

        rules = OnlineRules(AnomalyConfig(), rank=0)
        rules.judge("weight_grad", 7, ("min", "max", "mean", "norm", "nans"), rows)
        events = rules.end_step(7)   # at most one per kind, in execution order
    """

    def __init__(self, config: AnomalyConfig, rank: int) -> None:
        self.config = config
        self.rank = rank
        self._rule = config.spike() if "spike" in config.rules else None
        self._states: dict[SeriesKey, Any] = {}
        self._steps: dict[int, _StepFindings] = {}

    def judge(
        self,
        table: str,
        step: int,
        ops: Sequence[str],
        rows: Iterable[tuple[RowKey, Sequence[float]]],
        *,
        skipped: bool = False,
        first_position: int = 0,
    ) -> None:
        """Judge one monitor's rows of ``step`` (in the order it produced them, the first being
        the monitor's ``first_position``-th row of the step); ``skipped``: a step GradScaler
        skipped (its backward rows are left out)."""
        findings = self._steps.setdefault(step, _StepFindings())
        index = {op: i for i, op in enumerate(ops)}
        for position, (key, values) in enumerate(rows, start=first_position):
            if skipped and _is_backward(table, key):
                continue
            if "nonfinite" in self.config.rules:
                bad = first_nonfinite_op(ops, values)
                if bad is not None:
                    findings.add(self._event(table, step, key, position, ops[bad], values[bad], "nonfinite"))
            if self._rule is not None:
                for event in self._spikes(table, step, key, position, index, values):
                    findings.add(event)

    def current(self, step: int) -> list[AnomalyEvent]:
        """The events of ``step`` so far (at most one per kind, in execution order), kept."""
        findings = self._steps.get(step)
        if findings is None:
            return []
        events = [_with_rows(event, findings.counts[kind]) for kind, event in findings.first.items()]
        return sorted(events, key=lambda e: e.order_key())

    def end_step(self, step: int) -> list[AnomalyEvent]:
        """The events of ``step`` and of any earlier step still open (rows that trail their step,
        such as collectives issued after ``optimizer.step()``), in step and execution order;
        forgotten here."""
        events = []
        for earlier in sorted(s for s in self._steps if s <= step):
            events += self.current(earlier)
            del self._steps[earlier]
        return events

    def _spikes(
        self, table: str, step: int, key: RowKey, position: int, index: dict[str, int], values: Sequence[float]
    ) -> Iterable[AnomalyEvent]:
        assert self._rule is not None
        for signal, op, value in _signals(index, values):
            series: SeriesKey = (table, key.name, key.scope, key.micro_step, key.vpp_stage, signal)
            state = self._states.get(series)
            if state is None:
                state = self._states[series] = self._rule.start(is_squared(key.scope))
            magnitude = abs(value) if math.isfinite(value) else math.nan
            verdict = self._rule.update(state, step, magnitude)
            if verdict is not None:
                yield self._event(table, step, key, position, op, value, "spike", reference=verdict.reference)

    def _event(
        self,
        table: str,
        step: int,
        key: RowKey,
        position: int,
        op: str,
        value: float,
        kind: str,
        reference: float | None = None,
    ) -> AnomalyEvent:
        return AnomalyEvent(
            step=step,
            rank=self.rank,
            table=table,
            scope=key.scope,
            name=key.name,
            op=op,
            value=float(value),
            kind=kind,
            reference=reference,
            micro_step=key.micro_step,
            vpp_stage=key.vpp_stage,
            position=position,
            rule=self.config.spike_rule if kind == "spike" else None,
        )


def _signals(index: dict[str, int], values: Sequence[float]) -> Iterable[tuple[str, str, float]]:
    """(signal, op reported, value) of a row, as :func:`trainprobe.engine.rules.series.signals`
    cuts them: ``norm``, and ``amax`` (the larger magnitude of ``min`` and ``max``)."""
    if "norm" in index:
        yield "norm", "norm", values[index["norm"]]
    low = values[index["min"]] if "min" in index else None
    high = values[index["max"]] if "max" in index else None
    if low is not None and high is not None:
        low_ok, high_ok = math.isfinite(low), math.isfinite(high)
        if low_ok and high_ok:
            yield ("amax", "min", low) if abs(low) > abs(high) else ("amax", "max", high)
        elif low_ok or high_ok:  # the other one is NaN/inf: the finite one's magnitude, as fmax does
            yield ("amax", "min", low) if low_ok else ("amax", "max", high)
        else:
            yield "amax", "max", math.nan
    elif low is not None:
        yield "amax", "min", low
    elif high is not None:
        yield "amax", "max", high


def _is_backward(table: str, key: RowKey) -> bool:
    return phase_of_table(table_of(table, key.scope), key.name)[0] == BACKWARD


def _with_rows(event: AnomalyEvent, rows: int) -> AnomalyEvent:
    from dataclasses import replace

    return replace(event, rows=rows)
