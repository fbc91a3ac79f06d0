"""What a monitored tensor is on this rank: the whole tensor, one shard of it, a replica, or a
partial sum, and how many elements the rank's statistics summarise.

Under FSDP2, tensor parallelism (DTensor) and their 2-D mixes every statistic trainprobe writes is
of the rank's *local* tensor (``DTensor.to_local()``). A row alone cannot say whether it is a
whole tensor or a piece of one, so each rank describes its tensors once, beside its files
(``tensor_layout.json``, :mod:`trainprobe.engine.tensor_layout`), and the read side merges the
pieces into full-tensor statistics (min/max exact, norm √Σ norm², mean weighted by element
counts, replicas counted once).

:func:`layout_of` maps a tensor onto that description:

* a DTensor: its mesh (shape, dimension names, this rank's coordinate) and placements; ``Shard(d)``
  cuts dimension ``d`` as ``torch.chunk`` does (⌈n/k⌉ a piece, the last ones shorter or empty),
  which is what DTensor and FSDP2 do, and gives this rank's offsets and local shape;
* a parameter carrying Megatron's attributes (``tensor_model_parallel``, ``partition_dim``): a
  shard along ``partition_dim`` of a tensor whose global shape is not known here (offsets
  unknown; the read side then merges by rank);
* anything else: the whole tensor.

Kinds, in the order checked: ``partial`` (a ``Partial`` placement: the local tensor is a summand,
not a piece; its statistics describe no tensor), ``shard``, ``replica`` (every placement
``Replicate`` on a mesh of more than one rank), ``whole``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import torch

PARTIAL, SHARD, REPLICA, WHOLE = "partial", "shard", "replica", "whole"


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor (has a device mesh and placements)."""
    return hasattr(t, "device_mesh") and hasattr(t, "placements") and hasattr(t, "to_local")


def is_partial(t: Any) -> bool:
    """Whether ``t`` is a DTensor with a ``Partial`` placement: its local tensor is a summand of
    the tensor (the ranks' local tensors add up to it), not a piece, so no statistic of it
    describes the tensor. Cheap for a plain tensor (called on every module gradient)."""
    if type(t) in _PLAIN_TYPES:
        return False
    placements = getattr(t, "placements", None)
    return placements is not None and any(p.is_partial() for p in placements)


def layout_of(t: Any) -> dict[str, Any]:
    """The description of ``t`` on this rank (see the module docstring), as JSON-ready values:
    ``kind``, ``numel`` (elements of the local tensor), ``local_shape``, ``global_shape``,
    ``offsets`` (of the local piece in the global tensor; None when unknown), and for a DTensor
    ``placements`` (``["S(0)", "R"]``) and ``mesh`` (``shape``, ``dim_names``, ``coordinate``)."""
    if is_dtensor(t):
        return _dtensor_layout(t)
    shape = [int(s) for s in t.shape]
    if getattr(t, "tensor_model_parallel", False):
        dim = int(getattr(t, "partition_dim", 0))
        return {"kind": SHARD, "numel": int(t.numel()), "local_shape": shape, "global_shape": None,
                "offsets": None, "partition_dim": dim}
    return {"kind": WHOLE, "numel": int(t.numel()), "local_shape": shape, "global_shape": shape,
            "offsets": [0] * len(shape)}


def _dtensor_layout(t: Any) -> dict[str, Any]:
    mesh, placements = t.device_mesh, tuple(t.placements)
    global_shape = [int(s) for s in t.shape]
    local = t.to_local()
    coordinate = mesh.get_coordinate()
    offsets, shape = _piece(global_shape, placements, list(mesh.shape), coordinate)
    local_shape = [int(s) for s in local.shape]
    if shape != local_shape:  # a placement cut otherwise (a strided shard): the offsets are not known
        offsets = None
    kinds = {_kind(p) for p in placements}
    if PARTIAL in kinds:
        kind = PARTIAL
    elif SHARD in kinds:
        kind = SHARD
    elif mesh.size() > 1:
        kind = REPLICA
    else:
        kind = WHOLE
    return {
        "kind": kind,
        "numel": int(local.numel()),
        "local_shape": local_shape,
        "global_shape": global_shape,
        "offsets": offsets,
        "placements": [str(p) for p in placements],
        "mesh": {
            "shape": [int(s) for s in mesh.shape],
            "dim_names": list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
            "coordinate": list(coordinate) if coordinate is not None else None,
        },
    }


def _kind(placement: Any) -> str:
    if placement.is_partial():
        return PARTIAL
    if placement.is_shard():
        return SHARD
    return REPLICA


def _piece(
    global_shape: list[int],
    placements: tuple[Any, ...],
    mesh_shape: list[int],
    coordinate: list[int] | None,
    skip: tuple[int, ...] = (),
) -> tuple[list[int] | None, list[int]]:
    """``(offsets, local shape)`` of this rank's piece: each ``Shard(d)`` in mesh order cuts what
    is left of dimension ``d`` into ``mesh_shape[i]`` chunks (``torch.chunk``'s sizes); the mesh
    dimensions in ``skip`` cut nothing."""
    shape, offsets = list(global_shape), [0] * len(global_shape)
    if coordinate is None:
        return None, [0] * len(global_shape)
    for index, placement in enumerate(placements):
        if index in skip or not placement.is_shard() or type(placement).__name__ != "Shard":
            continue
        dim = placement.dim if placement.dim >= 0 else placement.dim + len(shape)
        pieces, size = mesh_shape[index], shape[dim]
        chunk = -(-size // pieces) if size else 0
        start = min(coordinate[index] * chunk, size)
        offsets[dim] += start
        shape[dim] = max(0, min(chunk, size - start))
    return offsets, shape


def unsharded_piece(t: Any, fsdp_dims: tuple[int, ...]) -> tuple[list[int] | None, list[int]]:
    """``(offsets, local shape)`` of what this rank holds of DTensor ``t`` once FSDP has gathered
    it over the mesh dimensions ``fsdp_dims`` (:func:`fsdp_mesh_dims`): the tensor autograd
    computes gradients for in forward and backward, so what an ``unreduced`` gradient row
    summarises. Under 1-D FSDP2 the whole parameter (``[7, 6]`` for a ``[7, 6]`` weight whose
    shard is ``[4, 6]``); under 2-D FSDP2 + tensor parallelism its tensor-parallel piece."""
    shape = [int(s) for s in t.shape]
    mesh = t.device_mesh
    return _piece(shape, tuple(t.placements), list(mesh.shape), mesh.get_coordinate(), fsdp_dims)


def fsdp_mesh_dims(chunks: Sequence[Any]) -> dict[int, tuple[int, ...]]:
    """``id`` of every FSDP2 (``fully_shard``) parameter of ``chunks``' modules → the dimensions of
    its DTensor mesh that are data-parallel (FSDP shards over them; HSDP also replicates over the
    first): the leading ones, before any tensor-parallel dimension. Read from FSDP's parameter
    records (the data-parallel mesh each was sharded on); where torch has none, every dimension
    of a 1-D mesh, all but the last of a larger one. FSDP1's flat parameters are not listed."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return {}
    dims: dict[int, tuple[int, ...]] = {}
    for chunk in chunks:
        for module in chunk.modules() if hasattr(chunk, "modules") else ():
            if isinstance(module, FSDPModule):
                dims.update(_fsdp2_dims(cast(torch.nn.Module, module)))
    return dims


def _fsdp2_dims(module: torch.nn.Module) -> dict[int, tuple[int, ...]]:
    """:func:`fsdp_mesh_dims` of the parameters one ``fully_shard`` module manages."""
    records = _fsdp2_records(module)
    if records is not None:
        return {
            id(r.sharded_param): tuple(range(r.mesh_info.mesh.ndim)) for r in records if is_dtensor(r.sharded_param)
        }
    out: dict[int, tuple[int, ...]] = {}
    for p in module.parameters():
        if is_dtensor(p):
            ndim = cast(Any, p).device_mesh.ndim
            out[id(p)] = tuple(range(max(1, ndim - 1)))
    return out


def _fsdp2_records(module: torch.nn.Module) -> list[Any] | None:
    """FSDP2's private per-parameter records (``FSDPParam``) of ``module``, or None where this
    torch keeps them otherwise."""
    try:
        state = module._get_fsdp_state()  # type: ignore[operator]
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = state._fsdp_param_group
            groups = [group] if group is not None else []
        records = [r for g in groups for r in g.fsdp_params]
        for r in records:
            _ = r.sharded_param, r.mesh_info.mesh.ndim
        return records
    except (AttributeError, TypeError, RuntimeError):
        return None


def param_layouts(
    params: Sequence[Any], chunks: Sequence[Any], optimizers: Sequence[Any] = ()
) -> tuple[int, dict[int, tuple[dict[str, Any], dict[str, Any]]]]:
    """The world size and, for each of ``params`` (``NamedParam``), ``(layout of its rows, layout
    of its unreduced gradient rows)``. An unreduced gradient is ``rank_local`` (the rank's own,
    before the data-parallel reduction) in a multi-rank run, except for a DTensor parameter not
    managed by FSDP whose mesh spans every rank (tensor parallelism alone: its gradient is
    already the shard's gradient). An FSDP2 parameter's unreduced gradient is of the unsharded
    parameter (:func:`unsharded_piece`): its ``local_shape``, ``numel`` and ``offsets`` say so.
    FSDP1's parameters (:func:`fsdp1_layouts`) are 1-D pieces of a flat shard. A parameter whose
    optimizer state a ``ZeroRedundancyOptimizer`` of ``optimizers`` keeps on one rank has that
    rank (global) as ``state_rank`` in its rows' layout (:func:`zero_state_holders`)."""
    import torch.distributed as dist

    from trainprobe.engine.tensor_layout import RANK_LOCAL

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    fsdp, gathered, flat = _fsdp_params(chunks), fsdp_mesh_dims(chunks), fsdp1_layouts(chunks)
    owners = zero_state_holders(optimizers)  # global ranks, as the layout file's rank
    out: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}
    for named in params:
        t = named.param
        if id(t) in flat:
            out[id(t)] = flat[id(t)]
            continue
        layout = layout_of(t)
        unreduced = layout
        if id(t) in gathered:
            unreduced = _unsharded_layout(t, layout, gathered[id(t)])
        if world > 1 and (id(t) in fsdp or not is_dtensor(t) or t.device_mesh.size() != world):
            unreduced = {**unreduced, "kind": RANK_LOCAL}
        if id(t) in owners:
            layout = {**layout, "state_rank": owners[id(t)]}
        out[id(t)] = (layout, unreduced)
    return world, out


def _unsharded_layout(t: Any, layout: dict[str, Any], fsdp_dims: tuple[int, ...]) -> dict[str, Any]:
    """``layout`` of an FSDP2 parameter as its unreduced gradient has it: the local shape, element
    count and offsets of the piece gathered over ``fsdp_dims`` (:func:`unsharded_piece`)."""
    offsets, shape = unsharded_piece(t, fsdp_dims)
    numel = 1
    for size in shape:
        numel *= size
    return {**layout, "numel": numel, "local_shape": shape, "offsets": offsets if layout["offsets"] is not None else None}


def _fsdp_params(chunks: Sequence[Any]) -> set[int]:
    """``id`` of every parameter a ``fully_shard`` (FSDP2) or ``FullyShardedDataParallel`` module owns."""
    kinds: list[type[Any]] = []
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

        kinds = [FSDPModule, FullyShardedDataParallel]
    except ImportError:  # torch without FSDP2
        pass
    owned: set[int] = set()
    for chunk in chunks:
        for module in chunk.modules() if hasattr(chunk, "modules") else ():
            if kinds and isinstance(module, tuple(kinds)):
                owned.update(id(p) for p in cast(torch.nn.Module, module).parameters())
    return owned



def fsdp1_layouts(chunks: Sequence[Any]) -> dict[int, tuple[dict[str, Any], dict[str, Any]]]:
    """``id`` of every parameter of ``chunks``' ``FullyShardedDataParallel`` (FSDP1) modules →
    ``(layout of its rows, layout of its unreduced gradient rows)``.

    Each FSDP1 unit flattens its parameters into one ``FlatParameter`` and gives each rank an
    equal 1-D piece of it (``torch.chunk`` sizes), padded with zeros at its end:

    * ``use_orig_params=False``: the monitored parameter is the ``FlatParameter`` itself; its rows
      are a ``shard`` of the unit's flat tensor (``global_shape`` ``[elements of the unit]``,
      ``offsets`` ``[this rank's start]``) whose last ``padding`` elements are FSDP's zeros, no
      element of any parameter;
    * ``use_orig_params=True``: each original parameter on a rank is a 1-D view of its part of
      the rank's piece, possibly empty; its rows are a ``shard`` of the parameter
      (``global_shape`` its real shape, ``flat_offset`` the index of the part's first element in
      the flattened parameter, ``offsets`` None; an empty part has ``numel`` 0 and
      ``flat_offset`` None).

    Unreduced gradients are ``rank_local``: the rank's own gradient of the unsharded tensor
    (the whole flat tensor with every rank's padding; the whole parameter). Read from FSDP1's
    flat-parameter records; where this torch keeps them otherwise, the parameters are left out
    (their rows are then described as the tensors they are), as they are under ``NO_SHARD``
    (whole tensors on every rank, as under DDP)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # torch without FSDP
        return {}
    out: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}
    for chunk in chunks:
        for module in chunk.modules() if hasattr(chunk, "modules") else ():
            if isinstance(module, FullyShardedDataParallel):
                handle = getattr(module, "_handle", None)
                if handle is not None:
                    out.update(_flat_param_layouts(handle))
    return out


def _flat_param_layouts(handle: Any) -> dict[int, tuple[dict[str, Any], dict[str, Any]]]:
    """:func:`fsdp1_layouts` of one FSDP1 unit (its ``FlatParamHandle``)."""
    from trainprobe.engine.tensor_layout import RANK_LOCAL

    try:
        flat = handle.flat_param
        infos, shapes = flat._shard_param_infos, [[int(s) for s in shape] for shape in flat._shapes]
        local, pad, shard_rank = int(flat._sharded_size.numel()), int(flat._shard_numel_padded), int(handle.rank)
        padded, unpadded = local * int(handle.world_size), int(flat._unpadded_unsharded_size.numel())
        originals, sharded = flat._params, bool(handle.uses_sharded_strategy)
    except (AttributeError, TypeError):
        return {}
    if not sharded:  # NO_SHARD: every rank holds the whole tensors, as under DDP
        return {}
    if originals is None:  # use_orig_params=False: the flat parameter is what the optimizer steps
        rows = {"kind": SHARD, "numel": local, "local_shape": [local], "global_shape": [unpadded],
                "offsets": [shard_rank * local], "padding": pad}
        unreduced = {"kind": RANK_LOCAL, "numel": padded, "local_shape": [padded], "global_shape": [unpadded],
                     "offsets": [0], "padding": padded - unpadded}
        return {id(flat): (rows, unreduced)}
    out: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}
    for param, info, shape in zip(originals, infos, shapes):
        numel = int(info.numel_in_shard) if info.in_shard else 0
        start = int(info.intra_param_start_idx) if info.in_shard else None
        rows = {"kind": SHARD, "numel": numel, "local_shape": [numel], "global_shape": shape,
                "offsets": None, "flat_offset": start}
        unreduced = {"kind": RANK_LOCAL, "numel": math.prod(shape), "local_shape": shape, "global_shape": shape,
                     "offsets": [0] * len(shape)}
        out[id(param)] = (rows, unreduced)
    return out


def zero_state_ranks(optimizers: Sequence[Any]) -> dict[int, int]:
    """``id`` of every parameter a ``ZeroRedundancyOptimizer`` among ``optimizers`` steps → the rank
    that holds its optimizer state (ZeRO-style sharding: each rank keeps the state of a subset of
    the parameters, whole tensors, and broadcasts their updated values after its step). Empty
    where there is none, or where this torch keeps the partition otherwise."""
    try:
        from torch.distributed.optim import ZeroRedundancyOptimizer
    except ImportError:  # torch without torch.distributed.optim
        return {}
    owners: dict[int, int] = {}
    for optimizer in optimizers:
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            try:
                owners.update({id(p): int(r) for p, r in optimizer._param_to_rank.items()})  # type: ignore[attr-defined]
            except (AttributeError, TypeError):
                continue
    return owners


def fsdp1_shard_groups(chunks: Sequence[Any]) -> dict[int, tuple[int, ...]]:
    """``id`` of every parameter :func:`fsdp1_layouts` describes → the global ranks of the process
    group its FSDP1 unit shards over, in group order (under ``HYBRID_SHARD`` each replica's
    group: a group's pieces make the whole tensor). Empty where this torch keeps them otherwise."""
    import torch.distributed as dist

    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # torch without FSDP
        return {}
    described = fsdp1_layouts(chunks)
    out: dict[int, tuple[int, ...]] = {}
    for chunk in chunks:
        for module in chunk.modules() if hasattr(chunk, "modules") else ():
            handle = getattr(module, "_handle", None) if isinstance(module, FullyShardedDataParallel) else None
            group = getattr(handle, "process_group", None)
            if handle is None or group is None:
                continue
            try:
                ranks = tuple(int(r) for r in dist.get_process_group_ranks(group))
                flat = handle.flat_param
                tensors = [flat] if flat._params is None else list(flat._params)
            except (AttributeError, TypeError, RuntimeError, ValueError):
                continue
            out.update({id(t): ranks for t in tensors if id(t) in described})
    return out


def zero_state_holders(optimizers: Sequence[Any]) -> dict[int, int]:
    """:func:`zero_state_ranks` as global ranks (a ``ZeroRedundancyOptimizer`` numbers the ranks
    of its own process group)."""
    import torch.distributed as dist

    out: dict[int, int] = {}
    for optimizer in optimizers:
        owners = zero_state_ranks([optimizer])
        group = getattr(optimizer, "process_group", None)
        for key, rank in owners.items():
            try:
                out[key] = int(dist.get_global_rank(group, rank)) if group is not None else rank
            except (RuntimeError, ValueError, AttributeError):
                out[key] = rank
    return out
