"""What an earlier run left in a Monitor V2 rank folder, and making room for this run.

A rank folder ``<output_dir>/rank_<r>/`` holds window files ``<table>_step<first>-<last>.csv``
(:data:`trainprobe.engine.layout.V2_FILE`). A new run writing into a folder that already
holds such files would mix two runs (a file renamed at the end of a short window replaces an
earlier run's file of the same name; readers then see one run made of two). Monitor V2 therefore
asks, at ``start()``, what the user wants (``docs/monitor_v2.md``, "Re-using an output folder"):

* nothing said: :func:`refuse_earlier_run` raises a :class:`ConfigError` naming the folder;
* ``start(overwrite=True)`` or ``TRAINPROBE_OVERWRITE=1``: :func:`keep_rows_before` with step 0
  removes the earlier run's window files (only those: nothing else in the folder is touched);
* ``start(initial_step=N)`` with N > 0 (a resumed run): :func:`keep_rows_before` with step N
  keeps the earlier rows of steps below N and drops the rest, the way TensorBoard's
  ``purge_step`` does, so the resumed run continues the files instead of repeating steps.

Every rewrite goes through :func:`~trainprobe.engine.sinks.files.write_atomically`: a process killed
while making room leaves each file whole, old or new.
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.layout import V2_FILE
from trainprobe.engine.sinks.files import write_atomically

OVERWRITE_ENV = "TRAINPROBE_OVERWRITE"


@dataclass(frozen=True, slots=True)
class WindowFile:
    """One window file: ``weight_grad_step0-9.csv`` is table ``weight_grad``, steps 0 to 9."""

    path: Path
    table: str
    first: int
    last: int


def window_files(rank_dir: Path, tables: Iterable[str]) -> list[WindowFile]:
    """The regular files of ``rank_dir`` named like a window file of one of ``tables``, sorted."""
    wanted = set(tables)
    found = []
    try:
        entries = sorted(rank_dir.iterdir())
    except OSError:
        return []
    for path in entries:
        match = V2_FILE.fullmatch(path.name)
        if match and match["type"] in wanted and path.is_file() and not path.is_symlink():
            found.append(WindowFile(path, match["type"], int(match["first"]), int(match["last"])))
    return found


def overwrite_requested() -> bool:
    """Whether ``TRAINPROBE_OVERWRITE`` asks to replace an earlier run (``1``, ``true``, ``yes``)."""
    return os.environ.get(OVERWRITE_ENV, "").strip().lower() in ("1", "true", "yes")


def refuse_earlier_run(rank_dir: Path, files: list[WindowFile]) -> ConfigError:
    """The error for a new run started over an earlier one's files, saying the ways out."""
    shown = ", ".join(f.path.name for f in files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    return ConfigError(
        f"output_dir: {str(rank_dir)!r} already holds the files of an earlier run ({shown}); a new run there "
        "would mix with them. Choose another output_dir, delete those files, pass start(overwrite=True) "
        f"(or set {OVERWRITE_ENV}=1) to replace them, or start(initial_step=N) to continue a resumed run "
        "at step N (earlier rows of steps >= N are dropped)"
    )


def keep_rows_before(files: list[WindowFile], step: int, name_file: Callable[[str, int, int], str]) -> int:
    """Drop every row of step ``step`` or later from ``files``; return how many rows went.

    A file whose window starts at ``step`` or later is removed; a file whose window straddles
    ``step`` is rewritten (atomically) with its earlier rows and renamed to end at the last step
    it still holds; a file with no row left is removed.

    Raises:
        OSError: a file cannot be read, rewritten or removed.
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
    with path.open(newline="", encoding="utf-8", errors="replace") as handle:
        return max(0, sum(1 for _ in csv.reader(handle)) - 1)


def _cut_at(window: WindowFile, step: int, name_file: Callable[[str, int, int], str]) -> int:
    """Rewrite ``window`` with its rows of steps below ``step``; return the rows dropped."""
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
