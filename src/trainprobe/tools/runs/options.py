"""The one vocabulary of the offline tools' command lines, and what csv2tb, csv2db and report share.

Every command that reads a run spells its arguments the same way (:func:`add_run_argument`,
:func:`add_output_argument`, :func:`add_tables_argument`, :func:`add_engine_argument`):

* the input is the **run**: a positional ``RUN`` (the run folder: a V2 ``output_dir``, a V1
  ``MONITOR_OUTPUT_DIR`` or one rank / run folder), ``args.run`` in code; the reference tools'
  spellings stay where they are part of the drop-in (``anomaly-analyse -d/--data_path``);
* what a command writes goes to **-o/--output** (``--out``, ``--out_path``, ``--output_path``
  kept as aliases where a command had them), and the command prints what it wrote;
* **--tables** selects tables / monitors (``--data-type``, the reference's spelling, kept),
  space- or comma-separated;
* **--engine duckdb|spark** on every command that reads the run's tables;
* options anywhere on the line (:func:`intermixed`: ``trainprobe query RUN --engine spark "SQL"``).

A command's function is ``args.handler`` (``args.run`` is the input).

Also here: the selection arguments of csv2db and csv2tb, the checks of their Python parameters,
the timestamped default output folder and the warnings their worker processes send back."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from os import PathLike
from pathlib import Path
from typing import Any

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.log import logger

OUTPUT_STAMP = "%Y%m%d%H%M%S"


class CommaList(argparse.Action):
    """``--tables a b`` and ``--tables a,b`` alike: the values, split at commas, in order."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: str | None = None
    ) -> None:
        items = [values] if isinstance(values, str) else list(values or [])
        setattr(namespace, self.dest, [part for item in items for part in str(item).split(",") if part])


#: The engines a reading command runs on.
ENGINES: tuple[str, ...] = ("duckdb", "spark")
RUN_HELP = "the run folder (V2 output_dir, V1 MONITOR_OUTPUT_DIR, or one rank/run folder)"


class _IntermixedParser(argparse.ArgumentParser):
    """An argument parser that takes options and positionals in any order: argparse's own parser
    stops filling an optional positional (``query``'s SQL) at the first option after the run."""

    _parsing = False

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if self._parsing:  # parse_known_intermixed_args calls back in for each of its two passes
            return super().parse_known_args(args, namespace)
        self._parsing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._parsing = False


def intermixed(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parser``, made to take options anywhere on the line (the sub-parsers object makes plain
    parsers, so its class is swapped); returns it."""
    parser.__class__ = _IntermixedParser
    return parser


def add_run_argument(parser: argparse.ArgumentParser, help: str = RUN_HELP, *, optional: bool = False) -> None:
    """The positional ``RUN`` (``args.run``); ``optional``: it may be left out (a command that also
    takes a reference spelling such as ``-d``)."""
    parser.add_argument("run", metavar="RUN", nargs="?" if optional else None, help=help)


def add_output_argument(
    parser: argparse.ArgumentParser, help: str, *aliases: str, dest: str = "output", metavar: str | None = None
) -> None:
    """``-o/--output`` (and ``aliases``, the spellings a command had: ``--out``, ``--out_path``) to ``dest``."""
    parser.add_argument("-o", "--output", *aliases, dest=dest, metavar=metavar, help=help)


def add_tables_argument(parser: argparse.ArgumentParser, help: str, dest: str = "tables") -> None:
    """``--tables TABLE ...`` (``--data-type``, the reference's spelling): space- or comma-separated,
    a list in ``dest`` (None: every table)."""
    parser.add_argument(
        "--tables", "--data-type", dest=dest, nargs="+", action=CommaList, metavar="TABLE",
        help=help + "; space- or comma-separated (--data-type: the reference's spelling)",
    )


READ_ENGINE_HELP = "duckdb (default) or spark: read the files through Apache Spark (Parquet runs)"
"""``--engine``'s help for the commands that read a run's rows (csv2db, csv2tb)."""


def add_engine_argument(parser: argparse.ArgumentParser, help: str = READ_ENGINE_HELP) -> None:
    """``--engine duckdb|spark`` (default duckdb) to ``args.engine``."""
    parser.add_argument("--engine", choices=ENGINES, default="duckdb", help=help)


def check_engine(engine: object) -> str:
    """``engine`` checked: one of :data:`ENGINES`.

    Raises:
        ConfigError: any other value.
    """
    if engine not in ENGINES:
        raise ConfigError(f"engine: expected one of {', '.join(ENGINES)}, got {engine!r}")
    return str(engine)


def add_selection_arguments(parser: argparse.ArgumentParser) -> None:
    """``RUN [--time-start T] [--time-end T] [--process-num N] [--tables TABLE ...]
    [-o OUTPUT_DIR]``; the Namespace fields are ``run``, ``time_start``, ``time_end``,
    ``process_num``, ``data_type_list`` (None = all) and ``output_dirpath``."""
    add_run_argument(parser, "the run folder (a V1 MONITOR_OUTPUT_DIR or run folder, a V2 output_dir): monitor_path")
    parser.add_argument("--time-start", dest="time_start", help="first V1 run timestamp to take, e.g. Dec03_21-34-40")
    parser.add_argument("--time-end", dest="time_end", help="last V1 run timestamp to take (inclusive)")
    parser.add_argument("--process-num", dest="process_num", type=int, default=1, help="worker processes (default 1)")
    add_tables_argument(
        parser, "tables to convert (V1 file prefixes such as grad_reduced, or V2 monitors; default all)", "data_type_list"
    )
    add_output_argument(parser, "output folder (default: timestamped)", "--output_dirpath", dest="output_dirpath")


def check_process_num(process_num: object) -> int:
    """``process_num`` as a positive int.

    Raises:
        ConfigError: not an integer >= 1.
    """
    if isinstance(process_num, bool) or not isinstance(process_num, int) or process_num < 1:
        raise ConfigError(f"process_num: expected an integer >= 1, got {process_num!r}")
    return process_num


def output_folder(output_dirpath: str | PathLike[str] | None, suffix: str) -> Path:
    """``output_dirpath`` (expanded), or ``<local time YYYYmmddHHMMSS>_<suffix>`` in the current
    folder; created if missing.

    Raises:
        ConfigError: the path exists and is not a folder, or cannot be created (a file on the way).
    """
    if output_dirpath is None:
        folder = Path(f"{datetime.now().strftime(OUTPUT_STAMP)}_{suffix}")
    else:
        folder = Path(output_dirpath).expanduser()
    return make_folder(folder, "output_dirpath")


def make_folder(folder: Path, field: str) -> Path:
    """``folder``, created with its parents if missing.

    Raises:
        ConfigError: naming ``field``, when ``folder`` exists and is not a folder, or cannot be
            created (a file on the way).
    """
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{field}: {str(folder)!r} exists and is not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{field}: cannot create {str(folder)!r}: {exc.strerror or exc}") from None
    return folder


class _Collector(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def worker_warnings() -> Iterator[list[str]]:
    """The warnings trainprobe's logger says inside the block, collected (and kept from its other
    handlers) so a worker process sends them back for the caller to say once."""
    collector = _Collector()
    logger.addHandler(collector)
    propagate, logger.propagate = logger.propagate, False
    try:
        yield collector.messages
    finally:
        logger.removeHandler(collector)
        logger.propagate = propagate
