"""The Monitor V2 config dialect: ``monitor_v2_config.json`` → :class:`MonitorV2Config`.

Every field of the reference format is accepted with its documented meaning; see
``docs/monitor_v2.md`` for the full reference. All defaults live in this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainprobe.engine.anomaly.config import AnomalyConfig, parse_anomaly
from trainprobe.engine.errors import ConfigError
from trainprobe.engine.fields import ConfigObject, check_choice, config_object
from trainprobe.engine.layout import V2_MONITORS
from trainprobe.engine.log import logger
from trainprobe.engine.schedule import Schedule
from trainprobe.engine.sinks.parquet_sink import require_pyarrow
from trainprobe.engine.stats.ops import DEFAULT_EPS, DEFAULT_OPS, parse_ops

FRAMEWORKS = ("pytorch", "mindspore")
FRAMEWORK_ALIASES = {"pt": "pytorch", "torch": "pytorch", "ms": "mindspore"}
MONITOR_NAMES = V2_MONITORS
TOP_LEVEL_KEYS = (
    "framework",
    "output_dir",
    "format",
    "async_write",
    "rank",
    "start_step",
    "stop_step",
    "step_interval",
    "step_count_per_record",
    "patch_optimizer_step",
    "collect_times",
    "global_stats",
    "anomaly",
    "monitors",
)
COMMON_KEYS = ("enabled", "ops", "eps")
CC_KEYS = ("cc_codeline", "cc_log_only", "cc_pre_hook", "module_ranks")


@dataclass(frozen=True, slots=True, kw_only=True)
class MonitorCommon:
    """Fields every monitor has."""

    enabled: bool = False
    ops: tuple[str, ...] = DEFAULT_OPS
    eps: float = DEFAULT_EPS


@dataclass(frozen=True, slots=True, kw_only=True)
class ModuleMonitorConfig(MonitorCommon):
    """``monitors.module``: forward inputs/outputs and their gradients of target modules."""

    targets: tuple[str, ...] = ()
    record_eval_mode: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightGradConfig(MonitorCommon):
    """``monitors.weight_grad``: parameter gradients, unreduced (backward) and reduced (pre-step)."""

    monitor_mbs_grad: bool = False
    micro_batch_number: int | None = None
    grad_acc_steps: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimizerConfig(MonitorCommon):
    """``monitors.optimizer``: Adam-family moments ``exp_avg``/``exp_avg_sq`` after the step."""

    mv_distribution: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamConfig(MonitorCommon):
    """``monitors.param``: parameters before (``param_origin``) and after (``param_updated``) the step."""

    param_distribution: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class CcConfig(MonitorCommon):
    """``monitors.cc``: torch.distributed collectives."""

    cc_codeline: tuple[str, ...] = ()
    cc_log_only: bool = False
    cc_pre_hook: bool = False
    module_ranks: tuple[int, ...] = ()
    ddp_comm_hook: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class MonitorV2Config:
    """A validated Monitor V2 configuration."""

    framework: str = "pytorch"
    output_dir: Path = Path("./")
    format: str = "csv"
    async_write: bool | None = None
    ranks: tuple[int, ...] = ()
    schedule: Schedule = field(default_factory=Schedule)
    patch_optimizer_step: bool | None = None
    global_stats: bool = False
    """Live full-tensor statistics of sharded tensors (``TrainerMonitorV2.global_stats``)."""
    anomaly: AnomalyConfig | None = None
    """The online rules and their actions (``anomaly`` block, :mod:`trainprobe.engine.anomaly.config`)."""
    module: ModuleMonitorConfig = field(default_factory=ModuleMonitorConfig)
    weight_grad: WeightGradConfig = field(default_factory=WeightGradConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    param: ParamConfig = field(default_factory=ParamConfig)
    cc: CcConfig = field(default_factory=CcConfig)

    def enabled_monitors(self) -> list[str]:
        """Names of the monitors that are on, in a fixed order."""
        return [name for name in MONITOR_NAMES if getattr(self, name).enabled]

    def monitors_rank(self, rank: int) -> bool:
        """Whether ``rank`` is monitored (an empty ``rank`` list means every rank)."""
        return not self.ranks or rank in self.ranks


def load_monitor_v2_config(source: str | Path | dict[str, Any], framework: str | None = None) -> MonitorV2Config:
    """Read and validate a Monitor V2 config.

    Args:
        source: path of a JSON file, or the already-parsed object.
        framework: overrides the file's ``framework`` field (pytorch, pt, torch, mindspore, ms).

    Raises:
        ConfigError: any invalid field, named by its JSON path.
    """
    top = ConfigObject(config_object(source, "config_path: expected a path to a JSON file or a dict"))
    top.check_keys(TOP_LEVEL_KEYS)
    fr = _framework(top, framework)
    fmt = top.choice("format", "csv", ("csv", "parquet"))
    if fmt == "parquet":
        require_pyarrow("format")
    monitors = top.section("monitors")
    monitors.check_keys(MONITOR_NAMES)
    return MonitorV2Config(
        framework=fr,
        output_dir=Path(top.string("output_dir", "./") or "./"),
        format=fmt,
        async_write=top.boolean("async_write", True) if top.has("async_write") else None,
        ranks=top.int_list("rank", minimum=0, allow_scalar=True),
        schedule=_schedule(top),
        patch_optimizer_step=top.boolean("patch_optimizer_step", False) if top.has("patch_optimizer_step") else None,
        global_stats=top.boolean("global_stats", False),
        anomaly=_anomaly(top.section("anomaly"), monitors),
        module=_module(monitors.section("module")),
        weight_grad=_weight_grad(monitors.section("weight_grad")),
        optimizer=_optimizer(monitors.section("optimizer")),
        param=_param(monitors.section("param")),
        cc=_cc(monitors.section("cc")),
    )


def _anomaly(section: ConfigObject, monitors: ConfigObject) -> AnomalyConfig | None:
    """``anomaly``: online rules over the enabled monitors' rows; ``before_update`` judges the
    gradients before the update, so it needs ``monitors.weight_grad``."""
    anomaly = parse_anomaly(section)
    if anomaly is None:
        return None
    weight_grad = monitors.section("weight_grad")
    if anomaly.before_update and not (weight_grad.present and weight_grad.raw("enabled", False) is True):
        raise section.fail(
            "before_update",
            'needs monitors.weight_grad (its reduced rows are what is checked before the update); add '
            '"weight_grad": {"enabled": true} or set before_update false',
        )
    return anomaly


def _framework(top: ConfigObject, override: str | None) -> str:
    if override is not None:
        if not isinstance(override, str):
            raise ConfigError(f"fr: must be a string such as 'pytorch', not {override!r}")
        fr = check_choice(override, "fr", FRAMEWORKS, FRAMEWORK_ALIASES)
    else:
        fr = top.choice("framework", "pytorch", FRAMEWORKS, aliases=FRAMEWORK_ALIASES)
    return fr


def _schedule(top: ConfigObject) -> Schedule:
    start = top.integer("start_step", 0, minimum=0)
    stop = top.integer("stop_step", None, minimum=0)
    if stop is not None and stop <= start:
        raise top.fail("stop_step", f"must be greater than start_step ({start}), got {stop}; stop_step is exclusive")
    return Schedule(
        start_step=start,
        stop_step=stop,
        step_interval=top.integer("step_interval", 1, minimum=1),
        collect_times=top.integer("collect_times", None, minimum=1),
        step_count_per_record=top.integer("step_count_per_record", 1, minimum=1),
    )


def _common(section: ConfigObject, extra: tuple[str, ...], *, enabled_default: bool) -> dict[str, Any]:
    """Common fields; a monitor whose key is absent is off, one present without ``enabled``
    takes ``enabled_default`` (true for module only, as the reference documents)."""
    section.check_keys(COMMON_KEYS + extra)
    present = section.present
    enabled = section.boolean("enabled", enabled_default) if present else False
    if present and not enabled and "enabled" not in section.data:
        logger.warning('%s is configured but off: add "enabled": true to switch it on', section.path)
    return {
        "enabled": enabled,
        "ops": parse_ops(section.raw("ops"), section.where("ops")),
        "eps": section.number("eps", DEFAULT_EPS, positive=True),
    }


def _module(s: ConfigObject) -> ModuleMonitorConfig:
    common = _common(s, ("targets", "record_eval_mode"), enabled_default=True)
    return ModuleMonitorConfig(
        **common, targets=s.str_list("targets"), record_eval_mode=s.boolean("record_eval_mode", False)
    )


def _weight_grad(s: ConfigObject) -> WeightGradConfig:
    common = _common(s, ("monitor_mbs_grad", "micro_batch_number", "grad_acc_steps"), enabled_default=False)
    return WeightGradConfig(
        **common,
        monitor_mbs_grad=s.boolean("monitor_mbs_grad", False),
        micro_batch_number=s.integer("micro_batch_number", None, minimum=1),
        grad_acc_steps=s.integer("grad_acc_steps", None, minimum=1),
    )


def _optimizer(s: ConfigObject) -> OptimizerConfig:
    common = _common(s, ("mv_distribution",), enabled_default=False)
    return OptimizerConfig(**common, mv_distribution=s.boolean("mv_distribution", True))


def _param(s: ConfigObject) -> ParamConfig:
    common = _common(s, ("param_distribution",), enabled_default=False)
    return ParamConfig(**common, param_distribution=s.boolean("param_distribution", True))


def _cc(s: ConfigObject) -> CcConfig:
    """``monitors.cc``; the legacy nested ``cc_distribution`` object is accepted too. Its
    ``enable`` switches cc on unless ``enabled`` is given explicitly, and a field given in both
    places takes the nested value."""
    legacy = s.section("cc_distribution")
    legacy.check_keys(("enable",) + CC_KEYS)
    legacy_on = legacy.boolean("enable", False)
    default_on = legacy_on if legacy.present and legacy.has("enable") else False
    common = _common(s, CC_KEYS + ("cc_distribution", "ddp_comm_hook"), enabled_default=default_on)

    def source(key: str) -> ConfigObject:
        return legacy if legacy.has(key) else s

    return CcConfig(
        **common,
        cc_codeline=source("cc_codeline").str_list("cc_codeline"),
        cc_log_only=source("cc_log_only").boolean("cc_log_only", False),
        cc_pre_hook=source("cc_pre_hook").boolean("cc_pre_hook", False),
        module_ranks=source("module_ranks").int_list("module_ranks", minimum=0),
        ddp_comm_hook=s.boolean("ddp_comm_hook", False),
    )
