"""MindSpore's collectives as the ``cc`` probe sees them (:class:`~trainprobe.engine.probes.collectives.CollectiveApi`).

Two entry points, both used by ordinary PyNative training code:

* ``mindspore.mint.distributed`` (``all_reduce``, ``all_gather``, ``broadcast``, ...): the same
  functions, argument names and in-place outputs as ``torch.distributed``; replaced in
  ``mindspore.mint.distributed`` and the module that defines them. With ``async_op=True`` the
  call returns a ``CommHandle``: its outputs are recorded when the loop calls ``wait()``, or at
  the end of the step (after one more ``wait()``, which MindSpore allows) if it never does.
* the communication primitives (``ops.AllReduce``, which ``nn.DistributedGradReducer`` calls,
  ``ops.AllGather``, ``ops.ReduceScatter``, ``ops.Broadcast``, ``ops.AlltoAll``): their
  ``__call__`` is wrapped at class level. Their rows are named like the equivalent
  ``torch.distributed`` function (``all_reduce``, ``all_gather_into_tensor``,
  ``reduce_scatter_tensor``, ``broadcast``, ``all_to_all_single``), so PyTorch and MindSpore files
  compare line by line.

``mindspore.communication.comm_func`` is not wrapped: on the CPU build its operators have no
kernel (``InnerCommAllReduce``), so it cannot be exercised here.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import mindspore as ms
import mindspore.mint.distributed as mint_dist
from mindspore.ops.operations import comm_ops

if TYPE_CHECKING:
    from trainprobe.engine.probes.collectives import Wrap

PRIMITIVE_OPS: dict[str, str] = {
    "AllReduce": "all_reduce",
    "AllGather": "all_gather_into_tensor",
    "ReduceScatter": "reduce_scatter_tensor",
    "Broadcast": "broadcast",
    "AlltoAll": "all_to_all_single",
}
"""Primitive class name (in ``mindspore.ops``) → the op name its rows carry."""


class _HandleRecorder:
    """Records a call's outputs once, when the loop waits for its handle or at the end of the step."""

    def __init__(self, handle: Any, record: Callable[[], None]) -> None:
        self.record = record
        self.done = False
        original_wait = handle.wait

        def wait(*args: Any, **kwargs: Any) -> Any:
            result = original_wait(*args, **kwargs)
            self.finish()
            return result

        self.original_wait = original_wait
        handle.wait = wait

    def finish(self) -> None:
        if not self.done:
            self.done = True
            self.record()

    def settle(self) -> None:
        if not self.done:
            self.original_wait()
            self.finish()


class MindSporeCollectives:
    """The MindSpore collectives."""

    tensor_type = ms.Tensor

    def namespaces(self) -> tuple[ModuleType, ...]:
        home = sys.modules[mint_dist.all_reduce.__module__]
        return (home, mint_dist) if home is not mint_dist else (mint_dist,)

    def primitives(self) -> Mapping[type, str]:
        return {getattr(comm_ops, name): op for name, op in PRIMITIVE_OPS.items() if hasattr(comm_ops, name)}

    def patches(self) -> Sequence[tuple[Any, str, Wrap]]:
        return ()  # a CommHandle's own wait() is wrapped per call (_HandleRecorder)

    def defer(self, result: Any, record: Callable[[], None]) -> Any:
        if result is None or not hasattr(result, "wait"):
            return None
        return _HandleRecorder(result, record)

    def settle(self, pending: Any) -> bool:
        pending.settle()
        return True

    def describe_group(self, group: Any) -> Any:
        from mindspore.communication import GlobalComm

        if group is None or group == GlobalComm.WORLD_COMM_GROUP:
            return "world"
        return str(group)

    def on_next_forward(self, callback: Callable[[], None]) -> None:
        """None: on MindSpore a collective issued after the optimizer's step counts in the next step."""
        return None

    def watch_ddp(self, model: Any, probe: Any) -> None:
        """None: MindSpore has no DistributedDataParallel comm hook (``ddp_comm_hook`` is refused)."""
        return None


MINDSPORE_COLLECTIVES = MindSporeCollectives()
