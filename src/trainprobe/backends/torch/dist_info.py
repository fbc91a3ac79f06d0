"""The current process's rank."""

from __future__ import annotations

import os

import torch.distributed as dist


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
