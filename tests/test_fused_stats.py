"""The fused single pass (trainprobe.backends.torch.fused_stats): exact against float64 references, selected only
when it compiles, is exact and (in ``auto``) faster, and silently replaced by the eager kernels
otherwise. Tests marked by a real ``torch.compile`` share one compilation per dtype (the process's
selector, ``TRAINPROBE_FUSED_STATS=on``)."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.optim import optimizer as optim_module

from conftest import read_csv, write_config
from trainprobe import TrainerMonitorV2
from trainprobe.backends.torch import fused_stats, native_stats
from trainprobe.backends.torch.backend import TorchBackend
from trainprobe.backends.torch.fused_stats import FUSED_ENV, FusedStats, min_max_sum_sumsq, mode_from_env
from trainprobe.backends.torch.stats import TensorStats, eager_reductions, shared_fused
from trainprobe.engine.errors import ConfigError
from trainprobe.engine.stats.ops import DEFAULT_OPS

LOGGER = "trainprobe.backends.torch.fused_stats"


def no_compiler(fn, **kwargs):
    """A 'compiler' that runs the function as it is: the selection logic without a compilation."""
    return fn


def broken_compiler(fn, **kwargs):
    raise RuntimeError("no C++ compiler found")


def reference(t: torch.Tensor) -> list[float]:
    """min, max, mean, norm, nans of ``t`` in float64."""
    x = t.to(torch.float64)
    nans = float(torch.isnan(x).sum())
    return [x.min().item(), x.max().item(), x.mean().item(), x.norm().item(), nans]


def assert_close_to_reference(row: list[float], t: torch.Tensor) -> None:
    ref = reference(t)
    assert row[0] == ref[0] or (math.isnan(row[0]) and math.isnan(ref[0]))
    assert row[1] == ref[1] or (math.isnan(row[1]) and math.isnan(ref[1]))
    for got, want in zip(row[2:4], ref[2:4], strict=True):
        if math.isfinite(want):
            assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
        else:
            assert got == want or (math.isnan(got) and math.isnan(want))
    assert row[4] == ref[4]


def same(a: float, b: float, rel: float = 0.0) -> bool:
    """Equal (NaN equals NaN), or within ``rel`` relative."""
    return a == b or (a != a and b != b) or abs(a - b) <= rel * abs(b)


def inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    """Large tensors of ``dtype``: odd sizes, offsets, cancelling sums, NaN, infinities, views."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(70_001, generator=g, dtype=torch.float64)
    with_nan = base.clone()
    with_nan[5] = math.nan
    with_inf = base.clone()
    with_inf[9] = math.inf
    both = with_inf.clone()
    both[11] = -math.inf
    flat = torch.randn(3 * 4_096 + 7, generator=g).to(dtype)
    made = [t.to(dtype) for t in (base, base * 1e-2 + 100, base - base.mean(), with_nan, with_inf, both)]
    return made + [flat[3 : 3 + 2 * 4_096].view(64, 128), torch.randn(8, 16, 5, 7, generator=g).to(dtype)]


@pytest.fixture
def fused_on(monkeypatch: pytest.MonkeyPatch) -> FusedStats:
    """The process's selector with the fused pass forced on (compiled once per dtype per process)."""
    monkeypatch.setenv(FUSED_ENV, "on")
    return shared_fused()


# ---- the real compiled pass -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # float16: as bfloat16, uncompiled below
def test_compiled_pass_is_exact_against_float64(fused_on, dtype):
    stats = TensorStats(DEFAULT_OPS, fused=fused_on)
    eager = TensorStats(DEFAULT_OPS, fused=FusedStats(eager_reductions, mode="off"))
    tensors = inputs(dtype)
    assert all(fused_on(t) is not None for t in tensors), "the fused pass was not selected"
    for t, row, single, plain in zip(
        tensors, stats.rows(tensors), [stats.row(t) for t in tensors], eager.rows(tensors), strict=True
    ):
        assert_close_to_reference(row, t)
        assert all(same(a, b, 1e-12) for a, b in zip(row, single, strict=True))  # batched = single path
        assert all(same(a, b) for a, b in zip(row[:2] + row[4:], plain[:2] + plain[4:], strict=True))


def test_compiled_pass_compiles_once_per_dtype_whatever_the_tensor(fused_on):
    from torch._dynamo.utils import counters

    fused_on(torch.randn(5_000))  # compiled (or already compiled by another test)
    graphs = counters["stats"]["unique_graphs"]
    flat = torch.randn(50_000)
    lin = nn.Linear(100, 80)
    lin(torch.randn(2, 100)).sum().backward()
    varied = [lin.weight, lin.weight.grad, flat[1:8_001], flat[2:40_002].view(200, 200), torch.randn(3, 4, 5, 100)]
    assert all(fused_on(t) is not None for t in varied)
    assert counters["stats"]["unique_graphs"] == graphs


def test_a_refused_recompilation_means_the_eager_kernels(fused_on):
    """Through dynamo (``compile_fn`` given, as on accelerators): a call that would need another
    compilation (here: under inference mode, which the compiled pass is guarded on) gets None,
    and so do later calls of its size class, without compiling."""
    from torch._dynamo.utils import counters

    fs = FusedStats(eager_reductions, mode="on", compile_fn=torch.compile)
    x = torch.randn(5_000, dtype=torch.float32)
    assert fs(x) is not None
    graphs = counters["stats"]["unique_graphs"]
    with torch.inference_mode():
        y = torch.randn(6_000)
        assert fs(y) is None
    assert fs(y) is None and fs(torch.randn(7_000)) is None
    assert fs(torch.randn(300_000)) is not None  # another size class is unaffected
    assert counters["stats"]["unique_graphs"] == graphs


def test_on_the_cpu_the_compiled_pass_is_called_without_dynamo(fused_on):
    """The CPU pass calls inductor's code directly: no guard to evaluate, so inference mode,
    other shapes and offsets run the one compiled graph, exactly, without compiling again."""
    from torch._dynamo.utils import counters

    x = torch.randn(5_000)
    assert fused_on(x) is not None
    assert fused_on._passes["cpu", torch.float32].direct
    graphs = counters["stats"]["unique_graphs"]
    with torch.inference_mode():
        y = torch.randn(6_001)
        got = fused_on(y)
    assert got is not None and counters["stats"]["unique_graphs"] == graphs
    ref = y.to(torch.float64)
    assert got[0].item() == ref.min().item() and got[1].item() == ref.max().item()
    assert got[2].item() == pytest.approx(ref.sum().item(), rel=1e-12, abs=1e-9)
    assert got[3].item() == pytest.approx(ref.square().sum().item(), rel=1e-12)


def test_a_changed_tensor_gives_new_statistics(fused_on):
    stats = TensorStats(DEFAULT_OPS, fused=fused_on)
    x = torch.randn(10_000)
    before = stats.row(x)
    x.mul_(2)
    x[7] = math.nan
    after = stats.row(x)
    assert after != before
    assert_close_to_reference(after, x)


def test_v2_run_with_the_fused_pass_writes_the_eager_values(tmp_path, monkeypatch):
    """Two identical runs, fused pass on and off: the same CSV values (min, max exactly)."""

    def run(mode: str) -> list[dict[str, str]]:
        monkeypatch.setenv(FUSED_ENV, mode)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 96), nn.Tanh(), nn.Linear(96, 96), nn.Tanh(), nn.Linear(96, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        out = tmp_path / mode
        ops = list(DEFAULT_OPS)
        monitors = {name: {"enabled": True, "ops": ops} for name in ("weight_grad", "optimizer", "param")}
        mon = TrainerMonitorV2(write_config(tmp_path / f"cfg_{mode}", {"output_dir": str(out), "monitors": monitors}))
        mon.start(model=model, optimizer=opt)
        for _ in range(3):
            model(torch.randn(4, 6)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        mon.stop()
        assert (shared_fused()(torch.randn(96 * 96)) is not None) == (mode == "on")
        return [row for f in sorted((out / "rank_0").glob("*.csv")) for row in read_csv(f)[1]]

    fused, eager = run("on"), run("off")
    assert len(fused) == len(eager) > 0
    for a, b in zip(fused, eager, strict=True):
        assert (a["min"], a["max"], a["nans"]) == (b["min"], b["max"], b["nans"])
        for op in ("mean", "norm"):
            assert float(a[op]) == pytest.approx(float(b[op]), rel=1e-6, abs=1e-12)


def test_no_compilation_inside_a_compiled_region(fused_on):
    x = torch.randn(8_192)

    @torch.compile(backend="eager")
    def traced(t: torch.Tensor) -> torch.Tensor:
        return torch.tensor(1.0 if fused_on(t) is None else 0.0)

    assert traced(x).item() == 1.0


# ---- selection, without a real compiler ----------------------------------------------------------


def test_off_and_small_empty_or_non_contiguous_tensors_take_the_eager_kernels():
    calls = []

    def counting(fn, **kwargs):
        calls.append(fn)
        return fn

    fs = FusedStats(eager_reductions, mode="on", compile_fn=counting)
    assert fs(torch.randn(4_095)) is None
    assert fs(torch.empty(0)) is None
    assert fs(torch.randn(100, 100).t()) is None
    assert calls == []
    assert FusedStats(eager_reductions, mode="off", compile_fn=counting)(torch.randn(10_000)) is None
    assert calls == []
    assert fs(torch.randn(10_000)) is not None
    assert fs(torch.randn(20_000)) is not None
    assert len(calls) == 1  # compiled once per (device, dtype)


def test_a_failing_compiler_falls_back_silently(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    fs = FusedStats(eager_reductions, mode="on", compile_fn=broken_compiler)
    x = torch.randn(30_000)
    assert fs(x) is None
    assert TensorStats(DEFAULT_OPS, fused=fs).row(x) == TensorStats(
        DEFAULT_OPS, fused=FusedStats(eager_reductions, mode="off")
    ).row(x)
    assert "unavailable" in caplog.text and "no C++ compiler found" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_kernel_that_fails_under_torch_compile_falls_back(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)

    def failing(x: torch.Tensor):
        raise ValueError("codegen failed")

    fs = FusedStats(eager_reductions, mode="on", kernel=failing)
    assert fs(torch.randn(30_000)) is None
    assert "codegen failed" in caplog.text


def test_an_inexact_pass_is_refused(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)

    def wrong_min(x: torch.Tensor):
        lo, hi, s, ss = min_max_sum_sumsq(x)
        return lo * (1 + 2**-10), hi, s, ss

    def wrong_squares(x: torch.Tensor):
        lo, hi, s, ss = min_max_sum_sumsq(x)
        return lo, hi, s, ss * (1 + 1e-6)

    for kernel in (wrong_min, wrong_squares):
        fs = FusedStats(eager_reductions, mode="on", kernel=kernel, compile_fn=no_compiler)
        assert fs(torch.randn(30_000)) is None
    assert "not exact" in caplog.text


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_the_fused_arithmetic_in_the_batched_rows(dtype):
    """The seam in TensorStats, with the uncompiled kernel: the same rows as float64 references."""
    fs = FusedStats(eager_reductions, mode="on", compile_fn=no_compiler)
    tensors = inputs(dtype) + [torch.randn(10, dtype=dtype), torch.empty(0, dtype=dtype)]
    rows = TensorStats(DEFAULT_OPS, fused=fs).rows(tensors)
    for t, row in zip(tensors[:-1], rows[:-1], strict=True):
        assert_close_to_reference(row, t)
    assert rows[-1][3:] == [0.0, 0.0] and all(math.isnan(v) for v in rows[-1][:3])


def test_auto_uses_the_pass_only_where_it_is_faster():
    slow = FusedStats(eager_reductions, mode="auto", compile_fn=no_compiler, min_speedup=1e9)
    assert slow(torch.randn(300_000)) is None
    free = FusedStats(eager_reductions, mode="auto", compile_fn=no_compiler, min_speedup=0.0)
    assert free(torch.randn(300_000)) is not None


def test_auto_never_compiles_for_tensors_below_262144_elements():
    calls = []
    fs = FusedStats(eager_reductions, mode="auto", compile_fn=lambda fn, **kw: calls.append(fn) or fn, min_speedup=0)
    assert fs(torch.randn(262_143)) is None
    assert calls == []


def test_ops_without_two_reductions_never_use_the_pass():
    calls = []
    fs = FusedStats(eager_reductions, mode="on", compile_fn=lambda fn, **kw: calls.append(fn) or fn)
    TensorStats(["norm", "nans"], fused=fs).rows([torch.randn(10_000), torch.randn(20_000)])
    assert calls == []
    TensorStats(["min", "max", "norm"], fused=fs).rows([torch.randn(10_000), torch.randn(20_000)])
    assert len(calls) == 1


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(64, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def test_by_default_start_builds_the_pass_aside_and_a_step_boundary_adopts_it(tmp_path, monkeypatch):
    """Variable unset, nothing cached: ``prepare()`` (a front door's start) starts a child process
    that builds the C kernel and returns; calls keep the eager kernels, even once the child is
    done and an optimizer stepped, until a step boundary (a front door's end of step calls
    ``step_boundary()``) adopts the pass. No global hook is registered for it."""
    monkeypatch.delenv(FUSED_ENV, raising=False)
    monkeypatch.setenv(native_stats.CACHE_ENV, str(tmp_path / "cache"))
    fs = FusedStats(eager_reductions)
    x = torch.randn(9_000)
    assert fs(x) is None and fs._passes == {}
    hooks = dict(optim_module._global_optimizer_post_hooks)
    fs.prepare()
    assert fs._passes == {} and fs._build is not None  # building aside, nothing loaded yet
    assert dict(optim_module._global_optimizer_post_hooks) == hooks
    assert fs._build.wait(300) and fs._build.result() is not None
    assert fs(x) is None  # built, but a call inside a step never switches kernels
    model = nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_steps(model, opt, 1)
    assert fs(x) is None and fs._build is not None  # an optimizer step alone is no front door's boundary
    fs.step_boundary()
    assert fs._build is None
    got = fs(x)
    assert got is not None and fs._passes["cpu", torch.float32].native
    ref = x.to(torch.float64)
    assert (got[0].item(), got[1].item()) == (ref.min().item(), ref.max().item())
    assert got[2].item() == pytest.approx(ref.sum().item(), rel=1e-12, abs=1e-9)
    assert got[3].item() == pytest.approx(ref.square().sum().item(), rel=1e-12)
    assert fs(x.to(torch.bfloat16)) is None  # other dtypes: eager, and nothing compiled in the call
    assert list(fs._passes) == [("cpu", torch.float32)]
    # the next process (here: another selector) finds it built and checked: in use from the start
    warm = FusedStats(eager_reductions)
    warm.prepare()
    assert warm._build is None and warm._passes["cpu", torch.float32].native
    assert [v.item() for v in warm(x)] == [v.item() for v in got]


def test_auto_builds_the_c_kernel_aside_from_start_and_never_inside_a_step(tmp_path, monkeypatch):
    """``auto``, nothing cached: ``prepare()`` (a front door's start) starts the child and returns;
    a call while it builds takes the eager kernels without waiting (nothing is decided for its
    size class), and the pass serves from the step boundary after the build on."""
    monkeypatch.setenv(FUSED_ENV, "auto")
    monkeypatch.setenv(native_stats.CACHE_ENV, str(tmp_path / "cache"))
    fs = FusedStats(eager_reductions, min_speedup=0.0)  # the timing decides nothing here
    x = torch.randn(300_000)
    fs.prepare()
    build = fs._build
    assert build is not None and fs._passes == {}
    assert fs(x) is None and fs._build is build and fs._chosen == {}  # no wait for the build inside a step
    assert build.wait(300) and build.result() is not None
    assert fs(x) is None  # built, but kernels switch only at a step boundary
    fs.step_boundary()
    assert fs._build is None and fs._passes["cpu", torch.float32].native
    got = fs(x)
    assert got is not None and (got[0].item(), got[1].item()) == (x.min().item(), x.max().item())


def test_on_waits_for_the_c_kernel_at_start_so_every_value_comes_from_it(tmp_path, monkeypatch):
    """``on``, nothing cached: ``prepare()`` waits for the child's build (at start, not inside a
    step): the first call of the run already has the pass, as every later one."""
    monkeypatch.setenv(FUSED_ENV, "on")
    monkeypatch.setenv(native_stats.CACHE_ENV, str(tmp_path / "cache"))
    fs = FusedStats(eager_reductions)
    fs.prepare()
    assert fs._build is None and fs._passes["cpu", torch.float32].native
    assert fs(torch.randn(9_000)) is not None


def test_without_a_c_compiler_the_default_keeps_the_eager_kernels(tmp_path, monkeypatch):
    monkeypatch.delenv(FUSED_ENV, raising=False)
    monkeypatch.setenv(native_stats.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("CC", "")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    fs = FusedStats(eager_reductions)
    fs.prepare()
    assert fs._build is None and fs._passes == {("cpu", torch.float32): None}
    assert fs(torch.randn(9_000)) is None


def test_a_library_that_disagrees_with_the_eager_kernels_is_not_used(tmp_path, monkeypatch):
    """The library found in the cache is loaded only after a quick check against the eager
    kernels (the full check ran in the child that built it)."""
    monkeypatch.setenv(native_stats.CACHE_ENV, str(tmp_path / "cache"))
    build = native_stats.start_build()
    assert build is not None and build.wait(300)
    path = build.result()
    assert path is not None

    def off_by_one_ulp(x: torch.Tensor):
        lo, hi, s, ss = eager_reductions(x)
        return torch.nextafter(lo, torch.tensor(-math.inf)), hi, s, ss

    assert fused_stats._native_pass(path, eager_reductions) is not None
    assert fused_stats._native_pass(path, off_by_one_ulp) is None


@pytest.mark.parametrize("threads", [1, 2])
def test_the_c_kernel_is_exact_split_over_threads_or_not(threads):
    """Against float64 references, on one thread and split over two (the full check's inputs)."""
    build = native_stats.start_build(threads)
    assert build is not None and build.wait(300)
    path = build.result()
    assert path is not None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for parallel_from in (native_stats.PARALLEL_FROM, 0):
            run = native_stats.load(path, parallel_from)
            assert fused_stats._first_mismatch(run, eager_reductions, torch.float32, torch.device("cpu")) is None
            for t in inputs(torch.float32):
                got = [v.item() for v in run(t.reshape(-1))]
                ref = reference(t)
                assert same(got[0], ref[0]) and same(got[1], ref[1])
                n = t.numel()
                assert same(got[2] / n, ref[2], 1e-12) or abs(got[2] / n - ref[2]) < 1e-12
                assert same(math.sqrt(got[3]), ref[3], 1e-12)
    finally:
        torch.set_num_threads(before)


START_PROBE = """
import json, sys, torch
from torch import nn
from torch.optim import optimizer as optim_module
from trainprobe import TrainerMonitorV2
from trainprobe.backends.torch.stats import shared_fused
seen = []
class Probe(nn.Module):
    def forward(self, x):
        seen.append(torch.compiler.is_compiling())
        return x
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), Probe(), nn.Linear(128, 64))
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
mon = TrainerMonitorV2(sys.argv[1])
mon.start(model=model, optimizer=opt)
after_start = ("cpu", torch.float32) in shared_fused()._passes
def step():
    model(torch.randn(64, 64)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
step()
build = shared_fused()._build
if build is not None:
    build.wait(300)
for _ in range(3):
    step()
mon.stop()
fused = shared_fused()._passes.get(("cpu", torch.float32))
print(json.dumps({
    "inductor": sorted(m for m in ("torch._inductor.compile_fx", "torch._inductor.graph") if m in sys.modules),
    "graphs": sum(sys.modules["torch._dynamo.utils"].counters["stats"].values()) if "torch._dynamo.utils" in sys.modules else 0,
    "compiling_seen": any(seen),
    "after_start": after_start,
    "native_in_use": bool(fused is not None and fused.native),
}))
"""


def test_a_default_start_compiles_nothing_in_the_training_process(tmp_path):
    """A V2 run with the variable unset, in a fresh process, cold cache then warm: inductor's
    compiler is never imported and dynamo never compiles in the training process (user code never sees
    ``is_compiling()``); cold, the pass is in use after the child built it; warm, from the start."""
    import json
    import os
    import subprocess
    import sys

    ops = ["min", "max", "norm"]
    monitors = {"param": {"enabled": True, "ops": ops}, "module": {"enabled": True, "ops": ops}}
    env = {k: v for k, v in os.environ.items() if k != FUSED_ENV}
    env[native_stats.CACHE_ENV] = str(tmp_path / "cache")
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(fused_stats.__file__).parents[3]), env.get("PYTHONPATH", "")])
    runs = []
    for state in ("cold", "warm"):
        config = write_config(tmp_path / state, {"output_dir": str(tmp_path / state / "out"), "monitors": monitors})
        done = subprocess.run(
            [sys.executable, "-c", START_PROBE, str(config)], env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    for run in runs:
        assert run["inductor"] == [] and run["graphs"] == 0 and not run["compiling_seen"] and run["native_in_use"]
    assert not cold["after_start"] and warm["after_start"]


def test_an_explicit_mode_prepares_nothing(monkeypatch):
    monkeypatch.setenv(FUSED_ENV, "off")
    fs = FusedStats(eager_reductions)
    fs.prepare()
    assert fs._passes == {} and fs(torch.randn(9_000)) is None


def test_a_default_run_records_every_module_of_every_step(tmp_path, monkeypatch):
    """A V2 run with the variable unset, the pass built aside while it trains: training is
    bitwise the unmonitored training, and the module monitor records every module at every step
    (a compilation in the process would raise ``torch.compiler.is_compiling()`` for the whole
    process, and module hooks, as user code, would take the run for a compiled one)."""
    monkeypatch.delenv(FUSED_ENV, raising=False)
    monkeypatch.setenv(native_stats.CACHE_ENV, str(tmp_path / "cache"))

    def train(monitored: bool) -> tuple[torch.Tensor, Path]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 64))
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        out = tmp_path / ("on" if monitored else "off")
        mon = None
        if monitored:
            ops = ["min", "max", "norm"]
            monitors = {"param": {"enabled": True, "ops": ops}, "module": {"enabled": True, "ops": ops}}
            mon = TrainerMonitorV2(write_config(tmp_path / "cfg", {"output_dir": str(out), "monitors": monitors}))
            mon.start(model=model, optimizer=opt)
        for step in range(4):
            model(torch.randn(64, 64)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            build = shared_fused()._build
            if step == 0 and build is not None:
                build.wait(300)  # adopted at the next step's end
        if monitored:
            assert shared_fused()._passes["cpu", torch.float32].native
        if mon is not None:
            mon.stop()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), out

    plain, _ = train(False)
    watched, out = train(True)
    assert torch.equal(plain, watched)
    params = [row for f in sorted((out / "rank_0").glob("param_*.csv")) for row in read_csv(f)[1]]
    modules = [row for f in sorted((out / "rank_0").glob("module_*.csv")) for row in read_csv(f)[1]]
    assert {row["step"] for row in params} == {row["step"] for row in modules} == {"0", "1", "2", "3"}
    names = {row["module_name"] for row in modules}
    assert {"0", "1", "2"} <= {n.split(".")[0] for n in names}
    for step in "0123":
        assert {row["module_name"] for row in modules if row["step"] == step} == names


# ---- the environment variable -------------------------------------------------------------------


def test_mode_defaults_on_on_the_cpu_only(monkeypatch):
    monkeypatch.delenv(FUSED_ENV, raising=False)
    assert mode_from_env("cpu") == "on"
    assert mode_from_env("cuda") == "off"
    assert mode_from_env("npu") == "off"
    monkeypatch.setenv(FUSED_ENV, " AUTO ")
    assert mode_from_env("cpu") == "auto"


def test_a_bad_mode_fails_at_start_naming_the_variable(monkeypatch):
    monkeypatch.setenv(FUSED_ENV, "yes")
    with pytest.raises(ConfigError, match=r"TRAINPROBE_FUSED_STATS='yes': must be one of auto, on, off"):
        TorchBackend().stats(DEFAULT_OPS, 1e-8)
    assert shared_fused().mode("cpu") == "off"  # during training: the eager kernels, no exception


def test_the_direct_pass_calls_inductors_generated_code(monkeypatch):
    """On the CPU the pass calls the ``call`` inductor generated (no AOT wrappers), on flat views
    at any storage offset; a compiled callable without one inside gives None (the wrapped
    callable is then used)."""
    found = []
    real = fused_stats._generated_code

    def spy(compiled, depth=8):
        found.append(real(compiled, depth))
        return found[-1]

    monkeypatch.setattr(fused_stats, "_generated_code", spy)
    fused = fused_stats._direct_pass(min_max_sum_sumsq, torch.float32, torch.device("cpu"))
    assert fused is not None and fused.direct and found and found[0] is not None
    base = torch.randn(3 * 4_096 + 9)
    for x in (base, base[5 : 5 + 2 * 4_096 + 1], base[7:].view(-1)):
        got = [v.item() for v in fused.run(x)]
        xd = x.double()
        assert got[:2] == [x.min().item(), x.max().item()]
        assert got[2] == pytest.approx(xd.sum().item(), rel=1e-12, abs=1e-9)
        assert got[3] == pytest.approx((xd * xd).sum().item(), rel=1e-12)
    assert real(lambda x: x) is None and real(object()) is None


def test_the_mode_is_read_when_statistics_are_made(monkeypatch):
    """The environment variable is read by ``shared_fused()`` (when a monitor makes its
    statistics), not at every tensor: a change takes effect at the next start."""
    monkeypatch.setenv(FUSED_ENV, "off")
    selector = shared_fused()
    assert selector.mode("cpu") == "off"
    monkeypatch.setenv(FUSED_ENV, "on")
    assert selector.mode("cpu") == "off"  # not re-read per call
    assert shared_fused().mode("cpu") == "on"


def test_the_generated_code_is_used_only_when_it_agrees_with_the_wrapped_callable(monkeypatch):
    """A generated ``call`` that takes its arguments otherwise than expected (here: it raises,
    or returns other values) is not used: the wrapped callable serves, still without dynamo."""
    for broken in (lambda args: (_ for _ in ()).throw(TypeError("args")), lambda args: [torch.zeros(())] * 4):
        monkeypatch.setattr(fused_stats, "_generated_code", lambda compiled, depth=8, broken=broken: broken)
        fused = fused_stats._direct_pass(min_max_sum_sumsq, torch.float32, torch.device("cpu"))
        assert fused is not None and fused.direct
        x = torch.randn(3 * 4_096 + 5)
        got = [v.item() for v in fused.run(x)]
        assert got[:2] == [x.min().item(), x.max().item()]
        assert got[2] == pytest.approx(x.double().sum().item(), rel=1e-12, abs=1e-9)


def test_capturing_the_pass_again_and_again_never_hits_dynamos_recompile_limit():
    """Each capture compiles a fresh copy of the kernel: dynamo's per-code-object cache (8
    entries) never fills, however many dtypes, devices or tests capture it."""
    for _ in range(10):
        fused = fused_stats._direct_pass(min_max_sum_sumsq, torch.float32, torch.device("cpu"))
        assert fused is not None and fused.direct
