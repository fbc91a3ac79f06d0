"""TensorBoard's record CRC through google-crc32c: the same bytes, read back by TensorBoard, for
trainprobe's own writers only (nothing in the tensorboard package is patched)."""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("google_crc32c")
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as python_crc  # noqa: E402
from tensorboard.summary.writer import record_writer  # noqa: E402
from tensorboard.summary.writer.event_file_writer import EventFileWriter  # noqa: E402

from test_metrics_helpers import read_events, scalars  # noqa: E402
from trainprobe.engine.records import RowKey, StepBatch  # noqa: E402
from trainprobe.engine.sinks.fast_crc import FastCrcRecordWriter, event_file_writer, masked_crc32c, use_fast_crc  # noqa: E402
from trainprobe.engine.sinks.tensorboard import TensorBoardSink  # noqa: E402

TENSORBOARDS_CRC = record_writer.masked_crc32c


def _record_writer_of(writer: object) -> object:
    """The record writer of a ``SummaryWriter`` or an ``EventWriter`` (under trainprobe's quiet-thread wrapper, if any)."""
    found = event_file_writer(getattr(writer, "_file", writer))._async_writer._writer  # type: ignore[attr-defined]
    return getattr(found, "_inner", found)


@pytest.mark.parametrize("size", [0, 1, 8, 100, 4097])
def test_same_checksum_as_tensorboards_own(size: int) -> None:
    data = os.urandom(size)
    assert masked_crc32c(data) == python_crc(data)


@pytest.mark.parametrize("size", [0, 100, 70000])
def test_same_record_bytes_as_tensorboards_record_writer(size: int) -> None:
    data = os.urandom(size)
    theirs, ours = io.BytesIO(), io.BytesIO()
    record_writer.RecordWriter(theirs).write(data)
    FastCrcRecordWriter(ours).write(data)
    assert ours.getvalue() == theirs.getvalue()


def test_event_files_written_with_it_read_back(tmp_path: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    assert use_fast_crc(writer) and use_fast_crc(writer)
    assert isinstance(_record_writer_of(writer), FastCrcRecordWriter)
    for step in range(5):
        writer.add_scalar("x", step * 0.5, step)
    writer.close()
    assert scalars(read_events(tmp_path))["x"] == {s: s * 0.5 for s in range(5)}


def test_tensorboard_module_is_left_as_it_was(tmp_path: Path) -> None:
    """The speed-up is chosen per writer: TensorBoard's module keeps its own function while a
    trainprobe sink writes and after it is closed, and a user's writer is not touched."""
    from torch.utils.tensorboard import SummaryWriter

    users = SummaryWriter(str(tmp_path / "user"))
    sink = TensorBoardSink(tmp_path / "sink", {"m": ("norm",)}, lambda m, k: m, lambda t, k, op: f"{k.name}/{op}")
    assert isinstance(_record_writer_of(sink._writer), FastCrcRecordWriter)
    assert record_writer.masked_crc32c is TENSORBOARDS_CRC
    sink.write(StepBatch("m", 0, [RowKey(0, "w", "param")], {0: [1.5]}))
    sink.close()
    users.add_scalar("y", 2.0, 0)
    users.close()
    assert record_writer.masked_crc32c is TENSORBOARDS_CRC
    assert type(_record_writer_of(users)) is record_writer.RecordWriter
    assert scalars(read_events(tmp_path / "sink")) == {"w/norm": {0: 1.5}}
    assert scalars(read_events(tmp_path / "user")) == {"y": {0: 2.0}}


def test_without_google_crc32c_tensorboards_own_writer_is_kept(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "google_crc32c", None)  # what a missing package looks like
    writer = EventFileWriter(str(tmp_path))
    assert not use_fast_crc(writer)
    assert type(writer._async_writer._writer) is record_writer.RecordWriter
    writer.close()
    assert read_events(tmp_path).Tags() is not None
