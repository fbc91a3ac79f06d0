"""MindSpore statistics against a float64 NumPy reference (fp32 to 1e-6 relative)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mindspore_support import ms, stats64
from trainprobe.backends.mindspore.stats import MindSporeStats
from trainprobe.engine.stats.numpy_stats import NumpyStats

OPS = ["min", "max", "mean", "norm", "nans", "zeros"]
SIZES = [1, 96, 4095, 4096, 65537, 200003]


def data(kind: str, n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "normal":
        return rng.standard_normal(n).astype(np.float32)
    if kind == "offset":  # a mean that cancels badly in float32
        return (1000.0 + rng.standard_normal(n)).astype(np.float32)
    if kind == "wide":
        return (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 6, n)).astype(np.float32)
    raise AssertionError(kind)


def reference(a: np.ndarray, eps: float = 1e-8) -> list[float]:
    x = a.astype(np.float64).ravel()
    ref = stats64(x)
    ref["zeros"] = float(np.count_nonzero(np.abs(x) < eps)) / x.size
    return [ref[op] for op in OPS]


@pytest.mark.parametrize("kind", ["normal", "offset", "wide"])
@pytest.mark.parametrize("n", SIZES)
def test_host_kernel_matches_float64_reference(kind: str, n: int) -> None:
    a = data(kind, n)
    got = MindSporeStats(OPS).row(ms.Tensor(a.reshape(-1, 1) if n % 2 else a))
    assert got == pytest.approx(reference(a), rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("kind", ["normal", "offset"])
@pytest.mark.parametrize("n", [96, 4096, 65537])
def test_device_kernel_matches_float64_reference(kind: str, n: int) -> None:
    """The accelerator path (MindSpore operators, float32 accumulation) runs on the CPU build:
    min/max exact, the rest to float32 accumulation accuracy."""
    a = data(kind, n)
    got = MindSporeStats(OPS, device_path=True).row(ms.Tensor(a))
    ref = reference(a)
    assert got[:2] == ref[:2]
    assert got[2:] == pytest.approx(ref[2:], rel=2e-5, abs=1e-12)


def test_nan_inf_and_empty() -> None:
    a = np.array([1.0, np.nan, -np.inf, 2.0, 0.0], np.float32)
    for kernel in (MindSporeStats(OPS), MindSporeStats(OPS, device_path=True)):
        got = kernel.row(ms.Tensor(a))
        assert [math.isnan(v) for v in got[:4]] == [True] * 4
        assert got[4:] == [1.0, 0.2]
        assert kernel.row(ms.Tensor(np.zeros((0, 3), np.float32))) == pytest.approx(
            [math.nan, math.nan, math.nan, 0.0, 0.0, 0.0], nan_ok=True
        )
    inf = MindSporeStats(["min", "max", "nans"]).row(ms.Tensor(np.array([1.0, np.inf], np.float32)))
    assert inf == [1.0, math.inf, 0.0]


@pytest.mark.parametrize(
    ("dtype", "values"),
    [
        (ms.float16, [1.5, -2.0, 3.0]),
        (ms.bfloat16, [1.5, -2.0, 3.0]),
        (ms.float64, [1.5, -2.0, 3.0]),
        (ms.int32, [1, -2, 3]),
        (ms.bool_, [True, False, True]),
        (ms.complex64, [3 + 4j, 0j, 1j]),
    ],
)
def test_other_dtypes(dtype: object, values: list) -> None:
    t = ms.Tensor(np.array(values), dtype)
    x = np.abs(np.array(values)).astype(np.float64) if dtype == ms.complex64 else np.array(values, np.float64)
    assert MindSporeStats(OPS).row(t) == pytest.approx(reference(x), rel=1e-6)


def test_norm_beyond_float32_squares_is_exact() -> None:
    for scale in (1e25, 1e-25):
        a = (np.random.default_rng(1).standard_normal(10000) * scale).astype(np.float32)
        got = MindSporeStats(["norm"]).row(ms.Tensor(a))[0]
        assert got == pytest.approx(np.linalg.norm(a.astype(np.float64)), rel=1e-9)


def test_parameters_and_arrays_are_summarised_without_copy_semantics_changing() -> None:
    p = ms.Parameter(ms.Tensor(data("normal", 300)), name="w")
    kernel = MindSporeStats(["min", "max", "mean", "norm"])
    assert kernel.row(p) == pytest.approx(reference(p.asnumpy())[:4], rel=1e-6)
    assert kernel.row(p.asnumpy()) == kernel.row(p)
    assert kernel.rows([p, p]) == [kernel.row(p)] * 2


@pytest.mark.parametrize(("device_path", "dtype"), [(False, np.float32), (True, np.float32), (True, np.float16)])
def test_accumulate_sums_in_float32_without_touching_inputs(device_path: bool, dtype: type) -> None:
    kernel = MindSporeStats(["mean", "norm"], device_path=device_path)
    grads = [ms.Tensor(data("normal", 5000, seed).astype(dtype)) for seed in range(3)]
    before = [g.asnumpy().copy() for g in grads]
    total = None
    for g in grads:
        total = kernel.accumulate(total, g)
    expected = sum(b.astype(np.float64) for b in before)
    assert kernel.row(total) == pytest.approx(reference(expected)[2:4], rel=1e-5 if device_path else 1e-6)
    assert all(np.array_equal(g.asnumpy(), b) for g, b in zip(grads, before))


def test_numpy_kernel_rejects_unknown_ops() -> None:
    with pytest.raises(ValueError, match="unknown ops"):
        NumpyStats(["median"])
