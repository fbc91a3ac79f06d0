"""``recent_max``: a ratio to the series' recent largest value, with a bar that is high while
the series is young. The default rule (docs/diagnose.md, "Spike rules").

A value ``v`` is a spike when

    v > F ** (1 + k / n) * max(the series' last W finite non-zero values)

with ``n`` the count of finite non-zero values the series has shown before ``v``; defaults
F = 4, k = 2, W = 10. For a series of squares the bar is squared (``F ** 2`` in place of F).

* **Judged from its second value on.** There is no blind warm-up: the bar starts high (n = 1:
  ``4 ** 3 = 64``) and falls towards F as the evidence grows (n = 9: 5.4; n = 50: 4.2), so a
  jump of a hundred times the earlier values is named at its step even at step 9, while the
  swings of the first steps stay under it.
* **The recent max, not the median**: a series that trends (Adam's state growing from 0, the
  gradients of a zero-initialised projection growing as it learns, a drifting input) is
  compared with its own latest values, so only a sudden jump over the trend counts; a noisy
  series' ordinary highs are in the reference. A spike enters the reference like any value
  (the next W steps are judged against it).
* **Zeros are not a history**: a series that is 0 (a zero-initialised projection's gradient at
  step 0, the state of a parameter not reached yet) has not started; zeros are neither judged
  nor counted until it leaves 0, and its first non-zero value starts it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from trainprobe.engine.rules.base import (
    FloatArray,
    Hits,
    IntArray,
    VectorisedRule,
    Verdict,
    as_arrays,
    place_in_series,
    series_ids,
)


@dataclass(slots=True)
class RecentState:
    """The last W finite non-zero values, how many were seen, and the base bar (F or F**2)."""

    recent: deque[float]
    base: float
    seen: int = 0


@dataclass(frozen=True, slots=True)
class RecentMax(VectorisedRule[RecentState]):
    """The ratio to the recent max with a warm-up bar (module docstring). ``reference`` "median"
    judges against the recent values' median instead (the benchmark's comparison; it cries wolf
    on trends)."""

    factor: float = 4.0
    window: int = 10
    grow: float = 2.0
    reference: str = "max"
    name: ClassVar[str] = "recent_max"

    def __post_init__(self) -> None:
        if not self.factor > 1:
            raise ValueError(f"factor {self.factor!r}: need a number above 1")
        if self.window < 1 or self.grow < 0:
            raise ValueError(f"window {self.window} and grow {self.grow}: need window >= 1, grow >= 0")
        if self.reference not in ("max", "median"):
            raise ValueError(f"reference {self.reference!r}: 'max' or 'median'")

    def start(self, squared: bool = False) -> RecentState:
        """Nothing seen yet."""
        return RecentState(deque(maxlen=self.window), float(self.factor) ** 2 if squared else float(self.factor))

    def bar(self, state: RecentState) -> float:
        """The bar after ``state.seen`` values: ``base ** (1 + grow / seen)``."""
        return float(state.base ** (1 + self.grow / state.seen))

    def ref(self, state: RecentState) -> float:
        """The reference: the max (or median) of the recent values."""
        if self.reference == "max":
            return max(state.recent)
        known = sorted(state.recent)
        return (known[(len(known) - 1) // 2] + known[len(known) // 2]) / 2

    def update(self, state: RecentState, step: int, value: float) -> Verdict | None:
        """Judge ``value`` against the recent values (nothing before the first non-zero value);
        then it joins them, a spike too."""
        if not math.isfinite(value) or value <= 0:
            return None
        verdict = None
        if state.seen:
            ref, bar = self.ref(state), self.bar(state)
            if value > bar * ref:
                verdict = Verdict(step, value, ref, value / ref, bar, step)
        state.recent.append(value)
        state.seen += 1
        return verdict

    def replay_many(
        self, starts: Sequence[int] | IntArray, steps: Sequence[int] | IntArray,
        values: Sequence[float] | FloatArray, squared: bool = False,
    ) -> Hits:
        """Vectorised over every series at once: the finite non-zero values of each series in
        order, each judged against the max (or median) of the up to W before it in its series,
        with the bar of its place in the series; the same arithmetic as :meth:`update`."""
        s, v = as_arrays(steps, values)
        ids = series_ids(starts, len(v))
        with np.errstate(invalid="ignore"):
            kept = np.flatnonzero(np.isfinite(v) & (v > 0))
        c, seen = v[kept], place_in_series(ids[kept])
        ref = self._references(c, seen)
        base = float(self.factor) ** 2 if squared else float(self.factor)
        # the bar of each place, by Python's float power as :meth:`bar` (NumPy's may differ by an ulp)
        bars = np.array([math.nan] + [base ** (1 + self.grow / n) for n in range(1, int(seen.max(initial=0)) + 1)])
        bar = bars[seen]
        with np.errstate(invalid="ignore"):
            hit = np.flatnonzero((seen >= 1) & (c > bar * ref))
        at = kept[hit]
        return Hits(at, at, ref[hit], c[hit] / ref[hit], bar[hit])

    def _references(self, c: FloatArray, seen: IntArray) -> FloatArray:
        """For each kept value, the max (or median) of the up to W kept values before it in its
        series (NaN for a series' first)."""
        lags = np.full((len(c), self.window), np.nan) if self.reference == "median" else None
        ref = np.full(len(c), -np.inf)
        for k in range(1, min(self.window, len(c)) + 1):
            earlier = np.full(len(c), np.nan)
            earlier[k:] = c[:-k]
            earlier[seen < k] = np.nan
            if lags is not None:
                lags[:, k - 1] = earlier
            else:
                ref = np.fmax(ref, earlier)
        if lags is None:
            ref[seen == 0] = np.nan
            return ref
        lags.sort(axis=1)
        count = np.minimum(seen, self.window)
        safe = np.maximum(count, 1)
        rows = np.arange(len(c))
        out: FloatArray = (lags[rows, (safe - 1) // 2] + lags[rows, safe // 2]) / 2
        out[count == 0] = np.nan
        return out

    def describe(self) -> str:
        """The rule with its parameters."""
        return (
            f"recent_max: v > {self.factor:g}^(1 + {self.grow:g}/n) x {self.reference} of the last "
            f"{self.window} non-zero values (n seen before)"
        )
