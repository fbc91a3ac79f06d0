"""The PyTorch adapter: :class:`~trainprobe.adapters.Backend` over ``torch``.

Statistics are :class:`~trainprobe.stats.torch_stats.TensorStats`; gradients of module tensors
come from ``Tensor.register_hook`` (the hook lives and dies with the tensor); the optimizer is a
``torch.optim.Optimizer`` with its own step hooks; ``weight_grad`` is
:class:`~trainprobe.probes.weight_grad.WeightGradProbe`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from trainprobe.adapters.pytorch_collectives import TORCH_COLLECTIVES, TorchCollectives
from trainprobe.dist_info import current_rank, distributed_ready
from trainprobe.probes.model_view import ModelView, NamedParam, unwrap_optimizer
from trainprobe.probes.optimizer_state import MOMENTS
from trainprobe.probes.weight_grad import WeightGradProbe
from trainprobe.stats.fused import mode_from_env
from trainprobe.stats.torch_stats import TensorStats

if TYPE_CHECKING:
    from trainprobe.config.monitor_v2 import WeightGradConfig
    from trainprobe.probes.base import Probe, StepClock


class TorchBackend:
    """PyTorch, eager mode, any device."""

    name = "pytorch"
    tensor_type: type = torch.Tensor

    def collective_api(self) -> TorchCollectives:
        return TORCH_COLLECTIVES

    def stats(self, ops: Sequence[str], eps: float) -> TensorStats:
        mode_from_env()  # a bad TRAINPROBE_FUSED_STATS fails at start, naming the variable
        return TensorStats(ops, eps)

    def records_forward(self, module: Any, record_eval_mode: bool) -> bool:
        return module.training or record_eval_mode

    def grad_recording(self) -> bool:
        return torch.is_grad_enabled()

    def wants_grad(self, t: torch.Tensor) -> bool:
        return t.requires_grad

    def hook_grad(self, t: torch.Tensor, fn: Callable[[torch.Tensor], None]) -> None:
        t.register_hook(fn)  # returns None: the gradient is unchanged
        return None

    def optimizer_moments(
        self, optimizer: torch.optim.Optimizer, params: Sequence[NamedParam]
    ) -> tuple[list[tuple[NamedParam, str, Any]], bool]:
        state = optimizer.state
        found: list[tuple[NamedParam, str, Any]] = []
        for named in params:
            entry = state.get(named.param)
            if not entry:
                continue
            for moment in MOMENTS:
                value = entry.get(moment)
                if isinstance(value, torch.Tensor):
                    found.append((named, moment, value))
        return found, bool(state)

    def rank(self) -> int:
        return current_rank()

    def distributed(self) -> bool:
        return distributed_ready()

    def model_view(self, model: Any) -> ModelView:
        return ModelView(model)

    def unwrap_optimizer(self, optimizer: Any) -> torch.optim.Optimizer:
        return unwrap_optimizer(optimizer)

    def weight_grad_probe(
        self,
        clock: StepClock,
        config: WeightGradConfig,
        params: list[NamedParam],
        micro_batches: int,
        view: ModelView,
        *,
        optimizer: Any = None,
        grad_of: Callable[[Any], Any] | None = None,
        keep_reduced: Callable[[NamedParam], bool] | None = None,
    ) -> Probe:
        modules = [(name, module) for _, name, module in view.modules()]
        return WeightGradProbe(
            clock,
            config,
            params,
            micro_batches,
            modules,
            grad_of=grad_of,
            keep_reduced=keep_reduced,
            backend=self,
        )


TORCH = TorchBackend()
"""The PyTorch adapter (stateless; shared)."""
