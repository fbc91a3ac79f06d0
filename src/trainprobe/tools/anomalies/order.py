"""Which anomaly events ``anomaly-analyse`` keeps, and in which order: the execution-order key of
an event (the shared :func:`trainprobe.engine.execution_order.execution_key`), the stable sort, the
step selection and the checks of ``topk`` and ``step_list``.

A bad ``topk`` or step list raises :class:`~trainprobe.engine.errors.ConfigError` with a one-line
message naming the argument (``topk: expected an integer >= 1, got 0``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.execution_order import execution_key as row_execution_key
from trainprobe.engine.safe_files import bounded_int
from trainprobe.tools.anomalies.events import AnomalyEvent, is_int, short

#: ``<target>/rank<r>/<table>``: the table may be a V2 ``<monitor>/<scope>`` group.
_RANK_TAG = re.compile(r"^(.*)/rank\d+/(.+)$", re.DOTALL)
_STEP = re.compile(r"[0-9]+")


def execution_key(event: AnomalyEvent) -> tuple[int, ...]:
    """Sort key of execution order (see :mod:`trainprobe.tools.anomalies.analyser`): the shared
    :func:`trainprobe.engine.execution_order.execution_key` of the event's step, table (what
    follows ``/rank<r>/`` in ``tag_name``: a V1 table or tag suffix, or a V2 ``monitor/scope``
    group as the report names its onsets), target, micro-step, position (``call_id`` unless a tool set
    :attr:`AnomalyEvent.position`), rank and pipeline stages."""
    data = event.data
    tagged = _RANK_TAG.match(data["tag_name"])  # a V2 group has a '/' too: weight_grad/reduced
    if tagged:
        target, table = tagged.groups()
    else:
        name, _, table = data["tag_name"].rpartition("/")
        target = name.rpartition("/")[0]
    return row_execution_key(
        data["step"],
        table,
        target=target,
        micro_step=data["micro_step"],
        position=data["call_id"] if event.position is None else event.position,
        rank=data["rank"],
        vpp_stage=data["vpp_stage"],
        pp_stage=data["pp_stage"],
    )


def order_events(events: Iterable[AnomalyEvent]) -> list[AnomalyEvent]:
    """``events`` in execution order (stable: equal keys keep their reading order)."""
    return sorted(events, key=execution_key)


def select_steps(events: Iterable[AnomalyEvent], step_list: Sequence[int] | None) -> list[AnomalyEvent]:
    """The events whose step is in ``step_list`` (None or empty: every event)."""
    if not step_list:
        return list(events)
    wanted = set(step_list)
    return [e for e in events if e.data["step"] in wanted]


def parse_step_list(text: str) -> list[int]:
    """``"[2,3]"``, ``"2,3"``, ``"2"``, ``"[]"`` or ``""`` → a list of steps (empty: every step).

    Raises:
        ConfigError: anything else, e.g. ``"[2,x]"`` or ``"-1"``.
    """
    body = text.strip()
    if body.startswith("[") and body.endswith("]"):
        body = body[1:-1].strip()
    if not body:
        return []
    steps: list[int] = []
    for part in body.split(","):
        item = part.strip()
        if not _STEP.fullmatch(item):
            raise ConfigError(f"step_list: {short(text)} is not a list of steps >= 0 such as [2,3] or 2,3")
        steps.append(bounded_int(item, "step", "step_list"))
    return steps


def check_step_list(step_list: Iterable[int] | None) -> list[int]:
    """``step_list`` as a list of steps >= 0 (None: empty, every step).

    Raises:
        ConfigError: an item is not an integer >= 0.
    """
    steps = list(step_list or [])
    for step in steps:
        if not is_int(step) or step < 0:
            raise ConfigError(f"step_list: expected integers >= 0, got {step!r}")
    return steps


def check_topk(topk: object) -> int:
    """``topk`` as an integer >= 1.

    Raises:
        ConfigError: anything else.
    """
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ConfigError(f"topk: expected an integer >= 1, got {topk!r}")
    return topk
