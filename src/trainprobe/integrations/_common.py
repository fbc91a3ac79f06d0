"""What both trainer callbacks share: validated configs, and starting/stopping the monitors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from trainprobe.backends.torch.optimizer import innermost_optimizer
from trainprobe.engine.errors import ConfigError
from trainprobe.frontdoors.metrics.config import TrainingMetricsConfig, load_training_metrics_config
from trainprobe.frontdoors.metrics.lr_groups import LrSource
from trainprobe.frontdoors.metrics.monitor import TrainingMetricsMonitor
from trainprobe.frontdoors.monitor_v2.trainer import TrainerMonitorV2

ConfigSource = str | Path | Mapping[str, Any] | None


class MonitorPair:
    """Training metrics and/or Monitor V2, configured once and started per training run, on one
    clock: the trainer's global step (set at :meth:`start`, ticked by :meth:`end_step`).

    Args:
        metrics_config: training-metrics configuration (YAML/JSON path or dict), or None.
        monitor_v2_config: Monitor V2 configuration (JSON path or any mapping), or None.
        monitor_kwargs: keyword arguments for :class:`TrainingMetricsMonitor` (e.g.
            ``flops_per_token``).

    Raises:
        ConfigError: neither configuration is given, or one is invalid.
    """

    def __init__(
        self, metrics_config: ConfigSource, monitor_v2_config: ConfigSource, monitor_kwargs: Mapping[str, Any]
    ) -> None:
        if metrics_config is None and monitor_v2_config is None:
            raise ConfigError("TrainProbeCallback: pass metrics_config=, monitor_v2_config=, or both")
        self.metrics_config: TrainingMetricsConfig | None = (
            load_training_metrics_config(metrics_config, trainer_loggers=True) if metrics_config is not None else None
        )
        if isinstance(monitor_v2_config, Mapping):
            monitor_v2_config = dict(monitor_v2_config)
        self.v2 = TrainerMonitorV2(monitor_v2_config) if monitor_v2_config is not None else None
        self.monitor_kwargs = dict(monitor_kwargs)
        self.metrics: TrainingMetricsMonitor | None = None

    def start(
        self,
        model: nn.Module | None,
        optimizer: Any,
        *,
        initial_step: int,
        hook_optimizer: bool,
        extra_text: Mapping[str, Any] | None,
        grad_acc_steps: int | None = None,
        lr_sources: Sequence[LrSource] | None = None,
    ) -> None:
        """Create the metrics monitor and start Monitor V2 (stopping a previous run first).

        One clock: ``initial_step`` is the trainer's global step at start (the optimizer steps
        already done, > 0 when resuming from a checkpoint). The next optimizer step is step
        ``initial_step + 1`` for both monitors: the metrics' step and Monitor V2's ``step``
        column hold the trainer's global step once that optimizer step is done (the ``step``
        of Hugging Face's ``log_history``), so the first optimizer step of a fresh run is 1.
        Monitor V2 treats the run as resumed (continuing an earlier run's files in its output
        folder) only when ``initial_step`` > 0; a fresh run into a used folder is refused.

        ``hook_optimizer=False``: the caller reports when the gradients are ready
        (:meth:`gradients_ready`, :meth:`gradients_applied`) instead of the optimizer's pre-step
        hook. ``grad_acc_steps``: the trainer's backward passes per optimizer step, passed to
        Monitor V2's ``start()`` (the configuration's own count, if any, wins). ``lr_sources``:
        the optimizers whose groups' learning rates are recorded (default: ``optimizer``)."""
        self.stop()
        if optimizer is not None:
            optimizer = innermost_optimizer(optimizer)
        if self.metrics_config is not None:
            self.metrics = TrainingMetricsMonitor(
                self.metrics_config,
                model=model,
                optimizer=optimizer,
                initial_step=initial_step,
                hook_optimizer=hook_optimizer,
                print_struct_exits=False,
                extra_text=extra_text,
                lr_sources=lr_sources,
                **self.monitor_kwargs,
            )
        if self.v2 is not None:
            # V2's clock holds the step being trained: the one that ends at global step + 1
            # resumed: only a run the trainer resumed continues an earlier run's files
            context: dict[str, Any] = {
                "optimizer_pre_step_hook": hook_optimizer,
                "initial_step": initial_step + 1,
                "resumed": initial_step > 0,
                "anomaly_stop_raises": False,  # an anomaly's "stop" stops the trainer (end_step's answer)
            }
            if grad_acc_steps is not None:
                context["grad_acc_steps"] = grad_acc_steps
            self.v2.start(model=model, optimizer=optimizer, **context)

    def end_step(self, **metrics_args: Any) -> bool:
        """The trainer finished an optimizer step: the one clock of both monitors ticks here.

        The metrics end their step (``metrics_args`` go to :meth:`TrainingMetricsMonitor.step`);
        Monitor V2 ends its own when ``optimizer.step()`` does not (``"patch_optimizer_step":
        false``; otherwise its optimizer post-hook already did, on the same optimizer step).
        Both then hold the trainer's global step. Returns whether the run should stop
        (``print_struct``, or Monitor V2's ``anomaly`` ``stop`` action: the trainer stops itself,
        with ``before_update`` after a step whose update was skipped)."""
        if self.v2 is not None and not self.v2.steps_with_optimizer:
            self.v2.step()
        anomaly = self.v2 is not None and self.v2.anomaly_stop is not None
        if self.metrics is None:
            return anomaly
        self.metrics.step(**metrics_args)
        return self.metrics.stop_requested or anomaly

    @property
    def forwards(self) -> bool:
        """Whether the metrics go to the trainer's loggers (no ``tensorboard_dir`` given)."""
        return self.metrics_config is not None and self.metrics_config.forwarded

    def forwarded(self, step: int) -> dict[str, float] | None:
        """The metrics of ``step`` for the trainer's loggers (see
        :meth:`TrainingMetricsMonitor.take_forwarded`), or None."""
        return self.metrics.take_forwarded(step) if self.metrics is not None else None

    def gradients_ready(self) -> None:
        """The step's gradients are accumulated, not yet clipped: the metrics read them
        (``grad-norm``, ``local_norm``, ``device_local_norm``, learning rate)."""
        if self.metrics is not None:
            self.metrics.capture_gradients()

    def gradients_applied(self) -> None:
        """The step's gradients are what the optimizer applies (after clipping, right before its
        update): Monitor V2 takes its pre-step statistics (weight_grad ``reduced``, optimizer
        state)."""
        if self.v2 is not None:
            self.v2.before_optimizer_step()

    def stop(self) -> None:
        """Close the metrics monitor and stop Monitor V2 (idempotent)."""
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.v2 is not None:
            self.v2.stop()


class MonitorPairCallback:
    """Base of the trainer callbacks: training metrics and/or Monitor V2 inside a trainer.

    Args:
        metrics_config: training-metrics configuration (``monitor_config`` / ``tensorboard``;
            YAML/JSON path or dict).
        monitor_v2_config: Monitor V2 configuration (JSON path or dict).
        monitor_kwargs: passed to ``TrainingMetricsMonitor`` (``flops_per_token``, ...).

    Raises:
        ConfigError: neither configuration given, or an invalid one (at construction).
    """

    def __init__(
        self, metrics_config: ConfigSource = None, monitor_v2_config: ConfigSource = None, **monitor_kwargs: Any
    ) -> None:
        super().__init__()
        self._pair = MonitorPair(metrics_config, monitor_v2_config, monitor_kwargs)
