"""Anomaly analyser: order the anomalies that Monitor V1 dumped (``alert.dump: true``) as training
executed them, keep the first ``topk`` and write them to ``anomaly_analyse.json``.

Command line (both forms are the same tool)::

    trainprobe anomaly-analyse RUN [-o OUT] [-k 8] [-s [2,3]]
    trainprobe anomaly-analyse -d MONITOR_OUTPUT_DIR/anomaly_detected [-o OUT] [-k 8] [-s [2,3]]
    python -m trainprobe.core.monitor.anomaly_processor -d ... [-o OUT] [-k TOPK] [-s STEP_LIST]

(``RUN`` and ``-d/--data_path``, the reference's spelling, are the same input; ``-o/--output`` and
``--out_path`` the same output; options anywhere on the line.)

Input: every ``rank<r>/anomaly.json`` under ``data_path`` (the ``anomaly_detected`` folder; the
monitor output folder that contains ``anomaly_detected`` is accepted too). Each file maps a key
(``<tag_name>_step_<s>_call_<id>``) to one event with exactly the fields :data:`EVENT_FIELDS`.
Files are read with :func:`trainprobe.engine.safe_json.load_json_file` (regular files only, size and
nesting bounded, byte-order mark accepted); integer fields must fit in 64 bits.

Execution order is the one every offline tool uses, :mod:`trainprobe.engine.execution_order`
(the sort key, smallest first; see :func:`execution_key`):

1. ``step``;
2. ``micro_step``, where events that happen once per step after gradient accumulation (reduced
   weight gradients and the whole optimizer phase) come after every micro-step of their step;
3. phase: forward < backward < optimizer, derived from the last ``/`` part of ``tag_name``
   (see :data:`PHASE_OF_SUFFIX`: trainprobe's table names and the reference tool's tags such as
   ``acc_grad``, ``pre_grad`` and ``post_grad``); a suffix it does not know is phase
   ``unknown``, placed before the forward phase as the reference tool places it, with a warning;
4. ``(vpp_stage, pp_stage)``: ascending in the forward phase, descending in the backward and
   optimizer phases (the pipeline runs backward from its last stage);
5. the table, in the order training computes them (activations; activation gradients,
   unreduced gradients; reduced gradients, collectives; parameters before the step, optimizer
   state, update statistics, ``mg_direction``, updated parameters);
6. ``call_id`` (the event's :attr:`AnomalyEvent.position` where a tool set one); 7. ``rank``.

Output: ``<out_path>/anomaly_analyse.json`` (default ``out_path``: the ``anomaly_detected``
folder), a JSON object holding the first ``topk`` events, keyed and shaped exactly as in the
input files, in execution order. The console shows the same events as a table with the columns
``order, step, micro_step, phase, vpp_stage, pp_stage, rank, call_id, rule, tag_name``.

Python API::

    from trainprobe.tools.anomalies.analyser import analyse
    result = analyse("monitor_output/anomaly_detected", topk=8, step_list=[2, 3])
    first = result.events[0]  # the first anomaly in execution order
    print(first.key, first.phase, result.output)

Every bad input (missing or empty folder, malformed or too deeply nested JSON, a file that is
not a regular file or not UTF-8, a missing, unknown or mistyped field, an integer beyond 64
bits) raises :class:`~trainprobe.engine.errors.ConfigError` with a one-line
message naming the file and the event; the command line prints it and exits with code 2.

The tool in modules of one job each: :mod:`~trainprobe.tools.anomalies.events` (the event, its
check and phase), :mod:`~trainprobe.tools.anomalies.read` (the files), :mod:`~trainprobe.tools.anomalies.order`
(the execution-order sort, the step selection, the argument checks),
:mod:`~trainprobe.tools.anomalies.output` (the JSON file and the console table); this module is
:func:`analyse`, the command line, and the public path of every name above.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.execution_order import (
    BACKWARD,
    FORWARD,
    ONCE_PER_STEP_SUFFIXES,
    OPTIMIZER,
    PHASE_OF_SUFFIX,
    PHASE_ORDER,
    UNKNOWN,
)
from trainprobe.engine.layout import ANOMALY_FILE, ANOMALY_FOLDER
from trainprobe.engine.safe_files import one_line
from trainprobe.tools.anomalies.events import (
    EVENT_FIELDS,
    INT_FIELDS,
    AnalyseResult,
    AnomalyEvent,
    check_event,
    make_event,
    phase_of,
)
from trainprobe.tools.anomalies.order import (
    check_step_list,
    check_topk,
    execution_key,
    order_events,
    parse_step_list,
    select_steps,
)
from trainprobe.tools.anomalies.output import (
    OUTPUT_NAME,
    TABLE_COLUMNS,
    format_table,
    output_file,
    print_result,
    table_rows,
    write_result,
)
from trainprobe.tools.anomalies.read import find_anomaly_files, load_anomalies, read_anomaly_file
from trainprobe.tools.runs.options import add_output_argument, add_run_argument

#: The names this public path has always offered (their homes: the modules above).
__all__ = [
    "ANOMALY_FILE",
    "ANOMALY_FOLDER",
    "BACKWARD",
    "COMMAND",
    "DEFAULT_TOPK",
    "EVENT_FIELDS",
    "FORWARD",
    "INT_FIELDS",
    "ONCE_PER_STEP_SUFFIXES",
    "OPTIMIZER",
    "OUTPUT_NAME",
    "PHASE_OF_SUFFIX",
    "PHASE_ORDER",
    "TABLE_COLUMNS",
    "UNKNOWN",
    "AnalyseResult",
    "AnomalyEvent",
    "add_parser",
    "analyse",
    "check_event",
    "check_step_list",
    "check_topk",
    "configure_parser",
    "execution_key",
    "find_anomaly_files",
    "format_table",
    "load_anomalies",
    "main",
    "make_event",
    "order_events",
    "output_file",
    "parse_step_list",
    "phase_of",
    "print_result",
    "read_anomaly_file",
    "run",
    "select_steps",
    "table_rows",
    "write_result",
]

COMMAND = "anomaly-analyse"
DEFAULT_TOPK = 8


def analyse(
    data_path: str | Path,
    out_path: str | Path | None = None,
    topk: int = DEFAULT_TOPK,
    step_list: Iterable[int] | None = None,
) -> AnalyseResult:
    """Read every ``rank<r>/anomaly.json`` under ``data_path``, keep the events of ``step_list``
    (None or empty: all), order them as training executed them, write the first ``topk`` to
    ``<out_path or the anomaly_detected folder>/anomaly_analyse.json`` and return them.

    Raises:
        ConfigError: bad arguments or input (one-line message naming the file and event).
    """
    topk = check_topk(topk)
    steps = check_step_list(step_list)
    folder, files, events = load_anomalies(data_path)
    selected = order_events(select_steps(events, steps))
    top = selected[:topk]
    path = output_file(out_path, folder)
    write_result(top, path)
    return AnalyseResult(top, len(selected), len(events), files, path)


# --------------------------------------------------------------------------- command line


def configure_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``RUN`` or ``-d/--data_path`` (the reference tool's spelling), ``-o/--output``
    (``--out_path``), ``-k/--topk``, ``-s/--step_list`` (also ``--step``, the reference tool's spelling)."""
    add_run_argument(
        parser, "the run folder holding anomaly_detected (or that folder itself); or give it with -d", optional=True
    )
    parser.add_argument(
        "-d",
        "--data_path",
        "--data-path",
        dest="data_path",
        metavar="RUN",
        help="the run, the reference tool's spelling: the anomaly_detected folder or the folder that contains it",
    )
    add_output_argument(
        parser,
        f"folder to write {OUTPUT_NAME} to (created; default: the anomaly_detected folder); its path is printed",
        "--out_path",
        "--out-path",
        dest="out_path",
    )
    parser.add_argument("-k", "--topk", type=int, default=DEFAULT_TOPK, help=f"events to keep (default {DEFAULT_TOPK})")
    parser.add_argument(
        "-s",
        "--step_list",
        "--step-list",
        "--step",
        dest="step_list",
        default="[]",
        help="steps to analyse, [2,3] or 2,3 (default [] = every step)",
    )
    parser.set_defaults(handler=run)
    return parser


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``anomaly-analyse`` on ``subparsers`` (an ``add_subparsers()`` result)."""
    parser = subparsers.add_parser(
        COMMAND,
        help="order dumped anomalies as training executed them and keep the first k",
        description="Order the anomalies of anomaly_detected/rank*/anomaly.json as training executed them.",
    )
    return configure_parser(parser)


def the_run(args: argparse.Namespace) -> str:
    """The run of parsed arguments: ``RUN`` or ``-d/--data_path`` (one of them, or both alike).

    Raises:
        ConfigError: neither given, or two different ones.
    """
    if args.run is None and args.data_path is None:
        raise ConfigError("RUN: give the run folder (or -d/--data_path DIR, the reference's spelling)")
    if args.run is not None and args.data_path is not None and args.run != args.data_path:
        raise ConfigError(f"RUN {args.run!r} and -d/--data_path {args.data_path!r}: give the run once")
    return str(args.run if args.run is not None else args.data_path)


def run(args: argparse.Namespace) -> int:
    """Run the analysis of parsed arguments and print it; returns 0.

    Raises:
        ConfigError: bad arguments or input.
    """
    steps = parse_step_list(args.step_list)
    result = analyse(the_run(args), args.out_path, args.topk, steps)
    print_result(result, steps)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m trainprobe.core.monitor.anomaly_processor -d DIR [-o OUT] [-k TOPK] [-s STEPS]``.

    Returns 0, or 2 after printing ``trainprobe anomaly-analyse: error: <message>`` on stderr.
    """
    parser = configure_parser(
        argparse.ArgumentParser(
            prog="python -m trainprobe.core.monitor.anomaly_processor",
            description="Order the anomalies of anomaly_detected/rank*/anomaly.json as training executed them.",
        )
    )
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args))
    except (ConfigError, OSError) as exc:
        print(f"trainprobe {COMMAND}: error: {one_line(str(exc))}", file=sys.stderr)
        return 2
