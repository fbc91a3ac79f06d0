"""``optimizer`` monitor: Adam-family moments, read just after ``optimizer.step()``.

Rows: ``module_name`` = ``<param>.exp_avg`` / ``<param>.exp_avg_sq`` with scope ``exp_avg`` /
``exp_avg_sq`` (with ``suffix_names=False``, as Monitor V1 writes them, just ``<param>``, the
scope telling the moments apart). Any optimizer whose per-parameter state holds ``exp_avg``/``exp_avg_sq`` tensors
is supported (Adam, AdamW, NAdam, RAdam, and most fused or third-party Adam variants). For any
other optimizer the monitor logs one warning naming the optimizer's class and switches itself
off. ``mv_distribution: false`` also switches it off.
"""

from __future__ import annotations

import torch

from trainprobe.config.monitor_v2 import OptimizerConfig
from trainprobe.log import warn_once
from trainprobe.probes.base import Probe, StepClock
from trainprobe.probes.model_view import NamedParam
from trainprobe.records import RowKey

MOMENTS = ("exp_avg", "exp_avg_sq")


class OptimizerStateProbe(Probe):
    """Statistics of the optimizer's first and second moments."""

    name = "optimizer"

    def __init__(
        self,
        clock: StepClock,
        config: OptimizerConfig,
        optimizer: torch.optim.Optimizer,
        params: list[NamedParam],
        *,
        suffix_names: bool = True,
    ) -> None:
        super().__init__(clock, config.ops, config.eps)
        self.suffix_names = suffix_names
        self.optimizer = optimizer
        self.params = params
        self.disabled = not config.mv_distribution

    def after_optimizer_step(self) -> None:
        keys: list[RowKey] = []
        tensors: list[torch.Tensor] = []
        state = self.optimizer.state
        for named in self.params:
            entry = state.get(named.param)
            if not entry:
                continue
            for moment in MOMENTS:
                value = entry.get(moment)
                if isinstance(value, torch.Tensor):
                    row = f"{named.name}.{moment}" if self.suffix_names else named.name
                    keys.append(RowKey(named.vpp_stage, row, moment))
                    tensors.append(value)
        if not keys and state:
            self.disabled = True
            warn_once(
                f"optimizer-unsupported-{type(self.optimizer).__name__}",
                f"trainprobe optimizer monitor: {type(self.optimizer).__name__} keeps no exp_avg/exp_avg_sq "
                "state (only Adam-family optimizers do); the optimizer monitor is skipped",
            )
            return
        self.rows.extend(keys, self.stats.rows(tensors))
