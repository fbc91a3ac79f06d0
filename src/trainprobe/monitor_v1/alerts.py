"""Alerts: rules over the statistics a step produced (they consume records; they write nothing
else).

Rules, checked in the configured order; the first that fires for a row is reported, naming every
op of that row it fired on:

* ``AnomalyTurbulence`` (``threshold`` t): a ``norm`` or ``mean`` value more than ``t`` times its
  running average away from it, above (``> (1+t)·avg``) or below (``< (1-t)·avg``, mirrored for a
  negative average). The running average is over the previous collected values of the same row
  (table, name, micro_step, op) that did not fire (an anomaly does not shift the baseline);
  the first value never fires.
* ``AnomalyNan`` (optional ``threshold`` t): a NaN value, a ``nans`` count above 0, or with ``t``
  any value with ``|value| > t``.

Only values that exist are judged: a parameter without a gradient produces no row, so it is never
an anomaly. Each anomaly prints one line (colour only when the stream is a terminal); with
``alert.dump`` every anomaly is kept in ``<MONITOR_OUTPUT_DIR>/anomaly_detected/rank<r>/
anomaly.json``, rewritten atomically after each step that found one.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from trainprobe.config.monitor_v1 import AlertRule
from trainprobe.records import RowKey, StepBatch
from trainprobe.sinks.files import write_json_atomically

TURBULENCE_OPS = ("norm", "mean")


@dataclass(frozen=True, slots=True)
class PipelineContext:
    """Where this rank sits: its pipeline stage and the ranks of its pipeline group."""

    rank: int
    pp_stage: int
    group_mates: tuple[int, ...]


class _Average:
    __slots__ = ("count", "total")

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0


def _turbulent(value: float, history: _Average | None, threshold: float) -> bool:
    if history is None or history.count == 0 or not math.isfinite(value):
        return False
    avg = history.total / history.count
    if avg == 0:
        return False
    deviation = abs(value - avg)
    return deviation > threshold * abs(avg)


def _nan_like(op: str, value: float, threshold: float | None) -> bool:
    if math.isnan(value):
        return True
    if op == "nans":
        return value > 0
    return threshold is not None and abs(value) > threshold


class AlertDetector:
    """Checks every row of every batch against ``rules`` (a sink-shaped record consumer).

    Args:
        rules: the configured rules, in priority order.
        ops: table → op names (value order).
        table_of: the table of a row.
        context: rank, pipeline stage and group mates for the dump.
        dump_dir: folder of ``anomaly.json`` (None: no dump).
        stream: where the console lines go (default ``sys.stdout``).
    """

    def __init__(
        self,
        rules: tuple[AlertRule, ...],
        ops: dict[str, tuple[str, ...]],
        table_of: Callable[[str, RowKey], str],
        context: PipelineContext,
        dump_dir: Path | None,
        stream: TextIO | None = None,
    ) -> None:
        self.rules = rules
        self.ops = ops
        self.table_of = table_of
        self.context = context
        self.dump_dir = dump_dir
        self.stream = stream
        self.anomalies: dict[str, dict[str, Any]] = {}
        self._history: dict[tuple[str, str, int | None, str], _Average] = {}
        self._call_id = 0

    def write(self, batch: StepBatch) -> None:
        found = False
        for key, values in batch.rows():
            self._call_id += 1
            table = self.table_of(batch.monitor, key)
            fired = self._check(table, key, values)
            if fired is not None:
                found = True
                self._report(batch.step, table, key, *fired)
        if found and self.dump_dir is not None:
            self._dump()

    def _check(self, table: str, key: RowKey, values: list[float]) -> tuple[str, list[str]] | None:
        ops = self.ops[table]
        result: tuple[str, list[str]] | None = None
        for rule in self.rules:
            if rule.rule_name == "AnomalyNan":
                hit = [op for op, v in zip(ops, values) if _nan_like(op, v, rule.threshold)]
            else:
                assert rule.threshold is not None
                hit = [
                    op
                    for op, v in zip(ops, values)
                    if op in TURBULENCE_OPS
                    and _turbulent(v, self._history.get((table, key.name, key.micro_step, op)), rule.threshold)
                ]
            if hit:
                result = (rule.rule_name, hit)
                break
        fired = set(result[1]) if result is not None else set()
        for op, v in zip(ops, values):
            if op in TURBULENCE_OPS and math.isfinite(v) and op not in fired:
                avg = self._history.setdefault((table, key.name, key.micro_step, op), _Average())
                avg.count += 1
                avg.total += v
        return result

    def _report(self, step: int, table: str, key: RowKey, rule: str, ops: list[str]) -> None:
        ctx = self.context
        micro = 0 if key.micro_step is None else key.micro_step
        tag = f"{key.name}/rank{ctx.rank}/{table}"
        signals = ", ".join(f"({tag!r}, {op!r})" for op in ops)
        message = f"Rule {rule} reports anomaly signal in {signals} at step {step}."
        self.anomalies[f"{tag}_step_{step}_call_{self._call_id}"] = {
            "rank": ctx.rank,
            "step": step,
            "micro_step": micro,
            "pp_stage": ctx.pp_stage,
            "vpp_stage": key.vpp_stage,
            "call_id": self._call_id,
            "tag_name": tag,
            "message": message,
            "group_mates": list(ctx.group_mates),
        }
        stream = self.stream or sys.stdout
        line = f"trainprobe alert: {message}"
        if getattr(stream, "isatty", lambda: False)():
            line = f"\033[1;33m{line}\033[0m"
        print(line, file=stream, flush=True)

    def _dump(self) -> None:
        assert self.dump_dir is not None
        write_json_atomically(self.dump_dir / "anomaly.json", self.anomalies, indent=4)

    def close(self, reached: int | None = None) -> None:
        """Nothing to release (the dump is rewritten after each step that found an anomaly)."""
