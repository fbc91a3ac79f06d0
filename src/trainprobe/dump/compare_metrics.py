"""The numbers of one compare row and its verdict.

"NPU" is the target dump (``-tp``), "Bench" the golden one (``-gp``). Differences are
``target - golden``; relative errors ``|target - golden| / |golden|`` written as percentages
(``"0.5%"``; ``"N/A"`` when golden is 0 and target is not). These columns show every difference;
the verdict (``Result``) uses the reference tool's thresholds, so that values near zero never
fail a row:

* statistics: ``error`` when dtype or shape differ, or inf/NaN appear on one side only;
  ``warning`` when for one of Max/Min/Mean/L2norm the *magnitude difference*
  ``|target - golden| / (max(|target|, |golden|) + floor)`` exceeds 0.5 (the reference's
  ``MAGNITUDE``); ``pass`` otherwise. ``floor`` is 1e-10 (the reference's ``EPSILON``), and for
  Mean also 1e-3 × the tensor's root mean square (``Norm / sqrt(numel)``): the mean of a
  centred tensor (a LayerNorm output, a gradient) is float rounding noise, and noise must not
  decide the verdict. Example: means 3e-11 and -2e-11 of a tensor of RMS 1.0 differ by
  5e-11 / (3e-11 + 1e-3) ≈ 5e-8: pass; maxima 1.0 and 3.0 differ by 2 / 3 ≈ 0.67: warning.
* tensor: ``error`` when shapes differ, inf/NaN differ, or the reference's accuracy check fails
  (Cosine < 0.99 with MaxAbsErr > 0.001, or Cosine < 0.9, or MaxAbsErr > 1); ``pass`` otherwise.
* md5: ``pass`` when the checksums are equal, ``error`` otherwise.
* values that are not tensors (an int, a float, a bool, ``None``): their value stands in for the
  four statistics; ``warning`` when two non-numeric values differ. In md5 mode their checksum
  is the CRC-32 of the value's text, so a changed argument is an ``error`` there.
* bool tensors: the reference writes ``Max`` (any) and ``Min`` (all) as ``true``/``false`` and
  no Mean or Norm; these read as 1.0 / 0.0 (:func:`stat_value`), so they compare with each
  other and with trainprobe's float64 summary of the same tensor.
* a tensor statistic in a dump file that is not a number (``"Max": "abc"``, ``true``, a list;
  ``null`` and the texts ``"nan"``/``"inf"``/``"-inf"`` are fine): ``error`` naming the file and
  the key (:func:`check_numbers`), in statistics and tensor mode; the columns of that statistic
  show ``N/A`` for its differences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

STAT_KEYS = ("Max", "Min", "Mean", "Norm")
MAGNITUDE = 0.5
"""A statistic whose magnitude difference exceeds this is a warning (the reference's rule)."""
EPSILON = 1e-10
"""The absolute floor of the magnitude difference's denominator (the reference's)."""
MEAN_FLOOR = 1e-3
"""Means are compared against this fraction of the tensor's root mean square as well."""
COSINE_ERROR = 0.99
COSINE_MIN = 0.9
MAX_ABS_ERROR = 0.001
MAX_ABS_MAX = 1.0


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


BOOL_DTYPE = "torch.bool"


def stat_value(entry: dict[str, Any], key: str) -> float | None:
    """Statistic ``key`` of ``entry`` as a float (:func:`as_float`); a bool tensor's ``true`` /
    ``false`` (the reference writes ``Max`` = any, ``Min`` = all, ``Mean``/``Norm`` null) is
    1.0 / 0.0, the value trainprobe's float64 summary gives."""
    value = entry.get(key)
    if isinstance(value, bool) and entry.get("dtype") == BOOL_DTYPE:
        return float(value)
    return as_float(value)


def check_numbers(entry: dict[str, Any], where: str, verdict: Verdict) -> None:
    """Flag, as an ``error`` naming ``where`` (the dump file) and the key, a tensor statistic that
    is neither a number, ``null``, nor a number's text (``"nan"``, ``"inf"``, ``"-inf"``,
    ``"1.5"``): ``"Max": "abc"``, or ``"Max": true`` of a tensor that is not a bool tensor, is a
    damaged dump, never a silent ``N/A``."""
    if entry.get("type") != "torch.Tensor":
        return
    for key in STAT_KEYS:
        value = entry.get(key)
        if value is not None and stat_value(entry, key) is None:
            shown = repr(value)
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            verdict.flag("error", f"{where}: {key} is not a number ({shown})")


def check_structure(t: dict[str, Any], g: dict[str, Any], verdict: Verdict) -> None:
    """Flag dtype and shape differences."""
    if t.get("dtype") != g.get("dtype"):
        verdict.flag("error", f"dtype differs ({t.get('dtype')} vs {g.get('dtype')})")
    if t.get("shape") != g.get("shape"):
        verdict.flag("error", f"shape differs ({t.get('shape')} vs {g.get('shape')})")


def _floor(key: str, entry: dict[str, Any]) -> float:
    """The denominator's floor for statistic ``key`` of ``entry`` (see the module docstring)."""
    if key != "Mean":
        return EPSILON
    norm, shape = as_float(entry.get("Norm")), entry.get("shape")
    if norm is None or not math.isfinite(norm) or not isinstance(shape, list):
        return EPSILON
    numel = math.prod(int(d) for d in shape if isinstance(d, int)) or 1
    return max(EPSILON, MEAN_FLOOR * norm / math.sqrt(numel))


def magnitude(a: float, b: float, floor: float) -> float:
    """``|a - b| / (max(|a|, |b|) + floor)``: 0 for equal values, at most 2."""
    return abs(a - b) / (max(abs(a), abs(b)) + floor)


def statistics_values(t: dict[str, Any], g: dict[str, Any], verdict: Verdict) -> list[Any]:
    """Max/Min/Mean/L2norm diff, then the four relative errors (flagging the verdict)."""
    diffs: list[Any] = []
    rels: list[Any] = []
    for key in STAT_KEYS:
        a, b = stat_value(t, key), stat_value(g, key)
        if a is None or b is None:
            diffs.append("N/A")
            rels.append("N/A")
            if a is None and b is None and t.get(key) != g.get(key):
                verdict.flag("warning", f"{key} differs ({t.get(key)!r} vs {g.get(key)!r})")
            continue
        finite_a, finite_b = math.isfinite(a), math.isfinite(b)
        if finite_a != finite_b or (not finite_a and str(a) != str(b)):
            verdict.flag("error", f"{key} is {a} vs {b}")
        diffs.append(a - b if finite_a and finite_b else "N/A")
        rels.append(percent(relative(a, b)))
        if finite_a and finite_b:
            m = magnitude(a, b, max(_floor(key, t), _floor(key, g)))
            if m > MAGNITUDE:
                verdict.flag("warning", f"{key} magnitude difference {m:.3g} > {MAGNITUDE} ({a:.6g} vs {b:.6g})")
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
    if (cosine < COSINE_ERROR and max_abs > MAX_ABS_ERROR) or cosine < COSINE_MIN or max_abs > MAX_ABS_MAX:
        verdict.flag("error", f"accuracy check failed: Cosine {cosine:.6g}, MaxAbsErr {max_abs:.6g}")
    return [cosine, euc, max_abs, max_rel, one, five]
