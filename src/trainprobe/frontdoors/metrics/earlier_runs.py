"""What an earlier training-metrics run left in ``<tensorboard_dir>/rank_<r>/``, and what a new
run does about it: Monitor V2's rule (:mod:`trainprobe.engine.sinks.earlier_runs`) for event files.

TensorBoard reads every event file of a folder as one run: a second run from step 0 into the
same folder shows its loss as steps ``1, 2, 3, 1, 2, 3``. So, at construction:

* the folder holds no event file: nothing to do;
* a run resumed after N steps (``initial_step=N`` > 0; the trainer callbacks pass the trainer's
  global step): the earlier files stay, and the new file's ``purge_step`` N+1 tells TensorBoard to
  hide the earlier run's events from step N+1 on (see :mod:`~trainprobe.frontdoors.metrics.outputs`);
* overwrite asked for (``tensorboard.overwrite: true``, ``TrainingMetricsMonitor(overwrite=True)``
  or ``TRAINPROBE_OVERWRITE=1``): the earlier event files (only those) are removed;
* otherwise: :func:`make_room_for_events` raises a :class:`ConfigError` naming
  ``tensorboard.tensorboard_dir`` and the ways out.
"""

from __future__ import annotations

from pathlib import Path

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.log import logger
from trainprobe.engine.sinks.earlier_runs import OVERWRITE_ENV

EVENTS_PREFIX = "events.out.tfevents."


def event_files(folder: Path) -> list[Path]:
    """The regular files of ``folder`` named like TensorBoard event files, sorted."""
    try:
        entries = sorted(folder.iterdir())
    except OSError:
        return []
    return [p for p in entries if p.name.startswith(EVENTS_PREFIX) and p.is_file() and not p.is_symlink()]


def make_room_for_events(folder: Path, *, resumed: bool, overwrite: bool) -> None:
    """Apply the module docstring's rule to the rank folder ``folder``.

    Raises:
        ConfigError: earlier event files, a run from step 0 and no overwrite; or an earlier file
            cannot be removed.
    """
    files = event_files(folder)
    if not files:
        return
    if overwrite:
        for path in files:
            try:
                path.unlink()
            except OSError as exc:
                raise ConfigError(
                    f"tensorboard.tensorboard_dir: cannot remove the earlier run's {str(path)!r}: {exc}"
                ) from None
        logger.info("trainprobe: %s: %d event files of an earlier run removed (overwrite)", folder, len(files))
        return
    if resumed:
        return
    shown = ", ".join(p.name for p in files[:2]) + (f" and {len(files) - 2} more" if len(files) > 2 else "")
    raise ConfigError(
        f"tensorboard.tensorboard_dir: {str(folder)!r} already holds the event files of an earlier run ({shown}); "
        "TensorBoard would show both runs as one (steps 1, 2, 3, 1, 2, 3). Choose another tensorboard_dir, delete "
        "those files, set tensorboard.overwrite: true (or pass TrainingMetricsMonitor(overwrite=True), or set "
        f"{OVERWRITE_ENV}=1) to replace them, or pass initial_step=N to continue a run resumed after step N "
        "(TensorBoard then hides the earlier run's events after step N)"
    )
