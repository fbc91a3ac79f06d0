"""How ``trainprobe report`` names anomaly events: the target and data type of an analyser
event (a CSV row's or an ``anomaly.json`` alert's), and which ops of a row are non-finite."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import numpy as np

from trainprobe.tools.anomalies.analyser import AnomalyEvent

_TAG = re.compile(r"^(.*)/rank\d+/(.+)$")
#: ``{vpp_stage}:`` before and ``:{micro_step}`` after the target in a V1 tag (the spec's tag form).
_V1_TARGET = re.compile(r"^(?:\d+:)?(.*?)(?::\d+)?$")
#: V1 tags name the gradient tables by task (the spec's tag form): the CSV table each one is.
TABLE_OF_TASK = {"acc_grad": "grad_unreduced", "post_grad": "grad_reduced"}
#: Ops whose value counts non-finite elements: above 0 makes the row non-finite.
COUNT_OPS: frozenset[str] = frozenset({"nans"})


def event_target(event: AnomalyEvent) -> str:
    """The target of an event as the CSV ``name`` column writes it: ``tag_name`` before
    ``/rank<r>/`` without the ``<vpp_stage>:`` prefix and the ``:<micro_step>`` suffix
    (``0:fc1.input:0/rank0/actv`` → ``fc1.input``)."""
    found = _TAG.match(event.data["tag_name"])
    if not found:
        return event.data["tag_name"]
    bare = _V1_TARGET.match(found.group(1))
    return bare.group(1) if bare else found.group(1)


def event_group(event: AnomalyEvent) -> str:
    """The group of an event (V1 table, or V2 ``monitor/scope``): ``tag_name`` after ``/rank<r>/``,
    with the V1 gradient tasks named as their tables (``post_grad`` → ``grad_reduced``)."""
    found = _TAG.match(event.data["tag_name"])
    if not found:
        return ""
    return TABLE_OF_TASK.get(found.group(2), found.group(2))


def bare_target(name: str) -> str:
    """A CSV target without a ``<vpp_stage>:`` prefix or ``:<micro_step>`` suffix (as :func:`event_target`)."""
    bare = _V1_TARGET.match(name)
    return bare.group(1) if bare else name


def describe_values(ops: Sequence[str], values: np.ndarray, known: np.ndarray) -> str:
    """``"NaN in min, max, mean, norm; nans = 1"``: which ops of a row are non-finite."""
    nan = [op for op, v, k in zip(ops, values, known) if k and math.isnan(v)]
    inf = [op for op, v, k in zip(ops, values, known) if k and math.isinf(v)]
    counts = [f"{op} = {v:g}" for op, v, k in zip(ops, values, known) if k and op in COUNT_OPS and v > 0]
    parts = ([f"NaN in {', '.join(nan)}"] if nan else []) + ([f"inf in {', '.join(inf)}"] if inf else []) + counts
    return "; ".join(parts) or "non-finite"
