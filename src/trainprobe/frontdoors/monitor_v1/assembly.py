"""Assembling one Monitor V1 session from a configuration: probes, sinks, alerts, writer.

Every session writes to the ``api`` memory (so ``generate_*_metrics`` always work) and, unless
``format`` is ``api``, to CSV files or TensorBoard event files in the rank's run folder (one
folder for the whole run, whatever restarts). With ``alert.rules`` the alert detector reads the
same records behind the fan-out; each session's detector is built with that session's ops and
tags, and goes on from the previous session's running state (its averages and its dump) while
the alert settings stay the same. File output runs on a background writer thread; with
``format: api`` the writer is synchronous, so the memory is current when ``optimizer.step()``
returns.

With an ``anomaly`` block each session runs the online rules
(:mod:`trainprobe.frontdoors.monitor_v1.online`: an
:class:`~trainprobe.frontdoors.monitor_v2.anomaly_watch.AnomalyWatch` on the training thread, as
Monitor V2's); like the alert detector, the watch of the previous session goes on (its spike
series, its event file, a dump under way) while the block stays the same.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainprobe.engine.anomaly.events import AnomalyEvent
from trainprobe.engine.errors import ConfigError
from trainprobe.engine.folders import check_output_folder
from trainprobe.engine.layout import ANOMALY_FOLDER, PARQUET_SUFFIX, V1_DATA_FILE, anomaly_rank_folder, v1_file_name
from trainprobe.engine.schedule import Schedule
from trainprobe.engine.session import NullSession, Session
from trainprobe.engine.sinks.background import Sink
from trainprobe.engine.sinks.csv_sink import CsvSink
from trainprobe.engine.sinks.memory import MemorySink
from trainprobe.engine.sinks.parquet_sink import ParquetSink, data_files, merged_step_files
from trainprobe.engine.sinks.tensorboard import TensorBoardSink
from trainprobe.frontdoors.monitor_v1 import output
from trainprobe.frontdoors.monitor_v1.alerts import AlertDetector
from trainprobe.frontdoors.monitor_v1.attachment import Attachment
from trainprobe.frontdoors.monitor_v1.config import MonitorV1Config
from trainprobe.frontdoors.monitor_v1.online import v1_watch
from trainprobe.frontdoors.monitor_v1.probe_set import build_probes
from trainprobe.frontdoors.monitor_v1.shapes import ShapeBook
from trainprobe.frontdoors.monitor_v2.anomaly_watch import AnomalyWatch


class SessionFactory:
    """Builds the sessions of one attached run.

    Args:
        attachment: what ``set_monitor`` attached to.
        model: the model given to ``set_monitor`` (what the ``dump`` action dumps).
        on_anomaly: ``TrainerMon(on_anomaly=...)``, the callback of the online rules' events.
    """

    def __init__(
        self,
        attachment: Attachment,
        *,
        model: Any = None,
        on_anomaly: Callable[[AnomalyEvent], Any] | None = None,
    ) -> None:
        self.attachment = attachment
        self.model = model
        self.on_anomaly = on_anomaly
        self.watch: AnomalyWatch | None = None
        """The online rules of the latest session with an ``anomaly`` block."""
        self._watch_key: tuple[Any, ...] | None = None
        self.idle = NullSession(attachment.clock)
        """The run's one null session: what runs while nothing is collected."""
        self.memory = MemorySink({}, output.table_of, output.api_key)
        """The ``api`` memory of the latest session (each session's is built with its ops and
        starts from the previous one's)."""
        self._alerts: AlertDetector | None = None

    def start(self, cfg: MonitorV1Config, start_step: int | None) -> Session | NullSession:
        """A running session for ``cfg`` (collecting from ``start_step``, else the config's
        ``start_step``), or :attr:`idle` when it collects nothing (``collect_times`` 0, no field
        on)."""
        schedule = cfg.schedule(start_step)
        if schedule is None:
            return self.idle
        shapes = ShapeBook(self.attachment.grad_of, per_call=cfg.format in ("csv", "parquet"))
        probes = build_probes(cfg, self.attachment, shapes)
        if not probes:
            return self.idle
        sinks = self._sinks(cfg, schedule, shapes)
        watch = self._watch(cfg)
        self._guard_exit()  # before the session's own atexit close, so that it runs after it
        # trailing: TrainerMon ends each step from the optimizer's post-step hook, so a collective
        # issued after optimizer.step() belongs to the step that trained, as in Monitor V2
        session = Session(
            probes=probes,
            schedule=schedule,
            sink=sinks,
            background=cfg.format != "api",
            clock=self.attachment.clock,
            trailing=True,
            watch=watch,
        )
        if watch is not None:
            watch.bind(session.end_step, session.close)
        session.attach()
        return session

    def _guard_exit(self) -> None:
        """A gloo run that never destroys its process group exits cleanly, as under Monitor V2
        (:mod:`trainprobe.backends.torch.exit_guard`, issue #34's exit aborts)."""
        if self.attachment.backend.name == "pytorch":
            from trainprobe.backends.torch.exit_guard import destroy_at_exit

            destroy_at_exit()

    def _watch(self, cfg: MonitorV1Config) -> AnomalyWatch | None:
        """The online rules of ``cfg``'s ``anomaly`` block (the previous session's watch when the
        block, the ops and the rounding are the same), or None."""
        anomaly = cfg.anomaly
        if anomaly is None:
            return None
        ndigits = cfg.ndigits if cfg.format in ("csv", "parquet") else None
        key = (anomaly, cfg.ops, ndigits, cfg.monitor_mbs_grad)
        earlier = self.watch
        if earlier is not None and not earlier.disabled and self._watch_key == key:
            return earlier
        attachment = self.attachment
        backend = attachment.backend
        agree = None
        if anomaly.stops and backend.name == "pytorch" and backend.distributed():
            from trainprobe.backends.torch.dist_info import ranks_flagging

            agree = ranks_flagging
        if earlier is not None:
            earlier.close()
        self.watch = v1_watch(
            anomaly,
            ops=cfg.ops,
            ndigits=ndigits,
            mbs_grad=cfg.monitor_mbs_grad,
            rank=attachment.rank,
            run_folder=attachment.run_folder(cfg),
            clock=attachment.clock,
            model=self.model,
            on_anomaly=self.on_anomaly,
            agree=agree,
        )
        self._watch_key = key
        return self.watch

    def _sinks(self, cfg: MonitorV1Config, schedule: Schedule, shapes: ShapeBook) -> list[Sink]:
        ops_of = output.columns(cfg.ops)
        self.memory = MemorySink(ops_of, output.table_of, output.api_key, earlier=self.memory)
        sinks: list[Sink] = [self.memory]
        if cfg.format == "csv":
            layouts = output.layouts(cfg.ops, cfg.ndigits, cfg.monitor_mbs_grad, shapes, shapes.changed)
            folder = self.attachment.run_folder(cfg)
            csv = CsvSink(
                folder,
                schedule,
                layouts,
                table_of=output.table_of,
                name_file=output.file_name,
                append=bool(cfg.append_output),
                first_step=self.attachment.clock.step,
                field=output.OUTPUT_ENV,
            )
            sinks.append(csv)
        elif cfg.format == "parquet":  # an extension: the CSV layout's files as Parquet, continued as CSV is
            layouts = output.layouts(cfg.ops, cfg.ndigits, cfg.monitor_mbs_grad, shapes, shapes.changed)
            folder = self.attachment.run_folder(cfg)
            if cfg.append_output:
                _drop_merged_step_files(folder)
            sinks.append(
                ParquetSink(
                    folder,
                    schedule,
                    layouts,
                    table_of=output.table_of,
                    name_file=_parquet_name,
                    first_step=self.attachment.clock.step,
                    append=bool(cfg.append_output),
                    field=output.OUTPUT_ENV,
                )
            )
        elif cfg.format == "tensorboard":
            folder = self.attachment.run_folder(cfg)
            tag_of = output.tag_of(self.attachment.rank, cfg.monitor_mbs_grad)
            histograms = output.HISTOGRAM_TABLES.values()
            sinks.append(
                TensorBoardSink(
                    folder, ops_of, output.table_of, tag_of, histogram_tables=histograms, field=output.OUTPUT_ENV
                )
            )
        if cfg.alert.rules:
            sinks.append(self._alert_detector(cfg, ops_of))
        return sinks

    def _alert_detector(self, cfg: MonitorV1Config, ops_of: dict[str, tuple[str, ...]]) -> AlertDetector:
        dump = (
            output.output_root() / ANOMALY_FOLDER / anomaly_rank_folder(self.attachment.rank)
            if cfg.alert.dump
            else None
        )
        if dump is not None:  # created with the first anomaly; an unusable path fails now
            check_output_folder(dump, output.OUTPUT_ENV)
        earlier = self._alerts
        same = earlier is not None and earlier.rules == cfg.alert.rules and earlier.dump_dir == dump
        self._alerts = AlertDetector(
            cfg.alert.rules,
            ops_of,
            output.table_of,
            self.attachment.pipeline,
            dump,
            tag_of=output.task_tagger(self.attachment.rank, cfg.monitor_mbs_grad),
            earlier=earlier if same else None,
        )
        return self._alerts


def _drop_merged_step_files(folder: Path) -> None:
    """Before an ``append_output`` run continues ``folder``: remove the step files a Parquet run
    killed between a window's merge and their removal left beside the merged file
    (:func:`~trainprobe.engine.sinks.parquet_sink.merged_step_files`), so no row counts twice."""
    try:
        for path in merged_step_files(data_files(folder, V1_DATA_FILE)):
            path.unlink()
    except OSError as exc:
        raise ConfigError(f"{output.OUTPUT_ENV}: cannot tidy {str(folder)!r} to continue it: {exc}") from None


def _parquet_name(table: str, first: int, last: int) -> str:
    """``grad_reduced_0-4.parquet``."""
    return v1_file_name(table, first, last, PARQUET_SUFFIX)
