"""NumPy kernels: host arrays → the statistics named in :mod:`trainprobe.engine.stats.ops`.

Framework-neutral: an adapter whose tensors live in host memory hands this kernel a NumPy view
of them (MindSpore's ``Tensor.asnumpy()`` on the CPU is one, without a copy). The numerics of
the PyTorch CPU kernel (:mod:`trainprobe.backends.torch.stats`), or better:

* min and max in the array's dtype (exact);
* the mean accumulated in float64 (NumPy converts block by block, without a full-size copy,
  and is faster so than summing float32 rows);
* the L2 norm in float64 below 4,096 elements, above as float32 sums of squares of rows of 64
  added in float64; a result above 1e18 or below 1e-15 (where float32 squares may overflow or
  underflow) is recomputed in float64;
* NaN counted lazily (a max, mean or norm that is not NaN proves there is none);
* half-precision inputs accumulate in float32 inside a row; integer and boolean arrays are
  summarised as float64, complex ones by their magnitude, other dtypes (bfloat16) as float32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from trainprobe.engine.stats.ops import ALL_OPS, EMPTY_TENSOR_VALUES

_ROW = 64
_NORM_ROWS_FROM = 1 << 12
_NORM_SAFE = (1e-15, 1e18)
_NATIVE_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
_FOUND = ("min", "max", "mean", "norm", "nans", "zeros")
"""The order in which :meth:`NumpyStats.row` computes the ops (then put in the caller's order)."""


def as_real_array(a: np.ndarray) -> np.ndarray:
    """A flat real floating-point array whose statistics describe ``a`` (no copy for contiguous
    float16/32/64 arrays)."""
    if a.dtype not in _NATIVE_FLOATS:
        if a.dtype.kind == "c":
            a = np.abs(a)
        elif a.dtype.kind in "biu":
            a = a.astype(np.float64)
        else:  # bfloat16 and other extension float types
            a = a.astype(np.float32)
    return a.reshape(-1)


def _split_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    body = x.size - x.size % _ROW
    return x[:body].reshape(-1, _ROW), (x[body:] if body < x.size else None)


def _row_precision(x: np.ndarray) -> np.ndarray:
    """float32 for half-precision arrays (their own precision is too coarse to accumulate in)."""
    return x.astype(np.float32) if x.dtype == np.float16 else x


def sum64(x: np.ndarray) -> float:
    """Sum of the flat array ``x`` accumulated in float64 (pairwise)."""
    return float(x.sum(dtype=np.float64))


def _norm_exact(x: np.ndarray) -> float:
    y = x.astype(np.float64, copy=False)
    return math.sqrt(float(np.dot(y, y)))


def norm64(x: np.ndarray) -> float:
    """L2 norm of the flat array ``x`` (see the module docstring)."""
    if x.dtype == np.float64 or x.size < _NORM_ROWS_FROM:
        return _norm_exact(x)
    rows, tail = _split_rows(_row_precision(x))
    squares = float(np.einsum("ij,ij->i", rows, rows).sum(dtype=np.float64))
    if tail is not None:
        squares += float(np.dot(tail.astype(np.float64), tail.astype(np.float64)))
    norm = math.sqrt(squares)
    if _NORM_SAFE[0] < norm < _NORM_SAFE[1] or math.isnan(norm):
        return norm
    return _norm_exact(x)


class NumpyStats:
    """Computes a fixed list of ops for host arrays; each row is a ``list[float]``.

    Args:
        ops: op names from :data:`trainprobe.engine.stats.ops.ALL_OPS`, in output order.
        eps: threshold of the ``zeros`` op (fraction of elements with ``abs(x) < eps``).

    Example:
        >>> NumpyStats(["min", "max", "nans"]).row(np.array([1.0, np.nan, 3.0]))
        [nan, nan, 1.0]
    """

    def __init__(self, ops: Sequence[str], eps: float = 1e-8) -> None:
        unknown = [op for op in ops if op not in ALL_OPS]
        if unknown:
            raise ValueError(f"unknown ops {unknown}; expected names from {', '.join(ALL_OPS)}")
        self.ops = tuple(ops)
        self.eps = float(eps)
        self._empty = [EMPTY_TENSOR_VALUES[op] for op in self.ops]
        self._minmax = "min" in self.ops or "max" in self.ops
        self._mean, self._norm, self._zeros = ("mean" in self.ops, "norm" in self.ops, "zeros" in self.ops)
        self._nans = "nans" in self.ops
        self._proofs = tuple(i for i, op in enumerate(("max", "mean", "norm")) if op in self.ops)
        self._order = tuple(_FOUND.index(op) for op in self.ops)

    def row(self, a: np.ndarray) -> list[float]:
        """Statistics of one array, in the order of ``ops`` (Python floats)."""
        x = as_real_array(np.asarray(a))
        n = x.size
        if n == 0:
            return list(self._empty)
        lo = hi = mean = norm = nans = zeros = 0.0
        if self._minmax:
            lo, hi = float(x.min()), float(x.max())
        if n < _NORM_ROWS_FROM and (self._mean or self._norm):  # one float64 copy serves both
            y = x.astype(np.float64, copy=False)
            if self._minmax and x.dtype != np.float64 and math.isfinite(lo) and math.isfinite(hi):
                mean, norm = float(y.sum()) / n, math.sqrt(float(np.dot(y, y)))  # cannot overflow
            else:  # infinities, NaN or huge float64 values: inf/NaN results, without NumPy's warnings
                with np.errstate(over="ignore", invalid="ignore"):
                    mean, norm = float(y.sum()) / n, math.sqrt(float(np.dot(y, y)))
        else:
            if self._mean:
                mean = sum64(x) / n
            if self._norm:
                norm = norm64(x)
        if self._nans:
            proof = (hi, mean, norm)
            if not self._proofs or any(math.isnan(proof[i]) for i in self._proofs):
                nans = float(np.count_nonzero(np.isnan(x)))
        if self._zeros:
            zeros = float(np.count_nonzero(np.abs(x) < self.eps)) / n
        found = (lo, hi, mean, norm, nans, zeros)
        return [found[i] for i in self._order]

    def rows(self, arrays: Sequence[np.ndarray]) -> list[list[float]]:
        """Statistics of several arrays, one row each, in order."""
        return [self.row(a) for a in arrays]
