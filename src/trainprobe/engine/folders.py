"""Output folders: create one, or say in a :class:`ConfigError` which field names the unusable path.

Every front door creates its output folder through :func:`make_output_folder`, so a folder under
a file, an unwritable parent, a name too long or a NUL byte is reported the same way, at
construction or ``start()``, before any hook is attached. The writers create their folders (again, when one was removed
during training) through it too: there the :class:`ConfigError` is a fault of that output,
logged once in one line (:func:`one_line_fault`), and that monitor is disabled. A folder created only when its first
file is written (Monitor V1's ``anomaly_detected/rank<r>`` and ``module_struct/rank<r>``,
``random_save``'s folder) is checked at start with :func:`check_output_folder`, which creates
nothing and raises the error :func:`make_output_folder` would.

A rerun into the folders of an earlier run keeps that run: :func:`earlier_run_home` says where
its rank folder goes (``<output_dir>.1/rank_0``, then ``.2``, ...), and
:func:`~trainprobe.engine.folder_lock.move_aside` moves it there.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from trainprobe.engine.errors import ConfigError


def one_line_fault(exc: BaseException) -> bool:
    """Whether a fault during training is said in one line, without a traceback: an ``OSError``
    (disk full, permissions) or a :class:`ConfigError` (an output folder that became unusable,
    from :func:`make_output_folder`): its message says it all."""
    return isinstance(exc, (OSError, ConfigError))


def make_output_folder(path: str | Path, field: str) -> Path:
    """``path`` created (parents included) and writable, as a :class:`Path`.

    Args:
        path: the folder to create or reuse.
        field: the config field or environment variable that named it, for the message.

    Raises:
        ConfigError: the folder cannot be created or is not writable; the message names ``field``.
    """
    text, folder = _checked(path, field)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{field}: cannot create the output folder {text!r}: {exc.strerror or exc}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"{field}: the output folder {text!r} is not writable; choose another folder")
    return folder


def check_output_folder(path: str | Path, field: str) -> Path:
    """``path`` as a :class:`Path` when :func:`make_output_folder` could create it now (or it
    exists and is writable); nothing is created.

    Raises:
        ConfigError: as :func:`make_output_folder` would for ``path``: a NUL byte, a part of the
            path that is a file, a folder name too long, a nearest existing folder that is not
            writable; the message names ``field``.
    """
    text, folder = _checked(path, field)
    missing: list[str] = []
    existing = folder
    while not os.path.lexists(existing) and existing.parent != existing:
        missing.append(existing.name)
        existing = existing.parent
    if not missing and existing.is_dir():
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ConfigError(f"{field}: the output folder {text!r} is not writable; choose another folder")
        return folder
    problem = None
    if not existing.is_dir():
        dangling = os.path.islink(existing) and not existing.exists()  # mkdir finds the link: "exists"
        problem = errno.EEXIST if not missing or dangling else errno.ENOTDIR
    elif any(len(os.fsencode(name)) > _name_max(existing) for name in missing):
        problem = errno.ENAMETOOLONG
    elif not os.access(existing, os.W_OK | os.X_OK):
        problem = errno.EACCES
    if problem is not None:
        raise ConfigError(f"{field}: cannot create the output folder {text!r}: {os.strerror(problem)}")
    return folder


EARLIER_RUN = "earlier_run"
"""The folder an earlier run goes to when its run folder has no name of its own (``./``)."""


def earlier_run_home(rank_dir: Path) -> Path:
    """Where the earlier run's ``rank_dir`` (``<run>/<rank folder>``) is moved to keep it whole
    beside the new run: ``<run>.N/<rank folder>`` for the first N = 1, 2, ... where that does not
    exist yet, so that the ranks of one earlier run land in one ``<run>.N`` (each rank moves its
    own folder) and ``<run>.N`` is a run the tools read (``trainprobe diff <run>.1 <run>``).

    A run folder with no name of its own (``./``, ``..``: the reference's default ``output_dir``
    is ``./``) would put ``<run>.N`` outside it: there the home is ``<run>/earlier_run.N/<rank folder>``,
    which readers of ``<run>`` do not take for a rank folder.
    """
    run, name = rank_dir.parent, rank_dir.name
    n = 1
    while True:
        if run.name in ("", ".", ".."):
            home = run / f"{EARLIER_RUN}.{n}" / name
        else:
            home = run.with_name(f"{run.name}.{n}") / name
        if not os.path.lexists(home):
            return home
        n += 1


def _checked(path: str | Path, field: str) -> tuple[str, Path]:
    """``(str(path), Path(path))``; a NUL byte is a ConfigError naming ``field``."""
    text = str(path)
    if "\0" in text:
        raise ConfigError(f"{field}: {text!r} contains a NUL byte; pass a folder path")
    return text, Path(path)


def _name_max(folder: Path) -> int:
    """The longest file name (bytes) the file system of ``folder`` takes (255 where it cannot say)."""
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255
