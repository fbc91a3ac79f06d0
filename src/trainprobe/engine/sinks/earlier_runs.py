"""What an earlier run left in a Monitor V2 rank folder, and making room for this run.

A rank folder ``<output_dir>/rank_<r>/`` holds window files ``<table>_step<first>-<last>.csv``,
or ``.parquet`` with ``"format": "parquet"`` (:data:`trainprobe.engine.layout.V2_DATA_FILE`);
the rule below is the same for both formats, and for a folder holding both. A new run writing into a folder that already
holds such files would mix two runs (a window file of the new run replaces the earlier run's
file of the same name; readers then see one run made of two). Monitor V2 therefore
asks, at ``start()``, what the user wants (``docs/monitor_v2.md``, "Re-using an output folder"):

* nothing said (a new run): the earlier run is kept whole, the rank folder moved to
  ``<output_dir>.1/rank_<r>`` (:func:`~trainprobe.engine.folder_lock.move_aside`; also when the
  folder holds only the hidden ``.partial`` file a killed Parquet run was writing);
* ``start(overwrite=True)`` or ``TRAINPROBE_OVERWRITE=1``: :func:`keep_rows_before` with step 0
  removes the earlier run's window files (only those, and the hidden ``.partial`` windows a
  killed Parquet run left open (:func:`open_windows`): nothing else in the folder is touched);
* ``start(initial_step=N)`` with N > 0 (a resumed run): :func:`keep_rows_before` with step N
  keeps the earlier rows of steps below N and drops the rest, the way TensorBoard's
  ``purge_step`` does, so the resumed run continues the files instead of repeating steps (first
  the step files a Parquet run killed in the middle of merging a window left beside the merged
  file are removed, :func:`drop_merged_step_files`, so no row is kept twice).

A run that is still going is never "an earlier run": it holds the folder's lock
(:mod:`~trainprobe.engine.folder_lock`) and the new one is refused before this rule is asked.

Every rewrite goes through :func:`~trainprobe.engine.sinks.files.write_atomically` (CSV) or a
temporary file renamed into place (Parquet): a process killed while making room leaves each file
whole, old or new. A Parquet file rewritten keeps its columns and carries a summary that is
true of its remaining rows (:mod:`~trainprobe.engine.sinks.parquet_summary`); rewriting one
needs pyarrow (which wrote it).
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainprobe.engine.layout import PARQUET_SUFFIX, V2_DATA_FILE
from trainprobe.engine.sinks.files import write_atomically
from trainprobe.engine.sinks.parquet_sink import merged_step_files
from trainprobe.engine.sinks.parquet_summary import SUMMARY_KEY, Summary, encode, read_summary

OVERWRITE_ENV = "TRAINPROBE_OVERWRITE"


@dataclass(frozen=True, slots=True)
class WindowFile:
    """One window file: ``weight_grad_step0-9.csv`` (or ``.parquet``) is table ``weight_grad``,
    steps 0 to 9."""

    path: Path
    table: str
    first: int
    last: int


def window_files(rank_dir: Path, tables: Iterable[str]) -> list[WindowFile]:
    """The regular files of ``rank_dir`` named like a window file of one of ``tables``, sorted."""
    wanted = set(tables)
    found = []
    for path in _entries(rank_dir):
        match = V2_DATA_FILE.fullmatch(path.name)
        if match and match["type"] in wanted and path.is_file() and not path.is_symlink():
            found.append(WindowFile(path, match["type"], int(match["first"]), int(match["last"])))
    return found


def open_windows(rank_dir: Path, tables: Iterable[str]) -> list[Path]:
    """The hidden ``.<window file>.partial`` files of ``tables`` in ``rank_dir``: windows a killed
    Parquet run left open (no reader picks them up; their rows were never complete)."""
    wanted = set(tables)
    found = []
    for path in _entries(rank_dir):
        inner = path.name[1 : -len(".partial")] if path.name.startswith(".") and path.name.endswith(".partial") else ""
        match = V2_DATA_FILE.fullmatch(inner)
        if match and match["type"] in wanted and path.is_file() and not path.is_symlink():
            found.append(path)
    return found


def _entries(rank_dir: Path) -> list[Path]:
    """The entries of ``rank_dir``, sorted; none when it cannot be listed (missing: a first run)."""
    try:
        return sorted(rank_dir.iterdir())
    except OSError:
        return []


def overwrite_requested() -> bool:
    """Whether ``TRAINPROBE_OVERWRITE`` asks to replace an earlier run (``1``, ``true``, ``yes``)."""
    return os.environ.get(OVERWRITE_ENV, "").strip().lower() in ("1", "true", "yes")


def drop_merged_step_files(files: list[WindowFile]) -> list[WindowFile]:
    """Remove the step files of ``files`` whose rows a merged window file beside them holds
    (:func:`~trainprobe.engine.sinks.parquet_sink.merged_step_files`: left by a Parquet run killed
    between a window's merge and their removal); return the files left.

    Raises:
        OSError: such a file cannot be removed.
    """
    merged = set(merged_step_files((f.path, f.table, f.first, f.last) for f in files))
    for path in sorted(merged):
        path.unlink()
    return [f for f in files if f.path not in merged]


def keep_rows_before(files: list[WindowFile], step: int, name_file: Callable[[str, int, int], str]) -> int:
    """Drop every row of step ``step`` or later from ``files``; return how many rows went.

    A file whose window starts at ``step`` or later is removed; a file whose window straddles
    ``step`` is rewritten (atomically) with its earlier rows and renamed to end at the last step
    it still holds (``name_file`` gives the CSV name; a Parquet file keeps its suffix); a file
    with no row left is removed.

    Raises:
        OSError: a file cannot be read, rewritten or removed (a Parquet file to rewrite without
            pyarrow installed included).
    """
    dropped = 0
    for window in files:
        if window.first >= step:
            dropped += _count_rows(window.path)
            window.path.unlink()
        elif window.last >= step:
            dropped += _cut_at(window, step, name_file)
    return dropped


def _count_rows(path: Path) -> int:
    if path.suffix == PARQUET_SUFFIX:
        summary = read_summary(path)
        return summary.rows if summary is not None else int(_parquet().read_metadata(str(path)).num_rows)
    with path.open(newline="", encoding="utf-8", errors="replace") as handle:
        return max(0, sum(1 for _ in csv.reader(handle)) - 1)


def _cut_at(window: WindowFile, step: int, name_file: Callable[[str, int, int], str]) -> int:
    """Rewrite ``window`` with its rows of steps below ``step``; return the rows dropped."""
    if window.path.suffix == PARQUET_SUFFIX:
        return _cut_parquet_at(window, step, name_file)
    with window.path.open(newline="", encoding="utf-8", errors="replace") as handle:
        records = list(csv.reader(handle))
    if not records or "step" not in records[0]:
        return 0  # not a table trainprobe wrote: left alone
    column = records[0].index("step")
    kept = [r for r in records[1:] if len(r) > column and r[column].isdigit() and int(r[column]) < step]
    dropped = len(records) - 1 - len(kept)
    if not kept:
        window.path.unlink()
        return dropped
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows([records[0], *kept])
    last = max(int(r[column]) for r in kept)
    target = window.path.with_name(name_file(window.table, window.first, last))
    write_atomically(target, text.getvalue())
    if target != window.path:
        window.path.unlink()
    return dropped


def _parquet() -> Any:
    """``pyarrow.parquet``, or OSError saying it is needed (the caller reports OSError)."""
    try:
        import pyarrow.parquet
    except ImportError:
        raise OSError("rewriting an earlier run's Parquet file needs pyarrow: pip install 'trainprobe[query]'") from None
    return pyarrow.parquet


def _cut_parquet_at(window: WindowFile, step: int, name_file: Callable[[str, int, int], str]) -> int:
    """:func:`_cut_at` for a Parquet file: its rows of steps below ``step`` written to a
    temporary file renamed into place, with a summary true of them."""
    pq = _parquet()
    import pyarrow.compute as pc

    try:
        table = pq.read_table(str(window.path))
    except Exception as exc:  # noqa: BLE001 - pyarrow raises its own types for a damaged file
        raise OSError(f"{window.path}: cannot read it as Parquet ({exc})") from None
    if "step" not in table.column_names:
        return 0  # not a table trainprobe wrote: left alone
    kept = table.filter(pc.less(table.column("step"), step))
    dropped = int(table.num_rows - kept.num_rows)
    if not kept.num_rows:
        window.path.unlink()
        return dropped
    before = read_summary(window.path)
    metadata = {k: v for k, v in (table.schema.metadata or {}).items() if k != SUMMARY_KEY.encode()}
    if before is not None:  # the first non-finite step stays if it is kept; else none is left
        first_bad = before.first_bad_step if before.first_bad_step is not None and before.first_bad_step < step else None
        metadata[SUMMARY_KEY.encode()] = encode(Summary(first_bad, tuple(kept.column_names), kept.num_rows)).encode()
    kept = kept.replace_schema_metadata(metadata)
    last = pc.max(kept.column("step")).as_py()
    target = window.path.with_name(name_file(window.table, window.first, last)).with_suffix(PARQUET_SUFFIX)
    partial = target.with_name(f".{target.name}.partial")
    try:
        pq.write_table(kept, str(partial))
        os.replace(partial, target)
    finally:
        if partial.exists():
            partial.unlink()
    if target != window.path:
        window.path.unlink()
    return dropped
