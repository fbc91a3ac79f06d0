"""``param`` monitor: parameters just before (``param_origin``) and just after
(``param_updated``) ``optimizer.step()``. ``module_name`` is the parameter's name.
``param_distribution: false`` switches it off."""

from __future__ import annotations

from trainprobe.config.monitor_v2 import ParamConfig
from trainprobe.probes.base import Probe, StepClock
from trainprobe.probes.model_view import NamedParam
from trainprobe.records import RowKey


class ParamProbe(Probe):
    """Parameter statistics around the optimizer step."""

    name = "param"

    def __init__(self, clock: StepClock, config: ParamConfig, params: list[NamedParam]) -> None:
        super().__init__(clock, config.ops, config.eps)
        self.params = params
        self.disabled = not config.param_distribution

    def _record(self, scope: str) -> None:
        keys = [RowKey(p.vpp_stage, p.name, scope) for p in self.params]
        self.rows.extend(keys, self.stats.rows([p.param for p in self.params]))

    def before_optimizer_step(self) -> None:
        self._record("param_origin")

    def after_optimizer_step(self) -> None:
        self._record("param_updated")
