"""``amp_skips.jsonl``: the steps a loss scaler skipped, one file per rank beside its data files
(Monitor V2: ``rank_<r>/amp_skips.jsonl``; Monitor V1: in the rank's run folder).

With fp16 and ``torch.amp.GradScaler`` the scaler calibrates its scale by overflowing: a step
whose scaled gradients hold inf/NaN is *skipped* (``optimizer.step()`` is not called, the scale
is lowered). Those rows carry inf on purpose; ``trainprobe diagnose`` and ``report`` read this
file to name such steps "skipped by GradScaler" instead of calling their inf an anomaly.

Format: JSON Lines, one object per skipped step, appended when the scaler skips::

    {"step": 0, "scale": 1048576.0}
    {"step": 1, "scale": 524288.0}

``step`` is the monitor's step (the rows' ``step``), ``scale`` the scale that overflowed (null
when it could not be read). Each line is written by one ``write()`` call on a file opened for
appending, so a process killed at any point leaves whole lines only (a reader ignores a last
line without its newline). A run started again at step ``s`` (resumed, or overwriting) first
drops the lines at or after ``s``. Standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainprobe.engine.jsonl import append_line, is_step, keep_before, read_lines
from trainprobe.engine.layout import V1_RUN, V2_RANK
from trainprobe.engine.log import warn_once

SKIP_FILE = "amp_skips.jsonl"


class SkipLog:
    """The skip file of one rank folder (see the module docstring). A failed write is logged
    once and turns the log off; training and the monitor's rows go on."""

    def __init__(self, path: Path, first_step: int) -> None:
        """Open ``path`` for appending; lines of an earlier run at or after ``first_step`` (and a
        torn last line, which would glue onto the next one) are dropped."""
        self.path = path
        self.enabled = True
        try:
            keep_before(path, first_step)
        except OSError as exc:
            self._fail(exc)

    def record(self, step: int, scale: float | None) -> None:
        """Append the line of a skipped ``step`` (one ``write()``: a kill leaves it whole or absent)."""
        if not self.enabled:
            return
        try:
            append_line(self.path, {"step": int(step), "scale": scale if scale is not None and math.isfinite(scale) else None})
        except OSError as exc:
            self._fail(exc)

    def _fail(self, exc: OSError) -> None:
        self.enabled = False
        warn_once(
            f"skip-log:{self.path}",
            f"trainprobe: {self.path}: GradScaler's skipped steps cannot be written ({exc}); "
            "diagnose will report their inf as anomalies",
        )


def read_skips(path: Path) -> list[tuple[int, float | None]]:
    """``(step, scale)`` of each whole line of the skip file ``path``, in file order; lines that
    are not such objects (and a torn last line) are left out. A missing file: []."""
    out: list[tuple[int, float | None]] = []
    for entry in read_lines(path):
        step: Any = entry.get("step")
        scale = entry.get("scale")
        if is_step(step):
            out.append((int(step), float(scale) if isinstance(scale, (int, float)) and not isinstance(scale, bool) else None))
    return out


def logged_watcher(
    watch: Callable[[Any, Callable[[], None]], Any], log: SkipLog, current_step: Callable[[], int]
) -> Callable[[Any, Callable[[], None]], Any]:
    """A skip watcher (``watch(optimizer, on_skip)``, the backend's ``watch_skipped_steps``)
    that also appends each skipped step (``current_step()`` when the skip is seen, before
    ``on_skip`` ends the step) and the scaler's scale (the handle's ``last_scale`` where it
    has one) to ``log``."""

    def watching(optimizer: Any, on_skip: Callable[[], None]) -> Any:
        handle: list[Any] = []

        def skipped() -> None:
            try:
                scale = getattr(handle[0], "last_scale", None) if handle else None
                log.record(current_step(), scale)
            finally:
                on_skip()

        handle.append(watch(optimizer, skipped))
        return handle[0]

    return watching


def run_skips(root: Path) -> dict[int, list[int]]:
    """Rank → the steps GradScaler skipped there, from the ``amp_skips.jsonl`` of each rank folder
    of ``root`` — Monitor V2's ``rank_<r>`` or Monitor V1's ``<stamp>-rank<r>-<id>`` (several V1
    folders of one rank: their steps together) — or of the rank folder ``root`` itself; ranks
    without skips left out."""
    found: dict[int, set[int]] = {}
    folders = [root] + (sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else [])
    for folder in folders:
        match = V2_RANK.fullmatch(folder.name) or V1_RUN.fullmatch(folder.name)
        path = folder / SKIP_FILE
        if match and path.is_file() and not path.is_symlink():
            steps = {step for step, _ in read_skips(path)}
            if steps:
                found.setdefault(int(match["rank"]), set()).update(steps)
    return {rank: sorted(steps) for rank, steps in found.items()}
