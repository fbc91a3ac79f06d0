"""Small file helpers shared by sinks and probes."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_json_atomically(
    path: Path, data: Any, indent: int | None = 2, default: Callable[[Any], Any] | None = None
) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file and ``os.replace``, so a reader
    (or a killed process) never sees a half-written file. Creates the parent folder. A failed
    write (disk full) removes the temporary file and leaves ``path`` as it was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    text = json.dumps(data, indent=indent, default=default)
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


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
