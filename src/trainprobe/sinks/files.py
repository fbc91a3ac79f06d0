"""Small file helpers shared by sinks and probes."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any


def write_json_atomically(path: Path, data: Any, indent: int = 2) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file and ``os.replace``, so a reader
    (or a killed process) never sees a half-written file. Creates the parent folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=indent), encoding="utf-8")
    os.replace(tmp, path)


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
