"""Execution order: the one order in which every offline tool lists monitor rows and anomalies.

"Which came first" must have one answer whichever tool asks: ``anomaly-analyse`` (events of
``anomaly.json``), ``report`` (its NaN/inf scan of the CSVs, the alerts and the timeline's star)
and any tool reading monitor rows (a ``diff`` or ``diagnose`` of two runs). They all sort with
:func:`execution_key`, which takes plain keys, so a tool needs no event object to use it::

    from trainprobe.engine.execution_order import execution_key, row_positions

    key = execution_key(step=30, table="actv", micro_step=0, position=12, rank=0)
    rows.sort(key=lambda r: execution_key(r.step, r.table, target=r.name, micro_step=r.micro,
                                          position=r.position, rank=r.rank))

The order, smallest key first, is the order training computed the rows:

1. ``step``;
2. inside a step, per micro-batch (``micro_step``; rows without one count as micro-step 0):
   forward (activations, modules in call order), then backward (activation gradients, then the
   unreduced weight gradients of that micro-batch); then, once per step after every
   micro-batch, the reduced gradients and collectives, then the optimizer phase (the
   parameters before the step, optimizer state ``exp_avg``, ``exp_avg_sq``, the update
   statistics, ``mg_direction``, the updated parameters);
3. the pipeline stage ``(vpp_stage, pp_stage)``: ascending in the forward phase, descending in
   the backward and optimizer phases (the pipeline runs backward from its last stage);
4. the table, in the order of item 2 (:data:`TABLE_ORDER`);
5. ``position``: the row's place among the rows of its step in its table, in the order the
   monitor wrote them (:func:`row_positions` for CSV rows), or the ``call_id`` of an
   ``anomaly.json`` event (Monitor V1 numbers the rows it checks in the same order). The two
   numberings are comparable only within one source: a tool mixing CSV rows and events
   (``report``) gives each event the position of its CSV row. The weight gradients
   (:data:`BACKWARD_ORDERED`: unreduced and reduced) are written in parameter (model) order but
   computed by backward from the last layer's to the first's (and reduced in that order, DDP's
   buckets too): their position counts from the last row written (:func:`place`), so that the
   last layer's gradient comes first;
6. ``rank``.

``table`` may be a V1 table (``actv``, ``grad_reduced``, ``other`` ...), the last ``/`` part of
a V1 alert tag (trainprobe's table names and the reference tool's ``input``, ``output_grad``,
``acc_grad``, ``post_grad`` ...) or a V2 group ``<monitor>/<scope>`` (``module/forward``,
``weight_grad/reduced`` ...). A table it does not know is phase ``unknown``, placed before the
forward phase of its micro-step as the reference tool places it, with a warning (once per name).
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Iterable
from typing import TYPE_CHECKING, overload

from trainprobe.engine.log import warn_once

if TYPE_CHECKING:
    import numpy as np

FORWARD = "forward"
BACKWARD = "backward"
OPTIMIZER = "optimizer"
#: A table not in :data:`PHASE_OF_SUFFIX` (the reference tool's default stage -1).
UNKNOWN = "unknown"
PHASE_ORDER: dict[str, int] = {UNKNOWN: -1, FORWARD: 0, BACKWARD: 1, OPTIMIZER: 2}

#: The tables (and alert tag suffixes) in the order training computes them within a phase;
#: names on one line share a place (the same kind of row under another name).
TABLE_ORDER: tuple[tuple[str, ...], ...] = (
    # forward: activations and the L2 features computed on a module's forward call
    ("actv", "input", "output"),
    ("linear_hook",),
    ("attention_hook",),
    ("moe_router_weight_hook",),  # the reference tool's MoE router features
    ("moe_router_logit_hook",),
    # backward, per micro-batch: activation gradients, then the weight gradients as accumulated
    ("actv_grad", "input_grad", "output_grad"),
    ("grad_unreduced", "acc_grad", "pre_grad"),
    # once per step after every micro-batch: reduced gradients, then the collectives (``other``)
    ("grad_reduced", "post_grad"),
    ("other",),
    # optimizer: parameters before the step, state, update statistics, mg_direction, parameters after
    ("param_origin", "param"),
    ("exp_avg",),
    ("exp_avg_sq",),
    ("adam_update",),
    ("adam_ratio",),
    ("mg_direction",),
    ("param_updated",),
)
TABLE_RANK: dict[str, int] = {name: rank for rank, names in enumerate(TABLE_ORDER) for name in names}

#: Tables (and alert tag suffixes) whose rows the monitors write in parameter order while
#: backward computes them in the reverse order: the weight gradients, unreduced and reduced.
BACKWARD_ORDERED: frozenset[str] = frozenset({"grad_unreduced", "acc_grad", "pre_grad", "grad_reduced", "post_grad"})

#: Table or tag suffix → phase.
PHASE_OF_SUFFIX: dict[str, str] = {
    **dict.fromkeys(["actv", "input", "output", "linear_hook", "attention_hook"], FORWARD),
    **dict.fromkeys(["moe_router_weight_hook", "moe_router_logit_hook"], FORWARD),
    **dict.fromkeys(["actv_grad", "input_grad", "output_grad", "grad_unreduced", "grad_reduced"], BACKWARD),
    **dict.fromkeys(["acc_grad", "pre_grad", "post_grad"], BACKWARD),
    **dict.fromkeys(["exp_avg", "exp_avg_sq", "param", "param_origin", "param_updated"], OPTIMIZER),
    **dict.fromkeys(["adam_update", "adam_ratio", "mg_direction"], OPTIMIZER),
}
#: The V1 ``other`` table holds ``<param>.mg_direction`` rows (optimizer) and collective calls
#: (counted over the whole step, without a micro-step; ordered as gradient synchronisation, at
#: the end of the backward phase after every micro-step).
OTHER_TABLE = "other"
#: Tables written once per step after gradient accumulation: they follow every micro-step.
ONCE_PER_STEP_SUFFIXES: frozenset[str] = frozenset(
    {"grad_reduced", "post_grad"} | {suffix for suffix, phase in PHASE_OF_SUFFIX.items() if phase == OPTIMIZER}
)

#: V2 ``(monitor, scope)`` → the V1 table holding the same kind of row.
V2_TABLE_OF: dict[tuple[str, str], str] = {
    ("module", "forward"): "actv",
    ("module", "backward"): "actv_grad",
    ("weight_grad", "unreduced"): "grad_unreduced",
    ("weight_grad", "reduced"): "grad_reduced",
    ("optimizer", "exp_avg"): "exp_avg",
    ("optimizer", "exp_avg_sq"): "exp_avg_sq",
    ("param", "param_origin"): "param_origin",
    ("param", "param_updated"): "param_updated",
    ("cc", "comm"): "other",
}
#: V2 monitor → the table of a scope not listed in :data:`V2_TABLE_OF`.
V2_DEFAULT_TABLE: dict[str, str] = {
    "module": "actv",
    "weight_grad": "grad_unreduced",
    "optimizer": "exp_avg",
    "param": "param_origin",
    "cc": "other",
}


def table_of(data_type: str, scope: str | None = None) -> str:
    """The V1 table a row belongs to for ordering: ``data_type`` itself for V1 (a table or an
    alert tag suffix), the equivalent V1 table of a V2 ``monitor`` and ``scope``
    (``("weight_grad", "reduced")`` → ``grad_reduced``; ``"weight_grad/reduced"`` works too)."""
    if scope is None and "/" in data_type:
        data_type, scope = data_type.split("/", 1)
    if scope is None:
        return data_type
    return V2_TABLE_OF.get((data_type, scope), V2_DEFAULT_TABLE.get(data_type, data_type))


def phase_of_table(table: str, target: str = "") -> tuple[str, bool]:
    """``(phase, once per step)`` of a row of ``table`` (see :func:`table_of` for the names
    accepted) and ``target``: ``("forward", False)`` for ``actv``, ``("backward", True)`` for
    ``grad_reduced``; in ``other``, ``<param>.mg_direction`` rows are ``("optimizer", True)`` and
    collective calls ``("backward", True)``. An unknown table is ``("unknown", False)``, with a
    warning once per name."""
    table = table_of(table)
    if table == OTHER_TABLE:
        return (OPTIMIZER, True) if target.endswith(".mg_direction") else (BACKWARD, True)
    phase = PHASE_OF_SUFFIX.get(table)
    if phase is None:
        warn_once(
            f"phase:{table}",
            f"table or tag suffix {short_repr(table)}: no known phase; ordered before the forward phase of its "
            "micro-step, as the reference tool orders it",
        )
        return UNKNOWN, False
    return phase, table in ONCE_PER_STEP_SUFFIXES


def table_rank(table: str, target: str = "") -> int:
    """Place of ``table`` in :data:`TABLE_ORDER` (``mg_direction`` rows of ``other`` in theirs);
    -1 for an unknown table."""
    table = table_of(table)
    if table == OTHER_TABLE and target.endswith(".mg_direction"):
        return TABLE_RANK["mg_direction"]
    return TABLE_RANK.get(table, -1)


def in_backward_order(table: str) -> bool:
    """Whether rows of ``table`` (see :func:`table_of` for the names accepted) ran in the reverse
    of the order they were written (:data:`BACKWARD_ORDERED`)."""
    return table_of(table) in BACKWARD_ORDERED


def place(table: str, position: int) -> int:
    """The key's place of the row at ``position`` (its place in its step as written, 0 first)
    of ``table``: ``-position`` for a table in :data:`BACKWARD_ORDERED` (the last row written ran
    first), else ``position``."""
    return -position if in_backward_order(table) else position


def execution_key(
    step: int,
    table: str,
    *,
    target: str = "",
    micro_step: int | None = 0,
    position: int = 0,
    rank: int = 0,
    vpp_stage: int = 0,
    pp_stage: int = 0,
) -> tuple[int, ...]:
    """Sort key of execution order (see the module docstring), a tuple of ints: smaller keys ran
    earlier. ``target`` matters only for the ``other`` table (``mg_direction`` rows);
    ``micro_step`` None counts as 0; ``position`` is the row's place in its step and table
    (:func:`row_positions`) or an event's ``call_id``, as written: the key holds its
    :func:`place` (weight gradients counted from the last row, backward's order)."""
    phase, once = phase_of_table(table, target)
    micro = (1, 0) if once else (0, micro_step or 0)
    stages = (vpp_stage, pp_stage) if phase in (FORWARD, UNKNOWN) else (-vpp_stage, -pp_stage)
    return (step, *micro, PHASE_ORDER[phase], *stages, table_rank(table, target), place(table, position), rank)


@overload
def row_positions(keys: np.ndarray) -> np.ndarray: ...


@overload
def row_positions(keys: Iterable[Hashable]) -> list[int]: ...


def row_positions(keys: Iterable[Hashable] | np.ndarray) -> list[int] | np.ndarray:
    """For rows in file order with these keys, each row's place among the earlier rows with the
    same key (0, 1, 2 ... per key), the one row numbering of the offline tools:

    * keys = the rows' steps: the ``position`` of :func:`execution_key` for CSV rows
      (``[3, 3, 4, 3]`` → ``[0, 1, 0, 2]``);
    * keys = ``(step, target)``: the call index that keeps apart the rows of a module called twice
      in one step (csv2db's ``call_index``).

    A list (or any iterable) of hashable keys gives a list. A numpy array gives an ``int64``
    array, computed without a Python step per row: a 1-D array holds one key per row, a 2-D array
    one key per row of it (``[[step, target_id], ...]``). Rows of one file, in the order the
    monitor wrote them, are what the numbering is meant for."""
    numpy = sys.modules.get("numpy")  # an array can only come from an imported numpy
    if numpy is not None and isinstance(keys, numpy.ndarray):
        return _array_positions(keys)
    seen: dict[Hashable, int] = {}
    out = []
    for key in keys:
        count = seen.get(key, 0)
        seen[key] = count + 1
        out.append(count)
    return out


def _array_positions(keys: np.ndarray) -> np.ndarray:
    """:func:`row_positions` of a numpy array: a stable sort groups equal keys in row order, each
    row's place is its distance from the start of its group."""
    import numpy as np

    if keys.ndim == 2:
        keys = np.unique(keys, axis=0, return_inverse=True)[1].reshape(-1)
    elif keys.ndim != 1:
        raise ValueError(f"row_positions: expected a 1-D or 2-D array of keys, got {keys.ndim} dimensions")
    order = np.argsort(keys, kind="stable")
    ordered = keys[order]
    starts = np.r_[0, np.flatnonzero(ordered[1:] != ordered[:-1]) + 1]
    first_of_group = np.repeat(starts, np.diff(np.r_[starts, len(ordered)]))
    positions = np.empty(len(keys), dtype=np.int64)
    positions[order] = np.arange(len(keys)) - first_of_group
    return positions


def short_repr(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters (a message about input stays one short line)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
