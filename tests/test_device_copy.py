"""The mechanism that keeps statistics off the host during a step: device rows stay tensors in
the :class:`RowBuffer`, ``drain`` starts ONE copy per device (:class:`DeviceCopy`) and only the
writer thread waits for it; an on-demand read (``snapshot``) also copies once per device.

CPU tensors stand in for device rows where a test checks the bookkeeping (the buffer treats any
non-list row as a device row); the ``device`` fixture runs the copy itself on CUDA when present."""

from __future__ import annotations

from typing import Any

import torch

from trainprobe.backends.torch.device_copy import DeviceCopy
from trainprobe.backends.torch.stats import TensorStats
from trainprobe.engine.records import RowBuffer, RowKey


class CountingCopy(DeviceCopy):
    """:class:`DeviceCopy` that records each copy started and each wait."""

    started: list[int] = []
    waited: list[int] = []

    def __init__(self, values: list[torch.Tensor]) -> None:
        CountingCopy.started.append(len(values))
        super().__init__(values)

    def tolist(self) -> list[list[float]]:
        CountingCopy.waited.append(1)
        return super().tolist()


def _buffer(rows: list[Any]) -> RowBuffer:
    CountingCopy.started, CountingCopy.waited = [], []
    buf = RowBuffer(copier=CountingCopy)
    buf.extend([RowKey(0, f"t{i}", "s") for i in range(len(rows))], rows)
    return buf


def test_device_rows_stay_tensors_until_the_writer_reads_them(device: torch.device) -> None:
    rows = [torch.tensor([float(i), -1.0, 0.5], dtype=torch.float64, device=device) for i in range(7)]
    buf = _buffer([*rows[:3], [9.0, 9.0, 9.0], *rows[3:]])
    batch = buf.drain("m", 0)
    assert CountingCopy.started == [7]  # one copy for the device's 7 rows, started at drain
    assert CountingCopy.waited == []  # nobody waited on the training thread
    values = batch.values()  # the writer thread's call
    assert CountingCopy.waited == [1]
    assert values == [r.tolist() for r in rows[:3]] + [[9.0, 9.0, 9.0]] + [r.tolist() for r in rows[3:]]


def test_snapshot_copies_once_per_device(device: torch.device) -> None:
    """Monitor V1's on-demand reads (``generate_xy_metrics``) used to read every device row with
    its own ``tolist()``: one synchronisation per tensor. Now one copy per device."""
    rows = [torch.full((4,), float(i), dtype=torch.float64, device=device) for i in range(5)]
    buf = _buffer([[1.0, 2.0, 3.0, 4.0], *rows])
    snap = buf.snapshot()
    assert CountingCopy.started == [5]
    assert [v for _, v in snap] == [[1.0, 2.0, 3.0, 4.0]] + [[float(i)] * 4 for i in range(5)]
    assert len(buf) == 6  # a snapshot takes nothing


def test_rows_of_several_lengths_round_trip(device: torch.device) -> None:
    """The training metrics' named values have different lengths: concatenated, one copy."""
    rows = [torch.arange(n, dtype=torch.float64, device=device) for n in (1, 3, 2)]
    assert DeviceCopy(rows).tolist() == [[0.0], [0.0, 1.0, 2.0], [0.0, 1.0]]


def test_statistics_of_device_tensors_stay_on_the_device(device: torch.device) -> None:
    """A device tensor's row is a float64 tensor on that device (no host read); a CPU tensor's
    row is host floats. Both hold the same values."""
    x = torch.randn(5000, generator=torch.Generator().manual_seed(0))
    stats = TensorStats(("min", "max", "mean", "norm", "nans", "zeros"))
    (row,) = stats.rows([x.to(device)])
    if device.type == "cpu":
        assert isinstance(row, list)
        return
    assert isinstance(row, torch.Tensor) and row.device.type == device.type and row.dtype == torch.float64
    host = stats.rows([x])[0]
    got = row.cpu().tolist()
    for a, b in zip(got, host, strict=True):
        assert abs(a - b) <= 1e-9 * max(1.0, abs(b)), (got, host)


def test_metrics_values_are_copied_when_the_step_ends(device: torch.device) -> None:
    """The training metrics' device values are copied at the end of the step, once per device:
    a tensor changed in place afterwards does not change what is written (it used to be read by
    the writer thread, one ``tolist()`` per value: later, and one synchronisation each)."""
    from trainprobe.frontdoors.metrics.outputs import RawValues, raw_values

    raw = RawValues()
    loss = torch.tensor(2.5, dtype=torch.float64, device=device)
    norms = torch.tensor([3.0, 4.0], dtype=torch.float64, device=device)
    raw.put("loss", loss)
    raw.put("norms", norms)
    raw.put("lr", 0.1)
    batch = raw.batch(step=1, samples=8)
    loss.add_(100.0)
    norms.zero_()
    values, samples = raw_values(batch)
    assert values == {"loss": 2.5, "norms": [3.0, 4.0], "lr": 0.1}
    assert samples == 8
