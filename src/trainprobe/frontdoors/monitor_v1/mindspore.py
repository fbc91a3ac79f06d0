"""Monitor V1 on MindSpore: ``from trainprobe.mindspore import TrainerMon``.

The PyTorch front door (:class:`trainprobe.frontdoors.monitor_v1.trainer.TrainerMon`) with the MindSpore
adapter: the same config dialect, sessions, sinks (``csv``, ``tensorboard``, ``api``), alerts
and dynamic mode; only :func:`attach` differs. Supported fields, as the spec's MindSpore column
lists them: ``xy_distribution`` (with ``all_xy``, ``targets`` and their specs,
``forward_only``/``backward_only``), ``wg_distribution`` (with ``monitor_mbs_grad``),
``mv_distribution``, ``param_distribution``, ``stack_info``, ``format``, ``ops``, ``ndigits``,
``alert`` (with ``dump``), dynamic on/off, ``cc_distribution`` (``mint.distributed`` and the
communication primitives, see :mod:`trainprobe.backends.mindspore.collectives`). ``print_struct``,
``ur_distribution``, ``mg_direction`` and ``recording_l2_features`` are PyTorch-only: the
constructor refuses them with a ConfigError naming the field (a dynamic-mode edit that switches
one on is skipped with a warning).

Example:
    >>> monitor = TrainerMon("./monitor_config.json")                               # doctest: +SKIP
    >>> monitor.set_monitor(net, grad_acc_steps=1, optimizer=optimizer)            # doctest: +SKIP
    >>> for x, y in data:                                                           # doctest: +SKIP
    ...     loss, grads = grad_fn(x, y); optimizer(grads)   # the optimizer call ends a step
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainprobe.backends.mindspore.backend import MINDSPORE
from trainprobe.engine.errors import ConfigError
from trainprobe.engine.probes.base import StepClock
from trainprobe.frontdoors.monitor_v1.alerts import PipelineContext
from trainprobe.frontdoors.monitor_v1.attachment import Attachment, check_arguments, redundancy_filter
from trainprobe.frontdoors.monitor_v1.config import MonitorV1Config
from trainprobe.frontdoors.monitor_v1.trainer import TrainerMon as _TrainerMon

TORCH_ONLY_FIELDS = ("print_struct", "ur_distribution", "mg_direction", "recording_l2_features")


def unsupported_fields(config: MonitorV1Config) -> list[str]:
    """The PyTorch-only fields ``config`` switches on."""
    on = {
        "print_struct": config.print_struct,
        "ur_distribution": config.ur_distribution,
        "mg_direction": config.mg_direction,
        "recording_l2_features": config.l2.enabled,
    }
    return [name for name in TORCH_ONLY_FIELDS if on[name]]


def _group_rank(group: Any, where: str) -> int:
    if not MINDSPORE.distributed():
        raise ConfigError(f"set_monitor({where}=...): needs mindspore.communication to be initialised (init())")
    from mindspore.communication import get_rank

    return int(get_rank(group))


def attach(
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
    """Validate ``set_monitor``'s arguments for MindSpore and resolve them.

    ``model`` is an ``nn.Cell`` or a list of chunks; ``optimizer`` a MindSpore optimizer (or a
    wrapper holding one in ``.optimizer``). ``params_have_main_grad`` has no meaning here
    (MindSpore parameters have no ``main_grad``) and is ignored; ``process_group`` gives stage 0.

    Raises:
        ConfigError: no optimizer, ``grad_acc_steps`` < 1, ``start_iteration`` < 0, a model that
            is not a cell or a list of cells, an optimizer that is not MindSpore's, a group
            without ``mindspore.communication``.
    """
    check_arguments(optimizer, grad_acc_steps, start_iteration)
    view = MINDSPORE.model_view(model, "set_monitor(model=...)", stage_prefix=True)  # V1: always "<vpp_stage>:"
    opt = MINDSPORE.optimizer_view(optimizer, "set_monitor(optimizer=...)")
    rank = MINDSPORE.rank()
    return Attachment(
        clock=StepClock(step=start_iteration, micro_batches=grad_acc_steps),
        view=view,
        optimizers=[opt],
        optimizer=opt,
        rank=rank,
        grad_of=None,
        keep_reduced=redundancy_filter(dp_group, tp_group, _group_rank),
        pipeline=PipelineContext(rank=rank, pp_stage=0, group_mates=(rank,)),
        backend=MINDSPORE,
    )


class TrainerMon(_TrainerMon):
    """Monitor V1 for MindSpore ``nn.Cell`` models in PyNative mode (see the module docstring).

    Args:
        config_file_path: the JSON config (the Monitor V1 dialect, ``docs/monitor_v1.md``).
        process_group: accepted for the reference's signature; pipeline stage 0.
        params_have_main_grad: accepted and ignored (no ``main_grad`` in MindSpore).
        opt_ty: deprecated and ignored.

    Raises:
        ConfigError: an invalid field, or a PyTorch-only field switched on (named).
    """

    _attach = staticmethod(attach)

    def __init__(
        self,
        config_file_path: str | Path,
        process_group: Any = None,
        params_have_main_grad: bool = True,
        opt_ty: Any = None,
    ) -> None:
        super().__init__(config_file_path, process_group, params_have_main_grad, opt_ty)
        unsupported = unsupported_fields(self.config)
        if unsupported:
            raise ConfigError(
                f"{unsupported[0]}: not supported on the MindSpore backend of trainprobe (PyTorch only); "
                "set it to false"
            )
