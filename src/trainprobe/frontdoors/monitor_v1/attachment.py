"""What ``set_monitor`` attaches Monitor V1 to: the model chunks, the optimizer, the parallel
groups, and the run folder; validated once and shared by every session of the run.
Everything framework-specific comes from the run's :class:`~trainprobe.engine.backend.Backend`
(``TrainerMon(framework=...)``; ``trainprobe.mindspore.TrainerMon`` picks MindSpore).

* ``model``: a module or a list of chunks (chunk ``i`` is ``vpp_stage`` i; names always carry
  the ``<vpp_stage>:`` prefix, also for a single model).
* ``optimizer``: seen through the backend's one
  :class:`~trainprobe.engine.optimizer_view.OptimizerView` (for PyTorch
  :func:`~trainprobe.backends.torch.optimizer.torch_optimizer_view`: wrappers, chains, and a
  mixed-precision wrapper's float32 master copies seen as the model's parameters).
* ``params_have_main_grad``: gradients are read from ``param.main_grad`` where it is a tensor
  (Megatron), else from ``.grad`` (``Backend.grad_reader``; PyTorch only).
* ``dp_group``: only the first rank of the data-parallel group keeps reduced-gradient rows;
  ``tp_group``: on the other ranks of the tensor-parallel group only the parameters whose piece
  there is another than on the first rank keep them, decided by placement on PyTorch
  (:mod:`~trainprobe.frontdoors.monitor_v1.tp_filter`: DTensor shards along the group's mesh
  dimension and parameters marked ``tensor_model_parallel``; replicas are written once), by
  ``tensor_model_parallel`` alone on other backends.
* ``process_group`` (of ``TrainerMon``): the pipeline group, giving anomalies their ``pp_stage``
  and ``group_mates``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainprobe.engine.backend import Backend
from trainprobe.engine.errors import ConfigError
from trainprobe.engine.folder_lock import FolderLock
from trainprobe.engine.folders import make_output_folder
from trainprobe.engine.optimizer_view import OptimizerView, warn_unstepped
from trainprobe.engine.probes.base import StepClock
from trainprobe.engine.probes.model_view import ModelView, NamedParam
from trainprobe.frontdoors.monitor_v1 import output
from trainprobe.frontdoors.monitor_v1.alerts import PipelineContext
from trainprobe.frontdoors.monitor_v1.config import MonitorV1Config

GradOf = Callable[[Any], Any]
KeepReduced = Callable[[NamedParam], bool]


@dataclass(slots=True)
class Attachment:
    """The run's backend, model, optimizer, step clock, rank and parallel context."""

    backend: Backend
    clock: StepClock
    view: ModelView
    optimizer: OptimizerView
    """The optimizer that steps (a chain seen as one: its step pre-hook is the first member's,
    its post-hook the last one's)."""
    rank: int
    grad_of: GradOf | None
    keep_reduced: KeepReduced | None
    pipeline: PipelineContext
    folder: Path | None = None
    lock: FolderLock | None = None
    """The run folder's lock, from its first use to :meth:`release` (``TrainerMon.stop()``)."""

    def run_folder(self, config: MonitorV1Config) -> Path:
        """This rank's output folder, created (or found, with ``append_output``; a rank with no
        folder in that range starts a new one) on first use, and locked for this run
        (:mod:`~trainprobe.engine.folder_lock`) until :meth:`release`.

        Raises:
            ConfigError: the folder cannot be created (naming ``MONITOR_OUTPUT_DIR``); another
                run that is still going writes it (``append_output`` naming a live run's folder).
        """
        if self.folder is None:
            make_output_folder(output.output_root(), output.OUTPUT_ENV)
            try:
                folder = output.run_folder(self.rank, config.append_output)
            except OSError as exc:
                raise ConfigError(
                    f"{output.OUTPUT_ENV}: cannot create this rank's folder under {str(output.output_root())!r}: {exc}"
                ) from None
            self.lock = FolderLock(folder, output.OUTPUT_ENV)
            self.folder = folder
        return self.folder

    def release(self) -> None:
        """Drop the run folder's lock (idempotent); the folder stays this run's."""
        lock, self.lock = self.lock, None
        if lock is not None:
            lock.release()


def attach(
    backend: Backend,
    model: Any,
    grad_acc_steps: int,
    optimizer: Any,
    *,
    dp_group: Any,
    tp_group: Any,
    start_iteration: int,
    params_have_main_grad: bool,
    process_group: Any,
) -> Attachment:
    """Validate ``set_monitor``'s arguments and resolve them on ``backend``.

    ``model`` is a module of the framework (MindSpore: an ``nn.Cell``) or a list of chunks;
    ``optimizer`` what the user steps, as ``backend.optimizer_view`` takes it.
    ``params_have_main_grad`` picks ``backend.grad_reader`` (MindSpore: no ``main_grad``,
    ignored); ``process_group`` gives the pipeline context where ``backend.group_ranks`` reads it
    (MindSpore: stage 0).

    Raises:
        ConfigError: no optimizer, ``grad_acc_steps`` < 1, ``start_iteration`` < 0, a model that
            is not a module or a list of modules, an optimizer the backend does not find, a group
            without the framework's distributed communication.
    """
    check_arguments(optimizer, grad_acc_steps, start_iteration)
    view = backend.model_view(model, "set_monitor(model=...)", stage_prefix=True)  # V1: always "<vpp_stage>:"
    opt = backend.optimizer_view(optimizer, "set_monitor(optimizer=...)")
    warn_unstepped([(n.name, n.param) for n in view.parameters()], opt, "set_monitor(model, optimizer=[opt_d, opt_g])")
    rank = backend.rank()
    return Attachment(
        backend=backend,
        clock=StepClock(step=start_iteration, micro_batches=grad_acc_steps),
        view=view,
        optimizer=opt,
        rank=rank,
        grad_of=backend.grad_reader(params_have_main_grad),
        keep_reduced=redundancy_filter(dp_group, tp_group, backend),
        pipeline=pipeline_context(rank, process_group, backend),
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


def redundancy_filter(dp_group: Any, tp_group: Any, backend: Backend) -> KeepReduced | None:
    """Which parameters keep their reduced-gradient rows on this rank (None: all of them): only
    the first rank of a data-parallel group writes them; on the other ranks of a tensor-parallel
    group, the parameters whose piece differs there (PyTorch: by placement, see
    :mod:`~trainprobe.frontdoors.monitor_v1.tp_filter`; elsewhere those marked
    ``tensor_model_parallel``). This rank in a group is ``backend.group_rank``.

    Raises:
        ConfigError: a group is given but the framework's distributed communication is not
            initialised.
    """
    dp_first = dp_group is None or backend.group_rank(dp_group, "set_monitor(dp_group=...)") == 0
    tp_first = tp_group is None or backend.group_rank(tp_group, "set_monitor(tp_group=...)") == 0
    if dp_first and tp_first:
        return None
    if not dp_first:
        return lambda named: False
    if backend.name == "pytorch":
        from trainprobe.frontdoors.monitor_v1.tp_filter import placement_filter

        return placement_filter(backend.group_ranks(tp_group))
    return lambda named: bool(getattr(named.param, "tensor_model_parallel", False))


def pipeline_context(rank: int, group: Any, backend: Backend) -> PipelineContext:
    """``rank``'s stage in the pipeline ``group`` and the group's ranks (stage 0 and only this
    rank without a group, or where ``backend.group_ranks`` cannot tell)."""
    ranks = backend.group_ranks(group) if group is not None else None
    if ranks is None:
        return PipelineContext(rank=rank, pp_stage=0, group_mates=(rank,))
    return PipelineContext(rank=rank, pp_stage=ranks.index(rank) if rank in ranks else 0, group_mates=ranks)
