"""The PyTorch adapter: :class:`~trainprobe.engine.backend.Backend` over ``torch``.

Statistics are :class:`~trainprobe.backends.torch.stats.TensorStats`; gradients of module tensors
come from ``Tensor.register_hook``, whose handle the module probe removes at the end of the step
(a tensor that outlives the step, such as an ``nn.Parameter`` passed as a module input, would
otherwise keep every step's hook); the optimizer is seen
through :class:`~trainprobe.backends.torch.optimizer.TorchOptimizerView` (its torch
optimizers' own step hooks); ``weight_grad`` is
:class:`~trainprobe.backends.torch.weight_grad.WeightGradProbe`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.hooks import RemovableHandle

from trainprobe.backends.torch.amp_skips import watch_skipped_steps
from trainprobe.backends.torch.collectives import TORCH_COLLECTIVES, TorchCollectives
from trainprobe.backends.torch.device_copy import DeviceCopy
from trainprobe.backends.torch.dist_info import current_rank, distributed_ready, group_rank, group_ranks
from trainprobe.backends.torch.fused_stats import mode_from_env
from trainprobe.backends.torch.model_view import TorchModelView
from trainprobe.backends.torch.optimizer import TorchOptimizerView, torch_optimizer_view
from trainprobe.backends.torch.stats import TensorStats
from trainprobe.backends.torch.weight_grad import WeightGradProbe
from trainprobe.engine.backend import ParamLayouts
from trainprobe.engine.optimizer_view import OptimizerView
from trainprobe.engine.probes.model_view import ModelView, NamedParam

_comptime: Callable[[Callable[[Any], None]], Any] | None
try:
    from torch._dynamo.comptime import comptime as _comptime
except ImportError:  # pragma: no cover - a torch without dynamo
    _comptime = None

if TYPE_CHECKING:
    from trainprobe.engine.probes.base import Probe, ProbeSpec, StepClock


def read_main_grad(p: torch.Tensor) -> torch.Tensor | None:
    """``p.main_grad`` where it is a tensor (Megatron's fp32 gradient), else ``p.grad``."""
    main = getattr(p, "main_grad", None)
    return main if isinstance(main, torch.Tensor) else p.grad


def at_trace_time(note: Callable[[object], None]) -> None:
    """Run ``note`` while dynamo traces the caller, at trace time only (``comptime``: nothing
    enters the graph, no guard is added); does nothing where that API is missing."""
    if _comptime is not None:
        _comptime(note)


class TorchBackend:
    """PyTorch, eager mode, any device."""

    name = "pytorch"
    tensor_type: type = torch.Tensor

    def collective_api(self) -> TorchCollectives:
        return TORCH_COLLECTIVES

    device_copy = DeviceCopy
    is_compiling = staticmethod(torch.compiler.is_compiling)
    at_trace_time = staticmethod(at_trace_time)
    watch_skipped_steps = staticmethod(watch_skipped_steps)

    def stats(self, ops: Sequence[str], eps: float) -> TensorStats:
        mode_from_env()  # a bad TRAINPROBE_FUSED_STATS fails at start, naming the variable
        stats = TensorStats(ops, eps)
        if stats.fused is not None:
            stats.fused.prepare()  # the default's pass: loaded now, or built aside (never compiled here)
        return stats

    def records_forward(self, module: Any, record_eval_mode: bool) -> bool:
        return module.training or record_eval_mode

    def grad_recording(self) -> bool:
        return torch.is_grad_enabled()

    def wants_grad(self, t: torch.Tensor) -> bool:
        return t.requires_grad and not t.is_meta

    def hook_grad(self, t: torch.Tensor, fn: Callable[[torch.Tensor], None]) -> RemovableHandle:
        """``fn(grad)`` on each gradient of ``t`` (``fn`` returns None: the gradient is unchanged);
        the handle is for the caller to remove (:meth:`Backend.hook_grad`)."""
        return t.register_hook(fn)

    def rank(self) -> int:
        return current_rank()

    def distributed(self) -> bool:
        return distributed_ready()

    def param_layouts(self, params: Sequence[NamedParam], chunks: Sequence[Any]) -> ParamLayouts:
        from trainprobe.backends.torch.placement import param_layouts

        views = [c for c in chunks if isinstance(c, TorchOptimizerView)]
        modules = [c for c in chunks if not isinstance(c, TorchOptimizerView)]
        return param_layouts(params, modules, [o for v in views for o in v.optimizers])

    group_rank = staticmethod(group_rank)
    group_ranks = staticmethod(group_ranks)

    def grad_reader(self, main_grad: bool) -> Callable[[torch.Tensor], torch.Tensor | None] | None:
        return read_main_grad if main_grad else None

    def model_view(self, model: Any, where: str = "start(model=...)", *, stage_prefix: bool | None = None) -> ModelView:
        return TorchModelView(model, where, stage_prefix=stage_prefix)

    def optimizer_view(self, optimizer: Any, where: str = "start(optimizer=...)") -> TorchOptimizerView:
        return torch_optimizer_view(optimizer, where)

    def weight_grad_probe(
        self,
        clock: StepClock,
        spec: ProbeSpec,
        params: list[NamedParam],
        micro_batches: int,
        view: ModelView,
        *,
        per_micro_batch: bool = False,
        optimizer: OptimizerView | None = None,
        grad_of: Callable[[Any], Any] | None = None,
        keep_reduced: Callable[[NamedParam], bool] | None = None,
    ) -> Probe:
        modules = [(name, module) for _, name, module in view.modules()]
        return WeightGradProbe(
            clock,
            spec,
            params,
            micro_batches,
            modules,
            per_micro_batch=per_micro_batch,
            grad_of=grad_of,
            keep_reduced=keep_reduced,
            backend=self,
        )


TORCH = TorchBackend()
"""The PyTorch adapter (stateless; shared)."""
