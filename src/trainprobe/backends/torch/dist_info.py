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
