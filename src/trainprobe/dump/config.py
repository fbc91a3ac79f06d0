"""The precision-dump dialect: ``config.json`` of :class:`PrecisionDebugger` → :class:`DumpConfig`.

Top-level fields: ``task`` (statistics | tensor | structure | overflow_check), ``level`` (L0 | L1 |
mix | debug), ``dump_path``, ``rank`` and ``step`` (lists; empty = all; steps also as ``"a-b"``
ranges), ``async_dump``, ``dump_enable`` (dynamic on/off, re-read at every ``step()``),
``extra_info`` (accepted, reserved), ``risk_level`` (CORE | FOCUS | ALL: which L1 APIs are dumped
when no ``scope``/``list`` is set, see :mod:`trainprobe.dump.api_catalog`). The section named
after the task holds ``scope`` (a ``[first, last]`` pair of names), ``list`` (names or
substrings), ``tensor_list`` (names whose tensors are also saved under ``statistics``), ``data_mode`` (all, forward, backward, input,
output) and ``summary_mode`` (statistics | md5 | xor); the ``overflow_check`` section also
``overflow_nums`` (how many overflowing APIs/modules to record over the run, default 1, -1: no
limit) and ``check_mode`` (accepted for compatibility; MindSpore only, ignored here). Every mistake
is a :class:`ConfigError` naming the field. Defaults live in this file only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from trainprobe.config.fields import Section, check_int, load_json_object
from trainprobe.errors import ConfigError

TASKS = ("statistics", "tensor", "structure", "overflow_check")
LEVELS = ("L0", "L1", "mix", "debug")
DATA_MODES = ("all", "forward", "backward", "input", "output")
SUMMARY_MODES = ("statistics", "md5", "xor")
RISK_LEVELS = ("CORE", "FOCUS", "ALL")
TOP_KEYS = (
    "task",
    "dump_path",
    "rank",
    "step",
    "level",
    "async_dump",
    "dump_enable",
    "extra_info",
    "enable_dataloader",
    "risk_level",
)
TASK_KEYS = ("scope", "list", "tensor_list", "data_mode", "summary_mode", "file_format", "overflow_nums", "check_mode")
DEFAULT_DUMP_PATH = "./dump_path"
DEFAULT_OVERFLOW_NUMS = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class DumpConfig:
    """A validated dump configuration (all defaults here)."""

    task: str = "statistics"
    level: str = "L1"
    dump_path: str = DEFAULT_DUMP_PATH
    ranks: tuple[int, ...] = ()
    steps: tuple[int, ...] = ()
    async_dump: bool = False
    dump_enable: bool | None = None
    extra_info: bool = True
    scope: tuple[str, ...] = ()
    names: tuple[str, ...] = ()
    tensor_list: tuple[str, ...] = ()
    data_mode: tuple[str, ...] = ("all",)
    summary_mode: str = "statistics"
    overflow_nums: int = DEFAULT_OVERFLOW_NUMS
    risk_level: str = "FOCUS"

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ConfigError(f"task: {self.task!r} is not one of {', '.join(TASKS)}")
        if self.level not in LEVELS:
            raise ConfigError(f"level: {self.level!r} is not one of {', '.join(LEVELS)}")
        if len(self.scope) not in (0, 2):
            raise ConfigError(f"{self.task}.scope: must be [] or [first, last], got {list(self.scope)}")
        check_overflow_nums(self.overflow_nums, "overflow_check.overflow_nums")

    @property
    def forward(self) -> bool:
        """Whether forward data is dumped (``data_mode``)."""
        return self._direction("forward")

    @property
    def backward(self) -> bool:
        """Whether backward data is dumped (``data_mode``)."""
        return self._direction("backward")

    @property
    def inputs(self) -> bool:
        """Whether inputs are dumped (``data_mode``)."""
        return self._side("input")

    @property
    def outputs(self) -> bool:
        """Whether outputs are dumped (``data_mode``)."""
        return self._side("output")

    def _direction(self, which: str) -> bool:
        modes = set(self.data_mode)
        return "all" in modes or which in modes or not modes & {"forward", "backward"}

    def _side(self, which: str) -> bool:
        modes = set(self.data_mode)
        return "all" in modes or which in modes or not modes & {"input", "output"}

    def with_overrides(
        self, *, task: str | None = None, dump_path: str | None = None, level: str | None = None, step: Any = None
    ) -> DumpConfig:
        """This config with the constructor arguments of :class:`PrecisionDebugger` applied."""
        changes: dict[str, Any] = {}
        if task is not None:
            changes["task"] = _choice(task, "task", TASKS)
        if dump_path is not None:
            if not isinstance(dump_path, (str, Path)):
                raise ConfigError(f"dump_path: must be a string, not {type(dump_path).__name__}")
            changes["dump_path"] = str(dump_path)
        if level is not None:
            changes["level"] = _level(level, "level")
        if step is not None:
            changes["steps"] = parse_steps(step if isinstance(step, list) else [step], "step")
        return replace(self, **changes)


def _choice(value: Any, where: str, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(f"{where}: {value!r} is not one of {', '.join(choices)}")
    return value


def _level(value: Any, where: str) -> str:
    if isinstance(value, str):
        for level in LEVELS:
            if value.lower() == level.lower():
                return level
    raise ConfigError(f"{where}: {value!r} is not one of {', '.join(LEVELS)}")


def check_overflow_nums(value: Any, where: str) -> int:
    """``value`` if it is -1 or an integer >= 1, else a ConfigError naming ``where``."""
    if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
        raise ConfigError(f"{where}: must be an integer >= 1, or -1 for no limit, got {value!r}")
    return value


def parse_steps(values: Any, where: str) -> tuple[int, ...]:
    """Steps from a list of integers and ``"a-b"`` ranges (inclusive)."""
    if not isinstance(values, list):
        raise ConfigError(f"{where}: must be a list of integers or 'a-b' ranges, not {type(values).__name__}")
    out: list[int] = []
    for i, item in enumerate(values):
        here = f"{where}[{i}]"
        if isinstance(item, str) and "-" in item:
            lo, _, hi = item.partition("-")
            try:
                a, b = int(lo), int(hi)
            except ValueError:
                raise ConfigError(f"{here}: {item!r} is not a range 'a-b' of integers") from None
            if a < 0 or b < a:
                raise ConfigError(f"{here}: range {item!r} must satisfy 0 <= a <= b")
            out.extend(range(a, b + 1))
        else:
            out.append(check_int(item, here, 0))
    return tuple(sorted(set(out)))


def parse_dump_config(data: dict[str, Any]) -> DumpConfig:
    """Validate a parsed ``config.json``; see the module docstring for the fields."""
    top = Section(data)
    top.check_keys(TOP_KEYS + TASKS)
    task = _choice(top.raw("task", "statistics"), "task", TASKS)
    level = _level(top.raw("level", "L1"), "level")
    dump_enable = top.raw("dump_enable")
    if dump_enable is not None and not isinstance(dump_enable, bool):
        raise ConfigError(f"dump_enable: must be true or false, not {dump_enable!r}")
    sec = top.section(task)
    sec.check_keys(TASK_KEYS)
    data_mode = sec.str_list("data_mode") or ("all",)
    for i, mode in enumerate(data_mode):
        if mode not in DATA_MODES:
            raise ConfigError(f"{task}.data_mode[{i}]: {mode!r} is not one of {', '.join(DATA_MODES)}")
    summary = sec.raw("summary_mode", "statistics")
    summary = _choice(summary, f"{task}.summary_mode", SUMMARY_MODES)
    overflow_nums = check_overflow_nums(sec.raw("overflow_nums", DEFAULT_OVERFLOW_NUMS), f"{task}.overflow_nums")
    return DumpConfig(
        task=task,
        level=level,
        dump_path=top.string("dump_path", DEFAULT_DUMP_PATH) or DEFAULT_DUMP_PATH,
        ranks=top.int_list("rank", minimum=0),
        steps=parse_steps(top.raw("step", []), "step"),
        async_dump=top.boolean("async_dump", False),
        dump_enable=dump_enable,
        extra_info=top.boolean("extra_info", True),
        scope=sec.str_list("scope"),
        names=sec.str_list("list"),
        tensor_list=sec.str_list("tensor_list"),
        data_mode=data_mode,
        summary_mode=summary,
        overflow_nums=overflow_nums,
        risk_level=_choice(top.raw("risk_level", "FOCUS"), "risk_level", RISK_LEVELS),
    )


def load_dump_config(path: str | Path | None) -> DumpConfig:
    """The config in ``path`` (None: every default: L1 statistics of all ranks and steps)."""
    if path is None:
        return DumpConfig()
    return parse_dump_config(load_json_object(path))
