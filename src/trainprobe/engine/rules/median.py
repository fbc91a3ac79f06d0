"""``median``: the running-median ratio, ``trainprobe diagnose``'s rule since its first version.

A value ``v`` is a spike when

    v > F * median(the finite values among the series' previous W rows)

and at least ``warmup`` of those W rows were finite, and the median is above 0. ``F`` is the
factor (``F**2`` for a series of squares). The window is W *rows*: a NaN/inf row takes a place
in it without entering the median, as in the SQL window frame ``ROWS BETWEEN W PRECEDING AND 1
PRECEDING`` of :mod:`trainprobe.tools.sql.diagnose`; a spike enters its successors' windows. The
median of an even count is the mean of the two middle values, ``(lo + hi) / 2``, DuckDB's.
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

CHUNK = 1 << 18
"""Rows judged at once by :meth:`RunningMedian.replay_many` (a chunk's windows: CHUNK x W floats)."""


@dataclass(slots=True)
class MedianState:
    """One series' last ``window`` rows (NaN where not finite) and its bar."""

    rows: deque[float]
    bar: float


@dataclass(frozen=True, slots=True)
class RunningMedian(VectorisedRule[MedianState]):
    """The running-median ratio (module docstring). Defaults: today's ``diagnose``'s."""

    factor: float = 10.0
    window: int = 20
    warmup: int = 10
    name: ClassVar[str] = "median"

    def __post_init__(self) -> None:
        if not 1 <= self.warmup <= self.window:
            raise ValueError(f"need 1 <= warmup ({self.warmup}) <= window ({self.window})")
        if not self.factor > 1:
            raise ValueError(f"factor {self.factor!r}: need a number above 1")

    def start(self, squared: bool = False) -> MedianState:
        """An empty window; the bar is ``factor`` (``factor ** 2`` when ``squared``)."""
        return MedianState(deque(maxlen=self.window), float(self.factor) ** 2 if squared else float(self.factor))

    def update(self, state: MedianState, step: int, value: float) -> Verdict | None:
        """The verdict on ``value`` against the window before it; then it joins the window."""
        known = sorted(v for v in state.rows if not math.isnan(v))
        clean = value if math.isfinite(value) else math.nan
        state.rows.append(clean)
        if len(known) < self.warmup or math.isnan(clean):
            return None
        median = (known[(len(known) - 1) // 2] + known[len(known) // 2]) / 2
        if median > 0 and clean > state.bar * median:
            return Verdict(step, clean, median, clean / median, state.bar, step)
        return None

    def replay_many(
        self, starts: Sequence[int] | IntArray, steps: Sequence[int] | IntArray,
        values: Sequence[float] | FloatArray, squared: bool = False,
    ) -> Hits:
        """Vectorised over every series at once, :data:`CHUNK` rows at a time: each row's window
        (the W rows before it in its series, NaN where not finite or before the series) sorted
        (NaN sort last), the same arithmetic as :meth:`update`."""
        s, v = as_arrays(steps, values)
        v = np.where(np.isfinite(v), v, np.nan)
        place = place_in_series(series_ids(starts, len(v)))
        bar = float(self.factor) ** 2 if squared else float(self.factor)
        parts = [self._judge(v, place, bar, a, min(a + CHUNK, len(v))) for a in range(0, len(v), CHUNK)]
        if not parts:
            return Hits.of([])
        at = np.concatenate([p[0] for p in parts])
        median = np.concatenate([p[1] for p in parts])
        return Hits(at, at, median, v[at] / median, np.full(len(at), bar))

    def _judge(self, v: FloatArray, place: IntArray, bar: float, a: int, b: int) -> tuple[IntArray, FloatArray]:
        """The spikes among rows ``a`` to ``b``: their positions and window medians."""
        rows = np.arange(a, b)
        windows = np.full((b - a, self.window), np.nan)
        for k in range(1, self.window + 1):
            inside = place[a:b] >= k
            windows[inside, k - 1] = v[rows[inside] - k]
        windows.sort(axis=1)
        count = np.count_nonzero(~np.isnan(windows), axis=1)
        safe = np.maximum(count, 1)
        index = np.arange(b - a)
        median = (windows[index, (safe - 1) // 2] + windows[index, safe // 2]) / 2
        with np.errstate(invalid="ignore"):
            hit = np.flatnonzero((count >= self.warmup) & (median > 0) & (v[a:b] > bar * median))
        return rows[hit], median[hit]

    def describe(self) -> str:
        """The rule with its parameters."""
        return f"median: v > {self.factor:g} x median of the previous {self.window} rows, after {self.warmup} finite"
