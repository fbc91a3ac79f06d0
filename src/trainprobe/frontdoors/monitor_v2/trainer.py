"""``TrainerMonitorV2``: the Monitor V2 front door.

Example:
    >>> mon = TrainerMonitorV2("monitor_v2_config.json")          # doctest: +SKIP
    >>> mon.start(model=model, optimizer=optimizer, grad_acc_steps=4)  # doctest: +SKIP
    >>> for batch in loader:                                       # doctest: +SKIP
    ...     train_step(batch)   # optimizer.step() ends the monitored step
    >>> mon.stop()                                                 # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainprobe.backends import backend_for
from trainprobe.engine.anomaly.events import AnomalyEvent, AnomalyStop
from trainprobe.engine.backend import Backend
from trainprobe.engine.errors import ConfigError
from trainprobe.engine.folder_lock import FolderLock, move_aside
from trainprobe.engine.folders import make_output_folder
from trainprobe.engine.layout import CC_LOG_FILE, V2_MONITORS, v2_file_name, v2_rank_folder
from trainprobe.engine.log import logger, warn_once
from trainprobe.engine.optimizer_view import OptimizerView, warn_unstepped
from trainprobe.engine.patching import AttrPatch
from trainprobe.engine.probes.base import Probe, ProbeSpec, StepClock
from trainprobe.engine.probes.collectives import CcSpec, CollectiveProbe
from trainprobe.engine.probes.model_view import ModelView, NamedParam
from trainprobe.engine.probes.module import ModuleProbe, ModuleSpec
from trainprobe.engine.probes.optimizer_state import OptimizerStateProbe
from trainprobe.engine.probes.param import ParamProbe
from trainprobe.engine.session import NullSession, Session
from trainprobe.engine.sinks.csv_sink import CsvSink, TableLayout
from trainprobe.engine.sinks.earlier_runs import (
    drop_merged_step_files,
    keep_rows_before,
    open_windows,
    overwrite_requested,
    window_files,
)
from trainprobe.engine.sinks.parquet_sink import ParquetSink
from trainprobe.engine.skip_log import SKIP_FILE, SkipLog, logged_watcher
from trainprobe.engine.tensor_layout import LAYOUT_FILE, LayoutFile
from trainprobe.frontdoors.monitor_v2.anomaly_watch import AnomalyWatch, skip_update_wrapper
from trainprobe.frontdoors.monitor_v2.config import MonitorV2Config, load_monitor_v2_config

if TYPE_CHECKING:
    from trainprobe.backends.torch.live_stats import GlobalStatsProbe, StatKey

_NEEDS_OPTIMIZER = ("weight_grad", "optimizer", "param")


def _checked_callback(
    on_anomaly: Any, config: MonitorV2Config, backend: str
) -> Callable[[AnomalyEvent], Any] | None:
    """``on_anomaly`` once known to be usable with this config and backend.

    Raises:
        ConfigError: not callable; given without an ``anomaly`` block; an action the backend
            cannot take (MindSpore: ``dump`` and ``before_update`` are PyTorch's).
    """
    if on_anomaly is not None and not callable(on_anomaly):
        raise ConfigError(f"on_anomaly: must be callable (a function taking one event), got {type(on_anomaly).__name__}")
    anomaly = config.anomaly
    if on_anomaly is not None and anomaly is None:
        raise ConfigError('on_anomaly: needs an "anomaly" block in the config (e.g. "anomaly": {}) to run the rules')
    if anomaly is not None and backend != "pytorch":
        if anomaly.dumps:
            raise ConfigError(f'anomaly.actions: "dump" is not supported on the {config.framework} backend; remove it')
        if anomaly.before_update:
            raise ConfigError(f"anomaly.before_update: not supported on the {config.framework} backend; set it false")
    return on_anomaly  # type: ignore[no-any-return]


class TrainerMonitorV2:
    """Monitor V2: per-rank CSV statistics of modules, gradients, optimizer state, parameters
    and collectives.

    Args:
        config_path: path of a ``monitor_v2_config.json`` (a dict is accepted too).
        fr: framework, overriding the file's ``framework`` (pytorch, pt, torch, mindspore, ms).
            MindSpore (PyNative) needs the ``trainprobe[mindspore]`` extra; see
            ``docs/mindspore.md``.
        on_anomaly: with an ``anomaly`` block, called at the step boundary with each
            :class:`~trainprobe.engine.anomaly.events.AnomalyEvent` the online rules find (at most
            one per kind and step), monitoring paused while it runs; see
            ``docs/acting_on_anomalies.md``.

    Raises:
        ConfigError: the file is missing, not JSON, or has an invalid field (named by JSON path);
            the framework is not installed; ``monitors.cc`` on a framework whose adapter has no
            collectives (both built-in adapters have them).
    """

    def __init__(
        self,
        config_path: str | Path | dict[str, Any],
        fr: str | None = None,
        on_anomaly: Callable[[AnomalyEvent], Any] | None = None,
    ) -> None:
        self.config: MonitorV2Config = load_monitor_v2_config(config_path, framework=fr)
        self._backend: Backend = backend_for(self.config.framework, "fr" if fr is not None else "framework")
        self._on_anomaly = _checked_callback(on_anomaly, self.config, self._backend.name)
        self._watch: AnomalyWatch | None = None  # the online rules of the last session
        self._step_patch = AttrPatch()
        if self.config.cc.enabled and self._backend.collective_api() is None:
            raise ConfigError(
                f"monitors.cc: not supported on the {self.config.framework} backend of trainprobe "
                '(see docs/mindspore.md); remove it or set "enabled": false'
            )
        self._clock = StepClock(step=0)
        self._session: Session | NullSession = NullSession(self._clock)
        self._started = False
        self._wrote_here = False  # a session of this monitor has written to the rank folder
        self._lock: FolderLock | None = None  # the rank folder's, from start() to stop()
        self._live: GlobalStatsProbe | None = None  # the global_stats probe of the last session

    @property
    def current_step(self) -> int:
        """The step being trained (starts at 0, advanced by ``step()`` or ``optimizer.step()``)."""
        return self._clock.step

    @property
    def steps_with_optimizer(self) -> bool:
        """Whether ``optimizer.step()`` ends each step of the running session
        (``patch_optimizer_step`` in force); False when stopped or when :meth:`step` ends them."""
        return self._session.patch_step and not self._session.closed

    @property
    def output_dir(self) -> Path:
        """This rank's output folder, ``<output_dir>/rank_<rank>``."""
        return self.config.output_dir / v2_rank_folder(self._backend.rank())

    def start(self, model: Any = None, optimizer: Any = None, **context: Any) -> None:
        """Create the enabled monitors and attach them.

        Args:
            model: an ``nn.Module`` (MindSpore: an ``nn.Cell``), a list of model chunks
                (``vpp_stage`` = list index), or ``torch.distributed.pipelining``
                ``PipelineStage`` objects (one, or the list this rank holds: ``vpp_stage`` = each
                stage's global stage index, names prefixed ``<stage>:``).
            optimizer: a ``torch.optim.Optimizer`` or a wrapper with ``.optimizer`` (MindSpore:
                an ``nn.Optimizer`` or ``mint.optim`` optimizer); required by weight_grad,
                optimizer and param.
            context: ``grad_acc_steps`` / ``micro_batch_number`` (number of micro-batches per
                optimizer step; the config's values win); ``optimizer_pre_step_hook`` (default
                True): pass False when the loop runs forward and backward inside
                ``optimizer.step(closure)`` (Lightning), where the optimizer's pre-step hook
                fires before the gradients exist, and call :meth:`before_optimizer_step` once
                they are ready; ``initial_step`` (int >= 0): the step the run is at, for a
                resumed run or a trainer's global step (default: 0 for the first ``start()``,
                the step reached for a later one). A first ``start()`` whose ``rank_<r>``
                folder already holds an earlier run's CSV files keeps that run's rows of steps
                below ``initial_step`` and drops the rest (a resumed run continues its files);
                ``overwrite`` (default False; or ``TRAINPROBE_OVERWRITE=1``): remove an earlier
                run's CSV files first; ``resumed`` (default: ``initial_step`` > 0): whether this
                run continues an earlier one, for callers whose first step is not 0 (the trainer
                callbacks number steps from 1). Other keys are accepted and ignored. "CSV files"
                means the data files of either format (``.csv``, ``.parquet``, and the hidden
                ``.partial`` file a killed Parquet run was writing). The rank folder is locked
                from here to :meth:`stop` (:mod:`~trainprobe.engine.folder_lock`).

        Raises:
            ConfigError: a monitor needs a model or an optimizer that was not passed; the
                rank folder holds an earlier run's CSV files and neither ``initial_step`` > 0
                nor ``overwrite`` says what to do with them (the message names the folder);
                another run that is still going (in this or another process) writes the rank
                folder, whatever ``overwrite`` says.
            RuntimeError: already started.
        """
        if self._started:
            raise RuntimeError("TrainerMonitorV2.start(): already started; call stop() first")
        rank = self._backend.rank()
        self._check_global_stats()  # on every rank: each takes part in its collectives
        self._check_anomaly_ranks()
        if not self.config.monitors_rank(rank):
            logger.info(
                "trainprobe: rank %d is not in rank=%s, nothing is monitored here", rank, list(self.config.ranks)
            )
            self._started = True
            return
        self._set_initial_step(context.get("initial_step"))
        self._check_arguments(model, optimizer)  # a bad call makes no folder and takes no lock
        rank_dir = make_output_folder(self.config.output_dir / v2_rank_folder(rank), "output_dir")
        lock = FolderLock(rank_dir, "output_dir")
        self._guard_exit()  # before the session's own atexit close, so that it runs after it
        try:
            self._session = self._build_session(model, optimizer, context, rank)
            self._session.attach()
            self._guard_update(optimizer, context)
        except BaseException:
            self._session.close()
            lock.release()
            raise
        self._lock = lock
        self._wrote_here = True
        self._started = True

    def step(self) -> None:
        """End the current training step: write its rows and move to the next step.

        Ignored (with one warning) when ``optimizer.step()`` already advances the step
        (``patch_optimizer_step``).
        """
        session = self._session
        if session.patch_step and not session.closed:
            warn_once(
                "v2-manual-step",
                "trainprobe: TrainerMonitorV2.step() is ignored because optimizer.step() advances "
                'the step (patch_optimizer_step); set "patch_optimizer_step": false to call step() yourself',
            )
            return
        session.end_step()

    def before_optimizer_step(self) -> None:
        """The gradients of this step are final: take the pre-step statistics (weight_grad
        ``reduced``, optimizer state). Only needed with ``start(optimizer_pre_step_hook=False)``
        (the integrations call it); otherwise the optimizer's pre-step hook does this."""
        self._session.optimizer_pre_step()

    def stop(self) -> None:
        """Write what is pending, remove every hook and patch, close the files. Idempotent;
        ``start()`` may be called again afterwards (the step count continues)."""
        self._session.close()
        self._session = NullSession(self._clock)
        if self._watch is not None:
            self._watch.close()
        self._unguard_update()
        self._started = False
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    def global_stats(self, step: int | None = None) -> dict[StatKey, dict[str, float]]:
        """The live full-tensor statistics of ``step`` (default: the latest collected step) with
        ``"global_stats": true``: ``{(table, name, scope): {op: value}}`` (the key a
        ``StatKey`` named tuple) for the ``weight_grad`` ``reduced``, ``param`` and ``optimizer``
        rows of every tensor this rank holds a piece of, each value that of the full tensor
        (merged over the ranks for shards, the local row for whole and replicated tensors).
        ``{}`` for a step not collected, not yet ended, or older than the last 8 collected; also
        when ``global_stats`` is off. Still readable after :meth:`stop`. See
        ``docs/parallelism.md#live-full-tensor-statistics``."""
        live = self._live
        return live.global_stats(step) if live is not None else {}

    @property
    def anomaly_events(self) -> list[AnomalyEvent]:
        """The events the online rules found so far (``anomaly`` block), in order; still
        readable after :meth:`stop`."""
        return list(self._watch.events) if self._watch is not None else []

    @property
    def anomaly_stop(self) -> AnomalyStop | None:
        """The :class:`~trainprobe.engine.anomaly.events.AnomalyStop` of a run the ``stop``
        action stopped (also when the trainer callbacks stop their trainer instead of raising
        it), else None."""
        return self._watch.stop_requested if self._watch is not None else None

    def __enter__(self) -> TrainerMonitorV2:
        """``with TrainerMonitorV2(...) as monitor:``: ``stop()`` runs when the block ends, also
        when the training loop raises, so every hook is removed and the files are flushed."""
        return self

    def __exit__(self, *exc_info: object) -> None:
        """The block ended, normally or by an exception (which propagates): :meth:`stop`."""
        self.stop()

    def _guard_exit(self) -> None:
        """A gloo run that never destroys its process group exits cleanly
        (:mod:`trainprobe.backends.torch.exit_guard`, issue #34's exit aborts)."""
        if self._backend.name == "pytorch":
            from trainprobe.backends.torch.exit_guard import destroy_at_exit

            destroy_at_exit()

    def _check_global_stats(self) -> None:
        """``global_stats`` needs the PyTorch backend, a monitor whose rows it merges, and every
        rank monitored (each takes part in its collectives)."""
        cfg = self.config
        if not cfg.global_stats:
            return
        if self._backend.name != "pytorch":
            raise ConfigError(f"global_stats: not supported on the {cfg.framework} backend; remove it or set it false")
        if not set(cfg.enabled_monitors()) & {"weight_grad", "param", "optimizer"}:
            raise ConfigError(
                "global_stats: merges the rows of monitors.weight_grad, param or optimizer, and none is enabled"
            )
        left_out = self._ranks_left_out()
        if left_out:
            raise ConfigError(
                f"global_stats: every rank takes part in its collectives, but rank={list(cfg.ranks)} leaves out "
                f"rank(s) {left_out}; monitor every rank (remove \"rank\") or set global_stats false"
            )

    def _ranks_left_out(self) -> list[int]:
        """The ranks of the world the config's ``rank`` list leaves unmonitored (PyTorch; none
        without a list): a collective every rank must join would wait for them."""
        if not self.config.ranks:
            return []
        from trainprobe.backends.torch.live_stats import world_size

        return sorted(set(range(world_size())) - set(self.config.ranks))

    def _check_anomaly_ranks(self) -> None:
        """A ``stop`` on several ranks is agreed by all of them each step: every rank monitored."""
        anomaly = self.config.anomaly
        if anomaly is None or not anomaly.stops or not self.config.ranks or self._backend.name != "pytorch":
            return
        left_out = self._ranks_left_out()
        if left_out:
            raise ConfigError(
                f'anomaly.actions: "stop" is agreed by every rank each step, but rank={list(self.config.ranks)} '
                f"leaves out rank(s) {left_out}; monitor every rank (remove \"rank\") or drop \"stop\""
            )

    def _anomaly_watch(
        self, model: Any, rank: int, rank_dir: Path, context: dict[str, Any], micro_tables: frozenset[str]
    ) -> AnomalyWatch | None:
        """The online rules of the ``anomaly`` block, or None."""
        self._watch = None
        anomaly = self.config.anomaly
        if anomaly is None:
            return None
        raises = context.get("anomaly_stop_raises", True)
        if not isinstance(raises, bool):
            raise ConfigError(f"start(anomaly_stop_raises=...): must be True or False, got {raises!r}")
        agree = None
        if anomaly.stops and self._backend.name == "pytorch" and self._backend.distributed():
            from trainprobe.backends.torch.dist_info import ranks_flagging

            agree = ranks_flagging
        self._watch = AnomalyWatch(
            anomaly,
            rank=rank,
            rank_dir=rank_dir,
            output_dir=self.config.output_dir,
            first_step=self._clock.step,
            clock=self._clock,
            model=model,
            on_anomaly=self._on_anomaly,
            agree=agree,
            raise_on_stop=raises,
            micro_step_tables=micro_tables,
        )
        return self._watch

    def _guard_update(self, optimizer: Any, context: dict[str, Any]) -> None:
        """With ``before_update`` under a trainer callback (no ``AnomalyStop`` raised), wrap the
        optimizer's ``step`` so that a stop skips the update (:func:`skip_update_wrapper`)."""
        watch = self._watch
        if watch is None or not watch.config.before_update or watch.raise_on_stop or optimizer is None:
            return
        from trainprobe.backends.torch.optimizer import innermost_optimizer

        inner = innermost_optimizer(optimizer)
        self._step_patch.replace(inner, "step", skip_update_wrapper(inner.step, self._session.end_step))

    def _unguard_update(self) -> None:
        self._step_patch.restore()

    def _live_stats(self, probes: list[Probe], view: ModelView, opt: OptimizerView | None) -> list[Probe]:
        """The ``global_stats`` probe (the session's last), or none."""
        self._live = None
        if not self.config.global_stats:
            return []
        from trainprobe.backends.torch.live_stats import GlobalStatsProbe

        params = view.optimizer_parameters(opt) if opt is not None else view.parameters()
        live = self._live = GlobalStatsProbe(
            self._clock, probes, params, backend=self._backend, chunks=view.chunks,
            optimizers=list(getattr(opt, "optimizers", ())) or None,
        )
        return [live]

    def _set_initial_step(self, step: Any) -> None:
        """Move the clock to ``start(initial_step=...)`` when given."""
        if step is None:
            return
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"start(initial_step=...): must be an integer >= 0, got {step!r}")
        self._clock.step = step

    def _make_room(self, rank_dir: Path, context: dict[str, Any]) -> None:
        """Deal with an earlier run's data files in ``rank_dir``, as ``start()`` documents."""
        files = window_files(rank_dir, V2_MONITORS)
        left_open = open_windows(rank_dir, V2_MONITORS)
        overwrite = context.get("overwrite", False)
        if not isinstance(overwrite, bool):
            raise ConfigError(f"start(overwrite=...): must be True or False, got {overwrite!r}")
        if not files and not left_open:
            return
        resumed = context.get("resumed", self._clock.step > 0 and context.get("initial_step") is not None)
        if not isinstance(resumed, bool):
            raise ConfigError(f"start(resumed=...): must be True or False, got {resumed!r}")
        if overwrite or overwrite_requested():
            keep_before = 0
        elif resumed:
            keep_before = self._clock.step
        else:  # a new run: the earlier one is kept whole, moved aside (engine.folder_lock.move_aside)
            move_aside(rank_dir, "output_dir")
            return
        try:
            dropped = keep_rows_before(drop_merged_step_files(files), keep_before, v2_file_name)
            for stale in open_windows(rank_dir, V2_MONITORS):  # a killed run's open windows: never whole
                stale.unlink()
        except OSError as exc:
            raise ConfigError(f"output_dir: cannot make room in {str(rank_dir)!r}: {exc}") from None
        logger.info("trainprobe: %s: %d rows of an earlier run from step %d on removed", rank_dir, dropped, keep_before)

    # -- assembly ------------------------------------------------------------------------
    def _check_arguments(self, model: Any, optimizer: Any) -> ModelView:
        """The model's view, once ``start()``'s arguments are known to give every enabled monitor
        what it needs (checked before anything is written or locked)."""
        enabled = self.config.enabled_monitors()
        view = self._backend.model_view(model)
        if "module" in enabled and not view.chunks:
            raise ConfigError("start(): monitors.module is enabled but no model was passed; call start(model=...)")
        missing = [name for name in enabled if name in _NEEDS_OPTIMIZER]
        if missing and optimizer is None:
            raise ConfigError(
                f"start(): monitors {', '.join(missing)} need the optimizer; call start(model=..., optimizer=...)"
            )
        return view

    def _build_session(self, model: Any, optimizer: Any, context: dict[str, Any], rank: int) -> Session:
        cfg, backend = self.config, self._backend
        enabled = cfg.enabled_monitors()
        view = self._check_arguments(model, optimizer)
        opt = backend.optimizer_view(optimizer) if optimizer is not None else None
        if opt is not None and set(enabled) & set(_NEEDS_OPTIMIZER):
            named = [(n.name, n.param) for n in view.parameters()]
            warn_unstepped(named, opt, "start(model=..., optimizer=[opt_d, opt_g])")
        rank_dir = make_output_folder(cfg.output_dir / v2_rank_folder(rank), "output_dir")
        if not self._wrote_here:
            self._make_room(rank_dir, context)
        clock = self._clock
        clock.micro_batches = self._micro_batches(context)
        probes = self._probes(enabled, view, opt, rank, rank_dir)
        layout_file = self._describe_layouts(enabled, view, opt, rank, rank_dir)
        pre_step_hook = context.get("optimizer_pre_step_hook", True)
        if not isinstance(pre_step_hook, bool):
            raise ConfigError(f"start(optimizer_pre_step_hook=...): must be True or False, got {pre_step_hook!r}")
        patch = cfg.patch_optimizer_step if cfg.patch_optimizer_step is not None else opt is not None
        if patch and opt is None:
            warn_once(
                "v2-patch-no-optimizer", "trainprobe: patch_optimizer_step needs an optimizer; call step() yourself"
            )
            patch = False
        # the column order is the spec's (the config's ops), as in V1; each kernel computes in that order
        layouts = {p.name: TableLayout(_with_micro_step(p, clock.micro_batches), p.spec.ops) for p in probes}
        live = self._live_stats(probes, view, opt)  # no table: out of the layouts
        described = self._module_layouts(probes, layout_file)  # no table either
        micro_tables = frozenset(name for name, layout in layouts.items() if layout.with_micro_step)
        watch = self._anomaly_watch(model, rank, rank_dir, context, micro_tables)
        sink: CsvSink | ParquetSink
        if cfg.format == "parquet":
            sink = ParquetSink(rank_dir, cfg.schedule, layouts, first_step=clock.step)
        else:
            sink = CsvSink(rank_dir, cfg.schedule, layouts, first_step=clock.step)
        session = Session(
            probes=[*probes, *described, *live],
            schedule=cfg.schedule,
            sink=sink,
            background=cfg.async_write is not False,
            clock=clock,
            optimizer=opt,
            patch_step=patch,
            pre_step_hook=pre_step_hook,
            skip_watch=logged_watcher(  # GradScaler's skipped steps labelled (engine/skip_log.py)
                self._backend.watch_skipped_steps, SkipLog(rank_dir / SKIP_FILE, clock.step), lambda: clock.step
            ),
            watch=watch,
        )
        if watch is not None:
            watch.bind(session.end_step, session.close)
            if self._live is not None:
                watch.see_full_tensors(self._live)  # the rules judge sharded rows on full tensors
        return session

    def _describe_layouts(
        self, enabled: list[str], view: ModelView, opt: OptimizerView | None, rank: int, rank_dir: Path
    ) -> LayoutFile | None:
        """Write ``tensor_layout.json`` (:mod:`trainprobe.engine.tensor_layout`) when a row may be
        a piece of a tensor: several ranks, or a parameter that is not whole; returns it (None
        when not written). Parameters' layouts are read once, here: a parameter resharded later
        in the run is not followed (module rows: :meth:`_module_layouts`)."""
        params = view.optimizer_parameters(opt) if opt is not None else view.parameters()
        world, layouts = self._backend.param_layouts(params, [*view.chunks, *([opt] if opt is not None else [])])
        if not layouts or (world == 1 and all(lay[0]["kind"] == "whole" for lay in layouts.values())):
            return None
        tensor_parallel = any(
            "placements" in rows and (unreduced["kind"] != "rank_local" or len(rows["mesh"]["shape"]) > 1)
            for rows, unreduced in layouts.values()
        )
        if "cc" in enabled and tensor_parallel:
            warn_once(
                "v2-cc-dtensor",
                "trainprobe: monitors.cc records torch.distributed's collectives (FSDP2's included); those DTensor "
                "issues for tensor parallelism (functional collectives) are not recorded",
            )
        file = LayoutFile(rank_dir / LAYOUT_FILE, rank, world)
        for named in params:
            if id(named.param) in layouts:
                _add_param_layouts(file, enabled, named.name, *layouts[id(named.param)])
        try:
            file.write(self._clock.step)
        except OSError as exc:
            warn_once("v2-layout-write", f"trainprobe: {file.path}: could not be written ({exc}); rows are still written")
        return file

    def _module_layouts(self, probes: list[Probe], file: LayoutFile | None) -> list[Probe]:
        """The probe that adds the ``module`` rows to ``file`` at the first call of each module
        (:mod:`trainprobe.backends.torch.module_layouts`), or none (no layout file, no module
        monitor, or a framework whose placements are not read)."""
        module = next((p for p in probes if isinstance(p, ModuleProbe)), None)
        if file is None or module is None or self._backend.name != "pytorch":
            return []
        from trainprobe.backends.torch.module_layouts import ModuleLayoutProbe

        return [ModuleLayoutProbe(self._clock, module, file, backend=self._backend)]

    def _micro_batches(self, context: dict[str, Any]) -> int:
        wg = self.config.weight_grad
        for where, value in (
            ("monitors.weight_grad.micro_batch_number", wg.micro_batch_number),
            ("monitors.weight_grad.grad_acc_steps", wg.grad_acc_steps),
            ("start(micro_batch_number=...)", context.get("micro_batch_number")),
            ("start(grad_acc_steps=...)", context.get("grad_acc_steps")),
        ):
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ConfigError(f"{where}: must be an integer >= 1, got {value!r}")
                return value
        return 1

    def _probes(
        self, enabled: list[str], view: ModelView, opt: OptimizerView | None, rank: int, rank_dir: Path
    ) -> list[Probe]:
        cfg, clock, backend = self.config, self._clock, self._backend
        params = view.optimizer_parameters(opt) if opt is not None else view.parameters()
        probes: list[Probe] = []
        if "module" in enabled:
            m = cfg.module
            spec = ModuleSpec(m.ops, m.eps, targets=m.targets, record_eval_mode=m.record_eval_mode)
            probes.append(ModuleProbe(clock, spec, view, backend=backend))
        if "weight_grad" in enabled:
            wg = cfg.weight_grad
            probes.append(
                backend.weight_grad_probe(
                    clock,
                    ProbeSpec(wg.ops, wg.eps),
                    params,
                    clock.micro_batches,
                    view,
                    per_micro_batch=wg.monitor_mbs_grad,
                    optimizer=opt,
                )
            )
        if "optimizer" in enabled and opt is not None:
            mv = cfg.optimizer
            mv_spec = ProbeSpec(mv.ops, mv.eps)
            probes.append(OptimizerStateProbe(clock, mv_spec, opt, params, enabled=mv.mv_distribution, backend=backend))
        if "param" in enabled:
            pc = cfg.param
            # the parameters as the optimizer steps them (a mixed-precision wrapper's float32 copies)
            stepped = (
                [NamedParam(n.vpp_stage, n.name, opt.copy_of(n.param)) for n in params] if opt is not None else params
            )
            probes.append(
                ParamProbe(clock, ProbeSpec(pc.ops, pc.eps), stepped, enabled=pc.param_distribution, backend=backend)
            )
        if "cc" in enabled:
            cc = cfg.cc
            if not backend.distributed():
                warn_once(
                    "v2-cc-no-dist",
                    f"trainprobe: monitors.cc is enabled but {backend.name}'s distributed communication is not "
                    "initialised; cc is skipped",
                )
            elif cc.module_ranks and rank not in cc.module_ranks:
                logger.info("trainprobe: cc skipped on rank %d (module_ranks=%s)", rank, list(cc.module_ranks))
            else:
                cc_spec = CcSpec(
                    cc.ops,
                    cc.eps,
                    cc_codeline=cc.cc_codeline,
                    cc_log_only=cc.cc_log_only,
                    cc_pre_hook=cc.cc_pre_hook,
                    ddp_comm_hook=cc.ddp_comm_hook,
                )
                log_path = rank_dir / CC_LOG_FILE
                probes.append(CollectiveProbe(clock, cc_spec, rank, log_path, backend=backend, models=view.chunks))
        return probes


def _add_param_layouts(
    file: LayoutFile, enabled: list[str], name: str, layout: dict[str, Any], unreduced: dict[str, Any]
) -> None:
    """The entries of parameter ``name``'s rows. Under ZeRO-style sharding (``state_rank`` in
    ``layout``) only the rank holding its optimizer state has ``optimizer`` rows (the whole
    moments); every rank's ``param_updated`` row is read after ``step()`` returns, after the
    owner's broadcast: the whole parameter, as its other rows."""
    state_rank = layout.get("state_rank")
    layout = {k: v for k, v in layout.items() if k != "state_rank"}
    if "weight_grad" in enabled:
        file.add("weight_grad", name, layout)
        if unreduced != layout:
            file.add("weight_grad", name, unreduced, scope="unreduced")
    if "param" in enabled:
        file.add("param", name, layout)
    if "optimizer" in enabled and (state_rank is None or state_rank == file.rank):
        extra = {"state_rank": state_rank} if state_rank is not None else {}
        for moment in ("exp_avg", "exp_avg_sq"):
            file.add("optimizer", f"{name}.{moment}", {**layout, **extra})


def _with_micro_step(probe: Probe, micro_batches: int) -> bool:
    """Whether ``probe``'s table has a ``micro_step`` column. The module table has one only when
    micro-batches are configured (``grad_acc_steps`` / ``micro_batch_number`` > 1), as the spec
    ("available only when micro-batch is enabled") and the reference's header
    ``vpp_stage,step,module_name,scope,<ops>`` have it; the other tables as their probe says."""
    if probe.name == "module":
        return micro_batches > 1
    return probe.with_micro_step
