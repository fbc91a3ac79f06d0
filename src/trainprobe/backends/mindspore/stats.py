"""MindSpore tensors → rows of statistics (``list[float]``, in the order of ``ops``).

Two paths, chosen once per kernel from MindSpore's device target:

* ``CPU``: ``Tensor.asnumpy()`` is a view of the tensor's memory (no copy), summarised by
  :class:`~trainprobe.engine.stats.numpy_stats.NumpyStats` (float64 accumulation, as the PyTorch CPU
  kernel). MindSpore's own operators are not used here: each costs milliseconds of dispatch
  and synchronisation in PyNative on the CPU, and the CPU build lacks ``LinalgVectorNorm``
  (``mint.norm``, ``mint.linalg.vector_norm``) and ``CountNonZero``.
* ``GPU``/``Ascend``: reductions with operators every MindSpore build has (``ReduceMin``,
  ``ReduceMax``, ``ReduceSum``, ``Square``, ``Sqrt``, ``IsNan``, ``Abs``, ``Less``, ``Select``,
  ``Cast``), accumulated in float32, stacked, and read back once per tensor. MindSpore's
  min/max reductions skip NaN; a tensor holding NaN gets NaN min and max, as on the CPU path. This path runs on the CPU
  too (``device_path=True``, used by the tests), but has not been measured on an accelerator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import ops as msops

from trainprobe.backends.mindspore.runtime import device_target
from trainprobe.engine.stats.numpy_stats import NumpyStats, as_real_array
from trainprobe.engine.stats.ops import ALL_OPS, EMPTY_TENSOR_VALUES

_FLOATS = (ms.float16, ms.float32, ms.float64, ms.bfloat16)


def host_array(t: Any) -> np.ndarray:
    """The host memory of ``t`` as a NumPy array (a view on the CPU); arrays pass through."""
    return t if isinstance(t, np.ndarray) else t.asnumpy()


class MindSporeStats:
    """Computes a fixed list of ops for MindSpore tensors (or NumPy arrays).

    Args:
        ops: op names from :data:`trainprobe.engine.stats.ops.ALL_OPS`, in output order.
        eps: threshold of the ``zeros`` op.
        device_path: use MindSpore operators instead of NumPy (default: on any device target
            but ``CPU``).
    """

    def __init__(self, ops: Sequence[str], eps: float = 1e-8, *, device_path: bool | None = None) -> None:
        self.host = NumpyStats(ops, eps)
        self.ops = self.host.ops
        self.eps = self.host.eps
        self.device_path = device_target() != "CPU" if device_path is None else device_path

    def row(self, t: Any) -> list[float]:
        """Statistics of one tensor."""
        if self.device_path and not isinstance(t, np.ndarray):
            return self._device_row(t)
        return self.host.row(host_array(t))

    def rows(self, tensors: Sequence[Any]) -> list[list[float]]:
        """Statistics of several tensors, one row each, in order."""
        return [self.row(t) for t in tensors]

    def between_steps(self) -> None:
        """Nothing to switch between steps (MindSpore has no meta tensors either: no row is None)."""

    def accumulate(self, total: Any, grad: Any) -> Any:
        """``total + grad`` without changing either (``total`` None: a copy of ``grad``), in
        float32 at least; what :meth:`row` reads. Used to sum micro-batch gradients."""
        if self.device_path:
            g = grad.astype(ms.float32) if grad.dtype in (ms.float16, ms.bfloat16) else grad
            return g.copy() if total is None else total + g
        a = as_real_array(host_array(grad))
        if total is None:
            return a.astype(np.float64 if a.dtype == np.float64 else np.float32, copy=True)
        np.add(total, a, out=total)
        return total

    def _device_row(self, t: Any) -> list[float]:
        x = t.reshape(-1)
        if x.dtype in (ms.complex64, ms.complex128):
            x = msops.abs(x)
        if x.dtype not in _FLOATS or x.dtype in (ms.float16, ms.bfloat16):
            x = x.astype(ms.float32)
        n = x.size
        if n == 0:
            return [EMPTY_TENSOR_VALUES[op] for op in self.ops]
        parts = []
        nan = ms.Tensor(float("nan"), x.dtype)
        has_nan = msops.isnan(x).any() if "min" in self.ops or "max" in self.ops else None
        for op in self.ops:
            if op == "min":  # MindSpore's ReduceMin/ReduceMax skip NaN; the ops table propagates it
                parts.append(msops.select(has_nan, nan, x.min()))
            elif op == "max":
                parts.append(msops.select(has_nan, nan, x.max()))
            elif op == "mean":
                parts.append(x.sum() / n)
            elif op == "norm":
                parts.append(msops.sqrt(msops.square(x).sum()))
            elif op == "nans":
                parts.append(msops.isnan(x).astype(ms.int32).sum())
            else:
                assert op in ALL_OPS
                parts.append((msops.abs(x) < self.eps).astype(ms.int32).sum().astype(ms.float64) / n)
        stacked = msops.stack([p.astype(ms.float64).reshape(()) for p in parts])
        return [float(v) for v in stacked.asnumpy()]
