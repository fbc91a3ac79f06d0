"""``TrainProbeCallback`` for Lightning (``lightning.pytorch``).

Example:
    >>> from trainprobe.integrations.lightning import TrainProbeCallback  # doctest: +SKIP
    >>> trainer = L.Trainer(callbacks=[TrainProbeCallback(metrics_config="train.yaml")])  # doctest: +SKIP

What is logged: the metrics of :mod:`trainprobe.frontdoors.metrics.compose` (tags and units listed
there), one step per optimizer step (``trainer.global_step``):

* ``loss`` / ``local_loss`` / ``device_accum_local_loss``: from the ``loss`` each
  ``training_step`` returned (mean / mean / sum over the micro-batches of the step; Lightning
  hands callbacks that loss divided by ``accumulate_grad_batches``, which is undone);
* ``batch-size``: leading dimension of the first tensor of each batch, summed over the
  micro-batches, times the world size;
* ``grad-norm``, ``local_norm``, ``device_local_norm``: read in ``on_before_optimizer_step``,
  i.e. after accumulation and before Lightning clips gradients;
* ``learning-rate``: the first optimizer's first parameter group;
* ``lr-<Optimizer>[/<group>]``: every parameter group of every optimizer, named exactly as
  Lightning's ``LearningRateMonitor`` names them (scheduler ``name``, ``-1`` suffixes,
  ``/pg1``, group ``name`` keys; see :mod:`trainprobe.frontdoors.metrics.lr_groups`);
* TEXT: the configuration's top-level keys and ``hparams`` (the module's hyperparameters).

Where they go: with ``tensorboard.tensorboard_dir`` to trainprobe's own event files, as
:class:`~trainprobe.frontdoors.metrics.TrainingMetricsMonitor` writes them. Without it (the
default) the scalars TensorBoard would get go to the trainer's own loggers
(``trainer.loggers``, ``log_metrics``) at the trainer's logging cadence, as Lightning's
``LearningRateMonitor`` does: on the steps where the logger connector updates the logs
(``log_every_n_steps``), at the step number Lightning's loggers use for that batch (the one its
``self.log`` values of the same batch get: ``k - 1`` for the metrics' step ``k``), named
``trainprobe/<tag>`` (per-group learning rates keep their ``lr-...`` names). A trainer without
a logger gets one log line saying so; the metrics then go to the log only.

With ``monitor_v2_config`` Monitor V2 is started with the LightningModule and the first
optimizer at ``on_train_start`` (with ``grad_acc_steps`` = ``trainer.accumulate_grad_batches``)
and stopped at ``on_train_end``. Its ``step`` column is the metrics' step: the trainer's
``global_step`` once the optimizer step is done (1 for the first optimizer step; a run resumed
with ``fit(ckpt_path=...)`` at global step N continues with N + 1).

Lightning runs forward and backward inside ``optimizer.step(closure)``, so the optimizer's
pre-step hook would fire before the gradients exist, and it clips gradients
(``gradient_clip_val``, ``configure_gradient_clipping``) *after* ``on_before_optimizer_step``.
Monitor V2's pre-step statistics (weight_grad ``reduced``, optimizer state) are therefore taken
right after the precision plugin's ``_after_closure`` (which runs ``on_before_optimizer_step``
and then the clipping), wrapped on that plugin instance for the run: they hold the gradients the
optimizer applies, as in the Hugging Face callback. (Where a Lightning version has no
``_after_closure`` they fall back to ``on_before_optimizer_step``, with one warning.) The
metrics keep Lightning's convention for gradient norms: before clipping. ``print_struct`` stops
training through ``trainer.should_stop``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

try:
    import lightning.pytorch as pl
except ImportError as exc:  # pragma: no cover - optional extra
    raise ImportError(
        f"trainprobe.integrations.lightning needs lightning ({exc}); pip install trainprobe[lightning]"
    ) from exc

import torch

from trainprobe.backends.torch.optimizer import innermost_optimizer
from trainprobe.engine.log import logger, warn_once
from trainprobe.engine.patching import AttrPatch
from trainprobe.frontdoors.metrics.lr_groups import LrSource
from trainprobe.frontdoors.metrics.sources import batch_counts
from trainprobe.integrations._common import MonitorPairCallback

__all__ = ["TrainProbeCallback"]


class TrainProbeCallback(MonitorPairCallback, pl.Callback):
    """Training metrics and/or Monitor V2 inside a Lightning ``Trainer``; the arguments are those
    of :class:`~trainprobe.integrations._common.MonitorPairCallback` (``metrics_config=``,
    ``monitor_v2_config=``, keyword arguments for ``TrainingMetricsMonitor``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._patch = AttrPatch()
        self._optimizer: torch.optim.Optimizer | None = None
        self._after_clipping = False
        self._reset()

    def _reset(self) -> None:
        self._losses: list[torch.Tensor] = []
        self._samples = 0
        self._tokens: int | None = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        self._patch.restore()
        hparams = dict(pl_module.hparams) if getattr(pl_module, "hparams", None) else None
        self._pair.start(
            pl_module,
            optimizer,
            initial_step=trainer.global_step,
            hook_optimizer=False,
            extra_text={"hparams": hparams} if hparams else None,
            grad_acc_steps=_accumulation(trainer),
            lr_sources=_lr_sources(trainer),
        )
        if self._pair.forwards and not trainer.loggers:
            logger.warning(
                "trainprobe: the Lightning Trainer has no logger, so the training metrics go to the log only "
                "(logger trainprobe.metrics); give the Trainer a logger, or set tensorboard.tensorboard_dir "
                "for trainprobe's own event files"
            )
        self._last_step = trainer.global_step
        self._reset()
        self._optimizer = innermost_optimizer(optimizer) if optimizer is not None else None
        self._after_clipping = self._pair.v2 is not None and self._read_after_clipping(trainer)

    def _read_after_clipping(self, trainer: pl.Trainer) -> bool:
        """Wrap the precision plugin's ``_after_closure`` (this instance only, undone at train
        end): Lightning calls it once the closure's backward has run, and it runs
        ``on_before_optimizer_step`` and then the gradient clipping; right after it, the
        gradients are those the optimizer applies. Returns False (with one warning) where this
        Lightning has no such method."""
        plugin = trainer.strategy.precision_plugin
        original = getattr(plugin, "_after_closure", None)
        if not callable(original) or trainer.strategy.precision_plugin is not plugin:
            warn_once(
                "lightning-after-closure",
                "trainprobe: this Lightning's precision plugin has no _after_closure; Monitor V2's weight_grad "
                "reduced rows are read in on_before_optimizer_step, before gradient clipping",
            )
            return False

        def after_closure(model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(model, optimizer, *args, **kwargs)
            if self._optimizer is None or innermost_optimizer(optimizer) is self._optimizer:
                self._pair.gradients_applied()
            return result

        self._patch.replace(plugin, "_after_closure", after_closure)
        return True

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self._pair.gradients_ready()
        if not self._after_clipping:
            self._pair.gradients_applied()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._pair.metrics is not None:
            loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
            if isinstance(loss, torch.Tensor) and loss.numel() == 1:
                # callbacks receive the loss divided by accumulate_grad_batches; undo it
                self._losses.append(loss.detach().reshape(()) * max(1, trainer.accumulate_grad_batches))
            samples, tokens = batch_counts(batch)
            self._samples += samples
            self._tokens = None if tokens is None or self._tokens is None else self._tokens + tokens
        if trainer.global_step == self._last_step:
            return  # accumulating: no optimizer step yet
        self._last_step = trainer.global_step
        world = max(1, trainer.world_size)
        stop = self._pair.end_step(
            loss=list(self._losses) or None,
            batch_size=self._samples * world if self._samples else None,
            num_tokens=self._tokens * world if self._tokens else None,
        )
        self._reset()
        if stop:
            trainer.should_stop = True
        elif self._pair.forwards and trainer.loggers and _should_update_logs(trainer):
            self._forward(trainer)

    def _forward(self, trainer: pl.Trainer) -> None:
        """The step's metrics to every logger of the trainer, at the step its loggers use for
        this batch (``_batches_that_stepped``, not yet counted up at ``on_train_batch_end``)."""
        values = self._pair.forwarded(trainer.global_step)
        if not values:
            return
        loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        step = getattr(loop, "_batches_that_stepped", trainer.global_step - 1)
        for each in trainer.loggers:
            each.log_metrics(values, step=step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop()

    def _stop(self) -> None:
        self._patch.restore()
        self._after_clipping = False
        self._pair.stop()


def _lr_sources(trainer: pl.Trainer) -> list[LrSource]:
    """The optimizers in ``LearningRateMonitor``'s naming order: those of the scheduler configs
    (with the scheduler's ``name``) first, then the others (a wrapper's ``.optimizer`` unwrapped
    one level, as Lightning does)."""
    sources = [LrSource(c.scheduler.optimizer, c.name) for c in trainer.lr_scheduler_configs]
    seen = [s.optimizer for s in sources]
    for optimizer in trainer.optimizers:
        optimizer = getattr(optimizer, "optimizer", optimizer)
        if all(optimizer is not other for other in seen):
            seen.append(optimizer)
            sources.append(LrSource(optimizer))
    return sources


def _should_update_logs(trainer: pl.Trainer) -> bool:
    """Whether the trainer's loggers are updated for this batch: its logger connector's rule
    (``log_every_n_steps``, or a stop), read as ``LearningRateMonitor`` reads it; the bare
    ``log_every_n_steps`` rule where this Lightning has no such connector."""
    if getattr(trainer, "fast_dev_run", False):
        return True
    connector = getattr(trainer, "_logger_connector", None)
    if connector is not None and hasattr(connector, "should_update_logs"):
        return bool(connector.should_update_logs)
    every = getattr(trainer, "log_every_n_steps", 0)
    return bool(every) and trainer.global_step % every == 0


def _accumulation(trainer: pl.Trainer) -> int | None:
    """The trainer's micro-batches per optimizer step (None where it has no fixed count)."""
    count = getattr(trainer, "accumulate_grad_batches", None)
    return count if isinstance(count, int) and not isinstance(count, bool) and count >= 1 else None
