"""csv2tensorboard: turn the output of Monitor V1 or Monitor V2 (CSV or Parquet) into TensorBoard event files.

Python API (the reference's ``csv2tensorboard_by_step``, also importable from
``trainprobe.pytorch.monitor.csv2tb``)::

    from trainprobe.tools.exports.tensorboard import csv2tensorboard_by_step
    out = csv2tensorboard_by_step("~/monitor_output", "Dec03_21-34-40", "Dec03_21-34-42",
                                  process_num=4, data_type_list=["grad_reduced"])

Command line::

    trainprobe csv2tb MONITOR_PATH [--time-start T] [--time-end T] [--process-num N]
                      [--data-type TYPE ...] [-o OUTPUT_DIR]

Input and selection are those of :func:`trainprobe.tools.runs.selection.find_monitor_files`: V1 run
folders ``<MonDD_HH-MM-SS>-rank<r>-<id>`` whose timestamp lies in ``[time_start, time_end]``
(``None`` = no bound), or a V2 ``output_dir`` with ``rank_<r>/`` folders (no time filter); CSV
and Parquet files alike (the Parquet file where a window has both).

Output, in ``output_dirpath`` (default ``<YYYYmmddHHMMSS>_csv2tensorboard_by_step`` in the
current folder, local time)::

    <out>/rank<r>/<data_type>/events.out.tfevents.<time>.<host>.<pid>.<n>

one event file per rank and data type, so TensorBoard lists every ``rank<r>/<data_type>`` as a
run. Re-running into the same folder replaces the event file of each converted rank and data
type (earlier ``events.out.tfevents.*`` files in that folder are deleted first), so no run shows
its points twice.

Tags (x axis = ``step``; values are float32 ``simple_value`` scalars as ``add_scalar`` writes):

* V1: ``vp<vpp_stage>:<name>/<op>`` where ``<name>`` loses its ``<vpp_stage>:`` chunk prefix,
  e.g. ``vp0:fc1.weight/min``; rows with a micro-step add ``:micro<m>``:
  ``vp0:fc1.input:micro0/min``.
* V2: ``vp<vpp_stage>:<module_name>:<scope>[:micro<m>]/<op>``, e.g.
  ``vp0:fc1.weight:unreduced:micro1/norm``, ``vp0:fc1.input.0:forward:micro0/max``.

The files are read as csv2db reads them (:mod:`trainprobe.tools.runs.read`: DuckDB through
the query layer's typed scans; both V1 layouts, V2; a torn last line of a killed run is skipped
with one warning per file, any other unreadable row is an error naming the file). ``process_num > 1`` converts the
(rank, data type) groups in that many spawned worker processes; the event files hold the same
tags, steps and values as with ``process_num=1``. Scripts that call it with ``process_num > 1``
need the usual ``if __name__ == "__main__":`` guard (the workers are spawned).

Every bad input (missing path, no monitor output, unknown data type, malformed or reversed time
range, bad ``process_num``, a missing ``tensorboard`` package) raises
:class:`~trainprobe.engine.errors.ConfigError`; the command line prints it on one line and exits with 2.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from itertools import repeat
from pathlib import Path
from typing import Any

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.log import warn_once
from trainprobe.engine.printable import printable
from trainprobe.engine.sinks.events import EventWriter, require_tensorboard
from trainprobe.tools.exports.sqlite_rows import ParsedFile
from trainprobe.tools.runs.files import RunFile
from trainprobe.tools.runs.options import (
    add_engine_argument,
    add_selection_arguments,
    check_engine,
    check_process_num,
    output_folder,
    worker_warnings,
)
from trainprobe.tools.runs.read import parquet_only, read_files, spark_read_files
from trainprobe.tools.runs.selection import find_monitor_files

COMMAND = "csv2tb"
OUTPUT_SUFFIX = "csv2tensorboard_by_step"
EVENT_FILE_PREFIX = "events.out.tfevents."


@dataclass(frozen=True)
class Group:
    """The files of one rank and data type: they become one event file."""

    rank: int
    data_type: str
    files: tuple[RunFile, ...]

    def folder(self, out: Path) -> Path:
        """``<out>/rank<r>/<data_type>``: the run TensorBoard shows for this group."""
        return out / f"rank{self.rank}" / self.data_type


@dataclass(frozen=True)
class GroupResult:
    """What converting one group wrote: the event file, rows and scalars, rows skipped as torn,
    and (from worker processes) the warnings to repeat in the calling process."""

    rank: int
    data_type: str
    event_file: Path
    rows: int
    scalars: int
    torn: int
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class Conversion:
    """The result of a conversion: the output folder and one result per (rank, data type)."""

    output: Path
    groups: tuple[GroupResult, ...]


def csv2tensorboard_by_step(
    monitor_path: str | Path,
    time_start: str | None,
    time_end: str | None,
    process_num: int = 1,
    data_type_list: Sequence[str] | None = None,
    output_dirpath: str | Path | None = None,
) -> Path:
    """Convert monitor CSV output to TensorBoard event files (see the module docstring).

    Args:
        monitor_path: a V1 ``MONITOR_OUTPUT_DIR`` (or one run folder) or a V2 ``output_dir``.
        time_start, time_end: the closed range of V1 run timestamps, e.g. ``"Dec03_21-34-40"``;
            ``None`` leaves that side open.
        process_num: worker processes (>= 1).
        data_type_list: file prefixes to convert (``["grad_reduced", "actv"]``, V2 monitors such
            as ``"weight_grad"``); ``None`` converts every data type found.
        output_dirpath: output folder; default ``<YYYYmmddHHMMSS>_csv2tensorboard_by_step``.

    Returns:
        The output folder (the reference returns None; callers may ignore it).

    Raises:
        ConfigError: any bad input (nothing is written then).
    """
    return convert(monitor_path, time_start, time_end, process_num, data_type_list, output_dirpath).output


def convert(
    monitor_path: str | Path,
    time_start: str | None = None,
    time_end: str | None = None,
    process_num: int = 1,
    data_type_list: Sequence[str] | None = None,
    output_dirpath: str | Path | None = None,
    engine: str = "duckdb",
) -> Conversion:
    """:func:`csv2tensorboard_by_step` returning what was written, per rank and data type;
    ``engine="spark"``: the files (Parquet only) read through Apache Spark in this process (the
    active session, else one in local mode; ``process_num`` is not used then).

    Raises:
        ConfigError: any bad input: the paths and options are checked before the output folder
            is created, each CSV file when its group is converted (see
            :mod:`trainprobe.tools.runs.layout`); also when no selected file holds a
            complete row.
    """
    workers = check_process_num(process_num)
    check_engine(engine)
    files = find_monitor_files(monitor_path, time_start, time_end, data_type_list)
    require_tensorboard(_missing_tensorboard)  # fail early when tensorboard is missing
    if engine == "spark":
        parquet_only(files)  # before Spark starts
    out = output_folder(output_dirpath, OUTPUT_SUFFIX)
    groups = group_files(files)
    if engine == "spark":
        from trainprobe.tools.engines.spark import local_session

        with local_session() as session:
            results = tuple(convert_group(group, out, session) for group in groups)
    else:
        results = tuple(_convert_groups(groups, out, workers))
    if not any(result.rows for result in results):
        raise ConfigError(
            f"monitor_path: the {len(files)} selected CSV file(s) under {str(monitor_path)!r} hold no complete "
            "row (empty, or only a torn line: a run that is starting?); the event files are empty"
        )
    return Conversion(out, results)


def group_files(files: Iterable[RunFile]) -> list[Group]:
    """The files grouped by (rank, data type), groups and files in the order given."""
    grouped: dict[tuple[int, str], list[RunFile]] = defaultdict(list)
    for file in files:
        grouped[(file.rank, file.data_type)].append(file)
    return [Group(rank, data_type, tuple(members)) for (rank, data_type), members in grouped.items()]


def target_label(file: RunFile, name: str, vpp_stage: int, micro_step: int | None, scope: str | None) -> str:
    """The tag of a row without the ``/<op>`` (see the module docstring): ``vp0:fc1.weight``,
    ``vp0:fc1.input:micro0`` (V1), ``vp0:fc1.weight:unreduced:micro1`` (V2)."""
    if file.layout == "v1":
        chunk = f"{vpp_stage}:"
        label = f"vp{vpp_stage}:{name[len(chunk) :] if name.startswith(chunk) else name}"
    else:
        label = f"vp{vpp_stage}:{name}:{scope}"
    return label if micro_step is None else f"{label}:micro{micro_step}"


def scalars_by_step(parsed: ParsedFile) -> dict[int, list[tuple[str, float]]]:
    """The (tag, value) pairs of every row of one file, by step in ascending order; the rows of
    one step keep their file order."""
    labels = [target_label(parsed.file, name, vpp, micro, scope) for name, vpp, micro, scope, _ in parsed.targets]
    tags = [[f"{label}/{op}" for op in parsed.ops] for label in labels]
    by_step: dict[int, list[tuple[str, float]]] = defaultdict(list)
    for row, (step, target) in enumerate(zip(parsed.steps, parsed.target_index)):
        by_step[step].extend(zip(tags[target], [column[row] for column in parsed.values]))
    return dict(sorted(by_step.items()))


def convert_group(group: Group, out: Path, spark: Any = None) -> GroupResult:
    """Write the event file of one group, replacing earlier ones in its folder: one event per
    step, written by trainprobe's one event writer (:class:`~trainprobe.engine.sinks.events.EventWriter`)
    into a staging folder beside it, then moved in (a rename) once complete; only then are the
    earlier event files removed. A failure leaves the folder as it was (no partial event file).
    ``spark``: a Spark session to read the group's (Parquet) files through."""
    folder = group.folder(out)
    folder.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".partial", dir=folder.parent))
    rows = scalars = torn = 0
    try:
        writer = EventWriter(staging, max_queue=1024, missing=_missing_tensorboard)
        try:
            for parsed in read_files(group.files) if spark is None else spark_read_files(spark, group.files):
                rows, torn = rows + len(parsed.steps), torn + parsed.torn
                for step, pairs in scalars_by_step(parsed).items():
                    scalars += writer.write(step, [writer.scalar(tag, value) for tag, value in pairs])
        finally:
            writer.close()
        (written,) = staging.glob(f"{EVENT_FILE_PREFIX}*")
        for old in folder.glob(f"{EVENT_FILE_PREFIX}*"):
            old.unlink()
        event_file = folder / written.name
        os.replace(written, event_file)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return GroupResult(group.rank, group.data_type, event_file, rows, scalars, torn)


def _convert_groups(groups: list[Group], out: Path, workers: int) -> Iterator[GroupResult]:
    workers = min(workers, len(groups))
    if workers <= 1:
        yield from (convert_group(group, out) for group in groups)
        return
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        try:
            for result in pool.map(_convert_group_in_worker, groups, repeat(out)):
                for message in result.warnings:
                    warn_once(message, message)
                yield result
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise


def _convert_group_in_worker(group: Group, out: Path) -> GroupResult:
    """:func:`convert_group` in a worker process: its warnings travel back with the result, so
    the calling process says them (once) where its logging is configured."""
    with worker_warnings() as warnings:
        result = convert_group(group, out)
    return replace(result, warnings=tuple(warnings))


def _missing_tensorboard(exc: ImportError) -> ConfigError:
    return ConfigError(
        f"csv2tensorboard: needs the tensorboard package ({exc}); install it with `pip install tensorboard` "
        "(or trainprobe[tensorboard])"
    )


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``csv2tb`` on ``subparsers`` (an ``add_subparsers()`` result)."""
    parser = subparsers.add_parser(
        COMMAND,
        help="convert monitor CSV output (V1 or V2) to TensorBoard event files",
        description="Convert monitor CSV output to TensorBoard event files: one per rank and data type, "
        "tags vp<vpp>:<name>[:micro<m>]/<op>, x axis = step.",
    )
    add_selection_arguments(parser)
    add_engine_argument(parser)
    parser.set_defaults(handler=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Convert as the parsed arguments say and print a summary; returns 0.

    Raises:
        ConfigError: bad arguments or input.
    """
    result = convert(
        args.run, args.time_start, args.time_end, args.process_num, args.data_type_list, args.output_dirpath,
        engine=args.engine,
    )
    for group in result.groups:
        torn = f", {group.torn} torn row(s) skipped" if group.torn else ""
        print(f"rank{group.rank}/{group.data_type}: {group.rows} rows, {group.scalars} scalars{torn} -> {printable(group.event_file)}")
    ranks = len({g.rank for g in result.groups})
    print(f"wrote {len(result.groups)} event file(s) for {ranks} rank(s) to {result.output}")
    print(f"view with: tensorboard --logdir {result.output}")
    return 0
