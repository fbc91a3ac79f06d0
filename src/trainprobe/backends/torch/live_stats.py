"""Live full-tensor statistics (Monitor V2 ``"global_stats": true``): each step, every rank holds
the statistics of the *full* tensors it holds a piece of, not only of its local shard.

Under FSDP2, tensor parallelism (DTensor) and their 2-D mixes a row summarises the rank's local
piece (:mod:`trainprobe.backends.torch.placement`). The read side merges the pieces after the
run (:mod:`trainprobe.tools.sql.full`); online rules need the merged values while training
runs. :class:`GlobalStatsProbe` gives them with one collective per collected step, whatever the
number of tensors:

* at start, the ranks agree once (an all-gather of their pickled slot lists) on one *slot* per
  sharded tensor and mesh: ``(table, name, scope, mesh ranks)``;
* after ``optimizer.step()``, each rank packs the local statistics of its pieces into one flat
  float64 tensor, one row per slot: the summed fields (norm², mean·numel, nans, zeros·numel,
  numel, NaN flags of min/max) then the maximised ones (max, −min); a slot this rank does not
  hold, an empty piece or a replicated copy of a piece (coordinate ≠ 0 along a ``Replicate``
  mesh dimension) contributes the neutral value (0, −inf). One ``all_gather`` of that tensor
  (``slots × 8`` values a rank) per collected step, whatever the number of tensors, the same
  call on every rank; each rank then sums and maximises over the ranks itself (in rank order,
  so every rank gets the same bits). No host synchronisation per tensor (on an accelerator the
  rows stay on the device; the values reach the host only when
  :meth:`GlobalStatsProbe.global_stats` is called);
* the merged statistics are those of the full tensor: ``norm`` = √Σ norm², ``mean`` and
  ``zeros`` element-weighted, ``nans`` summed, ``min``/``max`` exact (NaN when a piece has a
  NaN, as ``torch.max`` of the full tensor gives).

Before the update (:meth:`GlobalStatsProbe.judge_before_update`, Monitor V2's
``anomaly.before_update`` with ``global_stats``): the rows known before ``optimizer.step()``
(``weight_grad`` ``reduced``, ``param`` ``param_origin``, :data:`BEFORE_UPDATE`) are gathered in
the optimizer's pre-step hook instead, so the pre-step rules judge full tensors; the other rows
(``param_updated``, the Adam moments) after the step as before. With only ``weight_grad`` on (what
``before_update`` needs) that is still one collective per collected step, issued at the same point
on every rank; with ``param`` or ``optimizer`` on too, one before the update and one after.

Besides DTensors, two layouts of :mod:`~trainprobe.backends.torch.placement` are merged:

* FSDP1 (``FullyShardedDataParallel``, :func:`~trainprobe.backends.torch.placement.fsdp1_layouts`):
  with ``use_orig_params=True`` each rank's row of a parameter is its 1-D part of the flat shard
  (an empty part contributes nothing); with ``use_orig_params=False`` the row is of the rank's
  piece of the ``FlatParameter``, whose padding zeros are left out of the element count, the mean
  and ``zeros``; a min or max that a padding zero may be (the padded rank's min is 0 and no other
  piece is at or below 0, the same for the max) is not known and left out of the merged values
  (never the padding's 0); the pieces merge over the unit's shard group;
* ``ZeroRedundancyOptimizer`` (:func:`~trainprobe.backends.torch.placement.zero_state_holders`):
  a parameter's ``optimizer`` rows (its moments) exist on the rank keeping its state only; every
  rank gets them through the collective.

The FSDP1 units and the ``ZeroRedundancyOptimizer`` are read from the ``chunks`` and
``optimizers`` given to :class:`GlobalStatsProbe`, or, when not given, from its sources (the
``weight_grad`` probe's modules, the ``optimizer`` probe's optimizer view).

Tensors whose local rows already are the full tensor's (a whole tensor, a ``Replicate``-only
DTensor, the moments on the one rank keeping them) are given from the local rows, with no
collective. Left out: ``partial`` tensors (a
summand), Megatron-attribute shards (no mesh says which ranks hold the other pieces),
``unreduced`` gradients (each rank's own before the reduction), and a slot whose pieces do not
add up to the tensor's elements this step (a rank's rows are missing: its monitor failed).

The collectives are the process group's own (``ProcessGroup.allgather``), not the
``torch.distributed`` functions the ``cc`` monitor records: trainprobe's traffic is never a
``cc`` row.

A fault in packing is logged once and this rank contributes neutral values from then on (the
collectives go on, so no rank waits for another); a failing collective is logged once and ends
the live statistics on this rank.
"""

from __future__ import annotations

import math
import pickle
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist

from trainprobe.backends.torch.placement import is_dtensor
from trainprobe.engine.log import error_once
from trainprobe.engine.probes.base import Probe, ProbeSpec, StepClock
from trainprobe.engine.probes.model_view import NamedParam

if TYPE_CHECKING:
    from trainprobe.engine.backend import Backend

TABLE_SCOPES: dict[str, tuple[str, ...]] = {
    "weight_grad": ("reduced",),
    "param": ("param_origin", "param_updated"),
    "optimizer": ("exp_avg", "exp_avg_sq"),
}
"""The rows given full-tensor values: table → scopes."""
BEFORE_UPDATE: frozenset[tuple[str, str]] = frozenset({("weight_grad", "reduced"), ("param", "param_origin")})
"""The rows (table, scope) known before ``optimizer.step()``: gathered before it with
:meth:`GlobalStatsProbe.judge_before_update`."""
KEPT_STEPS = 8
"""How many of the latest collected steps :meth:`GlobalStatsProbe.global_stats` can answer."""
_SUM_FIELDS = 8  # norm², Σ mean·numel, nans, Σ zeros·numel, numel, NaN flags, unknown max, unknown min
_MAX_FIELDS = 2  # max, −min
_FIELDS = _SUM_FIELDS + _MAX_FIELDS


class StatKey(NamedTuple):
    """Which tensor a full-tensor value is of: the table (``weight_grad``, ``param``,
    ``optimizer``), the row name (``module_name`` in the CSV) and its scope."""

    table: str
    name: str
    scope: str


@dataclass(frozen=True, slots=True)
class Piece:
    """What this rank holds of one tensor.

    Attributes:
        group: the ranks holding its pieces (the DTensor mesh's, in mesh order); ``()`` when the
            local tensor is the full one (whole, or replicated on every mesh rank).
        contributes: whether this rank's piece counts (False on every copy but the first along
            ``Replicate`` mesh dimensions, and for an empty piece).
        numel: elements of the local piece (its row's statistics are of that many).
        global_numel: elements of the full tensor.
        padding: how many of the ``numel`` elements are padding zeros of no tensor (the end of
            an FSDP1 flat shard).
        replicated: whether copies of the pieces repeat over ``group`` (a ``Replicate``
            placement on a mesh dimension of more than one rank).
    """

    group: tuple[int, ...]
    contributes: bool
    numel: int
    global_numel: int
    padding: int = 0
    replicated: bool = False

    @property
    def sharded(self) -> bool:
        """Whether the full tensor is spread over several ranks (needs the collective)."""
        return bool(self.group)


def piece_of(t: Any) -> Piece | None:
    """How ``t`` (a parameter, a DTensor, a plain tensor) merges, or None when it cannot be
    merged live (a ``Partial`` placement, a Megatron-attribute shard)."""
    if not is_dtensor(t):
        if getattr(t, "tensor_model_parallel", False):
            return None
        return Piece((), True, int(t.numel()), int(t.numel()))
    placements = tuple(t.placements)
    if any(p.is_partial() for p in placements):
        return None
    mesh = t.device_mesh
    numel, global_numel = int(t.to_local().numel()), int(t.numel())
    cut = [not p.is_replicate() for p in placements]  # Shard, and _StridedShard (whose is_shard() is False)
    if not any(cut):
        return Piece((), True, numel, global_numel)
    coordinate = mesh.get_coordinate()
    first_copy = coordinate is not None and all(c == 0 for c, split in zip(coordinate, cut) if not split)
    group = tuple(int(r) for r in mesh.mesh.flatten().tolist())
    replicated = any(not split and size > 1 for split, size in zip(cut, mesh.shape))
    return Piece(group, first_copy and numel > 0, numel, global_numel, replicated=replicated)


def layout_piece(layout: dict[str, Any], group: tuple[int, ...]) -> Piece:
    """The piece an FSDP1 row layout (:func:`~trainprobe.backends.torch.placement.fsdp1_layouts`)
    describes, merged over ``group``: its ``numel`` elements, the last ``padding`` of them FSDP's
    zeros; it counts when it holds an element of the tensor."""
    numel, padding = int(layout["numel"]), int(layout.get("padding") or 0)
    return Piece(group, numel - padding > 0, numel, math.prod(int(s) for s in layout["global_shape"]), padding)


@dataclass(frozen=True, slots=True)
class Layouts:
    """What :func:`_pieces` reads besides the parameters: FSDP1's row layouts and shard groups
    (by parameter ``id``), the global rank keeping each ``ZeroRedundancyOptimizer`` parameter's
    state, and this rank."""

    flat: dict[int, dict[str, Any]]
    groups: dict[int, tuple[int, ...]]
    state_holders: dict[int, int]
    rank: int

    @classmethod
    def read(cls, chunks: Sequence[Any], optimizers: Sequence[Any]) -> Layouts:
        """The layouts of ``chunks`` (modules) and ``optimizers`` (torch optimizers)."""
        from trainprobe.backends.torch.placement import fsdp1_layouts, fsdp1_shard_groups, zero_state_holders

        flat = {key: rows for key, (rows, _) in fsdp1_layouts(chunks).items()}
        rank = dist.get_rank() if world_size() > 1 else 0
        return cls(flat, fsdp1_shard_groups(chunks), zero_state_holders(optimizers), rank)


def _pieces(params: Sequence[NamedParam], tables: Sequence[str], layouts: Layouts | None = None) -> dict[StatKey, Piece]:
    """Every row of ``tables`` given full-tensor values, with its piece."""
    out: dict[StatKey, Piece] = {}
    for named in params:
        t = named.param
        if layouts is not None and id(t) in layouts.flat and id(t) in layouts.groups:
            piece: Piece | None = layout_piece(layouts.flat[id(t)], layouts.groups[id(t)])
        else:
            piece = piece_of(t)
        if piece is None:
            continue
        for table in tables:
            for scope in TABLE_SCOPES[table]:
                name = f"{named.name}.{scope}" if table == "optimizer" else named.name
                out[StatKey(table, name, scope)] = _state_piece(t, piece, layouts) if table == "optimizer" else piece
    return out


def _state_piece(t: Any, piece: Piece, layouts: Layouts | None) -> Piece:
    """``piece`` for ``t``'s optimizer state: under ``ZeroRedundancyOptimizer`` the whole tensor on
    the one rank keeping it (every rank then gets it through the collective)."""
    if layouts is None or id(t) not in layouts.state_holders or piece.sharded:
        return piece
    holder = layouts.state_holders[id(t)]
    return Piece((holder,), holder == layouts.rank, piece.numel, piece.global_numel)


def _sources_context(sources: Sequence[Probe]) -> tuple[list[Any], list[Any]]:
    """``(FSDP1 modules, torch optimizers)`` the sources were built over, where they show them:
    the ``FullyShardedDataParallel`` units among the ``weight_grad`` probe's ``modules``
    (``(name, module)`` pairs), the ``optimizer`` probe's optimizer view's ``optimizers``."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # torch without FSDP
        FullyShardedDataParallel = ()  # type: ignore[assignment,misc]  # noqa: N806 - isinstance of nothing
    modules: list[Any] = []
    optimizers: list[Any] = []
    for probe in sources:
        entries = getattr(probe, "modules", None)
        for entry in entries if isinstance(entries, (list, tuple)) else ():
            module = entry[1] if isinstance(entry, tuple) and len(entry) == 2 else entry
            if isinstance(module, FullyShardedDataParallel):
                modules.append(module)
        view = getattr(probe, "optimizer", None)
        for o in getattr(view, "optimizers", None) or ():
            if isinstance(o, torch.optim.Optimizer) and not any(o is seen for seen in optimizers):
                optimizers.append(o)
    return modules, optimizers


@dataclass(frozen=True, slots=True)
class Holders:
    """Who holds a sharded tensor's pieces at a step, worded as ``trainprobe diagnose`` words a
    full-tensor row (:class:`~trainprobe.engine.anomaly.finding.Anomaly`'s ``ranks``, ``held``,
    ``bad_ranks``).

    Attributes:
        ranks: every rank holding a piece (sorted).
        held: ``"shards"``, or ``"<n> shards, replicated"`` when copies of the pieces repeat.
        bad_ranks: the ranks whose contributing piece has a NaN/inf statistic this step.
    """

    ranks: tuple[int, ...]
    held: str
    bad_ranks: tuple[int, ...]


@dataclass
class _Step:
    """One collected step's gathered buffer (``[world, slots, fields]``) and local rows, made
    host values on first read."""

    gathered: torch.Tensor
    local: dict[StatKey, Any]  # key → its row values (a list, or a device tensor)
    values: dict[StatKey, dict[str, float]] | None = None


class GlobalStatsProbe(Probe):
    """The live full-tensor statistics of ``sources`` (the ``weight_grad``, ``param`` and
    ``optimizer`` probes of one session), computed after each collected ``optimizer.step()``.

    Must be the session's last probe (its :meth:`after_optimizer_step` reads the rows the
    others took for the step). :meth:`attach` agrees on the slots with every other rank (a
    collective: every rank starts its monitor). ``chunks`` (the model's modules) and
    ``optimizers`` (the torch optimizers stepped) say where FSDP1 units and a
    ``ZeroRedundancyOptimizer`` are; None: read from the sources (see the module docstring)."""

    name = "global_stats"

    def __init__(
        self,
        clock: StepClock,
        sources: Sequence[Probe],
        params: Sequence[NamedParam],
        *,
        backend: Backend,
        chunks: Sequence[Any] | None = None,
        optimizers: Sequence[Any] | None = None,
    ) -> None:
        super().__init__(clock, ProbeSpec(("norm",), 1e-8), backend=backend)
        self.sources = {p.name: p for p in sources if p.name in TABLE_SCOPES}
        found_modules, found_optimizers = _sources_context(sources)
        layouts = Layouts.read(
            found_modules if chunks is None else chunks, found_optimizers if optimizers is None else optimizers
        )
        self._rank = layouts.rank
        self.pieces = _pieces(params, list(self.sources), layouts)
        self.slots: dict[tuple[str, str, str, tuple[int, ...]], int] = {}  # agreed by every rank
        self._slot_of: dict[StatKey, int] = {}  # this rank's sharded rows → their slot
        self.collectives = 0  # issued by this probe so far
        self._device = torch.device("cpu")
        self._steps: OrderedDict[int, _Step] = OrderedDict()
        self._packing_failed = False
        self._broken = False
        self.early = False  # judge_before_update: the rows known before the update gathered then

    # -- start -----------------------------------------------------------------------------
    def attach(self) -> None:
        """Agree with every other rank on the slots (once, at start)."""
        mine = sorted({_slot(key, piece) for key, piece in self.pieces.items() if piece.sharded})
        everyone: list[Any] = [mine]
        if world_size() > 1:
            self._device = _collective_device()
            everyone = _gather_objects(mine, self._device)
        union = sorted({(s[0], s[1], s[2], tuple(s[3])) for slots in everyone for s in (slots or [])})
        self.slots = {slot: i for i, slot in enumerate(union)}
        self._slot_of = {k: self.slots[_slot(k, p)] for k, p in self.pieces.items() if p.sharded}

    def judge_before_update(self) -> None:
        """Gather the rows known before the update (:data:`BEFORE_UPDATE`) in the pre-step hook,
        so that :meth:`global_stats` of the step in progress gives their full-tensor values to a
        check made before ``optimizer.step()`` (call before the session starts, on every rank)."""
        self.early = True

    # -- each step -------------------------------------------------------------------------
    def before_optimizer_step(self) -> None:
        """With :meth:`judge_before_update`: gather the rows known now (one collective)."""
        if self.early and not self._broken:
            self._gather_part(True)

    def after_optimizer_step(self) -> None:
        """Pack this rank's pieces, gather them from every rank (one collective), keep the
        step's buffer (with :meth:`judge_before_update`: the rows the pre-step hook did not
        gather; no collective when there are none)."""
        if not self._broken:
            self._gather_part(False if self.early else None)

    def _gather_part(self, before: bool | None) -> None:
        """Gather this step's slots of one part: the rows known ``before`` the update (True),
        the others (False), or all of them (None); the step's buffer keeps the other part's."""
        step = self.clock.step
        slots = self._part_slots(before)
        local, sums, maxes = self._contribution(before)
        mine = torch.cat([sums, maxes], dim=1)
        part = mine[slots] if before is not None else mine
        gathered = part.unsqueeze(0)
        if part.shape[0]:
            try:
                gathered = _gather(part)
                self.collectives += 1
            except Exception as exc:  # noqa: BLE001 - a monitor must never break training
                self._broken = True
                error_once(
                    f"global-stats-collective-{id(self)}",
                    f"trainprobe: global_stats: the collective failed ({type(exc).__name__}: {exc}); live "
                    "full-tensor statistics are off on this rank for the rest of the run",
                )
                return
        self._keep(step, local, gathered, slots if before is not None else None)

    def _part_slots(self, before: bool | None) -> torch.Tensor:
        """The slot indices of a part (see :meth:`_gather_part`), the same on every rank."""
        chosen = [i for slot, i in self.slots.items() if before is None or ((slot[0], slot[2]) in BEFORE_UPDATE) == before]
        return torch.tensor(sorted(chosen), dtype=torch.long, device=self._device)

    def _keep(self, step: int, local: dict[StatKey, Any], gathered: torch.Tensor, slots: torch.Tensor | None) -> None:
        """Keep ``step``'s gathered part (``slots``: its slot indices; None: every slot)."""
        held = self._steps.get(step)
        if slots is None or held is None:
            if slots is not None:  # the first part of the step: the other part's slots neutral for now
                full = torch.cat(self._neutral(), dim=1).unsqueeze(0).repeat(world_size(), 1, 1)
                full[:, slots] = gathered
                gathered = full
            self._steps[step] = _Step(gathered, local)
        else:
            held.gathered[:, slots] = gathered
            held.local.update(local)
            held.values = None
        while len(self._steps) > KEPT_STEPS:
            self._steps.popitem(last=False)

    def _contribution(self, before: bool | None = None) -> tuple[dict[StatKey, Any], torch.Tensor, torch.Tensor]:
        """This rank's local full rows and its SUM/MAX buffers of one part (see
        :meth:`_gather_part`; neutral once packing failed)."""
        if not self._packing_failed:
            try:
                return self._pack(before)
            except Exception as exc:  # noqa: BLE001 - the collectives must still run
                self._packing_failed = True
                error_once(
                    f"global-stats-pack-{id(self)}",
                    f"trainprobe: global_stats: packing this rank's statistics failed ({type(exc).__name__}: "
                    f"{exc}); its pieces are left out from now on (the merged values of those tensors are missing)",
                )
        return {}, *self._neutral()

    def _neutral(self) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self.slots)
        sums = torch.zeros(n, _SUM_FIELDS, dtype=torch.float64, device=self._device)
        maxes = torch.full((n, _MAX_FIELDS), -math.inf, dtype=torch.float64, device=self._device)
        return sums, maxes

    def _pack(self, before: bool | None = None) -> tuple[dict[StatKey, Any], torch.Tensor, torch.Tensor]:
        local: dict[StatKey, Any] = {}
        sums, maxes = self._neutral()
        for table, probe in self.sources.items():
            keys, values = probe.rows.pending()
            picked_rows: list[Any] = []
            picked: list[tuple[int, int, int]] = []  # (slot, numel, padding)
            for key, row in zip(keys, values):
                stat = StatKey(table, key.name, key.scope)
                piece = self.pieces.get(stat)
                if piece is None or (before is not None and ((table, key.scope) in BEFORE_UPDATE) != before):
                    continue
                if not piece.sharded:
                    local[stat] = row
                elif piece.contributes:
                    picked_rows.append(row)
                    picked.append((self._slot_of[stat], piece.numel, piece.padding))
            if picked_rows:
                self._scatter(sums, maxes, probe.spec.ops, picked_rows, picked)
        return local, sums, maxes

    def _scatter(
        self,
        sums: torch.Tensor,
        maxes: torch.Tensor,
        ops: Sequence[str],
        rows: list[Any],
        picked: list[tuple[int, int, int]],
    ) -> None:
        """Write the SUM/MAX contributions of ``rows`` (one table's, in ``ops`` order; ``picked``:
        their slots, element counts and padding zeros) into the buffers: a few tensor operations
        per table. A padded piece's min (max) is not known when it is not below (above) 0: a
        padding zero may be it; it is then flagged instead of maximised."""
        values = _stack(rows, self._device)
        index = torch.tensor([slot for slot, _, _ in picked], dtype=torch.long, device=self._device)
        numel = torch.tensor([n for _, n, _ in picked], dtype=torch.float64, device=self._device)
        padding = torch.tensor([p for _, _, p in picked], dtype=torch.float64, device=self._device)
        padded = padding > 0
        zero = torch.zeros_like(numel)

        def column(op: str) -> torch.Tensor | None:
            return values[:, ops.index(op)] if op in ops else None

        norm, mean, nans, zeros = column("norm"), column("mean"), column("nans"), column("zeros")
        hi, lo = column("max"), column("min")
        nan_flags = zero
        for extreme in (hi, lo):
            if extreme is not None:
                nan_flags = nan_flags + extreme.isnan().to(torch.float64)
        hi_unknown = padded & (hi <= 0) if hi is not None else torch.zeros_like(padded)
        lo_unknown = padded & (lo >= 0) if lo is not None else torch.zeros_like(padded)
        part = torch.stack(
            [
                norm * norm if norm is not None else zero,
                mean * numel if mean is not None else zero,
                nans if nans is not None else zero,
                zeros * numel - padding if zeros is not None else zero,
                numel - padding,
                nan_flags,
                hi_unknown.to(torch.float64),
                lo_unknown.to(torch.float64),
            ],
            dim=1,
        )
        sums.index_copy_(0, index, part)
        neg_inf = torch.full_like(numel, -math.inf)
        top = hi.nan_to_num(nan=-math.inf).masked_fill(hi_unknown, -math.inf) if hi is not None else neg_inf
        bottom = (-lo).nan_to_num(nan=-math.inf).masked_fill(lo_unknown, -math.inf) if lo is not None else neg_inf
        maxes.index_copy_(0, index, torch.stack([top, bottom], dim=1))

    # -- reading ---------------------------------------------------------------------------
    def sharded(self) -> frozenset[StatKey]:
        """The rows of this rank whose full-tensor values come from the collective (the others
        given are this rank's own rows: whole or replicated tensors, and the optimizer state a
        ``ZeroRedundancyOptimizer`` keeps on this rank alone)."""
        return frozenset(key for key in self._slot_of if self.pieces[key].group != (self._rank,))

    def holders(self, step: int, key: StatKey) -> Holders | None:
        """Who holds ``key``'s pieces at ``step`` (None: not a sharded row, or the step is not
        kept)."""
        held, slot = self._steps.get(step), self._slot_of.get(key)
        if held is None or slot is None:
            return None
        piece = self.pieces[key]
        rows = held.gathered[:, slot, :].cpu()
        sums, maxes = rows[:, :_SUM_FIELDS], rows[:, _SUM_FIELDS:]
        bad = (~sums.isfinite()).any(dim=1) | (sums[:, 2] > 0) | (sums[:, 5] > 0) | (maxes == math.inf).any(dim=1)
        pieces = int((sums[:, 4] > 0).sum())
        text = "whole" if len(piece.group) == 1 else f"{pieces} shards, replicated" if piece.replicated else "shards"
        return Holders(tuple(sorted(piece.group)), text, tuple(int(r) for r in bad.nonzero().flatten().tolist()))

    def global_stats(self, step: int | None = None) -> dict[StatKey, dict[str, float]]:
        """The full-tensor statistics of ``step`` (default: the latest collected step), as
        ``{StatKey(table, name, scope): {op: value}}`` with the table's ops; ``{}`` for a step
        not collected or no longer kept (the last :data:`KEPT_STEPS` are)."""
        if step is None:
            step = next(reversed(self._steps), None) if self._steps else None
        held = self._steps.get(step) if step is not None else None
        if held is None:
            return {}
        if held.values is None:
            held.values = self._values(held)
        return held.values

    def _values(self, held: _Step) -> dict[StatKey, dict[str, float]]:
        out: dict[StatKey, dict[str, float]] = {}
        for key, row in held.local.items():
            ops = self.sources[key.table].spec.ops
            out[key] = dict(zip(ops, (float(v) for v in _host(row))))
        sums, maxes = _combine(held.gathered)
        for key, slot in self._slot_of.items():
            global_numel = self.pieces[key].global_numel
            merged = _merge(self.sources[key.table].spec.ops, sums[slot], maxes[slot], global_numel)
            if merged is not None:
                out[key] = merged
        return out


def _slot(key: StatKey, piece: Piece) -> tuple[str, str, str, tuple[int, ...]]:
    """The slot of a sharded tensor: its row and the ranks holding its pieces."""
    return (key.table, key.name, key.scope, piece.group)


def _merge(ops: Sequence[str], sums: list[float], maxes: list[float], global_numel: int) -> dict[str, float] | None:
    """The full tensor's ``ops`` from one slot's reduced sums and maxima; None when the pieces
    do not add up to the tensor (a rank's rows are missing). A min (max) a padding zero may be
    is left out: a padded piece's was not known and no known piece is at or below (above) 0."""
    norm2, mean_w, nans, zeros_w, numel, nan_flags, hi_unknown, lo_unknown = sums
    if numel != global_numel:
        return None
    hi, neg_lo = maxes
    empty = numel == 0
    merged = {
        "norm": math.sqrt(norm2) if norm2 >= 0 or math.isnan(norm2) else math.nan,
        "mean": math.nan if empty else mean_w / numel,
        "nans": nans,
        "zeros": 0.0 if empty else zeros_w / numel,
        "max": math.nan if nan_flags or empty else hi,
        "min": math.nan if nan_flags or empty else -neg_lo,
    }
    if hi_unknown and not nan_flags and not hi >= 0:
        del merged["max"]
    if lo_unknown and not nan_flags and not -neg_lo <= 0:
        del merged["min"]
    return {op: merged[op] for op in ops if op in merged}


def _combine(gathered: torch.Tensor) -> tuple[list[list[float]], list[list[float]]]:
    """Every slot's sums and maxima over the ranks of a gathered ``[world, slots, fields]``
    buffer: summed in rank order (NaN propagates), maximised (the maxima hold no NaN)."""
    sums = gathered[0, :, :_SUM_FIELDS].clone()
    for contribution in gathered[1:]:
        sums += contribution[:, :_SUM_FIELDS]
    maxes = gathered[:, :, _SUM_FIELDS:].amax(dim=0)
    return sums.tolist(), maxes.tolist()


def _gather(mine: torch.Tensor) -> torch.Tensor:
    """``mine`` of every rank, stacked ``[world, ...]``: one ``allgather`` on the default
    process group itself (not through ``torch.distributed.all_gather``, which ``cc`` records)."""
    group = dist.distributed_c10d._get_default_group()
    out = torch.empty((group.size(), *mine.shape), dtype=mine.dtype, device=mine.device)
    group.allgather([list(out.unbind(0))], [mine.contiguous()]).wait()
    return out


def _gather_objects(mine: Any, device: torch.device) -> list[Any]:
    """``mine`` (picklable) of every rank, in rank order: two gathers (the sizes, then the padded
    bytes) on the default process group itself, out of ``cc``'s sight."""
    data = torch.frombuffer(bytearray(pickle.dumps(mine)), dtype=torch.uint8).to(device)
    sizes = _gather(torch.tensor([data.numel()], dtype=torch.int64, device=device)).flatten().tolist()
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    everyone = _gather(padded).cpu()
    return [pickle.loads(bytes(everyone[r, :n].tolist())) for r, n in enumerate(sizes)]  # noqa: S301 - our own ranks


def _stack(rows: list[Any], device: torch.device) -> torch.Tensor:
    """One ``[rows, ops]`` float64 tensor on ``device`` from host lists or device rows."""
    if all(isinstance(r, list) for r in rows):
        return torch.tensor(rows, dtype=torch.float64, device=device)
    tensors = [r if isinstance(r, torch.Tensor) else torch.tensor(r, dtype=torch.float64) for r in rows]
    return torch.stack([t.to(device=device, dtype=torch.float64) for t in tensors])


def _host(row: Any) -> list[float]:
    return row if isinstance(row, list) else list(row.tolist())


def _collective_device() -> torch.device:
    """Where the default process group reduces: the current CUDA device under NCCL, else the CPU."""
    backend = str(dist.get_backend()).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def world_size() -> int:
    """The number of ranks (1 without torch.distributed)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
