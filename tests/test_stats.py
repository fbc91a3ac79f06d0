"""TensorStats, parse_ops and format_value against float64 references."""

from __future__ import annotations

import itertools
import math
import re

import numpy as np
import pytest
import torch

from trainprobe.backends.torch.stats import TensorStats, as_statistic_input, eager_reductions, sum64
from trainprobe.engine.errors import ConfigError
from trainprobe.engine.stats.ops import ALL_OPS, COUNT_OPS, DEFAULT_EPS, DEFAULT_OPS, format_value, parse_ops

ALL = list(ALL_OPS)
RTOL = 1e-6


def reference(t: torch.Tensor, eps: float = DEFAULT_EPS) -> dict[str, float]:
    """Every op in float64 NumPy, from the tensor's exact values."""
    x = t.detach()
    if x.is_complex():
        a = np.abs(x.to(torch.complex128).numpy()).ravel()
    else:
        a = x.to(torch.float64).numpy().ravel()
    if a.size == 0:
        return {"min": math.nan, "max": math.nan, "mean": math.nan, "norm": 0.0, "nans": 0.0, "zeros": 0.0}
    with np.errstate(invalid="ignore", over="ignore"):
        return {
            "min": float(np.min(a)),
            "max": float(np.max(a)),
            "mean": float(np.mean(a)),
            "norm": float(np.sqrt(np.sum(a * a))),
            "nans": float(np.count_nonzero(np.isnan(a))),
            "zeros": float(np.count_nonzero(np.abs(a) < eps)) / a.size,
            "size": float(a.size),
        }


def as_dict(ops, row) -> dict[str, float]:
    assert isinstance(row, list)
    assert len(row) == len(ops)
    assert all(type(v) is float for v in row), [type(v) for v in row]
    return dict(zip(ops, row, strict=True))


def same(a: float, b: float) -> bool:
    """Equal, with nan == nan and inf == inf."""
    return (math.isnan(a) and math.isnan(b)) or a == b


def same_to_rounding(a: float, b: float) -> bool:
    """Equal but for the last bits of a float64 accumulation in another order (4 ulps)."""
    return same(a, b) or (math.isfinite(a) and abs(a - b) <= 4 * math.ulp(max(abs(a), abs(b))))


def assert_close(got: dict[str, float], ref: dict[str, float], rtol: float = RTOL):
    for op in ("min", "max", "nans", "zeros"):
        if op in got:
            assert same(got[op], ref[op]), (op, got[op], ref[op])
    if "norm" in got:
        if math.isfinite(ref["norm"]):
            assert got["norm"] == pytest.approx(ref["norm"], rel=rtol, abs=0), ("norm", got["norm"], ref["norm"])
        else:
            assert same(got["norm"], ref["norm"])
    if "mean" in got:
        if math.isfinite(ref["mean"]):
            # the documented contract: 1e-6 relative, or 1e-6 x norm / n where the values cancel
            cancel = rtol * ref["norm"] / ref["size"] if math.isfinite(ref["norm"]) else 0
            assert got["mean"] == pytest.approx(ref["mean"], rel=rtol, abs=cancel), ("mean", got["mean"], ref["mean"])
        else:
            assert same(got["mean"], ref["mean"])


def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


def _fp32_cases() -> dict[str, torch.Tensor]:
    g = gen()
    return {
        "single": torch.tensor([3.25]),
        "single_negative": torch.tensor([[-7.5]]),
        "normal_vector": torch.randn(1000, generator=g),
        "normal_matrix": torch.randn(31, 17, generator=g),
        "normal_3d": torch.randn(4, 5, 6, generator=g),
        "uniform_positive": torch.rand(64, 64, generator=g) * 10 + 1,
        "lognormal": torch.exp(torch.randn(5000, generator=g) * 3),
        "large_magnitude": torch.randn(2000, generator=g) * 1e15,
        "small_magnitude": torch.randn(2000, generator=g) * 1e-12,
        "large_n": torch.randn(200_000, generator=g) + 3.0,
        "constant": torch.full((123,), 0.1),
        "all_zero": torch.zeros(10, 10),
        "with_inf": torch.tensor([1.0, math.inf, -2.0]),
        "with_both_infs": torch.tensor([1.0, math.inf, -math.inf]),
    }


FP32_CASES = _fp32_cases()


@pytest.mark.parametrize("name", list(FP32_CASES))
def test_fp32_against_float64_reference(name: str) -> None:
    x = FP32_CASES[name]
    got = as_dict(ALL, TensorStats(ALL).row(x))
    assert_close(got, reference(x))


def test_mean_near_zero_with_large_spread() -> None:
    g = gen()
    a = torch.randn(50_000, generator=g) * 1e6
    x = torch.cat([a, -a, torch.tensor([0.5])])[torch.randperm(100_001, generator=g)]
    ref = reference(x)
    assert abs(ref["mean"]) < 1e-4  # essentially 0 compared with the spread
    got = as_dict(ALL, TensorStats(ALL).row(x))
    assert_close(got, ref)


def cancelling_tensors() -> list[torch.Tensor]:
    """Large float32 tensors whose mean is tiny next to their values (zero-mean weights and
    gradients, rows centred like a normalised layer's gradient, exact cancellation, 12 decades)."""
    g = gen()
    out = []
    for n in (65_536, 262_151, 1_048_576):
        x = torch.randn(n, generator=g)
        w = torch.randn(n // 512, 512, generator=g)
        centred = torch.cat([(w - w.mean(1, keepdim=True)).reshape(-1), torch.zeros(n % 512)])
        wide = (x + 2) * torch.logspace(-6, 6, n)[torch.randperm(n, generator=g)]
        out += [x, x - x.double().mean().float(), centred, wide]
    return out


def test_mean_of_cancelling_large_tensors_within_the_documented_bound() -> None:
    """Large CPU tensors: the mean is within 1e-6 x max(|mean|, norm / n) of float64 (the float32
    rounding of the row sums, see sum64) even when the values cancel, alone (row) and batched (rows), and the
    two paths agree."""
    xs = cancelling_tensors()
    stats = TensorStats(["mean", "norm"])
    for x, batched in zip(xs, stats.rows(xs)):
        ref = float(x.double().mean())
        bound = 1e-6 * max(abs(ref), float(x.double().norm()) / x.numel())
        assert abs(batched[0] - ref) <= bound
        assert stats.row(x)[0] == pytest.approx(batched[0], rel=1e-12)
        assert abs(float(sum64(x)) / x.numel() - ref) <= bound


def test_float64_tensor_is_exact_enough() -> None:
    g = gen()
    x = torch.randn(10_000, dtype=torch.float64, generator=g) * 1e100
    got = as_dict(ALL, TensorStats(ALL).row(x))
    assert_close(got, reference(x), rtol=1e-12)
    # float64 accumulation: no overflow where float32 would
    big = torch.full((4,), 1e150, dtype=torch.float64)
    got = as_dict(ALL, TensorStats(ALL).row(big))
    assert got["norm"] == pytest.approx(2e150, rel=1e-12)
    assert got["mean"] == pytest.approx(1e150, rel=1e-12)


# -- NaN counting ----------------------------------------------------------------------


def _nan_cases() -> dict[str, torch.Tensor]:
    g = gen()
    many = torch.randn(1000, generator=g)
    many[::7] = math.nan
    return {
        "none": torch.randn(100, generator=g),
        "one": torch.tensor([1.0, math.nan, 3.0]),
        "one_first": torch.tensor([math.nan, 1.0]),
        "many": many,
        "all": torch.full((37,), math.nan),
        "single_nan": torch.tensor([math.nan]),
        "nan_and_inf": torch.tensor([math.inf, math.nan, -math.inf, 2.0, math.nan]),
        "inf_only": torch.tensor([math.inf, -math.inf]),  # mean is nan, but there is no NaN element
        "pos_inf_only": torch.tensor([math.inf, math.inf]),
    }


NAN_CASES = _nan_cases()


@pytest.mark.parametrize("name", list(NAN_CASES))
def test_nan_count_is_exact_and_propagates(name: str) -> None:
    x = NAN_CASES[name]
    ref = reference(x)
    got = as_dict(ALL, TensorStats(ALL).row(x))
    assert got["nans"] == ref["nans"]
    if ref["nans"]:
        for op in ("min", "max", "mean", "norm"):
            assert math.isnan(got[op]), op
    else:
        assert_close(got, ref)


@pytest.mark.parametrize("name", list(NAN_CASES))
def test_nan_count_exact_for_every_op_subset(name: str) -> None:
    """The lazy NaN count must not depend on which other ops are asked for."""
    x = NAN_CASES[name]
    expected = reference(x)["nans"]
    others = [op for op in ALL if op != "nans"]
    for k in range(len(others) + 1):
        for combo in itertools.combinations(others, k):
            for ops in (list(combo) + ["nans"], ["nans"] + list(combo)):
                got = as_dict(ops, TensorStats(ops).row(x))
                assert got["nans"] == expected, ops


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_nan_count_other_float_dtypes(dtype: torch.dtype) -> None:
    x = torch.tensor([1.0, math.nan, math.nan, -1.0, math.nan], dtype=dtype)
    assert TensorStats(["nans"]).row(x) == [3.0]
    assert TensorStats(["max", "nans"]).row(x)[1] == 3.0


# -- zeros -----------------------------------------------------------------------------


def test_zeros_fraction_uses_eps() -> None:
    x = torch.tensor([0.0, -0.0, 1e-9, -1e-9, 1e-7, 1.0, math.nan, math.inf], dtype=torch.float64)
    assert TensorStats(["zeros"]).row(x) == [4 / 8]  # default eps 1e-8
    assert TensorStats(["zeros"], eps=1e-6).row(x) == [5 / 8]
    assert TensorStats(["zeros"], eps=1e-10).row(x) == [2 / 8]
    assert TensorStats(["zeros"], eps=2.0).row(x) == [6 / 8]  # NaN and inf never count


def test_zeros_is_strictly_less_than_eps() -> None:
    x = torch.tensor([0.5, -0.5, 0.25], dtype=torch.float32)
    assert TensorStats(["zeros"], eps=0.5).row(x) == [1 / 3]


def test_zeros_against_reference_random() -> None:
    g = gen()
    x = torch.randn(10_000, generator=g) * 1e-3
    for eps in (1e-8, 1e-5, 1e-4, 1e-3):
        got = TensorStats(["zeros"], eps=eps).row(x)[0]
        assert got == reference(x, eps=eps)["zeros"]


# -- dtypes ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "x",
    [
        torch.tensor([1, -2, 3, 100], dtype=torch.int8),
        torch.tensor([0, 200, 255], dtype=torch.uint8),
        torch.tensor([2**40, -(2**40), 7], dtype=torch.int64),
        torch.tensor([[5, 6], [7, 8]], dtype=torch.int32),
        torch.tensor([True, False, True, True]),
        torch.tensor([0, 0, 0], dtype=torch.int16),
    ],
    ids=["int8", "uint8", "int64_big", "int32_2d", "bool", "int16_zeros"],
)
def test_integer_and_bool_summarised_as_float(x: torch.Tensor) -> None:
    assert as_statistic_input(x).dtype == torch.float64
    got = as_dict(ALL, TensorStats(ALL).row(x))
    assert_close(got, reference(x), rtol=1e-12)


def test_int8_sum_does_not_wrap() -> None:
    x = torch.full((1000,), 127, dtype=torch.int8)
    got = as_dict(ALL, TensorStats(ALL).row(x))
    assert got["mean"] == 127.0
    assert got["norm"] == pytest.approx(127.0 * math.sqrt(1000), rel=1e-12)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_complex_summarised_by_magnitude(dtype: torch.dtype) -> None:
    g = gen()
    x = torch.complex(torch.randn(300, generator=g), torch.randn(300, generator=g)).to(dtype)
    x[0] = 3 - 4j
    got = as_dict(ALL, TensorStats(ALL).row(x))
    ref = reference(x)
    assert ref["min"] >= 0
    # |z| of complex64 is rounded to float32, so even min/max are only float32-accurate
    for op in ("min", "max", "mean", "norm"):
        assert got[op] == pytest.approx(ref[op], rel=1e-6, abs=0), op
    assert got["nans"] == 0.0 and got["zeros"] == ref["zeros"]
    small = torch.tensor([3 - 4j, 0j, 1j], dtype=dtype)
    got = as_dict(ALL, TensorStats(ALL).row(small))
    assert got["min"] == 0.0 and got["max"] == 5.0 and got["zeros"] == pytest.approx(1 / 3)
    assert got["norm"] == pytest.approx(math.sqrt(26), rel=1e-6)


def test_complex_nan_counts() -> None:
    x = torch.tensor([complex(math.nan, 0), 1 + 1j, complex(0, math.nan)], dtype=torch.complex64)
    assert TensorStats(["nans"]).row(x) == [2.0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_typical_values(dtype: torch.dtype) -> None:
    g = gen()
    x = (torch.randn(4096, generator=g) * 3 + 1).to(dtype)
    got = as_dict(ALL, TensorStats(ALL).row(x))
    assert_close(got, reference(x), rtol=1e-5)
    assert as_statistic_input(x).dtype == dtype  # no copy: accumulated, not converted


def test_float16_near_max_accumulates_in_float32() -> None:
    fmax = torch.finfo(torch.float16).max
    g = gen()
    x = (torch.rand(10_000, generator=g) * 0.1 + 0.9) * fmax
    x = x.to(torch.float16)
    x[0] = fmax
    ref = reference(x)
    got = as_dict(ALL, TensorStats(ALL).row(x))
    assert math.isfinite(got["norm"]) and math.isfinite(got["mean"])
    assert_close(got, ref, rtol=1e-5)
    assert got["max"] == fmax


def test_bfloat16_near_max_mean_finite() -> None:
    bmax = torch.finfo(torch.bfloat16).max
    x = torch.full((16,), bmax, dtype=torch.bfloat16)
    x[1] = -bmax / 2
    ref = reference(x)
    got = as_dict(["min", "max", "mean", "nans"], TensorStats(["min", "max", "mean", "nans"]).row(x))
    assert got["max"] == bmax and got["min"] == -bmax / 2 and got["nans"] == 0.0
    assert math.isfinite(got["mean"])
    assert got["mean"] == pytest.approx(ref["mean"], rel=1e-6, abs=0)


def test_bfloat16_near_max_norm_finite() -> None:
    bmax = torch.finfo(torch.bfloat16).max
    x = torch.full((16,), bmax, dtype=torch.bfloat16)
    x[1] = -bmax / 2
    got = TensorStats(["norm"]).row(x)[0]
    assert math.isfinite(got)
    assert got == pytest.approx(reference(x)["norm"], rel=1e-5, abs=0)


def test_bfloat16_large_values_norm_finite() -> None:
    # the true norm (2e20) is far below the float32 maximum; only the squares overflow
    x = torch.full((4,), 1e20, dtype=torch.bfloat16)
    got = as_dict(["norm"], TensorStats(["norm"]).row(x))
    assert got["norm"] == pytest.approx(reference(x)["norm"], rel=1e-5, abs=0)


def test_float32_large_values_norm_finite() -> None:
    x = torch.full((4,), 1e20, dtype=torch.float32)
    got = TensorStats(["norm"]).row(x)[0]
    assert got == pytest.approx(reference(x)["norm"], rel=1e-6, abs=0)


def test_float32_tiny_values_norm_nonzero() -> None:
    x = torch.full((4,), 1e-25, dtype=torch.float32)
    got = TensorStats(["norm"]).row(x)[0]
    assert got == pytest.approx(reference(x)["norm"], rel=1e-6, abs=0)


# -- shapes and layouts ----------------------------------------------------------------


@pytest.mark.parametrize(
    "x",
    [
        torch.empty(0),
        torch.empty(3, 0),
        torch.empty(0, dtype=torch.bfloat16),
        torch.empty(0, dtype=torch.float16),
        torch.empty(0, dtype=torch.float64),
        torch.empty(0, dtype=torch.int64),
        torch.empty(0, dtype=torch.bool),
        torch.empty(0, dtype=torch.complex64),
    ],
    ids=["f32", "f32_2d", "bf16", "f16", "f64", "int64", "bool", "complex64"],
)
def test_empty_tensor(x: torch.Tensor) -> None:
    got = as_dict(ALL, TensorStats(ALL).row(x))
    assert math.isnan(got["min"]) and math.isnan(got["max"]) and math.isnan(got["mean"])
    assert got["norm"] == 0.0 and got["nans"] == 0.0 and got["zeros"] == 0.0


def test_empty_row_is_a_fresh_list() -> None:
    s = TensorStats(["norm"])
    r = s.row(torch.empty(0))
    r.append(1.0)
    assert s.row(torch.empty(0)) == [0.0]


def test_meta_tensor_has_no_row() -> None:
    """A meta tensor holds no values: None, which the monitors' row buffers leave out and the
    dump writes as null statistics (tests/test_meta_tensors.py)."""
    assert TensorStats(ALL).row(torch.empty(4, device="meta")) is None
    with pytest.raises(ValueError, match="meta tensor"):
        as_statistic_input(torch.empty(4, device="meta"))


@pytest.mark.parametrize("n", [1, 4095, 8191, 8192, 3 * 4096, 3 * 4096 + 5, 100_003])
def test_sum64_row_blocking(n: int) -> None:
    g = gen()
    x = torch.randn(n, generator=g) * 1e3 + 0.5
    ref = float(np.sum(x.double().numpy()))
    got = sum64(x)
    assert got.dtype == torch.float64 and got.dim() == 0
    # exact below 65,536 elements; above, rows of 64 are summed in float32 (error ~1e-8 relative)
    assert float(got) == pytest.approx(ref, rel=1e-7, abs=1e-8 * float(x.double().abs().sum()))
    strided = torch.randn(2 * n, generator=g)[::2]
    assert float(sum64(strided)) == pytest.approx(float(strided.double().sum()), rel=1e-7, abs=1e-7 * n)
    assert float(sum64(x.double())) == pytest.approx(ref, rel=1e-12, abs=1e-9 * float(x.double().abs().sum()))


def test_mean_cancellation_accurate_to_float32_precision() -> None:
    # float64 accumulation: +big and -big cancel exactly, the small remainder survives
    x = torch.tensor([1e8, 1.0, -1e8, 1.0] * 5000, dtype=torch.float32)
    assert TensorStats(["mean"]).row(x) == [0.5]
    big = torch.cat([torch.full((10_000,), 3e7), torch.full((10_000,), -3e7), torch.ones(20_000)])
    assert TensorStats(["mean"]).row(big) == [0.5]


def test_zero_dim_scalar() -> None:
    got = as_dict(ALL, TensorStats(ALL).row(torch.tensor(-2.5)))
    assert got == {"min": -2.5, "max": -2.5, "mean": -2.5, "norm": 2.5, "nans": 0.0, "zeros": 0.0}


def _non_contiguous() -> dict[str, torch.Tensor]:
    g = gen()
    base = torch.randn(40, 30, generator=g)
    return {
        "transpose": base.t(),
        "step_slice": base[:, ::3],
        "column": base[:, 7],
        "expand": torch.randn(5, 3, generator=g).expand(4, 5, 3),
        "permute": torch.randn(3, 4, 5, generator=g).permute(2, 0, 1),
        "negative_values_slice": (base - 10)[1::2, 2::5],
    }


NON_CONTIGUOUS = _non_contiguous()


@pytest.mark.parametrize("name", list(NON_CONTIGUOUS))
def test_non_contiguous(name: str) -> None:
    x = NON_CONTIGUOUS[name]
    assert not x.is_contiguous()
    got = as_dict(ALL, TensorStats(ALL).row(x))
    assert_close(got, reference(x.contiguous()))


def test_requires_grad_leaf_and_non_leaf() -> None:
    g = gen()
    leaf = torch.randn(50, 4, generator=g, requires_grad=True)
    before = leaf.detach().clone()
    non_leaf = leaf * 2 + 1
    s = TensorStats(ALL)
    for t in (leaf, non_leaf):
        got = as_dict(ALL, s.row(t))
        assert_close(got, reference(t))
    assert torch.equal(leaf.detach(), before)
    assert leaf.grad is None and leaf.requires_grad
    # the graph of non_leaf is untouched: backward still works and gives the usual gradient
    non_leaf.sum().backward()
    assert torch.equal(leaf.grad, torch.full_like(leaf, 2.0))


def test_no_graph_built_from_statistic_input() -> None:
    t = torch.randn(8, requires_grad=True)
    x = as_statistic_input(t)
    assert not x.requires_grad and x.grad_fn is None
    assert x.data_ptr() == t.data_ptr()  # a view, no copy for floats


def test_row_under_no_grad_and_inference_mode() -> None:
    x = torch.randn(20, requires_grad=True)
    ref = TensorStats(ALL).row(x)
    with torch.no_grad():
        assert TensorStats(ALL).row(x) == ref
    with torch.inference_mode():
        y = torch.randn(20)
        assert_close(as_dict(ALL, TensorStats(ALL).row(y)), reference(y))


# -- op order, rows --------------------------------------------------------------------


def test_column_order_follows_ops() -> None:
    x = torch.tensor([1.0, -2.0, 0.0, math.nan, 4.0, 1e-9])
    full = as_dict(ALL, TensorStats(ALL).row(x))
    for ops in itertools.permutations(ALL, 3):
        row = TensorStats(list(ops)).row(x)
        assert len(row) == 3
        assert all(same(v, full[op]) for v, op in zip(row, ops, strict=True)), ops
    for ops in (list(reversed(ALL)), ["nans", "norm", "zeros", "min", "mean", "max"]):
        row = TensorStats(ops).row(x)
        assert all(same(v, full[op]) for v, op in zip(row, ops, strict=True)), ops


def test_default_ops_order() -> None:
    x = torch.tensor([3.0, 4.0])
    assert TensorStats(DEFAULT_OPS).row(x) == [3.0, 4.0, 3.5, 5.0, 0.0]
    assert TensorStats(["norm", "min"]).row(x) == [5.0, 3.0]
    assert TensorStats(["max"]).row(x) == [4.0]
    assert TensorStats(["mean"]).row(x) == [3.5]


def test_rows_one_per_tensor() -> None:
    s = TensorStats(["min", "nans"])
    rows = s.rows([torch.tensor([1.0, 2.0]), torch.empty(0), torch.tensor([math.nan])])
    assert rows[0] == [1.0, 0.0]
    assert math.isnan(rows[1][0]) and rows[1][1] == 0.0
    assert math.isnan(rows[2][0]) and rows[2][1] == 1.0
    assert s.rows([]) == []


@pytest.mark.parametrize("copies", [1, 3])
@pytest.mark.parametrize("ops", [DEFAULT_OPS, ALL_OPS, ("nans",), ("norm", "nans"), ("zeros", "min")])
def test_rows_batches_small_tensors_with_row_values(ops: tuple[str, ...], copies: int) -> None:
    """rows() stacks small same-size tensors: the values are row()'s (min, max and counts exactly;
    mean and norm to float64 rounding: a tensor alone is summed by NumPy, a stack by torch) and
    the float64 reference's (``copies``: groups of 16 rows or more are finished by kernels over
    all rows)."""
    g = gen()
    tensors = [torch.randn(256, generator=g) * (i + 1) for i in range(6 * copies)]
    tensors[2][7] = math.nan
    tensors[3][:5] = 0.0
    tensors[4][0] = math.inf
    tensors += [torch.randn(16, 16, generator=g), torch.randn(300, generator=g), torch.randn(5000, generator=g)]
    tensors += [torch.empty(0), torch.randn(256, generator=g).to(torch.bfloat16), torch.randn(256, generator=g).half()]
    tensors += [torch.randn(256, 4, generator=g).t()]  # non-contiguous, 1,024 elements, alone in its group
    s = TensorStats(ops)
    batched = s.rows(tensors)
    assert len(batched) == len(tensors)
    for t, got in zip(tensors, batched, strict=True):
        assert all(same_to_rounding(a, b) for a, b in zip(got, s.row(t), strict=True))
        assert_close(as_dict(ops, got), reference(t))


@pytest.mark.parametrize("copies", [1, 2])
@pytest.mark.parametrize("ops", [DEFAULT_OPS, ALL_OPS, ("mean",), ("norm", "nans"), ("nans",)])
def test_rows_combines_large_tensors_like_the_float64_reference(ops: tuple[str, ...], copies: int) -> None:
    """Several large tensors in one call take the segmented path (row results of all of them
    combined in float64): every row matches the float64 reference and row()'s value, including
    tails shorter than a row, half types, NaN/inf, float32 row overflow and underflow, with
    fewer or more than 16 tensors (finished row by row, or by kernels over all rows)."""
    g = gen()
    tensors = [
        torch.randn(4096, generator=g),
        torch.randn(5000, generator=g) + 3.0,  # tail of 136 elements
        torch.randn(70_001, generator=g),  # above 65,536: float32 rows, float64 across rows
        torch.randn(300, 100, generator=g).t(),  # non-contiguous
        torch.randn(8192, generator=g).to(torch.bfloat16),
        torch.randn(8192, generator=g).half(),
        torch.randn(6000, generator=g, dtype=torch.float64),
        torch.randn(5000, generator=g) * 1e30,  # squares overflow float32 inside a row
        torch.randn(5000, generator=g) * 1e-25,  # squares underflow float32 inside a row
        torch.full((70_000,), 3e38),  # row sums overflow float32: the mean is redone in float64
    ]
    tensors[0][17] = math.nan
    tensors[1][4999] = math.inf
    tensors *= copies  # 20 tensors: finished by kernels over all rows rather than row by row
    s = TensorStats(ops)
    batched = s.rows(tensors)
    for t, got in zip(tensors, batched, strict=True):
        ref = reference(t)
        assert_close(as_dict(ops, got), ref)
        alone = s.row(t)
        for a, b in zip(got, alone, strict=True):
            assert same(a, b) or a == pytest.approx(b, rel=1e-12)


def test_unknown_op_rejected() -> None:
    with pytest.raises(AssertionError, match="unknown ops"):
        TensorStats(["min", "nrom"])


def test_eps_stored_as_float() -> None:
    s = TensorStats(["zeros"], eps=1)
    assert s.eps == 1.0 and s.ops == ("zeros",)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_row_matches_host_row() -> None:
    g = gen()
    cases = [
        torch.randn(1000, generator=g),
        torch.tensor([1.0, math.nan, -3.0, 0.0]),
        (torch.randn(300, generator=g) * 100).to(torch.bfloat16),
        torch.tensor([1, 2, 3], dtype=torch.int32),
        torch.tensor([3 - 4j, 1j]),
    ]
    ops = ["nans", "zeros", "max", "min", "norm", "mean"]
    s = TensorStats(ops)
    for x in cases:
        host = s.row(x)
        dev = s.row(x.cuda())
        assert isinstance(dev, torch.Tensor) and dev.dtype == torch.float64 and dev.shape == (len(ops),)
        for h, d in zip(host, dev.cpu().tolist(), strict=True):
            assert same(h, d) or d == pytest.approx(h, rel=1e-5)
    empty = s.row(torch.empty(0, device="cuda"))
    assert isinstance(empty, list)


# -- parse_ops -------------------------------------------------------------------------


def test_parse_ops_default_for_absent_and_empty() -> None:
    assert parse_ops(None, "ops") == DEFAULT_OPS
    assert parse_ops([], "ops") == DEFAULT_OPS
    assert "zeros" not in DEFAULT_OPS and "zeros" in ALL_OPS


def test_parse_ops_keeps_order_drops_duplicates_normalises() -> None:
    assert parse_ops(["norm", "min", "norm", "max", "min"], "x") == ("norm", "min", "max")
    assert parse_ops(["NANS", " Zeros ", "nans"], "x") == ("nans", "zeros")
    assert parse_ops(list(reversed(ALL_OPS)), "x") == tuple(reversed(ALL_OPS))


def test_parse_ops_unknown_name() -> None:
    msg = "monitors.weight_grad.ops[1]: 'nrom' is not one of min, max, mean, norm, nans, zeros"
    with pytest.raises(ConfigError, match=f"^{re.escape(msg)}$"):
        parse_ops(["min", "nrom"], "monitors.weight_grad.ops")


def test_parse_ops_non_string_entry() -> None:
    with pytest.raises(ConfigError, match=re.escape("m.ops[0]: 3 is not one of min, max")):
        parse_ops([3], "m.ops")
    with pytest.raises(ConfigError, match=re.escape("m.ops[2]: None is not one of")):
        parse_ops(["min", "max", None], "m.ops")


@pytest.mark.parametrize("value,kind", [("min", "a string"), ({"min": 1}, "an object"), (3, "an integer")])
def test_parse_ops_not_a_list(value, kind: str) -> None:
    msg = f"m.ops: must be a list of op names (min, max, mean, norm, nans, zeros), not {kind}"
    with pytest.raises(ConfigError, match=f"^{re.escape(msg)}$"):
        parse_ops(value, "m.ops")


def test_parse_ops_custom_accepted_and_default() -> None:
    assert parse_ops(None, "x", accepted=("min", "max"), default=("max",)) == ("max",)
    with pytest.raises(ConfigError, match=re.escape("x[0]: 'norm' is not one of min, max")):
        parse_ops(["norm"], "x", accepted=("min", "max"))


# -- format_value ----------------------------------------------------------------------


def test_format_value_counts_are_integers() -> None:
    assert COUNT_OPS == {"nans"}
    assert format_value("nans", 0.0) == "0"
    assert format_value("nans", 3.0) == "3"
    assert format_value("nans", 123456789.0) == "123456789"
    assert format_value("nans", math.nan) == "nan"


def test_format_value_floats_round_trip() -> None:
    g = np.random.default_rng(7)
    values = [0.1, 1 / 3, -2.5, 0.0, -0.0, 1e-300, 5e-324, 1.7976931348623157e308, 123456789.123456789]
    values += list(g.standard_normal(200) * 10.0 ** g.integers(-30, 30, 200))
    values += [float(torch.tensor(v, dtype=torch.bfloat16)) for v in (0.1, 3.3e38, -7.7)]
    for op in ("min", "max", "mean", "norm", "zeros"):
        for v in values:
            text = format_value(op, v)
            assert float(text) == v, (op, v, text)
            assert text == repr(float(v))


def test_format_value_non_finite_and_numpy_scalars() -> None:
    assert format_value("max", math.inf) == "inf"
    assert format_value("min", -math.inf) == "-inf"
    assert format_value("mean", math.nan) == "nan"
    assert format_value("norm", np.float32(0.1)) == repr(float(np.float32(0.1)))
    assert float(format_value("norm", np.float32(0.1))) == float(np.float32(0.1))
    assert format_value("zeros", 0.5) == "0.5"


def test_format_value_of_computed_row_round_trips() -> None:
    ops = list(ALL_OPS)
    row = TensorStats(ops).row(torch.randn(1000, generator=gen()))
    for op, v in zip(ops, row, strict=True):
        assert float(format_value(op, v)) == v


@pytest.mark.parametrize("n", [4095, 4096, 4097, 65536 * 3 + 17, 1 << 22])
@pytest.mark.parametrize("kind", ["randn", "offset", "wide"])
def test_norm_of_large_float32_tensors_matches_float64(n: int, kind: str) -> None:
    """A flat float32 norm of 4M elements is off by ~1e-4; rows in float32 combined in float64
    must stay within float32 rounding of a row (2e-7) of the float64 norm."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g)
    if kind == "offset":
        x = x * 0.1 + 1.0
    elif kind == "wide":
        x = x * torch.exp(torch.randn(n, generator=g) * 3)
    (norm,) = TensorStats(["norm"]).row(x)
    ref = x.double().norm().item()
    assert norm == pytest.approx(ref, rel=2e-7)


def _unfused_row(x: torch.Tensor) -> list[float]:
    """min, max, sum and norm by the kernels the fused path replaces (aminmax, sum64, norm64)."""
    from trainprobe.backends.torch.stats import norm64

    lo, hi = torch.aminmax(x)
    return [lo.item(), hi.item(), sum64(x).item(), norm64(x).item()]


def _same_bits(a: list[float], b: list[float]) -> bool:
    return all((u != u and v != v) or (u == v and math.copysign(1, u) == math.copysign(1, v)) for u, v in zip(a, b))


@pytest.mark.parametrize(
    "n", [4096, 5000, 65535, 65536, 70000 - 70000 % 256, (1 << 18), (1 << 18) + 256, 3 * (1 << 18) + 512, 2_048_000]
)
def test_chunked_float32_row_is_bit_identical_to_the_unfused_kernels(n: int) -> None:
    from trainprobe.backends.torch.stats import _chunked_float32

    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen) * 3 + 0.25
    fused = _chunked_float32(x, True, True)
    assert fused is not None
    assert _same_bits(list(fused), _unfused_row(x))


@pytest.mark.parametrize("where", [0, 1 << 18, -1])
def test_chunked_float32_propagates_nan_and_keeps_signed_zero(where: int) -> None:
    from trainprobe.backends.torch.stats import _chunked_float32

    x = torch.randn(3 * (1 << 18))
    x[where] = float("nan")
    fused = _chunked_float32(x, True, True)
    assert fused is not None and all(v != v for v in fused[:3])
    z = torch.zeros(1 << 19)
    z[7] = -0.0
    z[(1 << 18) + 3] = 5.0
    fused = _chunked_float32(z, True, True)
    assert fused is not None and _same_bits(list(fused), _unfused_row(z))


def test_chunked_float32_declines_what_it_does_not_handle() -> None:
    from trainprobe.backends.torch.stats import _chunked_float32

    assert _chunked_float32(torch.randn(100), True, True) is None  # small: batched / direct path
    assert _chunked_float32(torch.randn(8192, dtype=torch.float64), True, True) is None
    assert _chunked_float32(torch.randn(128, 64).t(), True, True) is None  # not contiguous
    assert _chunked_float32(torch.randn((1 << 18) + 100), True, True) is None  # a tail beyond one chunk


def test_host_row_of_large_float32_equals_the_unfused_kernels() -> None:
    x = torch.randn(8, 128, 1024, requires_grad=True) * 2
    stats = TensorStats(("max", "min", "mean", "norm"))
    lo, hi, total, norm = _unfused_row(x.detach())
    assert stats.row(x) == [hi, lo, total / x.numel(), norm]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "case",
    ["plain", "signed_zeros", "zero_max", "nan", "inf", "both_inf", "huge", "scalar", "matrix", "requires_grad"],
)
def test_small_tensor_alone_takes_numpy_with_torch_values(case: str, dtype: torch.dtype) -> None:
    """A small CPU float tensor alone is summarised by NumPy: min and max are torch's exactly
    (signed zeros included), NaN and infinities propagate as torch's do, mean and norm are the
    float64 reference's to rounding, and every op is right (counts included)."""
    g = gen()
    t = torch.randn(300, generator=g, dtype=dtype)
    if case == "signed_zeros":
        t = torch.tensor([0.0, -0.0, 0.0, 1.0], dtype=dtype)
    elif case == "zero_max":
        t = torch.tensor([-0.0, -3.0, 0.0], dtype=dtype)
    elif case == "nan":
        t[17] = math.nan
    elif case == "inf":
        t[3] = math.inf
    elif case == "both_inf":
        t[3], t[4] = math.inf, -math.inf
    elif case == "huge":
        t = t * (1e30 if dtype == torch.float32 else 1e200)
    elif case == "scalar":
        t = torch.tensor(2.5, dtype=dtype)
    elif case == "matrix":
        t = torch.randn(20, 30, generator=g, dtype=dtype)
    elif case == "requires_grad":
        t = t.clone().requires_grad_(True)
    s = TensorStats(ALL_OPS)
    got = as_dict(ALL_OPS, s.row(t))
    lo, hi = torch.aminmax(t.detach())
    assert same(got["min"], lo.item()) and same(got["max"], hi.item())
    if case != "nan":  # a NaN's sign bit means nothing (written "nan")
        assert math.copysign(1.0, got["min"]) == math.copysign(1.0, lo.item())
        assert math.copysign(1.0, got["max"]) == math.copysign(1.0, hi.item())
    torch_norm = torch.linalg.vector_norm(t.detach(), dtype=torch.float64).item()
    assert same_to_rounding(got["norm"], torch_norm) or got["norm"] == pytest.approx(torch_norm, rel=1e-15)
    assert_close(got, reference(t))


@pytest.mark.parametrize("n", [300, 5_000, (1 << 18) + 256 * 3])
@pytest.mark.parametrize("fused", ["off", "on"])
def test_statistics_leave_the_storage_resizable(n: int, fused: str) -> None:
    """Summarising a tensor never marks its storage non-resizable (``Tensor.numpy()`` does, for
    good): FSDP resizes its unsharded flat parameter's storage to zero after each pass."""
    from trainprobe.backends.torch.fused_stats import FusedStats

    t = torch.randn(n)
    stats = TensorStats(ALL_OPS, fused=FusedStats(eager_reductions, mode=fused))
    stats.row(t)
    stats.rows([t, torch.randn(n)])
    t.untyped_storage().resize_(0)  # raises "Trying to resize storage that is not resizable" otherwise
    assert t.untyped_storage().size() == 0


@pytest.mark.parametrize("mode", ["md5", "xor"])
def test_the_dump_checksum_leaves_the_storage_resizable(mode: str) -> None:
    from trainprobe.dump.entries import checksum

    t = torch.randn(1000)
    expected = checksum(t.clone(), mode)
    assert checksum(t, mode) == expected
    t.untyped_storage().resize_(0)


@pytest.mark.parametrize(
    ("make", "dense"),
    [
        (lambda t: t.view(8, 16, 4, 8).transpose(1, 2), True),  # attention's heads view
        (lambda t: t.view(64, 64).t(), True),
        (lambda t: t.view(4, 8, 128).permute(2, 0, 1), True),
        (lambda t: t.view(64, 64)[:, :32], False),  # not dense: summarised as it is
        (lambda t: t.view(64, 1, 64).expand(64, 3, 64), False),  # overlapping: every element counted
    ],
)
def test_a_permuted_dense_tensor_is_summarised_in_memory_order(make, dense: bool) -> None:
    """A transposed or permuted tensor whose elements fill one dense block is read as that block
    (a view, no copy: the one-read pass applies); other strided tensors as they are; the values
    are the float64 reference's of the logical tensor in every case."""
    from trainprobe.backends.torch.stats import in_memory_order

    x = make(torch.randn(4096, generator=gen()))
    view = in_memory_order(x)
    assert view.is_contiguous() == dense and (view is x) == (not dense)
    assert view.data_ptr() == x.data_ptr() and view.numel() == x.numel()
    s = TensorStats(ALL_OPS)
    assert_close(as_dict(ALL_OPS, s.row(x)), reference(x))
    assert_close(as_dict(ALL_OPS, s.rows([x, torch.randn(300)])[0]), reference(x))
    assert_close(as_dict(ALL_OPS, s.rows([x, x * 2])[0]), reference(x))
