"""The data files of a run: the one walk of a run folder every offline tool finds its input with
(standard library only, so that finding files costs no DuckDB import).

A *run* is a folder holding any mix of:

* Monitor V2 output (``output_dir``): ``rank_<r>/<monitor>_step<a>-<b>.csv`` or ``.parquet``;
* Monitor V1 output (``MONITOR_OUTPUT_DIR``): ``<MonDD_HH-MM-SS>-rank<r>-<id>/<table>_<a>-<b>.csv``
  or ``.parquet``;

or one such rank / run folder itself. Both tools' layouts are recognised (trainprobe's and the
reference msProbe's: same names, see :mod:`trainprobe.tools.runs.layout`).

:func:`walk_run` walks the folder once and describes every data file it finds as a
:class:`RunFile` (path, rank, layout, table, window, format); entries named like data files that
are not regular files, and links to files outside the run, are set aside unopened. Every finder
is a selection over that walk:

* :func:`find_run_files`: the files the query layer reads (a window's ``.parquet`` preferred to
  its ``.csv``; Parquet step files a merged window already holds left out);
* :func:`trainprobe.tools.runs.selection.find_monitor_files` and
  :func:`~trainprobe.tools.runs.selection.find_csv_files`: csv2db's and csv2tb's selection by V1
  timestamp and data type.

A run without any data file raises :class:`NoRunFiles` (callers that fall back catch the type,
never the text).

Example::

    for f in find_run_files("monitor_output"):
        print(f.table, f.rank, f.window, f.format, f.path)
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.layout import ANOMALY_DUMP_FOLDER, V1_DATA_FILE, V1_RUN, V2_DATA_FILE, V2_RANK
from trainprobe.engine.log import warn_once
from trainprobe.engine.printable import printable
from trainprobe.engine.safe_files import bounded_int, is_inside, is_regular_file
from trainprobe.engine.sinks.parquet_sink import merged_step_files
from trainprobe.tools.runs.layout import V1_DATA_TYPES, V2_DATA_TYPES, Layout

Format = Literal["csv", "parquet"]

#: What the finders looked for, for the message of a run without data files.
LOOKED_FOR = (
    "Monitor V2 'rank_<r>/<monitor>_step<a>-<b>.csv' and Monitor V1 '<MonDD_HH-MM-SS>-rank<r>-<id>/<table>_<a>-<b>.csv'"
)


class NoRunFiles(ConfigError):
    """A run folder holds no monitor data file (of the kind selected; the message says what was
    looked for): callers that fall back to something else catch this type, not the text."""


@dataclass(frozen=True)
class RunFile:
    """One data file of a run: the one description of a found file every tool reads.

    Attributes:
        path: the file (absolute when found by :func:`find_run_files`; as given otherwise).
        layout: ``"v1"`` or ``"v2"``.
        format: ``"csv"`` or ``"parquet"``.
        rank: the rank that wrote it (from its folder's name).
        table: the view it belongs to: the V2 monitor or the V1 table (``weight_grad``, ``actv``).
        first_step, last_step: the window named in the file name.
        root: the run folder it was found in (a reader opens the file only if it still lies
            inside); None: no such check.
        identity: ``(st_dev, st_ino)`` of the file when it was found (its link followed), or
            None; :func:`check_unchanged` compares it with the file's at use.
    """

    path: Path
    layout: Layout
    format: Format
    rank: int
    table: str
    first_step: int
    last_step: int
    root: Path | None = None
    identity: tuple[int, int] | None = field(default=None, compare=False)

    @property
    def window(self) -> tuple[int, int]:
        """The steps named in the file name: ``(first_step, last_step)``."""
        return self.first_step, self.last_step

    @property
    def data_type(self) -> str:
        """The table, under the reference tools' name (csv2db's ``data_type_list``)."""
        return self.table

    @property
    def run(self) -> str:
        """The name of the rank (V2) or run (V1) folder holding the file."""
        return self.path.parent.name


@dataclass(frozen=True)
class Walk:
    """What one walk of a run folder found (:func:`walk_run`).

    Attributes:
        root: the run folder, as given (``~`` expanded).
        files: every data file, both formats (a window's ``.csv`` and ``.parquet`` both listed).
        irregular: entries named like data files that are not regular files (a folder, FIFO,
            device): not opened.
        outside: links to files outside ``root``: not opened.
    """

    root: Path
    files: tuple[RunFile, ...]
    irregular: tuple[str, ...]
    outside: tuple[str, ...]

    def warn_outside(self) -> None:
        """One warning naming the links to files outside the run that were skipped (if any)."""
        if self.outside:
            warn_once(
                f"outside:{self.root}",
                f"{self.outside[0]}: a link to a file outside {str(self.root)!r}, skipped (not read)"
                + (f", and {len(self.outside) - 1} more such links" if len(self.outside) > 1 else ""),
            )

    def warn_irregular(self) -> None:
        """One warning naming the entries that are not regular files (if any)."""
        if self.irregular:
            warn_once(
                f"irregular:{self.root}",
                f"{self.irregular[0]}: not a regular file (a folder, FIFO or device?), skipped"
                + (f", and {len(self.irregular) - 1} more such entries" if len(self.irregular) > 1 else ""),
            )


def walk_run(run: str | Path, field: str = "run") -> Walk:
    """Walk the run folder ``run`` once (it and its rank / run folders one level down) and describe
    every data file in it; ``field`` names the input in messages (``run``, or a reference
    spelling such as ``monitor_path``).

    Raises:
        ConfigError: ``run`` does not exist, is not a folder, or a folder cannot be listed; a
            rank or step in a folder or file name above 2**63 - 1.
    """
    root = Path(run).expanduser()
    if not root.exists():
        raise ConfigError(f"{field}: {str(root)!r} does not exist")
    if not root.is_dir():
        raise ConfigError(f"{field}: {str(root)!r} is not a folder")
    irregular: list[str] = []
    outside: list[str] = []
    files = [
        f
        for folder, layout, rank in _folders(root, field)
        for f in _files_of(folder, layout, rank, root, irregular, outside)
    ]
    return Walk(root, tuple(files), tuple(irregular), tuple(outside))


def run_order(f: RunFile) -> tuple[object, ...]:
    """The query layer's order of files: by table, rank, first step, format and path."""
    return f.table, f.rank, f.first_step, f.format, str(f.path)


def rank_order(f: RunFile) -> tuple[object, ...]:
    """The offline tools' order of files: by rank, data type, first step, folder and format."""
    return f.rank, f.table, f.first_step, f.run, f.format


def readable(files: tuple[RunFile, ...] | list[RunFile]) -> list[RunFile]:
    """``files`` as the readers read them: a window's ``.parquet`` file preferred to its ``.csv``
    (``trainprobe convert`` output, the readers read the Parquet one), and the Parquet step files
    whose rows a complete window file beside them already holds left out (a run killed between a
    window's merge and the removal of its step files left both:
    :func:`~trainprobe.engine.sinks.parquet_sink.merged_step_files`; read together their rows
    would count twice). The files stay on disk (a reader removes nothing)."""
    converted = {f.path.absolute().with_suffix("") for f in files if f.format == "parquet"}
    kept = [f for f in files if f.format == "parquet" or f.path.absolute().with_suffix("") not in converted]
    if not any(f.format == "parquet" and f.first_step == f.last_step for f in kept):
        return kept
    doubled = set(merged_step_files((f.path, f.table, f.first_step, f.last_step) for f in kept))
    return [f for f in kept if f.path not in doubled]


def find_run_files(run: str | Path, warn_links: bool = True) -> list[RunFile]:
    """Every data file of ``run`` the readers read (:func:`readable`), paths absolute, ordered by
    table, rank and first step (:func:`run_order`). Links to files outside ``run`` are skipped,
    with one warning unless ``warn_links`` is False (a caller that found the same files already
    and said so).

    Raises:
        NoRunFiles: ``run`` holds no monitor data file (the message says what was looked for).
        ConfigError: ``run`` does not exist or is not a folder, or cannot be listed.
    """
    walk = walk_run(Path(run).expanduser().absolute())
    if warn_links:
        walk.warn_outside()
    files = readable(walk.files)
    if not files:
        links = len(walk.outside)
        raise NoRunFiles(
            f"run: no monitor data file (.csv or .parquet) under {str(walk.root)!r}"
            + (f" (skipped {links} links to files outside the folder)" if links else "")
            + f"; looked for {LOOKED_FOR}"
        )
    return sorted(files, key=run_order)


def _folders(root: Path, field: str) -> Iterator[tuple[Path, Layout, int]]:
    try:
        children = sorted(p for p in root.iterdir() if p.is_dir())
    except OSError as exc:
        raise ConfigError(f"{field}: cannot list {str(root)!r}: {exc.strerror or exc}") from None
    for folder in [root, *children]:
        v1 = V1_RUN.fullmatch(folder.name)
        v2 = V2_RANK.fullmatch(folder.name)
        if v1:
            yield folder, "v1", bounded_int(v1["rank"], "rank", f"run folder {str(folder)!r}")
        elif v2:
            yield folder, "v2", bounded_int(v2["rank"], "rank", f"rank folder {str(folder)!r}")


def _files_of(
    folder: Path, layout: Layout, rank: int, root: Path, irregular: list[str], outside: list[str]
) -> Iterator[RunFile]:
    """The data files of one rank or run folder; entries that are not regular files go to
    ``irregular``, links to files outside ``root`` to ``outside`` (neither is opened)."""
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
            irregular.append(str(path))
            continue
        if not (folder_inside and not path.is_symlink()) and not is_inside(path, root):
            outside.append(str(path))
            continue
        first = bounded_int(match["first"], "first step", str(path))
        last = bounded_int(match["last"], "last step", str(path))
        fmt: Format = "parquet" if match["ext"] == "parquet" else "csv"
        yield RunFile(path, layout, fmt, rank, match["type"], first, last, root, _identity(path))


def _identity(path: Path) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of ``path`` (its link followed), None when it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def check_unchanged(files: Iterable[RunFile]) -> None:
    """Check each of ``files`` again right before a reader that cannot check it itself (DuckDB's
    views, which open the paths they are given) is built over it: it must still be the file
    found (the same ``(st_dev, st_ino)`` as :attr:`RunFile.identity`) and still lie inside its
    run (:attr:`RunFile.root`), so that a file swapped for a link to a file outside the run (or
    for another file) after the run was listed is not read. Files without a root or an identity
    are not checked. (A swap between this check and the reader's open is not seen: the check
    is repeated when a connection is sealed, just before its first query.)

    Raises:
        ConfigError: one line naming the file and what changed.
    """
    for f in files:
        if f.root is None or f.identity is None:
            continue
        shown = printable(str(f.path))
        now = _identity(f.path)
        if now is None:
            raise ConfigError(f"{shown}: gone since the run's files were listed (a run still writing or converting?)")
        if not is_inside(f.path, f.root):
            raise ConfigError(f"{shown}: now a link to a file outside {printable(str(f.root))!r}; not read")
        if now != f.identity:
            raise ConfigError(f"{shown}: replaced by another file since the run's files were listed; not read")


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


@dataclass(frozen=True)
class TornTail:
    """The torn end of a CSV data file (:func:`torn_tail`).

    Attributes:
        cut: the length in bytes of the file's complete part (its first ``cut`` bytes: whole
            records, ending with a line break; 0 when no record is complete, the header's
            line included).
        lines: the physical lines left out, from ``cut`` to the end of the file, the torn last
            line counted (so at least 1). More than 1 when the torn record's quoted name holds
            line breaks, or when a quote earlier in the file is unbalanced (a damaged file:
            everything after it reads as one quoted cell, often thousands of lines; then
            ``quote_open`` is True).
        first_line: the 1-based number of the first line left out (the header is line 1).
        quote_open: whether the file ends inside a quoted cell (an odd number of ``"``): the
            torn record stops inside a quoted name, or a quote earlier is unbalanced. A caller
            warning about the rows it skips can say ``lines`` and, when this is True and
            ``lines`` is large, that an unbalanced quote on line ``first_line`` or later cut
            the file there.
    """

    cut: int
    lines: int
    first_line: int
    quote_open: bool


_SCAN_CHUNK = 1 << 22  # bytes counted at a time (the file is mapped, not read whole)


def torn_tail(path: Path) -> TornTail | None:
    """What of CSV file ``path`` is torn, or None when nothing is: the file is empty or ends with
    a line break (``\\n`` or ``\\r``; the records' quotes are not checked then).

    Otherwise the complete part ends after the last line break outside a quoted cell, quotes
    counted from the start of the file (``""`` inside a cell counts twice, so it changes
    nothing): a run killed, or still writing, left a torn last record, which the query layer
    leaves out. One pass over the file (its ``"`` counted in chunks of a memory map), then a
    walk back from its end to that line break, and a count of the line breaks on either side
    of it: linear in the file's size, memory bounded by a chunk.

    Raises:
        OSError: the file cannot be read.
    """
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size == 0:
            return None
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            size = len(data)
            if data[size - 1 : size] in (b"\n", b"\r"):
                return None
            quote_open = _count(data, b'"', 0, size) % 2 == 1
            cut = _last_break_outside_quotes(data, size, quote_open)
            before = _count(data, b"\n", 0, cut)
            after = _count(data, b"\n", cut, size)
    return TornTail(cut=cut, lines=after + 1, first_line=before + 1, quote_open=quote_open)


def clean_length(path: Path) -> int | None:
    """None when the CSV file ends with a line break (nothing torn); 0 for an empty file; else the
    length in bytes of its complete part: up to and including the last line break outside a
    quoted cell (:func:`torn_tail`'s ``cut``; it also says how many lines that leaves out, which
    is more than one when a quoted cell is left open). Linear in the file's size."""
    if path.stat().st_size == 0:
        return 0
    tail = torn_tail(path)
    return None if tail is None else tail.cut


def _count(data: mmap.mmap, byte: bytes, start: int, stop: int) -> int:
    """How many times ``byte`` occurs in ``data[start:stop]``, counted a chunk at a time."""
    return sum(data[at : min(at + _SCAN_CHUNK, stop)].count(byte) for at in range(start, stop, _SCAN_CHUNK))


def _last_break_outside_quotes(data: mmap.mmap, end: int, inside: bool) -> int:
    """The offset just after the last ``\\n`` before ``end`` that is outside a quoted cell (0 when
    none), ``inside``: whether ``end`` itself is inside one. Walks back from quote to quote: the
    bytes between two quotes are all inside a cell or all outside it."""
    while end > 0:
        quote = data.rfind(b'"', 0, end)
        if not inside:
            found = data.rfind(b"\n", quote + 1, end)
            if found >= 0:
                return found + 1
        if quote < 0:
            return 0
        end, inside = quote, not inside
    return 0


def is_precision_dump(path: Path, depth: int = 3) -> bool:
    """Whether ``path`` holds a precision dump rather than monitor output: a ``dump.json`` or
    ``debug.json`` in it or at most ``depth`` folder levels below (``dump_path/step<N>/rank<R>/``).
    The dumps an online rule's ``dump`` action wrote inside a run (its ``anomaly_dump/`` folder,
    :data:`~trainprobe.engine.layout.ANOMALY_DUMP_FOLDER`) do not make the run a dump; the folder
    given itself may be one. The tools that read runs use it to point at ``trainprobe compare``."""
    if not path.is_dir():
        return False
    level = [path]
    for _ in range(depth + 1):
        if any((folder / name).is_file() for folder in level for name in ("dump.json", "debug.json")):
            return True
        level = [
            child
            for folder in level
            for child in _subfolders(folder)
            if child.name != ANOMALY_DUMP_FOLDER and not child.is_symlink()
        ]
    return False


def _subfolders(folder: Path) -> list[Path]:
    """The folders inside ``folder`` (none where it cannot be listed)."""
    try:
        return sorted(child for child in folder.iterdir() if child.is_dir())
    except OSError:
        return []
