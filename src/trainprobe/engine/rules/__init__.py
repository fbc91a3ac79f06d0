"""Spike rules: one definition each, used online (one step at a time) and offline (a series).

See :mod:`trainprobe.engine.rules.base` for the interface (``start`` / ``update`` / ``replay``)
and docs/diagnose.md, "Spike rules", for the rules and the benchmark that chose the default.

Example::

    from trainprobe.engine.rules import rule_named
    rule = rule_named("median")
    state = rule.start()
    for step, value in enumerate([1.0] * 12 + [50.0]):
        verdict = rule.update(state, step, value)   # a Verdict at step 12
    rule.replay(range(13), [1.0] * 12 + [50.0])     # the same verdicts, the whole series at once
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainprobe.engine.rules.base import Rule, Verdict
from trainprobe.engine.rules.median import RunningMedian
from trainprobe.engine.rules.published import EarlyMax, EmaZScore, MeanPatience
from trainprobe.engine.rules.recent import RecentMax

RULES: dict[str, Callable[..., Rule[Any]]] = {
    RunningMedian.name: RunningMedian,
    EarlyMax.name: EarlyMax,
    MeanPatience.name: MeanPatience,
    EmaZScore.name: EmaZScore,
    RecentMax.name: RecentMax,
}
"""Every rule by name, each with its published (or chosen) defaults."""
DEFAULT_RULE = "recent_max"
"""The rule the benchmark chose (docs/diagnose.md, "Spike rules")."""


def rule_named(name: str, **params: Any) -> Rule[Any]:
    """The rule ``name`` with ``params`` over its defaults.

    Raises:
        ValueError: an unknown name (the message lists the known ones) or a bad parameter.
    """
    make = RULES.get(name)
    if make is None:
        raise ValueError(f"unknown spike rule {name!r}; one of {', '.join(RULES)}")
    try:
        return make(**params)
    except TypeError as exc:
        raise ValueError(f"spike rule {name!r}: {exc}") from None


__all__ = ["DEFAULT_RULE", "RULES", "Rule", "Verdict", "rule_named"]
