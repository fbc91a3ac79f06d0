"""TensorBoard's record CRC through google-crc32c: the same bytes, read back by TensorBoard."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("google_crc32c")
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as python_crc  # noqa: E402
from tensorboard.summary.writer import record_writer  # noqa: E402

from test_metrics_helpers import read_events, scalars  # noqa: E402
from trainprobe.sinks.fast_crc import masked_crc32c, use_fast_crc  # noqa: E402


@pytest.mark.parametrize("size", [0, 1, 8, 100, 4097])
def test_same_checksum_as_tensorboards_own(size: int) -> None:
    data = os.urandom(size)
    assert masked_crc32c(data) == python_crc(data)


def test_event_files_written_with_it_read_back(tmp_path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    assert use_fast_crc() and use_fast_crc()
    assert record_writer.masked_crc32c is masked_crc32c
    writer = SummaryWriter(str(tmp_path))
    for step in range(5):
        writer.add_scalar("x", step * 0.5, step)
    writer.close()
    assert scalars(read_events(tmp_path))["x"] == {s: s * 0.5 for s in range(5)}
