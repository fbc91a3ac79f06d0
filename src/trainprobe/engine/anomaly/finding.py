"""One anomaly of a run, worded once: what ``trainprobe diagnose`` prints for a row and what the
online rules of Monitor V2 (:mod:`trainprobe.engine.anomaly`) report for the same row.

Standard library only (the execution order comes from :mod:`trainprobe.engine.execution_order`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from trainprobe.engine.execution_order import execution_key, phase_of_table, table_of
from trainprobe.engine.printable import printable


@dataclass(frozen=True, slots=True)
class Anomaly:
    """One anomaly.

    Attributes:
        kind: ``"nonfinite"`` (NaN/inf), ``"spike"`` or ``"alert"`` (a Monitor V1 alert whose row
            the files do not show as a NaN/inf or spike).
        step, rank, micro_step, vpp_stage: where.
        table: the view (``weight_grad``, ``actv`` ...; for an alert the last part of its tag).
        scope: the row's scope (V1: the table).
        name: the tensor (module or parameter).
        op: the statistic (``norm``, ``max`` ...); None when an alert does not say.
        value: its value (NaN/inf kept); None when unknown (an alert alone).
        median: for a spike, the reference it is compared with (the spike rule's: a running
            median, a recent max ...; the name is kept from the first rule).
        file: the data file of the row (None for an alert alone).
        position: the row's place among its step's rows in its file (an alert alone: its call_id).
        source: ``"files"``, ``"alert"`` or ``"files+alert"`` (found in both).
        rule: the alert's rule (``AnomalyNan`` ...), else None.
        ranks: for a full-tensor row of a sharded run (its shards merged), every rank holding a
            piece of the tensor; None for a rank's own row.
        held: how they hold it: ``"shards"``, ``"replicas, counted once"`` or ``"<n> shards,
            replicated"``; None for a rank's own row.
        bad_ranks: for a full-tensor NaN/inf, the ranks whose piece holds it; for a full-tensor
            spike, the ranks whose own piece spiked too (``rank`` is the least of them); None
            otherwise (or when no piece spiked alone).
        spike_rule: for a spike, the rule that found it (:mod:`trainprobe.engine.rules`); None
            is the running median's (``median``).
    """

    kind: str
    step: int
    rank: int
    table: str
    scope: str
    name: str
    micro_step: int | None = None
    vpp_stage: int | None = None
    op: str | None = None
    value: float | None = None
    median: float | None = None
    file: str | None = None
    position: int = 0
    source: str = "files"
    rule: str | None = None
    ranks: tuple[int, ...] | None = None
    held: str | None = None
    bad_ranks: tuple[int, ...] | None = None
    spike_rule: str | None = None

    def order_key(self) -> tuple[int, ...]:
        """Its :func:`~trainprobe.engine.execution_order.execution_key`."""
        return execution_key(
            self.step,
            table_of(self.table, None if self.source == "alert" else self.scope),
            target=self.name,
            micro_step=self.micro_step,
            position=self.position,
            rank=self.rank,
            vpp_stage=self.vpp_stage or 0,
        )

    def describe(self) -> str:
        """One line: step, rank, table, tensor, op and value (and for a spike its reference:
        ``60.6x its running median 0.0896 (spike)`` for the ``median`` rule, ``12.3x its recent
        max 0.0123 (spike, recent_max)`` for the others, :data:`REFERENCES`).

        A spike's ratio to its reference has a bounded width: ``60.6x`` below a million,
        ``1.23e+06x`` / ``1e+300x`` above, ``more than 1e308x`` where the ratio overflows a
        float; over a denormal median (below the smallest normal float, 2.2e-308) no ratio is
        printed, the line says the median is denormal."""
        where = self.table if self.scope in (self.table, "") else f"{self.table}/{self.scope}"
        once = phase_of_table(table_of(self.table, None if self.source == "alert" else self.scope), self.name)[1]
        micro = f" micro_step {self.micro_step}" if self.micro_step is not None and not once else ""
        if self.op is None:
            what = "(the alert names no op)"
        elif self.value is None:
            what = f"{self.op} (the alert gives no value)"
        else:
            what = f"{self.op} = {number_text(self.value)}"
        who = "full tensor" if self.ranks is not None else f"rank {self.rank}"
        text = f"step {self.step}{micro}, {who}, {printable(where)} {printable(self.name)}: {printable(what)}"
        if self.kind == "spike" and self.median:
            median = self.median
            named = REFERENCES.get(self.spike_rule or "median", "reference")
            tag = "(spike)" if self.spike_rule in (None, "median") else f"(spike, {printable(self.spike_rule or '')})"
            if abs(median) < 2.0**-1022:  # sys.float_info.min: below it a float is denormal
                text += f", over a denormal {named} {number_text(median)} (no ratio) {tag}"
            else:
                ratio = abs(self.value or 0) / median
                if not math.isfinite(ratio):
                    shown = "more than 1e308x"
                elif abs(ratio) < 1e6:
                    shown = f"{ratio:.1f}x"
                else:
                    shown = f"{ratio:.3g}x"
                text += f", {shown} its {named} {number_text(median)} {tag}"
        elif self.kind == "nonfinite":
            text += " (NaN/inf)"
        if self.rule:
            text += f" [alert {self.rule}]"
        return text + self._holders()

    def _holders(self) -> str:
        """``, held by ranks 0,1 (shards), NaN/inf in rank 1's shard`` for a full-tensor row."""
        if self.ranks is None:
            return ""
        text = f", held by ranks {','.join(str(r) for r in self.ranks[:16])}{'...' if len(self.ranks) > 16 else ''} ({self.held})"
        if self.bad_ranks:
            piece = "shard" if self.held == "shards" else "replica" if (self.held or "").startswith("replica") else "piece"
            what, bad = ("NaN/inf" if self.kind == "nonfinite" else "spike"), list(self.bad_ranks)
            text += f", {what} in rank {bad[0]}'s {piece}" if len(bad) == 1 else f", {what} in the {piece}s of ranks {ranks_text(bad)}"
        return text


REFERENCES: dict[str, str] = {
    "median": "running median",
    "recent_max": "recent max",
    "early_max": "early max",
    "mean_patience": "recent mean",
    "ema_z": "EMA mean",
}
"""What each spike rule of :data:`trainprobe.engine.rules.RULES` compares a value with, as the
answers word it (every rule has one; tests/test_rules.py checks)."""


def number_text(value: float | None) -> str:
    """A value as the answers print it: 6 significant digits, ``nan``/``inf`` as Python writes
    them, ``?`` when unknown."""
    if value is None:
        return "?"
    if math.isnan(value) or math.isinf(value):
        return repr(value)
    return f"{value:.6g}"


def ranks_text(ranks: list[int]) -> str:
    """``0, 1, 2`` (the first 16, then how many more)."""
    return ", ".join(str(r) for r in ranks[:16]) + (f" and {len(ranks) - 16} more" if len(ranks) > 16 else "")


def step_spans(steps: Sequence[int]) -> str:
    """``0-4, 7, 9-10``: sorted steps as runs (at most 8 runs shown)."""
    runs: list[list[int]] = []
    for step in steps:
        if runs and step == runs[-1][1] + 1:
            runs[-1][1] = step
        else:
            runs.append([step, step])
    shown = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs[:8])
    return shown + (f" and {len(runs) - 8} more runs" if len(runs) > 8 else "")


def skipped_text(skipped: Mapping[int, Sequence[int]], ranks: Sequence[int]) -> str | None:
    """``skipped by GradScaler: steps 0-6 on all 2 ranks (...)``: the steps GradScaler skipped
    (rank → steps) among ``ranks``; None where it skipped none."""
    if not skipped:
        return None
    sets = {tuple(steps) for steps in skipped.values()}
    if len(sets) == 1 and len(skipped) == len(ranks):
        where = f"steps {step_spans(next(iter(sets)))}" + (f" on all {len(ranks)} ranks" if len(ranks) > 1 else "")
    else:
        where = "; ".join(f"rank {r}: steps {step_spans(s)}" for r, s in sorted(skipped.items()))
    return f"skipped by GradScaler: {where} (the inf/NaN of their scaled gradients is not an anomaly)"
