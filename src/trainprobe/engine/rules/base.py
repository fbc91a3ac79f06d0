"""What a spike rule is: one definition, fed one value at a time, replayed over a whole series.

A rule judges one *series*: one tensor's statistic over the steps (a magnitude, ``>= 0``), in
step order. The same object serves both sides of a run:

* online, during training: ``state = rule.start(squared)`` once per series, then
  ``verdict = rule.update(state, step, value)`` for each recorded step;
* offline, over the files: ``rule.replay(steps, values, squared)`` gives the verdicts of the
  whole series, the same list the step-by-step loop gives (a rule may compute it vectorised;
  ``tests/test_rules.py`` checks both agree on every rule); ``rule.replay_many(starts, steps,
  values, squared)`` judges many series laid end to end at once (``trainprobe diagnose``: every
  series of a table in one call), as :class:`Hits`, the same verdicts.

A value that is NaN or ±inf (or missing, given as NaN) is the non-finite check's business: it
is never a spike and never enters a rule's history; a rule says whether it still takes a place
in a window of rows (:class:`~trainprobe.engine.rules.median.RunningMedian` does, as the SQL
frame of ``trainprobe diagnose`` always did). ``squared`` marks a series of squares (Adam's
``exp_avg_sq``): each rule's bar is then the square of its bar in the series' own units, the
same spike in gradient units.

Pure Python and NumPy: no framework, no DuckDB.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class Verdict:
    """A rule's finding on one series.

    Attributes:
        step: the step named as anomalous (for a rule with patience, the first step of the run
            of outliers that tripped it).
        value: the series' value at ``step``.
        reference: what the value was compared with (a median, a max, a mean, an EMA mean).
        score: how far above it is, in the rule's terms: ``value / reference`` for the ratio
            rules, the z-score for :class:`~trainprobe.engine.rules.published.EmaZScore`.
        bar: the score above which a value is a spike, at that step.
        decided: the step whose value decided it (``step`` but for rules with patience).
    """

    step: int
    value: float
    reference: float
    score: float
    bar: float
    decided: int


S = TypeVar("S")


class Rule(ABC, Generic[S]):
    """One spike rule (see the module docstring): ``start``, ``update``, ``replay``.

    Subclasses are frozen dataclasses of their parameters; their state is a small mutable object
    of their own (``S``), one per series.
    """

    name: ClassVar[str]
    """The rule's name (``trainprobe diagnose --rule NAME``)."""

    @abstractmethod
    def start(self, squared: bool = False) -> S:
        """A fresh state for one series (``squared``: a series of squares, see the module docstring)."""

    @abstractmethod
    def update(self, state: S, step: int, value: float) -> Verdict | None:
        """Feed the series' value at ``step`` (after the earlier steps, in order); the verdict
        when it is (or completes) a spike, else None. ``value`` NaN/inf: never a spike."""

    def replay(self, steps: Sequence[int] | IntArray, values: Sequence[float] | FloatArray, squared: bool = False) -> list[Verdict]:
        """Every verdict of a whole series (``steps`` ascending, ``values`` the magnitudes): the
        same as feeding them one by one to :meth:`update` from :meth:`start`."""
        state = self.start(squared)
        found = []
        for step, value in zip(steps, values, strict=True):
            verdict = self.update(state, int(step), float(value))
            if verdict is not None:
                found.append(verdict)
        return found

    def replay_many(
        self, starts: Sequence[int] | IntArray, steps: Sequence[int] | IntArray,
        values: Sequence[float] | FloatArray, squared: bool = False,
    ) -> Hits:
        """The verdicts of many series laid end to end: series ``i`` is ``steps`` and ``values``
        from ``starts[i]`` to ``starts[i + 1]`` (the last to the end; ``starts`` ascending, the
        first 0), each judged from a fresh state: the same verdicts as :meth:`replay` of each,
        as positions into the arrays (:class:`Hits`). This default replays each series in turn;
        the rules that can judge all series at once override it (and :meth:`replay` is then
        this of one series)."""
        s, v = as_arrays(steps, values)
        bounds = series_bounds(starts, len(v))
        found: list[tuple[int, int, Verdict]] = []
        for a, b in bounds:
            for verdict in Rule.replay(self, s[a:b], v[a:b], squared):
                at = a + int(np.searchsorted(s[a:b], verdict.step, side="left"))
                decided = a + int(np.searchsorted(s[a:b], verdict.decided, side="left"))
                found.append((at, decided, verdict))
        return Hits.of(found)

    def describe(self) -> str:
        """One line: the rule and its parameters, as the docs and the benchmark show it."""
        return self.name

    def params(self) -> dict[str, object]:
        """The rule's parameters by name (``diagnosis.json``'s ``spike_rule``)."""
        from dataclasses import fields

        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]


class VectorisedRule(Rule[S]):
    """A rule whose :meth:`replay_many` judges every series at once: :meth:`replay` is that of one
    series (the vectorised arithmetic serves both; tests/test_rules.py checks it equals the
    step-by-step :meth:`update`)."""

    def replay(self, steps: Sequence[int] | IntArray, values: Sequence[float] | FloatArray, squared: bool = False) -> list[Verdict]:
        """:meth:`replay_many` of one series."""
        s, v = as_arrays(steps, values)
        return self.replay_many([0] if len(v) else [], s, v, squared).verdicts(s, v)


@dataclass(frozen=True, slots=True)
class Hits:
    """The verdicts of :meth:`Rule.replay_many`, as arrays of one length (one entry a verdict,
    in series and step order).

    Attributes:
        at: the position (into the arrays given) of the value named (:attr:`Verdict.step`).
        decided: the position of the value that decided it (:attr:`Verdict.decided`).
        reference, score, bar: as in :class:`Verdict`.
    """

    at: IntArray
    decided: IntArray
    reference: FloatArray
    score: FloatArray
    bar: FloatArray

    @staticmethod
    def of(found: Sequence[tuple[int, int, Verdict]]) -> Hits:
        """From (position named, position deciding, verdict) triples."""
        return Hits(
            np.array([a for a, _, _ in found], dtype=np.int64),
            np.array([d for _, d, _ in found], dtype=np.int64),
            np.array([v.reference for _, _, v in found], dtype=np.float64),
            np.array([v.score for _, _, v in found], dtype=np.float64),
            np.array([v.bar for _, _, v in found], dtype=np.float64),
        )

    def verdicts(self, steps: IntArray, values: FloatArray) -> list[Verdict]:
        """As :class:`Verdict` objects, over the ``steps`` and ``values`` judged."""
        return [
            Verdict(int(steps[a]), float(values[a]), float(r), float(sc), float(b), int(steps[d]))
            for a, d, r, sc, b in zip(self.at, self.decided, self.reference, self.score, self.bar, strict=True)
        ]


def series_bounds(starts: Sequence[int] | IntArray, length: int) -> list[tuple[int, int]]:
    """``starts`` (of :meth:`Rule.replay_many`) as (start, end) pairs, checked."""
    first = np.asarray(starts, dtype=np.int64)
    if length and (not len(first) or first[0] != 0 or np.any(np.diff(first) <= 0) or first[-1] >= length):
        raise ValueError(f"series starts {first[:5].tolist()}...: need 0 first, ascending, below {length}")
    ends = np.append(first[1:], length)
    return [(int(a), int(b)) for a, b in zip(first, ends, strict=True)] if length else []


def series_ids(starts: Sequence[int] | IntArray, length: int) -> IntArray:
    """Each position's series number (0 for the first series), from ``starts``."""
    series_bounds(starts, length)  # checked
    ids = np.zeros(length, dtype=np.int64)
    first = np.asarray(starts, dtype=np.int64)
    if len(first) > 1:
        ids[first[1:]] = 1
    out: IntArray = np.cumsum(ids)
    return out


def place_in_series(ids: IntArray) -> IntArray:
    """Each position's index within its series (``ids`` non-decreasing: :func:`series_ids`)."""
    n = len(ids)
    if not n:
        return np.zeros(0, dtype=np.int64)
    new = np.ones(n, dtype=bool)
    new[1:] = ids[1:] != ids[:-1]
    first = np.maximum.accumulate(np.where(new, np.arange(n), 0))
    out: IntArray = np.arange(n) - first
    return out


def finite(value: float) -> bool:
    """Whether ``value`` counts as a value (not NaN, not ±inf)."""
    return math.isfinite(value)


def as_arrays(steps: Sequence[int] | IntArray, values: Sequence[float] | FloatArray) -> tuple[IntArray, FloatArray]:
    """``steps`` and ``values`` as NumPy arrays of equal length (a series for a vectorised replay)."""
    s = np.asarray(steps, dtype=np.int64)
    v = np.asarray(values, dtype=np.float64)
    if s.shape != v.shape or s.ndim != 1:
        raise ValueError(f"steps {s.shape} and values {v.shape}: need two 1-d arrays of one length")
    return s, v
