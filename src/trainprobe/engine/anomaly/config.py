"""The ``anomaly`` block of a Monitor V2 config: online rules and what to do when one fires.

Example (every field shown with its default but ``actions``)::

    "anomaly": {
        "rules": ["nonfinite", "spike"],
        "spike_rule": "warm",
        "spike_factor": null,
        "actions": ["log", "stop"],
        "dump": {"steps": 1, "config": null},
        "before_update": false
    }

* ``rules``: ``nonfinite`` (a NaN/inf in any statistic, :mod:`trainprobe.engine.nonfinite`) and
  ``spike`` (the spike rule ``spike_rule`` of :mod:`trainprobe.engine.rules`, the one
  ``trainprobe diagnose --rule`` applies to the files).
* ``spike_factor``: the spike rule's factor (its bar: a value this many times its reference);
  null keeps the rule's own (10 for ``warm``, ``median`` and ``early_max``); ``ema_z`` has a
  z-score bar instead and takes none.
* ``actions``: ``log`` (one warning line per anomaly event), ``stop`` (raise
  :class:`~trainprobe.engine.anomaly.events.AnomalyStop` at the step boundary; the Hugging Face
  and Lightning callbacks stop their trainer instead), ``dump`` (a precision dump of the next
  ``dump.steps`` steps into ``<output_dir>/anomaly_dump/``).
* ``dump.config``: a precision-dump ``config.json`` to use instead of the default (L1 statistics
  of every API); its ``dump_path`` and ``step`` are replaced.
* ``before_update``: check the reduced gradients before ``optimizer.step()`` applies them, so
  that with ``stop`` the model and optimizer are left as after the last healthy step (one small
  device-to-host read per step).

Every field is checked at ``TrainerMonitorV2(...)``: a wrong one is a ConfigError naming it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.fields import ConfigObject, check_choice, config_file
from trainprobe.engine.rules import DEFAULT_RULE, RULES, Rule, rule_named

ANOMALY_KEYS: tuple[str, ...] = ("rules", "spike_rule", "spike_factor", "actions", "dump", "before_update")
RULE_NAMES: tuple[str, ...] = ("nonfinite", "spike")
ACTIONS: tuple[str, ...] = ("log", "stop", "dump")
DUMP_KEYS: tuple[str, ...] = ("steps", "config")


@dataclass(frozen=True, slots=True)
class DumpAction:
    """``anomaly.dump``: how many steps to dump after an anomaly, and with which dump config."""

    steps: int = 1
    config: Path | None = None


@dataclass(frozen=True, slots=True)
class AnomalyConfig:
    """A validated ``anomaly`` block (see the module docstring)."""

    rules: tuple[str, ...] = RULE_NAMES
    spike_rule: str = DEFAULT_RULE
    spike_factor: float | None = None
    actions: tuple[str, ...] = ("log",)
    dump: DumpAction = field(default_factory=DumpAction)
    before_update: bool = False

    def spike(self) -> Rule[object]:
        """The spike rule, with ``spike_factor`` where one is set."""
        params = {} if self.spike_factor is None else {"factor": self.spike_factor}
        return rule_named(self.spike_rule, **params)

    @property
    def stops(self) -> bool:
        """Whether an anomaly stops the run."""
        return "stop" in self.actions

    @property
    def dumps(self) -> bool:
        """Whether an anomaly starts a precision dump of the next steps."""
        return "dump" in self.actions


def parse_anomaly(section: ConfigObject) -> AnomalyConfig | None:
    """The ``anomaly`` block, or None when the config has none.

    Raises:
        ConfigError: an unknown field, rule or action, or a bad value (the message names the
            field, e.g. ``anomaly.actions[1]``, and lists what is accepted).
    """
    if not section.present:
        return None
    section.check_keys(ANOMALY_KEYS)
    rules = _choices(section, "rules", RULE_NAMES, RULE_NAMES)
    actions = _choices(section, "actions", ACTIONS, ("log",))
    spike_rule = section.choice("spike_rule", DEFAULT_RULE, tuple(RULES))
    factor = section.number("spike_factor", 1.0, positive=True) if section.has("spike_factor") else None
    if factor is not None:
        try:
            rule_named(spike_rule, factor=factor)
        except ValueError:
            raise section.fail("spike_factor", f"the spike rule {spike_rule!r} takes no factor; leave spike_factor out") from None
    dump = _dump(section.section("dump"))
    if section.has("dump") and "dump" not in actions:
        raise section.fail("dump", 'is set but "dump" is not in anomaly.actions; add it there or remove anomaly.dump')
    return AnomalyConfig(
        rules=rules,
        spike_rule=spike_rule,
        spike_factor=factor,
        actions=actions,
        dump=dump,
        before_update=section.boolean("before_update", False),
    )


def _choices(section: ConfigObject, key: str, allowed: tuple[str, ...], default: tuple[str, ...]) -> tuple[str, ...]:
    if not section.has(key):
        return default
    values = section.str_list(key)
    if not values:
        raise section.fail(key, f"must name at least one of {', '.join(allowed)} (or be left out)")
    picked = [check_choice(v, f"{section.where(key)}[{i}]", allowed) for i, v in enumerate(values)]
    return tuple(dict.fromkeys(picked))


def _dump(section: ConfigObject) -> DumpAction:
    section.check_keys(DUMP_KEYS)
    config = None
    if section.has("config"):
        where = section.where("config")
        try:
            config = config_file(section.string("config", ""), where)
        except ConfigError as exc:
            raise ConfigError(f"{exc} (a precision-dump config.json, see docs/precision_dump.md)") from None
    return DumpAction(steps=section.integer("steps", 1, minimum=1), config=config)
