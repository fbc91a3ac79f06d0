"""Which engine probes a Monitor V1 configuration runs, and over which parameters.

One probe per enabled field: ``xy_distribution`` → module probe (with :class:`V1Naming`),
``wg_distribution`` → weight-gradient probe, ``mv_distribution`` → optimizer-state probe,
``param_distribution`` → parameter probe, ``ur_distribution`` → update/ratio probe (plus its
histogram rows with ``format: tensorboard``), ``recording_l2_features`` → l2 probe,
``mg_direction`` → sign-agreement probe, ``cc_distribution`` → collective probe,
``stack_info`` → stack probe. Module-level monitoring (xy, l2, stack_info) runs only on the
``module_ranks``. Parameters are those of the optimizer that ``targets`` selects, named with
their ``<vpp_stage>:`` prefix (squashed with ``squash_name``, distinct names kept distinct: see
:func:`~trainprobe.frontdoors.monitor_v1.naming.first_come_names`). A ``targets`` entry that names no module
or parameter of the model is reported once, with the closest names.
"""

from __future__ import annotations

from trainprobe.engine.backend import Backend
from trainprobe.engine.errors import ConfigError
from trainprobe.engine.folders import check_output_folder
from trainprobe.engine.layout import CC_LOG_FILE
from trainprobe.engine.log import warn_once
from trainprobe.engine.probes.base import Probe, ProbeSpec
from trainprobe.engine.probes.collectives import CcSpec
from trainprobe.engine.probes.model_view import NamedParam
from trainprobe.engine.probes.module import ModuleProbe, ModuleSpec
from trainprobe.engine.probes.optimizer_state import OptimizerStateProbe
from trainprobe.engine.probes.param import ParamProbe
from trainprobe.frontdoors.monitor_v1 import output
from trainprobe.frontdoors.monitor_v1.attachment import Attachment
from trainprobe.frontdoors.monitor_v1.collectives import V1CollectiveProbe
from trainprobe.frontdoors.monitor_v1.config import MonitorV1Config
from trainprobe.frontdoors.monitor_v1.features import HistogramRows, MgDirectionProbe, UpdateRatioProbe
from trainprobe.frontdoors.monitor_v1.l2 import L2Probe
from trainprobe.frontdoors.monitor_v1.naming import (
    DisplayNames,
    V1Naming,
    display_name,
    display_names,
    first_come_names,
    param_targeted,
    unmatched_targets,
    with_roots,
)
from trainprobe.frontdoors.monitor_v1.shapes import ShapeBook, ShapedModuleProbe
from trainprobe.frontdoors.monitor_v1.struct import StackProbe


def parameter_names(cfg: MonitorV1Config, attachment: Attachment) -> tuple[list[NamedParam], DisplayNames]:
    """The optimizer's parameters (model order, full names) and their written names (squashed
    names taken first come, first served among the monitored ones, as the reference names them:
    :func:`~trainprobe.frontdoors.monitor_v1.naming.first_come_names`)."""
    every = attachment.view.optimizer_parameters(attachment.optimizer)
    names = [named.name for named in every]
    selected = [n for n in names if any(param_targeted(cfg, form) for form in (n, display_name(cfg, n)))]
    return every, first_come_names(cfg, names, selected)


def module_names(cfg: MonitorV1Config, attachment: Attachment) -> DisplayNames:
    """The written names of the model's modules (each chunk's root: ``<vpp>:``)."""
    roots, names, seen = [], [], set()
    for vpp, name, _ in attachment.view.modules():
        names.append(name)
        if vpp not in seen:  # root first in each chunk
            seen.add(vpp)
            roots.append(name)
    return with_roots(display_names(cfg, names), roots)


def monitored_params(cfg: MonitorV1Config, every: list[NamedParam], names: DisplayNames) -> list[NamedParam]:
    """The parameters of ``every`` that ``targets`` selects (by full, written or squashed name),
    in model order, with their written names (no two alike)."""
    return [
        NamedParam(named.vpp_stage, names(named.name), named.param)
        for named in every
        if any(param_targeted(cfg, form) for form in names.forms(named.name))
    ]


def build_probes(cfg: MonitorV1Config, attachment: Attachment, shapes: ShapeBook | None = None) -> list[Probe]:
    """The probes ``cfg`` enables, unattached (may create the run folder for stack_info).

    Warns once when squashing would merge names (those keep their full names) and when a
    ``targets`` entry names nothing in the model. ``shapes`` learns the shape and dtype of the
    rows (monitored parameters now, activations as they are picked).
    """
    every, param_names = parameter_names(cfg, attachment)
    params = monitored_params(cfg, every, param_names)
    if shapes is not None:
        shapes.add_params(params, attachment.view.chunks)
    probes: list[Probe] = []
    spec = ProbeSpec(cfg.ops, cfg.eps)
    module_rank = cfg.monitors_rank(attachment.rank)
    xy = cfg.xy_distribution and module_rank
    per_param = (
        cfg.wg_distribution,
        cfg.mv_distribution,
        cfg.param_distribution,
        cfg.ur_distribution,
        cfg.mg_direction,
    )
    modules = module_names(cfg, attachment) if xy or cfg.targets or cfg.stack_info else None
    if cfg.targets and (cfg.xy_distribution or any(per_param)):
        _warn_unmatched(cfg, param_names, modules)
    if any(per_param) and params:
        param_names.warn_clashes("parameters")
    if xy and modules is not None:
        probes += _activations(cfg, attachment, modules, shapes)
    if cfg.wg_distribution:
        probes.append(_weight_grad(cfg, attachment, params))
    if cfg.mv_distribution:
        probes.append(
            OptimizerStateProbe(
                attachment.clock, spec, attachment.optimizer, params, suffix_names=False, backend=attachment.backend
            )
        )
    if cfg.param_distribution:
        copy_of = attachment.optimizer.copy_of  # the float32 masters a wrapper steps (the parameter itself if none)
        stepped = [NamedParam(n.vpp_stage, n.name, copy_of(n.param)) for n in params]
        probes.append(ParamProbe(attachment.clock, spec, stepped, backend=attachment.backend))
    if cfg.ur_distribution and torch_only("ur_distribution", attachment):
        probes += _update_ratio(cfg, attachment, params)
    if cfg.l2.enabled and module_rank and torch_only("recording_l2_features", attachment):
        probes += _l2(cfg, attachment)
    if cfg.mg_direction and torch_only("mg_direction", attachment):
        probes.append(
            MgDirectionProbe(
                attachment.clock, ProbeSpec(cfg.ops, cfg.eps), attachment.optimizer, params, attachment.grad_of
            )
        )
    if cfg.cc.enable:
        probes += _collectives(cfg, attachment)
    if cfg.stack_info and module_rank:
        probes.append(StackProbe(attachment.clock, attachment.view, attachment.run_folder(cfg), modules))
    return probes


_FRAMEWORK_NAMES = {"mindspore": "MindSpore"}
"""How messages spell a backend's framework."""

TORCH_ONLY_FIELDS = ("print_struct", "ur_distribution", "mg_direction", "recording_l2_features")
"""The Monitor V1 fields only the PyTorch backend runs."""
ANOMALY_TORCH_ONLY = ("anomaly.actions", "anomaly.before_update")
"""The ``anomaly`` block's parts only the PyTorch backend runs: the ``dump`` action (a precision
dump) and ``before_update``."""


def unsupported_fields(config: MonitorV1Config) -> list[str]:
    """The PyTorch-only fields ``config`` switches on."""
    on = {
        "print_struct": config.print_struct,
        "ur_distribution": config.ur_distribution,
        "mg_direction": config.mg_direction,
        "recording_l2_features": config.l2.enabled,
        "anomaly.actions": config.anomaly is not None and config.anomaly.dumps,
        "anomaly.before_update": config.anomaly is not None and config.anomaly.before_update,
    }
    return [name for name in TORCH_ONLY_FIELDS + ANOMALY_TORCH_ONLY if on[name]]


def refuse_unsupported(config: MonitorV1Config, backend: Backend) -> None:
    """Refuse, at construction, a PyTorch-only field ``config`` switches on for another backend.

    Raises:
        ConfigError: naming the first such field.
    """
    unsupported = unsupported_fields(config) if backend.name != "pytorch" else []
    if unsupported:
        framework = _FRAMEWORK_NAMES.get(backend.name, backend.name)
        field = unsupported[0]
        fix = 'remove "dump"' if field == "anomaly.actions" else "set it to false"
        what = f'{field}: "dump" is' if field == "anomaly.actions" else f"{field}:"
        raise ConfigError(f"{what} not supported on the {framework} backend of trainprobe (PyTorch only); {fix}")


def torch_only(field: str, attachment: Attachment) -> bool:
    """Whether the PyTorch-only feature ``field`` can run (else it is skipped with a warning;
    MindSpore's front door refuses it up front, this covers dynamic-mode edits)."""
    if attachment.backend.name == "pytorch":
        return True
    warn_once(
        f"v1-torch-only-{field}", f"trainprobe: {field} is not supported on {attachment.backend.name}; it is skipped"
    )
    return False


def _warn_unmatched(cfg: MonitorV1Config, params: DisplayNames, modules: DisplayNames | None) -> None:
    """One warning naming the ``targets`` entries that match no parameter or module."""
    unmatched = unmatched_targets(cfg, params, *([modules] if modules is not None else []))
    if not unmatched:
        return
    parts = []
    for target, close in unmatched.items():
        hint = f" (closest: {', '.join(repr(c) for c in close)})" if close else ""
        parts.append(f"{target!r}{hint}")
    warn_once(
        f"v1-unmatched-targets-{'|'.join(unmatched)}",
        f"trainprobe: targets name no module or parameter of the model, so nothing is collected for them: "
        f"{'; '.join(parts)}. print_struct lists the module names",
    )


def _activations(
    cfg: MonitorV1Config, attachment: Attachment, names: DisplayNames, shapes: ShapeBook | None
) -> list[Probe]:
    if cfg.forward_only and cfg.backward_only:
        warn_once(
            "v1-fwd-bwd-only", "trainprobe: forward_only and backward_only are both true, so no activation is collected"
        )
        return []
    naming = V1Naming(cfg, names, shapes=shapes)
    if not any(naming.wants(v, n, m) for v, n, m in attachment.view.modules()):
        warn_once(
            "v1-xy-no-module",
            'trainprobe: xy_distribution is true but no module is selected: set "all_xy": true, or name '
            "modules in targets (print_struct lists their names)",
        )
        return []
    names.warn_clashes("modules")
    module_spec = ModuleSpec(cfg.ops, cfg.eps)
    if shapes is not None:  # each row states the shape of its own call
        return [
            ShapedModuleProbe(
                attachment.clock, module_spec, attachment.view, naming=naming, backend=attachment.backend, shapes=shapes
            )
        ]
    return [ModuleProbe(attachment.clock, module_spec, attachment.view, naming=naming, backend=attachment.backend)]


def _weight_grad(cfg: MonitorV1Config, attachment: Attachment, params: list[NamedParam]) -> Probe:
    return attachment.backend.weight_grad_probe(
        attachment.clock,
        ProbeSpec(cfg.ops, cfg.eps),
        params,
        attachment.clock.micro_batches,
        attachment.view,
        per_micro_batch=cfg.monitor_mbs_grad,
        optimizer=attachment.optimizer,
        grad_of=attachment.grad_of,
        keep_reduced=attachment.keep_reduced,
    )


def _update_ratio(cfg: MonitorV1Config, attachment: Attachment, params: list[NamedParam]) -> list[Probe]:
    histograms = (
        HistogramRows(attachment.clock, ProbeSpec(cfg.ops, cfg.eps), backend=attachment.backend)
        if cfg.format == "tensorboard"
        else None
    )
    if histograms is None:
        warn_once(
            "v1-ur-no-histograms",
            f"trainprobe: ur_distribution writes its update/ratio histograms only with format 'tensorboard'; "
            f"with format {cfg.format!r} only their statistics (adam_update, adam_ratio) are written",
        )
    probe = UpdateRatioProbe(attachment.clock, ProbeSpec(cfg.ops, cfg.eps), attachment.optimizer, params, histograms)
    return [probe] if histograms is None else [probe, histograms]


def _l2(cfg: MonitorV1Config, attachment: Attachment) -> list[Probe]:
    if cfg.l2.attention_hook or cfg.l2.linear_hook is not None:
        return [L2Probe(attachment.clock, cfg.l2, attachment.view)]
    warn_once("v1-l2-empty", "trainprobe: recording_l2_features is true but l2_targets lists no hook")
    return []


def _collectives(cfg: MonitorV1Config, attachment: Attachment) -> list[Probe]:
    if not attachment.backend.distributed():
        warn_once(
            "v1-cc-no-dist",
            f"trainprobe: cc_distribution needs {attachment.backend.name}'s distributed communication; it is skipped",
        )
        return []
    cc = CcSpec(
        ops=cfg.ops,
        eps=cfg.eps,
        cc_codeline=cfg.cc.cc_codeline,
        cc_log_only=cfg.cc.cc_log_only,
        cc_pre_hook=cfg.cc.cc_pre_hook,
    )
    # cc_log.json goes to the run folder, or with format api (no run folder) next to it: that
    # folder is made with the first call site logged, an unusable path fails now
    if cfg.format != "api":
        folder = attachment.run_folder(cfg)
    else:
        folder = check_output_folder(output.output_root() / f"cc_log-rank{attachment.rank}", output.OUTPUT_ENV)
    return [V1CollectiveProbe(attachment.clock, cc, attachment.rank, folder / CC_LOG_FILE, backend=attachment.backend)]
