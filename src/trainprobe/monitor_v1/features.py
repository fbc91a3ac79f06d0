"""Monitor V1 features with no Monitor V2 counterpart: ``mg_direction`` and ``ur_distribution``.

``mg_direction`` (table ``other``, row ``<param>.mg_direction``): just before ``optimizer.step()``,
the element-wise agreement of the gradient's sign with the first moment's (``exp_avg``, the
momentum of the previous steps), as a 0/1 tensor summarised by the configured ops: its ``mean``
is the fraction of elements where gradient and momentum agree. Parameters without momentum yet
(the first step) or without a gradient give no row.

``ur_distribution`` (tables ``adam_update`` and ``adam_ratio``, rows ``<param>``): just after an
Adam-family ``optimizer.step()``, with the bias-corrected moments ``m̂ = exp_avg / (1 - β1^t)`` and
``v̂ = exp_avg_sq / (1 - β2^t)``, the update ``m̂ / (√v̂ + eps)`` and the ratio ``m̂ / √v̂``,
summarised by the configured ops (CSV, TensorBoard scalars or the ``api`` memory). With
``format: tensorboard`` their distributions are also written as TensorBoard histograms, one per
parameter and step (tables ``adam_update_histogram`` / ``adam_ratio_histogram``, rows from
:func:`~trainprobe.monitor_v1.histogram.histogram_row`), kept in a companion
:class:`HistogramRows` probe because a histogram row is longer than a statistics row.

Both need an optimizer whose state holds ``exp_avg`` (and, for ``ur_distribution``,
``exp_avg_sq``, ``step`` and the group's ``betas``/``eps``); with any other optimizer each logs
one warning naming the optimizer's class and switches itself off.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from trainprobe.log import warn_once
from trainprobe.monitor_v1.histogram import histogram_row
from trainprobe.monitor_v1.output import HISTOGRAM_TABLES
from trainprobe.probes.base import Probe, StepClock
from trainprobe.probes.model_view import NamedParam
from trainprobe.records import RowKey


def _unsupported(probe: Probe, optimizer: Any, needs: str) -> None:
    """Switch ``probe`` off with one warning: ``optimizer`` keeps no Adam-family state."""
    probe.disabled = True
    kind = type(optimizer).__name__
    warn_once(
        f"v1-{probe.name}-unsupported-{kind}",
        f"trainprobe: {probe.name} needs an Adam-family optimizer ({needs} in its state); "
        f"{kind} has none, so {probe.name} is skipped",
    )


class MgDirectionProbe(Probe):
    """Sign agreement of gradient and momentum."""

    name = "mg_direction"

    def __init__(
        self,
        clock: StepClock,
        ops: tuple[str, ...],
        eps: float,
        optimizer: Any,
        params: list[NamedParam],
        grad_of: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
    ) -> None:
        super().__init__(clock, ops, eps)
        self.optimizer = optimizer
        self.params = params
        self.grad_of = grad_of or (lambda p: p.grad)

    def before_optimizer_step(self) -> None:
        state: Mapping[Any, Any] = self.optimizer.state
        found = False
        for named in self.params:
            entry = state.get(named.param) or {}
            moment = entry.get("exp_avg")
            found = found or isinstance(moment, torch.Tensor)
            grad = self.grad_of(named.param)
            if grad is None or not isinstance(moment, torch.Tensor):
                continue
            agree = (torch.sign(grad.detach()) == torch.sign(moment)).to(torch.float32)
            self.rows.add(RowKey(named.vpp_stage, f"{named.name}.mg_direction", "other"), self.stats.row(agree))
        if not found and len(state):
            _unsupported(self, self.optimizer, "exp_avg")


class HistogramRows(Probe):
    """Holds the histogram rows another probe computes (no hooks of its own)."""

    name = "ur_histogram"


class UpdateRatioProbe(Probe):
    """Adam update and update/ratio statistics (and histograms) after the optimizer step.

    Args:
        histograms: where histogram rows go (None: statistics only).
    """

    name = "ur_distribution"

    def __init__(
        self,
        clock: StepClock,
        ops: tuple[str, ...],
        eps: float,
        optimizer: Any,
        params: list[NamedParam],
        histograms: HistogramRows | None = None,
    ) -> None:
        super().__init__(clock, ops, eps)
        self.optimizer = optimizer
        self.params = params
        self.histograms = histograms
        self._group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}

    def after_optimizer_step(self) -> None:
        state: Mapping[Any, Any] = self.optimizer.state
        found = False
        for named in self.params:
            pair = self._update_and_ratio(state.get(named.param) or {}, self._group_of.get(id(named.param)))
            if pair is None:
                continue
            found = True
            for scope, tensor in zip(("adam_update", "adam_ratio"), pair):
                self.rows.add(RowKey(named.vpp_stage, named.name, scope), self.stats.row(tensor))
                if self.histograms is not None:
                    key = RowKey(named.vpp_stage, named.name, HISTOGRAM_TABLES[scope])
                    self.histograms.rows.add(key, histogram_row(tensor))
        if not found and len(state):
            _unsupported(self, self.optimizer, "exp_avg, exp_avg_sq, step and betas")

    @staticmethod
    def _update_and_ratio(
        entry: Mapping[str, Any], group: Mapping[str, Any] | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(m̂ / (√v̂ + eps), m̂ / √v̂)`` of one parameter, or None without Adam state."""
        m, v, step = entry.get("exp_avg"), entry.get("exp_avg_sq"), entry.get("step")
        if not isinstance(m, torch.Tensor) or not isinstance(v, torch.Tensor) or step is None:
            return None
        if group is None or "betas" not in group:
            return None
        t = step.to(torch.float64) if isinstance(step, torch.Tensor) else float(step)  # no host sync
        beta1, beta2 = group["betas"]
        m_hat = m / (1 - beta1**t)
        root = torch.sqrt(v / (1 - beta2**t))
        return m_hat / (root + group.get("eps", 1e-8)), m_hat / root

    def fail(self, exc: BaseException) -> None:
        super().fail(exc)
        if self.histograms is not None:
            self.histograms.disabled = True
            self.histograms.rows.clear()
