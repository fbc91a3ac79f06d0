"""``TrainProbeCallback`` for the Hugging Face ``Trainer``.

Example:
    >>> from trainprobe.integrations.transformers import TrainProbeCallback  # doctest: +SKIP
    >>> trainer = Trainer(model, args, train_dataset=ds,                        # doctest: +SKIP
    ...                   callbacks=[TrainProbeCallback(metrics_config="train.yaml")])

What is logged: the metrics of :mod:`trainprobe.frontdoors.metrics.compose` (tags and units listed
there), one step per optimizer step (``state.global_step``):

* ``loss``, ``local_loss``, ``device_accum_local_loss``: the step's loss as the Trainer logs it.
  The model's returned losses (``output.loss``) are averaged over the micro-batches, except when
  the Trainer passed ``num_items_in_batch`` (transformers ≥ 4.46 under gradient accumulation):
  then each is the micro-batch's share of the step's loss, and they are summed;
* ``batch-size``: samples fed to the model in the step, times the world size;
* ``grad-norm``: the norm the Trainer itself logs as ``grad_norm``, i.e. what
  ``Accelerator.clip_grad_norm_`` returned: the total gradient norm *before* clipping to
  ``max_grad_norm`` (the Trainer calls it every step, with an infinite bound when
  ``max_grad_norm`` is 0); measured from the gradients where no value was returned;
* ``local_norm``, ``device_local_norm``: the gradients read right before that clipping (after
  accumulation and any unscaling). Where they cannot be read there (an fp16 ``GradScaler``
  unscales inside the clipping call; DeepSpeed clips inside its engine) they are read in the
  optimizer's pre-step hook instead, i.e. after clipping;
* ``learning-rate``: the optimizer's first parameter group before the scheduler steps;
* ``lr-<Optimizer>[/<group>]``: every parameter group's learning rate, named as Lightning's
  ``LearningRateMonitor`` names them (``lr-AdamW``; ``lr-AdamW/pg1``, ``lr-AdamW/pg2`` with two
  groups; a group's ``name`` key replaces ``pg<i>``);
* TEXT: the configuration's top-level keys and ``training_args`` (``TrainingArguments``).

Where they go: with ``tensorboard.tensorboard_dir`` to trainprobe's own event files. Without it
(the default) the scalars TensorBoard would get are logged through the Trainer itself, so its
``report_to`` integrations (TensorBoard, W&B, MLflow, ...) and ``state.log_history`` get them at
its logging cadence: each time the Trainer logs its training loss (``logging_steps``,
``logging_first_step``, ``logging_strategy``), the callback's ``on_log`` calls
``trainer.log()`` with the metrics of that step (``trainprobe/<tag>``; per-group learning rates
as ``lr-...``): one more ``log_history`` entry at the same ``step``, written by the integrations
at ``state.global_step``. A callback is not handed the Trainer, so pass it:
``trainer.add_callback(TrainProbeCallback(metrics_config=..., trainer=trainer))``. Without
``trainer=``, or with ``report_to`` naming no integration, one log line says where the metrics
go (the log; ``state.log_history``).

With ``monitor_v2_config`` Monitor V2 is started with the Trainer's model and optimizer at
``on_train_begin`` (with ``grad_acc_steps`` = ``args.gradient_accumulation_steps``) and stopped at
``on_train_end``. Its weight_grad ``reduced`` rows (and optimizer-state rows) are taken in the
optimizer's pre-step hook: the Trainer clips before ``optimizer.step()``, so they hold the
gradients the optimizer applies, after clipping. Its ``step`` column is the metrics' step, the
Trainer's ``state.global_step`` once the step is done (1 for the first optimizer step; a run
resumed with ``resume_from_checkpoint`` at global step N continues with N + 1).
``print_struct`` stops training through ``control.should_training_stop``.

To read the norm before clipping, ``accelerate.Accelerator.clip_grad_norm_`` is wrapped for the
duration of ``train()`` (on the class, as the callback never sees the Trainer's accelerator;
only calls on this model's parameters are looked at, the call itself is unchanged) and put back
at ``on_train_end``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as exc:  # pragma: no cover - optional extra
    raise ImportError(
        f"trainprobe.integrations.transformers needs transformers ({exc}); pip install trainprobe[hf]"
    ) from exc

from trainprobe.engine.log import logger
from trainprobe.engine.patching import AttrPatch
from trainprobe.integrations._common import MonitorPairCallback

__all__ = ["TrainProbeCallback"]


class TrainProbeCallback(MonitorPairCallback, TrainerCallback):
    """Training metrics and/or Monitor V2 inside a Hugging Face ``Trainer``; the arguments are
    those of :class:`~trainprobe.integrations._common.MonitorPairCallback` (``metrics_config=``,
    ``monitor_v2_config=``, keyword arguments for ``TrainingMetricsMonitor``), and ``trainer=``:
    the Trainer this callback is added to, through which the metrics are logged when no
    ``tensorboard_dir`` is given (see the module docstring)."""

    def __init__(self, *args: Any, trainer: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._patch = AttrPatch()
        self._grad_norm: torch.Tensor | float | None = None
        # weakly: the Trainer holds this callback, and a cycle would keep its model alive until gc runs
        self._trainer: Callable[[], Any] = weakref.ref(trainer) if trainer is not None else lambda: None
        self._logging = False

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._patch.restore()
        model = kwargs.get("model")
        self._pair.start(
            model,
            kwargs.get("optimizer"),
            initial_step=state.global_step,
            hook_optimizer=True,
            extra_text={"training_args": args.to_dict()},
            grad_acc_steps=max(1, int(args.gradient_accumulation_steps)),
        )
        self._grad_norm = None
        if self._pair.metrics is not None and isinstance(model, torch.nn.Module):
            self._watch_clipping(model)
        if self._pair.forwards:
            self._say_where_metrics_go(args)

    def _say_where_metrics_go(self, args: TrainingArguments) -> None:
        """One log line when the forwarded metrics cannot reach a ``report_to`` integration."""
        if self._trainer() is None:
            logger.warning(
                "trainprobe: TrainProbeCallback was not given the Trainer (trainer=...), so the training metrics "
                "go to the log only (logger trainprobe.metrics); pass trainer= to log them through the Trainer's "
                "report_to integrations, or set tensorboard.tensorboard_dir for trainprobe's own event files"
            )
        elif not _integrations(args):
            logger.warning(
                "trainprobe: the Trainer reports to no integration (report_to), so the training metrics reach "
                "only state.log_history, the callbacks' on_log and the log; set report_to, or "
                "tensorboard.tensorboard_dir for trainprobe's own event files"
            )

    def _watch_clipping(self, model: torch.nn.Module) -> None:
        """Wrap ``Accelerator.clip_grad_norm_`` until :meth:`on_train_end`: on a call with this
        model's parameters, the metrics read the gradients before it clips them (when nothing is
        still to be unscaled) and keep the pre-clip norm it returns for ``grad-norm``."""
        try:
            from accelerate import Accelerator
        except ImportError:  # pragma: no cover - the Trainer needs accelerate
            return
        original = Accelerator.clip_grad_norm_
        mine = {id(p) for p in model.parameters()}
        callback = weakref.ref(self)

        def clip_grad_norm_(accelerator: Any, parameters: Any, *args: Any, **kwargs: Any) -> Any:
            me = callback()
            monitor = me._pair.metrics if me is not None else None
            if monitor is None:
                return original(accelerator, parameters, *args, **kwargs)
            parameters = list(parameters)
            ours = any(id(p) in mine for p in parameters)
            if ours and _grads_final(accelerator):
                monitor.capture_gradients()
            result = original(accelerator, parameters, *args, **kwargs)
            if ours and me is not None:
                me._grad_norm = result
            return result

        self._patch.replace(Accelerator, "clip_grad_norm_", clip_grad_norm_)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        grad_norm, self._grad_norm = self._grad_norm, None
        if self._pair.end_step(grad_norm=grad_norm if isinstance(grad_norm, (torch.Tensor, float, int)) else None):
            control.should_training_stop = True

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """The Trainer logged: after its training log (the one with ``loss``) of a recorded step,
        the metrics of that step are logged through it as well (not re-entered by that log)."""
        trainer = self._trainer()
        if self._logging or trainer is None or not self._pair.forwards or not logs or "loss" not in logs:
            return
        values = self._pair.forwarded(state.global_step)
        if not values:
            return
        self._logging = True
        try:
            trainer.log(dict(values))
        finally:
            self._logging = False

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._patch.restore()
        self._pair.stop()


def _integrations(args: TrainingArguments) -> list[str]:
    """The integrations ``report_to`` names (``"none"`` and empty: none)."""
    report_to = getattr(args, "report_to", None)
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    return [n for n in names if n and n != "none"]


def _grads_final(accelerator: Any) -> bool:
    """Whether ``.grad`` already holds the gradients to be clipped when ``clip_grad_norm_`` is
    entered: not with an fp16 ``GradScaler`` (it unscales inside the call) nor under DeepSpeed
    (its engine holds and clips them)."""
    if getattr(accelerator, "scaler", None) is not None:
        return False
    return getattr(accelerator, "deepspeed_engine_wrapped", None) is None and "DEEPSPEED" not in str(
        getattr(accelerator, "distributed_type", "")
    )
