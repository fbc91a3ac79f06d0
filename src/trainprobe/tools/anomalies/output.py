"""What ``anomaly-analyse`` writes and prints: ``anomaly_analyse.json`` and the console table.

* ``<out_path>/anomaly_analyse.json`` (default ``out_path``: the ``anomaly_detected`` folder;
  created if missing): one JSON object, indent 4, the kept events keyed and shaped exactly as in
  the input files, inserted in execution order; written atomically (a temporary file, then a
  rename).
* The console: a summary line, the table with the columns :data:`TABLE_COLUMNS` (drawn with
  ``rich`` on a terminal when it is installed, plain aligned text otherwise; tag names never cut,
  control characters shown escaped) and ``written to <file>``.

A folder that cannot be made or a file that cannot be written raises
:class:`~trainprobe.engine.errors.ConfigError` naming ``out_path``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.printable import printable
from trainprobe.engine.sinks.files import write_json_atomically
from trainprobe.tools import console
from trainprobe.tools.anomalies.events import AnalyseResult, AnomalyEvent
from trainprobe.tools.runs.options import make_folder

OUTPUT_NAME = "anomaly_analyse.json"

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
        write_json_atomically(path, {e.key: e.data for e in events}, indent=4, field="out_path")
    except OSError as exc:
        raise ConfigError(f"out_path: cannot write {str(path)!r}: {exc.strerror or exc}") from None


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
                printable(e.rule),
                printable(d["tag_name"]),
            ]
        )
    return rows


def format_table(events: Sequence[AnomalyEvent]) -> str:
    """A plain aligned text table of ``events``: a header, dashes, one line per event
    (:func:`trainprobe.tools.console.format_table`).

    Example::

        order  step  micro_step  phase     vpp_stage  pp_stage  rank  call_id  rule        tag_name
        -----  ----  ----------  --------  ---------  --------  ----  -------  ----------  --------
        1      3     0           backward  0          0         0     12       AnomalyNan  0:fc1.weight/rank0/grad_reduced
    """
    return console.format_table(TABLE_COLUMNS, table_rows(events))


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
    elif not (getattr(out, "isatty", lambda: False)() and console.rich_table(TABLE_COLUMNS, table_rows(result.events), title, out)):
        print(title, file=out)
        print(format_table(result.events), file=out)
    print(f"written to {result.output}", file=out)
