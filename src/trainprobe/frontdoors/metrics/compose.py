"""Raw step values → named metrics, with the specification's names and units (pure Python).

Runs on the writer thread. Every metric is a :class:`Metric` (a :class:`~trainprobe.engine.records.NamedScalar`):
a tag, a value and where it goes.

Scalars of the loss family (always logged in the step's summary line; written to TensorBoard
when there is a ``tensorboard`` section, each also as ``<tag>-vs-samples`` against the number
of samples consumed so far over all ranks):

========================================  ==================================================
tag                                       value (unit)
========================================  ==================================================
``learning-rate``                         learning rate of the first parameter group
``lr-<Optimizer>[/<group>]``               learning rate of every parameter group, named as
                                          Lightning's ``LearningRateMonitor`` names them
                                          (:mod:`~trainprobe.frontdoors.metrics.lr_groups`;
                                          TensorBoard only: no -vs-samples, not in the log)
``batch-size``                            samples in this step over all ranks (global batch)
``loss``                                  the loss of the step (the loop's, or the mean of
                                          the micro-batch losses the model returned)
``loss-scale``                            loss scale (``log_loss_scale_to_tensorboard``)
``grad-norm``                             global L2 norm of the gradients
``iteration-time``                        time of the step, milliseconds
                                          (``log_timers_to_tensorboard``)
``throughput``                            samples per second per device (timers)
``model-flops-throughput-per-device``     TFLOPS per device (10^12 FLOP/s), from a FLOPs
                                          estimate; written when one is available
``B-samples-per-day``                     billions of samples per day, all devices (timers)
``expert_load/<layer>/expert_<i>``        share of the layer's tokens routed to expert i
                                          (``log_expert_load_to_tensorboard``; no -vs-samples)
========================================  ==================================================

State metrics (``monitor_config``, each to the destinations of its ``*_format``):

=====================================  ========================================  ============================
tag                                    value                                     format key
=====================================  ========================================  ============================
``local_norm/<param>``                 L2 norm of the parameter's gradient on    ``local_norm_format``
                                       this rank (``target``/``invert``)
``device_local_norm``                  L2 norm of all gradients on this rank     ``device_local_norm_format``
``local_loss``                         mean of this rank's micro-batch losses    ``local_loss_format``
``device_accum_local_loss``            sum of this rank's micro-batch losses     ``device_local_loss_format``
``adam_m_norm/<param>``                L2 norm of Adam's first moment            ``optimizer_state_format``
``adam_v_norm/<param>``                L2 norm of Adam's second moment           ``optimizer_state_format``
``weight_norm``                        L2 norm of all trainable weights          ``weight_state_format``
``throughput_linearity``               throughput / ``throughput_baseline``      always log and tensorboard
=====================================  ========================================  ============================
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from trainprobe.engine.records import NamedScalar
from trainprobe.frontdoors.metrics.config import LOG, TENSORBOARD, Formats, TrainingMetricsConfig

Value = float | list[float]
"""A raw value of a step: a number or a list of numbers (host floats)."""

SECONDS_PER_DAY = 86400.0
EXPERT_PREFIX = "expert/"
LR_GROUP_PREFIX = "lr-group:"
"""Raw values ``lr-group:<name>``: the learning rate of the parameter group named ``<name>``."""


Metric = NamedScalar
"""One value to write (:class:`~trainprobe.engine.records.NamedScalar`: tag, value, formats,
``vs_samples``, ``summary`` for the log's one-line step summary, ``dump`` for
``training_state.jsonl``)."""


def _norm(values: Sequence[float]) -> float:
    return math.sqrt(math.fsum(v * v for v in values))


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


class Composer:
    """Builds the metrics of a step from its raw values.

    Args:
        config: the validated configuration.
        param_names: names of the optimizer's parameters, indexed like ``grad_index``.
        world_size: number of ranks (devices).
    """

    def __init__(self, config: TrainingMetricsConfig, param_names: Sequence[str], world_size: int) -> None:
        self.config = config
        self.names = list(param_names)
        self.world = max(1, world_size)
        tb = config.tensorboard
        self._loss_formats: Formats = frozenset({TENSORBOARD}) if tb is not None else frozenset()
        self._timers = tb is not None and tb.log_timers_to_tensorboard
        self._loss_scale = tb is not None and tb.log_loss_scale_to_tensorboard
        self._experts = tb is not None and tb.log_expert_load_to_tensorboard

    def compose(self, raw: dict[str, Value]) -> list[Metric]:
        """The metrics of one step, loss family first."""
        out: list[Metric] = []
        self._loss_family(raw, out)
        if self.config.monitor.monitor_on:
            self._state(raw, out)
        return out

    # -- loss family -----------------------------------------------------------------------
    def _scalar(self, out: list[Metric], tag: str, value: float, vs_samples: bool = True) -> None:
        out.append(Metric(tag, float(value), self._loss_formats, vs_samples=vs_samples, summary=True))

    def _loss_family(self, raw: dict[str, Value], out: list[Metric]) -> None:
        lr = raw.get("lr")
        if isinstance(lr, float):
            self._scalar(out, "learning-rate", lr)
        for key, value in raw.items():
            if key.startswith(LR_GROUP_PREFIX) and isinstance(value, float) and self._loss_formats:
                out.append(Metric(key[len(LR_GROUP_PREFIX) :], value, self._loss_formats))
        batch = raw.get("batch_size")
        if isinstance(batch, float):
            self._scalar(out, "batch-size", batch)
        loss = self.loss(raw)
        if loss is not None:
            self._scalar(out, "loss", loss)
        scale = raw.get("loss_scale")
        if self._loss_scale and isinstance(scale, float):
            self._scalar(out, "loss-scale", scale)
        grad_norm = self.grad_norm(raw)
        if grad_norm is not None:
            self._scalar(out, "grad-norm", grad_norm)
        seconds = raw.get("iteration_s")
        if isinstance(seconds, float) and seconds > 0:
            throughput = self.throughput(raw)
            if self._timers:
                self._scalar(out, "iteration-time", seconds * 1000.0)
                if throughput is not None:
                    self._scalar(out, "throughput", throughput)
            flops = raw.get("flops")
            if isinstance(flops, float):
                self._scalar(out, "model-flops-throughput-per-device", flops / self.world / seconds / 1e12)
            if self._timers and throughput is not None:
                self._scalar(out, "B-samples-per-day", throughput * self.world * SECONDS_PER_DAY / 1e9)
        if self._experts:
            for key, counts in raw.items():
                if key.startswith(EXPERT_PREFIX) and isinstance(counts, list):
                    total = math.fsum(counts)
                    layer = key[len(EXPERT_PREFIX) :]
                    for i, c in enumerate(counts):
                        share = c / total if total > 0 else 0.0
                        out.append(Metric(f"expert_load/{layer}/expert_{i}", share, frozenset({TENSORBOARD})))

    # -- state metrics ---------------------------------------------------------------------
    def _state(self, raw: dict[str, Value], out: list[Metric]) -> None:
        mon = self.config.monitor
        norms = raw.get("grad_norms")
        index = raw.get("grad_index")
        if isinstance(norms, list) and isinstance(index, list):
            if mon.local_norm_format:
                for i, v in zip(index, norms):
                    name = self.names[int(i)]
                    if mon.targeted(name):
                        out.append(Metric(f"local_norm/{name}", v, mon.local_norm_format, dump=True))
            if mon.device_local_norm_format:
                out.append(Metric("device_local_norm", _norm(norms), mon.device_local_norm_format, dump=True))
        micro = raw.get("micro_losses")
        shares = raw.get("micro_losses_are_shares") == 1.0
        local = _mean(micro) if isinstance(micro, list) and micro and not shares else self.loss(raw)
        accum = math.fsum(micro) if isinstance(micro, list) and micro else self.loss(raw)
        if mon.local_loss_format and local is not None:
            out.append(Metric("local_loss", local, mon.local_loss_format, dump=True))
        if mon.device_local_loss_format and accum is not None:
            out.append(Metric("device_accum_local_loss", accum, mon.device_local_loss_format, dump=True))
        state_index = raw.get("state_index")
        if mon.optimizer_state_format and isinstance(state_index, list):
            for key, tag in (("m_norms", "adam_m_norm"), ("v_norms", "adam_v_norm")):
                values = raw.get(key)
                if isinstance(values, list):
                    for i, v in zip(state_index, values):
                        out.append(Metric(f"{tag}/{self.names[int(i)]}", v, mon.optimizer_state_format))
        weights = raw.get("weight_norms")
        if mon.weight_state_format and isinstance(weights, list):
            out.append(Metric("weight_norm", _norm(weights), mon.weight_state_format))
        throughput = self.throughput(raw)
        if mon.throughput_baseline is not None and throughput is not None:
            linearity = throughput / mon.throughput_baseline
            out.append(Metric("throughput_linearity", linearity, frozenset({LOG, TENSORBOARD})))

    # -- derived values --------------------------------------------------------------------
    @staticmethod
    def loss(raw: dict[str, Value]) -> float | None:
        """The step's loss: the loop's, else the mean of the micro-batch losses (their sum when
        they are shares of the step's loss: a model called with ``num_items_in_batch``)."""
        loss = raw.get("loss")
        if isinstance(loss, float):
            return loss
        micro = raw.get("micro_losses")
        if isinstance(micro, list) and micro:
            return math.fsum(micro) if raw.get("micro_losses_are_shares") == 1.0 else _mean(micro)
        return None

    @staticmethod
    def grad_norm(raw: dict[str, Value]) -> float | None:
        """The loop's gradient norm, else the L2 norm of every gradient measured."""
        passed = raw.get("grad_norm")
        if isinstance(passed, float):
            return passed
        norms = raw.get("grad_norms")
        if isinstance(norms, list):
            return _norm(norms)
        return None

    def throughput(self, raw: dict[str, Value]) -> float | None:
        """Samples per second per device."""
        batch = raw.get("batch_size")
        seconds = raw.get("iteration_s")
        if isinstance(batch, float) and isinstance(seconds, float) and seconds > 0:
            return batch / self.world / seconds
        return None
