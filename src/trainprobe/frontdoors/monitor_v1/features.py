"""Monitor V1 features with no Monitor V2 counterpart: ``mg_direction`` and ``ur_distribution``.

``mg_direction`` (table ``other``, row ``<param>``, tag task ``mg_direction``): just before ``optimizer.step()``,
the fraction of the parameter's elements where the gradient's sign equals the first moment's
(``exp_avg``, the momentum of the previous steps), a number in [0, 1] (the spec's "ratio of
weight gradient and momentum with the same direction"). The row holds the statistics of that one
number, so every op column holds the fraction whatever ``ops`` are: ``min`` = ``max`` = ``mean`` =
``norm`` = the fraction, ``nans`` = 0, ``zeros`` = 1 when the fraction is below ``eps`` (no element
agrees) and 0 otherwise. Signs are compared as ``torch.sign`` gives them: a zero agrees only with a
zero, and a NaN element never agrees. Parameters without momentum yet (the first step, or a layer
not used so far), without a gradient, or with no elements give no row.

``ur_distribution`` (tables ``adam_update`` and ``adam_ratio``, rows ``<param>``): just after an
Adam-family ``optimizer.step()``, with the bias-corrected moments ``m̂ = exp_avg / (1 - β1^t)`` and
``v̂ = exp_avg_sq / (1 - β2^t)``, the update ``m̂ / (√v̂ + eps)`` (the group's ``eps``) and the
ratio ``m̂ / √v̂``, summarised by the configured ops (CSV, TensorBoard scalars or the ``api``
memory). An element whose moments are both 0 (its gradient has always been 0, such as an
``Embedding`` row never looked up) has update 0 and ratio 0, not ``0/0 = NaN``: NaN appears only
where the moments hold NaN (or where both are infinite). With ``format: tensorboard`` their
distributions are also written as TensorBoard histograms, one per parameter and step (tables
``adam_update_histogram`` / ``adam_ratio_histogram``, rows from
:func:`~trainprobe.frontdoors.monitor_v1.histogram.histogram_row`), kept in a companion
:class:`HistogramRows` probe because a histogram row is longer than a statistics row.

Both need an optimizer whose state holds ``exp_avg`` (and, for ``ur_distribution``,
``exp_avg_sq``, ``step`` and the group's ``betas``/``eps``). That is decided from the optimizer
(its class and the kind of state it keeps, see :meth:`~trainprobe.engine.optimizer_view.OptimizerView.keeps_state`),
not from the monitored parameters: with any other optimizer each logs one warning naming the
optimizer's class and switches itself off; with an Adam-family one, a parameter that has no state
yet is skipped on that step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from trainprobe.backends.torch.backend import TORCH
from trainprobe.engine.log import warn_once
from trainprobe.engine.optimizer_view import OptimizerView
from trainprobe.engine.probes.base import Probe, ProbeSpec, StepClock
from trainprobe.engine.probes.model_view import NamedParam
from trainprobe.engine.records import RowKey
from trainprobe.frontdoors.monitor_v1.histogram import histogram_row
from trainprobe.frontdoors.monitor_v1.output import HISTOGRAM_TABLES

MG_NEEDS: tuple[str, ...] = ("exp_avg",)
"""State keys ``mg_direction`` reads."""
UR_NEEDS: tuple[str, ...] = ("exp_avg", "exp_avg_sq", "step")
"""State keys ``ur_distribution`` reads (and the group's ``betas``)."""


class _AdamFeature(Probe):
    """A probe that reads Adam-family state: judges the optimizer once (see
    :meth:`~trainprobe.engine.optimizer_view.OptimizerView.keeps_state`) and switches itself off with one
    warning naming the optimizer's class when it keeps no such state."""

    needs: tuple[str, ...] = ()
    requirement: str = ""
    """What the warning says the optimizer lacks."""

    def __init__(self, clock: StepClock, spec: ProbeSpec, optimizer: OptimizerView, params: list[NamedParam]) -> None:
        super().__init__(clock, spec, backend=TORCH)
        self.optimizer = optimizer
        self.params = params
        self._verdict: bool | None = None  # the optimizer's verdict, once known

    def supported(self, *, stepped: bool) -> bool:
        """Whether the optimizer keeps :attr:`needs` (False until that is known; on the step
        that shows it never will, warn once and switch off). ``stepped``: called after
        ``optimizer.step()``."""
        verdict = self._verdict
        if verdict is None:
            verdict = self._verdict = self._judge(stepped)
            if verdict is False:
                self.disabled = True
                kind = self.optimizer.class_name
                warn_once(
                    f"v1-{self.name}-unsupported-{kind}",
                    f"trainprobe: {self.name} needs an Adam-family optimizer ({self.requirement}); "
                    f"{kind} has none, so {self.name} is skipped",
                )
        return bool(verdict)

    def _judge(self, stepped: bool) -> bool | None:
        return self.optimizer.keeps_state(self.needs, stepped=stepped)


class MgDirectionProbe(_AdamFeature):
    """Fraction of elements where the gradient and the momentum have the same sign."""

    name = "mg_direction"
    needs = MG_NEEDS
    requirement = "exp_avg in its state"

    def __init__(
        self,
        clock: StepClock,
        spec: ProbeSpec,
        optimizer: OptimizerView,
        params: list[NamedParam],
        grad_of: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
    ) -> None:
        super().__init__(clock, spec, optimizer, params)
        self.grad_of = grad_of or (lambda p: p.grad)

    def before_optimizer_step(self) -> None:
        if not self.supported(stepped=False):
            return
        for named in self.params:
            moment = (self.optimizer.state_of(named.param) or {}).get("exp_avg")
            grad = self.grad_of(named.param)
            if grad is None or not isinstance(moment, torch.Tensor) or grad.numel() == 0:
                continue
            if moment.shape != grad.shape:  # a shard of the parameter (Megatron's distributed optimizer)
                warn_once(
                    f"mg-shard-{named.name}",
                    f"trainprobe mg_direction: the optimizer's exp_avg of {named.name} is a shard "
                    f"{tuple(moment.shape)} of its gradient {tuple(grad.shape)}; no mg_direction row for it",
                )
                continue
            fraction = self.agreement(grad.detach(), moment)
            self.rows.add(RowKey(named.vpp_stage, named.name, "mg_direction"), self.stats.row(fraction))

    def after_optimizer_step(self) -> None:
        self.supported(stepped=True)  # an optimizer without state after a step with gradients: warn now

    @staticmethod
    def agreement(grad: torch.Tensor, moment: torch.Tensor) -> torch.Tensor:
        """The fraction (a float64 0-dim tensor on the tensors' device, no host sync) of
        elements where ``torch.sign(grad) == torch.sign(moment)``; counted exactly."""
        same = torch.count_nonzero(torch.sign(grad) == torch.sign(moment))
        return same.to(torch.float64) / grad.numel()


class HistogramRows(Probe):
    """Holds the histogram rows another probe computes (no hooks of its own)."""

    name = "ur_histogram"


class UpdateRatioProbe(_AdamFeature):
    """Adam update and update/ratio statistics (and histograms) after the optimizer step.

    Args:
        histograms: where histogram rows go (None: statistics only).
    """

    name = "ur_distribution"
    needs = UR_NEEDS
    requirement = "exp_avg, exp_avg_sq and step in its state, betas in its groups"

    def __init__(
        self,
        clock: StepClock,
        spec: ProbeSpec,
        optimizer: OptimizerView,
        params: list[NamedParam],
        histograms: HistogramRows | None = None,
    ) -> None:
        super().__init__(clock, spec, optimizer, params)
        self.histograms = histograms
        self._group_of = {id(p): g for g in optimizer.groups() for p in g["params"]}

    def _judge(self, stepped: bool) -> bool | None:
        verdict = super()._judge(stepped)
        if verdict and not any("betas" in g for g in self.optimizer.groups()):
            return False
        return verdict

    def after_optimizer_step(self) -> None:
        if not self.supported(stepped=True):
            return
        for named in self.params:
            pair = self._update_and_ratio(
                self.optimizer.state_of(named.param) or {}, self._group_of.get(id(named.param))
            )
            if pair is None:
                continue
            for scope, tensor in zip(("adam_update", "adam_ratio"), pair):
                self.rows.add(RowKey(named.vpp_stage, named.name, scope), self.stats.row(tensor))
                if self.histograms is not None:
                    key = RowKey(named.vpp_stage, named.name, HISTOGRAM_TABLES[scope])
                    self.histograms.rows.add(key, histogram_row(tensor))

    @staticmethod
    def _update_and_ratio(
        entry: Mapping[str, Any], group: Mapping[str, Any] | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(m̂ / (√v̂ + eps), m̂ / √v̂)`` of one parameter, or None without Adam state. Where
        both moments are 0 both values are 0 (not ``0/0``); NaN only where a moment is NaN."""
        m, v, step = entry.get("exp_avg"), entry.get("exp_avg_sq"), entry.get("step")
        if not isinstance(m, torch.Tensor) or not isinstance(v, torch.Tensor) or step is None:
            return None
        if group is None or "betas" not in group:
            return None
        t = step.to(torch.float64) if isinstance(step, torch.Tensor) else float(step)  # no host sync
        beta1, beta2 = group["betas"]
        m_hat = m / (1 - beta1**t)
        root = torch.sqrt(v / (1 - beta2**t))
        at_rest = (m_hat == 0) & (root == 0)  # gradient always 0 so far: no update, ratio 0
        ratio = (m_hat / root).masked_fill_(at_rest, 0.0)
        update = (m_hat / root.add_(group.get("eps", 1e-8))).masked_fill_(at_rest, 0.0)
        return update, ratio

    def fail(self, exc: BaseException) -> None:
        super().fail(exc)
        if self.histograms is not None:
            self.histograms.disabled = True
            self.histograms.rows.clear()
