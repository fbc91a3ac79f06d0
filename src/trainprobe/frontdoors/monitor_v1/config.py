"""The Monitor V1 dialect: ``monitor_config.json`` of ``TrainerMon`` → :class:`MonitorV1Config`.

Every field of the reference's detailed configuration table is read here, validated, and given
its documented default; every mistake is a :class:`~trainprobe.engine.errors.ConfigError` naming the
field's JSON path (``alert.rules[0].args.threshold: ...``). See ``docs/monitor_v1.md``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainprobe.engine.anomaly.config import AnomalyConfig, parse_anomaly
from trainprobe.engine.errors import ConfigError
from trainprobe.engine.fields import ConfigObject, config_object, join_path, type_name
from trainprobe.engine.schedule import Schedule
from trainprobe.engine.sinks.parquet_sink import require_pyarrow
from trainprobe.engine.stats.ops import ALL_OPS, DEFAULT_EPS, parse_ops

FORMATS = ("csv", "tensorboard", "api", "parquet")
DEFAULT_V1_OPS: tuple[str, ...] = ("norm",)
DEFAULT_COLLECT_TIMES = 100_000_000
SA_ORDERS = ("s,b,h,d", "b,s,h,d")
RULE_NAMES = ("AnomalyTurbulence", "AnomalyNan")
TENSOR_KINDS = ("input", "output", "input_grad", "output_grad")
TOP_LEVEL_KEYS = (
    "targets",
    "dynamic_on",
    "start_step",
    "collect_times",
    "step_interval",
    "print_struct",
    "module_ranks",
    "ur_distribution",
    "xy_distribution",
    "all_xy",
    "forward_only",
    "backward_only",
    "mv_distribution",
    "param_distribution",
    "wg_distribution",
    "monitor_mbs_grad",
    "mg_direction",
    "cc_distribution",
    "stack_info",
    "alert",
    "anomaly",
    "format",
    "ops",
    "eps",
    "ndigits",
    "step_count_per_record",
    "append_output",
    "squash_name",
    "recording_l2_features",
    "l2_targets",
    "sa_order",
)
# Reference keys trainprobe does not implement: accepted, one warning each (see ConfigObject.check_keys).
IGNORED: dict[str, str] = {
    "mg_distribution": "the reference validates this switch but collects nothing with it; "
    "use mg_direction for the gradient/momentum direction; ignored",
}
_SPEC = re.compile(r"^\s*(?:(tensor)|(tuple|list)\[(\d+)\](?::(\d+))?)\s*$")
_STAMP = re.compile(r"^[A-Z][a-z]{2}\d{2}_\d{2}-\d{2}-\d{2}$")


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorSpec:
    """A target's ``"tensor"`` / ``"tuple[2]:0"``: which element of the call's tensors is kept
    (``index`` None: all of them)."""

    text: str
    index: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class TargetConfig:
    """One ``targets`` entry: a module or parameter name, with optional per-tensor specs (an
    empty entry ``{}`` means every input, output and gradient)."""

    name: str
    specs: dict[str, TensorSpec] = field(default_factory=dict)

    def wants(self, kind: str) -> bool:
        """Whether ``kind`` (input, output, input_grad, output_grad) is monitored."""
        return not self.specs or kind in self.specs


@dataclass(frozen=True, slots=True, kw_only=True)
class CcConfig:
    """``cc_distribution``; ``cc_codeline`` entries are regular expressions searched in the
    collective's call stack (``<path>[<line>]`` per frame), or plain suffixes of its call site."""

    enable: bool = False
    cc_codeline: tuple[str, ...] = ()
    cc_pre_hook: bool = False
    cc_log_only: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class AlertRule:
    """One ``alert.rules`` entry."""

    rule_name: str
    threshold: float | None


@dataclass(frozen=True, slots=True, kw_only=True)
class AlertConfig:
    """``alert``: rules checked in order (the first that fires is reported) and ``dump``."""

    rules: tuple[AlertRule, ...] = ()
    dump: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class L2Config:
    """``recording_l2_features`` with ``l2_targets`` and ``sa_order``. A hook list that is None
    was not configured (nothing collected); an empty ``linear_hook`` list means every layer with
    a 2-D weight."""

    enabled: bool = False
    attention_hook: tuple[str, ...] | None = None
    linear_hook: tuple[str, ...] | None = None
    sa_order: str = "s,b,h,d"


@dataclass(frozen=True, slots=True, kw_only=True)
class MonitorV1Config:
    """A validated Monitor V1 configuration (defaults are the reference's)."""

    targets: tuple[TargetConfig, ...] = ()
    dynamic_on: bool = False
    start_step: int = 0
    collect_times: int = DEFAULT_COLLECT_TIMES
    step_interval: int = 1
    print_struct: bool = False
    module_ranks: tuple[int, ...] = ()
    ur_distribution: bool = False
    xy_distribution: bool = False
    all_xy: bool = False
    forward_only: bool = False
    backward_only: bool = False
    mv_distribution: bool = False
    param_distribution: bool = False
    wg_distribution: bool = False
    monitor_mbs_grad: bool = False
    mg_direction: bool = False
    cc: CcConfig = field(default_factory=CcConfig)
    stack_info: bool = False
    alert: AlertConfig = field(default_factory=AlertConfig)
    anomaly: AnomalyConfig | None = None
    """The online rules and their actions (the ``anomaly`` block of
    :mod:`trainprobe.engine.anomaly.config`, as in Monitor V2; None without one)."""
    format: str = "csv"
    ops: tuple[str, ...] = DEFAULT_V1_OPS
    eps: float = DEFAULT_EPS
    ndigits: int = 6
    step_count_per_record: int = 1
    append_output: tuple[str, ...] = ()
    squash_name: bool = True
    l2: L2Config = field(default_factory=L2Config)

    def schedule(self, start_step: int | None = None) -> Schedule | None:
        """The collection schedule (None when ``collect_times`` is 0: nothing is collected);
        ``start_step`` overrides the file's (dynamic mode starts at the next step)."""
        if self.collect_times == 0:
            return None
        return Schedule(
            start_step=self.start_step if start_step is None else start_step,
            step_interval=self.step_interval,
            collect_times=self.collect_times,
            step_count_per_record=self.step_count_per_record,
            record_origin=0,
        )

    def target(self, name: str) -> TargetConfig | None:
        """The ``targets`` entry for module or parameter ``name`` (with or without the
        ``<vpp_stage>:`` prefix)."""
        bare = name.split(":", 1)[1] if ":" in name else name
        for t in self.targets:
            if t.name in (name, bare):
                return t
        return None

    def monitors_rank(self, rank: int) -> bool:
        """Whether module monitoring runs on ``rank`` (``module_ranks`` empty: every rank)."""
        return not self.module_ranks or rank in self.module_ranks


def load_monitor_v1_config(source: str | Path | dict[str, Any]) -> MonitorV1Config:
    """Read and validate a Monitor V1 config (a path to a JSON file, or the parsed object).

    Raises:
        ConfigError: the file is missing or not JSON, or any field is invalid (named by path).
    """
    top = ConfigObject(config_object(source, "config_file_path: expected a path to a JSON file"))
    top.check_keys(TOP_LEVEL_KEYS, IGNORED)
    fmt = top.choice("format", "csv", FORMATS)
    if fmt == "parquet":
        require_pyarrow("format")
    ops = parse_ops(top.raw("ops"), "ops", ALL_OPS, DEFAULT_V1_OPS) if top.has("ops") else DEFAULT_V1_OPS
    return MonitorV1Config(
        targets=_targets(top.section("targets")),
        dynamic_on=top.boolean("dynamic_on", False),
        start_step=_int(top, "start_step", 0, 0),
        collect_times=_int(top, "collect_times", DEFAULT_COLLECT_TIMES, 0),
        step_interval=_int(top, "step_interval", 1, 1),
        print_struct=top.boolean("print_struct", False),
        module_ranks=top.int_list("module_ranks", minimum=0),
        ur_distribution=top.boolean("ur_distribution", False),
        xy_distribution=top.boolean("xy_distribution", False),
        all_xy=top.boolean("all_xy", False),
        forward_only=top.boolean("forward_only", False),
        backward_only=top.boolean("backward_only", False),
        mv_distribution=top.boolean("mv_distribution", False),
        param_distribution=top.boolean("param_distribution", False),
        wg_distribution=top.boolean("wg_distribution", False),
        monitor_mbs_grad=top.boolean("monitor_mbs_grad", False),
        mg_direction=top.boolean("mg_direction", False),
        cc=_cc(top.section("cc_distribution")),
        stack_info=top.boolean("stack_info", False),
        alert=_alert(top.section("alert")),
        anomaly=_anomaly(top),
        format=fmt,
        ops=ops,
        eps=top.number("eps", DEFAULT_EPS, positive=True),
        ndigits=_int(top, "ndigits", 6, 0),
        step_count_per_record=_int(top, "step_count_per_record", 1, 1),
        append_output=_append_output(top),
        squash_name=top.boolean("squash_name", True),
        l2=_l2(top),
    )


def _int(s: ConfigObject, key: str, default: int, minimum: int) -> int:
    value = s.integer(key, default, minimum=minimum)
    assert value is not None
    return value


def parse_tensor_spec(text: Any, where: str) -> TensorSpec:
    """``"tensor"``, ``"tuple[N]"`` or ``"tuple[N]:i"`` (``list`` too), validated."""
    if not isinstance(text, str):
        raise ConfigError(f"{where}: must be a string such as 'tensor' or 'tuple[2]:0', not {type_name(text)}")
    m = _SPEC.match(text)
    if m is None:
        raise ConfigError(f"{where}: {text!r} is not 'tensor', 'tuple[N]' or 'tuple[N]:i' (e.g. 'tuple[2]:0')")
    if m.group(1):
        return TensorSpec(text=text, index=None)
    size, index = int(m.group(3)), m.group(4)
    if index is None:
        return TensorSpec(text=text, index=None)
    if int(index) >= size:
        raise ConfigError(f"{where}: element {index} is out of range for {m.group(2)}[{size}]")
    return TensorSpec(text=text, index=int(index))


def _targets(s: ConfigObject) -> tuple[TargetConfig, ...]:
    out = []
    for name in s.data:
        if not isinstance(name, str) or not name:
            raise s.fail(str(name), "target names must be non-empty strings")
        entry = s.section(name)
        entry.check_keys(TENSOR_KINDS)
        specs = {kind: parse_tensor_spec(entry.data[kind], entry.where(kind)) for kind in entry.data}
        out.append(TargetConfig(name=name, specs=specs))
    return tuple(out)


def _cc(s: ConfigObject) -> CcConfig:
    s.check_keys(("enable", "cc_codeline", "cc_pre_hook", "cc_log_only"))
    codeline = s.str_list("cc_codeline")
    for i, pattern in enumerate(codeline):
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ConfigError(
                f"{join_path(s.where('cc_codeline'), i)}: {pattern!r} is not a valid regular expression ({exc}); "
                "write a code line such as 'train.py\\[23\\]' (brackets escaped)"
            ) from None
    return CcConfig(
        enable=s.boolean("enable", False),
        cc_codeline=codeline,
        cc_pre_hook=s.boolean("cc_pre_hook", False),
        cc_log_only=s.boolean("cc_log_only", False),
    )


def _alert(s: ConfigObject) -> AlertConfig:
    s.check_keys(("rules", "dump"))
    rules_raw = s.raw("rules", [])
    if not isinstance(rules_raw, list):
        raise s.fail("rules", f"must be a list of rules, not {type_name(rules_raw)}")
    rules = []
    for i, raw in enumerate(rules_raw):
        rule = ConfigObject(raw, join_path(s.where("rules"), i))
        rule.check_keys(("rule_name", "args"))
        if not rule.has("rule_name"):
            raise rule.fail("rule_name", f"is required; one of {', '.join(RULE_NAMES)}")
        name = rule.string("rule_name", "")
        if name not in RULE_NAMES:
            raise rule.fail("rule_name", f"{name!r} is not one of {', '.join(RULE_NAMES)}")
        args = rule.section("args")
        args.check_keys(("threshold",))
        threshold = args.number("threshold", 0.0, positive=True) if args.has("threshold") else None
        if name == "AnomalyTurbulence" and threshold is None:
            raise ConfigError(
                f"{args.where('threshold')}: AnomalyTurbulence needs a threshold, e.g. 0.5 for a 50% deviation"
            )
        rules.append(AlertRule(rule_name=name, threshold=threshold))
    return AlertConfig(rules=tuple(rules), dump=s.boolean("dump", False))


def _anomaly(top: ConfigObject) -> AnomalyConfig | None:
    """``anomaly``: Monitor V2's block (the same fields and checks); ``before_update`` judges the
    reduced gradients, so it needs ``wg_distribution``."""
    anomaly = parse_anomaly(top.section("anomaly"))
    if anomaly is not None and anomaly.before_update and top.raw("wg_distribution", False) is not True:
        raise top.section("anomaly").fail(
            "before_update",
            'checks the reduced gradients before optimizer.step(), which needs "wg_distribution": true; '
            "set it or set before_update false",
        )
    return anomaly


def _append_output(top: ConfigObject) -> tuple[str, ...]:
    stamps = top.str_list("append_output")
    if not stamps:
        return ()
    if len(stamps) != 2:
        raise top.fail(
            "append_output", f"must hold two timestamps such as ['Dec03_21-34-40', 'Dec03_21-34-41'], got {len(stamps)}"
        )
    for i, stamp in enumerate(stamps):
        if not _STAMP.match(stamp):
            raise ConfigError(
                f"{join_path('append_output', i)}: {stamp!r} is not a timestamp like 'Dec03_21-34-40' "
                "(the prefix of an output folder)"
            )
    return stamps


def _l2(top: ConfigObject) -> L2Config:
    targets = top.section("l2_targets")
    targets.check_keys(("attention_hook", "linear_hook"))
    return L2Config(
        enabled=top.boolean("recording_l2_features", False),
        attention_hook=targets.str_list("attention_hook") if targets.has("attention_hook") else None,
        linear_hook=targets.str_list("linear_hook") if targets.has("linear_hook") else None,
        sa_order=top.choice("sa_order", "s,b,h,d", SA_ORDERS, aliases={"sbhd": "s,b,h,d", "bshd": "b,s,h,d"}),
    )
