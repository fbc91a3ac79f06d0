"""Three published spike rules, as their projects define them, applied to one series each.

* ``early_max`` (Megatron-LM's rerun state machine, ``is_unexpectedly_large``): a value above
  ``factor`` (10) times the largest of the series' first ``first`` (100) finite values; checked
  once those are in.
* ``mean_patience`` (llm-foundry's ``KillLossSpike``): a value above ``factor`` (2) times the
  mean of the previous ``window`` (100) finite values is an outlier, once the window is full; more
  than ``patience`` (4) outliers in a row are a spike, named at the first of them.
* ``ema_z`` (ZClip's z-score): after ``warmup`` (25) values set an EMA's mean and variance, a
  value whose z-score against them is above ``z`` (2.5) is a spike; the EMA (``alpha`` 0.97)
  then takes the clipped value ``mean + z * std``, not the spike.

Each judges a series of squares (``squared``) in its own way: the two ratio rules square their
factor, the z-score rule judges the square roots (z-scores are not scale-free).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from trainprobe.engine.rules.base import (
    FloatArray,
    Hits,
    IntArray,
    Rule,
    VectorisedRule,
    Verdict,
    as_arrays,
    place_in_series,
    series_ids,
)


@dataclass(slots=True)
class EarlyMaxState:
    """The first values seen (their count and max) and the bar."""

    bar: float
    seen: int = 0
    largest: float = 0.0


@dataclass(frozen=True, slots=True)
class EarlyMax(VectorisedRule[EarlyMaxState]):
    """``v > factor * max(first `first` finite values)``, checked after ``warmup`` values
    (default: all ``first`` of them, Megatron's; a spike found earlier does not join the max)."""

    factor: float = 10.0
    first: int = 100
    warmup: int | None = None
    name: ClassVar[str] = "early_max"

    def start(self, squared: bool = False) -> EarlyMaxState:
        """No value seen yet."""
        return EarlyMaxState(float(self.factor) ** 2 if squared else float(self.factor))

    def update(self, state: EarlyMaxState, step: int, value: float) -> Verdict | None:
        """Judge ``value`` against the max of the first values; it joins them while they are few."""
        if not math.isfinite(value):
            return None
        warmup = self.first if self.warmup is None else self.warmup
        if state.seen >= warmup and state.largest > 0 and value > state.bar * state.largest:
            return Verdict(step, value, state.largest, value / state.largest, state.bar, step)
        if state.seen < self.first:
            state.seen += 1
            state.largest = max(state.largest, value)
        return None

    def replay_many(
        self, starts: Sequence[int] | IntArray, steps: Sequence[int] | IntArray,
        values: Sequence[float] | FloatArray, squared: bool = False,
    ) -> Hits:
        """Vectorised with Megatron's warm-up (checked once all ``first`` values are in: then no
        spike joins the max, which is each series' max of its first values); a shorter warm-up
        judges step by step (a spike found early is kept out of the max)."""
        if self.warmup is not None and self.warmup != self.first:
            return Rule.replay_many(self, starts, steps, values, squared)
        s, v = as_arrays(steps, values)
        ids = series_ids(starts, len(v))
        kept = np.flatnonzero(np.isfinite(v))
        c, gid, seen = v[kept], ids[kept], place_in_series(ids[kept])
        early = seen < self.first
        largest = np.zeros(int(ids[-1]) + 1 if len(ids) else 0)
        if early.any():
            firsts = np.flatnonzero(early & (seen == 0))  # the first of each series' early values
            top = np.maximum.reduceat(c[early], np.searchsorted(np.flatnonzero(early), firsts))
            largest[gid[firsts]] = np.fmax(0.0, top)
        bar = float(self.factor) ** 2 if squared else float(self.factor)
        ref = largest[gid]
        hit = np.flatnonzero(~early & (ref > 0) & (c > bar * ref))
        at = kept[hit]
        return Hits(at, at, ref[hit], c[hit] / ref[hit], np.full(len(at), bar))

    def describe(self) -> str:
        """The rule with its parameters."""
        return f"early_max: v > {self.factor:g} x max of the first {self.first} values"


@dataclass(slots=True)
class PatienceState:
    """The last ``window`` values, the current run of outliers (length, first step, value, mean)."""

    bar: float
    values: deque[float]
    run: int = 0
    first: tuple[int, float, float] = (0, 0.0, 0.0)


@dataclass(frozen=True, slots=True)
class MeanPatience(Rule[PatienceState]):
    """Outliers above ``factor`` times the previous ``window`` values' mean, more than
    ``patience`` in a row (module docstring)."""

    factor: float = 2.0
    window: int = 100
    patience: int = 4
    name: ClassVar[str] = "mean_patience"

    def start(self, squared: bool = False) -> PatienceState:
        """An empty window, no outlier yet."""
        return PatienceState(float(self.factor) ** 2 if squared else float(self.factor), deque(maxlen=self.window))

    def update(self, state: PatienceState, step: int, value: float) -> Verdict | None:
        """Count ``value`` as an outlier or not; the verdict on the run's ``patience + 1``-th."""
        if not math.isfinite(value):
            return None
        verdict = None
        if len(state.values) == self.window:
            mean = math.fsum(state.values) / self.window
            if mean > 0 and value > state.bar * mean:
                state.run += 1
                if state.run == 1:
                    state.first = (step, value, mean)
                if state.run == self.patience + 1:
                    at, first_value, first_mean = state.first
                    verdict = Verdict(at, first_value, first_mean, first_value / first_mean, state.bar, step)
            else:
                state.run = 0
        state.values.append(value)
        return verdict

    def describe(self) -> str:
        """The rule with its parameters."""
        return (
            f"mean_patience: v > {self.factor:g} x mean of the previous {self.window} values, "
            f"more than {self.patience} steps in a row"
        )


@dataclass(slots=True)
class EmaState:
    """The warm-up values, then the EMA's mean and variance."""

    squared: bool
    early: list[float] = field(default_factory=list)
    mean: float = math.nan
    var: float = math.nan


@dataclass(frozen=True, slots=True)
class EmaZScore(Rule[EmaState]):
    """The z-score of a value against an EMA of mean and variance (module docstring)."""

    z: float = 2.5
    alpha: float = 0.97
    warmup: int = 25
    name: ClassVar[str] = "ema_z"

    def start(self, squared: bool = False) -> EmaState:
        """No value yet."""
        return EmaState(squared)

    def update(self, state: EmaState, step: int, value: float) -> Verdict | None:
        """Warm up, or judge ``value``'s z-score; then the EMA moves (by the clipped value)."""
        if not math.isfinite(value):
            return None
        x = math.sqrt(value) if state.squared else value
        if len(state.early) < self.warmup:
            state.early.append(x)
            if len(state.early) == self.warmup:
                state.mean = math.fsum(state.early) / self.warmup
                state.var = math.fsum((e - state.mean) ** 2 for e in state.early) / self.warmup
            return None
        std = math.sqrt(state.var)
        score = (x - state.mean) / std if std > 0 else (math.inf if x > state.mean else 0.0)
        reference = state.mean**2 if state.squared else state.mean  # in the value's units
        verdict = Verdict(step, value, reference, score, self.z, step) if score > self.z else None
        used = state.mean + self.z * std if verdict is not None else x
        state.mean = self.alpha * state.mean + (1 - self.alpha) * used
        state.var = self.alpha * state.var + (1 - self.alpha) * (used - state.mean) ** 2
        return verdict

    def describe(self) -> str:
        """The rule with its parameters."""
        return f"ema_z: z > {self.z:g} against an EMA (alpha {self.alpha:g}) of mean and variance, after {self.warmup} values"
