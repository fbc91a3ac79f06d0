"""Anomaly analyser: order the anomalies that Monitor V1 dumped (``alert.dump: true``) as training
executed them, keep the first ``topk`` and write them to ``anomaly_analyse.json``.

Command line (both forms are the same tool)::

    trainprobe anomaly-analyse -d MONITOR_OUTPUT_DIR/anomaly_detected [-o OUT] [-k 8] [-s [2,3]]
    python -m trainprobe.core.monitor.anomaly_processor -d ... [-o OUT] [-k TOPK] [-s STEP_LIST]

Input: every ``rank<r>/anomaly.json`` under ``data_path`` (the ``anomaly_detected`` folder; the
monitor output folder that contains ``anomaly_detected`` is accepted too). Each file maps a key
(``<tag_name>_step_<s>_call_<id>``) to one event with exactly the fields :data:`EVENT_FIELDS`.
Files are read with :func:`trainprobe.engine.safe_json.load_json_file` (regular files only, size and
nesting bounded, byte-order mark accepted); integer fields must fit in 64 bits.

Execution order is the one every offline tool uses, :mod:`trainprobe.tools.execution_order`
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

    from trainprobe.tools.anomaly_analyse import analyse
    result = analyse("monitor_output/anomaly_detected", topk=8, step_list=[2, 3])
    first = result.events[0]  # the first anomaly in execution order
    print(first.key, first.phase, result.output)

Every bad input (missing or empty folder, malformed or too deeply nested JSON, a file that is
not a regular file or not UTF-8, a missing, unknown or mistyped field, an integer beyond 64
bits) raises :class:`~trainprobe.engine.errors.ConfigError` with a one-line
message naming the file and the event; the command line prints it and exits with code 2.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.layout import ANOMALY_FILE, ANOMALY_FOLDER, ANOMALY_RANK
from trainprobe.engine.log import warn_once
from trainprobe.engine.safe_files import INT_MAX, INT_MIN, bounded_int, is_inside, one_line
from trainprobe.engine.safe_json import load_json_file
from trainprobe.engine.sinks.files import write_json_atomically
from trainprobe.tools.execution_order import (
    BACKWARD,  # noqa: F401  (re-exported: users import the phases from here)
    FORWARD,  # noqa: F401
    ONCE_PER_STEP_SUFFIXES,  # noqa: F401
    OPTIMIZER,  # noqa: F401
    OTHER_TABLE,
    PHASE_OF_SUFFIX,
    PHASE_ORDER,  # noqa: F401
    UNKNOWN,  # noqa: F401
    phase_of_table,
    short_repr,
)
from trainprobe.tools.execution_order import execution_key as row_execution_key
from trainprobe.tools.options import make_folder

COMMAND = "anomaly-analyse"
OUTPUT_NAME = "anomaly_analyse.json"
DEFAULT_TOPK = 8

#: Integer fields of an event, then the others with their JSON types.
INT_FIELDS: tuple[str, ...] = ("rank", "step", "micro_step", "pp_stage", "vpp_stage", "call_id")
EVENT_FIELDS: tuple[str, ...] = (*INT_FIELDS, "tag_name", "message", "group_mates")

_RULE = re.compile(r"^Rule (\S+) ")
_STEP = re.compile(r"[0-9]+")


@dataclass(frozen=True, slots=True)
class AnomalyEvent:
    """One anomaly: its key and dict exactly as read, the file it came from and its phase.

    Attributes:
        key: the event's key in ``anomaly.json`` (``<tag_name>_step_<s>_call_<id>``).
        data: the event dict as read (the fields :data:`EVENT_FIELDS`).
        source: the ``anomaly.json`` it came from.
        phase: ``"forward"``, ``"backward"``, ``"optimizer"`` or ``"unknown"``.
        once_per_step: True for events that follow every micro-step of their step.
        position: the row's place among the CSV rows of its step and table, where a tool that
            reads the CSVs too (``report``) found it; None: ``call_id`` orders the event.
    """

    key: str
    data: dict[str, Any]
    source: Path
    phase: str
    once_per_step: bool
    position: int | None = None

    def __getitem__(self, field: str) -> Any:
        return self.data[field]

    @property
    def rule(self) -> str:
        """The rule named by ``message`` (``Rule AnomalyNan reports ...`` → ``AnomalyNan``), or ''."""
        found = _RULE.match(self.data["message"])
        return found.group(1) if found else ""


@dataclass(frozen=True, slots=True)
class AnalyseResult:
    """What :func:`analyse` found.

    Attributes:
        events: the first ``topk`` events in execution order.
        selected: how many events lie in the selected steps (all of them without a step list).
        found: how many events the files hold.
        files: the ``anomaly.json`` files read, in rank order.
        output: the ``anomaly_analyse.json`` written.
    """

    events: list[AnomalyEvent]
    selected: int
    found: int
    files: list[Path]
    output: Path


# --------------------------------------------------------------------------- reading


def find_anomaly_files(data_path: str | Path) -> tuple[Path, list[Path]]:
    """The ``anomaly_detected`` folder and its ``rank<r>/anomaly.json`` files, in rank order.

    ``data_path`` is the ``anomaly_detected`` folder, or a folder that contains one.

    Raises:
        ConfigError: ``data_path`` does not exist, is not a folder, or holds no such file.
    """
    folder = Path(data_path).expanduser()
    if not folder.exists():
        raise ConfigError(f"data_path: {str(folder)!r} does not exist")
    if not folder.is_dir():
        raise ConfigError(f"data_path: {str(folder)!r} is not a folder")
    files = _rank_files(folder)
    if not files and (folder / ANOMALY_FOLDER).is_dir():
        folder = folder / ANOMALY_FOLDER
        files = _rank_files(folder)
    if not files:
        raise ConfigError(
            f"data_path: {str(folder)!r} holds no rank<r>/{ANOMALY_FILE} (expected the {ANOMALY_FOLDER} "
            "folder that Monitor V1 writes with alert.dump: true)"
        )
    return folder, files


def _rank_files(folder: Path) -> list[Path]:
    found: list[tuple[int, Path]] = []
    try:
        children = list(folder.iterdir())
    except OSError as exc:
        raise ConfigError(f"data_path: cannot list {str(folder)!r}: {exc.strerror or exc}") from None
    for child in children:
        match = ANOMALY_RANK.fullmatch(child.name)
        if match and (child / ANOMALY_FILE).is_file():  # regular files (or links to one) only
            if not is_inside(child / ANOMALY_FILE, folder):
                warn_once(
                    f"outside:{child / ANOMALY_FILE}",
                    f"{child / ANOMALY_FILE}: a link to a file outside {str(folder)!r}, skipped (not read)",
                )
                continue
            found.append((bounded_int(match.group(1), "rank", f"data_path: {str(child)!r}"), child / ANOMALY_FILE))
    return [path for _, path in sorted(found)]


def read_anomaly_file(path: Path, within: Path | None = None) -> list[AnomalyEvent]:
    """The events of one ``anomaly.json``, in file order; with ``within``, only a file inside
    that folder (a link leading elsewhere is refused unread).

    Raises:
        ConfigError: unreadable file, malformed JSON, not an object of events, or a bad event
            (see :func:`check_event`); the message starts with the file's path.
    """
    document = load_json_file(path, within=within)
    if not isinstance(document, dict):
        raise ConfigError(f"{path}: expected a JSON object of events, got {type(document).__name__}")
    return [make_event(key, value, path) for key, value in document.items()]


def check_event(key: str, value: object, source: Path) -> dict[str, Any]:
    """``value`` as an event dict: exactly the fields :data:`EVENT_FIELDS`, the integer ones
    integers, ``tag_name`` and ``message`` strings, ``group_mates`` a list of integers.

    Raises:
        ConfigError: ``<file>: event '<key>': missing field 'step'`` (or unknown field, wrong type).
    """
    where = f"{source}: event {key!r}"
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected an object, got {type(value).__name__}")
    for field in EVENT_FIELDS:
        if field not in value:
            raise ConfigError(f"{where}: missing field {field!r}")
    for field in value:
        if field not in EVENT_FIELDS:
            raise ConfigError(f"{where}: unknown field {field!r} (expected {', '.join(EVENT_FIELDS)})")
    for field in INT_FIELDS:
        if not _is_int(value[field]):
            raise ConfigError(f"{where}: field {field!r} must be an integer, got {_short(value[field])}")
        if not INT_MIN <= value[field] <= INT_MAX:
            raise ConfigError(f"{where}: field {field!r} is outside the 64-bit range [-2**63, 2**63-1]")
    for field in ("tag_name", "message"):
        if not isinstance(value[field], str):
            raise ConfigError(f"{where}: field {field!r} must be a string, got {_short(value[field])}")
    mates = value["group_mates"]
    if not isinstance(mates, list) or not all(_is_int(m) for m in mates):
        raise ConfigError(f"{where}: field 'group_mates' must be a list of integers, got {_short(mates)}")
    if not all(INT_MIN <= m <= INT_MAX for m in mates):
        raise ConfigError(f"{where}: field 'group_mates' holds an integer outside the 64-bit range")
    return value


def _short(value: object) -> str:
    """``repr(value)`` cut to 60 characters (a message stays one short line)."""
    return short_repr(value, 60)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def make_event(key: str, value: object, source: Path) -> AnomalyEvent:
    """An :class:`AnomalyEvent` from one entry of ``source`` (checked, phase derived).

    Raises:
        ConfigError: see :func:`check_event` and :func:`phase_of`.
    """
    data = check_event(key, value, source)
    phase, once = phase_of(data["tag_name"])
    return AnomalyEvent(key, data, source, phase, once)


def phase_of(tag_name: str) -> tuple[str, bool]:
    """The phase of a tag and whether it happens once per step (after gradient accumulation).

    The last ``/`` part of ``tag_name`` decides (:data:`PHASE_OF_SUFFIX`), e.g.
    ``0:fc1.weight/rank0/grad_reduced`` → ``("backward", True)``,
    ``0:1.self_attention.core_attention_flash_0/rank0/input_grad`` → ``("backward", False)``,
    ``0:fc1.output/rank1/actv`` → ``("forward", False)``, the reference tool's
    ``0:fc1.weight/rank0/acc_grad`` → ``("backward", False)`` and ``.../post_grad`` →
    ``("backward", True)``. In the ``other`` table, rows named ``<param>.mg_direction`` are
    optimizer rows and collective calls are backward rows; both are once per step. A suffix not
    in :data:`PHASE_OF_SUFFIX` gives ``("unknown", False)`` and a warning (once per suffix).
    """
    name, _, suffix = tag_name.rpartition("/")
    if suffix != OTHER_TABLE and suffix not in PHASE_OF_SUFFIX:
        warn_once(
            f"phase:{suffix}",
            f"tag_name {_short(tag_name)}: no known phase for {_short(suffix)}; ordered before the forward "
            "phase of its micro-step, as the reference tool orders it",
        )
    return phase_of_table(suffix, name.rpartition("/")[0])


def load_anomalies(data_path: str | Path) -> tuple[Path, list[Path], list[AnomalyEvent]]:
    """The ``anomaly_detected`` folder, its files and every event they hold (rank order, then
    file order).

    Raises:
        ConfigError: see :func:`find_anomaly_files` and :func:`read_anomaly_file`; also the
            same key in two files.
    """
    folder, files = find_anomaly_files(data_path)
    events: list[AnomalyEvent] = []
    seen: dict[str, Path] = {}
    for path in files:
        for event in read_anomaly_file(path, within=folder):
            if event.key in seen:
                raise ConfigError(f"{path}: event {event.key!r}: the same key is also in {seen[event.key]}")
            seen[event.key] = path
            events.append(event)
    return folder, files, events


# --------------------------------------------------------------------------- ordering


#: ``<target>/rank<r>/<table>``: the table may be a V2 ``<monitor>/<scope>`` group.
_RANK_TAG = re.compile(r"^(.*)/rank\d+/(.+)$", re.DOTALL)


def execution_key(event: AnomalyEvent) -> tuple[int, ...]:
    """Sort key of execution order (see the module docstring): the shared
    :func:`trainprobe.tools.execution_order.execution_key` of the event's step, table (what
    follows ``/rank<r>/`` in ``tag_name``: a V1 table or tag suffix, or a V2 ``monitor/scope``
    group as the report names its onsets), target, micro-step, position (``call_id`` unless a tool set
    :attr:`AnomalyEvent.position`), rank and pipeline stages."""
    data = event.data
    tagged = _RANK_TAG.match(data["tag_name"])  # a V2 group has a '/' too: weight_grad/reduced
    if tagged:
        target, table = tagged.groups()
    else:
        name, _, table = data["tag_name"].rpartition("/")
        target = name.rpartition("/")[0]
    return row_execution_key(
        data["step"],
        table,
        target=target,
        micro_step=data["micro_step"],
        position=data["call_id"] if event.position is None else event.position,
        rank=data["rank"],
        vpp_stage=data["vpp_stage"],
        pp_stage=data["pp_stage"],
    )


def order_events(events: Iterable[AnomalyEvent]) -> list[AnomalyEvent]:
    """``events`` in execution order (stable: equal keys keep their reading order)."""
    return sorted(events, key=execution_key)


def select_steps(events: Iterable[AnomalyEvent], step_list: Sequence[int] | None) -> list[AnomalyEvent]:
    """The events whose step is in ``step_list`` (None or empty: every event)."""
    if not step_list:
        return list(events)
    wanted = set(step_list)
    return [e for e in events if e.data["step"] in wanted]


def parse_step_list(text: str) -> list[int]:
    """``"[2,3]"``, ``"2,3"``, ``"2"``, ``"[]"`` or ``""`` → a list of steps (empty: every step).

    Raises:
        ConfigError: anything else, e.g. ``"[2,x]"`` or ``"-1"``.
    """
    body = text.strip()
    if body.startswith("[") and body.endswith("]"):
        body = body[1:-1].strip()
    if not body:
        return []
    steps: list[int] = []
    for part in body.split(","):
        item = part.strip()
        if not _STEP.fullmatch(item):
            raise ConfigError(f"step_list: {_short(text)} is not a list of steps >= 0 such as [2,3] or 2,3")
        steps.append(bounded_int(item, "step", "step_list"))
    return steps


def check_step_list(step_list: Iterable[int] | None) -> list[int]:
    """``step_list`` as a list of steps >= 0 (None: empty, every step).

    Raises:
        ConfigError: an item is not an integer >= 0.
    """
    steps = list(step_list or [])
    for step in steps:
        if not _is_int(step) or step < 0:
            raise ConfigError(f"step_list: expected integers >= 0, got {step!r}")
    return steps


def check_topk(topk: object) -> int:
    """``topk`` as an integer >= 1.

    Raises:
        ConfigError: anything else.
    """
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ConfigError(f"topk: expected an integer >= 1, got {topk!r}")
    return topk


# --------------------------------------------------------------------------- writing


def output_file(out_path: str | Path | None, default_folder: Path) -> Path:
    """``<out_path>/anomaly_analyse.json`` (folder created), or in ``default_folder``.

    Raises:
        ConfigError: ``out_path`` exists and is not a folder, or cannot be created.
    """
    folder = default_folder if out_path is None else Path(out_path).expanduser()
    return make_folder(folder, "out_path") / OUTPUT_NAME


def write_result(events: Sequence[AnomalyEvent], path: Path) -> None:
    """Write ``{key: event dict}`` in the order of ``events`` to ``path`` (atomically).

    Raises:
        ConfigError: the file cannot be written.
    """
    try:
        write_json_atomically(path, {e.key: e.data for e in events}, indent=4)
    except OSError as exc:
        raise ConfigError(f"out_path: cannot write {str(path)!r}: {exc.strerror or exc}") from None


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


# --------------------------------------------------------------------------- table

TABLE_COLUMNS: tuple[str, ...] = (
    "order",
    "step",
    "micro_step",
    "phase",
    "vpp_stage",
    "pp_stage",
    "rank",
    "call_id",
    "rule",
    "tag_name",
)


def table_rows(events: Sequence[AnomalyEvent]) -> list[list[str]]:
    """One row of cells per event, following :data:`TABLE_COLUMNS` (``order`` counts from 1);
    control characters in tag names and rules are shown escaped (one line per event)."""
    rows = []
    for index, e in enumerate(events, start=1):
        d = e.data
        rows.append(
            [
                str(index),
                str(d["step"]),
                str(d["micro_step"]),
                e.phase,
                str(d["vpp_stage"]),
                str(d["pp_stage"]),
                str(d["rank"]),
                str(d["call_id"]),
                one_line(e.rule),
                one_line(d["tag_name"]),
            ]
        )
    return rows


def format_table(events: Sequence[AnomalyEvent]) -> str:
    """A plain aligned text table of ``events``: a header, dashes, one line per event.

    Example::

        order  step  micro_step  phase     vpp_stage  pp_stage  rank  call_id  rule        tag_name
        -----  ----  ----------  --------  ---------  --------  ----  -------  ----------  --------
        1      3     0           backward  0          0         0     12       AnomalyNan  0:fc1.weight/rank0/grad_reduced
    """
    rows = [list(TABLE_COLUMNS), ["-" * len(c) for c in TABLE_COLUMNS], *table_rows(events)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(TABLE_COLUMNS))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def _rich_table(events: Sequence[AnomalyEvent], title: str, stream: TextIO) -> bool:
    try:
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text
    except ImportError:
        return False
    table = Table(title=Text(title))
    for column in TABLE_COLUMNS:
        table.add_column(column, no_wrap=True)
    for row in table_rows(events):
        table.add_row(*(Text(cell) for cell in row))  # Text: names such as "op[12]" are not markup
    console = Console(file=stream)
    needed = console.measure(table, options=console.options.update(max_width=100_000)).maximum
    if needed > console.width:  # never cut a tag name: let the terminal wrap the lines instead
        console = Console(file=stream, width=needed)
    console.print(table)
    return True


def print_result(result: AnalyseResult, step_list: Sequence[int], stream: TextIO | None = None) -> None:
    """Print a summary line, the table (drawn with ``rich`` when it is installed and ``stream``
    is a terminal, plain text otherwise) and where the JSON went."""
    out = stream or sys.stdout
    steps = "steps " + ",".join(map(str, step_list)) if step_list else "all steps"
    title = (
        f"first {len(result.events)} of {result.selected} anomalies ({steps}; {result.found} in "
        f"{len(result.files)} file(s)), in execution order"
    )
    if not result.events:
        print(f"no anomalies in {steps} ({result.found} in {len(result.files)} file(s))", file=out)
    elif not (getattr(out, "isatty", lambda: False)() and _rich_table(result.events, title, out)):
        print(title, file=out)
        print(format_table(result.events), file=out)
    print(f"written to {result.output}", file=out)


# --------------------------------------------------------------------------- command line


def configure_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the options ``-d/--data_path``, ``-o/--out_path``, ``-k/--topk``, ``-s/--step_list``
    (also ``--step``, the reference tool's spelling)."""
    parser.add_argument(
        "-d",
        "--data_path",
        "--data-path",
        dest="data_path",
        required=True,
        help="the anomaly_detected folder (or the monitor output folder that contains it)",
    )
    parser.add_argument(
        "-o",
        "--out_path",
        "--out-path",
        dest="out_path",
        help=f"folder to write {OUTPUT_NAME} to (created; default: the anomaly_detected folder)",
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
    parser.set_defaults(run=run)
    return parser


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``anomaly-analyse`` on ``subparsers`` (an ``add_subparsers()`` result)."""
    parser = subparsers.add_parser(
        COMMAND,
        help="order dumped anomalies as training executed them and keep the first k",
        description="Order the anomalies of anomaly_detected/rank*/anomaly.json as training executed them.",
    )
    return configure_parser(parser)


def run(args: argparse.Namespace) -> int:
    """Run the analysis of parsed arguments and print it; returns 0.

    Raises:
        ConfigError: bad arguments or input.
    """
    steps = parse_step_list(args.step_list)
    result = analyse(args.data_path, args.out_path, args.topk, steps)
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
        return args.run(args)
    except (ConfigError, OSError) as exc:
        print(f"trainprobe {COMMAND}: error: {one_line(str(exc))}", file=sys.stderr)
        return 2
