"""The step downsampling of ``trainprobe report``'s heatmaps and lines: buckets of consecutive
steps, each keeping its value of largest magnitude (a spike survives) and NaN/inf if any value is."""

from __future__ import annotations

import math

import numpy as np


def bucket_size(n_steps: int, max_columns: int) -> int:
    """Steps per column so that ``n_steps`` fit in ``max_columns`` (1: no downsampling)."""
    return max(1, math.ceil(n_steps / max_columns))


def downsample(values: np.ndarray, nonfinite: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Downsample the last axis in buckets of ``size`` consecutive steps.

    Each bucket keeps its value of largest magnitude (sign kept), so a spike survives; a bucket
    with a non-finite value is non-finite. Missing values (NaN, not flagged) are ignored; an
    all-missing bucket is NaN.
    """
    if size <= 1:
        return values, nonfinite
    n = values.shape[-1]
    pad = (-n) % size
    shape = (*values.shape[:-1], (n + pad) // size, size)
    padded = np.concatenate([values, np.full((*values.shape[:-1], pad), np.nan)], axis=-1).reshape(shape)
    flags = np.concatenate([nonfinite, np.zeros((*nonfinite.shape[:-1], pad), dtype=bool)], axis=-1).reshape(shape)
    magnitude = np.where(np.isnan(padded), -1.0, np.abs(padded))
    pick = np.take_along_axis(padded, magnitude.argmax(axis=-1)[..., None], axis=-1)[..., 0]
    return pick, np.asarray(flags.any(axis=-1))
