"""``weight_grad`` on MindSpore: parameter gradients, ``unreduced`` and ``reduced``.

MindSpore computes gradients functionally (``value_and_grad`` returns them; there is no
``.grad``), so the two scopes mean:

* ``unreduced``: the gradient autograd computes for each parameter in each backward pass, read
  by a tensor hook on the parameter (``Parameter.register_hook``, PyNative), before the training
  loop accumulates micro-batches, clips or scales, and before any gradient reducer
  (``nn.DistributedGradReducer``) averages it. With ``monitor_mbs_grad`` every micro-batch's
  gradient is a row, ``micro_step`` = its index; otherwise one row per step with the sum of
  the step's micro-batch gradients (what a PyTorch ``.grad`` holds after accumulation),
  written at the last micro-batch with ``micro_step`` = the number of micro-batches. Summing
  keeps one float32 copy per parameter while a step with more than one micro-batch runs.
* ``reduced``: the gradients the optimizer is called with (``optimizer(grads)``, also inside
  ``nn.TrainOneStepCell``), read by the optimizer cell's forward pre-hook, with ``micro_step`` =
  the number of micro-batches. With a plain loop and one micro-batch they equal ``unreduced``.

The number of micro-batches is ``micro_batch_number``, else ``grad_acc_steps``, from the config
or else from ``start(...)``/``set_monitor(...)``; 1 by default.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from trainprobe.backends.mindspore.optimizer import MindSporeOptimizer
from trainprobe.backends.mindspore.stats import MindSporeStats
from trainprobe.engine.probes.base import Probe, ProbeSpec, StepClock
from trainprobe.engine.probes.grad_counts import warn_short_step
from trainprobe.engine.probes.model_view import NamedParam
from trainprobe.engine.records import RowBuffer, RowKey, StepBatch

if TYPE_CHECKING:
    from trainprobe.engine.backend import Backend


class MindSporeWeightGradProbe(Probe):
    """Unreduced (parameter hooks) and reduced (optimizer input) gradient statistics of every
    trainable parameter the optimizer holds."""

    name = "weight_grad"
    with_micro_step = True

    def __init__(
        self,
        clock: StepClock,
        spec: ProbeSpec,
        params: list[NamedParam],
        micro_batches: int,
        optimizer: MindSporeOptimizer | None,
        *,
        per_micro_batch: bool = False,
        backend: Backend,
        keep_reduced: Callable[[NamedParam], bool] | None = None,
    ) -> None:
        super().__init__(clock, spec, backend=backend)
        self.optimizer = optimizer
        self.keep_reduced = keep_reduced
        self.per_micro_batch = per_micro_batch
        self.micro_batches = micro_batches
        self.params = [p for p in params if getattr(p.param, "requires_grad", True)]
        position = {id(p): i for i, p in enumerate(optimizer.parameters)} if optimizer is not None else {}
        self._position = [position.get(id(p.param)) for p in self.params]
        self._seen = [0] * len(self.params)
        self._sums: dict[int, Any] = {}
        self.rows = ModelOrderRows({p.name: i for i, p in enumerate(self.params)})

    def attach(self) -> None:
        for index, named in enumerate(self.params):
            self.keep(self.backend.hook_grad(named.param, self.guard(self._on_grad(index))))

    def _on_grad(self, index: int) -> Callable[[Any], None]:
        named = self.params[index]

        def on_grad(grad: Any) -> None:
            if not self.active or grad is None:
                return
            self._seen[index] += 1
            seen = self._seen[index]
            if self.per_micro_batch:
                self.rows.add(RowKey(named.vpp_stage, named.name, "unreduced", seen - 1), self.stats.row(grad))
                return
            if self.micro_batches == 1:
                total = grad
            else:
                stats: MindSporeStats = self.stats  # type: ignore[assignment]
                total = stats.accumulate(self._sums.get(index), grad)
                if seen < self.micro_batches:
                    self._sums[index] = total
                    return
                self._sums.pop(index, None)
            if seen == self.micro_batches:
                key = RowKey(named.vpp_stage, named.name, "unreduced", self.micro_batches)
                self.rows.add(key, self.stats.row(total))

        return on_grad

    def before_optimizer_step(self) -> None:
        keys, values = self.reduced_rows()
        self.rows.extend(keys, values)

    def reduced_rows(self) -> tuple[list[RowKey], list[Any]]:
        """Reduced rows of the gradients the optimizer is being called with (empty outside a
        call; also read on demand by Monitor V1)."""
        grads = self.optimizer.gradients if self.optimizer is not None else None
        if grads is None:
            return [], []
        keep = self.keep_reduced
        keys: list[RowKey] = []
        tensors: list[Any] = []
        for named, pos in zip(self.params, self._position):
            if pos is None or pos >= len(grads) or (keep is not None and not keep(named)):
                continue
            keys.append(RowKey(named.vpp_stage, named.name, "reduced", self.micro_batches))
            tensors.append(grads[pos])
        return keys, self.stats.rows(tensors)

    def end_step(self) -> None:
        if not self.per_micro_batch and self.clock.collecting:
            short = max(self._seen, default=0)
            warn_short_step(self.clock.step, short, self.micro_batches)
        self._seen = [0] * len(self.params)
        self._sums.clear()


class ModelOrderRows(RowBuffer):
    """A row buffer that hands its ``unreduced`` rows over in model order, micro-batch by
    micro-batch, as PyTorch's rows come, rather than in the order backward reached the
    parameters (rows are visible to :meth:`snapshot` as soon as they are taken).

    Args:
        rank_of: parameter name → position in model order.
    """

    def __init__(self, rank_of: dict[str, int]) -> None:
        super().__init__()
        self._rank_of = rank_of

    def drain(self, monitor: str, step: int) -> StepBatch:
        with self._lock:
            pairs = sorted(zip(self._keys, self._values), key=self._order)
            self._keys = [k for k, _ in pairs]
            self._values = [v for _, v in pairs]
        return super().drain(monitor, step)

    def _order(self, pair: tuple[RowKey, Any]) -> tuple[int, int, int]:
        key = pair[0]
        if key.scope != "unreduced":
            return (1, 0, 0)  # reduced rows stay after, in their own (model) order
        return (0, key.micro_step or 0, self._rank_of.get(key.name, 0))
