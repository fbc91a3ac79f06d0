"""``param`` monitor: parameters just before (``param_origin``) and just after
(``param_updated``) ``optimizer.step()``. ``module_name`` is the parameter's name.
``param_distribution: false`` switches it off.

In a single-process run, a parameter that has not changed since the last ``param_updated``
row (same tensor, same version counter) reuses those statistics as its ``param_origin`` row
(where the backend can tell: its ``unchanged_cache()``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainprobe.config.monitor_v2 import ParamConfig
from trainprobe.probes.base import Probe, StepClock
from trainprobe.probes.model_view import NamedParam
from trainprobe.records import RowKey

if TYPE_CHECKING:
    from trainprobe.adapters import Backend


class ParamProbe(Probe):
    """Parameter statistics around the optimizer step."""

    name = "param"

    def __init__(
        self, clock: StepClock, config: ParamConfig, params: list[NamedParam], *, backend: Backend | None = None
    ) -> None:
        super().__init__(clock, config.ops, config.eps, backend=backend)
        self.params = params
        self.disabled = not config.param_distribution
        self._cache = self.backend.unchanged_cache()
        self._keys: dict[str, list[RowKey]] = {}

    def _record(self, scope: str) -> None:
        cache = self._cache if scope == "param_origin" else None
        values: list = [cache.get(i, p.param) if cache is not None else None for i, p in enumerate(self.params)]
        missing = [i for i, v in enumerate(values) if v is None]
        for i, found in zip(missing, self.stats.rows([self.params[i].param for i in missing])):
            values[i] = found
            if self._cache is not None and scope == "param_updated":
                self._cache.put(i, self.params[i].param, found)
        keys = self._keys.get(scope)
        if keys is None:
            keys = self._keys[scope] = [RowKey(p.vpp_stage, p.name, scope) for p in self.params]
        self.rows.extend(keys, values)

    def before_optimizer_step(self) -> None:
        self._record("param_origin")

    def after_optimizer_step(self) -> None:
        self._record("param_updated")
