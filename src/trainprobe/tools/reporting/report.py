"""``trainprobe report MONITOR_DIR [-o report.html]``: one self-contained HTML page (works offline)
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
    monitor_dir: str | Path,
    output: str | Path | None = None,
    training_state: str | Path | None = None,
    tensorboard: str | Path | None = None,
    baseline: str | Path | None = None,
    rank_local: bool = False,
) -> Path:
    """Write the HTML report of the monitor output under ``monitor_dir`` (a V1 MONITOR_OUTPUT_DIR
    or run folder, or a V2 output_dir) to ``output`` (see :func:`output_path`) and return its path.

    The training metrics' ``training_state.jsonl`` files (loss and gradient norms of the training
    curves) come from ``training_state`` (the file, a ``rank_<id>`` folder or the metrics'
    ``dump_path``), else from ``monitor_dir``, its ``rank_<id>`` folders or one level below;
    their TensorBoard scalars (loss, learning rate, gradient norm) from ``tensorboard`` (the
    metrics' ``tensorboard_dir``), else from event files in ``monitor_dir``'s ``rank_<id>`` folders.

    Torn rows of a killed run are skipped (a warning names each file once, the summary counts them).
    The "Diagnosis" section holds ``trainprobe diagnose``'s answer for ``monitor_dir``; with
    ``baseline`` (a good run of the same kind) the page also holds ``trainprobe diff``'s answer,
    counts and heatmaps of ``baseline`` against ``monitor_dir``; the anomaly timeline marks
    diagnose's anomalies and stars its first one. On a sharded run (FSDP2, tensor parallelism)
    the diagnosis, heatmaps, lines, training curves and top offenders are of full tensors (shards
    merged, replicas counted once; the diagnosis names the ranks holding the tensor where it went
    wrong); ``rank_local=True``: of each rank's rows as written. GradScaler's skipped steps are named (summary and diagnosis),
    not counted as anomalies by the diagnosis.

    Raises:
        ConfigError: ``monitor_dir`` missing or holding no monitor CSV, a CSV with a foreign
            header, no complete row at all, a malformed ``anomaly.json``, an unwritable output,
            a ``training_state`` without ``training_state.jsonl``, a ``tensorboard`` without a
            readable event file (or without the tensorboard package), or plotly missing.
    """
    _import_plotly()
    from trainprobe.tools.reporting.data import load_report_data
    from trainprobe.tools.reporting.html import render_page
    from trainprobe.tools.reporting.read import find_report_files, run_files

    files = find_report_files(Path(monitor_dir).expanduser())
    # the diagnosis first: its DuckDB memory is given back before the report's data is read
    diagnosis = _diagnosis(monitor_dir, run_files(files), rank_local)
    data = load_report_data(monitor_dir, training_state, tensorboard, files=files, rank_local=rank_local)
    path = output_path(output)
    text = render_page(data, diagnosis=diagnosis, baseline=_baseline_adder(baseline, monitor_dir))
    try:
        write_atomically(path, text, field="output")
    except OSError as exc:
        raise ConfigError(f"output: cannot write {str(path)!r}: {exc.strerror or exc}") from None
    return path


def _diagnosis(monitor_dir: str | Path, files: Any = None, rank_local: bool = False) -> Diagnosed:
    """``trainprobe diagnose``'s answer for the Diagnosis section and the timeline: its lines and
    its anomalies (a run it cannot read: one line saying why, no anomaly); ``files``: the run's
    files, found already by the report."""
    from trainprobe.tools.diagnosis.answer import diagnosis_summary

    try:
        summary = diagnosis_summary(monitor_dir, files=files, memory_limit=DIAGNOSE_MEMORY, rank_local=rank_local)
    except ConfigError as exc:
        return Diagnosed([f"no diagnosis: {exc}"])
    return Diagnosed(list(summary["lines"]), findings_of(summary), ran=True)


def _baseline_adder(baseline: str | Path | None, monitor_dir: str | Path) -> Any:
    """A callable adding the diff of ``baseline`` against ``monitor_dir`` to the report's page
    (None without ``baseline``). Raises ConfigError (at the call) when diff cannot compare them."""
    if baseline is None:
        return None
    from trainprobe.tools.rundiff.answer import diff

    def add(page: Any) -> None:
        diff(baseline, monitor_dir, page=page)

    return add


def run(args: argparse.Namespace) -> int:
    """Write the report of parsed arguments, print its path; returns 0.

    Raises:
        ConfigError: see :func:`write_report`.
    """
    print(write_report(args.monitor_dir, args.output, args.training_state, args.tensorboard, args.baseline,
                       rank_local=args.rank_local))
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``report`` on ``subparsers`` (an ``add_subparsers()`` result)."""
    parser = subparsers.add_parser(
        COMMAND,
        help="write a self-contained HTML report (heatmaps, lines, anomaly timeline) of monitor output",
        description="Write one self-contained HTML page (works offline) from Monitor V1 or V2 output.",
    )
    parser.add_argument("monitor_dir", help="monitor output: a V1 MONITOR_OUTPUT_DIR or run folder, a V2 output_dir")
    parser.add_argument(
        "-o",
        "--output",
        help=f"the HTML file, or a folder to write {DEFAULT_NAME} in (default: ./{DEFAULT_NAME})",
    )
    parser.add_argument(
        "--training-state",
        metavar="PATH",
        help="the training metrics' training_state.jsonl, a rank_<id> folder or their dump_path (default: any "
        "found in MONITOR_DIR, its rank_<id> folders or one level below): loss and gradient norm of the training curves",
    )
    parser.add_argument(
        "--tensorboard",
        metavar="PATH",
        help="the training metrics' tensorboard_dir (or a rank_<id> folder or event file): loss, learning rate "
        "and grad-norm of the training curves (default: event files in MONITOR_DIR's rank_<id> folders)",
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
    parser.set_defaults(run=run)
    return parser
