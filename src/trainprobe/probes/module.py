"""``module`` monitor: statistics of module inputs/outputs and of their gradients.

Rows (``module_<a>-<b>.csv``): ``module_name`` is ``<module>.<input|output>.<i>`` with scope
``forward`` and ``<module>.<grad_input|grad_output>.<i>`` with scope ``backward``; ``i`` counts
the tensors of the call (positional arguments, then keyword arguments, nested tuples/lists
flattened). ``micro_step`` is the index of the forward pass of the model chunk within the step.

Gradients are read with tensor hooks (``Tensor.register_hook``), never with module full backward
hooks, so the autograd graph is left exactly as it was and training stays bitwise identical.
``grad_output.i`` is the gradient of output ``i``; ``grad_input.i`` is the gradient of input ``i``
as autograd accumulates it for that tensor (it includes other uses of the same tensor, such as
a residual connection). Modules in eval mode are skipped unless ``record_eval_mode`` is true.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from trainprobe.config.monitor_v2 import ModuleMonitorConfig
from trainprobe.probes.base import Probe, StepClock
from trainprobe.probes.model_view import ModelView
from trainprobe.probes.tensor_walk import call_tensors, tensors_in
from trainprobe.records import RowKey

if TYPE_CHECKING:
    from trainprobe.adapters import Backend

Picked = list[tuple[str, Any]]
"""``(row name, tensor)`` pairs chosen from a call's tensors."""


class ModuleNaming(Protocol):
    """Which modules are hooked and how their tensors are chosen and named (one per dialect)."""

    forward_scope: str
    backward_scope: str

    def wants(self, vpp_stage: int, name: str, module: Any) -> bool:
        """Whether module ``name`` is hooked."""
        ...

    def forward(self, name: str, kind: str, tensors: list[Any]) -> Picked:
        """Forward rows of ``kind`` (``input``/``output``) of module ``name``."""
        ...

    def backward(self, name: str, kind: str, tensors: list[Any]) -> Picked:
        """Tensors whose gradient is recorded, with the gradient rows' names."""
        ...


@dataclass(frozen=True, slots=True)
class V2Naming:
    """Monitor V2: modules whose name contains a target; ``<module>.<kind>.<i>`` forward rows and
    ``<module>.grad_<kind>.<i>`` backward rows for every tensor of the call."""

    targets: tuple[str, ...]
    forward_scope: str = "forward"
    backward_scope: str = "backward"

    def wants(self, vpp_stage: int, name: str, module: Any) -> bool:
        return not self.targets or any(t in name for t in self.targets)

    def forward(self, name: str, kind: str, tensors: list[Any]) -> Picked:
        return [(f"{name}.{kind}.{i}", t) for i, t in enumerate(tensors)]

    def backward(self, name: str, kind: str, tensors: list[Any]) -> Picked:
        return [(f"{name}.grad_{kind}.{i}", t) for i, t in enumerate(tensors)]


class ModuleProbe(Probe):
    """Forward/backward statistics of the target modules.

    ``naming`` (default :class:`V2Naming` over ``config.targets``) picks the modules, the tensors
    and the row names and scopes. ``backend`` is the framework adapter (PyTorch by default):
    modules need PyTorch's ``register_forward_pre_hook(hook, prepend=, with_kwargs=)`` and
    ``register_forward_hook(hook, with_kwargs=)``, which MindSpore's ``Cell`` has too; gradient
    hooks the backend returns a handle for are removed at the end of the step.
    """

    name = "module"
    with_micro_step = True

    def __init__(
        self,
        clock: StepClock,
        config: ModuleMonitorConfig,
        view: ModelView,
        naming: ModuleNaming | None = None,
        *,
        backend: Backend | None = None,
    ) -> None:
        super().__init__(clock, config.ops, config.eps, backend=backend)
        self.config = config
        self.view = view
        self.naming: ModuleNaming = naming if naming is not None else V2Naming(config.targets)
        self._micro = [0] * len(view.chunks)
        self._tensor_type = self.backend.tensor_type
        self._step_handles: list[Any] = []

    def targets(self) -> list[tuple[int, str, Any]]:
        """The hooked modules, in model order."""
        return [(v, n, m) for v, n, m in self.view.modules() if self.naming.wants(v, n, m)]

    def attach(self) -> None:
        for vpp, chunk in enumerate(self.view.chunks):
            self.keep(chunk.register_forward_pre_hook(self.guard(self._counter(vpp)), prepend=True))
        for vpp, name, module in self.targets():
            self.keep(module.register_forward_pre_hook(self.guard(self._pre_hook(vpp, name)), with_kwargs=True))
            self.keep(module.register_forward_hook(self.guard(self._post_hook(vpp, name)), with_kwargs=True))

    def end_step(self) -> None:
        self._micro = [0] * len(self._micro)
        self._drop_step_handles()

    def detach(self) -> None:
        super().detach()
        self._drop_step_handles()

    def _drop_step_handles(self) -> None:
        handles, self._step_handles = self._step_handles, []
        for handle in handles:
            handle.remove()

    def _records(self, module: Any) -> bool:
        return self.active and self.backend.records_forward(module, self.config.record_eval_mode)

    def _counter(self, vpp: int) -> Any:
        def count(module: Any, args: tuple[Any, ...]) -> None:
            if self._records(module):
                self._micro[vpp] += 1

        return count

    def _pre_hook(self, vpp: int, name: str) -> Any:
        def pre(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self._records(module):
                self._record(vpp, name, "input", call_tensors(args, kwargs, self._tensor_type))
            return None

        return pre

    def _post_hook(self, vpp: int, name: str) -> Any:
        def post(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if self._records(module):
                self._record(vpp, name, "output", list(tensors_in(output, 0, self._tensor_type)))
            return None

        return post

    def _record(self, vpp: int, name: str, kind: str, tensors: list[Any]) -> None:
        micro = max(self._micro[vpp] - 1, 0)
        naming = self.naming
        picked = naming.forward(name, kind, tensors)
        if picked:
            keys = [RowKey(vpp, row, naming.forward_scope, micro) for row, _ in picked]
            self.rows.extend(keys, self.stats.rows([t for _, t in picked]))
        backend = self.backend
        if not backend.grad_recording():
            return
        for row, t in naming.backward(name, kind, tensors):
            if backend.wants_grad(t):
                key = RowKey(vpp, row, naming.backward_scope, micro)
                handle = backend.hook_grad(t, self.guard(self._grad_hook(key)))
                if handle is not None:
                    self._step_handles.append(handle)

    def _grad_hook(self, key: RowKey) -> Any:
        def on_grad(grad: Any) -> None:
            if not self.disabled and grad is not None:
                self.rows.add(key, self.stats.row(grad))

        return on_grad
