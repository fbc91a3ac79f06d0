"""PyTorch kernels that turn tensors into the statistics named in :mod:`trainprobe.engine.stats.ops`.

Two strategies, picked per tensor by its device, both returning values in the order of ``ops``:

* CPU tensors: a call of :meth:`TensorStats.rows` summarises all its CPU tensors together and
  reads the values back at once (on the CPU a read-back is not a device sync). Tensors of fewer
  than 4,096 elements are stacked by shape and dtype when 6 or more share one, and reduced one
  kernel per op for the whole group; larger ones get three kernels each (``aminmax``, row sums,
  row norms over rows of 256 elements) and the per-row partial results of all of them are
  combined in float64 by one segmented reduction per op. A tensor in a smaller group, or the
  only large one, takes the direct path (:meth:`TensorStats.row`'s): below 4,096 elements the
  engine's NumPy kernels on a view of its memory, above that fewer kernels. NaN counting is
  lazy: min, max, mean and norm propagate NaN, so when one of them is not NaN the tensor has no
  NaN and the counting pass is skipped. A transposed or permuted tensor that fills one dense
  block is read in memory order; other strided tensors are copied once. Result: a
  ``list[float]`` per tensor.
  Where a single pass is selected (:mod:`trainprobe.backends.torch.fused_stats`: on by default
  on the CPU for float32, a C kernel built aside), a tensor's min, max, sum and sum of squares from 4,096
  elements on come from it instead: one read, the sums accumulated in float64.
* Accelerator tensors: every value stays on the device, with no host synchronisation; rows are
  stacked and copied to the host once per monitor per step by :mod:`trainprobe.engine.records`.
  Result: a float64 tensor of shape ``[len(ops)]``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
import torch

from trainprobe.backends.torch.fused_stats import FusedStats, Reductions
from trainprobe.backends.torch.numpy_view import numpy_view
from trainprobe.engine.stats.numpy_stats import NumpyStats
from trainprobe.engine.stats.ops import ALL_OPS, EMPTY_TENSOR_VALUES

RowValues = list | torch.Tensor
"""One row of statistics: host floats (CPU tensors) or a float64 device tensor."""

_PLAIN_FLOATS = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16})


def as_statistic_input(t: torch.Tensor) -> torch.Tensor:
    """The real floating-point tensor whose statistics describe ``t`` (no copy for floats).

    Gradients are detached; DTensor shards are summarised locally; integer and boolean tensors
    become float64; complex tensors their magnitude; sparse tensors their stored values.

    Raises:
        ValueError: ``t`` is a meta tensor.
    """
    if t.is_meta:
        raise ValueError("a meta tensor holds no data to summarise")
    x = t.detach()
    to_local = getattr(x, "to_local", None)
    if to_local is not None and type(x) is not torch.Tensor:
        x = to_local()
    if x.layout != torch.strided:
        x = x.coalesce().values() if x.is_sparse else x.to_dense()
    if x.is_complex():
        x = x.abs()
    if not x.is_floating_point():
        x = x.to(torch.float64)
    return x


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_set_grad_enabled = torch._C._set_grad_enabled


def _fast_input(t: torch.Tensor) -> torch.Tensor:
    """:func:`as_statistic_input`, with the common case first: a dense float tensor or parameter
    is used as it is (``rows`` runs under ``no_grad``, so no graph is recorded), in memory order
    (:func:`in_memory_order`)."""
    if type(t) in _PLAIN_TYPES and t.dtype in _PLAIN_FLOATS and t.layout == torch.strided and not t.is_meta:
        return t if t.is_contiguous() else in_memory_order(t)
    if t.is_meta:
        return t  # no values: its row is None (TensorStats._row_of)
    return in_memory_order(as_statistic_input(t))


def in_memory_order(x: torch.Tensor) -> torch.Tensor:
    """``x``'s elements as a contiguous view when they fill one dense block of memory in another
    order (a transpose or permute, such as attention's ``[batch, heads, seq, dim]`` views), else
    ``x``. The view permutes ``x``'s dimensions (no copy): min, max, sums and counts do not depend
    on the order of the elements, and a contiguous tensor takes the one-read pass and the fast
    kernels where a strided one needs a copy first (2.6 against 0.5 ns an element, measured)."""
    if x.is_contiguous():
        return x
    strides = x.stride()
    y = x.permute(sorted(range(x.dim()), key=strides.__getitem__, reverse=True))
    return y if y.is_contiguous() else x


_NUMPY_BELOW = 1 << 12
_NUMPY_FLOATS = frozenset({torch.float32, torch.float64})
"""A tensor alone of fewer elements and of these dtypes is summarised by NumPy
(:meth:`TensorStats._small_row`): the fixed cost of a row is then 10-14 µs instead of 20-28 µs
(measured on the 2-core machine of docs/performance.md)."""
_STACK_FROM = 6
"""Small tensors of one shape are stacked and reduced together from this many on; fewer are
summarised one by one (:meth:`TensorStats._small_row`: a stack costs ~45 µs of kernels whatever
its size, a tensor alone ~6-10 µs)."""
_VECTOR_FINISH_FROM = 16
"""Rows from which a batch is finished (NaN counts, sizes, overflow checks) by kernels over all
rows rather than by Python per row."""
_HOST_ROW_ORDER = ("min", "max", "mean", "norm", "nans", "zeros")
_ROW = 256
_EXACT_BELOW = 1 << 16
_NORM_ROWS_FROM = 1 << 12
_NORM_SAFE = (1e-15, 1e18)


def _split_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` flattened into rows of 256 elements, and the tail that does not fill a row (or None)."""
    flat = x.reshape(-1)
    n = flat.numel()
    body = n - n % _ROW
    if body == n:
        return flat.view(-1, _ROW), None
    return flat[:body].view(-1, _ROW), flat[body:]


_ROW_ACCUMULATOR = {torch.float16: torch.float32, torch.bfloat16: torch.float32}
"""float32 accumulation inside a row for half types (their own precision is too coarse)."""


@functools.lru_cache(maxsize=256)
def _lengths_tensor(lengths: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(lengths, dtype=torch.int64)


def _segment_sums(values: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Sums of consecutive segments of ``values`` (float64), one per entry of ``lengths``."""
    return torch.segment_reduce(values, "sum", lengths=_lengths_tensor(tuple(lengths)))


@functools.lru_cache(maxsize=256)
def _sizes_tensor(numels: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(numels, dtype=torch.float64)


def _true_rows(flags: list[torch.Tensor]) -> list[int]:
    """Indices where any of the boolean columns ``flags`` is true (one read-back)."""
    if not flags:
        return []
    any_flag = flags[0]
    for more in flags[1:]:
        any_flag = any_flag | more
    return any_flag.nonzero().flatten().tolist()


def sum64(x: torch.Tensor) -> torch.Tensor:
    """Sum of ``x`` with float64 accumulation (a 0-d float64 tensor on ``x``'s device).

    Below 65,536 elements, float64 tensors and on accelerators: one float64-accumulating
    reduction (exact to float64 rounding). Larger CPU tensors: rows of 256 elements summed in
    float32 and the row sums added in float64, without the float64 copy a float64 reduction
    makes on the CPU (4-10x slower). The error is then the float32 rounding of the row sums:
    at most ~9 u times the root of their summed squares (u = 2**-24; measured on zero-mean,
    offset, cancelling, gradient-like and 12-decade-wide data), about 6e-8 x the L2 norm for
    zero-mean values. So the mean is within 1e-6 x max(|mean|, norm / n) of the float64 mean:
    1e-6 relative unless the values cancel. (Redoing cancelling sums in float64 was measured at
    2.4-4.4 ms per step on the GPT benchmark: the gradients of weights that feed a
    normalisation sum to zero by construction, and their float64 mean is rounding noise.)
    """
    if x.dtype == torch.float64:
        return x.sum()
    if x.numel() < _EXACT_BELOW or x.device.type != "cpu":
        return x.sum(dtype=torch.float64)
    rows, tail = _split_rows(x)
    total = rows.sum(1, dtype=_ROW_ACCUMULATOR.get(x.dtype)).sum(dtype=torch.float64)
    if tail is not None:
        total = total + tail.sum(dtype=torch.float64)
    return total


def norm64(x: torch.Tensor) -> torch.Tensor:
    """L2 norm of ``x`` with float64 accumulation across rows (a 0-d float64 tensor).

    Below 4,096 elements: one float64 reduction. Above: the norms of rows of 256 elements in
    float32, combined in float64. A flat float32 norm of 4M elements is off by up to 1e-4
    relative (measured), this by about 1e-10, at the speed of the flat float32 reduction.
    Squares of float32 values beyond about 1e18 overflow and below 1e-19 underflow inside a row:
    :class:`TensorStats` redoes such results as one float64 reduction.
    """
    if x.dtype == torch.float64:
        return torch.linalg.vector_norm(x)
    if x.numel() < _NORM_ROWS_FROM:
        return torch.linalg.vector_norm(x, dtype=torch.float64)
    rows, tail = _split_rows(x)
    row_norms = torch.linalg.vector_norm(rows, dim=1, dtype=_ROW_ACCUMULATOR.get(x.dtype))
    total = torch.linalg.vector_norm(row_norms, dtype=torch.float64)
    if tail is not None:
        total = torch.hypot(total, torch.linalg.vector_norm(tail, dtype=torch.float64))
    return total


_CHUNKED_FROM = 1 << 12
_CHUNK = 1 << 18
"""Elements per chunk of :func:`_chunked_float32` (1 MiB of float32: a chunk read for its minimum
and maximum is still in the core's cache for the row sums and row norms that follow)."""


def _chunked_float32(
    x: torch.Tensor, want_sum: bool, want_norm: bool
) -> tuple[float, float, float | None, float | None] | None:
    """Min, max, float64-accumulated sum and L2 norm of a contiguous CPU float32 tensor of 4,096
    elements or more, bit for bit what ``aminmax``, :func:`sum64` and :func:`norm64` give, or
    None when ``x`` does not qualify (then the caller takes those functions).

    Why it is faster: ``aminmax`` is replaced by NumPy's minimum and maximum (SIMD, about twice as
    fast on data in cache; a minimum or maximum is one of the elements, so any order of
    comparison finds the same value), and a tensor of more than :data:`_CHUNK` elements is
    processed chunk by chunk, each chunk's minimum, maximum, row sums and row norms computed while
    it is in cache (one pass over memory instead of three). The row sums and row norms are the
    very kernels of :func:`sum64` / :func:`norm64` on the same rows of 256 elements; the
    concatenated per-row results are combined by the same float64 reductions, so the values are
    identical. A minimum or maximum of zero is redone with ``aminmax`` (NumPy and torch may pick
    a different one of ``0.0`` and ``-0.0``); NaN propagates through both.
    """
    n = x.numel()
    if (
        x.dtype != torch.float32
        or n < _CHUNKED_FROM
        or x.device.type != "cpu"
        or type(x) not in _PLAIN_TYPES
        or not x.is_contiguous()
        or (n > _CHUNK and n % _ROW)
    ):
        return None
    flat = x.detach().view(-1)
    values = numpy_view(flat)
    f64 = torch.float64
    if n <= _CHUNK:
        lo, hi = float(values.min()), float(values.max())
        total = sum64(flat).item() if want_sum else None
        norm = norm64(flat).item() if want_norm else None
    else:  # more than 65,536 elements, a multiple of 256: sum64/norm64 take their row paths
        los, his, sums, norms = [], [], [], []
        for start in range(0, n, _CHUNK):
            part = values[start : start + _CHUNK]
            los.append(part.min())
            his.append(part.max())
            rows = flat[start : start + _CHUNK].view(-1, _ROW)
            if want_sum:
                sums.append(rows.sum(1))
            if want_norm:
                norms.append(torch.linalg.vector_norm(rows, dim=1))
        lo, hi = float(np.minimum.reduce(los)), float(np.maximum.reduce(his))  # NaN propagates
        total = torch.cat(sums).sum(dtype=f64).item() if want_sum else None
        norm = torch.linalg.vector_norm(torch.cat(norms), dtype=f64).item() if want_norm else None
    if lo == 0.0 or hi == 0.0:
        a, b = torch.aminmax(flat)
        lo, hi = a.item(), b.item()
    return lo, hi, total, norm


def eager_reductions(x: torch.Tensor) -> Reductions:
    """min, max, sum and sum of squares of ``x`` by the eager kernels this module uses."""
    lo, hi = torch.aminmax(x)
    if x.device.type == "cpu":
        return lo, hi, sum64(x), norm64(x).square()
    return lo, hi, sum64(x), torch.linalg.vector_norm(x, dtype=torch.float64).square()


def _fastest_eager(x: torch.Tensor) -> object:
    """What a CPU float32 tensor's statistics cost without the fused pass (the chunked path where
    it applies): the baseline ``auto`` times the fused pass against."""
    return _chunked_float32(x, True, True) or eager_reductions(x)


_SHARED_FUSED: list[FusedStats] = []


def shared_fused() -> FusedStats:
    """The process's fused-pass selector, made on first use; its mode is read from
    ``TRAINPROBE_FUSED_STATS`` at each call of this function (statistics made afterwards see it)."""
    if not _SHARED_FUSED:
        _SHARED_FUSED.append(FusedStats(eager_reductions, baseline=_fastest_eager))
    _SHARED_FUSED[0].refresh()
    return _SHARED_FUSED[0]


class TensorStats:
    """Computes a fixed list of ops for tensors.

    Args:
        ops: op names from :data:`trainprobe.engine.stats.ops.ALL_OPS`, in output order.
        eps: threshold of the ``zeros`` op (fraction of elements with ``abs(x) < eps``).
        fused: the fused-pass selector (default: the process's, see :func:`shared_fused`); used
            for large tensors when at least two of min/max, mean and norm are asked for.

    Example:
        >>> TensorStats(["min", "max", "nans"]).row(torch.tensor([1.0, float("nan"), 3.0]))
        [nan, nan, 1.0]
    """

    def __init__(self, ops: Sequence[str], eps: float = 1e-8, fused: FusedStats | None = None) -> None:
        unknown = [op for op in ops if op not in ALL_OPS]
        assert not unknown, f"unknown ops {unknown}"
        self.ops = tuple(ops)
        self.eps = float(eps)
        wanted = ("min" in ops or "max" in ops) + ("mean" in ops) + ("norm" in ops)
        self._fused = (fused or shared_fused()) if wanted >= 2 else None
        self._empty = [EMPTY_TENSOR_VALUES[op] for op in self.ops]
        # where each op sits among the columns of every op but nans (see _nan_column)
        plain = [op for op in self.ops if op != "nans"]
        self._nan_at = self.ops.index("nans") if "nans" in self.ops else None
        self._mean_at = plain.index("mean") if "mean" in plain else None
        self._zeros_at = plain.index("zeros") if "zeros" in plain else None
        self._norm_at = plain.index("norm") if "norm" in plain else None
        self._nan_proof_at = [j for j, op in enumerate(plain) if op in ("max", "norm", "mean")]
        self._plain = tuple(plain)
        self._want_minmax = "min" in self.ops or "max" in self.ops
        self._want_mean, self._want_norm, self._want_zeros = ("mean" in ops, "norm" in ops, "zeros" in ops)
        self._order = tuple(_HOST_ROW_ORDER.index(op) for op in self.ops)
        self._proof_ops = tuple(j for j, op in enumerate(("max", "mean", "norm")) if op in self.ops)
        self._mean_pos = self.ops.index("mean") if "mean" in self.ops else None  # in a finished row
        self._norm_pos = self.ops.index("norm") if "norm" in self.ops else None
        self._numpy = NumpyStats(self.ops, self.eps)
        self._minmax_at = tuple(j for j, op in enumerate(self.ops) if op in ("min", "max"))

    def between_steps(self) -> None:
        """Called between two training steps: the one-read pass, if a child process built it
        since start, serves from the next step on (:meth:`FusedStats.step_boundary`)."""
        if self._fused is not None:
            self._fused.step_boundary()

    @property
    def fused(self) -> FusedStats | None:
        """The fused-pass selector these statistics ask first (None: the ops need no two reductions)."""
        return self._fused

    def row(self, t: torch.Tensor) -> RowValues | None:
        """Statistics of one tensor: host floats for CPU tensors, a device tensor otherwise, None
        for a tensor without values (``device="meta"``: a shape and a dtype only; the monitors
        write no row for it, the dump null statistics)."""
        enabled = torch.is_grad_enabled()
        if enabled:
            _set_grad_enabled(False)
        try:
            return self._row_of(_fast_input(t))
        finally:
            if enabled:
                _set_grad_enabled(True)

    def _row_of(self, x: torch.Tensor) -> RowValues | None:
        if x.numel() == 0:
            return None if x.is_meta else list(self._empty)
        if x.device.type != "cpu":
            return None if x.is_meta else self._device_row(x)
        return self._host_row(x)

    def _host_row(self, x: torch.Tensor) -> list[float]:
        """One CPU tensor on its own: the arithmetic of the batched paths (float64 below 4,096
        elements, rows of 256 combined in float64 above) in the fewest kernels, no batching,
        and no per-op containers (the module monitor runs this once per tensor and call).
        Without a compiled single pass, contiguous float32 tensors take :func:`_chunked_float32`:
        the eager kernels' values, fewer passes over memory. A strided tensor (not one dense
        block, see :func:`in_memory_order`) is copied once into a contiguous one first: one copy
        and one read instead of the two copies and three strided reads of the eager kernels."""
        if not x.is_contiguous():
            x = x.contiguous()
        n = x.numel()
        if n < _NUMPY_BELOW and x.dtype in _NUMPY_FLOATS and type(x) in _PLAIN_TYPES:
            return self._small_row(x, numpy_view(x))
        lo = hi = total = norm = zeros = 0.0
        one_pass = self._fused(x) if self._fused is not None else None
        if one_pass is not None:
            lo, hi, total, squares = (v.item() for v in one_pass)
            norm = math.sqrt(squares)
        else:
            chunked = _chunked_float32(x, self._want_mean, self._want_norm) if self._want_minmax else None
            if chunked is not None:
                lo, hi, chunk_total, chunk_norm = chunked
                if chunk_total is not None:
                    total = chunk_total
                if chunk_norm is not None:
                    norm = chunk_norm
            else:
                if self._want_minmax:
                    a, b = torch.aminmax(x)
                    lo, hi = a.item(), b.item()
                if self._want_mean:
                    total = sum64(x).item()
                if self._want_norm:
                    norm = norm64(x).item()
        if self._want_zeros:
            zeros = torch.count_nonzero(x.abs() < self.eps).item() / n
        if x.dtype != torch.float64:  # float32 partial results that overflowed or underflowed
            if self._want_mean and not math.isfinite(total):
                total = x.sum(dtype=torch.float64).item()
            if self._want_norm and not (_NORM_SAFE[0] < norm < _NORM_SAFE[1]) and norm == norm:
                norm = torch.linalg.vector_norm(x, dtype=torch.float64).item()
        mean = total / n
        nans = 0.0
        if self._nan_at is not None:
            proof = (hi, mean, norm)
            if not self._proof_ops or any(proof[j] != proof[j] for j in self._proof_ops):
                nans = float(torch.count_nonzero(torch.isnan(x)).item())
        found = (lo, hi, mean, norm, nans, zeros)
        return [found[j] for j in self._order]

    def _small_row(self, x: torch.Tensor, v: np.ndarray) -> list[float]:
        """A contiguous CPU float32/float64 tensor of fewer than 4,096 elements, through the
        engine's NumPy kernels (:class:`~trainprobe.engine.stats.numpy_stats.NumpyStats`: min and
        max exact, sum and sum of squares accumulated in float64) at about half the fixed cost of
        torch's kernels and ``.item()`` calls; a minimum or maximum of zero is taken by torch
        (NumPy and torch may pick a different one of 0.0 and -0.0)."""
        row = self._numpy.row(v)
        at = self._minmax_at
        if at and any(row[j] == 0.0 for j in at):
            lo, hi = (t.item() for t in torch.aminmax(x))
            for j in at:
                row[j] = lo if self.ops[j] == "min" else hi
        return row

    def rows(self, tensors: Sequence[torch.Tensor]) -> list[RowValues | None]:
        """Statistics of several tensors, one row each, in order (None for a tensor without
        values, see :meth:`row`).

        Summarising a step's tensors in one call is much cheaper than one call per tensor on
        the CPU: small tensors of one size (a model's biases and norm weights) share their
        kernels, and the float64 combination of every large tensor's partial sums is one
        kernel per op (see the module docstring).
        """
        enabled = torch.is_grad_enabled()  # no_grad without its Python context manager
        if enabled:
            _set_grad_enabled(False)
        try:
            if len(tensors) == 1:
                return [self._row_of(_fast_input(tensors[0]))]
            return self._rows([_fast_input(t) for t in tensors])
        finally:
            if enabled:
                _set_grad_enabled(True)

    def _rows(self, xs: list[torch.Tensor]) -> list[RowValues | None]:
        out: list[RowValues | None] = [[] for _ in xs]
        small: dict[tuple[torch.Size, torch.dtype], list[int]] = {}
        large: list[int] = []
        for i, x in enumerate(xs):
            n = x.numel()
            if n == 0:
                out[i] = None if x.is_meta else list(self._empty)
                continue
            if not x.is_cpu:
                out[i] = None if x.is_meta else self._device_row(x)
                continue
            if not x.is_contiguous():  # one copy, then the contiguous paths (see _host_row)
                x = xs[i] = x.contiguous()
            if n < _NORM_ROWS_FROM:
                small.setdefault((x.shape, x.dtype), []).append(i)
            else:
                large.append(i)
        for members in small.values():
            if len(members) < _STACK_FROM:
                for i in members:
                    out[i] = self._host_row(xs[i])
                continue
            block = torch.stack([xs[i] for i in members]).view(len(members), -1)
            for i, values in zip(members, self._host_block(block)):
                out[i] = values
        if len(large) == 1:
            out[large[0]] = self._host_row(xs[large[0]])
        elif large:
            for i, values in zip(large, self._host_large([xs[i] for i in large])):
                out[i] = values
        return out

    def _host_block(self, block: torch.Tensor) -> list[list[float]]:
        """Rows of a ``[k, n]`` CPU block of k tensors of n < 4,096 elements (float64 sums and norms)."""
        n = block.shape[1]
        ops = self.ops
        cols: dict[str, torch.Tensor] = {}
        if "min" in ops:  # not aminmax: along a dimension it is ~15x slower than amin + amax on the CPU
            cols["min"] = torch.amin(block, dim=1)
        if "max" in ops:
            cols["max"] = torch.amax(block, dim=1)
        if "mean" in ops:
            cols["mean"] = block.sum(1, dtype=torch.float64) / n
        if "norm" in ops:
            cols["norm"] = torch.linalg.vector_norm(block, dim=1, dtype=torch.float64)
        if "zeros" in ops:
            cols["zeros"] = torch.count_nonzero(block.abs() < self.eps, dim=1).to(torch.float64) / n
        present = [cols[op].to(torch.float64) for op in self._plain]
        k = block.shape[0]
        if k < _VECTOR_FINISH_FROM:
            return self._few_rows(present, block, None)
        if self._nan_at is not None:
            present.insert(self._nan_at, self._nan_column(present, k, block))
        return torch.stack(present, 1).tolist() if present else [[] for _ in range(k)]

    def _host_large(self, xs: list[torch.Tensor]) -> list[list[float]]:
        """Rows of CPU tensors of 4,096 elements or more: three kernels per tensor (``aminmax``
        first: it reads the tensor from memory, the row reductions then find it in cache), and
        one float64 segmented reduction per op for all of them."""
        ops = self.ops
        minmax, want_sum, want_norm = "min" in ops or "max" in ops, "mean" in ops, "norm" in ops
        want_zeros = "zeros" in ops
        f64 = torch.float64
        los: list[torch.Tensor] = []
        his: list[torch.Tensor] = []
        sums: list[torch.Tensor] = []
        norms: list[torch.Tensor] = []
        zeros: list[torch.Tensor] = []
        lengths: list[int] = []
        numels: list[int] = []
        for x in xs:
            n = x.numel()
            numels.append(n)
            if want_zeros:
                zeros.append(torch.count_nonzero(x.abs() < self.eps))
            one_pass = self._fused(x) if self._fused is not None else None
            if one_pass is not None:  # one read: its float64 totals are this tensor's one segment
                los.append(one_pass[0])
                his.append(one_pass[1])
                sums.append(one_pass[2].reshape(1))
                norms.append(one_pass[3].sqrt().reshape(1))
                lengths.append(1)
                continue
            rows, tail = _split_rows(x)
            acc = _ROW_ACCUMULATOR.get(x.dtype)
            if minmax:
                lo, hi = torch.aminmax(x)
                los.append(lo)
                his.append(hi)
            if want_sum:  # float64 throughout below 65,536 elements, as sum64 does
                sums.append(rows.sum(1, dtype=f64 if n < _EXACT_BELOW else acc))
            if want_norm:
                norms.append(torch.linalg.vector_norm(rows, dim=1, dtype=acc))
            if tail is not None:
                if want_sum:
                    sums.append(tail.sum(dtype=f64).reshape(1))
                if want_norm:
                    norms.append(torch.linalg.vector_norm(tail, dtype=f64).reshape(1))
            lengths.append(rows.shape[0] + (tail is not None))
        cols: dict[str, torch.Tensor] = {}
        if minmax:
            cols["min"], cols["max"] = torch.stack(los), torch.stack(his)
        if want_sum:
            cols["mean"] = _segment_sums(torch.cat(sums).to(f64), lengths)
        if want_norm:
            cols["norm"] = _segment_sums(torch.cat(norms).to(f64).square(), lengths).sqrt()
        if want_zeros:
            cols["zeros"] = torch.stack(zeros)
        return self._large_table(cols, xs, numels)

    def _large_table(
        self, cols: dict[str, torch.Tensor], xs: list[torch.Tensor], numels: list[int]
    ) -> list[list[float]]:
        """Host rows from the columns of :meth:`_host_large` (sums and counts): means and zero
        fractions divided by the sizes and NaN counts inserted with a few kernels for all rows;
        then, for the rare rows whose float32 partial results may have overflowed or underflowed
        (a non-finite sum, a norm outside (1e-15, 1e18)), their redo (:meth:`_redo_row`)."""
        f64 = torch.float64
        present = [cols[op].to(f64) for op in self._plain]
        if len(xs) < _VECTOR_FINISH_FROM:
            return self._few_rows(present, xs, numels)
        mean_at, norm_at = self._mean_at, self._norm_at
        suspects: list[torch.Tensor] = []
        if mean_at is not None:
            suspects.append(~torch.isfinite(present[mean_at]))
        if norm_at is not None:
            norm = present[norm_at]
            suspects.append((norm <= _NORM_SAFE[0]) | (norm >= _NORM_SAFE[1]) | torch.isnan(norm))
        redo = _true_rows(suspects)
        sizes = _sizes_tensor(tuple(numels))
        for at in (mean_at, self._zeros_at):
            if at is not None:
                present[at] = present[at] / sizes
        if self._nan_at is not None:
            present.insert(self._nan_at, self._nan_column(present, len(xs), xs))
        table = torch.stack(present, 1).tolist() if present else [[] for _ in xs]
        for r in redo:
            self._redo_row(table[r], xs[r], numels[r])
        return table

    def _few_rows(
        self, present: list[torch.Tensor], xs: Sequence[torch.Tensor] | torch.Tensor, numels: list[int] | None
    ) -> list[list[float]]:
        """What :meth:`_large_table` (with ``numels``) and :meth:`_host_block` (without) do, row
        by row in Python: cheaper than their fixed kernels for fewer than 16 rows."""
        k = len(xs)
        table = torch.stack(present, 1).tolist() if present else [[] for _ in range(k)]
        nan_at, proof = self._nan_at, self._nan_proof_at
        mean_at, zeros_at = self._mean_at, self._zeros_at
        for r, values in enumerate(table):
            if numels is not None:
                if mean_at is not None:
                    values[mean_at] /= numels[r]
                if zeros_at is not None:
                    values[zeros_at] /= numels[r]
            if nan_at is not None:
                clean = proof and not any(values[j] != values[j] for j in proof)
                values.insert(nan_at, 0.0 if clean else float(torch.count_nonzero(torch.isnan(xs[r])).item()))
            if numels is not None:
                self._redo_row(values, xs[r], numels[r])
        return table

    def _nan_column(
        self, present: list[torch.Tensor], k: int, xs: Sequence[torch.Tensor] | torch.Tensor
    ) -> torch.Tensor:
        """NaN counts of k rows (float64), counted only for rows whose min/max/mean/norm columns
        (``present``, every op but ``nans``) hold a NaN: where none does, the tensor has none."""
        proof = self._nan_proof_at
        rows = _true_rows([torch.isnan(present[j]) for j in proof]) if proof else list(range(k))
        column = torch.zeros(k, dtype=torch.float64)
        if rows:
            column[rows] = torch.stack([torch.count_nonzero(torch.isnan(xs[r])) for r in rows]).to(torch.float64)
        return column

    def _redo_row(self, values: list[float], x: torch.Tensor, n: int) -> None:
        """A finished row's non-finite mean and out-of-range (not NaN) norm redone as one float64
        reduction (float32 and half inputs only), as :meth:`_host_row` does."""
        if x.dtype == torch.float64:
            return
        mean_at, norm_at = self._mean_pos, self._norm_pos
        if mean_at is not None and not math.isfinite(values[mean_at]):
            values[mean_at] = x.sum(dtype=torch.float64).item() / n
        if norm_at is not None:
            norm = values[norm_at]
            if not (_NORM_SAFE[0] < norm < _NORM_SAFE[1]) and norm == norm:
                values[norm_at] = torch.linalg.vector_norm(x, dtype=torch.float64).item()

    def _device_row(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        found: dict[str, torch.Tensor] = {}
        ops = self.ops
        one_pass = self._fused(x) if self._fused is not None else None
        if one_pass is not None:
            found.update(min=one_pass[0], max=one_pass[1], mean=one_pass[2] / n, norm=one_pass[3].sqrt())
        else:
            if "min" in ops or "max" in ops:
                found["min"], found["max"] = torch.aminmax(x)
            if "mean" in ops:
                found["mean"] = sum64(x) / n
            if "norm" in ops:
                found["norm"] = torch.linalg.vector_norm(x, dtype=torch.float64)
        if "nans" in ops:
            found["nans"] = torch.count_nonzero(torch.isnan(x))
        if "zeros" in ops:
            found["zeros"] = torch.count_nonzero(x.abs() < self.eps).to(torch.float64) / n
        return torch.stack([found[op].to(torch.float64) for op in ops])
