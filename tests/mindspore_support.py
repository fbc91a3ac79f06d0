"""Shared helpers of the MindSpore tests: a usable MindSpore or a clean skip, small models,
float64 NumPy references.

Importing this module skips the importing test module when MindSpore is not installed
(``pytest.importorskip``) or cannot run an operator here (MindSpore's wheels need NumPy < 2).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

try:
    import trainprobe.mindspore  # noqa: E402, F401 - checks that MindSpore can work here
except ImportError as exc:  # installed but unusable (NumPy 2): skip, saying why
    pytest.skip(f"MindSpore is installed but unusable here: {exc}", allow_module_level=True)

from mindspore import Tensor, nn  # noqa: E402, F401 - re-exported for the tests

try:
    ms.set_device("CPU")
except RuntimeError:  # the runtime already started (on the CPU, the only device here)
    pass
ms.set_context(mode=ms.PYNATIVE_MODE)

OPS = ["min", "max", "mean", "norm", "nans"]


class MsMLP(nn.Cell):
    """Dense → ReLU → Dense, named like ``tests/models.py``'s PyTorch ``MLP``."""

    def __init__(self, d_in: int = 6, hidden: int = 16, d_out: int = 3) -> None:
        super().__init__()
        self.fc1 = nn.Dense(d_in, hidden)
        self.act = nn.ReLU()
        self.fc2 = nn.Dense(hidden, d_out)

    def construct(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


def stats64(a: Any) -> dict[str, float]:
    """Float64 NumPy reference statistics of a MindSpore tensor or an array."""
    x = np.asarray(a.asnumpy() if hasattr(a, "asnumpy") else a, dtype=np.float64).ravel()
    return {
        "min": float(x.min()),
        "max": float(x.max()),
        "mean": float(x.mean()),
        "norm": float(np.sqrt(np.sum(x * x))),
        "nans": float(np.isnan(x).sum()),
    }


def assert_row_matches(row: dict[str, str], a: Any, rel: float = 1e-6) -> None:
    """The CSV row's statistics equal ``a``'s float64 reference to ``rel`` relative."""
    for op, value in stats64(a).items():
        if op in row:
            got = float(row[op])
            assert got == pytest.approx(value, rel=rel, abs=1e-12), f"{row['module_name']} {op}: {got} vs {value}"


def snapshot(params: Any) -> dict[str, np.ndarray]:
    """Copies of the values of ``(name, tensor)`` pairs."""
    return {name: p.asnumpy().copy() for name, p in params}


def cell_hooks_left(*cells: nn.Cell) -> int:
    """Forward pre-/post-hooks still registered on ``cells`` and their sub-cells."""
    count = 0
    for cell in cells:
        for _, c in cell.cells_and_names():
            count += len(c._forward_pre_hook) + len(c._forward_hook)
    return count
