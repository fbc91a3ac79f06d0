"""A read-only NumPy view of a CPU tensor's elements that leaves the tensor as it was.

``Tensor.numpy()`` marks the tensor's storage as not resizable, for good: NumPy holds a raw pointer
into it. A monitor that summarised a user's tensor through ``.numpy()`` would change that tensor:
FSDP, for one, frees its unsharded flat parameter after each forward and backward by resizing its
storage to zero, and fails with ``Trying to resize storage that is not resizable``. The view made
here describes the same memory through NumPy's array interface without touching the storage.

The array keeps its tensor alive: its ``base`` is an object holding a reference to the tensor, so
a view of a temporary (``numpy_view(x.contiguous())`` on a non-contiguous ``x``, whose copy
nothing else references) never reads freed memory. It is still only valid while the storage is
not resized, so it is used inside one statistics or checksum call and never kept.
"""

from __future__ import annotations

import numpy as np
import torch

_TYPESTR = {
    torch.float32: np.dtype(np.float32).str,
    torch.float64: np.dtype(np.float64).str,
    torch.uint8: np.dtype(np.uint8).str,
}


class _Described:
    """An object NumPy turns into an array without a copy (``__array_interface__``); it becomes
    the array's ``base`` and holds ``owner``, the tensor whose memory it describes."""

    __slots__ = ("__array_interface__", "owner")

    def __init__(self, interface: dict[str, object], owner: torch.Tensor) -> None:
        self.__array_interface__ = interface
        self.owner = owner


def numpy_view(x: torch.Tensor) -> np.ndarray:
    """The elements of the contiguous CPU tensor ``x`` (float32, float64 or uint8) as a flat,
    read-only NumPy array over the same memory; ``x`` and its storage are left unchanged, and
    ``x`` stays alive as long as the array (or any view of it) does.

    Example:
        >>> t = torch.tensor([1.0, 2.0])
        >>> numpy_view(t).sum(), t.untyped_storage().resize_(0).size()
        (np.float32(3.0), 0)
    """
    assert x.device.type == "cpu" and x.is_contiguous() and x.dtype in _TYPESTR, (x.device, x.dtype)
    interface = {"data": (x.data_ptr(), True), "shape": (x.numel(),), "typestr": _TYPESTR[x.dtype], "version": 3}
    return np.asarray(_Described(interface, x))
