"""Small file helpers shared by sinks and probes."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from trainprobe.engine.folders import make_output_folder


def write_atomically(
    path: Path,
    data: str | bytes | Callable[[BinaryIO], None],
    unless: Callable[[], bool] | None = None,
    field: str = "output folder",
) -> bool:
    """Write ``path`` whole or not at all: ``data`` (text is UTF-8 encoded, or a function writing
    into the binary file it is given) goes into a new temporary file created with a random name
    and ``O_EXCL`` in ``path``'s folder (``tempfile.mkstemp``: nothing planted there, such as a
    symbolic link, is ever followed or overwritten), is flushed to disk (``fsync``), gets the
    permissions a plain new file would get (``0o666`` less the umask), and then replaces ``path``
    with ``os.replace`` (a symbolic link at ``path`` itself is replaced, not followed). A reader,
    or a killed process, sees the old file or the new one, never half of one. Creates the parent
    folder with :func:`~trainprobe.engine.folders.make_output_folder` (a ConfigError naming
    ``field`` when it cannot be). On any failure the temporary file is removed, ``path`` is left as it was and the
    error is raised.

    Every temporary-file-then-rename writer of trainprobe calls this one function.

    Args:
        unless: checked after the data is on disk, just before the replace; when it returns
            True the temporary file is removed and ``path`` left alone.

    Returns:
        Whether ``path`` was replaced (False only when ``unless`` said so).
    """
    make_output_folder(path.parent, field)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            if callable(data):
                data(handle)
            else:
                handle.write(data.encode("utf-8") if isinstance(data, str) else data)
            handle.flush()
            os.fchmod(handle.fileno(), 0o666 & ~_umask())
            os.fsync(handle.fileno())
        if unless is not None and unless():
            os.unlink(name)
            return False
        os.replace(name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(name)
        raise
    return True


def _umask() -> int:
    """The process umask, read without changing it where Linux tells it (``/proc/self/status``;
    setting and restoring it is not thread-safe), else by setting and restoring it."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/self/status", encoding="ascii") as status:
            return int(next(line for line in status if line.startswith("Umask:")).split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_json_atomically(
    path: Path,
    data: Any,
    indent: int | None = 2,
    default: Callable[[Any], Any] | None = None,
    field: str = "output folder",
) -> None:
    """Write ``data`` as JSON to ``path`` with :func:`write_atomically`, so a reader (or a killed
    process) never sees a half-written file. Creates the parent folder. A failed write (disk
    full) removes the temporary file and leaves ``path`` as it was."""
    write_atomically(path, json.dumps(data, indent=indent, default=default), field=field)


def append_whole(fd: int, data: bytes) -> None:
    """Append ``data`` to ``fd`` whole or not at all: a write that fails part-way (disk full,
    file size limit) is cut back with ``ftruncate`` to where it began, so the file keeps whole
    lines (rows) only; the ``OSError`` is raised for the caller to report."""
    start = os.lseek(fd, 0, os.SEEK_END)
    view = memoryview(data)
    try:
        while view:
            written = os.write(fd, view)
            view = view[written:]
    except OSError:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, start)
        raise
