"""The numbers of one compare row and its verdict.

"NPU" is the target dump (``-tp``), "Bench" the golden one (``-gp``). Differences are
``target - golden``; relative errors ``|target - golden| / |golden|`` written as percentages
(``"0.5%"``; ``"N/A"`` when golden is 0 and target is not).

Verdicts (``Result``):

* statistics: ``error`` when dtype or shape differ, inf/NaN appear on one side only or a relative
  error exceeds 50%; ``warning`` when one exceeds 0.5% (5‰); ``pass`` otherwise.
* tensor: ``error`` when shapes differ, inf/NaN differ or Cosine < 0.99; ``warning`` when
  Cosine < 0.9999 or fewer than 99.9% of the elements are within 5‰; ``pass`` otherwise.
* md5: ``pass`` when the checksums are equal, ``error`` otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

STAT_KEYS = ("Max", "Min", "Mean", "Norm")
WARN_REL = 0.005
ERROR_REL = 0.5
COSINE_ERROR = 0.99
COSINE_WARN = 0.9999
RATIO_WARN = 0.999


@dataclass(slots=True)
class Verdict:
    """``pass`` / ``warning`` / ``error`` and why."""

    result: str = "pass"
    reasons: list[str] = field(default_factory=list)

    def flag(self, level: str, reason: str) -> None:
        """Raise the verdict to ``level`` (never lower it) and note the reason."""
        order = {"pass": 0, "warning": 1, "error": 2}
        if order[level] > order[self.result]:
            self.result = level
        self.reasons.append(reason)

    @property
    def message(self) -> str:
        """The reasons, one line."""
        return "; ".join(self.reasons)


def as_float(value: Any) -> float | None:
    """A statistic as a float (``"nan"``/``"inf"`` strings included); None when absent."""
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def percent(rel: float | None) -> str:
    """A relative error as a percentage string."""
    if rel is None:
        return "N/A"
    return f"{rel * 100:.6g}%"


def relative(a: float | None, b: float | None) -> float | None:
    """``|a - b| / |b|`` (0 when both are equal, None when undefined)."""
    if a is None or b is None:
        return None
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    if b == 0 or not math.isfinite(b) or not math.isfinite(a):
        return None
    return abs(a - b) / abs(b)


def check_structure(t: dict[str, Any], g: dict[str, Any], verdict: Verdict) -> None:
    """Flag dtype and shape differences."""
    if t.get("dtype") != g.get("dtype"):
        verdict.flag("error", f"dtype differs ({t.get('dtype')} vs {g.get('dtype')})")
    if t.get("shape") != g.get("shape"):
        verdict.flag("error", f"shape differs ({t.get('shape')} vs {g.get('shape')})")


def statistics_values(t: dict[str, Any], g: dict[str, Any], verdict: Verdict) -> list[Any]:
    """Max/Min/Mean/L2norm diff, then the four relative errors (flagging the verdict)."""
    diffs: list[Any] = []
    rels: list[Any] = []
    for key in STAT_KEYS:
        a, b = as_float(t.get(key)), as_float(g.get(key))
        if a is None or b is None:
            diffs.append("N/A")
            rels.append("N/A")
            continue
        finite_a, finite_b = math.isfinite(a), math.isfinite(b)
        if finite_a != finite_b or (not finite_a and str(a) != str(b)):
            verdict.flag("error", f"{key} is {a} vs {b}")
        diffs.append(a - b if finite_a and finite_b else "N/A")
        rel = relative(a, b)
        rels.append(percent(rel))
        if rel is None and finite_a and finite_b:
            verdict.flag("warning", f"{key} relative error undefined (golden {key} is 0, target {a})")
        elif rel is not None and rel > ERROR_REL:
            verdict.flag("error", f"{key} relative error {percent(rel)} > {percent(ERROR_REL)}")
        elif rel is not None and rel > WARN_REL:
            verdict.flag("warning", f"{key} relative error {percent(rel)} > {percent(WARN_REL)}")
    return diffs + rels


def tensor_values(a: torch.Tensor, b: torch.Tensor, verdict: Verdict) -> list[Any]:
    """Cosine, EucDist, MaxAbsErr, MaxRelativeErr, One Thousandth and Five Thousandths Err
    Ratio of two tensors (computed in float64), flagging the verdict."""
    if a.shape != b.shape:
        verdict.flag("error", f"shape differs ({list(a.shape)} vs {list(b.shape)})")
        return ["N/A"] * 6
    x = a.detach().to(torch.float64).flatten()
    y = b.detach().to(torch.float64).flatten()
    if x.numel() == 0:
        return [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    fx, fy = torch.isfinite(x), torch.isfinite(y)
    if not torch.equal(fx, fy) or not torch.equal(x[~fx].nan_to_num(0.0, 1.0, -1.0), y[~fy].nan_to_num(0.0, 1.0, -1.0)):
        verdict.flag("error", "inf/NaN differ")
    x, y = x[fx & fy], y[fx & fy]
    diff = (x - y).abs()
    nx, ny = x.norm().item(), y.norm().item()
    if nx == 0 and ny == 0:
        cosine = 1.0
    elif nx == 0 or ny == 0:
        cosine = 0.0
    else:
        cosine = max(-1.0, min(1.0, (x @ y).item() / (nx * ny)))
    euc = diff.norm().item()
    max_abs = diff.max().item() if diff.numel() else 0.0
    rel = torch.where(y != 0, diff / y.abs(), torch.where(diff == 0, 0.0, math.inf))
    max_rel = rel.max().item() if rel.numel() else 0.0
    n = max(rel.numel(), 1)
    one = (rel <= 0.001).sum().item() / n
    five = (rel <= 0.005).sum().item() / n
    if cosine < COSINE_ERROR:
        verdict.flag("error", f"Cosine {cosine:.6g} < {COSINE_ERROR}")
    elif cosine < COSINE_WARN:
        verdict.flag("warning", f"Cosine {cosine:.6g} < {COSINE_WARN}")
    if five < RATIO_WARN:
        verdict.flag("warning", f"only {five:.4%} of the elements are within 5‰")
    return [cosine, euc, max_abs, max_rel, one, five]
