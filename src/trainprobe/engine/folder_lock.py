"""One live run per output folder: an exclusive lock on the folder while a run writes into it.

Two runs appending to one file at once interleave their lines (steps 8, 1, 9, 2, ...) and lose
some of them, silently. :class:`FolderLock` takes an exclusive, non-blocking ``flock`` on the
folder itself (no lock file is left behind): a second run, in another process or in the same
one, is refused with a :class:`ConfigError` naming the config field. The kernel drops the lock
when its holder ends, however it ends (a ``SIGKILL`` included), so a dead run never blocks the
next one: there is no stale lock to take over.

A rerun into an earlier (ended) run's folder keeps that run: :func:`move_aside` renames the
folder to :func:`~trainprobe.engine.folders.earlier_run_home` (``<output_dir>.1/rank_0``), makes
it anew, empty, and moves this process's lock on it to the new folder, saying so in one line.

A forked child (a DataLoader worker) does not keep the lock: its copy of the descriptor is
closed right after the fork, so the folder is free once the run that took it closes, whatever
its workers do.

Where locks are not available (Windows; a file system that refuses ``flock`` on a folder, as some
network file systems do) one warning says so and the run goes on unlocked.

Who takes it: Monitor V2 on its ``rank_<r>`` folder and Monitor V1 on its run folder, from
``start()`` / ``set_monitor`` to ``stop()`` (whatever the format: CSV, Parquet, TensorBoard), and
the training metrics on ``dump_path`` and ``tensorboard_dir``. A tool that must know whether a
run is still writing a folder asks :func:`live_writer` (a shared lock taken for an instant and
dropped: a run starting at that instant retries for ``wait_s``, a quarter second, before it
calls the folder taken, so a look never refuses a run), or holds :func:`reading` while it works
on the folder (``trainprobe convert``): its shared lock keeps a new run from starting to write
there meanwhile (refused, with the message saying a convert may be the holder).
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.folders import earlier_run_home, make_output_folder
from trainprobe.engine.log import logger, warn_once

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]


_HELD: weakref.WeakSet[FolderLock] = weakref.WeakSet()


def _forget_in_child() -> None:
    """After a fork, in the child: close the inherited descriptors (never ``LOCK_UN``, which would
    release the parent's lock too)."""
    for lock in list(_HELD):
        fd, lock._fd = lock._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


class FolderLock:
    """An exclusive lock on ``folder``, held until :meth:`release` (or until the process ends).

    Args:
        folder: an existing folder the run writes into.
        field: the config field that named it, for the message (``monitor_config.dump_path``).
        wait_s: how long a lock held by someone else is retried before the folder counts as taken
            (covers :func:`live_writer`'s instant look; a live run holds it for good).

    Raises:
        ConfigError: another live run holds the folder; the message names ``field`` and the folder.
    """

    def __init__(self, folder: Path, field: str, wait_s: float = 0.25) -> None:
        self.folder = folder
        self._fd: int | None = None
        if fcntl is None:  # pragma: no cover - Windows
            warn_once("folder-lock-none", "trainprobe: no file locks on this platform; output folders are not locked")
            return
        try:
            fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            warn_once(f"folder-lock-{folder}", f"trainprobe: {field}: cannot lock {str(folder)!r} ({exc}); not locked")
            return
        self._fd = _exclusive(fd, folder, field, wait_s)
        if self._fd is not None:
            _HELD.add(self)

    @property
    def held(self) -> bool:
        """Whether the lock is held (False after :meth:`release`, or where locks are unavailable)."""
        return self._fd is not None

    def holds(self, folder: Path) -> bool:
        """Whether this lock is held on the folder now at ``folder`` (the same folder, not a name)."""
        if self._fd is None:
            return False
        try:
            mine, there = os.fstat(self._fd), os.stat(folder)
        except OSError:
            return False
        return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)

    def follow(self, folder: Path, field: str) -> None:
        """Hold the lock on ``folder`` (a new folder at this lock's path) instead of the one held.

        Raises:
            ConfigError: another live run took ``folder`` first (as :class:`FolderLock`); the
                old lock is dropped either way.
        """
        old, self._fd = self._fd, None
        _HELD.discard(self)
        try:
            replacement = FolderLock(folder, field, wait_s=0)
        finally:
            if old is not None:
                os.close(old)
        self._fd, replacement._fd = replacement._fd, None
        _HELD.discard(replacement)
        if self._fd is not None:
            _HELD.add(self)

    def release(self) -> None:
        """Drop the lock (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the last descriptor drops the flock

    def __del__(self) -> None:
        self.release()


def _exclusive(fd: int, folder: Path, field: str, wait_s: float) -> int | None:
    """``fd`` (an open folder) once it holds the exclusive lock; None (closed, one warning) where
    the file system refuses locks.

    Raises:
        ConfigError: a live run holds the folder (``fd`` closed).
    """
    try:
        _lock_within(fd, fcntl.LOCK_EX, wait_s)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(
            f"{field}: {str(folder)!r} is being written by another run that is still going (in this or "
            f"another process), or read by a trainprobe convert; two runs writing one folder interleave and "
            f"lose lines. Give this run another {field.rsplit('.', 1)[-1]}, or close the other run first"
        ) from None
    except OSError as exc:
        os.close(fd)
        warn_once(f"folder-lock-{folder}", f"trainprobe: {field}: cannot lock {str(folder)!r} ({exc}); not locked")
        return None
    return fd


def move_aside(folder: Path, field: str) -> Path:
    """Keep the earlier run in ``folder`` (one rank's folder, which no live run holds) by moving it
    to :func:`~trainprobe.engine.folders.earlier_run_home`, make ``folder`` anew and empty, and
    return where the earlier run went. A :class:`FolderLock` this process holds on ``folder``
    holds the new folder afterwards. One INFO line says it:
    ``trainprobe: out/rank_0 holds an earlier run; it was moved to out.1/rank_0``.

    Raises:
        ConfigError: the folder cannot be moved or made anew (a read-only parent, another file
            system); the message names ``field`` and the ways out. Another live run took the new
            folder at that instant (as :class:`FolderLock`).
    """
    home = earlier_run_home(folder)
    held = [lock for lock in list(_HELD) if lock.holds(folder)]
    try:
        make_output_folder(home.parent, field)
        os.rename(folder, home)
    except (OSError, ConfigError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(
            f"{field}: {str(folder)!r} holds an earlier run, which could not be moved to {str(home)!r} to keep it "
            f"({reason}); choose another {field.rsplit('.', 1)[-1]}, move or delete that run, or pass overwrite "
            "to replace it"
        ) from None
    make_output_folder(folder, field)
    for lock in held:
        lock.follow(folder, field)
    logger.info("trainprobe: %s holds an earlier run; it was moved to %s", folder, home)
    return home


def _lock_within(fd: int, kind: int, wait_s: float) -> None:
    """``flock(fd, kind)`` without blocking, retried for ``wait_s`` seconds (BlockingIOError after)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.01)


def live_writer(folder: Path) -> bool | None:
    """Whether a live run holds ``folder`` (a :class:`FolderLock` of a process that is still going).

    Returns True when one does, False when none does (a run that ended, or was killed: the
    kernel dropped its lock), None when it cannot be told (no locks on this platform or file
    system, or the folder cannot be opened). The look takes a shared lock for an instant and
    drops it (see the module docstring): it never blocks and never leaves anything behind.
    """
    with reading(folder) as live:
        return live


@contextmanager
def reading(folder: Path) -> Iterator[bool | None]:
    """``with reading(folder) as live:`` whether a live run holds ``folder`` (as
    :func:`live_writer` says), and, while the block runs and no live run holds it, a shared lock
    on it: a run that starts meanwhile is refused (:class:`FolderLock`), so the folder's files
    stay as the block found them. Several readers hold it at once. Never blocks."""
    if fcntl is None:  # pragma: no cover - Windows
        yield None
        return
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        yield None
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            live: bool | None = False
        except BlockingIOError:
            live = True
        except OSError:
            live = None
        yield live
    finally:
        os.close(fd)  # drops the shared lock, if taken
