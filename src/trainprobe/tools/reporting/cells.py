"""The numpy work of ``trainprobe report`` on one file's rows: names as target ids (model order),
each row's place in its step, one cell per (target, step) from several micro-steps (the value
of largest magnitude), and the float32 the page draws. No Python loop over rows."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_FLOAT32_MAX = float(np.finfo(np.float32).max)


def target_ids(index: dict[str, int], codes: np.ndarray, names: Sequence[str]) -> np.ndarray:
    """Each row's name (``names[code]``) as its id in ``index``; names not in it yet are added in
    the order they first appear (model order). Works per distinct name, not per row."""
    if not len(codes):
        return np.zeros(0, dtype=np.int64)
    unique, first, inverse = np.unique(codes, return_index=True, return_inverse=True)
    for new in unique[np.argsort(first)].tolist():
        index.setdefault(names[new], len(index))
    lookup = np.fromiter((index[names[u]] for u in unique.tolist()), dtype=np.int64, count=len(unique))
    return lookup[inverse.reshape(-1)]


def compact(values: np.ndarray) -> np.ndarray:
    """``values`` as float32, the precision the page draws: finite values clipped to float32's
    range (so that they stay finite), NaN and inf kept."""
    return np.where(np.isfinite(values), np.clip(values, -_FLOAT32_MAX, _FLOAT32_MAX), values).astype(np.float32)


def grown(array: np.ndarray | None, size: int, fill: float | bool) -> np.ndarray:
    """``array`` extended to ``size`` with ``fill`` (a new one when None)."""
    old = 0 if array is None else len(array)
    extra = np.full(size - old, fill, dtype=np.float64 if isinstance(fill, float) else bool)
    return extra if array is None else np.concatenate([array, extra])


def real_rows(shapes: list[str] | None, values: np.ndarray) -> np.ndarray:
    """Per row: False for the reference's row of a missing tensor (``shape`` and every value
    ``nan``), True otherwise."""
    if shapes is None:
        return np.ones(len(values), dtype=bool)
    missing = np.fromiter((s.strip().lower() == "nan" for s in shapes), dtype=bool, count=len(values))
    return ~(missing & np.isnan(values).all(axis=1))


def merge_cells(keys: np.ndarray, values: np.ndarray, finite: np.ndarray, size: int) -> np.ndarray:
    """``(size, ops)`` cells from rows with cell index ``keys``: the finite value of largest
    magnitude among rows sharing a cell; NaN where none is finite or no row falls."""
    cells = np.full((size, values.shape[1]), np.nan)
    clean = np.where(finite, values, np.nan)
    if not has_repeats(keys, size):  # one row per cell: no micro-steps to merge
        cells[keys] = clean
        return cells
    for op in range(values.shape[1]):
        unique, largest = largest_per_key(keys, values[:, op], finite[:, op])
        cells[unique, op] = largest
    return cells


def largest_per_key(keys: np.ndarray, values: np.ndarray, finite: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct ``keys`` (ascending) and, for each, the finite value of largest magnitude
    among its rows (NaN when none is finite)."""
    if not len(keys):
        return keys, values
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    if not (sorted_keys[1:] == sorted_keys[:-1]).any():  # one row per key (no micro-steps): no merging
        return sorted_keys, np.where(finite[order], values[order], np.nan)
    magnitude = np.where(finite, np.abs(values), -1.0)
    order = np.lexsort((magnitude, keys))
    sorted_keys = keys[order]
    last = order[np.r_[sorted_keys[1:] != sorted_keys[:-1], True]]
    return keys[last], np.where(finite[last], values[last], np.nan)


def has_repeats(keys: np.ndarray, size: int | None = None) -> bool:
    """Whether some key occurs twice; ``size``: every key is in ``range(size)`` (a mark per key,
    no sort)."""
    if size is not None and len(keys):
        seen = np.zeros(size, dtype=bool)
        seen[keys] = True
        return int(np.count_nonzero(seen)) < len(keys)
    ordered = np.sort(keys)
    return bool((ordered[1:] == ordered[:-1]).any())


def unique_inverse(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(values, return_inverse=True)``, without a sort when ``values`` are already
    in ascending order (a file's steps)."""
    if len(values) and not (values[1:] < values[:-1]).any():
        change = np.r_[False, values[1:] != values[:-1]]
        return values[np.r_[True, change[1:]]], np.cumsum(change)
    unique, inverse = np.unique(values, return_inverse=True)
    return unique, inverse.reshape(-1)
