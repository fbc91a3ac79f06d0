"""``optimizer`` monitor: Adam-family moments, read just after ``optimizer.step()``.

Rows: ``module_name`` = ``<param>.exp_avg`` / ``<param>.exp_avg_sq`` with scope ``exp_avg`` /
``exp_avg_sq`` (with ``suffix_names=False``, as Monitor V1 writes them, just ``<param>``, the
scope telling the moments apart). Any optimizer whose per-parameter state holds ``exp_avg``/``exp_avg_sq`` tensors
is supported (Adam, AdamW, NAdam, RAdam, and most fused or third-party Adam variants). For any
other optimizer (plain SGD included, which keeps no state at all) the monitor logs one warning
naming the optimizer's class and switches itself off. ``mv_distribution: false`` also switches
it off. The moments are read through the optimizer's
:class:`~trainprobe.engine.optimizer_view.OptimizerView` (``moments_of``; MindSpore's Adam-family
moments are renamed ``exp_avg``/``exp_avg_sq``).

Whether an optimizer is supported is decided from the optimizer, never from the monitored
parameters: a parameter that has no state yet (a layer not used so far, an expert that received
no token) simply gives no row on that step, and its rows appear once the optimizer keeps its
moments. The decision is the view's ``keeps_state``, which :mod:`trainprobe.frontdoors.monitor_v1.features`
shares.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainprobe.engine.log import warn_once
from trainprobe.engine.optimizer_view import MOMENTS, OptimizerView
from trainprobe.engine.probes.base import Probe, ProbeSpec, StepClock
from trainprobe.engine.probes.model_view import NamedParam
from trainprobe.engine.records import RowKey

if TYPE_CHECKING:
    from trainprobe.engine.backend import Backend

__all__ = ["MOMENTS", "OptimizerStateProbe"]


class OptimizerStateProbe(Probe):
    """Statistics of the optimizer's first and second moments.

    The optimizer is judged once (its view's ``keeps_state``): with an optimizer that keeps no
    ``exp_avg``/``exp_avg_sq`` the probe logs one warning naming its class and switches off;
    with an Adam-family one, a parameter without moments yet gives no row on that step.
    """

    name = "optimizer"

    def __init__(
        self,
        clock: StepClock,
        spec: ProbeSpec,
        optimizer: OptimizerView,
        params: list[NamedParam],
        *,
        suffix_names: bool = True,
        enabled: bool = True,
        backend: Backend,
    ) -> None:
        """``enabled=False`` (``mv_distribution: false``): built switched off."""
        super().__init__(clock, spec, backend=backend)
        self.suffix_names = suffix_names
        self.optimizer = optimizer
        self.params = params
        self.disabled = not enabled
        self._keys: dict[tuple[int, str], RowKey] = {}  # (id of the NamedParam, moment) -> its row key
        self._supported: bool | None = None  # the optimizer's verdict, once known

    def after_optimizer_step(self) -> None:
        if not self._optimizer_supported():
            return
        keys: list[RowKey] = []
        tensors: list[Any] = []
        known, stepping = self._keys, self.clock.stepping
        for named in self.params:
            if stepping is not None and id(named.param) not in stepping:
                continue  # one of several optimizers steps: its parameters only
            for moment, value in self.optimizer.moments_of(named.param).items():
                key = known.get((id(named), moment))
                if key is None:
                    row = f"{named.name}.{moment}" if self.suffix_names else named.name
                    key = known[(id(named), moment)] = RowKey(named.vpp_stage, row, moment)
                keys.append(key)
                tensors.append(value)
        if keys:
            self.rows.extend(keys, self.stats.rows(tensors))

    def _optimizer_supported(self) -> bool:
        """Whether the optimizer keeps Adam-family moments; on the first step that shows it
        does not, warn once (naming its class) and switch the probe off."""
        if self._supported is None:
            self._supported = self.optimizer.keeps_state(MOMENTS, every=False, stepped=True)
            if self._supported is False:
                self.disabled = True
                kind = self.optimizer.class_name
                warn_once(
                    f"optimizer-unsupported-{kind}",
                    f"trainprobe optimizer monitor: {kind} keeps no exp_avg/exp_avg_sq "
                    "state (only Adam-family optimizers do); the optimizer monitor is skipped",
                )
        return bool(self._supported)
