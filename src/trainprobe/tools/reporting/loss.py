"""The optional ``loss.csv`` beside a run: the loss (and learning rate, gradient norm) of a
training that has no training metrics, for the report's training curves.

Format: a CSV file with a header naming ``step`` and at least one of ``loss``, ``lr`` (or
``learning-rate``) and ``grad-norm``; one line per step, numbers as Python or C print them
(``nan``/``inf`` kept, an empty cell is no value). ``trainprobe demo`` writes one; your own loop
can too::

    with open(f"{output_dir}/loss.csv", "w") as f:
        f.write("step,loss\\n")
        for step, loss in enumerate(losses):
            f.write(f"{step},{loss!r}\\n")

Where: ``MONITOR_DIR/loss.csv`` (rank 0) and ``MONITOR_DIR/rank_<r>/loss.csv`` (rank r). A line
whose step is not an integer (a torn last line) is skipped and counted; a file without a
``step`` column or any known one is skipped with one warning: the file is optional, never an
error.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

import numpy as np

from trainprobe.engine.log import warn_once
from trainprobe.engine.safe_files import is_inside, is_regular_file
from trainprobe.tools.reporting.run import LOSS_KEYS, LR_KEYS, NORM_KEYS, Series, TrainingState, rank_of

LOSS_FILE = "loss.csv"
#: The columns drawn, as the training curves' panels name them (``lr`` and ``learning-rate`` both mean the learning rate).
KEYS = (*LOSS_KEYS, *LR_KEYS, *NORM_KEYS)
#: Bytes read of a ``loss.csv`` at most (a million steps of a few columns fit).
MAX_BYTES = 64 << 20


def find_loss_files(root: Path) -> list[tuple[int, Path]]:
    """(rank, file) of ``root/loss.csv`` (rank 0) and ``root/rank_<r>/loss.csv`` (rank r); the
    first per rank wins; links leading out of ``root`` are not read."""
    if not root.is_dir():
        return []
    found = [root / LOSS_FILE, *sorted(root.glob(f"rank*/{LOSS_FILE}"))]
    by_rank: dict[int, Path] = {}
    for path in found:
        if is_regular_file(path) and is_inside(path, root):
            by_rank.setdefault(rank_of(path.parent) if path.parent != root else 0, path)
    return sorted(by_rank.items())


def read_loss_files(files: list[tuple[int, Path]], state: TrainingState) -> None:
    """Add each file's columns of :data:`KEYS` to ``state.series`` (source ``loss.csv``) and the
    file to ``state.loss_files``; lines that are not a step are counted in ``state.skipped``."""
    for rank, path in files:
        read = _read(path)
        if read is None:
            continue
        columns, skipped = read
        state.loss_files.append(path)
        state.skipped += skipped
        for key, by_step in columns.items():
            if by_step:
                steps = np.array(sorted(by_step), dtype=np.int64)
                values = np.array([by_step[int(s)] for s in steps], dtype=np.float64)
                state.series.append(Series(key, LOSS_FILE, rank, steps, values))


def _read(path: Path) -> tuple[dict[str, dict[int, float]], int] | None:
    """The file's known columns (key → step → value) and its skipped lines; None (one warning)
    when it cannot be read or names no ``step`` and no known column."""
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_BYTES)
        text = raw.decode("utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        warn_once(f"loss:{path}", f"{path}: not read ({exc}); the training curves leave it out")
        return None
    lines = text.splitlines(keepends=True)
    torn = 1 if lines and not lines[-1].endswith(("\n", "\r")) and len(lines) > 1 else 0
    rows = list(csv.reader(io.StringIO("".join(lines[: len(lines) - torn]))))
    header = [name.strip() for name in rows[0]] if rows else []
    wanted = {name: i for i, name in enumerate(header) if name in KEYS}
    if "step" not in header or not wanted:
        warn_once(f"loss:{path}", f"{path}: no 'step' column and one of {', '.join(KEYS)}; left out")
        return None
    at = header.index("step")
    columns: dict[str, dict[int, float]] = {name: {} for name in wanted}
    skipped = torn
    for row in rows[1:]:
        step = _int(row[at]) if at < len(row) else None
        if step is None:
            skipped += 1
            continue
        for name, i in wanted.items():
            value = _float(row[i]) if i < len(row) else None
            if value is not None:
                columns[name][step] = value
    if skipped:
        warn_once(f"loss-skipped:{path}", f"{path}: skipped {skipped} line(s) without an integer step")
    return columns, skipped


def _int(text: str) -> int | None:
    try:
        return int(text.strip())
    except ValueError:
        return None


def _float(text: str) -> float | None:
    """A cell as float (``nan``/``inf`` kept); None when empty or not a number."""
    try:
        return float(text.strip())
    except ValueError:
        return None
