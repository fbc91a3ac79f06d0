"""The MindSpore adapter: :class:`~trainprobe.engine.backend.Backend` over MindSpore in PyNative mode.

* statistics: :class:`~trainprobe.backends.mindspore.stats.MindSporeStats`;
* module hooks: ``Cell.register_forward_pre_hook``/``register_forward_hook`` (with kwargs),
  gradients of a call's tensors through ``Tensor.register_hook`` (the hook returns the gradient
  unchanged; its handle is removed at the end of the step, so a tensor the loop reuses, such
  as a fixed batch, does not collect hooks). A forward is recorded when the cell is in
  training mode (``set_train()``) or runs under a gradient transform (``value_and_grad``,
  ``TrainOneStepCell``), since plain PyNative loops often never call ``set_train()``;
* the optimizer: :class:`~trainprobe.backends.mindspore.optimizer.MindSporeOptimizer` (its cell's
  forward hooks are the step hooks);
* ``weight_grad``: :class:`~trainprobe.backends.mindspore.weight_grad.MindSporeWeightGradProbe`;
* process groups: ``group_rank`` through ``mindspore.communication.get_rank(group)``;
  ``group_ranks`` is not read (None: a pipeline ``process_group`` gives stage 0); no
  ``main_grad`` (``grad_reader`` is None);
* collectives: :class:`~trainprobe.backends.mindspore.collectives.MindSporeCollectives`
  (``mint.distributed`` functions and the communication primitives).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import mindspore as ms

from trainprobe.backends.mindspore import runtime
from trainprobe.backends.mindspore.collectives import MINDSPORE_COLLECTIVES, MindSporeCollectives
from trainprobe.backends.mindspore.model_view import CellView
from trainprobe.backends.mindspore.optimizer import MindSporeOptimizer, unwrap_optimizer
from trainprobe.backends.mindspore.stats import MindSporeStats
from trainprobe.engine.errors import ConfigError
from trainprobe.engine.probes.model_view import ModelView, NamedParam
from trainprobe.engine.records import RowsOnHost

if TYPE_CHECKING:
    from trainprobe.engine.probes.base import Probe, ProbeSpec, StepClock


class MindSporeBackend:
    """MindSpore, PyNative mode."""

    name = "mindspore"
    tensor_type: type = ms.Tensor

    def collective_api(self) -> MindSporeCollectives:
        return MINDSPORE_COLLECTIVES

    device_copy = RowsOnHost  # MindSpore rows are host arrays already

    def is_compiling(self) -> bool:
        return False  # PyNative: hooks always run eagerly

    def at_trace_time(self, note: Callable[[object], None]) -> None:
        return None  # never traced

    def watch_skipped_steps(self, optimizer: Any, on_skip: Callable[[], None]) -> None:
        return None  # no loss scaler that skips optimizer steps behind its back

    def stats(self, ops: Sequence[str], eps: float) -> MindSporeStats:
        return MindSporeStats(ops, eps)

    def records_forward(self, module: Any, record_eval_mode: bool) -> bool:
        return bool(module.training) or record_eval_mode or runtime.grad_recording()

    def grad_recording(self) -> bool:
        return runtime.grad_recording()

    def wants_grad(self, t: Any) -> bool:
        return bool(t.is_floating_point())

    def hook_grad(self, t: Any, fn: Callable[[Any], None]) -> Any:
        def hook(grad: Any) -> Any:
            fn(grad)
            return grad  # MindSpore hooks must return the gradient to leave it unchanged

        return t.register_hook(hook)

    def rank(self) -> int:
        if self.distributed():
            from mindspore.communication import get_rank

            return int(get_rank())
        try:
            return int(os.environ.get("RANK", "0"))
        except ValueError:
            return 0

    def distributed(self) -> bool:
        from mindspore.communication.management import GlobalComm

        return bool(GlobalComm.INITED)

    def param_layouts(self, params: Sequence[Any], chunks: Sequence[Any]) -> tuple[int, dict[int, Any]]:
        """MindSpore's placements are not read: no layout file (every row is of the local tensor)."""
        return 1, {}

    def group_rank(self, group: Any, where: str) -> int:
        if not self.distributed():
            raise ConfigError(f"{where}: needs mindspore.communication to be initialised (init())")
        from mindspore.communication import get_rank

        return int(get_rank(group))

    def group_ranks(self, group: Any) -> None:
        return None  # groups are not read: Monitor V1's process_group gives pipeline stage 0

    def grad_reader(self, main_grad: bool) -> None:
        return None  # MindSpore parameters carry no main_grad: gradients come from the optimizer call

    def model_view(self, model: Any, where: str = "start(model=...)", *, stage_prefix: bool | None = None) -> ModelView:
        runtime.check_runs_operators("start()")
        if not runtime.pynative_mode():
            raise ConfigError(
                f"{where}: MindSpore runs in GRAPH_MODE, where cell and tensor hooks do not run; "
                "trainprobe needs PyNative mode: mindspore.set_context(mode=mindspore.PYNATIVE_MODE)"
            )
        return CellView(model, where, stage_prefix=stage_prefix)

    def optimizer_view(self, optimizer: Any, where: str = "start(optimizer=...)") -> MindSporeOptimizer:
        return unwrap_optimizer(optimizer, where)

    def weight_grad_probe(
        self,
        clock: StepClock,
        spec: ProbeSpec,
        params: list[NamedParam],
        micro_batches: int,
        view: ModelView,
        *,
        per_micro_batch: bool = False,
        optimizer: Any = None,
        grad_of: Callable[[Any], Any] | None = None,
        keep_reduced: Callable[[NamedParam], bool] | None = None,
    ) -> Probe:
        from trainprobe.backends.mindspore.weight_grad import MindSporeWeightGradProbe

        return MindSporeWeightGradProbe(
            clock,
            spec,
            params,
            micro_batches,
            optimizer,
            per_micro_batch=per_micro_batch,
            backend=self,
            keep_reduced=keep_reduced,
        )


MINDSPORE = MindSporeBackend()
"""The MindSpore adapter (stateless; shared)."""
