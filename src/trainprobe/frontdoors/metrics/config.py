"""The training-metrics dialect: MindSpore Transformers' ``monitor_config`` and ``tensorboard``
sections, read into frozen dataclasses and validated once.

The file (YAML or JSON) or dict is a whole training configuration: every top-level key other
than the two sections is kept as text for TensorBoard's TEXT page and never validated. Inside
the sections every key and value is checked; a mistake raises :class:`ConfigError` naming it,
e.g. ``monitor_config.local_norm_format[1]: 'tb' is not one of log, tensorboard``.

Without a ``tensorboard`` section every ``*_format`` that asks for ``tensorboard`` falls back
to ``log`` (with one warning), as the specification says.

Inside a trainer (the callbacks of :mod:`trainprobe.integrations`, ``trainer_loggers=True``) the
trainer's own loggers stand in for TensorBoard when no ``tensorboard_dir`` is given: the
section may then be absent or leave ``tensorboard_dir`` out (its other keys still apply), and
``tensorboard`` in a ``*_format`` means "to the trainer's loggers".
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.fields import ConfigObject, join_path, parse_json_config, read_config_text, type_name
from trainprobe.engine.log import warn_once
from trainprobe.frontdoors.metrics.yaml_config import parse_yaml_config

LOG = "log"
TENSORBOARD = "tensorboard"
DESTINATIONS = (LOG, TENSORBOARD)

Formats = frozenset[str]
"""Where a metric goes: a subset of ``{"log", "tensorboard"}``; empty means off."""

FORMAT_KEYS = (
    "local_loss_format",
    "device_local_loss_format",
    "local_norm_format",
    "device_local_norm_format",
    "optimizer_state_format",
    "weight_state_format",
)
MONITOR_KEYS = (
    "monitor_on",
    "dump_path",
    "target",
    "invert",
    "step_interval",
    *FORMAT_KEYS,
    "throughput_baseline",
    "print_struct",
)
TENSORBOARD_KEYS = (
    "tensorboard_dir",
    "tensorboard_queue_size",
    "log_loss_scale_to_tensorboard",
    "log_timers_to_tensorboard",
    "log_expert_load_to_tensorboard",
    "overwrite",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class MonitorSection:
    """``monitor_config``: the per-parameter and per-device state metrics.

    ``monitor_on`` false switches every field below off (``print_struct`` included).
    """

    monitor_on: bool = False
    dump_path: Path = Path("./dump")
    target: tuple[str, ...] = (".*",)
    invert: bool = False
    step_interval: int = 1
    local_loss_format: Formats = frozenset()
    device_local_loss_format: Formats = frozenset()
    local_norm_format: Formats = frozenset()
    device_local_norm_format: Formats = frozenset()
    optimizer_state_format: Formats = frozenset()
    weight_state_format: Formats = frozenset()
    throughput_baseline: float | None = None
    print_struct: bool = False

    def __post_init__(self) -> None:
        assert self.step_interval >= 1, "step_interval is validated by the loader"

    def targeted(self, name: str) -> bool:
        """Whether parameter ``name`` is selected by ``target`` (``re.search``) and ``invert``."""
        hit = any(re.search(pattern, name) is not None for pattern in self.target)
        return hit != self.invert

    @property
    def dumped(self) -> bool:
        """Whether any metric of ``dump_path`` (local/device norms and losses) is on."""
        return self.monitor_on and any(
            (
                self.local_loss_format,
                self.device_local_loss_format,
                self.local_norm_format,
                self.device_local_norm_format,
            )
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorBoardSection:
    """``tensorboard``: where event files go and which optional scalars are written.

    ``overwrite`` (a trainprobe extension, default false): a run from step 0 removes the event
    files an earlier run left in its rank folder instead of being refused (see
    :mod:`trainprobe.frontdoors.metrics.earlier_runs`).

    ``tensorboard_dir`` None (only inside a trainer): no event files of our own; what would go
    to TensorBoard is forwarded to the trainer's loggers.
    """

    tensorboard_dir: Path | None
    tensorboard_queue_size: int = 10
    log_loss_scale_to_tensorboard: bool = False
    log_timers_to_tensorboard: bool = False
    log_expert_load_to_tensorboard: bool = False
    overwrite: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingMetricsConfig:
    """A validated training-metrics configuration.

    Attributes:
        monitor: the ``monitor_config`` section (defaults when absent).
        tensorboard: the ``tensorboard`` section, or None when absent (no event files).
        text: ``(tag, markdown)`` of every top-level key, for TensorBoard's TEXT page.
    """

    monitor: MonitorSection = field(default_factory=MonitorSection)
    tensorboard: TensorBoardSection | None = None
    text: tuple[tuple[str, str], ...] = ()

    @property
    def step_interval(self) -> int:
        """Every how many steps metrics are recorded (``monitor_config.step_interval``)."""
        return self.monitor.step_interval

    @property
    def forwarded(self) -> bool:
        """Whether the TensorBoard scalars go to the trainer's loggers instead of event files of
        our own (a trainer callback's configuration without ``tensorboard_dir``)."""
        return self.tensorboard is not None and self.tensorboard.tensorboard_dir is None


def load_training_metrics_config(
    source: str | Path | Mapping[str, Any], *, trainer_loggers: bool = False
) -> TrainingMetricsConfig:
    """Read and validate a training configuration (YAML/JSON path or dict).

    ``trainer_loggers``: the configuration of a trainer callback, whose trainer has loggers of
    its own: without ``tensorboard.tensorboard_dir`` (section absent, or the key left out) the
    TensorBoard scalars are forwarded to them (:attr:`TrainingMetricsConfig.forwarded`).

    Raises:
        ConfigError: the file cannot be read or parsed, is empty or ``null``, breaks a rule of
            :mod:`trainprobe.engine.fields` (size, repeated keys, over-long integers; for YAML see
            :mod:`~trainprobe.frontdoors.metrics.yaml_config`), or a field of ``monitor_config`` /
            ``tensorboard`` is unknown or invalid (the message names it).
    """
    if isinstance(source, Mapping):
        data = dict(source)
        check_expanded_size(data, "config")
    else:
        data = _read_file(source)
    top = ConfigObject(data, "")
    tb_section = top.section("tensorboard")
    tensorboard = _tensorboard(tb_section, trainer_loggers) if tb_section.present else None
    if tensorboard is None and trainer_loggers:
        tensorboard = TensorBoardSection(tensorboard_dir=None)
    monitor = _monitor(top.section("monitor_config"), tensorboard is not None)
    return TrainingMetricsConfig(monitor=monitor, tensorboard=tensorboard, text=config_text(data))


MAX_EXPANDED_VALUES = 100_000


def check_expanded_size(data: Any, where: str) -> None:
    """Reject a document whose aliases expand beyond :data:`MAX_EXPANDED_VALUES` values or refer
    to themselves ("billion laughs", ``&a [*a]``): a ConfigError naming ``where``.

    The walk is iterative and counts every value as often as aliases repeat it, without copying.
    """
    count = 0
    stack: list[tuple[Any, frozenset[int]]] = [(data, frozenset())]
    while stack:
        value, ancestors = stack.pop()
        count += 1
        if count > MAX_EXPANDED_VALUES:
            raise ConfigError(
                f"{where}: expands to more than {MAX_EXPANDED_VALUES} values (YAML aliases?); "
                "write the configuration out without repeated aliases"
            )
        if isinstance(value, (dict, list)):
            if id(value) in ancestors:
                raise ConfigError(f"{where}: a YAML alias refers to itself; a configuration cannot be circular")
            inner = ancestors | {id(value)}
            items = value.values() if isinstance(value, dict) else value
            stack.extend((item, inner) for item in items)


def _read_file(source: str | Path) -> dict[str, Any]:
    """The top-level mapping of a YAML or JSON (by suffix) config file; an empty or ``null``
    document is refused, as Monitor V2 refuses it (it would silently configure nothing)."""
    file, raw = read_config_text(source)
    name = str(file)
    if file.suffix.lower() == ".json":
        data = parse_json_config(raw, name)
    else:
        data = parse_yaml_config(raw, name)
        check_expanded_size(data, f"config file {name!r}")
    if data is None:
        raise ConfigError(
            f"config file {name!r} is empty (or null); a training-metrics configuration needs a "
            "monitor_config and/or a tensorboard section (see docs/training_metrics.md)"
        )
    if not isinstance(data, dict):
        raise ConfigError(f"config file {name!r}: the top level must be a mapping, not {type_name(data)}")
    return data


def _formats(section: ConfigObject, key: str, has_tensorboard: bool) -> Formats:
    value = section.raw(key)
    if value is None:
        return frozenset()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items:
        raise section.fail(key, f"must be 'log', 'tensorboard', a non-empty list of them, or null; not {value!r}")
    found: set[str] = set()
    for i, item in enumerate(items):
        where = section.where(key) if isinstance(value, str) else join_path(section.where(key), i)
        if not isinstance(item, str) or item not in DESTINATIONS:
            raise ConfigError(f"{where}: {item!r} is not one of {', '.join(DESTINATIONS)}")
        found.add(item)
    if TENSORBOARD in found and not has_tensorboard:
        warn_once(
            f"metrics-no-tb-{key}",
            f"trainprobe: {section.where(key)} asks for 'tensorboard' but there is no tensorboard section; "
            "writing it to the log instead",
        )
        found = (found - {TENSORBOARD}) | {LOG}
    return frozenset(found)


def _monitor(section: ConfigObject, has_tensorboard: bool) -> MonitorSection:
    section.check_keys(MONITOR_KEYS)
    target = section.str_list("target") if section.has("target") else (".*",)
    if not target:
        raise section.fail("target", "must list at least one regular expression (or be null for all parameters)")
    for i, pattern in enumerate(target):
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ConfigError(
                f"{join_path(section.where('target'), i)}: invalid regular expression {pattern!r}: {exc}"
            ) from None
    baseline = None
    if section.has("throughput_baseline"):
        baseline = section.number("throughput_baseline", 0.0, positive=True)
    step_interval = section.integer("step_interval", 1, minimum=1)
    assert step_interval is not None
    formats = {key: _formats(section, key, has_tensorboard) for key in FORMAT_KEYS}
    return MonitorSection(
        monitor_on=section.boolean("monitor_on", False),
        dump_path=Path(section.string("dump_path", "./dump")),
        target=target,
        invert=section.boolean("invert", False),
        step_interval=step_interval,
        throughput_baseline=baseline,
        print_struct=section.boolean("print_struct", False),
        **formats,
    )


def _tensorboard(section: ConfigObject, trainer_loggers: bool) -> TensorBoardSection:
    section.check_keys(TENSORBOARD_KEYS)
    if not section.has("tensorboard_dir") and not trainer_loggers:
        raise section.fail("tensorboard_dir", "is required when the tensorboard section is present")
    queue_size = section.integer("tensorboard_queue_size", 10, minimum=1)
    assert queue_size is not None
    return TensorBoardSection(
        tensorboard_dir=Path(section.string("tensorboard_dir", "")) if section.has("tensorboard_dir") else None,
        tensorboard_queue_size=queue_size,
        log_loss_scale_to_tensorboard=section.boolean("log_loss_scale_to_tensorboard", False),
        log_timers_to_tensorboard=section.boolean("log_timers_to_tensorboard", False),
        log_expert_load_to_tensorboard=section.boolean("log_expert_load_to_tensorboard", False),
        overwrite=section.boolean("overwrite", False),
    )


def render_value(value: Any) -> str:
    """A configuration value as TensorBoard markdown: scalars as they are, the rest as an
    indented JSON block."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return str(value)
    text = json.dumps(value, indent=2, ensure_ascii=False, default=str)
    return "\n".join("    " + line for line in text.splitlines())


def config_text(data: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """``(tag, text)`` for every top-level key of a training configuration, in file order."""
    return tuple((str(key), render_value(value)) for key, value in data.items())
