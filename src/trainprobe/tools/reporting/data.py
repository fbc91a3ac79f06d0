"""The numbers behind ``trainprobe report``: monitor CSVs read into matrices, NaN/inf onsets and
anomaly events in execution order. Its helpers: :mod:`~trainprobe.tools.reporting.read` (the files,
read through the query layer), :mod:`~trainprobe.tools.reporting.types` (the public data types,
re-exported here), :mod:`~trainprobe.tools.reporting.collect` (the reading state),
:mod:`~trainprobe.tools.reporting.digest` (the digest of each file's rows),
:mod:`~trainprobe.tools.reporting.groups` (the groups and their matrices),
:mod:`~trainprobe.tools.reporting.onsets` (NaN/inf onsets, ``anomaly.json`` alerts),
:mod:`~trainprobe.tools.reporting.rows` (rows as arrays), :mod:`~trainprobe.tools.reporting.cells`
(the numpy work on a file's rows), :mod:`~trainprobe.tools.reporting.events` (naming events),
:mod:`~trainprobe.tools.reporting.downsample` (the step buckets of the heatmaps and lines).

* A *group* is one V1 table (``grad_reduced``, ``actv`` ...) or one V2 monitor and scope
  (``weight_grad/reduced``, ``module/forward`` ...). Its targets are kept in model order, the order
  in which they first appear in the CSVs (rank 0 first).
* Rows of several micro-steps (activations) fall into one cell per (target, step): the cell holds
  the value of largest magnitude, so a spike in one micro-batch is not averaged away.
* A row is *non-finite* when one of its values is NaN or inf, or its ``nans`` count is above 0.
  For each (group, rank, target) the first such row in execution order is an *onset* event.
* Execution order is the one every tool uses (:mod:`trainprobe.engine.execution_order`, through
  :func:`trainprobe.tools.anomalies.analyser.execution_key`): CSV rows are turned into the same kind
  of event, with the V1 table name (V2 groups mapped to the equivalent table) deciding the phase
  and the table's place, and the row's place among the rows of its step in its file as the
  position. An alert of ``anomaly.json`` gets the position of its CSV row (same rank, table,
  step, micro-step, stage and target) so that alerts and CSV rows compare on one numbering; an
  alert whose row is not in the CSVs keeps its ``call_id``.
* Bounded: at most :data:`MAX_TARGETS` targets per group are drawn (NaN/inf ones first, then the
  largest peaks) and :data:`MAX_ONSETS` onsets kept. Files are read one at a time and digested
  (counts, per-target peaks, global norm per step, first onsets); rows are kept only for groups
  of at most :data:`MAX_TARGETS` targets, a larger group's files are read again for the rows of
  its drawn targets. The global norm assumes a target's micro-steps of one step share a file (as
  both V1 writers and V2 write them).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from trainprobe.engine.errors import ConfigError
from trainprobe.tools.anomalies.analyser import order_events
from trainprobe.tools.reporting.collect import Reading, alerts_by_row, collect_file
from trainprobe.tools.reporting.downsample import bucket_size as bucket_size
from trainprobe.tools.reporting.downsample import downsample as downsample
from trainprobe.tools.reporting.events import event_group as event_group
from trainprobe.tools.reporting.events import event_target as event_target
from trainprobe.tools.reporting.full import row_reader
from trainprobe.tools.reporting.groups import build_group, group_order
from trainprobe.tools.reporting.groups import default_op as default_op
from trainprobe.tools.reporting.groups import pick_targets as pick_targets
from trainprobe.tools.reporting.loss import find_loss_files, read_loss_files
from trainprobe.tools.reporting.onsets import read_alerts
from trainprobe.tools.reporting.read import find_report_files
from trainprobe.tools.reporting.run import find_event_files, find_training_state, read_event_files, read_training_state
from trainprobe.tools.reporting.spark import spark_row_reader
from trainprobe.tools.reporting.types import GRADIENT_TABLES as GRADIENT_TABLES
from trainprobe.tools.reporting.types import MAX_ONSETS as MAX_ONSETS
from trainprobe.tools.reporting.types import MAX_TARGETS as MAX_TARGETS
from trainprobe.tools.reporting.types import Group as Group
from trainprobe.tools.reporting.types import RankMatrix as RankMatrix
from trainprobe.tools.reporting.types import ReportData as ReportData
from trainprobe.tools.runs.files import RunFile


def load_report_data(
    monitor_dir: str | Path,
    training_state: str | Path | None = None,
    tensorboard: str | Path | None = None,
    files: list[RunFile] | None = None,
    rank_local: bool = False,
    spark: Any = None,
) -> ReportData:
    """Read every monitor CSV and anomaly file under ``monitor_dir``, and the training metrics'
    ``training_state.jsonl`` files: those of ``training_state`` (the file, a ``rank_<id>``
    folder or the metrics' ``dump_path``), else any in ``monitor_dir``, its ``rank_<id>``
    folders or one level below (see :func:`~trainprobe.tools.reporting.run.find_training_state`);
    and the metrics' TensorBoard scalars (loss, learning rate, gradient norm) of ``tensorboard``
    (their ``tensorboard_dir``), else of event files in ``monitor_dir``'s ``rank_<id>`` folders
    (see :func:`~trainprobe.tools.reporting.run.find_event_files`); and the ``loss.csv`` files in
    ``monitor_dir`` and its ``rank_<id>`` folders (:mod:`~trainprobe.tools.reporting.loss`).
    ``files``: the data files of ``monitor_dir`` when the caller found them already (:func:`~trainprobe.tools.reporting.read.find_report_files`).

    On a sharded run (FSDP2, tensor parallelism) the ``weight_grad``, ``param`` and ``optimizer``
    rows are read as full tensors (:mod:`~trainprobe.tools.reporting.full`); ``rank_local``: each
    rank's rows as written. ``spark``: a Spark session to read the rows through
    (:mod:`~trainprobe.tools.reporting.spark`, Parquet runs) instead of DuckDB.

    Memory is bounded by what is drawn, not by the number of rows: each file's rows are digested
    as they are read (counts, each target's peak and NaN/inf, the global norm per step, the first
    onsets) and kept only while their data type has at most :data:`MAX_TARGETS` targets; a data
    type with more is read a second time for the rows of the targets it draws.

    Raises:
        ConfigError: missing path, no monitor output, a foreign CSV header, no complete row at
            all (every file empty or torn), a malformed ``anomaly.json`` (the message names the file),
            a ``training_state`` that is missing or holds no ``training_state.jsonl``, a
            ``tensorboard`` that is missing or holds no event file (or an unreadable one).
    """
    root = Path(monitor_dir).expanduser()
    files = find_report_files(root) if files is None else files
    from trainprobe.tools.sql.full import is_sharded

    sharded = is_sharded(root)
    reader: Any = (
        row_reader(root, files, full=sharded and not rank_local)
        if spark is None
        else spark_row_reader(spark, root, files, full=sharded and not rank_local)
    )
    training = read_training_state(find_training_state(root, training_state))
    read_event_files(find_event_files(root, tensorboard), training, required=tensorboard is not None)
    read_loss_files(find_loss_files(root), training)
    anomaly_files, alerts = read_alerts(root, files)
    reading = Reading(alert_rows=alerts_by_row(alerts))
    try:
        torn = sum(collect_file(file, rows, reading) for file, rows in reader.read(files))
        if not reading.tables:
            raise ConfigError(
                f"monitor_path: the {len(files)} monitor file(s) under {str(root)!r} hold no complete row "
                "(all torn or header only); let the run write at least one step"
            )
        reading.reread_sampled(reader.read, files)
    finally:
        reader.close()
    built = [build_group(name, reading) for name in group_order(reading.tables)]
    groups = [group for group, _ in built]
    onsets = order_events(event for _, events in built for event in events)[:MAX_ONSETS]
    alerts = order_events(
        replace(event, position=reading.alert_positions[n]) if n in reading.alert_positions else event
        for n, event in enumerate(alerts)
    )
    layouts = tuple(sorted({f.layout for f in files}))
    count = sum(g.onset_targets for g in groups)
    from trainprobe.engine.skip_log import run_skips

    return ReportData(
        root, layouts, len(files), torn, groups, onsets, alerts, anomaly_files, count, training,
        skipped=run_skips(root), sharded=sharded, tensors="full" if reader.full is not None else "rank-local",
    )
