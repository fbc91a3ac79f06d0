"""Monitor V1 on MindSpore: ``from trainprobe.mindspore import TrainerMon``.

The one Monitor V1 front door (:class:`trainprobe.frontdoors.monitor_v1.trainer.TrainerMon`) on the
MindSpore backend (``framework="mindspore"``, resolved by :func:`trainprobe.backends.backend_for`):
the same config dialect, sessions, sinks (``csv``, ``tensorboard``, ``api``), alerts and dynamic
mode; what differs is the backend's (model and optimizer views, ranks, process groups). Supported fields, as the spec's MindSpore column
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

from trainprobe.frontdoors.monitor_v1.probe_set import TORCH_ONLY_FIELDS, unsupported_fields
from trainprobe.frontdoors.monitor_v1.trainer import TrainerMon as _TrainerMon

__all__ = ["TORCH_ONLY_FIELDS", "TrainerMon", "unsupported_fields"]


def TrainerMon(  # noqa: N802 - the reference's class name, kept for ``from trainprobe.mindspore import TrainerMon``
    config_file_path: str | Path,
    process_group: Any = None,
    params_have_main_grad: bool = True,
    opt_ty: Any = None,
) -> _TrainerMon:
    """Monitor V1 for MindSpore ``nn.Cell`` models in PyNative mode (see the module docstring):
    ``TrainerMon(..., framework="mindspore")``.

    Args:
        config_file_path: the JSON config (the Monitor V1 dialect, ``docs/monitor_v1.md``).
        process_group: accepted for the reference's signature; pipeline stage 0.
        params_have_main_grad: accepted and ignored (no ``main_grad`` in MindSpore).
        opt_ty: deprecated and ignored.

    Raises:
        ConfigError: an invalid field, or a PyTorch-only field switched on (named).
    """
    return _TrainerMon(config_file_path, process_group, params_have_main_grad, opt_ty, framework="mindspore")
