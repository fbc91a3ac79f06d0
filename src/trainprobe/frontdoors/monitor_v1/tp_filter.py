"""Which reduced-gradient rows a rank of a tensor-parallel group writes (``set_monitor(tp_group=...)``),
decided by each parameter's placement (PyTorch): every distinct piece once.

* A DTensor parameter whose mesh has a dimension spanning ``tp_group``: written on every rank of
  the group where its placement on that dimension is a ``Shard`` (each rank holds another piece:
  ColwiseParallel / RowwiseParallel weights), on the group's first rank only where it is
  ``Replicate`` (or ``Partial``: the ranks hold copies, or summands). A DTensor whose mesh does
  not span the group (an FSDP2-only mesh) is the same on every rank of it: first rank only.
* A plain parameter carrying Megatron's attributes (``tensor_model_parallel``, ``partition_dim``;
  :func:`~trainprobe.backends.torch.placement.layout_of` calls it a shard): every rank.
* Any other parameter is a replica across the group: first rank only.

The reference keeps only parameters marked ``tensor_model_parallel`` on the group's other ranks,
so a DTensor shard's other halves are never written there; trainprobe writes them (see
docs/compatibility.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from trainprobe.backends.torch.placement import SHARD, is_dtensor, layout_of
from trainprobe.engine.probes.model_view import NamedParam


def placement_filter(tp_ranks: Sequence[int] | None) -> Callable[[NamedParam], bool]:
    """For a rank of a tensor-parallel group that is not its first rank: whether a parameter
    keeps its reduced rows (see the module docstring), decided once per parameter.

    Args:
        tp_ranks: the global ranks of the group (None where they cannot be read: then no
            DTensor mesh dimension is taken for the group, only Megatron's attributes count).
    """
    ranks = tuple(tp_ranks) if tp_ranks is not None else None
    decided: dict[int, bool] = {}

    def keep(named: NamedParam) -> bool:
        found = decided.get(id(named.param))
        if found is None:
            found = decided[id(named.param)] = _distinct_here(named.param, ranks)
        return found

    return keep


def _distinct_here(param: Any, tp_ranks: tuple[int, ...] | None) -> bool:
    """Whether ``param``'s local piece on this (not first) rank of the group differs from the
    first rank's."""
    if not is_dtensor(param):
        return bool(layout_of(param)["kind"] == SHARD)
    dim = _group_dim(param.device_mesh, tp_ranks)
    return dim is not None and bool(param.placements[dim].is_shard())


def _group_dim(mesh: Any, tp_ranks: tuple[int, ...] | None) -> int | None:
    """The dimension of ``mesh`` whose group (this rank's) has exactly ``tp_ranks``, or None."""
    if tp_ranks is None:
        return None
    wanted = sorted(tp_ranks)
    for dim in range(mesh.ndim):
        if sorted(dist.get_process_group_ranks(mesh.get_group(dim))) == wanted:
            return dim
    return None
