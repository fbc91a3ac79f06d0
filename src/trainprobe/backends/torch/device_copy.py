"""The PyTorch device-to-host copy of a monitor's rows: one stacked copy per device per step.

:meth:`trainprobe.engine.records.RowBuffer.drain` hands this :data:`~trainprobe.engine.records.DeviceCopier`
the rows of one device; on CUDA they go to pinned host memory with one non-blocking copy and an
event that the writer thread waits on, so the training thread never synchronises.
"""

from __future__ import annotations

import torch


class DeviceCopy:
    """Values of one device, stacked (or, rows of different lengths, concatenated) and on their
    way to the host."""

    def __init__(self, values: list[torch.Tensor]) -> None:
        self.lengths: list[int] | None = None
        if len({v.shape for v in values}) > 1:  # named values of several lengths (training metrics)
            self.lengths = [v.numel() for v in values]
            stacked = torch.cat([v.reshape(-1) for v in values])
        else:
            stacked = torch.stack(values)
        self.event = None
        if stacked.device.type == "cuda":
            host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
            host.copy_(stacked, non_blocking=True)
            self.event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves Event() untyped
            self.event.record()
            self.host = host
        else:
            self.host = stacked.to("cpu")

    def tolist(self) -> list[list[float]]:
        if self.event is not None:
            self.event.synchronize()
        flat = self.host.tolist()
        if self.lengths is None:
            return flat
        rows, offset = [], 0
        for n in self.lengths:
            rows.append(flat[offset : offset + n])
            offset += n
        return rows
