"""A C implementation of the CRC-32C that TensorBoard's event writer computes for every record.

The ``tensorboard`` package computes it in pure Python (about 12 µs for a 100-byte scalar event,
twice per event): with hundreds of scalars per step that is milliseconds of GIL-holding work on
the writer thread. When ``google-crc32c`` (part of the ``tensorboard`` extra) is installed,
:func:`use_fast_crc` gives one event writer a :class:`FastCrcRecordWriter`: TensorBoard's record
framing with the C checksum, writing identical bytes (checked by the tests) to the same file.

Only that writer changes: nothing global is patched, so other TensorBoard writers in the process
(the user's own ``SummaryWriter``) and the ``tensorboard`` modules are left exactly as they are.
Without ``google-crc32c``, or with a TensorBoard whose writer internals differ, the writer keeps
its own record writer (the fallback: same files, slower checksum).
"""

from __future__ import annotations

import struct
from typing import Any

_MASK_DELTA = 0xA282EAD8


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC-32C of ``data`` (what ``tensorboard``'s own function returns).

    Raises:
        ImportError: ``google-crc32c`` is not installed.
    """
    import google_crc32c

    crc: int = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


class FastCrcRecordWriter:
    """TensorBoard's ``RecordWriter`` (same record framing, same bytes) computing the checksums
    with :func:`masked_crc32c`. ``file`` is the file object TensorBoard's record writer wrote to."""

    def __init__(self, file: Any) -> None:
        self._writer = file

    def write(self, data: bytes) -> None:
        """Write one record: length, its masked CRC, ``data``, its masked CRC (little-endian)."""
        header = struct.pack("<Q", len(data))
        self._writer.write(
            header + struct.pack("<I", masked_crc32c(header)) + data + struct.pack("<I", masked_crc32c(data))
        )

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

    @property
    def closed(self) -> bool:
        return bool(self._writer.closed)


def event_file_writer(writer: Any) -> Any:
    """The ``EventFileWriter`` of ``writer`` (itself, or a ``SummaryWriter``'s), or None."""
    if hasattr(writer, "_async_writer"):
        return writer
    try:
        return writer._get_file_writer().event_writer
    except AttributeError:
        return None


def use_fast_crc(writer: Any) -> bool:
    """Make ``writer`` (TensorBoard's ``EventFileWriter`` or a ``SummaryWriter``) checksum its
    records with :func:`masked_crc32c`; returns whether it does. False, and the writer unchanged,
    when ``google-crc32c`` is missing or the writer's internals are not TensorBoard's known ones.
    Call it right after creating the writer, before any other wrapper of its record writer."""
    try:
        import google_crc32c  # noqa: F401
        from tensorboard.summary.writer.record_writer import RecordWriter
    except ImportError:
        return False
    events = event_file_writer(writer)
    try:
        async_writer = events._async_writer
        worker = async_writer._worker
        record_writer = async_writer._writer
        file = record_writer._writer
    except AttributeError:
        return False
    if isinstance(record_writer, FastCrcRecordWriter):
        return True
    if type(record_writer) is not RecordWriter or worker._record_writer is not record_writer:
        return False
    fast = FastCrcRecordWriter(file)
    worker._record_writer = fast  # the thread reads it per record: whole records either way
    async_writer._writer = fast
    return True
