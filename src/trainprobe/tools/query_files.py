"""The data files of a run, for the query layer (:mod:`trainprobe.tools.query`): standard library
only, so that finding files costs no DuckDB import.

A *run* is a folder holding any mix of:

* Monitor V2 output (``output_dir``): ``rank_<r>/<monitor>_step<a>-<b>.csv`` or ``.parquet``;
* Monitor V1 output (``MONITOR_OUTPUT_DIR``): ``<MonDD_HH-MM-SS>-rank<r>-<id>/<table>_<a>-<b>.csv``
  or ``.parquet``;

or one such rank / run folder itself. Both tools' layouts are recognised (trainprobe's and the
reference msProbe's: same names, see :mod:`trainprobe.tools.monitor_layout`). Entries that are
not regular files, and names no monitor writes, are left out; so is a link to a file outside the
run folder given (never opened; one warning names it), the rule of
:func:`trainprobe.tools.monitor_layout.find_csv_files`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.layout import V1_DATA_FILE, V1_RUN, V2_DATA_FILE, V2_RANK
from trainprobe.engine.log import warn_once
from trainprobe.engine.safe_files import bounded_int, is_inside, is_regular_file
from trainprobe.tools.monitor_layout import V1_DATA_TYPES, V2_DATA_TYPES

Layout = Literal["v1", "v2"]
Format = Literal["csv", "parquet"]


class NoRunFiles(ConfigError):
    """:func:`find_run_files` found no monitor data file in an existing folder (the message says
    what was looked for): callers that fall back to something else catch this, not the text."""


@dataclass(frozen=True)
class RunFile:
    """One data file of a run.

    Attributes:
        path: the file (absolute).
        layout: ``"v1"`` or ``"v2"``.
        format: ``"csv"`` or ``"parquet"``.
        rank: the rank that wrote it (from its folder's name).
        table: the view it belongs to: the V2 monitor or the V1 table (``weight_grad``, ``actv``).
        first_step, last_step: the window named in the file name.
    """

    path: Path
    layout: Layout
    format: Format
    rank: int
    table: str
    first_step: int
    last_step: int


def find_run_files(run: str | Path, warn_links: bool = True) -> list[RunFile]:
    """Every data file of ``run``, ordered by table, rank and first step. Links to files outside
    ``run`` are skipped, with one warning unless ``warn_links`` is False (a caller that found
    the same files already and said so).

    Raises:
        NoRunFiles: ``run`` holds no monitor data file (the message says what was looked for).
        ConfigError: ``run`` does not exist or is not a folder, or cannot be listed.
    """
    root = Path(run).expanduser().absolute()
    if not root.exists():
        raise ConfigError(f"run: {str(root)!r} does not exist")
    if not root.is_dir():
        raise ConfigError(f"run: {str(root)!r} is not a folder")
    outside: list[str] = []
    files = [f for folder, layout, rank in _folders(root) for f in _files_of(folder, layout, rank, root, outside)]
    if outside and warn_links:
        warn_once(
            f"outside:{root}",
            f"{outside[0]}: a link to a file outside {str(root)!r}, skipped (not read)"
            + (f", and {len(outside) - 1} more such links" if len(outside) > 1 else ""),
        )
    converted = {f.path.with_suffix("") for f in files if f.format == "parquet"}
    files = [f for f in files if f.format == "parquet" or f.path.with_suffix("") not in converted]
    if not files:
        raise NoRunFiles(
            f"run: no monitor data file (.csv or .parquet) under {str(root)!r}"
            + (f" (skipped {len(outside)} links to files outside the folder)" if outside else "")
            + "; looked for Monitor V2 "
            "'rank_<r>/<monitor>_step<a>-<b>.csv' and Monitor V1 '<MonDD_HH-MM-SS>-rank<r>-<id>/<table>_<a>-<b>.csv'"
        )
    return sorted(files, key=lambda f: (f.table, f.rank, f.first_step, f.format, str(f.path)))


def _folders(root: Path) -> Iterator[tuple[Path, Layout, int]]:
    try:
        children = sorted(p for p in root.iterdir() if p.is_dir())
    except OSError as exc:
        raise ConfigError(f"run: cannot list {str(root)!r}: {exc.strerror or exc}") from None
    for folder in [root, *children]:
        v1 = V1_RUN.fullmatch(folder.name)
        v2 = V2_RANK.fullmatch(folder.name)
        if v1:
            yield folder, "v1", bounded_int(v1["rank"], "rank", f"run folder {str(folder)!r}")
        elif v2:
            yield folder, "v2", bounded_int(v2["rank"], "rank", f"rank folder {str(folder)!r}")


def _files_of(folder: Path, layout: Layout, rank: int, root: Path, outside: list[str]) -> Iterator[RunFile]:
    """The data files of one rank or run folder; links to files outside ``root`` go to ``outside``."""
    folder_inside = is_inside(folder, root)  # a plain file of the folder is inside iff the folder is
    pattern = V1_DATA_FILE if layout == "v1" else V2_DATA_FILE
    known = V1_DATA_TYPES if layout == "v1" else V2_DATA_TYPES
    try:
        names = sorted(os.listdir(folder))
    except OSError as exc:
        raise ConfigError(f"{folder}: cannot list the folder: {exc.strerror or exc}") from None
    for name in names:
        match = pattern.fullmatch(name)
        if not (match and match["type"] in known):
            continue
        path = folder / name
        if not is_regular_file(path):
            continue
        if not (folder_inside and not path.is_symlink()) and not is_inside(path, root):
            outside.append(str(path))
            continue
        first = bounded_int(match["first"], "first step", str(path))
        last = bounded_int(match["last"], "last step", str(path))
        fmt: Format = "parquet" if match["ext"] == "parquet" else "csv"
        yield RunFile(path, layout, fmt, rank, match["type"], first, last)


def csv_header(path: Path, limit: int = 1 << 16) -> tuple[str, ...] | None:
    """The column names of a CSV data file (its first line; a byte-order mark and ``\\r`` dropped),
    or None when the file has no complete first line (empty, or a run that is starting).

    Monitor headers never quote a name (they are identifiers), so the line is split on commas."""
    with open(path, "rb") as handle:
        head = handle.read(limit)
    end = head.find(b"\n")
    if end < 0:
        return None
    line = head[:end].decode("utf-8", "replace").removeprefix("\ufeff").rstrip("\r")
    return tuple(line.split(",")) if line else None


def clean_length(path: Path) -> int | None:
    """None when the CSV file ends with a line break (nothing torn); else the length in bytes of its
    complete part: up to the last line break outside a quoted cell (a run killed, or still writing,
    left a torn last record, which the query layer leaves out)."""
    size = path.stat().st_size
    if size == 0:
        return 0
    with open(path, "rb") as handle:
        handle.seek(size - 1)
        if handle.read(1) in (b"\n", b"\r"):
            return None
        handle.seek(0)
        data = handle.read()
    end = data.rfind(b"\n")
    while end >= 0 and data.count(b'"', 0, end) % 2:  # that line break is inside a quoted cell
        end = data.rfind(b"\n", 0, end)
    return end + 1


def is_precision_dump(path: Path, depth: int = 3) -> bool:
    """Whether ``path`` holds a precision dump rather than monitor output: a ``dump.json`` or
    ``debug.json`` in it or at most ``depth`` folder levels below (``dump_path/step<N>/rank<R>/``).
    The tools that read runs use it to point at ``trainprobe compare`` instead."""
    if not path.is_dir():
        return False
    patterns = ("*/" * level + name for level in range(depth + 1) for name in ("dump.json", "debug.json"))
    return any(next(path.glob(pattern), None) is not None for pattern in patterns)
