"""``weight_grad`` monitor: parameter gradients, ``unreduced`` and ``reduced``.

* ``unreduced`` rows are taken in backward, from the gradient autograd hands to each parameter
  (a tensor hook on the parameter, which runs before the gradient is accumulated into ``.grad``
  and, under DistributedDataParallel, before it is all-reduced). With ``monitor_mbs_grad`` each
  micro-batch's gradient is a row with ``micro_step`` = its index, and each micro-batch's rows
  are written in parameter (model) order, as every other writer of weight gradients writes them
  (backward hands them over last layer first; see "Per-micro-batch order" below); otherwise
  one row per step holds the locally accumulated gradient (``.grad`` + the incoming gradient)
  after the step's last backward pass, with ``micro_step`` = the number of backward passes.
* ``reduced`` rows are taken just before ``optimizer.step()`` from ``.grad`` (after DDP's
  all-reduce, gradient clipping, loss-scale unscaling), with ``micro_step`` = the number of
  backward passes.

``grad_of`` reads a parameter's accumulated gradient (default ``.grad``; Monitor V1 reads
Megatron's ``main_grad`` where it exists) and ``keep_reduced`` drops redundant reduced rows
(data/tensor-parallel copies).

The number of micro-batches is ``micro_batch_number``, else ``grad_acc_steps``, from the config
or else from ``start(...)``; 1 by default. It is only the expected count: the probe counts the
backward passes each step really runs (gradient accumulation is detected, not trusted). The
``unreduced`` row of a step is the whole locally accumulated gradient the optimizer will see,
read after the last backward pass before the optimizer step, and its ``micro_step`` (and that of
the ``reduced`` rows) is the number of backward passes that ran. A count that disagrees with the
expected one is warned once, naming both numbers: more passes than expected are still recorded
in full (the gradient is read again after each pass beyond the expected count, which costs one
summary per extra pass); fewer leave the step without ``unreduced`` rows.

How ``unreduced`` rows are taken depends on the run:

* Single process, one row per step (no ``monitor_mbs_grad``): no hook per parameter. Tensor
  hooks on three sentinel parameters (the first, middle and last trainable ones) notice that a
  backward is running; the first to fire queues a callback that autograd runs once that
  backward has finished, and the callback summarises every parameter's accumulated gradient
  after the last micro-batch (nothing has reduced it: there is no other process). A few Python
  calls per backward instead of one per parameter: this is what keeps the monitor cheap enough
  to leave on. A sentinel whose gradient is computed inside a nested backward (reentrant
  activation checkpointing, ``checkpoint(..., use_reentrant=True)``) does not queue the callback:
  it would run at the end of the nested backward, before the parameters outside the checkpointed
  block have their gradients. A step whose backward reached no sentinel outside a nested
  backward but left gradients has no ``unreduced`` rows; the monitor says so once and switches
  to per-parameter hooks from the next step.

Gradients cleared (``zero_grad``) between two backward passes of one step, with no step of the
monitored optimizer in between, mean an optimizer the monitor does not see ends the steps (one it
cannot follow, see :mod:`trainprobe.backends.torch.optimizer`), or ``zero_grad`` between the
micro-batches of a step: one warning says so and what to do, in place of the count mismatch's
(whose "accumulated over all passes" would be false). Seen where ``.grad`` is set to None (the
default of ``zero_grad``), in a single process.

``reduced`` rows are always computed from the gradients as they are at the step, never reused
from ``unreduced``: loss-scale unscaling (``GradScaler.unscale_``) and writes through ``.data``
change gradients without bumping autograd's version counter, and telling such a change apart is
the very purpose of the two scopes.
* Otherwise (distributed runs, where DDP/FSDP reduce gradients during backward; per-micro-batch
  rows; FSDP2 shards): a tensor hook on every parameter, as described above.

Per-micro-batch order (``monitor_mbs_grad``): each hook computes its row's statistics at once
(on the gradient's device, no host sync) but holds the row aside with its parameter's index; the
held rows go to the step's rows sorted by ``(micro_step, parameter index)`` when the backward
pass that produced them ends (an autograd callback queued by the pass's first hook outside a
nested backward), and at the latest before the optimizer step, at the end of the step and on
``stop()``. So the file holds every micro-batch's rows in the model's parameter order, which the
one execution order (:mod:`trainprobe.engine.execution_order`) reads backwards, last layer first,
as backward computed them. On-demand reads between the end of a backward pass and the step
(Monitor V1's ``generate_xy_metrics``, the anomaly watch, live merges) see them as before.

FSDP2 (``fully_shard``): the model's parameters are sharded DTensors, but autograd computes
gradients for the unsharded parameters FSDP swaps into the modules for forward and backward.
A forward pre-hook on each module that owns sharded parameters hooks those unsharded
parameters (the same objects from one step to the next), so ``unreduced`` rows hold this rank's
full local gradient before the reduce-scatter, and ``reduced`` rows the local shard after it.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from trainprobe.backends.torch.dist_info import distributed_ready
from trainprobe.engine.log import warn_once
from trainprobe.engine.probes.base import Probe, ProbeSpec, StepClock
from trainprobe.engine.probes.grad_counts import warn_count_mismatch, warn_unseen_optimizer_step
from trainprobe.engine.probes.model_view import NamedParam
from trainprobe.engine.records import RowKey

if TYPE_CHECKING:
    from trainprobe.engine.backend import Backend


class WeightGradProbe(Probe):
    """Unreduced and reduced gradient statistics of every trainable parameter."""

    name = "weight_grad"
    with_micro_step = True

    def __init__(
        self,
        clock: StepClock,
        spec: ProbeSpec,
        params: list[NamedParam],
        micro_batches: int,
        modules: list[tuple[str, nn.Module]] | None = None,
        *,
        per_micro_batch: bool = False,
        grad_of: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
        keep_reduced: Callable[[NamedParam], bool] | None = None,
        backend: Backend,
    ) -> None:
        super().__init__(clock, spec, backend=backend)
        self.grad_of: Callable[[torch.Tensor], torch.Tensor | None] = grad_of or _dot_grad
        self.keep_reduced = keep_reduced
        self.per_micro_batch = per_micro_batch
        self.params = [p for p in params if p.param.requires_grad]
        self.micro_batches = micro_batches
        self.modules = modules or []
        self._seen = [0] * len(self.params)
        self._hooked_unsharded: set[int] = set()
        self._row_keys: dict[tuple[int, str, int], RowKey] = {}
        self._all_keys: dict[tuple[str, int], list[RowKey]] = {}  # every parameter's keys of a scope
        self._tensors = [p.param for p in self.params]
        self._backwards = 0  # backward passes finished in this step (backward-end capture)
        self._written: dict[int, RowKey] = {}  # this step's unreduced row key of each parameter
        self._counted = False  # this step's backward count was checked against micro_batches
        self._queued = False
        self._captured = False
        self._had_grad: dict[int, bool] = {}  # sentinel -> whether it had a gradient after the last pass
        self._cleared = False  # this step's gradients were cleared between two passes (zero_grad)
        self._held: list[tuple[int, int, RowKey, Any]] = []  # per-micro-batch rows not yet in self.rows
        self._held_lock = threading.Lock()  # hooks may run on autograd's device threads
        self._flush_queued = False  # a callback will move the held rows at the end of this backward
        self.backward_end = False  # unreduced rows read at the end of backward (else per-parameter hooks)

    def attach(self) -> None:
        self.backward_end = self._backward_end_capture()
        if self.backward_end:
            for index in self._sentinels():
                started = functools.partial(self._backward_started, index)
                self.keep(self.params[index].param.register_hook(self.guard(started)))
            return
        self._attach_param_hooks()

    def _attach_param_hooks(self) -> None:
        for index, named in enumerate(self.params):
            self.keep(named.param.register_hook(self.guard(self._on_grad(index, named.param))))
        self._attach_fsdp2()

    def _backward_end_capture(self) -> bool:
        """Whether ``unreduced`` rows can be read once at the end of backward (see the module
        docstring): single process, one row per step, no FSDP2 shard."""
        return bool(self.params) and not self.per_micro_batch and not distributed_ready() and not self.hooked_sharded()

    def _sentinels(self) -> list[int]:
        """Indices of the parameters whose gradient hooks announce a backward pass."""
        last = len(self.params) - 1
        return sorted({0, last // 2, last})

    # -- backward-end capture ----------------------------------------------------------------
    def _backward_started(self, index: int, grad: torch.Tensor) -> None:
        if self.backward_end and self.active and not self._queued and not _in_nested_backward():
            self._queued = True
            if self._had_grad.get(index) and self.grad_of(self._tensors[index]) is None:
                self._gradients_cleared()  # it had one after the last pass of this step: zero_grad ran
            torch.autograd.Variable._execution_engine.queue_callback(self.guard(self._backward_finished))

    def _backward_finished(self) -> None:
        self._queued = False
        if not self.backward_end or not self.active:
            return
        self._backwards += 1
        self._had_grad = {i: self.grad_of(self._tensors[i]) is not None for i in self._sentinels()}
        if self._backwards < self.micro_batches:
            return
        self._captured = True
        indices, grads = self._present_grads()
        self._replace_written()
        keys = self._keys_of(indices, "unreduced", self._backwards)
        self.rows.extend(keys, self.stats.rows(grads))
        self._written = dict(zip(indices, keys))

    def _present_grads(self) -> tuple[range | list[int], list[torch.Tensor]]:
        """The indices of the parameters that have a gradient now, and those gradients (every
        parameter, checked with one pass of C calls, is the common case)."""
        grads = list(map(self.grad_of, self._tensors))
        if _NONE_TYPE not in set(map(type, grads)):
            return range(len(grads)), cast(list[torch.Tensor], grads)  # no None among them
        indices = [i for i, g in enumerate(grads) if g is not None]
        return indices, [g for g in grads if g is not None]

    def _keys_of(self, indices: range | list[int], scope: str, micro_step: int) -> list[RowKey]:
        """Row keys of parameters ``indices``; for every parameter, one list made once."""
        if type(indices) is not range:
            return [self._key(i, scope, micro_step) for i in indices]
        keys = self._all_keys.get((scope, micro_step))
        if keys is None:
            keys = self._all_keys[(scope, micro_step)] = [self._key(i, scope, micro_step) for i in indices]
        return keys

    def _check_capture(self) -> None:
        """A collected step that reached the optimizer with gradients but no backward-end
        capture: fall back to per-parameter hooks from the next step on."""
        if self._captured or not self.backward_end or self._backwards:
            return
        if not any(self.grad_of(p.param) is not None for p in self.params):
            return
        warn_once(
            "weight_grad-no-backward-end",
            f"trainprobe weight_grad: backward at step {self.clock.step} reached none of the parameters "
            f"watched for the end of backward ({', '.join(self.params[i].name for i in self._sentinels())}) "
            "outside a nested backward (reentrant checkpointing), "
            "so its unreduced rows are missing; per-parameter gradient hooks are used from the next step on",
        )
        self.backward_end = False
        self._attach_param_hooks()

    def hooked_sharded(self) -> bool:
        """Whether any parameter is an FSDP2 shard."""
        return any(_is_sharded(p.param) for p in self.params)

    def _attach_fsdp2(self) -> None:
        """Hook the unsharded parameters of FSDP2 modules when they appear in forward."""
        index_of = {id(p.param): i for i, p in enumerate(self.params) if _is_sharded(p.param)}
        if not index_of:
            return
        for _, module in self.modules:
            owned = [
                (name, index_of[id(p)]) for name, p in module._parameters.items() if p is not None and id(p) in index_of
            ]
            if owned:
                self.keep(module.register_forward_pre_hook(self.guard(self._hook_unsharded(owned))))

    def _hook_unsharded(self, owned: list[tuple[str, int]]) -> Any:
        def pre(module: nn.Module, args: Any) -> None:
            for name, index in owned:
                p = module._parameters.get(name)
                # still the sharded parameter: not unsharded yet (under 2-D FSDP2 + TP the unsharded
                # parameter is itself a DTensor, a TP shard, and is hooked like any other)
                if p is None or p is self.params[index].param or id(p) in self._hooked_unsharded or not p.requires_grad:
                    continue
                self._hooked_unsharded.add(id(p))
                self.keep(p.register_hook(self.guard(self._on_grad(index, p))))

        return pre

    def _on_grad(self, index: int, holder: torch.Tensor) -> Any:
        """Hook for parameter ``index``; ``holder`` is the tensor whose ``.grad`` accumulates."""
        named = self.params[index]

        def on_grad(grad: torch.Tensor) -> None:
            if not self.active or grad is None:
                return
            self._seen[index] += 1
            seen = self._seen[index]
            if seen > 1 and self._clear_visible and holder is named.param and self.grad_of(holder) is None:
                self._gradients_cleared()  # it had one from the pass before, in this step: zero_grad ran
            if self.per_micro_batch:
                self._hold(index, seen - 1, self.stats.row(grad))
            elif seen >= self.micro_batches:
                accumulated = self.grad_of(holder)
                local = grad if accumulated is None else accumulated + grad
                self._replace_written(index)
                key = self._written[index] = self._key(index, "unreduced", seen)
                self.rows.add(key, self.stats.row(local))

        return on_grad

    # -- per-micro-batch rows in parameter order ----------------------------------------------
    def _hold(self, index: int, micro_step: int, values: Any) -> None:
        """Hold parameter ``index``'s row of micro-batch ``micro_step`` until its backward pass
        ends (:meth:`_release_held`); the first row of a pass queues that release."""
        key = self._key(index, "unreduced", micro_step)
        with self._held_lock:
            self._held.append((micro_step, index, key, values))
        if not self._flush_queued and not _in_nested_backward():
            self._flush_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.guard(self._backward_pass_ended))

    def _backward_pass_ended(self) -> None:
        self._flush_queued = False
        self._release_held()

    def _release_held(self) -> None:
        """Move the held per-micro-batch rows to the step's rows, sorted by ``(micro_step,
        parameter index)``: the model's parameter order within each micro-batch."""
        with self._held_lock:
            held, self._held = self._held, []
        if held:
            held.sort(key=_micro_then_index)
            self.rows.extend([key for _, _, key, _ in held], [values for _, _, _, values in held])

    def has_work(self) -> bool:
        return bool(self._held) or super().has_work()

    def fail(self, exc: BaseException) -> None:
        with self._held_lock:
            self._held = []
        super().fail(exc)

    def _gradients_cleared(self) -> None:
        """The gradients were cleared between two backward passes of this step with no step of
        the monitored optimizer in between: say once what that means and what to do (the
        count-mismatch warning, whose advice about grad_acc_steps would be wrong, is left out)."""
        self._cleared = True
        warn_unseen_optimizer_step(self.clock.step)

    @functools.cached_property
    def _clear_visible(self) -> bool:
        """Whether per-parameter hooks can see a cleared gradient: in a single process (under
        DDP/FSDP the ``.grad`` between passes is the framework's business)."""
        return not distributed_ready()

    def before_optimizer_step(self) -> None:
        self._release_held()  # a pass whose callback was not queued (its rows all in a nested backward)
        self._check_capture()
        self._check_count()
        keys, values = self.reduced_rows()
        self.rows.extend(keys, values)

    def backward_passes(self) -> int:
        """Backward passes that reached the watched parameters in this step so far."""
        return self._backwards if self.backward_end else max(self._seen, default=0)

    def _micro_step(self) -> int:
        """``micro_step`` of this step's one-per-step rows: the backward passes that ran, or the
        expected number of micro-batches before any ran."""
        return self.backward_passes() or self.micro_batches

    def _replace_written(self, index: int | None = None) -> None:
        """Drop the unreduced rows a pass beyond the expected count reads again (all of them, or
        parameter ``index``'s): the step's row is the gradient after its last pass."""
        if index is None:
            old, self._written = list(self._written.values()), {}
        else:
            key = self._written.pop(index, None)
            old = [] if key is None else [key]
        if old:
            self.rows.discard(set(old))

    def _check_count(self) -> None:
        """Warn once if the step's backward passes are not the expected number of micro-batches."""
        if self._counted:
            return
        self._counted = True
        if self._cleared:
            return  # warn_unseen_optimizer_step said what happened
        passes = self.backward_passes()
        if self.per_micro_batch:
            outcome = "its unreduced rows are one per pass"
        elif self._written:
            outcome = f"its unreduced rows hold the gradient accumulated over all {passes} passes"
        else:
            outcome = "no unreduced row was written for it"
        warn_count_mismatch(self.clock.step, passes, self.micro_batches, outcome)

    def reduced_rows(self) -> tuple[list[RowKey], list[Any]]:
        """Reduced rows of the gradients as they are now (also read on demand by Monitor V1)."""
        keep = self.keep_reduced
        indices, grads = self._present_grads()
        stepping = self.clock.stepping
        if stepping is not None:  # one of several optimizers steps: its parameters' gradients only
            kept_ids = [(i, g) for i, g in zip(indices, grads) if id(self._tensors[i]) in stepping]
            indices, grads = [i for i, _ in kept_ids], [g for _, g in kept_ids]
        if keep is not None:
            kept = [(i, g) for i, g in zip(indices, grads) if keep(self.params[i])]
            indices, grads = [i for i, _ in kept], [g for _, g in kept]
        keys = self._keys_of(indices, "reduced", self._micro_step())
        return list(keys), self.stats.rows(grads)

    def _key(self, index: int, scope: str, micro_step: int) -> RowKey:
        """The row key of parameter ``index`` (made once, reused every step)."""
        key = self._row_keys.get((index, scope, micro_step))
        if key is None:
            named = self.params[index]
            key = self._row_keys[(index, scope, micro_step)] = RowKey(named.vpp_stage, named.name, scope, micro_step)
        return key

    def end_step(self) -> None:
        if self.clock.collecting and self.active:
            self._release_held()  # a step without an optimizer step, or stop() mid-step
            self._check_count()  # a step that ended without an optimizer step (skipped by AMP)
        with self._held_lock:
            self._held = []
        self._flush_queued = False
        self._seen = [0] * len(self.params)
        self._backwards = 0
        self._captured = False
        self._queued = False
        self._written = {}
        self._counted = False
        self._had_grad = {}
        self._cleared = False


_BACKWARD_OF_FUNCTION = torch.autograd.function.BackwardCFunction.apply.__code__
"""Code of the frame that runs a custom autograd Function's backward (reentrant checkpointing
runs a nested backward from there)."""


def _in_nested_backward() -> bool:
    """Whether the caller runs inside a backward started from a custom autograd Function's
    backward (a nested backward, as reentrant activation checkpointing runs)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _BACKWARD_OF_FUNCTION:
            return True
        frame = frame.f_back
    return False


_NONE_TYPE = type(None)


def _micro_then_index(held: tuple[int, int, RowKey, Any]) -> tuple[int, int]:
    """Sort key of a held per-micro-batch row: its micro-step, then its parameter's index."""
    return held[0], held[1]


def _dot_grad(p: torch.Tensor) -> torch.Tensor | None:
    return p.grad


def _is_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (an FSDP2 sharded parameter)."""
    return type(t) is not nn.Parameter and hasattr(t, "to_local") and hasattr(t, "device_mesh")
