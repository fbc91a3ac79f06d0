"""``TrainProbeCallback`` for the Hugging Face ``Trainer``.

Example:
    >>> from trainprobe.integrations.transformers import TrainProbeCallback  # doctest: +SKIP
    >>> trainer = Trainer(model, args, train_dataset=ds,                        # doctest: +SKIP
    ...                   callbacks=[TrainProbeCallback(metrics_config="train.yaml")])

What is logged: the metrics of :mod:`trainprobe.metrics.compose` (tags and units listed
there), one step per optimizer step (``state.global_step``):

* ``loss``, ``local_loss``, ``device_accum_local_loss``: the step's loss as the Trainer logs it.
  The model's returned losses (``output.loss``) are averaged over the micro-batches, except when
  the Trainer passed ``num_items_in_batch`` (transformers ≥ 4.46 under gradient accumulation):
  then each is the micro-batch's share of the step's loss, and they are summed;
* ``batch-size``: samples fed to the model in the step, times the world size;
* ``grad-norm``, ``local_norm``, ``device_local_norm``: gradients as the optimizer applies
  them, i.e. after the Trainer's clipping to ``max_grad_norm``;
* ``learning-rate``: the optimizer's first parameter group before the scheduler steps;
* TEXT: the configuration's top-level keys and ``training_args`` (``TrainingArguments``).

With ``monitor_v2_config`` Monitor V2 is started with the Trainer's model and optimizer at
``on_train_begin`` (with ``grad_acc_steps`` = ``args.gradient_accumulation_steps``) and stopped at
``on_train_end``. ``print_struct`` stops training through
``control.should_training_stop``.
"""

from __future__ import annotations

from typing import Any

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as exc:  # pragma: no cover - optional extra
    raise ImportError(
        f"trainprobe.integrations.transformers needs transformers ({exc}); pip install trainprobe[hf]"
    ) from exc

from trainprobe.integrations._common import MonitorPairCallback


class TrainProbeCallback(MonitorPairCallback, TrainerCallback):
    """Training metrics and/or Monitor V2 inside a Hugging Face ``Trainer``; the arguments are
    those of :class:`~trainprobe.integrations._common.MonitorPairCallback` (``metrics_config=``,
    ``monitor_v2_config=``, keyword arguments for ``TrainingMetricsMonitor``)."""

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._pair.start(
            kwargs.get("model"),
            kwargs.get("optimizer"),
            initial_step=state.global_step,
            hook_optimizer=True,
            extra_text={"training_args": args.to_dict()},
            grad_acc_steps=max(1, int(args.gradient_accumulation_steps)),
        )

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        mon = self._pair.metrics
        if mon is None:
            return
        mon.step()
        if mon.stop_requested:
            control.should_training_stop = True

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._pair.stop()
