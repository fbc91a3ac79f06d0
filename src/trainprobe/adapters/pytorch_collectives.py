"""``torch.distributed`` as the ``cc`` probe sees it (:class:`~trainprobe.probes.collectives.CollectiveApi`).

The functions are replaced in ``torch.distributed`` and ``torch.distributed.distributed_c10d``.
An asynchronous call's work is followed through its future (recorded when it completes); a
backend whose works have no future (gloo's point-to-point works) is read at the end of the step,
after one ``wait()``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


class TorchCollectives:
    """The PyTorch collectives."""

    tensor_type = torch.Tensor

    def namespaces(self) -> tuple[ModuleType, ...]:
        return (c10d, dist)

    def primitives(self) -> Mapping[type, str]:
        return {}

    def defer(self, result: Any, record: Callable[[], None]) -> Any:
        if result is None or not hasattr(result, "get_future"):
            return None
        try:
            future = result.get_future()
        except RuntimeError:
            return (result, record)  # no futures here: read after wait() at the end of the step
        return future.then(lambda _f: record())

    def settle(self, pending: Any) -> None:
        if isinstance(pending, tuple):
            work, record = pending
            if not work.is_completed():
                # never wait twice: a second wait() on a gloo irecv blocks for another message
                work.wait()
            record()
        else:
            pending.wait()

    def describe_group(self, group: Any) -> Any:
        if group is None or group is dist.GroupMember.WORLD:
            return "world"
        try:
            return dist.get_process_group_ranks(group)
        except Exception:  # noqa: BLE001 - a description only
            return str(group)


TORCH_COLLECTIVES = TorchCollectives()
