"""``optimizer`` monitor: Adam-family moments, read just after ``optimizer.step()``.

Rows: ``module_name`` = ``<param>.exp_avg`` / ``<param>.exp_avg_sq`` with scope ``exp_avg`` /
``exp_avg_sq`` (with ``suffix_names=False``, as Monitor V1 writes them, just ``<param>``, the
scope telling the moments apart). Any optimizer whose per-parameter state holds ``exp_avg``/``exp_avg_sq`` tensors
is supported (Adam, AdamW, NAdam, RAdam, and most fused or third-party Adam variants). For any
other optimizer (plain SGD included, which keeps no state at all) the monitor logs one warning
naming the optimizer's class and switches itself off. ``mv_distribution: false`` also switches
it off. The moments are found by the backend (``optimizer_moments``; MindSpore's Adam-family
moments are renamed ``exp_avg``/``exp_avg_sq``).

Whether an optimizer is supported is decided from the optimizer, never from the monitored
parameters: a parameter that has no state yet (a layer not used so far, an expert that received
no token) simply gives no row on that step, and its rows appear once the optimizer keeps its
moments. See :func:`keeps_state` for the decision, which :mod:`trainprobe.monitor_v1.features`
shares.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

import torch

from trainprobe.config.monitor_v2 import OptimizerConfig
from trainprobe.log import warn_once
from trainprobe.probes.base import Probe, StepClock
from trainprobe.probes.model_view import NamedParam
from trainprobe.records import RowKey

if TYPE_CHECKING:
    from trainprobe.adapters import Backend

MOMENTS = ("exp_avg", "exp_avg_sq")

_TORCH_STATE_KEYS: dict[str, frozenset[str]] = {
    "Adam": frozenset({"step", "exp_avg", "exp_avg_sq"}),
    "AdamW": frozenset({"step", "exp_avg", "exp_avg_sq"}),
    "NAdam": frozenset({"step", "exp_avg", "exp_avg_sq", "mu_product"}),
    "RAdam": frozenset({"step", "exp_avg", "exp_avg_sq"}),
    "SparseAdam": frozenset({"step", "exp_avg", "exp_avg_sq"}),
    "Adamax": frozenset({"step", "exp_avg", "exp_inf"}),
    "SGD": frozenset({"momentum_buffer"}),
    "Adagrad": frozenset({"step", "sum"}),
    "Adadelta": frozenset({"step", "square_avg", "acc_delta"}),
    "ASGD": frozenset({"step", "eta", "mu", "ax"}),
    "RMSprop": frozenset({"step", "square_avg", "momentum_buffer", "grad_avg"}),
    "Rprop": frozenset({"step", "prev", "step_size"}),
    "LBFGS": frozenset({"func_evals", "n_iter", "d", "t", "old_dirs", "old_stps", "ro", "H_diag"}),
    "Adafactor": frozenset({"step", "row_var", "col_var", "variance"}),
}
"""Per-parameter state keys that ``torch.optim``'s own optimizers can keep, by class name."""

TORCH_STATE_KEYS: dict[type, frozenset[str]] = {
    cls: keys for name, keys in _TORCH_STATE_KEYS.items() if isinstance(cls := getattr(torch.optim, name, None), type)
}
"""The state keys of ``torch.optim`` classes present in this PyTorch (for optimizers that have
taken no step yet; subclasses are matched through their base classes)."""


def optimizer_class_name(optimizer: Any) -> str:
    """The class name of ``optimizer`` for messages: the adapters' ``class_name`` (MindSpore),
    the classes of a chain's optimizers (``.optimizers``), or the class itself."""
    inner = getattr(optimizer, "optimizers", None)
    if isinstance(inner, (list, tuple)) and inner:
        return "/".join(dict.fromkeys(optimizer_class_name(o) for o in inner))
    return str(getattr(optimizer, "class_name", type(optimizer).__name__))


def keeps_state(optimizer: Any, needs: Collection[str], *, every: bool = True, stepped: bool = False) -> bool | None:
    """Whether ``optimizer`` keeps the per-parameter state ``needs`` (all of the keys, or with
    ``every=False`` any one of them), decided from the optimizer as a whole, never from which
    parameters happen to have state yet.

    * A chain (an object with ``.optimizers``, Monitor V1's :class:`OptimizerGroup`): True when
      one of its optimizers does, False when none does, None otherwise.
    * MindSpore (an adapter wrapper with ``moments()`` and no ``state``): its moment tuples.
    * A PyTorch optimizer (``state``): its non-empty state entries, for any of its parameters,
      are authoritative: True when one holds the keys, False when none does (state of another
      kind, such as SGD's ``momentum_buffer``). With no state yet: the keys its ``torch.optim``
      class (or base class) keeps; for other classes False once it has ``stepped`` while one of
      its parameters had a gradient (an optimizer that keeps no per-parameter state at all),
      else None.

    Args:
        optimizer: the (unwrapped) optimizer the probes read.
        needs: the state keys the caller reads (``exp_avg``, ...).
        every: whether all of ``needs`` are required (else any one).
        stepped: whether the optimizer has just taken a step (called after ``step()``).

    Returns:
        True (supported: parameters without state yet are skipped), False (never supported:
        warn and switch off) or None (cannot tell yet: ask again at the next step).
    """
    chain = getattr(optimizer, "optimizers", None)
    if isinstance(chain, (list, tuple)) and chain:
        verdicts = [keeps_state(o, needs, every=every, stepped=stepped) for o in chain]
        if any(v is True for v in verdicts):
            return True
        return False if all(v is False for v in verdicts) else None

    def holds(keys: Collection[str]) -> bool:
        return (all if every else any)(k in keys for k in needs)

    state = getattr(optimizer, "state", None)
    if not isinstance(state, Mapping):
        moments = getattr(optimizer, "moments", None)
        if callable(moments):
            found = moments()
            return holds(found.keys() if isinstance(found, Mapping) else ())
        return None
    seen = False
    for entry in state.values():
        if isinstance(entry, Mapping) and entry:
            seen = True
            if holds([k for k, v in entry.items() if v is not None]):
                return True
    if seen:
        return False
    for cls in type(optimizer).__mro__:
        keys = TORCH_STATE_KEYS.get(cls)
        if keys is not None:
            return holds(keys)
    if stepped and any(
        getattr(p, "grad", None) is not None for g in getattr(optimizer, "param_groups", ()) for p in g["params"]
    ):
        return False
    return None


class OptimizerStateProbe(Probe):
    """Statistics of the optimizer's first and second moments.

    The optimizer is judged once (see :func:`keeps_state`): with an optimizer that keeps no
    ``exp_avg``/``exp_avg_sq`` the probe logs one warning naming its class and switches off;
    with an Adam-family one, a parameter without moments yet gives no row on that step.
    """

    name = "optimizer"

    def __init__(
        self,
        clock: StepClock,
        config: OptimizerConfig,
        optimizer: Any,
        params: list[NamedParam],
        *,
        suffix_names: bool = True,
        backend: Backend,
    ) -> None:
        super().__init__(clock, config.ops, config.eps, backend=backend)
        self.suffix_names = suffix_names
        self.optimizer = optimizer
        self.params = params
        self.disabled = not config.mv_distribution
        self._keys: dict[tuple[int, str], RowKey] = {}  # (id of the NamedParam, moment) -> its row key
        self._supported: bool | None = None  # the optimizer's verdict, once known

    def after_optimizer_step(self) -> None:
        if not self._optimizer_supported():
            return
        keys: list[RowKey] = []
        tensors: list[Any] = []
        found, _ = self.backend.optimizer_moments(self.optimizer, self.params)
        known = self._keys
        for named, moment, value in found:
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
            self._supported = keeps_state(self.optimizer, MOMENTS, every=False, stepped=True)
            if self._supported is False:
                self.disabled = True
                kind = optimizer_class_name(self.optimizer)
                warn_once(
                    f"optimizer-unsupported-{kind}",
                    f"trainprobe optimizer monitor: {kind} keeps no exp_avg/exp_avg_sq "
                    "state (only Adam-family optimizers do); the optimizer monitor is skipped",
                )
        return bool(self._supported)
