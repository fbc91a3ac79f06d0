"""``TrainingMetricsMonitor``: loss, learning rate, gradient norms, throughput and per-parameter
state of a training run, to TensorBoard, the log and a per-rank dump folder.

Example:
    >>> mon = TrainingMetricsMonitor("train.yaml", model=model, optimizer=optimizer)  # doctest: +SKIP
    >>> for batch in loader:                                                           # doctest: +SKIP
    ...     loss = model(batch).loss; loss.backward(); optimizer.step(); optimizer.zero_grad()
    ...     mon.step(loss=loss)
    >>> mon.close()                                                                    # doctest: +SKIP

The tags, values and units written are listed in :mod:`trainprobe.frontdoors.metrics.compose`.

What the loop does not pass is gathered:

* gradients (``grad-norm``, ``local_norm``, ``device_local_norm``) and the learning rate are
  read by an optimizer step pre-hook, i.e. the gradients the optimizer applies (after clipping
  when the loop clips; pass ``grad_norm=`` to log the norm before clipping). Callers whose
  optimizer evaluates a closure inside ``step()`` call :meth:`capture_gradients` themselves
  and pass ``hook_optimizer=False`` (the Lightning callback does);
* the batch size and token count from the root module's forward inputs, and the loss from
  its outputs (``output.loss``), in training mode only; counts are multiplied by the world
  size (data parallelism assumed: pass ``batch_size``/``num_tokens`` for other layouts);
* Adam moments and weight norms from the optimizer and the model after ``optimizer.step()``;
* the iteration time between consecutive :meth:`step` calls (the first one from construction).

On collected steps everything stays on the device and moves to the host in one copy per
device, waited for on the writer thread; the training thread never synchronises. Any fault in
a gatherer is logged once and turns that gatherer off; training is never changed.
"""

from __future__ import annotations

import atexit
import math
import os
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainprobe.backends.torch import optimizer as torch_optimizer
from trainprobe.backends.torch.dist_info import current_rank
from trainprobe.backends.torch.model_view import TorchModelView
from trainprobe.backends.torch.optimizer import innermost_optimizer
from trainprobe.backends.torch.stats import shared_fused
from trainprobe.engine.errors import ConfigError
from trainprobe.engine.folder_lock import FolderLock
from trainprobe.engine.folders import make_output_folder, one_line_fault
from trainprobe.engine.guard import Fuses, guarded
from trainprobe.engine.log import error_once, logger, warn_once
from trainprobe.engine.probes.model_view import ModelView
from trainprobe.engine.records import ScalarBatch
from trainprobe.engine.schedule import Schedule
from trainprobe.engine.sinks.background import Sink, Writer
from trainprobe.engine.sinks.earlier_runs import overwrite_requested
from trainprobe.engine.sinks.fanout import FanOut
from trainprobe.frontdoors.metrics.compose import EXPERT_PREFIX, LR_GROUP_PREFIX, Composer
from trainprobe.frontdoors.metrics.config import TrainingMetricsConfig, config_text, load_training_metrics_config
from trainprobe.frontdoors.metrics.earlier_runs import make_room_for_events
from trainprobe.frontdoors.metrics.flops import FlopsEstimate, transformer_estimate
from trainprobe.frontdoors.metrics.lr_groups import LrSource, lr_group_names
from trainprobe.frontdoors.metrics.outputs import (
    MONITOR,
    ComposeSink,
    ForwardSink,
    LogSink,
    RawValues,
    TrainingStateSink,
    tensorboard_sink,
)
from trainprobe.frontdoors.metrics.sources import InputTap, norms

LossArg = torch.Tensor | float | Sequence[torch.Tensor | float] | None


def world_size() -> int:
    """``torch.distributed`` world size when initialised, else ``$WORLD_SIZE``, else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


class TrainingMetricsMonitor:
    """Training metrics of MindSpore Transformers' monitor, for PyTorch.

    Args:
        config: a YAML/JSON path or a dict holding ``monitor_config`` and/or ``tensorboard``
            (other top-level keys are the training configuration, written as TEXT), or a
            loaded :class:`TrainingMetricsConfig`.
        model: the ``nn.Module`` trained (or a list of model chunks); needed for parameter
            names, gathered batch sizes/losses, ``weight_norm`` and the FLOPs estimate.
        optimizer: the optimizer (or a wrapper with ``.optimizer``); needed for gathered
            gradients, learning rate and Adam moments.
        flops_per_sample / flops_per_token: training FLOPs (forward + backward) per sample or
            per token for ``model-flops-throughput-per-device``; by default estimated for
            transformer models (see :mod:`trainprobe.frontdoors.metrics.flops`).
        initial_step: the step count before the first :meth:`step` (when resuming): an earlier
            run's event files stay (TensorBoard hides their steps after ``initial_step``) and
            ``training_state.jsonl`` keeps its lines up to that step.
        overwrite: replace what an earlier run left (its event files; ``training_state.jsonl``
            from its first line) even when resuming; also ``tensorboard.overwrite: true`` or
            ``TRAINPROBE_OVERWRITE=1``. Without it (and without ``initial_step``), a run into a
            ``rank_<r>`` folder of ``tensorboard_dir`` or ``dump_path`` holding an earlier run's
            files keeps that run: the folder is moved to ``<tensorboard_dir>.1/rank_<r>`` (the
            next free ``.N``), said in one line, and this run writes a new, empty ``rank_<r>``.
        hook_optimizer: read gradients in an optimizer step pre-hook (default); False when the
            caller calls :meth:`capture_gradients` itself.
        print_struct_exits: with ``print_struct``, raise ``SystemExit(0)`` after printing
            (default); False only sets :attr:`stop_requested` (for trainers with a stop flag).
        extra_text: more ``{tag: value}`` entries for TensorBoard's TEXT page.
        lr_sources: the optimizers whose parameter groups' learning rates are written as
            ``lr-<Optimizer>[/<group>]`` (:mod:`~trainprobe.frontdoors.metrics.lr_groups`), in
            naming order; default: ``optimizer``.

    Raises:
        ConfigError: invalid configuration or arguments (the message names the field); an
            earlier run that cannot be moved aside (see
            :mod:`~trainprobe.frontdoors.metrics.earlier_runs`); ``dump_path`` or
            ``tensorboard_dir`` being written by another live run (see
            :mod:`~trainprobe.engine.folder_lock`).
    """

    def __init__(
        self,
        config: str | Path | Mapping[str, Any] | TrainingMetricsConfig,
        model: nn.Module | Sequence[nn.Module] | None = None,
        optimizer: Any = None,
        *,
        flops_per_sample: float | None = None,
        flops_per_token: float | None = None,
        initial_step: int = 0,
        overwrite: bool = False,
        hook_optimizer: bool = True,
        print_struct_exits: bool = True,
        extra_text: Mapping[str, Any] | None = None,
        lr_sources: Sequence[LrSource] | None = None,
    ) -> None:
        self.config = config if isinstance(config, TrainingMetricsConfig) else load_training_metrics_config(config)
        if flops_per_sample is not None and flops_per_token is not None:
            raise ConfigError("flops_per_sample / flops_per_token: give one of them, not both")
        for name, value in (("flops_per_sample", flops_per_sample), ("flops_per_token", flops_per_token)):
            if value is not None and (isinstance(value, bool) or not math.isfinite(float(value)) or value <= 0):
                raise ConfigError(f"{name}: must be a positive number, got {value!r}")
        if isinstance(initial_step, bool) or not isinstance(initial_step, int) or initial_step < 0:
            raise ConfigError(f"initial_step: must be an integer >= 0, got {initial_step!r}")
        if not isinstance(overwrite, bool):
            raise ConfigError(f"overwrite: must be True or False, got {overwrite!r}")
        tb_config = self.config.tensorboard
        self._overwrite = overwrite or overwrite_requested() or (tb_config is not None and tb_config.overwrite)
        self._locks: list[FolderLock] = []
        self.rank = current_rank()
        self.world = world_size()
        view = TorchModelView(model)
        self._model_chunks = view.chunks
        self._optimizer = innermost_optimizer(optimizer) if optimizer is not None else None
        self._params = self._named_params(view)
        self.param_names = [name for name, _ in self._params]
        mon = self.config.monitor
        self._state_index = [i for i, name in enumerate(self.param_names) if mon.targeted(name)]
        self._weights = [p for chunk in self._model_chunks for p in chunk.parameters() if p.requires_grad]
        if not self._weights:
            self._weights = [p for _, p in self._params if p.requires_grad]
        self._flops = self._flops_estimate(flops_per_sample, flops_per_token)
        self._print_struct_exits = print_struct_exits
        self._schedule = Schedule(step_interval=self.config.step_interval)  # the monitors' schedule: every k-th step
        self.stop_requested = False
        self._step = initial_step
        self._samples: int | None = 0
        self._gatherers = Fuses(f"metrics-{id(self)}")
        self._captured_step = -1
        self._grad_index: list[int] = []
        self._grad_norms: torch.Tensor | list[float] | None = None
        self._lr: torch.Tensor | float | None = None
        if lr_sources is None:
            lr_sources = [LrSource(self._optimizer)] if self._optimizer is not None else []
        self._lr_sources = [LrSource(innermost_optimizer(s.optimizer), s.scheduler_name) for s in lr_sources]
        self._group_lrs: list[tuple[str, torch.Tensor | float]] | None = None
        self._forward: ForwardSink | None = None
        self._closed = False
        self._handles: list[Any] = []
        # outputs first: a folder that cannot be created fails here, before any hook is attached
        composer = Composer(self.config, self.param_names, self.world)
        outputs = FanOut(self._outputs(), on_error=_output_failed)
        self._writer = Writer(ComposeSink(composer, outputs), background=True, on_error=_write_failed, max_pending=64)
        self._fused = shared_fused()
        self._fused.prepare()  # the norms' one-read pass: loaded now, or built aside (never compiled here)
        self._tap = InputTap(self._model_chunks[0]) if self._model_chunks else None
        if self._optimizer is not None and hook_optimizer:
            self._handles.append(self._optimizer.register_step_pre_hook(self._on_optimizer_step))
        text = self.config.text + (config_text(extra_text) if extra_text else ())
        if self.config.tensorboard is not None and text:
            self._writer.submit(ScalarBatch(MONITOR, 0, None, [], texts=tuple(text)))
        self._last_time = time.perf_counter()
        ref = weakref.ref(self)
        self._atexit: Callable[[], None] = lambda: (m := ref()) is not None and m.close()  # type: ignore[func-returns-value,assignment]
        atexit.register(self._atexit)

    # -- setup -------------------------------------------------------------------------------
    def _named_params(self, view: ModelView) -> list[tuple[str, torch.Tensor]]:
        if self._optimizer is not None:
            own = torch_optimizer.torch_optimizer_view(self._optimizer, "start(optimizer=...)")
            return [(p.name, p.param) for p in view.optimizer_parameters(own)]
        return [(p.name, p.param) for p in view.parameters() if p.param.requires_grad]

    def _flops_estimate(self, per_sample: float | None, per_token: float | None) -> FlopsEstimate | None:
        if per_sample is not None:
            return FlopsEstimate(per_sample=float(per_sample))
        if per_token is not None:
            return FlopsEstimate(per_token=float(per_token))
        if len(self._model_chunks) == 1:
            return transformer_estimate(self._model_chunks[0])
        return None

    def _outputs(self) -> list[Sink]:
        """The log, event-file and dump outputs; each folder is locked for this run and an earlier
        run's event files dealt with first. On a ConfigError nothing stays open or locked."""
        outputs: list[Sink] = [LogSink()]
        resume_at = self._step + 1 if self._step else None  # the first step this run writes
        try:
            tb = self.config.tensorboard
            if tb is not None and tb.tensorboard_dir is None:
                self._forward = ForwardSink()
                outputs.append(self._forward)
            elif tb is not None and tb.tensorboard_dir is not None:
                field = "tensorboard.tensorboard_dir"
                folder = self._locked_folder(tb.tensorboard_dir / f"rank_{self.rank}", field)
                make_room_for_events(folder, resumed=resume_at is not None, overwrite=self._overwrite, field=field)
                try:
                    outputs.append(tensorboard_sink(folder, tb.tensorboard_queue_size, resume_at))
                except OSError as exc:
                    raise ConfigError(f"tensorboard.tensorboard_dir: cannot write to {str(folder)!r}: {exc}") from None
            if self.config.monitor.dumped:
                field = "monitor_config.dump_path"
                folder = self._locked_folder(self.config.monitor.dump_path / f"rank_{self.rank}", field)
                make_room_for_events(folder, resumed=resume_at is not None, overwrite=self._overwrite, field=field)
                try:
                    outputs.append(TrainingStateSink(folder, resume_at=None if self._overwrite else resume_at))
                except OSError as exc:
                    raise ConfigError(f"monitor_config.dump_path: cannot write to {str(folder)!r}: {exc}") from None
        except BaseException:
            for out in outputs:
                out.close()
            self._release_locks()
            raise
        return outputs

    def _locked_folder(self, folder: Path, field: str) -> Path:
        """``folder`` created and locked for this run (once, when both outputs share it)."""
        make_output_folder(folder, field)
        if all(not _same_folder(lock.folder, folder) for lock in self._locks):
            self._locks.append(FolderLock(folder, field))
        return folder

    def _release_locks(self) -> None:
        for lock in self._locks:
            lock.release()
        self._locks = []

    # -- properties ----------------------------------------------------------------------------
    @property
    def current_step(self) -> int:
        """Steps completed (the step the next :meth:`step` call ends is ``current_step + 1``)."""
        return self._step

    def collects(self, step: int) -> bool:
        """Whether ``step`` (1-based) is recorded."""
        return self._schedule.collects(step)

    def take_forwarded(self, step: int) -> dict[str, float] | None:
        """In a trainer without ``tensorboard_dir``: the TensorBoard scalars of ``step`` for the
        trainer's loggers (``trainprobe/<tag>``, per-group learning rates as ``lr-...``), waiting
        for the step to be written first (call it at the trainer's logging cadence only: it
        waits for the device like the trainer's own ``.item()`` there). None when ``step`` was not
        recorded, was taken already, or nothing is forwarded."""
        if self._forward is None or self._closed:
            return None
        self._writer.flush()
        return self._forward.take(step)

    # -- gathering -----------------------------------------------------------------------------
    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.capture_gradients()

    def capture_gradients(self) -> None:
        """Measure the gradients and learning rate of the step now ending (once per step; later
        calls in the same step are ignored). Call it where the gradients are final, before
        ``optimizer.step()``, when ``hook_optimizer=False``."""
        step = self._step + 1
        if self._closed or self._captured_step == step or not self.collects(step):
            return
        self._captured_step = step
        self._gatherers.run("grads", "gradient norms", self._capture_grads)
        self._gatherers.run("lr", "the learning rate", self._capture_lr)
        if self._lr_sources and self.config.tensorboard is not None:  # written to TensorBoard only
            self._gatherers.run("lr-groups", "the learning rates of the parameter groups", self._capture_group_lrs)

    def _capture_grads(self) -> None:
        index, grads = [], []
        for i, (_, p) in enumerate(self._params):
            if p.grad is not None:
                index.append(i)
                grads.append(p.grad)
        self._grad_index = index
        self._grad_norms = norms(grads) if grads else None

    def _capture_lr(self) -> None:
        if self._optimizer is None or not self._optimizer.param_groups:
            return
        lr = self._optimizer.param_groups[0].get("lr")
        self._lr = lr.detach().clone() if isinstance(lr, torch.Tensor) else lr

    def _capture_group_lrs(self) -> None:
        self._group_lrs = self._read_group_lrs()

    def _read_group_lrs(self) -> list[tuple[str, torch.Tensor | float]]:
        """``(name, lr)`` of every parameter group of the ``lr_sources`` (tensors copied)."""
        out: list[tuple[str, torch.Tensor | float]] = []
        for source, names in zip(self._lr_sources, lr_group_names(self._lr_sources)):
            for name, group in zip(names, source.optimizer.param_groups):
                lr = group.get("lr")
                if isinstance(lr, torch.Tensor):
                    out.append((name, lr.detach().clone()))
                elif isinstance(lr, (int, float)):
                    out.append((name, float(lr)))
        return out

    # -- the step ------------------------------------------------------------------------------
    def step(
        self,
        loss: LossArg = None,
        lr: float | torch.Tensor | None = None,
        batch_size: int | None = None,
        num_tokens: int | None = None,
        loss_scale: float | torch.Tensor | None = None,
        expert_load: Mapping[str, torch.Tensor | Sequence[float]] | None = None,
        grad_norm: float | torch.Tensor | None = None,
    ) -> None:
        """End a training step (call once per optimizer step, after ``optimizer.step()``).

        Args:
            loss: the step's loss (tensor or number), or the list of its micro-batch losses;
                default: the losses the model returned.
            lr: learning rate; default: the optimizer's first parameter group.
            batch_size: samples of this step over all ranks; default: counted from the inputs.
            num_tokens: tokens of this step over all ranks; default: counted from the inputs.
            loss_scale: the mixed-precision loss scale, if any.
            expert_load: ``{layer_name: per-expert token counts}`` of mixture-of-experts routers.
            grad_norm: the global gradient norm (e.g. ``clip_grad_norm_``'s return, before
                clipping); default: measured from the gradients the optimizer applied.

        Raises:
            SystemExit: after printing the parameter names when ``print_struct`` is on (unless
                ``print_struct_exits=False``).
            TypeError: ``expert_load`` is not a mapping (checked at the call, on every step).
        """
        if expert_load is not None and not isinstance(expert_load, Mapping):
            raise TypeError(
                "step(expert_load=...): expected a mapping {layer_name: per-expert token counts}, "
                f"not {type(expert_load).__name__}"
            )
        if self._closed:
            return
        now = time.perf_counter()
        seconds, self._last_time = now - self._last_time, now
        self._step += 1
        step = self._step
        samples, tokens, losses, shares = (
            self._tap.take() if self._tap is not None and self._gatherers.is_on("inputs") else (0, None, [], False)
        )
        if batch_size is None and samples:
            batch_size = samples * self.world
        if num_tokens is None and tokens:
            num_tokens = tokens * self.world
        if self._samples is not None:
            self._samples = self._samples + int(batch_size) if batch_size is not None else None
        if self.config.monitor.monitor_on and self.config.monitor.print_struct:
            self._print_struct()
            return
        if not self.collects(step):
            self._grad_norms, self._lr, self._group_lrs = None, None, None
            self._fused.step_boundary()  # the one-read pass, if built aside since start: from the next step
            return

        def submit() -> None:
            payload = self._payload(
                step, seconds, loss, losses, lr, batch_size, num_tokens, loss_scale, expert_load, grad_norm
            )
            if shares and losses and not isinstance(loss, (list, tuple)):
                payload.put("micro_losses_are_shares", 1.0)
            self._writer.submit(payload.batch(step, self._samples))

        guarded(
            submit,
            off=lambda: False,  # a failed step is lost, the next one is tried again
            fail=lambda exc: error_once(
                f"metrics-step-{id(self)}", f"trainprobe: training metrics of step {step} failed"
            ),
        )()
        self._fused.step_boundary()  # the one-read pass, if built aside since start: from the next step

    def _payload(
        self,
        step: int,
        seconds: float,
        loss: LossArg,
        tapped: list[torch.Tensor],
        lr: Any,
        batch_size: int | None,
        num_tokens: int | None,
        loss_scale: Any,
        expert_load: Mapping[str, Any] | None,
        grad_norm: Any,
    ) -> RawValues:
        p = RawValues()
        p.put("iteration_s", seconds)
        if isinstance(loss, (list, tuple)):
            self._put_losses(p, list(loss))
        elif loss is not None:
            p.put("loss", _scalar(loss))
        if not isinstance(loss, (list, tuple)) and tapped:
            self._put_losses(p, tapped)
        if batch_size is not None:
            p.put("batch_size", float(batch_size))
        if self._flops is not None and batch_size is not None:
            flops = self._flops.step_flops(int(batch_size), num_tokens)
            if flops is not None:
                p.put("flops", flops)
        tb = self.config.tensorboard
        if loss_scale is not None and tb is not None and tb.log_loss_scale_to_tensorboard:
            p.put("loss_scale", _scalar(loss_scale))
        if grad_norm is not None:
            p.put("grad_norm", _scalar(grad_norm))
        lr_value = lr if lr is not None else self._lr
        if lr_value is None and self._optimizer is not None and self._gatherers.is_on("lr"):
            lr_value = self._optimizer.param_groups[0].get("lr")
        if lr_value is not None:
            p.put("lr", _scalar(lr_value))
        self._put_group_lrs(p, step)
        if self._captured_step == step and self._grad_norms is not None:
            p.put("grad_norms", self._grad_norms)
            p.put("grad_index", [float(i) for i in self._grad_index])
        self._grad_norms, self._lr = None, None
        mon = self.config.monitor
        if mon.monitor_on and mon.optimizer_state_format and self._optimizer is not None:
            self._gatherers.run("optimizer_state", "Adam moment norms", lambda: self._put_moments(p))
        if mon.monitor_on and mon.weight_state_format:
            self._gatherers.run("weights", "weight norms", lambda: p.put("weight_norms", norms(self._weights)))
        if expert_load and tb is not None and tb.log_expert_load_to_tensorboard:
            self._gatherers.run("experts", "expert load", lambda: self._put_experts(p, expert_load))
        return p

    def _put_group_lrs(self, p: RawValues, step: int) -> None:
        """Every parameter group's learning rate: as captured with the gradients, else read now."""
        groups, self._group_lrs = self._group_lrs, None
        if self._captured_step != step or groups is None:
            if not self._lr_sources or self.config.tensorboard is None or not self._gatherers.is_on("lr-groups"):
                return
            self._gatherers.run("lr-groups", "the learning rates of the parameter groups", self._capture_group_lrs)
            groups, self._group_lrs = self._group_lrs, None
        for name, lr in groups or ():
            p.put(LR_GROUP_PREFIX + name, _scalar(lr))

    def _put_losses(self, p: RawValues, losses: list[Any]) -> None:
        if not losses:
            return
        if all(isinstance(v, torch.Tensor) for v in losses):
            p.put("micro_losses", torch.stack([v.detach().reshape(()).float() for v in losses]))
        else:
            p.put("micro_losses", [float(_scalar(v)) for v in losses])

    def _put_moments(self, p: RawValues) -> None:
        assert self._optimizer is not None
        state = self._optimizer.state
        index, m, v = [], [], []
        for i in self._state_index:
            s = state.get(self._params[i][1])
            if s and "exp_avg" in s and "exp_avg_sq" in s:
                index.append(i)
                m.append(s["exp_avg"])
                v.append(s["exp_avg_sq"])
        if not index:
            warn_once(
                f"metrics-no-adam-{id(self)}",
                "trainprobe: monitor_config.optimizer_state_format: the optimizer keeps no exp_avg/exp_avg_sq "
                "(Adam-style) state; adam_m_norm/adam_v_norm are not written",
            )
            return
        p.put("state_index", [float(i) for i in index])
        p.put("m_norms", norms(m))
        p.put("v_norms", norms(v))

    @staticmethod
    def _put_experts(p: RawValues, expert_load: Mapping[str, Any]) -> None:
        for layer, counts in expert_load.items():
            t = counts.detach() if isinstance(counts, torch.Tensor) else torch.as_tensor(counts, dtype=torch.float64)
            p.put(EXPERT_PREFIX + str(layer), t.reshape(-1).to(torch.float64))

    def _print_struct(self) -> None:
        names = [name for chunk in self._model_chunks for name, q in chunk.named_parameters() if q.requires_grad]
        if not names:
            names = [name for name, q in self._params if q.requires_grad]
        for name in names:
            print(name, flush=True)
        logger.info("trainprobe: print_struct: %d trainable parameters printed; stopping the run", len(names))
        self.stop_requested = True
        self.close()
        if self._print_struct_exits:
            raise SystemExit(0)

    # -- teardown ------------------------------------------------------------------------------
    def flush(self) -> None:
        """Block until every recorded step is written."""
        if not self._closed:
            self._writer.flush()

    def close(self) -> None:
        """Remove every hook, write what is pending and close the files (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._tap is not None:
            self._tap.remove()
        self._writer.close(reached=self._step)
        self._release_locks()
        atexit.unregister(self._atexit)

    def __enter__(self) -> TrainingMetricsMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _output_failed(output: Sink, exc: BaseException) -> None:
    """One output failed: it is skipped from now on (the fan-out's rule), the others go on."""
    name = type(output).__name__
    error_once(
        f"metrics-output-{name}",
        f"trainprobe: {name} failed and is disabled; the other outputs continue ({type(exc).__name__}: {exc})",
        traceback=not one_line_fault(exc),  # disk full, permissions, a folder gone: one line says it all
    )


def _write_failed(monitor: str, exc: BaseException) -> None:
    """Writing failed outside any one output (the writer then drops the metrics' later steps)."""
    error_once(
        f"metrics-writer-{monitor}",
        f"trainprobe: writing the training metrics failed ({type(exc).__name__}: {exc}); training continues",
        traceback=not one_line_fault(exc),
    )


def _same_folder(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:
        return False


def _scalar(value: Any) -> float | torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(-1)[0] if value.numel() >= 1 else float("nan")
    return float(value)
