"""The files of one step of one rank: ``dump_path/step{N}/rank{R}|proc{pid}/``.

``dump.json`` (or ``debug.json`` at level debug), ``stack.json`` and ``construct.json`` are held
in memory and written atomically (temporary file + ``os.replace``) by :meth:`StepStore.flush`, so a
crash never leaves half a JSON file. ``dump_tensor_data/<name>.pt`` files are written as each op
finishes (``torch.save`` of a detached CPU copy, loadable with ``weights_only=True``); with
``async_dump`` they are written by a background thread from copies taken at once.
``dump_error_info.log`` collects dump errors, one line each.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

import torch

from trainprobe.dump.entries import resolve
from trainprobe.log import error_once


def write_json_atomically(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` via a temporary file and ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(data), encoding="utf-8")  # no indent: the C encoder, ~10x faster
    os.replace(tmp, path)


class TensorFileWriter:
    """Saves ``.pt`` files, synchronously or on one daemon thread (``async_write``)."""

    def __init__(self, async_write: bool) -> None:
        self.async_write = async_write
        self.bytes_written = 0
        self._queue: queue.Queue[tuple[Path, torch.Tensor] | None] | None = None
        self._thread: threading.Thread | None = None

    def save(self, path: Path, tensor: torch.Tensor) -> None:
        """Save a copy of ``tensor`` (detached, contiguous, on the CPU) to ``path``."""
        copy = tensor.detach()
        copy = copy.to("cpu", copy=True) if copy.device.type != "cpu" else copy.clone()
        if not self.async_write:
            self._write(path, copy)
            return
        if self._thread is None:
            self._queue = queue.Queue(maxsize=256)
            self._thread = threading.Thread(target=self._drain, name="trainprobe-dump-writer", daemon=True)
            self._thread.start()
        assert self._queue is not None
        self._queue.put((path, copy))

    def _write(self, path: Path, tensor: torch.Tensor) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(tensor, path)
        self.bytes_written += tensor.numel() * tensor.element_size()

    def _drain(self) -> None:
        assert self._queue is not None
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception:  # noqa: BLE001 - a dump error never reaches training
                error_once("dump-async-write", "trainprobe dump: writing a tensor file failed")
            finally:
                self._queue.task_done()

    def wait(self) -> None:
        """Block until every queued file is written."""
        if self._queue is not None:
            self._queue.join()


class StepStore:
    """In-memory JSON content of one step of one rank, and its files."""

    def __init__(self, rank_dir: Path, header: dict[str, Any], files: TensorFileWriter, *, debug: bool = False) -> None:
        self.rank_dir = rank_dir
        self.header = header
        self.files = files
        self.debug = debug
        self.data: dict[str, Any] = {}
        self.stack: dict[str, list[str]] = {}
        self.construct: dict[str, str | None] = {}
        self.lock = threading.RLock()
        self.dirty = False

    @property
    def tensor_dir(self) -> Path:
        """Where ``.pt`` files go."""
        return self.rank_dir / "dump_tensor_data"

    def save_tensor(self, file_name: str, tensor: torch.Tensor) -> None:
        """Write ``dump_tensor_data/<file_name>`` now (or queue it with async_dump)."""
        self.files.save(self.tensor_dir / file_name, tensor)

    def add(self, name: str, record: Any, *, stack: list[str] | None = None, parent: str | None = None) -> None:
        """Add (or replace) the record ``name``; ``parent`` goes to construct.json."""
        with self.lock:
            self.data[name] = record
            if stack is not None:
                self.stack[name] = stack
            if parent is not None or not self.debug:
                self.construct[name] = parent
            self.dirty = True

    def remove(self, name: str) -> None:
        """Forget the record ``name`` (if any)."""
        with self.lock:
            self.data.pop(name, None)
            self.stack.pop(name, None)
            self.construct.pop(name, None)

    def touch(self) -> None:
        """Mark the content changed (a backward record filled in place)."""
        self.dirty = True

    def log_error(self, message: str) -> None:
        """Append one line to ``dump_error_info.log``."""
        self.rank_dir.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        with (self.rank_dir / "dump_error_info.log").open("a", encoding="utf-8") as fh:
            fh.write(f"{stamp} {message}\n")

    def flush(self, *, construct: bool) -> None:
        """Write the JSON files atomically (only when something changed)."""
        with self.lock:
            if not self.dirty:
                return
            self.files.wait()
            data = {name: resolve(record) for name, record in self.data.items()}
            self.dirty = False
            if self.debug:
                write_json_atomically(self.rank_dir / "debug.json", {**self.header, "data": data})
                return
            write_json_atomically(self.rank_dir / "dump.json", {**self.header, "data": data})
            write_json_atomically(self.rank_dir / "stack.json", self.stack)
            write_json_atomically(self.rank_dir / "construct.json", self.construct if construct else {})
