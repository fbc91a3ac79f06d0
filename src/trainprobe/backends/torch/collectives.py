"""``torch.distributed`` as the ``cc`` probe sees it (:class:`~trainprobe.engine.probes.collectives.CollectiveApi`).

The functions are replaced in ``torch.distributed`` and ``torch.distributed.distributed_c10d``.
An asynchronous call's outputs are recorded when its work completes:

* a work with a future (NCCL, gloo collectives): when the future completes;
* a work without one (gloo's ``isend``/``irecv``, also through ``batch_isend_irecv``): when the
  loop's ``wait()`` on it returns, so a buffer reused after ``wait()`` is recorded with what was
  received. For this ``torch.distributed.Work.wait`` is replaced at class level while a ``cc``
  monitor runs (restored exactly by the last ``stop()``); the work the loop gets is the very
  object torch returned, of type ``Work``. A work that has completed by the end of the step
  without a Python ``wait()`` is read then; one that has not is never waited for on the loop's
  behalf (a second ``wait()`` on a gloo receive blocks for another message): it is recorded when
  the loop waits for it, in the step running then, and not at all if nothing in Python does.

The next step starts at the next ``nn.Module`` forward anywhere in the process
(:meth:`TorchCollectives.on_next_forward`: a global forward pre-hook that removes itself when it
fires). DistributedDataParallel's gradient all-reduce runs inside its C++ reducer, out of the
patch's sight; :meth:`TorchCollectives.watch_ddp` registers a comm hook that averages and
all-reduces each bucket exactly as the built-in reducer does and reports it.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.nn.parallel import DistributedDataParallel

from trainprobe.engine.errors import ConfigError

if TYPE_CHECKING:
    from trainprobe.engine.probes.collectives import CollectiveProbe, Wrap


class _AwaitedWork:
    """A work without a future and the ``record`` of one listener's call, run once: when the loop
    waits for the work (or at the end of a step, if it has completed by then)."""

    __slots__ = ("work", "record", "done", "__weakref__")

    def __init__(self, work: Any, record: Callable[[], None]) -> None:
        self.work = work
        self.record = record
        self.done = False


class TorchCollectives:
    """The PyTorch collectives."""

    tensor_type = torch.Tensor

    # id(work) -> the calls waiting for it; weak: a probe that stops forgets its pending calls.
    # Class-level: one Work.wait wrapper serves every instance (one patch per adapter type).
    _awaited: dict[int, list[weakref.ref[_AwaitedWork]]] = {}
    _lock = threading.Lock()

    def namespaces(self) -> tuple[ModuleType, ...]:
        return (c10d, dist)

    def primitives(self) -> Mapping[type, str]:
        return {}

    def patches(self) -> Sequence[tuple[Any, str, Wrap]]:
        return ((dist.Work, "wait", self._wrap_wait),)

    def _wrap_wait(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """``Work.wait`` that, once the work completed, records the calls waiting for it."""
        awaited = self._awaited

        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(work, *args, **kwargs)
            if awaited:
                self._completed(work)
            return result

        functools.update_wrapper(wait, original)  # name, doc, __wrapped__
        return wait

    def _completed(self, work: Any) -> None:
        with self._lock:
            refs = self._awaited.pop(id(work), [])
        for ref in refs:
            pending = ref()
            if pending is not None and pending.work is work:
                self._finish(pending)

    def _finish(self, pending: _AwaitedWork) -> None:
        with self._lock:
            if pending.done:
                return
            pending.done = True
        pending.record()

    def _forget(self, pending: _AwaitedWork) -> None:
        with self._lock:
            refs = self._awaited.get(id(pending.work))
            if refs is None:
                return
            refs[:] = [ref for ref in refs if ref() is not None and ref() is not pending]
            if not refs:
                del self._awaited[id(pending.work)]

    def defer(self, result: Any, record: Callable[[], None]) -> Any:
        if result is None or not hasattr(result, "get_future"):
            return None
        try:
            future = result.get_future()
        except RuntimeError:
            # no future (gloo point-to-point): recorded when the loop's wait() returns
            pending = _AwaitedWork(result, record)
            with self._lock:
                self._awaited.setdefault(id(result), []).append(weakref.ref(pending))
            return pending
        return future.then(lambda _f: record())

    def settle(self, pending: Any) -> bool:
        if not isinstance(pending, _AwaitedWork):
            pending.wait()  # a future: waiting on it again is harmless
            return True
        if not pending.done and not pending.work.is_completed():
            # Never wait on the loop's behalf: a second wait() on a gloo irecv blocks for another
            # message, so a loop that waits after the step boundary would hang. The call stays
            # registered and is recorded when the loop waits (in a later step).
            return False
        self._forget(pending)
        self._finish(pending)
        return True

    def describe_group(self, group: Any) -> Any:
        if group is None or group is dist.GroupMember.WORLD:
            return "world"
        try:
            return dist.get_process_group_ranks(group)
        except Exception:  # noqa: BLE001 - a description only
            return str(group)

    def on_next_forward(self, callback: Callable[[], None]) -> Any:
        """A global ``nn.Module`` forward pre-hook calling ``callback`` once, at the first module
        forward of any model (it runs before the module's own pre-hooks, FSDP's all-gathers
        included) and removing itself (torch iterates a copy of the hooks, so that is safe).
        Inside a graph ``torch.compile`` traces (a module compiled in place) it does nothing, so
        nothing of trainprobe enters the graph; the session's fallback then ends the step."""
        handle: Any = None
        is_compiling = torch.compiler.is_compiling

        def first_forward(module: Any, args: Any) -> None:
            if is_compiling():
                return
            handle.remove()
            callback()

        handle = register_module_forward_pre_hook(first_forward)
        return handle

    def watch_ddp(self, model: Any, probe: CollectiveProbe) -> Any:
        """Report the buckets of ``model`` (a DistributedDataParallel, else None is returned) to
        ``probe`` until the returned handle is removed (see :class:`_DdpHookState`)."""
        if not isinstance(model, DistributedDataParallel):
            return None
        state = _DDP_STATES.get(model)
        if state is None:
            if getattr(model, "_comm_hooks", None):
                raise ConfigError(
                    "monitors.cc.ddp_comm_hook: this DistributedDataParallel already has a comm hook "
                    '(DDP allows one); set "ddp_comm_hook": false'
                )
            state = _DdpHookState(model)
            try:
                model.register_comm_hook(state, _ddp_comm_hook)
            except RuntimeError as exc:  # a built-in comm hook is registered already
                raise ConfigError(
                    f'monitors.cc.ddp_comm_hook: DDP refused the comm hook ({exc}); set "ddp_comm_hook": false'
                ) from exc
            if state.bucket_view:
                model.register_forward_pre_hook(state.snapshot)
            _DDP_STATES[model] = state
        state.probes = (*state.probes, probe)
        return _DdpListening(state, probe)


class _DdpHookState:
    """The state of trainprobe's DDP comm hook on one model: its process group, the probes
    listening now and, with ``gradient_as_bucket_view``, which parameters' gradients were already
    views of DDP's buckets when the step's last forward started. DDP cannot unregister a comm
    hook, so the hook (and that forward pre-hook) stay for the model's life, averaging exactly as
    DDP's reducer does and recording nothing once no probe listens (a later ``start()`` on the
    same model listens again)."""

    __slots__ = ("process_group", "probes", "bucket_view", "aliased", "__weakref__")

    def __init__(self, model: DistributedDataParallel) -> None:
        self.process_group = model.process_group
        self.probes: tuple[CollectiveProbe, ...] = ()
        self.bucket_view = bool(getattr(model, "gradient_as_bucket_view", False))
        self.aliased: frozenset[int] = frozenset()

    def snapshot(self, module: Any, args: Any) -> None:
        """Forward pre-hook of the DDP model: remember whose gradient is a bucket view now (DDP's
        reducer divides those in place and multiplies the others by the reciprocal while copying
        them into the bucket)."""
        if torch.compiler.is_compiling():
            return
        self.aliased = frozenset(id(p) for p in module.parameters() if p.grad is not None and p.grad._is_view())


_DDP_STATES: weakref.WeakKeyDictionary[Any, _DdpHookState] = weakref.WeakKeyDictionary()


class _DdpListening:
    """Removes one probe from a model's :class:`_DdpHookState` (idempotent)."""

    def __init__(self, state: _DdpHookState, probe: CollectiveProbe) -> None:
        self.state = state
        self.probe = probe

    def remove(self) -> None:
        self.state.probes = tuple(p for p in self.state.probes if p is not self.probe)


def _average(state: _DdpHookState, bucket: dist.GradBucket) -> None:
    """Scale the bucket's gradients by 1/world size in place with the very operations of DDP's
    built-in reducer (``mul`` by the reciprocal for a gradient copied into the bucket, ``div`` for
    one that already is a bucket view), so the averaged gradients are bitwise DDP's own."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    size = group.size()
    aliased = state.aliased if state.bucket_view else frozenset()
    flags = [id(p) in aliased for p in bucket.parameters()] if aliased else []
    if not any(flags):
        bucket.buffer().mul_(1.0 / size)
    elif all(flags):
        bucket.buffer().div_(size)
    else:
        for is_view, grad in zip(flags, bucket.gradients()):
            if is_view:
                grad.div_(size)
            else:
                grad.mul_(1.0 / size)


def _all_reduce(state: _DdpHookState, tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    return dist.all_reduce(tensor, group=group, async_op=True).get_future().then(lambda done: done.value()[0])


def _ddp_comm_hook(state: _DdpHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's own averaging all-reduce of ``bucket`` (:func:`_average`, then a sum all-reduce, as
    the built-in reducer does; gradients are bitwise the same), reported to each listening probe
    as ``all_reduce`` of ``ddp.bucket_<index>``: ``in`` before averaging, ``out`` once the future
    completed. Its inner ``dist.all_reduce`` is not recorded again."""
    probes = state.probes
    tensor = bucket.buffer()
    if not probes:
        _average(state, bucket)
        return _all_reduce(state, tensor)
    index = bucket.index()
    calls = [(probe, probe.bucket_call(index, tensor)) for probe in probes]
    _average(state, bucket)
    with probes[0].unobserved():
        future = _all_reduce(state, tensor)

    def reduced(done: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        result = done.value()
        for probe, call in calls:
            probe.bucket_done(call, result)
        return result

    return future.then(reduced)


# DDP checks the hook's annotations as objects, not as this module's postponed strings
_ddp_comm_hook.__annotations__ = {
    "state": _DdpHookState,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}

TORCH_COLLECTIVES = TorchCollectives()
