"""Small JSON Lines files beside a run's data files (``amp_skips.jsonl``, ``anomaly_events.jsonl``).

One object per line, appended by one ``write()`` call on a file opened for appending, so a
process killed at any point leaves whole lines only: a reader ignores a last line without its
newline. A run started again at step ``s`` first drops the lines at or after ``s``
(:func:`keep_before`). Standard library only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

MAX_BYTES = 64 << 20
"""A file larger than this is read only up to here."""


def append_line(path: Path, entry: dict[str, Any]) -> None:
    """Append ``entry`` as one line (one ``write()``: a kill leaves it whole or absent).

    Raises:
        OSError: the file cannot be opened or written (the caller reports it once).
    """
    line = json.dumps(entry, allow_nan=False, default=str) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def read_lines(path: Path) -> list[dict[str, Any]]:
    """The objects of each whole line of ``path``, in file order; lines that are not JSON objects
    (and a torn last line) are left out. A missing file: []."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_BYTES)
    except FileNotFoundError:
        return []
    out = []
    for raw in data.split(b"\n")[:-1]:  # the part after the last newline is torn (or empty)
        try:
            entry = json.loads(raw)
        except ValueError:
            continue
        if isinstance(entry, dict):
            out.append(entry)
    return out


def is_step(value: Any) -> bool:
    """Whether a line's ``step`` is one (an integer >= 0, not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def keep_before(path: Path, first_step: int) -> None:
    """Drop the lines whose ``step`` is ``first_step`` or later (a run starting again there), those
    without a step, and a torn last line, rewriting the file atomically; nothing when there is nothing to drop.

    Raises:
        OSError: the file cannot be read or rewritten.
    """
    if not path.exists():
        return
    entries = read_lines(path)
    kept = [e for e in entries if is_step(e.get("step")) and e["step"] < first_step]
    torn = path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n")
    if len(kept) < len(entries) or torn:
        from trainprobe.engine.sinks.files import write_atomically

        write_atomically(path, "".join(json.dumps(e, default=str) + "\n" for e in kept))
