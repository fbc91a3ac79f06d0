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

from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.fields import ConfigObject, check_int, load_json_object

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
# Reference keys trainprobe does not implement: accepted, one warning each (see ConfigObject.check_keys).
_OTHER_TOOL = "belongs to another msProbe tool that trainprobe does not implement; ignored"
IGNORED_TOP: dict[str, str] = {
    "precision": "the dump precision switch is not implemented; statistics are always float64-accurate; ignored",
    "custom_op_namespaces": "custom operator namespaces are not implemented; ignored",
    "load": "loading dumped inputs back into modules is not implemented; ignored",
    "acc_check": _OTHER_TOOL,
    "diff_check": _OTHER_TOOL,
    "nan_check": _OTHER_TOOL,
    "exception_dump": _OTHER_TOOL,
}
IGNORED_TASK: dict[str, str] = {
    "slice": "tensor slicing is not implemented; whole tensors are dumped; ignored",
    "request_id": "request filtering (inference) is not implemented; ignored",
    "bench_path": "benchmark comparison during the dump is not implemented; use trainprobe compare; ignored",
    "diff_nums": _OTHER_TOOL,
    "white_list": _OTHER_TOOL,
    "black_list": _OTHER_TOOL,
    "error_data_path": _OTHER_TOOL,
}
DEFAULT_DUMP_PATH = "./dump_path"


@dataclass(frozen=True, slots=True)
class IntRanges:
    """A set of non-negative integers kept as inclusive ``(first, last)`` ranges, so that
    ``"0-1000000000000"`` costs two integers; empty means "all"."""

    spans: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, spans: list[tuple[int, int]]) -> IntRanges:
        """Sorted, merged ranges."""
        merged: list[tuple[int, int]] = []
        for lo, hi in sorted(spans):
            if merged and lo <= merged[-1][1] + 1:
                merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
            else:
                merged.append((lo, hi))
        return cls(tuple(merged))

    def __contains__(self, value: object) -> bool:
        return isinstance(value, int) and any(lo <= value <= hi for lo, hi in self.spans)

    def __bool__(self) -> bool:
        return bool(self.spans)

    def __len__(self) -> int:
        return sum(hi - lo + 1 for lo, hi in self.spans)

    def __iter__(self) -> Iterator[int]:
        for lo, hi in self.spans:
            yield from range(lo, hi + 1)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, IntRanges):
            return self.spans == other.spans
        if isinstance(other, (tuple, list)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=False))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.spans)


DEFAULT_OVERFLOW_NUMS = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class DumpConfig:
    """A validated dump configuration (all defaults here)."""

    task: str = "statistics"
    level: str = "L1"
    dump_path: str = DEFAULT_DUMP_PATH
    ranks: IntRanges = IntRanges()
    steps: IntRanges = IntRanges()
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
            changes["dump_path"] = check_dump_path(str(dump_path))
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


def check_dump_path(path: str) -> str:
    """``path`` if it can name a folder (no NUL byte, a usable length), else a ConfigError naming ``dump_path``."""
    if "\0" in path:
        raise ConfigError(f"dump_path: {path!r} contains a NUL byte; pass a folder path")
    try:
        Path(path).resolve().exists()
    except (OSError, ValueError) as exc:
        raise ConfigError(f"dump_path: {path!r} cannot be used as a folder: {exc}") from None
    return path


def check_overflow_nums(value: Any, where: str) -> int:
    """``value`` if it is -1 or an integer >= 1 (integral floats count), else a ConfigError naming ``where``."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
        raise ConfigError(f"{where}: must be an integer >= 1, or -1 for no limit, got {value!r}")
    return value


def parse_steps(values: Any, where: str) -> IntRanges:
    """Steps (or ranks) from a list of integers and ``"a-b"`` ranges (inclusive), kept as ranges."""
    if not isinstance(values, list):
        raise ConfigError(f"{where}: must be a list of integers or 'a-b' ranges, not {type(values).__name__}")
    out: list[tuple[int, int]] = []
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
            out.append((a, b))
        else:
            n = check_int(item, here, 0)
            out.append((n, n))
    return IntRanges.of(out)


def parse_dump_config(data: dict[str, Any]) -> DumpConfig:
    """Validate a parsed ``config.json``; see the module docstring for the fields."""
    top = ConfigObject(data)
    top.check_keys(TOP_KEYS + TASKS, IGNORED_TOP)
    task = _choice(top.raw("task", "statistics"), "task", TASKS)
    level = _level(top.raw("level", "L1"), "level")
    dump_enable = top.raw("dump_enable")
    if dump_enable is not None and not isinstance(dump_enable, bool):
        raise ConfigError(f"dump_enable: must be true or false, not {dump_enable!r}")
    sec = top.section(task)
    sec.check_keys(TASK_KEYS, IGNORED_TASK)
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
        dump_path=check_dump_path(top.string("dump_path", DEFAULT_DUMP_PATH) or DEFAULT_DUMP_PATH),
        ranks=parse_steps(top.raw("rank", []), "rank"),
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
