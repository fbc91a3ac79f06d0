"""Monitor V1 features with no Monitor V2 counterpart: ``mg_direction`` and ``ur_distribution``.

``mg_direction`` (table ``other``, row ``<param>.mg_direction``): just before ``optimizer.step()``,
the element-wise agreement of the gradient's sign with the first moment's (``exp_avg``, the
momentum of the previous steps), as a 0/1 tensor summarised by the configured ops: its ``mean``
is the fraction of elements where gradient and momentum agree. Parameters without momentum yet
(the first step) or without a gradient give no row.

``ur_distribution`` (tables ``adam_update`` and ``adam_ratio``, rows ``<param>``): just after an
Adam-family ``optimizer.step()``, with the bias-corrected moments ``m̂ = exp_avg / (1 - β1^t)`` and
``v̂ = exp_avg_sq / (1 - β2^t)``, the update ``m̂ / (√v̂ + eps)`` and the ratio ``m̂ / √v̂``,
summarised by the configured ops (in CSV, or as TensorBoard scalars).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from trainprobe.probes.base import Probe, StepClock
from trainprobe.probes.model_view import NamedParam
from trainprobe.records import RowKey


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
        state = self.optimizer.state
        for named in self.params:
            grad = self.grad_of(named.param)
            moment = (state.get(named.param) or {}).get("exp_avg")
            if grad is None or not isinstance(moment, torch.Tensor):
                continue
            agree = (torch.sign(grad.detach()) == torch.sign(moment)).to(torch.float32)
            self.rows.add(RowKey(named.vpp_stage, f"{named.name}.mg_direction", "other"), self.stats.row(agree))


class UpdateRatioProbe(Probe):
    """Adam update and update/ratio statistics after the optimizer step."""

    name = "ur_distribution"

    def __init__(
        self, clock: StepClock, ops: tuple[str, ...], eps: float, optimizer: Any, params: list[NamedParam]
    ) -> None:
        super().__init__(clock, ops, eps)
        self.optimizer = optimizer
        self.params = params
        self._group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}

    def after_optimizer_step(self) -> None:
        state = self.optimizer.state
        for named in self.params:
            entry = state.get(named.param) or {}
            m, v, step = entry.get("exp_avg"), entry.get("exp_avg_sq"), entry.get("step")
            group = self._group_of.get(id(named.param))
            if not isinstance(m, torch.Tensor) or not isinstance(v, torch.Tensor) or step is None or group is None:
                continue
            t = float(step)
            beta1, beta2 = group["betas"]
            m_hat = m / (1 - beta1**t)
            root = torch.sqrt(v / (1 - beta2**t))
            self.rows.add(
                RowKey(named.vpp_stage, named.name, "adam_update"), self.stats.row(m_hat / (root + group["eps"]))
            )
            self.rows.add(RowKey(named.vpp_stage, named.name, "adam_ratio"), self.stats.row(m_hat / root))
