"""``TrainerMon``: the Monitor V1 front door over the shared engine.

Example:
    >>> monitor = TrainerMon("monitor_config.json", params_have_main_grad=False)  # doctest: +SKIP
    >>> monitor.set_monitor(model, grad_acc_steps=4, optimizer=optimizer)         # doctest: +SKIP
    >>> for batch in loader:                                                       # doctest: +SKIP
    ...     train_step(batch)   # optimizer.step() ends each monitored step

``optimizer.step()`` ends a step: TrainerMon owns one step pre-hook (on the first optimizer) and
one post-hook (on the last, for chains). At the end of each step it writes the step's rows, then
applies what changed: ``reload_xy`` / ``ops``, an edited config file in dynamic mode, the end of
``print_struct`` or ``cc_log_only`` runs (which stop the process with exit code 0).
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainprobe.config.monitor_v1 import DEFAULT_V1_OPS, MonitorV1Config, load_monitor_v1_config
from trainprobe.config.monitor_v2 import CcConfig as EngineCcConfig
from trainprobe.config.monitor_v2 import ModuleMonitorConfig, OptimizerConfig, ParamConfig, WeightGradConfig
from trainprobe.dist_info import current_rank, distributed_ready
from trainprobe.errors import ConfigError
from trainprobe.log import logger, warn_once
from trainprobe.monitor_v1 import output
from trainprobe.monitor_v1.alerts import AlertDetector, PipelineContext
from trainprobe.monitor_v1.dynamic import ConfigWatcher, dynamic_mode
from trainprobe.monitor_v1.features import MgDirectionProbe, UpdateRatioProbe
from trainprobe.monitor_v1.l2 import L2Probe
from trainprobe.monitor_v1.naming import V1Naming, bare, param_targeted, squash_name
from trainprobe.monitor_v1.optimizers import OptimizerGroup, unwrap_all
from trainprobe.monitor_v1.struct import StackProbe, StructProbe
from trainprobe.probes.base import Probe, StepClock
from trainprobe.probes.collectives import CollectiveProbe
from trainprobe.probes.model_view import ModelView, NamedParam
from trainprobe.probes.module import ModuleProbe
from trainprobe.probes.optimizer_state import OptimizerStateProbe
from trainprobe.probes.param import ParamProbe
from trainprobe.probes.weight_grad import WeightGradProbe
from trainprobe.session import Session
from trainprobe.sinks.background import Sink, Writer
from trainprobe.sinks.csv_sink import CsvSink
from trainprobe.sinks.fanout import FanOut
from trainprobe.sinks.memory import MemorySink
from trainprobe.sinks.tensorboard import TensorBoardSink
from trainprobe.stats.ops import ALL_OPS, parse_ops


class TrainerMon:
    """Monitor V1: activations, weight gradients, optimizer moments, parameters, collectives.

    Args:
        config_file_path: the JSON config (see ``docs/monitor_v1.md``).
        process_group: the pipeline-parallel group; gives ``pp_stage`` and ``group_mates`` of
            anomalies.
        params_have_main_grad: read ``param.main_grad`` where it exists (Megatron), else ``.grad``.
        opt_ty: deprecated and ignored (the optimizer is recognised by itself).

    Raises:
        ConfigError: the file is missing, not JSON, or has an invalid field (named by JSON path).
    """

    def __init__(
        self,
        config_file_path: str | Path,
        process_group: Any = None,
        params_have_main_grad: bool = True,
        opt_ty: Any = None,
    ) -> None:
        self.config_file_path = Path(config_file_path)
        self.config: MonitorV1Config = load_monitor_v1_config(self.config_file_path)
        self.process_group = process_group
        self.params_have_main_grad = bool(params_have_main_grad)
        if opt_ty is not None:
            _deprecated(
                "opt_ty", "TrainerMon(opt_ty=...) is deprecated and ignored; the optimizer is recognised by itself"
            )
        self.dynamic = dynamic_mode()
        self._watcher = ConfigWatcher(self.config_file_path) if self.dynamic else None
        self._clock = StepClock(step=0)
        self._session: Session | None = None
        self._pending: MonitorV1Config | None = None
        self._wrapped_optimizer: Any = None
        self._hooks: list[Any] = []
        self._extras: list[Probe] = []
        self._memory: MemorySink | None = None
        self._alerts: AlertDetector | None = None
        self._folder: Path | None = None
        self._set = False
        self._rank = 0
        self._between_steps = True

    # -- public API ----------------------------------------------------------------------
    @property
    def current_step(self) -> int:
        """The step being trained (``start_iteration`` at first)."""
        return self._clock.step

    @property
    def output_dir(self) -> Path | None:
        """This rank's run folder (None before ``set_monitor`` or with ``format: api``)."""
        return self._folder

    @property
    def ops(self) -> tuple[str, ...]:
        """The statistics collected; assigning a list takes effect at the next step."""
        return (self._pending or self.config).ops

    @ops.setter
    def ops(self, value: list[str]) -> None:
        ops = parse_ops(list(value) if isinstance(value, tuple) else value, "ops", ALL_OPS, DEFAULT_V1_OPS)
        self._change(dataclasses.replace(self._pending or self.config, ops=ops))

    def reload_xy(self, xy_distribution: bool = False) -> None:
        """Switch activation monitoring on or off from the next step (deprecated in the
        reference in favour of dynamic mode, still supported)."""
        self._change(dataclasses.replace(self._pending or self.config, xy_distribution=bool(xy_distribution)))

    def _change(self, cfg: MonitorV1Config) -> None:
        """Apply ``cfg`` now when no step is running (between ``optimizer.step()`` and the next
        forward), else at the end of the running step."""
        self._pending = cfg
        if self._set and self._between_steps:
            self._apply_pending()

    def set_monitor(
        self,
        model: nn.Module | list[nn.Module],
        grad_acc_steps: int,
        optimizer: Any,
        dp_group: Any = None,
        tp_group: Any = None,
        start_iteration: int = 0,
    ) -> None:
        """Attach to ``model`` (a module or a list of chunks) and ``optimizer``.

        Raises:
            ConfigError: a bad argument (no optimizer, grad_acc_steps < 1, ...).
            RuntimeError: called twice.
        """
        if self._set:
            raise RuntimeError("TrainerMon.set_monitor(): already called for this monitor")
        if optimizer is None:
            optimizer = self._wrapped_optimizer
        if optimizer is None:
            raise ConfigError("set_monitor(optimizer=...): the optimizer is required")
        for where, value, minimum in (("grad_acc_steps", grad_acc_steps, 1), ("start_iteration", start_iteration, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ConfigError(f"set_monitor({where}=...): must be an integer >= {minimum}, got {value!r}")
        chunks = [model] if isinstance(model, nn.Module) else model
        self._view = ModelView(list(chunks) if isinstance(chunks, (list, tuple)) else chunks)
        self._view.is_list = True  # V1 names always carry the "<vpp_stage>:" prefix
        self._optimizers = unwrap_all(optimizer)
        self._opt = self._optimizers[0] if len(self._optimizers) == 1 else OptimizerGroup(self._optimizers)
        self._rank = current_rank()
        self._clock.step = start_iteration
        self._clock.micro_batches = grad_acc_steps
        self._keep_reduced = _redundancy_filter(dp_group, tp_group)
        self._memory = MemorySink({}, output.table_of, output.api_key)
        self._set = True
        first, last = self._optimizers[0], self._optimizers[-1]
        self._hooks = [first.register_step_pre_hook(self._pre_step), last.register_step_post_hook(self._post_step)]
        for chunk in self._view.chunks:
            self._hooks.append(chunk.register_forward_pre_hook(self._step_begins, prepend=True))
        cfg = self.config
        if cfg.print_struct:
            self._extras.append(StructProbe(self._clock, self._view, output.output_root(), self._rank))
        for probe in self._extras:
            probe.attach()
        if self.dynamic:
            if cfg.dynamic_on:
                self._start(cfg, self._clock.step + 1)
        else:
            self._start(cfg, None)

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

    def generate_wgrad_metrics(self) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
        """``(reduced, unreduced)`` gradient statistics, ``{param name: {op: value}}``.

        ``reduced`` is computed now from the accumulated gradients; ``unreduced`` holds the
        rows of the step in progress, else those of the latest collected step. Needs
        ``wg_distribution``; empty dicts otherwise.
        """
        probe = self._probe(WeightGradProbe)
        if probe is None:
            warn_once("v1-wgrad-off", 'trainprobe: generate_wgrad_metrics() needs "wg_distribution": true')
            return {}, {}
        keys, values = probe.reduced_rows()
        ops = probe.stats.ops
        reduced = {k.name: dict(zip(ops, _host(v))) for k, v in zip(keys, values)}
        return reduced, self._current(probe, "grad_unreduced")

    def generate_xy_metrics(self) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
        """``(actv, actv_grad)``: ``{"<module>.<input|output>:<micro_step>": {op: value}}`` of
        the step in progress, else of the latest collected step. Empty without
        ``xy_distribution``."""
        probe = self._probe(ModuleProbe)
        if probe is None:
            return {}, {}
        return self._current(probe, "actv"), self._current(probe, "actv_grad")

    def stop(self) -> None:
        """Write what is pending, remove every hook, close the files (idempotent)."""
        self._close_session()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for probe in self._extras:
            probe.detach()
        self._extras = []

    # -- steps ---------------------------------------------------------------------------
    def _step_begins(self, module: nn.Module, args: Any) -> None:
        self._between_steps = False

    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._session is not None:
            self._session.optimizer_pre_step()

    def _post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        session = self._session
        if session is not None:
            session.optimizer_post_step()
            session.end_step()
        else:
            self._clock.step += 1
        self._between_steps = True
        try:
            self._after_step()
        except SystemExit:
            raise
        except Exception as exc:  # noqa: BLE001 - never raise into training
            logger.error("trainprobe: monitor bookkeeping failed at step %d: %s", self._clock.step, exc, exc_info=True)

    def _after_step(self) -> None:
        for probe in self._extras:
            if isinstance(probe, StructProbe) and probe.done():
                self.stop()
                print(
                    f"trainprobe: print_struct is set: the model structure is in {probe.path}; the run ends here "
                    '(exit code 0). Set "print_struct": false to train.',
                    flush=True,
                )
                raise SystemExit(0)
        cc = self._probe(CollectiveProbe)
        if cc is not None and cc.config.cc_log_only:
            self.stop()
            print(
                f"trainprobe: cc_log_only is set: the collective call sites were printed (and kept in "
                f'{cc.log_path}); the run ends here (exit code 0). Set "cc_codeline" from them and '
                '"cc_log_only": false to monitor.',
                flush=True,
            )
            raise SystemExit(0)
        if self._session is not None and self._session.closed:
            self._session = None
            if self.dynamic and self._watcher is not None:
                self._watcher.switch_off()
                logger.info("trainprobe: collect_times reached; dynamic_on set to false in %s", self.config_file_path)
        if self._watcher is not None:
            fresh = self._watcher.poll()
            if fresh is not None:
                self.config = fresh
                self._pending = None
                self._close_session()
                if fresh.dynamic_on:
                    self._start(fresh, self._clock.step)
                return
        if self._pending is not None:
            self._apply_pending()

    def _apply_pending(self) -> None:
        cfg, self._pending = self._pending, None
        assert cfg is not None
        self.config = cfg
        if self.dynamic and self._session is None:
            return  # dynamic mode and not monitoring: the change applies when monitoring starts
        start = self._session.schedule.start_step if self._session is not None else None
        self._close_session()
        self._start(cfg, start)

    # -- assembly ------------------------------------------------------------------------
    def _start(self, cfg: MonitorV1Config, start: int | None) -> None:
        schedule = cfg.schedule(start)
        if schedule is None:
            return
        probes = self._build_probes(cfg)
        if not probes:
            return
        ops_of = output.columns(cfg.ops)
        self._memory.ops = ops_of
        sinks: list[Sink] = [self._memory]
        if cfg.format != "api":
            if self._folder is None:
                self._folder = output.run_folder(self._rank, cfg.append_output)
            if cfg.format == "csv":
                layouts = output.layouts(cfg.ops, cfg.ndigits, cfg.monitor_mbs_grad)
                sinks.append(
                    CsvSink(
                        self._folder,
                        schedule,
                        layouts,
                        table_of=output.table_of,
                        name_file=output.file_name,
                        append=bool(cfg.append_output),
                    )
                )
            else:
                sinks.append(TensorBoardSink(self._folder, ops_of, output.table_of, output.tag_of(self._rank)))
        if cfg.alert.rules:
            sinks.append(self._alert_detector(cfg, ops_of))
        writer = Writer(FanOut(sinks), background=cfg.format != "api", on_error=lambda m, e: None)
        self._session = Session(probes=probes, schedule=schedule, writer=writer, clock=self._clock)
        self._session.attach()

    def _alert_detector(self, cfg: MonitorV1Config, ops_of: dict[str, tuple[str, ...]]) -> AlertDetector:
        """The detector of ``cfg.alert``, kept across sessions (its running averages and dump)
        while the alert settings do not change."""
        dump = output.output_root() / "anomaly_detected" / f"rank{self._rank}" if cfg.alert.dump else None
        det = self._alerts
        if det is None or det.rules != cfg.alert.rules or det.dump_dir != dump:
            det = AlertDetector(
                cfg.alert.rules, ops_of, output.table_of, _pipeline(self._rank, self.process_group), dump
            )
            self._alerts = det
        det.ops = ops_of
        return det

    def _build_probes(self, cfg: MonitorV1Config) -> list[Probe]:
        clock, view = self._clock, self._view
        ops, eps = cfg.ops, cfg.eps
        params = self._params(cfg)
        probes: list[Probe] = []
        if cfg.xy_distribution and cfg.monitors_rank(self._rank):
            if cfg.forward_only and cfg.backward_only:
                warn_once(
                    "v1-fwd-bwd-only",
                    "trainprobe: forward_only and backward_only are both true, so no activation is collected",
                )
            else:
                module_cfg = ModuleMonitorConfig(enabled=True, ops=ops, eps=eps)
                probes.append(ModuleProbe(clock, module_cfg, view, naming=V1Naming(cfg)))
        if cfg.wg_distribution:
            wg = WeightGradConfig(enabled=True, ops=ops, eps=eps, monitor_mbs_grad=cfg.monitor_mbs_grad)
            modules = [(name, module) for _, name, module in view.modules()]
            probes.append(
                WeightGradProbe(
                    clock,
                    wg,
                    params,
                    clock.micro_batches,
                    modules,
                    grad_of=_main_grad if self.params_have_main_grad else None,
                    keep_reduced=self._keep_reduced,
                )
            )
        if cfg.mv_distribution:
            mv = OptimizerConfig(enabled=True, ops=ops, eps=eps)
            probes.append(OptimizerStateProbe(clock, mv, self._opt, params, suffix_names=False))
        if cfg.param_distribution:
            probes.append(ParamProbe(clock, ParamConfig(enabled=True, ops=ops, eps=eps), params))
        if cfg.ur_distribution:
            probes.append(UpdateRatioProbe(clock, ops, eps, self._opt, params))
        if cfg.l2.enabled and cfg.monitors_rank(self._rank):
            if cfg.l2.attention_hook or cfg.l2.linear_hook is not None:
                probes.append(L2Probe(clock, cfg.l2, view))
            else:
                warn_once("v1-l2-empty", "trainprobe: recording_l2_features is true but l2_targets lists no hook")
        if cfg.mg_direction:
            probes.append(
                MgDirectionProbe(clock, ops, eps, self._opt, params, _main_grad if self.params_have_main_grad else None)
            )
        if cfg.cc.enable:
            if not distributed_ready():
                warn_once("v1-cc-no-dist", "trainprobe: cc_distribution needs torch.distributed; it is skipped")
            else:
                cc = EngineCcConfig(
                    enabled=True,
                    ops=ops,
                    eps=eps,
                    cc_codeline=cfg.cc.cc_codeline,
                    cc_log_only=cfg.cc.cc_log_only,
                    cc_pre_hook=cfg.cc.cc_pre_hook,
                )
                folder = self._folder or output.output_root() / f"cc_log-rank{self._rank}"
                probes.append(CollectiveProbe(clock, cc, self._rank, folder))
        if cfg.stack_info and cfg.monitors_rank(self._rank):
            if self._folder is None:
                self._folder = output.run_folder(self._rank, cfg.append_output)
            probes.append(StackProbe(clock, view, self._folder or output.output_root()))
        return probes

    def _params(self, cfg: MonitorV1Config) -> list[NamedParam]:
        out = []
        for named in self._view.optimizer_parameters(self._opt):  # type: ignore[arg-type]
            name = named.name
            if cfg.squash_name and ":" in name:
                name = f"{named.vpp_stage}:{squash_name(bare(name))}"
            if param_targeted(cfg, named.name) or param_targeted(cfg, name):
                out.append(NamedParam(named.vpp_stage, name, named.param))
        return out

    def _close_session(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None

    def _probe(self, kind: type) -> Any:
        if self._session is None:
            return None
        return next((p for p in self._session.probes if isinstance(p, kind)), None)

    def _current(self, probe: Probe, table: str) -> dict[str, dict[str, float]]:
        ops = probe.stats.ops
        pending = {
            output.api_key(k): dict(zip(ops, v))
            for k, v in probe.rows.snapshot()
            if output.table_of(probe.name, k) == table
        }
        if pending:
            return pending
        if self._session is not None:
            self._session.writer.flush()
        assert self._memory is not None
        return self._memory.latest(table)[1]


def _host(values: Any) -> list[float]:
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)


def _main_grad(p: torch.Tensor) -> torch.Tensor | None:
    main = getattr(p, "main_grad", None)
    return main if isinstance(main, torch.Tensor) else p.grad


def _deprecated(key: str, message: str) -> None:
    warn_once(f"v1-deprecated-{key}", f"trainprobe: {message}")
    warnings.warn(message, DeprecationWarning, stacklevel=3)


def _group_rank(group: Any, where: str) -> int:
    if not distributed_ready():
        raise ConfigError(f"set_monitor({where}=...): needs torch.distributed to be initialised")
    return dist.get_rank(group)


def _redundancy_filter(dp_group: Any, tp_group: Any) -> Any:
    """Which parameters keep their reduced-gradient rows on this rank: only the first rank of a
    data-parallel group writes them; on the other ranks of a tensor-parallel group, only
    parameters marked ``tensor_model_parallel`` (the others are copies)."""
    dp_first = dp_group is None or _group_rank(dp_group, "dp_group") == 0
    tp_first = tp_group is None or _group_rank(tp_group, "tp_group") == 0
    if dp_first and tp_first:
        return None
    if not dp_first:
        return lambda named: False
    return lambda named: bool(getattr(named.param, "tensor_model_parallel", False))


def _pipeline(rank: int, group: Any) -> PipelineContext:
    if group is None or not distributed_ready():
        return PipelineContext(rank=rank, pp_stage=0, group_mates=(rank,))
    ranks = tuple(dist.get_process_group_ranks(group))
    return PipelineContext(rank=rank, pp_stage=ranks.index(rank) if rank in ranks else 0, group_mates=ranks)


__all__ = ["TrainerMon"]
