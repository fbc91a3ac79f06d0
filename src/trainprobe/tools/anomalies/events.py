"""The events of Monitor V1's ``anomaly.json`` (``alert.dump: true``): their type, the check of
one entry, its phase, and the result type of ``anomaly-analyse``.

An entry maps a key (``<tag_name>_step_<s>_call_<id>``) to an object with exactly the fields
:data:`EVENT_FIELDS`: the integer fields :data:`INT_FIELDS` within 64 bits, ``tag_name`` and
``message`` strings, ``group_mates`` a list of integers. Anything else is a
:class:`~trainprobe.engine.errors.ConfigError` whose one-line message starts with the file and
the event key. The phase (forward, backward, optimizer, unknown) comes from the last ``/`` part of
``tag_name`` (:func:`phase_of`, the table of :mod:`trainprobe.engine.execution_order`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.execution_order import OTHER_TABLE, PHASE_OF_SUFFIX, phase_of_table, short_repr
from trainprobe.engine.log import warn_once
from trainprobe.engine.safe_files import INT_MAX, INT_MIN

#: Integer fields of an event, then the others with their JSON types.
INT_FIELDS: tuple[str, ...] = ("rank", "step", "micro_step", "pp_stage", "vpp_stage", "call_id")
EVENT_FIELDS: tuple[str, ...] = (*INT_FIELDS, "tag_name", "message", "group_mates")

_RULE = re.compile(r"^Rule (\S+) ")


@dataclass(frozen=True, slots=True)
class AnomalyEvent:
    """One anomaly: its key and dict exactly as read, the file it came from and its phase.

    Attributes:
        key: the event's key in ``anomaly.json`` (``<tag_name>_step_<s>_call_<id>``).
        data: the event dict as read (the fields :data:`EVENT_FIELDS`).
        source: the ``anomaly.json`` it came from.
        phase: ``"forward"``, ``"backward"``, ``"optimizer"`` or ``"unknown"``.
        once_per_step: True for events that follow every micro-step of their step.
        position: the row's place among the CSV rows of its step and table, where a tool that
            reads the CSVs too (``report``) found it; None: ``call_id`` orders the event.
    """

    key: str
    data: dict[str, Any]
    source: Path
    phase: str
    once_per_step: bool
    position: int | None = None

    def __getitem__(self, field: str) -> Any:
        """The event's field ``field`` as read (``event["step"]``)."""
        return self.data[field]

    @property
    def rule(self) -> str:
        """The rule named by ``message`` (``Rule AnomalyNan reports ...`` → ``AnomalyNan``), or ''."""
        found = _RULE.match(self.data["message"])
        return found.group(1) if found else ""


@dataclass(frozen=True, slots=True)
class AnalyseResult:
    """What :func:`trainprobe.tools.anomalies.analyser.analyse` found.

    Attributes:
        events: the first ``topk`` events in execution order.
        selected: how many events lie in the selected steps (all of them without a step list).
        found: how many events the files hold.
        files: the ``anomaly.json`` files read, in rank order.
        output: the ``anomaly_analyse.json`` written.
    """

    events: list[AnomalyEvent]
    selected: int
    found: int
    files: list[Path]
    output: Path


def check_event(key: str, value: object, source: Path) -> dict[str, Any]:
    """``value`` as an event dict: exactly the fields :data:`EVENT_FIELDS`, the integer ones
    integers, ``tag_name`` and ``message`` strings, ``group_mates`` a list of integers.

    Raises:
        ConfigError: ``<file>: event '<key>': missing field 'step'`` (or unknown field, wrong type).
    """
    where = f"{source}: event {key!r}"
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected an object, got {type(value).__name__}")
    _check_field_names(value, where)
    for field in INT_FIELDS:
        if not is_int(value[field]):
            raise ConfigError(f"{where}: field {field!r} must be an integer, got {short(value[field])}")
        if not INT_MIN <= value[field] <= INT_MAX:
            raise ConfigError(f"{where}: field {field!r} is outside the 64-bit range [-2**63, 2**63-1]")
    for field in ("tag_name", "message"):
        if not isinstance(value[field], str):
            raise ConfigError(f"{where}: field {field!r} must be a string, got {short(value[field])}")
    mates = value["group_mates"]
    if not isinstance(mates, list) or not all(is_int(m) for m in mates):
        raise ConfigError(f"{where}: field 'group_mates' must be a list of integers, got {short(mates)}")
    if not all(INT_MIN <= m <= INT_MAX for m in mates):
        raise ConfigError(f"{where}: field 'group_mates' holds an integer outside the 64-bit range")
    return value


def _check_field_names(value: dict[str, Any], where: str) -> None:
    """Every field of :data:`EVENT_FIELDS` present, no other (the first missing one named first)."""
    for field in EVENT_FIELDS:
        if field not in value:
            raise ConfigError(f"{where}: missing field {field!r}")
    for field in value:
        if field not in EVENT_FIELDS:
            raise ConfigError(f"{where}: unknown field {field!r} (expected {', '.join(EVENT_FIELDS)})")


def short(value: object) -> str:
    """``repr(value)`` cut to 60 characters (a message stays one short line)."""
    return short_repr(value, 60)


def is_int(value: object) -> bool:
    """Whether ``value`` is an integer (a JSON number without a fraction), ``bool`` excluded."""
    return isinstance(value, int) and not isinstance(value, bool)


def make_event(key: str, value: object, source: Path) -> AnomalyEvent:
    """An :class:`AnomalyEvent` from one entry of ``source`` (checked, phase derived).

    Raises:
        ConfigError: see :func:`check_event`.
    """
    data = check_event(key, value, source)
    phase, once = phase_of(data["tag_name"])
    return AnomalyEvent(key, data, source, phase, once)


def phase_of(tag_name: str) -> tuple[str, bool]:
    """The phase of a tag and whether it happens once per step (after gradient accumulation).

    The last ``/`` part of ``tag_name`` decides (:data:`PHASE_OF_SUFFIX`), e.g.
    ``0:fc1.weight/rank0/grad_reduced`` → ``("backward", True)``,
    ``0:1.self_attention.core_attention_flash_0/rank0/input_grad`` → ``("backward", False)``,
    ``0:fc1.output/rank1/actv`` → ``("forward", False)``, the reference tool's
    ``0:fc1.weight/rank0/acc_grad`` → ``("backward", False)`` and ``.../post_grad`` →
    ``("backward", True)``. In the ``other`` table, rows named ``<param>.mg_direction`` are
    optimizer rows and collective calls are backward rows; both are once per step. A suffix not
    in :data:`PHASE_OF_SUFFIX` gives ``("unknown", False)`` and a warning (once per suffix).
    """
    name, _, suffix = tag_name.rpartition("/")
    if suffix != OTHER_TABLE and suffix not in PHASE_OF_SUFFIX:
        warn_once(
            f"phase:{suffix}",
            f"tag_name {short(tag_name)}: no known phase for {short(suffix)}; ordered before the forward "
            "phase of its micro-step, as the reference tool orders it",
        )
    return phase_of_table(suffix, name.rpartition("/")[0])
