"""``optimizer`` monitor: Adam-family moments, read just after ``optimizer.step()``.

Rows: ``module_name`` = ``<param>.exp_avg`` / ``<param>.exp_avg_sq`` with scope ``exp_avg`` /
``exp_avg_sq`` (with ``suffix_names=False``, as Monitor V1 writes them, just ``<param>``, the
scope telling the moments apart). Any optimizer whose per-parameter state holds ``exp_avg``/``exp_avg_sq`` tensors
is supported (Adam, AdamW, NAdam, RAdam, and most fused or third-party Adam variants). For any
other optimizer the monitor logs one warning naming the optimizer's class and switches itself
off. ``mv_distribution: false`` also switches it off. The moments are found by the backend
(``optimizer_moments``; MindSpore's Adam-family moments are renamed ``exp_avg``/``exp_avg_sq``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainprobe.config.monitor_v2 import OptimizerConfig
from trainprobe.log import warn_once
from trainprobe.probes.base import Probe, StepClock
from trainprobe.probes.model_view import NamedParam
from trainprobe.records import RowKey

if TYPE_CHECKING:
    from trainprobe.adapters import Backend

MOMENTS = ("exp_avg", "exp_avg_sq")


class OptimizerStateProbe(Probe):
    """Statistics of the optimizer's first and second moments."""

    name = "optimizer"

    def __init__(
        self,
        clock: StepClock,
        config: OptimizerConfig,
        optimizer: Any,
        params: list[NamedParam],
        *,
        suffix_names: bool = True,
        backend: Backend | None = None,
    ) -> None:
        super().__init__(clock, config.ops, config.eps, backend=backend)
        self.suffix_names = suffix_names
        self.optimizer = optimizer
        self.params = params
        self.disabled = not config.mv_distribution
        self._keys: dict[tuple[int, str], RowKey] = {}  # (id of the NamedParam, moment) -> its row key

    def after_optimizer_step(self) -> None:
        keys: list[RowKey] = []
        tensors: list[Any] = []
        found, has_state = self.backend.optimizer_moments(self.optimizer, self.params)
        known = self._keys
        for named, moment, value in found:
            key = known.get((id(named), moment))
            if key is None:
                row = f"{named.name}.{moment}" if self.suffix_names else named.name
                key = known[(id(named), moment)] = RowKey(named.vpp_stage, row, moment)
            keys.append(key)
            tensors.append(value)
        if not keys and has_state:
            self.disabled = True
            kind = getattr(self.optimizer, "class_name", type(self.optimizer).__name__)  # adapters' wrappers
            warn_once(
                f"optimizer-unsupported-{kind}",
                f"trainprobe optimizer monitor: {kind} keeps no exp_avg/exp_avg_sq "
                "state (only Adam-family optimizers do); the optimizer monitor is skipped",
            )
            return
        self.rows.extend(keys, self.stats.rows(tensors))
