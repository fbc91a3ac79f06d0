"""``generate_wgrad_metrics`` and ``generate_xy_metrics``: the statistics of the current step,
read on demand (any format, ``api`` included).

Rows of the step in progress are read from the probes' pending rows; when there are none yet
(between steps) the latest collected step is read from the memory sink, after the writer has
caught up. Keys are parameter names for gradients and ``<module>.<input|output>[_grad]:<micro
step>`` for activations; values ``{op: value}``.
"""

from __future__ import annotations

from typing import Any

import torch

from trainprobe.engine.log import warn_once
from trainprobe.engine.probes.base import Probe
from trainprobe.engine.probes.module import ModuleProbe
from trainprobe.engine.session import NullSession, Session
from trainprobe.engine.sinks.memory import MemorySink
from trainprobe.frontdoors.monitor_v1 import output

Metrics = dict[str, dict[str, float]]


def find_probe(session: Session | NullSession, kind: type) -> Any:
    """The running session's probe of class ``kind`` (None without one)."""
    return next((p for p in session.probes if isinstance(p, kind)), None)


def wgrad_metrics(session: Session | NullSession, memory: MemorySink) -> tuple[Metrics, Metrics]:
    """``(reduced, unreduced)``: ``reduced`` computed now from the accumulated gradients (where
    there are none, as on MindSpore outside the optimizer call, the step's rows as ``current``
    reads them), ``unreduced`` the current step's rows. Empty without ``wg_distribution`` (warns
    once)."""
    probe = next((p for p in session.probes if p.name == "weight_grad"), None)
    if probe is None:
        warn_once("v1-wgrad-off", 'trainprobe: generate_wgrad_metrics() needs "wg_distribution": true')
        return {}, {}
    keys, values = probe.reduced_rows()  # type: ignore[attr-defined]  # both backends' weight_grad probes have it
    ops = probe.spec.ops
    reduced = {k.name: dict(zip(ops, _host(v))) for k, v in zip(keys, values)}
    if not reduced:
        reduced = current(session, probe, memory, "grad_reduced")
    return reduced, current(session, probe, memory, "grad_unreduced")


def xy_metrics(session: Session | NullSession, memory: MemorySink) -> tuple[Metrics, Metrics]:
    """``(actv, actv_grad)`` of the current step. Empty without ``xy_distribution``."""
    probe = find_probe(session, ModuleProbe)
    if probe is None:
        return {}, {}
    return current(session, probe, memory, "actv"), current(session, probe, memory, "actv_grad")


def current(session: Session | NullSession, probe: Probe, memory: MemorySink, table: str) -> Metrics:
    """Rows of ``table``: the step in progress, else the latest collected step."""
    ops = probe.spec.ops
    pending = {
        output.api_key(k): dict(zip(ops, v))
        for k, v in probe.rows.snapshot()
        if output.table_of(probe.name, k) == table
    }
    if pending:
        return pending
    session.flush()
    return memory.latest(table)[1]


def _host(values: Any) -> list[float]:
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)
