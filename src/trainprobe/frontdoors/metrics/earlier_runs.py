"""What an earlier training-metrics run left in ``<tensorboard_dir>/rank_<r>/`` (event files) or
``<dump_path>/rank_<r>/`` (``training_state.jsonl``), and what a new run does about it: Monitor
V2's rule (:mod:`trainprobe.engine.sinks.earlier_runs`).

TensorBoard reads every event file of a folder as one run: a second run from step 0 into the
same folder shows its loss as steps ``1, 2, 3, 1, 2, 3``. So, at construction:

* the folder holds no event file (no ``training_state.jsonl`` line): nothing to do;
* a run resumed after N steps (``initial_step=N`` > 0; the trainer callbacks pass the trainer's
  global step): the earlier files stay, and the new file's ``purge_step`` N+1 tells TensorBoard to
  hide the earlier run's events from step N+1 on (see :mod:`~trainprobe.frontdoors.metrics.outputs`);
* overwrite asked for (``tensorboard.overwrite: true``, ``TrainingMetricsMonitor(overwrite=True)``
  or ``TRAINPROBE_OVERWRITE=1``): the earlier event files (only those) are removed (the dump's
  ``training_state.jsonl`` is started anew);
* otherwise (a new run from step 0): the earlier run is kept whole, its rank folder moved to
  ``<tensorboard_dir>.1/rank_<r>`` (``.2``, ... when taken; :func:`~trainprobe.engine.folder_lock.move_aside`),
  said in one line, and this run writes into a new, empty ``rank_<r>``. ``tensorboard
  --logdir <tensorboard_dir>`` shows this run; ``--logdir .`` shows both, side by side.
"""

from __future__ import annotations

from pathlib import Path

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.folder_lock import move_aside
from trainprobe.engine.log import logger
from trainprobe.frontdoors.metrics.outputs import DUMP_FILE

EVENTS_PREFIX = "events.out.tfevents."


def event_files(folder: Path) -> list[Path]:
    """The regular files of ``folder`` named like TensorBoard event files, sorted."""
    try:
        entries = sorted(folder.iterdir())
    except OSError:
        return []
    return [p for p in entries if p.name.startswith(EVENTS_PREFIX) and p.is_file() and not p.is_symlink()]


def make_room_for_events(folder: Path, *, resumed: bool, overwrite: bool, field: str) -> None:
    """Apply the module docstring's rule to the rank folder ``folder`` (``field`` names it).

    Raises:
        ConfigError: an earlier file cannot be removed, or the earlier run cannot be moved aside
            (:func:`~trainprobe.engine.folder_lock.move_aside`).
    """
    files = event_files(folder)
    if not files and not _has_lines(folder / DUMP_FILE):
        return
    if overwrite:
        for path in files:
            try:
                path.unlink()
            except OSError as exc:
                raise ConfigError(f"{field}: cannot remove the earlier run's {str(path)!r}: {exc}") from None
        if files:
            logger.info("trainprobe: %s: %d event files of an earlier run removed (overwrite)", folder, len(files))
        return
    if not resumed:
        move_aside(folder, field)


def _has_lines(path: Path) -> bool:
    """Whether ``path`` is a regular file with something in it."""
    try:
        return path.is_file() and not path.is_symlink() and path.stat().st_size > 0
    except OSError:
        return False
