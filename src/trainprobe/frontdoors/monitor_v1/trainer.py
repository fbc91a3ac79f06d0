"""``TrainerMon``: the Monitor V1 front door over the shared engine.

Example:
    >>> monitor = TrainerMon("monitor_config.json", params_have_main_grad=False)  # doctest: +SKIP
    >>> monitor.set_monitor(model, grad_acc_steps=4, optimizer=optimizer)         # doctest: +SKIP
    >>> for batch in loader:                                                       # doctest: +SKIP
    ...     train_step(batch)   # optimizer.step() ends each monitored step

``optimizer.step()`` ends a step: TrainerMon owns one step pre-hook (on the first optimizer) and
one post-hook (on the last, for chains), plus a forward pre-hook on each model chunk marking the
start of a step. At the end of each step it writes the step's rows, then ends ``print_struct``
and ``cc_log_only`` runs (exit code 0), then applies what changed (see
:mod:`trainprobe.frontdoors.monitor_v1.control`).

``print_struct`` follows the configuration in force like every other field: in static mode the
structure is recorded during the first step after ``set_monitor``; in dynamic mode during the
first step of a configuration read with ``dynamic_on: true`` (at start or from an edit), and never
while ``dynamic_on`` is false. The run ends after that step.

The work is split by job: :mod:`~trainprobe.frontdoors.monitor_v1.attachment` (what ``set_monitor``
attaches to), :mod:`~trainprobe.frontdoors.monitor_v1.probe_set` and :mod:`~trainprobe.frontdoors.monitor_v1.assembly`
(a session from a configuration), :mod:`~trainprobe.frontdoors.monitor_v1.control` (dynamic mode and
pending changes), :mod:`~trainprobe.frontdoors.monitor_v1.exits` and
:mod:`~trainprobe.frontdoors.monitor_v1.metrics_api` (``generate_*_metrics``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from torch import nn

from trainprobe.backends import backend_for
from trainprobe.engine.anomaly.events import AnomalyEvent, AnomalyStop
from trainprobe.engine.backend import Backend
from trainprobe.engine.errors import ConfigError
from trainprobe.engine.fields import config_file
from trainprobe.engine.log import logger, warn_once
from trainprobe.engine.optimizer_view import SeveralOptimizers
from trainprobe.engine.skip_log import SKIP_FILE, SkipLog
from trainprobe.engine.stats.ops import ALL_OPS, parse_ops
from trainprobe.frontdoors.monitor_v1 import output
from trainprobe.frontdoors.monitor_v1.assembly import SessionFactory
from trainprobe.frontdoors.monitor_v1.attachment import Attachment, attach
from trainprobe.frontdoors.monitor_v1.config import DEFAULT_V1_OPS, MonitorV1Config, load_monitor_v1_config
from trainprobe.frontdoors.monitor_v1.control import MonitorControl
from trainprobe.frontdoors.monitor_v1.dynamic import dynamic_mode
from trainprobe.frontdoors.monitor_v1.exits import run_end_message
from trainprobe.frontdoors.monitor_v1.metrics_api import Metrics, wgrad_metrics, xy_metrics
from trainprobe.frontdoors.monitor_v1.probe_set import module_names, refuse_unsupported, torch_only
from trainprobe.frontdoors.monitor_v1.struct import StructProbe


class TrainerMon:
    """Monitor V1: activations, weight gradients, optimizer moments, parameters, collectives.

    Args:
        config_file_path: the JSON config (see ``docs/monitor_v1.md``).
        process_group: the pipeline-parallel group; gives ``pp_stage`` and ``group_mates`` of
            anomalies.
        params_have_main_grad: read ``param.main_grad`` where it exists (Megatron), else ``.grad``.
        opt_ty: deprecated and ignored (the optimizer is recognised by itself).
        framework: the training framework, a key of :data:`trainprobe.backends.BACKENDS`
            (``pytorch``, or ``mindspore`` as ``trainprobe.mindspore.TrainerMon`` passes it:
            ``nn.Cell`` models in PyNative mode, where ``process_group`` gives pipeline stage 0
            and ``params_have_main_grad`` is ignored).
        on_anomaly: with an ``anomaly`` block in the config, called at the step boundary with
            each :class:`~trainprobe.engine.anomaly.events.AnomalyEvent` the online rules find
            (at most one per kind and step; see ``docs/acting_on_anomalies.md``). Keyword-only,
            an extension of the reference's signature.

    Raises:
        ConfigError: the file is missing, not JSON, or has an invalid field (named by JSON path);
            an unknown or unusable framework; a PyTorch-only field (``print_struct``,
            ``ur_distribution``, ``mg_direction``, ``recording_l2_features``, ``anomaly.dump``,
            ``anomaly.before_update``) switched on for another framework (named); ``on_anomaly``
            not callable, or given without an ``anomaly`` block.

    With ``anomaly.actions`` holding ``stop``, :class:`~trainprobe.engine.anomaly.events.AnomalyStop`
    comes out of ``optimizer.step()`` at the step boundary (before the update with
    ``before_update``); the monitor has written the step and stopped (:meth:`stop`) first.
    """

    def __init__(
        self,
        config_file_path: str | Path,
        process_group: Any = None,
        params_have_main_grad: bool = True,
        opt_ty: Any = None,
        *,
        framework: str = "pytorch",
        on_anomaly: Callable[[AnomalyEvent], Any] | None = None,
    ) -> None:
        self.config_file_path = config_file(config_file_path, "config_file_path")
        self.process_group = process_group
        self.params_have_main_grad = bool(params_have_main_grad)
        if opt_ty is not None:
            _deprecated(
                "opt_ty", "TrainerMon(opt_ty=...) is deprecated and ignored; the optimizer is recognised by itself"
            )
        self.dynamic = dynamic_mode()
        config = load_monitor_v1_config(self.config_file_path)
        self._backend: Backend = backend_for(framework, "framework")
        refuse_unsupported(config, self._backend)
        self._on_anomaly = _checked_callback(on_anomaly, config)
        self._control = MonitorControl(config, self.config_file_path, self.dynamic)
        self._attachment: Attachment | None = None
        self._factory: SessionFactory | None = None
        self._wrapped_optimizer: Any = None
        self._hooks: list[Any] = []
        self._skip_log: SkipLog | None = None
        self._struct: StructProbe | None = None

    # -- state ---------------------------------------------------------------------------
    @property
    def config(self) -> MonitorV1Config:
        """The configuration in force."""
        return self._control.config

    @property
    def current_step(self) -> int:
        """The step being trained (``start_iteration`` at first; 0 before ``set_monitor``)."""
        return self._attachment.clock.step if self._attachment is not None else 0

    @property
    def output_dir(self) -> Path | None:
        """This rank's run folder (None before the first output or with ``format: api``)."""
        return self._attachment.folder if self._attachment is not None else None

    @property
    def ops(self) -> tuple[str, ...]:
        """The statistics collected; assigning a list takes effect at the next step.

        Raises:
            ConfigError: an unknown op (on assignment).
        """
        return self._control.wanted.ops

    @ops.setter
    def ops(self, value: list[str]) -> None:
        ops = parse_ops(list(value) if isinstance(value, tuple) else value, "ops", ALL_OPS, DEFAULT_V1_OPS)
        self._control.change(dataclasses.replace(self._control.wanted, ops=ops))

    def reload_xy(self, xy_distribution: bool = False) -> None:
        """Switch activation monitoring on or off from the next step (deprecated in the
        reference in favour of dynamic mode, still supported)."""
        self._control.change(dataclasses.replace(self._control.wanted, xy_distribution=bool(xy_distribution)))

    # -- attaching -----------------------------------------------------------------------
    def set_monitor(
        self,
        model: nn.Module | list[nn.Module],
        grad_acc_steps: int,
        optimizer: Any,
        dp_group: Any = None,
        tp_group: Any = None,
        start_iteration: int = 0,
    ) -> None:
        """Attach to ``model`` (a module or a list of chunks) and ``optimizer`` (a torch
        optimizer, a wrapper holding it in ``.optimizer``, or a chain); count steps from
        ``start_iteration``.

        Raises:
            ConfigError: a bad argument (no optimizer, grad_acc_steps < 1, ...).
            RuntimeError: called twice.
        """
        if self._attachment is not None:
            raise RuntimeError("TrainerMon.set_monitor(): already called for this monitor")
        attachment = attach(
            self._backend,
            model,
            grad_acc_steps,
            optimizer if optimizer is not None else self._wrapped_optimizer,
            dp_group=dp_group,
            tp_group=tp_group,
            start_iteration=start_iteration,
            params_have_main_grad=self.params_have_main_grad,
            process_group=self.process_group,
        )
        self._attachment = attachment
        self._factory = SessionFactory(attachment, model=model, on_anomaly=self._on_anomaly)
        try:
            self._hook_steps(attachment)
            self._control.begin(self._factory)
            self._sync_struct()
        except BaseException:
            self.stop()  # a failed set_monitor leaves the model and optimizer as they were
            self._attachment = self._factory = None
            raise

    def _hook_steps(self, attachment: Attachment) -> None:
        """The step hooks."""
        optimizer = attachment.optimizer  # a chain's pre-step hook is its first member's, its post-step its last's
        # the skip watch first: its counting hook must run before _post_step, which may stop()
        watch = attachment.backend.watch_skipped_steps(
            optimizer, functools.partial(self._skipped_step, optimizer)
        )  # GradScaler skipped it
        self._hooks = [watch] if watch is not None else []
        if getattr(optimizer, "several", False):  # each optimizer's rows around its own step, the last ends it
            several: SeveralOptimizers = optimizer  # type: ignore[assignment]
            last = functools.partial(self._post_step, optimizer, (), {}, members=True)
            self._hooks.append(several.register_member_hooks(self._member_pre_step, self._member_post_step, last))
        else:
            self._hooks += [
                optimizer.register_step_pre_hook(self._pre_step),
                optimizer.register_step_post_hook(self._post_step),
            ]
        for chunk in attachment.view.chunks:
            self._hooks.append(chunk.register_forward_pre_hook(self._step_begins, prepend=True))

    def _sync_struct(self) -> None:
        """Keep the structure probe of ``print_struct`` in line with the configuration in force:
        one recording the first step of that configuration (see the module docstring) when it
        sets ``print_struct``, none otherwise (nor on a backend other than PyTorch, with a
        warning)."""
        attachment, first = self._attachment, self._control.active_from
        wanted = first if self.config.print_struct else None
        if self._struct is not None and self._struct.first_step != wanted:
            self._struct.detach()
            self._struct = None
        if (
            attachment is None
            or wanted is None
            or self._struct is not None
            or not torch_only("print_struct", attachment)
        ):
            return
        probe = StructProbe(
            attachment.clock,
            attachment.view,
            output.output_root(),
            attachment.rank,
            module_names(self.config, attachment),
            first_step=wanted,
        )
        probe.attach()
        self._struct = probe

    def set_wrapped_optimizer(self, optimizer: Any) -> None:
        """Deprecated: pass the optimizer to :meth:`set_monitor` instead."""
        _deprecated(
            "set_wrapped_optimizer",
            "TrainerMon.set_wrapped_optimizer() is deprecated; pass optimizer= to set_monitor()",
        )
        self._wrapped_optimizer = optimizer

    def monitor_gnorm_with_ad(
        self,
        model: nn.Module | list[nn.Module],
        grad_acc_steps: int = 1,
        optimizer: Any = None,
        dp_group: Any = None,
        tp_group: Any = None,
        start_iteration: int = 0,
    ) -> None:
        """Deprecated name of :meth:`set_monitor` (the optimizer may come from
        :meth:`set_wrapped_optimizer`)."""
        _deprecated("monitor_gnorm_with_ad", "TrainerMon.monitor_gnorm_with_ad() is deprecated; use set_monitor()")
        self.set_monitor(model, grad_acc_steps, optimizer, dp_group, tp_group, start_iteration)

    # -- metrics on demand ---------------------------------------------------------------
    def generate_wgrad_metrics(self) -> tuple[Metrics, Metrics]:
        """``(reduced, unreduced)`` gradient statistics, ``{param name: {op: value}}``.

        ``reduced`` is computed now from the accumulated gradients; ``unreduced`` holds the
        rows of the step in progress, else those of the latest collected step. Needs
        ``wg_distribution``; empty dicts otherwise.
        """
        if self._factory is None:
            return {}, {}
        return wgrad_metrics(self._control.session, self._factory.memory)

    def generate_xy_metrics(self) -> tuple[Metrics, Metrics]:
        """``(actv, actv_grad)``: ``{"<module>.<input|output>:<micro_step>": {op: value}}`` of
        the step in progress, else of the latest collected step. Empty without
        ``xy_distribution``."""
        if self._factory is None:
            return {}, {}
        return xy_metrics(self._control.session, self._factory.memory)

    @property
    def anomaly_events(self) -> list[AnomalyEvent]:
        """The events the online rules (``anomaly`` block) found so far, in order; still readable
        after :meth:`stop`."""
        watch = self._factory.watch if self._factory is not None else None
        return list(watch.events) if watch is not None else []

    def stop(self) -> None:
        """Write what is pending, remove every hook, close the files and unlock the run folder
        (idempotent)."""
        self._control.close()
        if self._factory is not None and self._factory.watch is not None:
            self._factory.watch.close()  # a dump of the anomaly action still running
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self._attachment is not None:
            self._attachment.release()
        if self._struct is not None:
            self._struct.detach()
            self._struct = None

    def __enter__(self) -> TrainerMon:
        """``with TrainerMon(...) as monitor:``: ``stop()`` runs when the block ends, also when
        the training loop raises, so every hook is removed and the files are flushed."""
        return self

    def __exit__(self, *exc_info: object) -> None:
        """The block ended, normally or by an exception (which propagates): :meth:`stop`."""
        self.stop()

    # -- step hooks ----------------------------------------------------------------------
    def _step_begins(self, module: nn.Module, args: Any) -> None:
        self._control.step_begins()

    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        with self._stopping_on_anomaly():
            self._control.before_optimizer_step()

    def _member_pre_step(self, stepping: frozenset[int]) -> None:
        """One of several optimizers is about to step ``stepping``: their pre-step rows."""
        with self._stopping_on_anomaly():
            self._control.session.optimizer_pre_step(stepping)

    @contextlib.contextmanager
    def _stopping_on_anomaly(self) -> Iterator[None]:
        """An :class:`AnomalyStop` of the online rules stops the monitor, then goes on to the
        training loop (out of ``optimizer.step()``)."""
        try:
            yield
        except AnomalyStop:
            self.stop()
            raise

    def _skipped_step(self, optimizer: Any) -> None:
        """GradScaler skipped the step: its backward rows are not anomalies (written to the run
        folder's ``amp_skips.jsonl`` for diagnose and report, as Monitor V2 does); the step ends."""
        watch = self._factory.watch if self._factory is not None else None
        if watch is not None:
            watch.skipped(self.current_step)
        self._record_skip()
        self._post_step(optimizer, (), {})

    def _record_skip(self) -> None:
        """Append the skipped step and the scale that overflowed to ``<run folder>/amp_skips.jsonl``
        (:mod:`trainprobe.engine.skip_log`); nothing before the run folder exists (``format: api``)."""
        folder = self._attachment.folder if self._attachment is not None else None
        if folder is None:
            return
        path = Path(folder) / SKIP_FILE
        if self._skip_log is None or self._skip_log.path != path:
            self._skip_log = SkipLog(path, self.current_step)
        scale = getattr(self._hooks[0], "last_scale", None) if self._hooks else None
        self._skip_log.record(self.current_step, scale)

    def _member_post_step(self, stepping: frozenset[int]) -> None:
        """One of several optimizers stepped ``stepping``: their post-step rows."""
        self._control.session.optimizer_post_step(stepping)

    def _post_step(self, optimizer: Any, args: Any, kwargs: Any, *, members: bool = False) -> None:
        """The step ended; ``members``: the last of several optimizers stepped (each one's
        post-step work is done)."""
        with self._stopping_on_anomaly():
            self._control.end_step(post_step=not members)
        try:
            ending = run_end_message([self._struct] if self._struct is not None else [], self._control.probes)
            if ending is not None:
                message, code = ending
                self.stop()
                print(message, flush=True)
                raise SystemExit(code)
            self._control.after_step()
            self._sync_struct()
        except SystemExit:
            raise
        except Exception as exc:  # noqa: BLE001 - never raise into training
            logger.error("trainprobe: monitor bookkeeping failed at step %d: %s", self.current_step, exc, exc_info=True)


def _checked_callback(on_anomaly: Any, config: MonitorV1Config) -> Callable[[AnomalyEvent], Any] | None:
    """``on_anomaly`` once known to be usable with ``config``.

    Raises:
        ConfigError: not callable, or given without an ``anomaly`` block.
    """
    if on_anomaly is not None and not callable(on_anomaly):
        raise ConfigError(f"on_anomaly: must be callable (a function taking one event), got {type(on_anomaly).__name__}")
    if on_anomaly is not None and config.anomaly is None:
        raise ConfigError('on_anomaly: needs an "anomaly" block in the config (e.g. "anomaly": {}) to run the rules')
    return on_anomaly  # type: ignore[no-any-return]


def _deprecated(key: str, message: str) -> None:
    warn_once(f"v1-deprecated-{key}", f"trainprobe: {message}")
    warnings.warn(message, DeprecationWarning, stacklevel=3)


__all__ = ["TrainerMon"]
