"""``trainprobe report RUN [-o report.html] [--engine duckdb|spark]``: one self-contained HTML page (works offline)
from Monitor V1 or V2 output.

The page holds, top to bottom: a summary (the first anomaly, steps, ranks, data types, targets,
rows, torn rows skipped, NaN/inf rows and the first one in execution order, dumped alerts); the
Diagnosis (``trainprobe diagnose``'s answer); the training curves (loss, learning rate, global
gradient norm over steps, from a ``loss.csv`` beside the run, ``training_state.jsonl``, the
training metrics' TensorBoard scalars and the gradient CSVs); the top offenders (the parameters
carrying the largest shares of the global gradient norm², per step and over the run); the
anomaly timeline (the first NaN/inf row of each target in the CSVs, the events of
``anomaly_detected/rank*/anomaly.json`` and diagnose's anomalies, spikes included, with its
first anomaly starred); per data type a targets × steps heatmap (menus: op, rank, log colour by
default, or linear; every row labelled) and line charts of the top targets by max norm; with
several ranks, a ranks × steps heatmap of each data type's global norm. A sharded run is shown
in full tensors (``--rank-local``: each rank's rows). Heatmaps of more than 500 steps are
downsampled: each column is a bucket of consecutive steps showing its value of largest magnitude
(red if any is NaN/inf). A data type with more than 200 targets draws 200 heatmap rows (NaN/inf
targets first, then the largest peaks) and the page says so. Names are escaped for Plotly,
which reads labels as HTML. See ``docs/report.md``.

Python::

    from trainprobe.tools.reporting.report import write_report
    path = write_report("monitor_output", "run42.html")

Needs the ``report`` extra (plotly, and DuckDB through ``[query]``: the runs are read by the query
layer, so Parquet runs work too); without DuckDB one line says how to install it.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.printable import printable
from trainprobe.engine.sinks.files import write_atomically
from trainprobe.tools.reporting.findings import Diagnosed, findings_of

COMMAND = "report"
#: DuckDB's memory limit for the Diagnosis section's ``trainprobe diagnose`` (it spills beyond it):
#: the report's peak memory stays under 500 MB on a run of 3.2 M rows.
DIAGNOSE_MEMORY = "256MB"
DEFAULT_NAME = "report.html"


def output_path(output: str | Path | None) -> Path:
    """Where the page goes: ``output``; inside it as ``report.html`` when it is a folder; or
    ``./report.html`` when None. Missing parent folders are created.

    Raises:
        ConfigError: the parent cannot be created (e.g. it is a file).
    """
    path = Path.cwd() / DEFAULT_NAME if output is None else Path(output).expanduser()
    if path.is_dir():
        path = path / DEFAULT_NAME
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"output: cannot create the folder {str(path.parent)!r}: {exc.strerror or exc}") from None
    return path


def _import_plotly() -> None:
    try:
        import plotly  # noqa: F401
    except ImportError:
        raise ConfigError("report: needs plotly; install it with pip install 'trainprobe[report]'") from None


def write_report(
    run: str | Path,
    output: str | Path | None = None,
    training_state: str | Path | None = None,
    tensorboard: str | Path | None = None,
    baseline: str | Path | None = None,
    rank_local: bool = False,
    engine: str = "duckdb",
) -> Path:
    """Write the HTML report of the run ``run`` (a V1 MONITOR_OUTPUT_DIR or run folder, or a V2
    output_dir) to ``output`` (see :func:`output_path`) and return its path.

    The training metrics' ``training_state.jsonl`` files (loss and gradient norms of the training
    curves) come from ``training_state`` (the file, a ``rank_<id>`` folder or the metrics'
    ``dump_path``), else from ``run``, its ``rank_<id>`` folders or one level below;
    their TensorBoard scalars (loss, learning rate, gradient norm) from ``tensorboard`` (the
    metrics' ``tensorboard_dir``), else from event files in ``run``'s ``rank_<id>`` folders.

    Torn rows of a killed run are skipped (a warning names each file once, the summary counts them).
    The "Diagnosis" section holds ``trainprobe diagnose``'s answer for ``run``; with
    ``baseline`` (a good run of the same kind) the page also holds ``trainprobe diff``'s answer,
    counts and heatmaps of ``baseline`` against ``run``; the anomaly timeline marks
    diagnose's anomalies and stars its first one. On a sharded run (FSDP2, tensor parallelism)
    the diagnosis, heatmaps, lines, training curves and top offenders are of full tensors (shards
    merged, replicas counted once; the diagnosis names the ranks holding the tensor where it went
    wrong); ``rank_local=True``: of each rank's rows as written. GradScaler's skipped steps are named (summary and diagnosis),
    not counted as anomalies by the diagnosis. ``engine="spark"``: the rows, the diagnosis and the
    baseline's diff are read through Apache Spark (a Parquet run; the process's active session,
    else one in local mode, stopped at the end: :mod:`~trainprobe.tools.reporting.spark`).

    Raises:
        ConfigError: ``run`` missing or holding no monitor file, a CSV with a foreign
            header, no complete row at all, a malformed ``anomaly.json``, an unwritable output,
            a ``training_state`` without ``training_state.jsonl``, a ``tensorboard`` without a
            readable event file (or without the tensorboard package), plotly missing, an
            unknown ``engine``, or ``engine="spark"`` on a run with CSV files or without pyspark.
    """
    from trainprobe.tools.runs.options import check_engine

    _import_plotly()
    if check_engine(engine) == "spark":
        from trainprobe.tools.engines.spark import local_session
        from trainprobe.tools.reporting.read import find_report_files
        from trainprobe.tools.runs.read import parquet_only

        parquet_only(find_report_files(Path(run).expanduser()))  # before Spark starts
        with local_session() as session:
            return _write(run, output, training_state, tensorboard, baseline, rank_local, session)
    return _write(run, output, training_state, tensorboard, baseline, rank_local, None)


def _write(
    run: str | Path,
    output: str | Path | None,
    training_state: str | Path | None,
    tensorboard: str | Path | None,
    baseline: str | Path | None,
    rank_local: bool,
    spark: Any,
) -> Path:
    """:func:`write_report` on DuckDB (``spark`` None) or on the Spark session ``spark``."""
    from trainprobe.tools.reporting.data import load_report_data
    from trainprobe.tools.reporting.html import render_page
    from trainprobe.tools.reporting.read import find_report_files, run_files

    engine = "duckdb" if spark is None else "spark"
    files = find_report_files(Path(run).expanduser())
    # the diagnosis first: its DuckDB memory is given back before the report's data is read
    diagnosis = _diagnosis(run, run_files(files), rank_local, engine)
    data = load_report_data(run, training_state, tensorboard, files=files, rank_local=rank_local, spark=spark)
    path = output_path(output)
    text = render_page(data, diagnosis=diagnosis, baseline=_baseline_adder(baseline, run, engine))
    try:
        write_atomically(path, text, field="output")
    except OSError as exc:
        raise ConfigError(f"output: cannot write {str(path)!r}: {exc.strerror or exc}") from None
    return path


def _diagnosis(run: str | Path, files: Any = None, rank_local: bool = False, engine: str = "duckdb") -> Diagnosed:
    """``trainprobe diagnose``'s answer for the Diagnosis section and the timeline: its lines and
    its anomalies (a run it cannot read: one line saying why, no anomaly); ``files``: the run's
    files, found already by the report."""
    from trainprobe.tools.diagnosis.answer import diagnosis_summary

    try:
        summary = diagnosis_summary(
            run, files=files, memory_limit=DIAGNOSE_MEMORY, rank_local=rank_local, engine=engine
        )
    except ConfigError as exc:
        return Diagnosed([f"no diagnosis: {exc}"])
    return Diagnosed(list(summary["lines"]), findings_of(summary), ran=True)


def _baseline_adder(baseline: str | Path | None, run: str | Path, engine: str = "duckdb") -> Any:
    """A callable adding the diff of ``baseline`` against ``run`` to the report's page
    (None without ``baseline``). Raises ConfigError (at the call) when diff cannot compare them."""
    if baseline is None:
        return None
    from trainprobe.tools.rundiff.answer import diff

    def add(page: Any) -> None:
        diff(baseline, run, page=page, engine=engine)

    return add


def command(args: argparse.Namespace) -> int:
    """Write the report of parsed arguments, print its path; returns 0.

    Raises:
        ConfigError: see :func:`write_report`.
    """
    path = write_report(args.run, args.output, args.training_state, args.tensorboard, args.baseline,
                        rank_local=args.rank_local, engine=args.engine)
    print(printable(path))
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``report`` on ``subparsers`` (an ``add_subparsers()`` result)."""
    from trainprobe.tools.runs.options import add_engine_argument, add_output_argument, add_run_argument

    parser = subparsers.add_parser(
        COMMAND,
        help="write a self-contained HTML report (heatmaps, lines, anomaly timeline) of monitor output",
        description="Write one self-contained HTML page (works offline) from Monitor V1 or V2 output; "
        "prints the page's path.",
    )
    add_run_argument(parser)
    add_output_argument(parser, f"the HTML file, or a folder to write {DEFAULT_NAME} in (default: ./{DEFAULT_NAME})")
    parser.add_argument(
        "--training-state",
        metavar="PATH",
        help="the training metrics' training_state.jsonl, a rank_<id> folder or their dump_path (default: any "
        "found in RUN, its rank_<id> folders or one level below): loss and gradient norm of the training curves",
    )
    parser.add_argument(
        "--tensorboard",
        metavar="PATH",
        help="the training metrics' tensorboard_dir (or a rank_<id> folder or event file): loss, learning rate "
        "and grad-norm of the training curves (default: event files in RUN's rank_<id> folders)",
    )
    parser.add_argument(
        "--baseline",
        metavar="BASELINE",
        help="a good run of the same kind: adds trainprobe diff's answer and heatmaps of this run against BASELINE",
    )
    parser.add_argument(
        "--rank-local", action="store_true",
        help="each rank's rows as written (Diagnosis, heatmaps, lines); by default a sharded run (FSDP2, TP) is "
        "shown in full tensors (shards merged, replicas counted once)",
    )
    add_engine_argument(
        parser, "duckdb (default) or spark: read the rows through Apache Spark (Parquet runs; "
        "pip install 'trainprobe[spark]')"
    )
    parser.set_defaults(handler=command)
    return parser
