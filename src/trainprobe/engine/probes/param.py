"""``param`` monitor: parameters just before (``param_origin``) and just after
(``param_updated``) ``optimizer.step()``. ``module_name`` is the parameter's name.
``param_distribution: false`` switches it off.

Both scopes are computed from the parameters as they are at that moment: ``param_origin`` is
never taken from the previous step's ``param_updated``, because writes through ``.data`` (weight
clipping, loading weights) change a parameter without bumping autograd's version counter.

A parameter with no element on this rank when the first rows are taken (an FSDP1 parameter, with
``use_orig_params=True``, outside the rank's flat shard: ``numel`` 0 in ``tensor_layout.json``)
has no rows, as it has no gradient and no optimizer state to give ``weight_grad`` and
``optimizer`` rows: an empty tensor's min/max/mean are NaN, which would read as a NaN of the
parameter."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainprobe.engine.probes.base import Probe, ProbeSpec, StepClock
from trainprobe.engine.probes.model_view import NamedParam
from trainprobe.engine.records import RowKey

if TYPE_CHECKING:
    from trainprobe.engine.backend import Backend


class ParamProbe(Probe):
    """Parameter statistics around the optimizer step."""

    name = "param"

    def __init__(
        self, clock: StepClock, spec: ProbeSpec, params: list[NamedParam], *, enabled: bool = True, backend: Backend
    ) -> None:
        """``enabled=False`` (``param_distribution: false``): built switched off."""
        super().__init__(clock, spec, backend=backend)
        self.params = params
        self.disabled = not enabled
        self._keys: dict[str, list[RowKey]] = {}
        self._tensors = [p.param for p in params]
        self._held: list[int] | None = None  # indices of the parameters with elements (first record)

    def _record(self, scope: str) -> None:
        if self._held is None:
            self._held = [i for i, t in enumerate(self._tensors) if _has_elements(t)]
            self._tensors = [self._tensors[i] for i in self._held]
        keys = self._keys.get(scope)
        if keys is None:
            keys = self._keys[scope] = [RowKey(self.params[i].vpp_stage, self.params[i].name, scope) for i in self._held]
        tensors, stepping = self._tensors, self.clock.stepping
        if stepping is not None:  # one of several optimizers steps: its parameters only
            kept = [i for i, t in enumerate(tensors) if id(t) in stepping]
            keys, tensors = [keys[i] for i in kept], [tensors[i] for i in kept]
        self.rows.extend(keys, self.stats.rows(tensors))

    def before_optimizer_step(self) -> None:
        self._record("param_origin")

    def after_optimizer_step(self) -> None:
        self._record("param_updated")


def _has_elements(t: object) -> bool:
    """Whether ``t`` holds an element (a tensor without ``numel()`` is taken to)."""
    numel = getattr(t, "numel", None)
    return not callable(numel) or int(numel()) > 0
