"""What csv2tb, csv2db and report share: the selection arguments of their command lines, the
checks of their Python parameters, the timestamped default output folder and the warnings their
worker processes send back."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterator
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


def add_selection_arguments(parser: argparse.ArgumentParser) -> None:
    """``MONITOR_PATH [--time-start T] [--time-end T] [--process-num N] [--tables TABLE ...]
    [-o OUTPUT_DIR]``; the Namespace fields are ``monitor_path``, ``time_start``, ``time_end``,
    ``process_num``, ``data_type_list`` (None = all) and ``output_dirpath``."""
    parser.add_argument("monitor_path", help="monitor output: a V1 MONITOR_OUTPUT_DIR or run folder, a V2 output_dir")
    parser.add_argument("--time-start", dest="time_start", help="first V1 run timestamp to take, e.g. Dec03_21-34-40")
    parser.add_argument("--time-end", dest="time_end", help="last V1 run timestamp to take (inclusive)")
    parser.add_argument("--process-num", dest="process_num", type=int, default=1, help="worker processes (default 1)")
    parser.add_argument(
        "--tables",
        "--data-type",
        dest="data_type_list",
        nargs="+",
        action=CommaList,
        metavar="TABLE",
        help="tables to convert (V1 file prefixes such as grad_reduced, or V2 monitors), space- or comma-separated; "
        "default all (--data-type: the reference's spelling)",
    )
    parser.add_argument("-o", "--output", dest="output_dirpath", help="output folder (default: timestamped)")


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
