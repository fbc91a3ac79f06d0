"""The current process's rank, and its process groups."""

from __future__ import annotations

import os

import torch.distributed as dist

from trainprobe.engine.errors import ConfigError


def current_rank() -> int:
    """``torch.distributed`` rank when initialised, else ``$RANK``, else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def distributed_ready() -> bool:
    """Whether torch.distributed is initialised in this process."""
    return dist.is_available() and dist.is_initialized()


def group_rank(group: object, where: str) -> int:
    """This process's rank in ``group``.

    Raises:
        ConfigError: naming ``where``, when torch.distributed is not initialised.
    """
    if not distributed_ready():
        raise ConfigError(f"{where}: needs torch.distributed to be initialised")
    return dist.get_rank(group)  # type: ignore[arg-type]


def group_ranks(group: object) -> tuple[int, ...] | None:
    """The global ranks of ``group``'s members (None without torch.distributed)."""
    if not distributed_ready():
        return None
    return tuple(dist.get_process_group_ranks(group))  # type: ignore[arg-type]


def ranks_flagging(flag: bool, group: object = None) -> tuple[int, ...]:
    """The global ranks of ``group`` (default: the world) whose ``flag`` is true: one all-gather
    of one integer per rank, which every rank of the group must call together. Issued on the
    process group itself, not through ``torch.distributed.all_gather``, so that the ``cc``
    monitors never record trainprobe's own traffic. Without torch.distributed: ``(0,)`` when
    ``flag`` else ``()``."""
    if not distributed_ready():
        return (0,) if flag else ()
    import torch

    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    backend = dist.get_backend(pg)  # type: ignore[arg-type]
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    mine = torch.tensor([1 if flag else 0], dtype=torch.int64, device=device)
    flags = [torch.zeros_like(mine) for _ in range(dist.get_world_size(pg))]  # type: ignore[arg-type]
    pg.allgather([flags], [mine]).wait()  # type: ignore[attr-defined]
    ranks = dist.get_process_group_ranks(pg) if group is not None else list(range(len(flags)))  # type: ignore[arg-type]
    return tuple(r for r, f in zip(ranks, torch.cat(flags).tolist()) if f)
