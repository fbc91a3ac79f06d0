"""The files of one step of one rank: ``dump_path/step{N}/rank{R}|proc{pid}/``.

``dump.json`` (or ``debug.json`` at level debug), ``stack.json`` and ``construct.json`` are held
in memory and written atomically (temporary file + ``os.replace``) by :meth:`StepStore.flush`, so a
crash never leaves half a JSON file. ``dump_tensor_data/<name>.pt`` files are written by
:class:`TensorFileWriter` (see there: a snapshot is taken when the op finishes and written by a
background thread; ``flush`` waits for them, so ``dump.json`` never names a missing file).
``dump_error_info.log`` collects dump errors, one line each.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import io
import os
import pickle
import shutil
import stat
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainprobe.dump.entries import resolve_pending
from trainprobe.engine.errors import ConfigError
from trainprobe.engine.file_names import path_under
from trainprobe.engine.folders import make_output_folder
from trainprobe.engine.log import error_once
from trainprobe.engine.sinks.background import Writer
from trainprobe.engine.sinks.files import append_whole
from trainprobe.engine.sinks.files import write_json_atomically as write_json_file

PENDING_BYTES = {False: 64 << 20, True: 1 << 30}
"""How many bytes of snapshots may wait for the disk (``async_dump`` false / true) before the
training thread waits for the writer."""


DUMP_PATH = "dump_path"
"""The config field naming the dump's root, for the ConfigError of a folder under it that cannot
be created (:func:`~trainprobe.engine.folders.make_output_folder`)."""

IDLE_EXIT_S = 5.0
"""The writer thread ends after this many seconds without work."""


def write_json_atomically(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` via a temporary file and ``os.replace``
    (:func:`trainprobe.engine.sinks.files.write_json_atomically`, no indent: the C encoder, ~10x faster)."""
    write_json_file(path, data, indent=None, default=_no_tensor)


def _no_tensor(value: Any) -> Any:
    """JSON for a device statistics row not yet read back (a record still being filled by another
    thread while the files are written): null; the next flush writes its values."""
    if isinstance(value, torch.Tensor):
        return None
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _plain_save(tensor: torch.Tensor, file: Any) -> None:
    torch.save(tensor, file)


def _make_fast_save() -> Callable[[torch.Tensor, Any], None]:
    """``torch.save`` without the zip CRC-32 of each record, or plain ``torch.save``.

    The CRC-32 costs about half of ``torch.save``'s CPU time (1 ms per 4 MB) and is not needed by
    ``torch.load``; torch offers to skip it (``torch.serialization.set_crc32_options``), but only
    process-wide, which would also change the user's own checkpoints. This builds the same
    zip writer with the CRC turned off for the dump's files only. The private functions it uses
    are checked once (a tensor saved to memory must load back equal with ``weights_only=True``);
    on any mismatch it falls back to ``torch.save``.
    """
    try:
        from torch.serialization import DEFAULT_PROTOCOL, _get_storage_alignment, _save

        def fast_save(tensor: torch.Tensor, file: Any) -> None:
            writer = torch._C.PyTorchFileWriter(file, False, _get_storage_alignment())
            try:
                _save(tensor, writer, pickle, DEFAULT_PROTOCOL, False)
            finally:
                writer.write_end_of_file()

        probe = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        buf = io.BytesIO()
        fast_save(probe, buf)
        buf.seek(0)
        if torch.equal(torch.load(buf, weights_only=True), probe):
            return fast_save  # type: ignore[return-value]
    except Exception:  # noqa: BLE001 - any incompatibility: the public path
        pass
    return _plain_save


_save_pt: Callable[[torch.Tensor, Any], None] | None = None

_OPEN_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
"""A dump file is created or truncated, never reached through a symbolic link planted at its name."""


_SMALL_WRITE = 64 << 10
"""Records smaller than this are gathered and written together (a ``.pt`` file is several small
records around the tensor's bytes; one system call each would cost more than torch's own
buffered writer)."""


class _FileSink:
    """The file object ``torch.save`` writes into: every byte goes through ``os.write`` on a
    descriptor trainprobe opened itself, so a failing write keeps its ``errno`` (torch's own file
    writer reports a full disk as ``enforce fail at inline_container.cc``). Small records are
    gathered up to :data:`_SMALL_WRITE` bytes; :meth:`flush` writes what is gathered."""

    __slots__ = ("buffer", "error", "fd")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.error: OSError | None = None
        self.buffer = bytearray()

    def write(self, data: Any) -> int:
        if self.error is not None:
            raise self.error
        view = memoryview(data).cast("B")
        total = len(view)
        if len(self.buffer) + total <= _SMALL_WRITE:
            self.buffer += view
            return total
        self.flush()
        if total < _SMALL_WRITE:
            self.buffer += view
        else:
            self._write_all(view)
        return total

    def flush(self) -> None:
        """Write the gathered records."""
        if self.buffer:
            data, self.buffer = self.buffer, bytearray()
            self._write_all(memoryview(data))

    def _write_all(self, view: memoryview) -> None:
        try:
            while view:
                view = view[os.write(self.fd, view) :]
        except OSError as exc:
            self.error = exc
            raise

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self.flush()
        return os.lseek(self.fd, offset, whence)

    def tell(self) -> int:
        return os.lseek(self.fd, 0, os.SEEK_CUR) + len(self.buffer)


def save_pt(tensor: torch.Tensor, path: str) -> None:
    """Write ``tensor`` to ``path`` in ``torch.save``'s format (loadable with
    ``torch.load(path, weights_only=True)``), without per-record CRC-32 when torch allows.

    A symbolic link at ``path`` is not followed. A failed write removes the partial file and
    raises the ``OSError`` the operating system gave (``errno.ENOSPC`` on a full disk).
    """
    global _save_pt
    if _save_pt is None:
        _save_pt = _make_fast_save()
    fd = os.open(path, _OPEN_FLAGS, 0o644)
    sink = _FileSink(fd)
    try:
        _save_pt(tensor, sink)
        sink.flush()
    except BaseException as exc:
        with contextlib.suppress(OSError):
            if stat.S_ISREG(os.fstat(fd).st_mode):  # never a device such as /dev/full
                os.unlink(path)
        if sink.error is not None and sink.error is not exc:
            raise sink.error from None
        raise
    finally:
        os.close(fd)


def snapshot(tensor: torch.Tensor) -> torch.Tensor:
    """A detached CPU copy of ``tensor`` holding exactly its elements (no larger base storage)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        return t.to("cpu")
    return t.clone()


@dataclass(slots=True)
class _Job:
    """One ``.pt`` file for the engine's writer thread (a batch of one)."""

    path: Path
    tensor: torch.Tensor | None  # None: hard-link ``source``
    source: Path | None
    nbytes: int
    on_error: Callable[[str], None] | None
    monitor: str = "dump"

    def __len__(self) -> int:
        return 1


class TensorFileWriter:
    """Writes the ``.pt`` files of a dump on the engine's writer thread
    (:class:`~trainprobe.engine.sinks.background.Writer`), in the order given.

    :meth:`save` takes a snapshot of the tensor at once (later in-place changes never reach the
    file) and returns; the writer thread serialises it. At most ``PENDING_BYTES[async_write]``
    bytes of snapshots wait at any time (then :meth:`save` waits for the disk). :meth:`wait`
    blocks until every file given so far is complete; files still queued when the interpreter
    exits normally (even through an exception) are written before it ends. The thread ends after
    ``IDLE_EXIT_S`` idle seconds (the next file starts another). A tensor saved again
    in the same step and directory (the same tensor object, not modified in place since) becomes
    a hard link to its first file (a copy where links are not supported): same name, same bytes,
    no second serialisation. A file that cannot be written is reported through the ``on_error``
    given with it and the next files are still written.

    ``bytes_written`` counts the tensor bytes of every file produced (links included),
    ``bytes_serialised`` those actually serialised.
    """

    def __init__(self, async_write: bool) -> None:
        self.async_write = async_write
        self.bytes_written = 0
        self.bytes_serialised = 0
        self._seen: dict[int, tuple[weakref.ref[torch.Tensor], int, Path]] = {}
        self._dirs: set[Path] = set()
        self._failed: set[Path] = set()  # files that could not be written (this step)
        self._writer: Writer[_Job] = Writer(
            self,
            background=True,
            on_error=_unreported,
            max_pending=PENDING_BYTES[bool(async_write)],
            cost=_job_bytes,
            idle_exit_s=IDLE_EXIT_S,
        )
        ref = weakref.ref(self)
        atexit.register(_wait_at_exit, ref)

    @property
    def max_pending(self) -> int:
        """The bytes of snapshots that may wait for the disk."""
        return self._writer.max_pending

    # -- caller side ----------------------------------------------------------------------
    def save(self, path: Path, tensor: torch.Tensor, on_error: Callable[[str], None] | None = None) -> None:
        """Queue ``tensor`` (a snapshot of it) for ``path``; see the class docstring."""
        nbytes = tensor.numel() * tensor.element_size()
        self.bytes_written += nbytes
        source = self._already_saved(path, tensor)
        if source is not None:
            self._writer.submit(_Job(path, None, source, 0, on_error))
            return
        self.bytes_serialised += nbytes
        self._writer.submit(_Job(path, snapshot(tensor), None, nbytes, on_error))

    def _already_saved(self, path: Path, tensor: torch.Tensor) -> Path | None:
        """The file this very tensor (unchanged) went to earlier in this step, in ``path``'s folder."""
        version = version_of(tensor)
        if version is None:
            return None
        key = id(tensor)
        hit = self._seen.get(key)
        if hit is not None and hit[0]() is tensor and hit[1] == version and hit[2].parent == path.parent:
            return hit[2]
        try:
            self._seen[key] = (weakref.ref(tensor), version, path)
        except TypeError:  # a tensor subclass without weak references
            pass
        return None

    def new_step(self) -> None:
        """Forget which tensors were saved (links never cross steps)."""
        self._seen.clear()
        self._failed.clear()

    def wait(self) -> None:
        """Block until every file given so far is written."""
        self._writer.flush()

    # -- the sink (writer thread) ----------------------------------------------------------
    def write(self, job: _Job) -> None:
        """Write one file; a failure goes to the job's ``on_error`` (never raised)."""
        try:
            self._write(job)
        except Exception as exc:  # noqa: BLE001 - a dump error never reaches training
            try:
                message = self._failure(job, exc)
            except Exception:  # noqa: BLE001 - reporting must not end the writer thread
                message = f"writing {job.path.name} failed"
            if job.on_error is not None:
                with contextlib.suppress(Exception):
                    job.on_error(message)
        finally:
            job.tensor = None

    def close(self, reached: int | None = None) -> None:
        """Nothing to close: every file is complete when written."""

    def _failure(self, job: _Job, exc: BaseException) -> str:
        """The one-line description of a failed job (a link to a file that failed is not a
        second error)."""
        self._failed.add(job.path)
        if job.source is not None and job.source in self._failed:
            return f"{job.path.name} not written: {job.source.name}, the file it repeats, could not be written"
        return report_write_error(exc, job.path)

    def _write(self, job: _Job) -> None:
        if job.source is not None and job.source in self._failed:
            raise FileNotFoundError(errno.ENOENT, "its source could not be written", str(job.source))
        folder = job.path.parent
        if folder not in self._dirs:
            make_output_folder(folder, DUMP_PATH)
            self._dirs.add(folder)
        try:
            self._write_file(job)
        except Exception:
            if folder.is_dir():
                raise
            make_output_folder(folder, DUMP_PATH)  # removed by someone since: once more
            self._write_file(job)

    @staticmethod
    def _write_file(job: _Job) -> None:
        if job.source is not None:
            _link_or_copy(job.source, job.path)
        else:
            assert job.tensor is not None
            save_pt(job.tensor, str(job.path))


def _job_bytes(job: _Job) -> int:
    return job.nbytes


def _unreported(monitor: str, exc: BaseException) -> None:
    """The dump's sink reports its own faults (``TensorFileWriter.write`` never raises)."""


def _wait_at_exit(ref: weakref.ref[TensorFileWriter]) -> None:
    writer = ref()
    if writer is not None:
        writer.wait()


_DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)})
_LOW_SPACE_BYTES = 1 << 20


def disk_full(exc: BaseException, folder: Path) -> bool:
    """Whether ``exc``, raised writing into ``folder``, means the disk (or quota) is full: by its
    ``errno``, by its message, or (an error without either, such as torch's
    ``enforce fail at inline_container.cc``) by less than 1 MiB left on ``folder``'s file system."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return exc.errno in _DISK_FULL_ERRNOS
    if "no space left" in str(exc).lower():
        return True
    try:
        st = os.statvfs(folder)
    except (OSError, ValueError, AttributeError):
        return False
    return st.f_bavail * st.f_frsize < _LOW_SPACE_BYTES


def report_write_error(exc: BaseException, path: Path) -> str:
    """Log a failed dump file write once and return its one-line description: ``no space left
    on device writing <path>`` for a full disk (one message for the whole run), else ``writing
    <name> failed: <error>`` (logged once; with its traceback unless it is an ``OSError``)."""
    if disk_full(exc, path.parent):
        message = f"no space left on device writing {path}"
        error_once("dump-no-space", f"trainprobe dump: {message}; dump files that do not fit are skipped",
                   traceback=False)  # fmt: skip
        return message
    message = f"writing {path.name} failed: {type(exc).__name__}: {exc}"
    error_once("dump-write-failed", f"trainprobe dump: {message}", traceback=not isinstance(exc, (OSError, ConfigError)))
    return message


def _link_or_copy(source: Path, target: Path) -> None:
    if target.exists():
        target.unlink()
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def grouped_stacks(stacks: dict[str, list[str]]) -> dict[str, list[list[str]]]:
    """``stack.json`` as the reference tool writes it: records with the same call stack share one
    entry, ``{"0": [[name, ...], [frame, ...]], "1": ...}``, numbered in order of first appearance.

    Example: ``{"Torch.relu.0.forward": F, "Torch.relu.1.forward": F}`` →
    ``{"0": [["Torch.relu.0.forward", "Torch.relu.1.forward"], F]}``.
    """
    groups: dict[tuple[str, ...], list[str]] = {}
    for name, frames in stacks.items():
        groups.setdefault(tuple(frames), []).append(name)
    return {str(i): [names, list(frames)] for i, (frames, names) in enumerate(groups.items())}


def version_of(tensor: torch.Tensor) -> int | None:
    """The autograd version counter (None for inference tensors, which have none)."""
    try:
        return tensor._version
    except RuntimeError:
        return None


def _one_line(message: str) -> str:
    return message.replace("\r", "\\r").replace("\n", "\\n")


def _report_log_failure(exc: BaseException, path: Path, message: str) -> None:
    if disk_full(exc, path.parent):
        error_once("dump-no-space", f"trainprobe dump: no space left on device writing {path}", traceback=False)
        return
    error_once(
        "dump-error-log-failed",
        f"trainprobe dump: cannot write {path!r} ({type(exc).__name__}: {exc}); the error to log was: {message}",
        traceback=False,
    )


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
        self.dirty = True  # a started step writes its JSON files even when nothing was recorded

    @property
    def tensor_dir(self) -> Path:
        """Where ``.pt`` files go."""
        return self.rank_dir / "dump_tensor_data"

    def save_tensor(self, file_name: str, tensor: torch.Tensor) -> None:
        """Queue ``dump_tensor_data/<file_name>`` (written by the writer thread; errors go to
        ``dump_error_info.log``). ``file_name`` must be a plain file name (as
        :func:`trainprobe.engine.file_names.safe_file_name` makes them): any other is refused, logged
        and not written, so no file is ever written outside ``dump_tensor_data``."""
        try:
            path = path_under(self.tensor_dir, file_name)
        except ValueError as exc:
            error_once("dump-unsafe-name", f"trainprobe dump: {exc}", traceback=False)
            self.log_error(str(exc))
            return
        self.files.save(path, tensor, self.log_error)

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
        """Append one line to ``dump_error_info.log`` (line breaks in ``message`` escaped).

        Never raises: this runs inside fault handlers. When the log itself cannot be written
        (disk full, a ``dump_path`` the file system refuses), that is reported once through the
        ``trainprobe`` logger instead."""
        path = self.rank_dir / "dump_error_info.log"
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        line = f"{stamp} {_one_line(message)}\n".encode("utf-8", "backslashreplace")
        try:
            make_output_folder(self.rank_dir, DUMP_PATH)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0), 0o644)
            try:
                append_whole(fd, line)
            finally:
                os.close(fd)
        except Exception as exc:  # noqa: BLE001 - a fault handler must not fail
            with contextlib.suppress(Exception):
                _report_log_failure(exc, path, message)

    def flush(self, *, construct: bool) -> None:
        """Write the JSON files atomically (only when something changed)."""
        with self.lock:
            if not self.dirty:
                return
            self.files.wait()
            resolve_pending()
            data = dict(self.data)
            self.dirty = False
            if self.debug:
                write_json_atomically(self.rank_dir / "debug.json", {**self.header, "data": data})
                return
            write_json_atomically(self.rank_dir / "dump.json", {**self.header, "data": data})
            write_json_atomically(self.rank_dir / "stack.json", grouped_stacks(self.stack))
            write_json_atomically(self.rank_dir / "construct.json", self.construct if construct else {})
