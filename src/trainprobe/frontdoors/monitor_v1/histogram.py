"""Histograms of tensors as rows for TensorBoard (``ur_distribution`` with ``format: tensorboard``).

A histogram row is :data:`~trainprobe.engine.sinks.tensorboard.HISTOGRAM_HEAD` (``min, max, num, sum,
sum_squares`` of the finite elements) followed by :data:`HISTOGRAM_BINS` bucket counts that split
``[min, max]`` into equal widths (the maximum falls in the last bucket). NaN and ±inf elements
are left out of every value; a tensor with no finite element gives ``num`` 0 (TensorBoard skips
it). Accelerator tensors are summarised on the device without a host synchronisation (a float64
tensor, copied with the step's other rows); CPU tensors give host floats.
"""

from __future__ import annotations

import torch

from trainprobe.backends.torch.stats import RowValues, as_statistic_input, sum64

HISTOGRAM_BINS = 30


def histogram_row(t: torch.Tensor, bins: int = HISTOGRAM_BINS) -> RowValues:
    """The histogram row of ``t`` (see the module docstring)."""
    x = as_statistic_input(t).reshape(-1)
    if x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()
    finite = torch.isfinite(x)
    inf = x.new_full((), float("inf"))  # a fill, not a host-to-device copy
    lo = torch.where(finite, x, inf).amin() if x.numel() else inf
    hi = torch.where(finite, x, -inf).amax() if x.numel() else -inf
    clean = torch.where(finite, x, x.new_zeros(()))
    width = torch.where(hi > lo, hi - lo, torch.ones_like(hi))
    position = torch.where(finite, (clean - lo) * (bins / width), torch.zeros_like(clean))
    index = torch.nan_to_num(position.floor_(), nan=0.0, posinf=bins - 1, neginf=0.0).clamp_(0, bins - 1).long()
    counts = torch.zeros(bins, dtype=torch.float64, device=x.device)
    counts.scatter_add_(0, index, finite.to(torch.float64))
    head = torch.stack(
        [
            lo.to(torch.float64),
            hi.to(torch.float64),
            finite.sum().to(torch.float64),
            sum64(clean),
            torch.linalg.vector_norm(clean, dtype=torch.float64).square(),
        ]
    )
    row = torch.cat([head, counts])
    return row.tolist() if row.device.type == "cpu" else row
