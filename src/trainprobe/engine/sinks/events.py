"""The one TensorBoard event-file writer of trainprobe (no torch: the offline tools use it too).

:class:`EventWriter` owns one event file (TensorBoard's ``EventFileWriter``: its file name, its
background thread, its ``max_queue``) and writes each call's values as **one** ``Summary`` event
at one step, built directly from TensorBoard's protobufs: a monitor's whole step is one record,
not one record per scalar. Its records are checksummed with the native CRC-32C when
``google-crc32c`` is installed (:func:`~trainprobe.engine.sinks.fast_crc.use_fast_crc`, TensorBoard's
own pure-Python checksum otherwise: identical bytes either way), and an error on TensorBoard's
writer thread (disk full) is raised by the next call on the caller's thread instead of being
printed there as a thread traceback (:func:`quiet_writer_thread`).

The values are those ``SummaryWriter.add_scalar`` / ``add_text`` / ``add_histogram_raw`` write
(float32 ``simple_value`` scalars, the text plugin's string tensor, ``HistogramProto``), and
``purge_step`` writes the same marker events as ``SummaryWriter(purge_step=...)``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from trainprobe.engine.folders import make_output_folder
from trainprobe.engine.sinks.fast_crc import event_file_writer, use_fast_crc


class _QuietRecordWriter:
    """TensorBoard's record writer as its background thread sees it: an error raised on that
    thread is kept (for :func:`quiet_writer_thread`) instead of ending the thread with a raw
    ``Exception in thread`` traceback; later records are dropped. Calls from any other thread
    behave as before."""

    def __init__(self, inner: Any, worker: threading.Thread) -> None:
        self._inner = inner
        self._worker = worker
        self._failed = False

    def _call(self, method: str, *args: Any) -> None:
        if threading.current_thread() is not self._worker:
            getattr(self._inner, method)(*args)
            return
        if self._failed:
            return
        try:
            getattr(self._inner, method)(*args)
        except Exception as exc:  # noqa: BLE001 - handed to the caller's thread, not printed
            self._failed = True
            self._worker.exception = exc  # type: ignore[attr-defined]  # the caller's next call raises it

    def write(self, data: bytes) -> None:
        self._call("write", data)

    def flush(self) -> None:
        self._call("flush")

    def close(self) -> None:
        self._inner.close()

    @property
    def closed(self) -> bool:
        return bool(self._inner.closed)


def quiet_writer_thread(writer: Any) -> bool:
    """Keep the background thread of ``writer`` (an ``EventFileWriter`` or a ``SummaryWriter``)
    from printing a traceback when a write fails (disk full): the error is raised instead by the
    writer's next call on the caller's thread, where trainprobe reports it in one line. Returns
    whether the thread could be reached (TensorBoard's event writer internals:
    ``_async_writer._worker``); when it cannot, nothing changes."""
    try:
        async_writer = event_file_writer(writer)._async_writer
        worker = async_writer._worker
        inner = worker._record_writer
    except AttributeError:
        return False
    if isinstance(inner, _QuietRecordWriter):
        return True
    quiet = _QuietRecordWriter(inner, worker)
    worker._record_writer = quiet
    async_writer._writer = quiet
    return True


def require_tensorboard(missing: Callable[[ImportError], Exception]) -> None:
    """Raise ``missing(exc)`` when the ``tensorboard`` package (its event writer) cannot be
    imported; for front doors that check before they start writing."""
    try:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter  # noqa: F401
    except ImportError as exc:
        raise missing(exc) from None


class EventWriter:
    """One TensorBoard event file in ``log_dir`` (created if missing).

    Args:
        log_dir: the folder; the file is ``events.out.tfevents.<time>.<host>.<pid>.<n>``.
        max_queue: events TensorBoard queues before its thread writes them.
        purge_step: TensorBoard hides the events of steps >= this one written by earlier runs
            into the folder (a resumed run); None for a fresh run.
        missing: the exception raised when the ``tensorboard`` package is missing (each front
            door names its own field and fix).
        field: the config field that named ``log_dir``, for the ConfigError of
            :func:`~trainprobe.engine.folders.make_output_folder`, which creates it.

    Raises:
        Exception: ``missing(exc)`` when tensorboard cannot be imported; ``ConfigError`` naming
            ``field`` when the folder cannot be created; ``OSError`` when the file cannot be.
    """

    def __init__(
        self,
        log_dir: Path,
        *,
        max_queue: int = 10,
        purge_step: int | None = None,
        missing: Callable[[ImportError], Exception],
        field: str = "output_dir",
    ) -> None:
        require_tensorboard(missing)
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event = event_pb2.Event
        self._session_log = event_pb2.SessionLog
        self.Summary = summary_pb2.Summary  # noqa: N815 - the protobuf class, for callers building values
        make_output_folder(log_dir, field)
        self.log_dir = log_dir
        self._file = EventFileWriter(str(log_dir), max_queue, 120, "")
        use_fast_crc(self._file)
        quiet_writer_thread(self._file)
        if purge_step is not None:  # what SummaryWriter(purge_step=...) writes first
            self._add(self._event(step=purge_step, file_version="brain.Event:2"))
            self._add(self._event(step=purge_step, session_log=self._session_log(status=self._session_log.START)))

    def _add(self, event: Any) -> None:
        event.wall_time = time.time()
        self._file.add_event(event)

    # -- values --------------------------------------------------------------------------
    def scalar(self, tag: str, value: float) -> Any:
        """A scalar value (float32 ``simple_value``, as ``add_scalar`` writes it)."""
        return self.Summary.Value(tag=tag, simple_value=float(value))

    def text(self, tag: str, body: str) -> Any:
        """A text value for TensorBoard's TEXT page (tag ``<tag>/text_summary``, as ``add_text``)."""
        from tensorboard.compat.proto.summary_pb2 import SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
        from tensorboard.plugins.text.plugin_data_pb2 import TextPluginData

        plugin = SummaryMetadata.PluginData(plugin_name="text", content=TextPluginData(version=0).SerializeToString())
        tensor = TensorProto(
            dtype="DT_STRING",
            string_val=[body.encode(encoding="utf_8")],
            tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]),
        )
        return self.Summary.Value(
            tag=tag + "/text_summary", metadata=SummaryMetadata(plugin_data=plugin), tensor=tensor
        )

    def histogram(
        self,
        tag: str,
        lo: float,
        hi: float,
        num: float,
        total: float,
        squares: float,
        limits: Sequence[float],
        counts: Sequence[float],
    ) -> Any:
        """A histogram value (``add_histogram_raw``'s ``HistogramProto``)."""
        from tensorboard.compat.proto.summary_pb2 import HistogramProto

        histo = HistogramProto(
            min=lo, max=hi, num=num, sum=total, sum_squares=squares, bucket_limit=limits, bucket=counts
        )
        return self.Summary.Value(tag=tag, histo=histo)

    # -- writing -------------------------------------------------------------------------
    def write(self, step: int, values: Iterable[Any]) -> int:
        """Write ``values`` as one ``Summary`` event at ``step``; returns how many (nothing is
        written for none)."""
        values = list(values)
        if values:
            self._add(self._event(step=int(step), summary=self.Summary(value=values)))
        return len(values)

    def flush(self) -> None:
        """Push pending events to disk."""
        self._file.flush()

    def close(self) -> None:
        """Flush and close the file (closed even when the flush raises a write error)."""
        try:
            self._file.flush()
        finally:
            self._file.close()
