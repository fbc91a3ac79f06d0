"""What ``set_monitor`` attaches Monitor V1 to: the model chunks, the optimizer, the parallel
groups, and the run folder; validated once and shared by every session of the run.

* ``model``: a module or a list of chunks (chunk ``i`` is ``vpp_stage`` i; names always carry
  the ``<vpp_stage>:`` prefix, also for a single model).
* ``optimizer``: seen through the backend's one
  :class:`~trainprobe.engine.optimizer_view.OptimizerView` (for PyTorch
  :func:`~trainprobe.backends.torch.optimizer.torch_optimizer_view`: wrappers, chains, and a
  mixed-precision wrapper's float32 master copies seen as the model's parameters).
* ``params_have_main_grad``: gradients are read from ``param.main_grad`` where it is a tensor
  (Megatron), else from ``.grad``.
* ``dp_group``: only the first rank of the data-parallel group keeps reduced-gradient rows;
  ``tp_group``: on the other ranks of the tensor-parallel group only parameters marked
  ``tensor_model_parallel`` keep them (the others are copies).
* ``process_group`` (of ``TrainerMon``): the pipeline group, giving anomalies their ``pp_stage``
  and ``group_mates``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainprobe.backends.torch.backend import TORCH
from trainprobe.backends.torch.dist_info import current_rank, distributed_ready
from trainprobe.backends.torch.model_view import TorchModelView
from trainprobe.engine.backend import Backend
from trainprobe.engine.errors import ConfigError
from trainprobe.engine.folders import make_output_folder
from trainprobe.engine.optimizer_view import OptimizerView, StepHooks
from trainprobe.engine.probes.base import StepClock
from trainprobe.engine.probes.model_view import ModelView, NamedParam
from trainprobe.frontdoors.monitor_v1 import output
from trainprobe.frontdoors.monitor_v1.alerts import PipelineContext
from trainprobe.frontdoors.monitor_v1.config import MonitorV1Config

GradOf = Callable[[torch.Tensor], torch.Tensor | None]
KeepReduced = Callable[[NamedParam], bool]


@dataclass(slots=True)
class Attachment:
    """The run's model, optimizer, step clock, rank and parallel context."""

    clock: StepClock
    view: ModelView
    optimizers: list[StepHooks]
    """The optimizers that step, in step order (the first one's pre-step and the last one's
    post-step hooks are the step's)."""
    optimizer: OptimizerView
    rank: int
    grad_of: GradOf | None
    keep_reduced: KeepReduced | None
    pipeline: PipelineContext
    folder: Path | None = None
    backend: Backend = TORCH

    def run_folder(self, config: MonitorV1Config) -> Path:
        """This rank's output folder, created (or found, with ``append_output``; a rank with no
        folder in that range starts a new one) on first use."""
        if self.folder is None:
            make_output_folder(output.output_root(), output.OUTPUT_ENV)
            try:
                self.folder = output.run_folder(self.rank, config.append_output)
            except OSError as exc:
                raise ConfigError(
                    f"{output.OUTPUT_ENV}: cannot create this rank's folder under {str(output.output_root())!r}: {exc}"
                ) from None
        return self.folder


def attach(
    model: nn.Module | list[nn.Module],
    grad_acc_steps: int,
    optimizer: Any,
    *,
    dp_group: Any,
    tp_group: Any,
    start_iteration: int,
    params_have_main_grad: bool,
    process_group: Any,
) -> Attachment:
    """Validate ``set_monitor``'s arguments and resolve them.

    Raises:
        ConfigError: no optimizer, ``grad_acc_steps`` < 1, ``start_iteration`` < 0, a model that
            is not a module or a list of modules, a group without torch.distributed.
    """
    check_arguments(optimizer, grad_acc_steps, start_iteration)
    chunks = [model] if isinstance(model, nn.Module) else model
    view = TorchModelView(  # V1 names always carry the "<vpp_stage>:" prefix
        list(chunks) if isinstance(chunks, (list, tuple)) else chunks, "set_monitor(model=...)", stage_prefix=True
    )
    opt = TORCH.optimizer_view(optimizer, "set_monitor(optimizer=...)")
    rank = current_rank()
    return Attachment(
        clock=StepClock(step=start_iteration, micro_batches=grad_acc_steps),
        view=view,
        optimizers=list(opt.optimizers),
        optimizer=opt,
        rank=rank,
        grad_of=main_grad if params_have_main_grad else None,
        keep_reduced=redundancy_filter(dp_group, tp_group),
        pipeline=pipeline_context(rank, process_group),
    )


def check_arguments(optimizer: Any, grad_acc_steps: int, start_iteration: int) -> None:
    """The framework-neutral checks of ``set_monitor``'s arguments.

    Raises:
        ConfigError: no optimizer, ``grad_acc_steps`` < 1, ``start_iteration`` < 0.
    """
    if optimizer is None:
        raise ConfigError("set_monitor(optimizer=...): the optimizer is required")
    for where, value, minimum in (("grad_acc_steps", grad_acc_steps, 1), ("start_iteration", start_iteration, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"set_monitor({where}=...): must be an integer >= {minimum}, got {value!r}")


def main_grad(p: torch.Tensor) -> torch.Tensor | None:
    """``p.main_grad`` where it is a tensor (Megatron's fp32 gradient), else ``p.grad``."""
    main = getattr(p, "main_grad", None)
    return main if isinstance(main, torch.Tensor) else p.grad


def _group_rank(group: Any, where: str) -> int:
    if not distributed_ready():
        raise ConfigError(f"set_monitor({where}=...): needs torch.distributed to be initialised")
    return dist.get_rank(group)


def redundancy_filter(
    dp_group: Any, tp_group: Any, group_rank: Callable[[Any, str], int] = _group_rank
) -> KeepReduced | None:
    """Which parameters keep their reduced-gradient rows on this rank (None: all of them): only
    the first rank of a data-parallel group writes them; on the other ranks of a tensor-parallel
    group, only parameters marked ``tensor_model_parallel``. ``group_rank(group, argument)`` is
    this rank in ``group`` (torch.distributed by default).

    Raises:
        ConfigError: a group is given but torch.distributed is not initialised.
    """
    dp_first = dp_group is None or group_rank(dp_group, "dp_group") == 0
    tp_first = tp_group is None or group_rank(tp_group, "tp_group") == 0
    if dp_first and tp_first:
        return None
    if not dp_first:
        return lambda named: False
    return lambda named: bool(getattr(named.param, "tensor_model_parallel", False))


def pipeline_context(rank: int, group: Any) -> PipelineContext:
    """``rank``'s stage in the pipeline ``group`` and the group's ranks (stage 0 and only this
    rank without a group or without torch.distributed)."""
    if group is None or not distributed_ready():
        return PipelineContext(rank=rank, pp_stage=0, group_mates=(rank,))
    ranks = tuple(dist.get_process_group_ranks(group))
    return PipelineContext(rank=rank, pp_stage=ranks.index(rank) if rank in ranks else 0, group_mates=ranks)
