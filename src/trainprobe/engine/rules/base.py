"""What a spike rule is: one definition, fed one value at a time, replayed over a whole series.

A rule judges one *series*: one tensor's statistic over the steps (a magnitude, ``>= 0``), in
step order. The same object serves both sides of a run:

* online, during training: ``state = rule.start(squared)`` once per series, then
  ``verdict = rule.update(state, step, value)`` for each recorded step;
* offline, over the files: ``rule.replay(steps, values, squared)`` gives the verdicts of the
  whole series, the same list the step-by-step loop gives (a rule may compute it vectorised;
  ``tests/test_rules.py`` checks both agree on every rule).

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

    def describe(self) -> str:
        """One line: the rule and its parameters, as the docs and the benchmark show it."""
        return self.name


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
