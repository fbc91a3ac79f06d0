"""Which series of a monitor table the spike rules judge, and their values.

A *series* is one tensor's statistic over the steps: one (table, rank, name, scope, micro_step,
vpp_stage) and one of two signals, as ``trainprobe diagnose`` has always cut them:

* ``norm``: ``|norm|``;
* ``amax``: the largest finite magnitude ``max(|min|, |max|)``, reported as ``max`` or
  ``min``, whichever it is (the finite one where the other is NaN/inf; ``max`` when neither is).

Not ``min`` or ``max`` alone (the small side of a tensor sits near 0 and jumps 10x without
anything being wrong), not ``mean`` (it crosses 0), not counts (``nans`` is the NaN/inf
check's). A NaN/inf value is NaN here (the rules never call it a spike). Series of the scopes
in :data:`SQUARED_SCOPES` are series of squares.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import numpy as np

from trainprobe.engine.rules.base import FloatArray, IntArray, Rule, Verdict

SPIKE_OPS: tuple[str, ...] = ("norm", "max", "min")
"""The ops the signals are made of (``norm``; ``max`` and ``min`` for ``amax``)."""
SQUARED_SCOPES: tuple[str, ...] = ("exp_avg_sq",)
"""Scopes holding squares (Adam's ``exp_avg_sq``): judged with squared bars."""
SIGNALS: tuple[str, ...] = ("norm", "amax")
"""The two signals of a tensor, in the order a row's are judged."""

K = TypeVar("K")


def _finite_abs(values: FloatArray) -> FloatArray:
    """``|v|`` where finite, else NaN."""
    out: FloatArray = np.where(np.isfinite(values), np.abs(values), np.nan)
    return out


def signals(ops: Mapping[str, FloatArray]) -> dict[str, tuple[FloatArray, list[str]]]:
    """The signals a table with these op columns has (``ops``: op name → one column of values):
    signal → (magnitudes, the op each magnitude is reported as). ``amax`` needs ``min`` or
    ``max``; with only one of them it is that op's magnitude."""
    out: dict[str, tuple[FloatArray, list[str]]] = {}
    if "norm" in ops:
        norm = np.asarray(ops["norm"], dtype=np.float64)
        out["norm"] = (_finite_abs(norm), ["norm"] * len(norm))
    low = np.asarray(ops["min"], dtype=np.float64) if "min" in ops else None
    high = np.asarray(ops["max"], dtype=np.float64) if "max" in ops else None
    if low is not None and high is not None:
        lo, hi = _finite_abs(low), _finite_abs(high)
        with np.errstate(invalid="ignore"):
            bigger = ~np.isnan(lo) & (np.isnan(hi) | (lo > hi))  # the finite one, else the larger
        out["amax"] = (np.fmax(lo, hi), ["min" if b else "max" for b in bigger])
    elif low is not None or high is not None:
        only = low if low is not None else high
        assert only is not None
        out["amax"] = (_finite_abs(only), ["min" if low is not None else "max"] * len(only))
    return out


def is_squared(scope: str) -> bool:
    """Whether a scope's series are series of squares (:data:`SQUARED_SCOPES`)."""
    return scope in SQUARED_SCOPES


def judge_all(
    rule: Rule[Any], series: Iterable[tuple[K, IntArray, FloatArray, bool]]
) -> dict[K, list[Verdict]]:
    """Each series' verdicts under ``rule``: ``series`` yields (key, steps, magnitudes,
    squared); the answer maps the keys with at least one verdict to them."""
    found: dict[K, list[Verdict]] = {}
    for key, steps, values, squared in series:
        verdicts = rule.replay(steps, values, squared)
        if verdicts:
            found[key] = verdicts
    return found
