"""Overhead of Monitor V2 on a small GPT trained on the CPU: step time and memory.

What is trained: ``TinyGPT`` with its default size (4 layers, d_model 256, 4 heads, sequence 128,
vocabulary 2000, about 4.2M parameters) on synthetic tokens, batch 8, AdamW, on the CPU with
torch's default thread count. ``torch.manual_seed`` fixes the weights and the batches.

Method (one process, one model, one optimizer for every configuration); ``bench_paired.py`` measures
the way users run instead, twin models with the tool left on; on the same code and load the two
methods agree, see docs/performance.md):

* Step time. After a warm-up, blocks of ``--steps-per-block`` steps are run alternately with the
  monitor (``start()`` before the block, ``stop()`` after it) and without it, ``--blocks`` blocks
  each side. Consecutive blocks form a pair; the order inside a pair alternates (monitored first,
  then unmonitored first, ...) so that a slow drift of the machine does not favour one side. Only
  the steps are timed (``perf_counter`` around forward, backward, ``optimizer.step()`` and
  ``zero_grad``); ``start()``/``stop()`` are timed separately and reported, never counted in step
  times. Every block begins with one untimed lead-in step: on the monitored side the writer
  thread's work for the lead-in step then overlaps timed step 1, and the work of the last timed
  step is drained by ``stop()``, so each timed step carries exactly one step's worth of
  background writing, as in a long run. A pair's ratio is the mean step time of its monitored
  block over that of its unmonitored block; the reported figure is the median over the pairs
  (with the interquartile range of the pair ratios).
* Floor and one-read. ``floor`` runs ``weight_grad + optimizer + param`` with the statistics
  replaced by the three reductions any exact min/max, mean and norm needs (:func:`kernel_floor`);
  ``one-read`` replaces the monitor by a minimal hook set of this file that reads each of the
  same tensors at the same points with one ``torch.sum`` (:class:`OneReadHooks`): the lower
  bound of any single-pass design.
* Control. ``control`` runs the same schedule with no monitor on either side; its ratio is the
  noise floor of the method on this machine (ideally 1.00x).
* Clock. Step times are wall clock by default (the headline). ``--clock cpu`` times steps by the
  process's CPU time, every thread included (the writer thread's work too); with ``--threads 1``
  it is close to wall time on an idle machine and hardly moved by other jobs on a shared one,
  which only ever lengthen wall time.
* Memory. ``peak RSS`` is ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` after the configuration
  (process-wide, so it can only grow from one configuration to the next). ``RSS growth`` is
  ``VmRSS`` (``/proc/self/status``) after ``--rss-steps`` consecutive monitored steps (monitor
  still attached) compared with ``VmRSS`` just before ``start()``, in percent. Both readings are
  "settled": ``gc.collect()`` and glibc's ``malloc_trim(0)`` first, because the allocator's cache
  of freed activation buffers alone moves raw VmRSS by about ±10% from one step to the next (the
  raw growth is printed in the details; ``control`` shows the noise of both).
* Noise. Other processes on a small machine lengthen steps at random, and only ever lengthen
  them. The details therefore also give the median over the pairs of the ratio of the two
  blocks' *fastest* steps ("min-step ratio"), which is less sensitive to such bursts; the mean
  ratio stays the headline figure because it includes every cost, spikes of the monitor too.
  (Process CPU time with several threads is no help: torch's OpenMP workers spin while they
  wait, so CPU time is about threads × wall time; with one thread it is, see ``--clock``.) The
  load average is printed at the start and at the end: a
  load above the CPU count means other processes were competing and ``control`` will show it.

Output (CSV files) goes to a temporary directory, removed at the end unless ``--out`` is given.

Usage::

    python bench/bench_monitor_v2.py                 # full run, a few minutes on 2 cores
    python bench/bench_monitor_v2.py --quick         # smoke run
    python bench/bench_monitor_v2.py --configs control,weight_grad --blocks 12
    python bench/bench_monitor_v2.py --configs module --profile   # cProfile of a monitored block
    python bench/bench_monitor_v2.py --threads 1 --clock cpu      # CPU time, 1 thread: stable when shared
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import ctypes
import ctypes.util
import gc
import io
import os
import pstats
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from trainprobe import TrainerMonitorV2
from trainprobe.demo.gpt import benchmark_setup

BATCH_SIZE = 8
T = TypeVar("T")


@dataclass(frozen=True)
class BenchConfig:
    """One configuration: which monitors are on and what it must achieve."""

    key: str
    label: str
    monitors: dict[str, Any] | None  # None: no monitor at all (the control)
    ratio_target: float | None = None
    rss_target_pct: float | None = None
    kernels_only: bool = False  # the "floor" row: see kernel_floor()
    one_read: bool = False  # the "one-read" row: OneReadHooks instead of the monitor


def _on(*names: str) -> dict[str, Any]:
    return {name: {"enabled": True} for name in names}


CONFIGS: tuple[BenchConfig, ...] = (
    BenchConfig("control", "control", None),
    BenchConfig("weight_grad", "weight_grad", _on("weight_grad"), ratio_target=1.02),
    BenchConfig(
        "weight_grad+optimizer+param",
        "weight_grad+optimizer+param",
        _on("weight_grad", "optimizer", "param"),
        ratio_target=1.05,
        rss_target_pct=5.0,
    ),
    BenchConfig(
        "floor",
        "floor: weight_grad+optimizer+param, kernels only",
        _on("weight_grad", "optimizer", "param"),
        kernels_only=True,
    ),
    BenchConfig(
        "one-read",
        "one-read: one sum per tensor at the same points (no trainprobe)",
        _on("weight_grad", "optimizer", "param"),
        one_read=True,
    ),
    BenchConfig("module", "module(all modules)", _on("module"), ratio_target=1.35),
    BenchConfig("all", "all (module+weight_grad+optimizer+param)", _on("module", "weight_grad", "optimizer", "param")),
)
CONFIG_KEYS = {c.key: c for c in CONFIGS} | {c.label: c for c in CONFIGS}


# -- training ---------------------------------------------------------------------------------
class Trainer:
    """The model, its optimizer and a stream of batches."""

    def __init__(self, seed: int) -> None:
        run = benchmark_setup(seed, BATCH_SIZE)
        self.cfg, self.model, self.optimizer, self.batches = run.cfg, run.model, run.optimizer, run.batches
        self.last_loss = float("nan")

    clock = staticmethod(time.perf_counter)
    """What a step's time is: wall clock, or the process's CPU time with ``--clock cpu``."""

    def step(self) -> float:
        """One training step; returns its seconds on :attr:`clock`."""
        batch = next(self.batches)
        t0 = self.clock()
        loss = self.model.loss(batch)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        elapsed = self.clock() - t0
        self.last_loss = loss.item()
        return elapsed


@dataclass
class Block:
    """One timed block."""

    mean_s: float
    min_s: float
    start_s: float = 0.0
    stop_s: float = 0.0


def run_block(trainer: Trainer, steps: int, monitor: TrainerMonitorV2 | None) -> Block:
    """One lead-in step (untimed) then ``steps`` timed steps, with ``monitor`` attached if given."""
    gc.collect()
    start_s = stop_s = 0.0
    if monitor is not None:
        t0 = time.perf_counter()
        monitor.start(model=trainer.model, optimizer=trainer.optimizer)
        start_s = time.perf_counter() - t0
    trainer.step()
    times = [trainer.step() for _ in range(steps)]
    if monitor is not None:
        t0 = time.perf_counter()
        monitor.stop()
        stop_s = time.perf_counter() - t0
    return Block(statistics.fmean(times), min(times), start_s, stop_s)


# -- memory -----------------------------------------------------------------------------------
def _libc_malloc_trim() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_MALLOC_TRIM = _libc_malloc_trim()


def vm_rss_kib(settle: bool = False) -> int:
    """Current resident set size (``VmRSS`` of /proc/self/status) in KiB.

    With ``settle``, Python's garbage is collected and glibc is asked to hand freed heap pages
    back first (``malloc_trim(0)``), so the reading reflects live memory rather than whatever
    the allocator happens to keep cached after the last step (which swings by tens of MiB).
    """
    if settle:
        gc.collect()
        if _MALLOC_TRIM is not None:
            _MALLOC_TRIM(0)
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("VmRSS not found in /proc/self/status")


def load_text() -> str:
    """1/5/15-minute load averages and the CPU count: other work on the machine shows up as noise."""
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return "unavailable"
    return f"{one:.2f} / {five:.2f} / {fifteen:.2f} on {os.cpu_count()} CPUs"


def peak_rss_mib() -> float:
    """``ru_maxrss`` of this process in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- one configuration ------------------------------------------------------------------------
@dataclass
class Result:
    """What was measured for one configuration."""

    config: BenchConfig
    ratios: list[float] = field(default_factory=list)
    min_ratios: list[float] = field(default_factory=list)
    a_blocks: list[Block] = field(default_factory=list)
    b_blocks: list[Block] = field(default_factory=list)
    rss_before_kib: int = 0  # settled (gc + malloc_trim)
    rss_after_kib: int = 0
    raw_before_kib: int = 0  # as the allocator left it
    raw_after_kib: int = 0
    rss_run_peak_kib: int = 0
    peak_rss_mib: float = 0.0
    seconds: float = 0.0

    @property
    def median_ratio(self) -> float:
        return statistics.median(self.ratios)

    @property
    def iqr(self) -> tuple[float, float]:
        return quartiles(self.ratios)

    @property
    def rss_growth_pct(self) -> float:
        return 100.0 * (self.rss_after_kib - self.rss_before_kib) / self.rss_before_kib

    @property
    def raw_growth_pct(self) -> float:
        return 100.0 * (self.raw_after_kib - self.raw_before_kib) / self.raw_before_kib

    def passes(self) -> bool | None:
        checks = []
        if self.config.ratio_target is not None:
            checks.append(self.median_ratio <= self.config.ratio_target)
        if self.config.rss_target_pct is not None:
            checks.append(self.rss_growth_pct <= self.config.rss_target_pct)
        return all(checks) if checks else None


def in_turn(i: int, first: Callable[[], T], second: Callable[[], T]) -> tuple[T, T]:
    """``(first(), second())`` of pair ``i``, called in that order for even ``i`` and the other
    way round for odd ``i``, so that a slow drift of the machine favours neither side."""
    if i % 2 == 0:
        a = first()
        b = second()
    else:
        b = second()
        a = first()
    return a, b


def quartiles(values: list[float]) -> tuple[float, float]:
    """First and third quartiles of ``values`` (inclusive method; one value: that value twice)."""
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def measure(
    cfg: BenchConfig, trainer: Trainer, out: Path, args: argparse.Namespace, framework: str = "pytorch"
) -> Result:
    """Alternating blocks, then the RSS run, for one configuration (``trainer``: anything with
    ``model``, ``optimizer`` and ``step() -> seconds``; ``framework`` as TrainerMonitorV2's ``fr``)."""
    with kernel_floor(cfg.kernels_only):
        return _measure(cfg, trainer, out, args, framework)


@contextlib.contextmanager
def kernel_floor(active: bool) -> Iterator[None]:
    """While active, statistics cost only the three reductions that any exact implementation of
    min/max, mean and norm must run over each tensor (``aminmax``, row sums, row norms, for every
    tensor of 4,096 elements or more: 99% of the values); rows are written as zeros. The
    ``floor`` row measured this way is the overhead left with no Python, batching, combination
    or number formatting at all: what the monitor's own code adds is the distance to it."""
    if not active:
        yield
        return
    from trainprobe.backends.torch import stats as torch_stats

    real = torch_stats.TensorStats.rows

    def reductions_only(self: Any, tensors: list[torch.Tensor]) -> list[list[float]]:
        for t in tensors:
            x = t.detach()
            n = x.numel() - x.numel() % 256
            if n >= 4096:
                torch.aminmax(x)
                rows = x.reshape(-1)[:n].view(-1, 256)
                rows.sum(1)
                torch.linalg.vector_norm(rows, dim=1)
        return [[0.0] * len(self.ops) for _ in tensors]

    torch_stats.TensorStats.rows = reductions_only
    try:
        yield
    finally:
        torch_stats.TensorStats.rows = real


class OneReadHooks:
    """The ``one-read`` rows: a minimal hook set, no trainprobe, that reads every tensor a monitor
    configuration reads, once, at each point where it reads it, with one ``torch.sum`` per
    tensor, and copies the step's sums to the host once, when the step ends (as the monitors
    copy a step's statistics once): no min/max/norm, no rows, no files. The lower bound of any
    design that reads each monitored tensor once per point. ``points`` says which configuration:

    * ``"wg+opt+param"`` (V2 ``weight_grad + optimizer + param``, V1 ``wg + mv + param``): every
      gradient at the end of backward (``unreduced``) and again just before ``optimizer.step()``
      (``reduced``), every parameter before the step (``param_origin``) and after it
      (``param_updated``), and both Adam moments after it;
    * ``"weight_grad"`` (V2 ``weight_grad`` alone): the two gradient points;
    * ``"module"`` (V2 ``module`` and V1 ``xy`` over all modules): every module's input tensors
      in a forward pre-hook and its outputs in a forward hook, and, through tensor hooks (as the
      monitors read them, never module backward hooks), the gradient of each output and of each
      input that requires one.

    ``start(model, optimizer)`` / ``stop()`` like a monitor."""

    POINTS = ("wg+opt+param", "weight_grad", "module")

    def __init__(self, points: str = "wg+opt+param", *_: Any, **__: Any) -> None:
        if points not in self.POINTS:
            raise ValueError(f"points: one of {self.POINTS}, not {points!r}")
        self.points = points
        self._handles: list[Any] = []
        self._params: list[torch.nn.Parameter] = []
        self._optimizer: torch.optim.Optimizer | None = None
        self._pending: list[torch.Tensor] = []  # this step's sums, not yet on the host
        self.sums: list[float] = []  # the last step's sums, on the host

    def start(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, **_: Any) -> None:
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._optimizer = optimizer
        if self.points == "module":
            for module in model.modules():
                self._handles.append(module.register_forward_pre_hook(self._module_inputs, with_kwargs=True))
                self._handles.append(module.register_forward_hook(self._module_outputs))
        else:
            self._handles.append(self._params[-1].register_hook(self._backward_started))
            self._handles.append(optimizer.register_step_pre_hook(self._before_step))
        self._handles.append(optimizer.register_step_post_hook(self._after_step))

    def stop(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _read(self, tensors: Iterable[Any]) -> None:
        with torch.no_grad():
            self._pending.extend(torch.sum(t) for t in tensors if isinstance(t, torch.Tensor))

    def _read_grad(self, grad: torch.Tensor) -> None:
        self._read([grad])

    def _watch(self, tensors: Iterable[Any]) -> None:
        """Read ``tensors`` now and their gradients when autograd computes them."""
        tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
        self._read(tensors)
        for t in tensors:
            if t.requires_grad:
                t.register_hook(self._read_grad)

    def _module_inputs(self, _module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._watch([*args, *kwargs.values()])

    def _module_outputs(self, _module: torch.nn.Module, _args: Any, output: Any) -> None:
        self._watch(output if isinstance(output, (tuple, list)) else [output])

    def _backward_started(self, grad: torch.Tensor) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_finished)

    def _backward_finished(self) -> None:
        self._read([p.grad for p in self._params if p.grad is not None])

    def _before_step(self, *_: Any) -> None:
        self._read([p.grad for p in self._params if p.grad is not None])
        if self.points == "wg+opt+param":
            self._read(self._params)

    def _after_step(self, *_: Any) -> None:
        assert self._optimizer is not None
        if self.points == "wg+opt+param":
            self._read(self._params)
            state = self._optimizer.state
            self._read(
                [state[p][k] for p in self._params if p in state for k in ("exp_avg", "exp_avg_sq") if k in state[p]]
            )
        if self._pending:  # the one host copy of the step
            self.sums = torch.stack(self._pending).tolist()
            self._pending = []


def _measure(cfg: BenchConfig, trainer: Trainer, out: Path, args: argparse.Namespace, framework: str) -> Result:
    t_begin = time.perf_counter()
    monitor: Any = None
    if cfg.one_read:
        monitor = OneReadHooks()
    elif cfg.monitors is not None:
        monitor = TrainerMonitorV2(
            {"output_dir": str(out / cfg.key.replace("+", "_")), "monitors": cfg.monitors}, fr=framework
        )
    res = Result(cfg)
    # Warm-up pair, discarded: first start() of this config, caches after the switch.
    run_block(trainer, args.warmup_block_steps, monitor)
    run_block(trainer, args.warmup_block_steps, None)
    for i in range(args.blocks):
        a, b = in_turn(
            i,
            lambda: run_block(trainer, args.steps_per_block, monitor),
            lambda: run_block(trainer, args.steps_per_block, None),
        )
        res.a_blocks.append(a)
        res.b_blocks.append(b)
        res.ratios.append(a.mean_s / b.mean_s)
        res.min_ratios.append(a.min_s / b.min_s)
    # Memory: a long monitored run (the monitor is still attached at the "after" readings).
    gc.collect()
    res.raw_before_kib = vm_rss_kib()
    res.rss_before_kib = vm_rss_kib(settle=True)
    if monitor is not None:
        monitor.start(model=trainer.model, optimizer=trainer.optimizer)
    peak = 0
    for _ in range(args.rss_steps):
        trainer.step()
        peak = max(peak, vm_rss_kib())
    res.raw_after_kib = vm_rss_kib()
    res.rss_after_kib = vm_rss_kib(settle=True)
    res.rss_run_peak_kib = peak
    if monitor is not None:
        monitor.stop()
    res.peak_rss_mib = peak_rss_mib()
    res.seconds = time.perf_counter() - t_begin
    return res


# -- profiling (optional) ---------------------------------------------------------------------
def profile_config(
    cfg: BenchConfig, trainer: Trainer, out: Path, steps: int, top: int, framework: str = "pytorch"
) -> None:
    """cProfile of ``steps`` monitored steps (after one untimed step), top functions by own time."""
    if cfg.monitors is None:
        return
    monitor: Any = (
        OneReadHooks()
        if cfg.one_read
        else TrainerMonitorV2(
            {"output_dir": str(out / f"profile_{cfg.key.replace('+', '_')}"), "monitors": cfg.monitors}, fr=framework
        )
    )
    monitor.start(model=trainer.model, optimizer=trainer.optimizer)
    trainer.step()
    prof = profiled_steps(trainer.step, steps)
    monitor.stop()
    print_profile(prof, f"{cfg.label}, {steps} steps, main thread only, sorted by own time", top)


def profiled_steps(step: Callable[[], object], steps: int) -> cProfile.Profile:
    """cProfile of ``steps`` calls of ``step``."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    return prof


def print_profile(prof: cProfile.Profile, title: str, top: int) -> None:
    """The ``top`` functions of ``prof`` (by own time, or ``$BENCH_PROFILE_SORT``) as a Markdown
    section headed ``cProfile: <title>``."""
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats(os.environ.get("BENCH_PROFILE_SORT", "tottime")).print_stats(top)
    print(f"\n### cProfile: {title}\n")
    print("```")
    print(buf.getvalue().strip())
    print("```")


# -- report -----------------------------------------------------------------------------------
def target_text(cfg: BenchConfig) -> str:
    parts = []
    if cfg.ratio_target is not None:
        parts.append(f"≤ {cfg.ratio_target:.2f}x")
    if cfg.rss_target_pct is not None:
        parts.append(f"RSS growth ≤ {cfg.rss_target_pct:.0f}%")
    return ", ".join(parts) if parts else "—"


def pass_text(res: Result) -> str:
    ok = res.passes()
    if ok is None:
        return "—"
    if ok:
        return "yes"
    missed = []
    cfg = res.config
    if cfg.ratio_target is not None and res.median_ratio > cfg.ratio_target:
        missed.append("ratio")
    if cfg.rss_target_pct is not None and res.rss_growth_pct > cfg.rss_target_pct:
        missed.append("RSS")
    return f"**NO** ({', '.join(missed)})"


def print_report(results: list[Result]) -> None:
    print("\n| config | median ratio | target | pass | RSS growth | peak RSS |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r.config.label} | {r.median_ratio:.3f}x | {target_text(r.config)} | {pass_text(r)} "
            f"| {r.rss_growth_pct:+.1f}% | {r.peak_rss_mib:.0f} MiB |"
        )
    print(
        "\nDetails: IQR and range of the pair ratios; min-step ratio = median over the pairs of the ratio of"
        "\nthe blocks' fastest steps; step times are medians of block means; start()/stop()"
        "\nare medians per block (not in step times); RSS: settled (gc + malloc_trim) before → after, raw"
        "\nVmRSS growth without settling, and the highest raw VmRSS seen during the RSS run.\n"
    )
    print(
        "| config | IQR of ratios | min–max | min-step ratio | monitored step | unmonitored step | start() | stop() "
        "| RSS before → after | raw growth | run peak | wall |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        q1, q3 = r.iqr
        a_ms = 1000 * statistics.median(b.mean_s for b in r.a_blocks)
        b_ms = 1000 * statistics.median(b.mean_s for b in r.b_blocks)
        start_ms = 1000 * statistics.median(b.start_s for b in r.a_blocks)
        stop_ms = 1000 * statistics.median(b.stop_s for b in r.a_blocks)
        print(
            f"| {r.config.label} | {q1:.3f}–{q3:.3f} | {min(r.ratios):.3f}–{max(r.ratios):.3f} "
            f"| {statistics.median(r.min_ratios):.3f}x | {a_ms:.1f} ms | {b_ms:.1f} ms | {start_ms:.1f} ms "
            f"| {stop_ms:.1f} ms | {r.rss_before_kib / 1024:.0f} → {r.rss_after_kib / 1024:.0f} MiB "
            f"| {r.raw_growth_pct:+.1f}% | {r.rss_run_peak_kib / 1024:.0f} MiB | {r.seconds:.0f} s |"
        )


# -- command line -----------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps-per-block", type=int, default=None, help="timed steps per block (default 5)")
    p.add_argument("--blocks", type=int, default=None, help="blocks per side and configuration (default 8)")
    p.add_argument("--rss-steps", type=int, default=None, help="steps of the RSS-growth run (default 40)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps before everything (default 10)")
    p.add_argument("--quick", action="store_true", help="small counts for a smoke run")
    p.add_argument(
        "--configs",
        default=",".join(c.key for c in CONFIGS),
        help=f"comma-separated subset of: {', '.join(c.key for c in CONFIGS)}",
    )
    p.add_argument("--out", type=Path, default=None, help="keep the CSV output here (default: a temp dir, removed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="also print a cProfile of each monitored config")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="a step's time: wall clock (the headline), or the process's CPU time, every thread included "
        "(with --threads 1, robust to other jobs on a shared machine)",
    )
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        Trainer.clock = staticmethod(time.process_time)
    quick = args.quick
    fill_counts(p, args, {"steps_per_block": (2, 5), "blocks": (2, 8), "rss_steps": (6, 40), "warmup": (2, 10)})
    args.warmup_block_steps = 1 if quick else 2
    wanted = [s.strip() for s in args.configs.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in CONFIG_KEYS]
    if unknown:
        p.error(f"unknown config(s) {unknown}; choose from {', '.join(c.key for c in CONFIGS)}")
    chosen = {CONFIG_KEYS[s].key for s in wanted}
    args.selected = [c for c in CONFIGS if c.key in chosen]
    return args


def fill_counts(p: argparse.ArgumentParser, args: argparse.Namespace, defaults: dict[str, tuple[int, int]]) -> None:
    """Each count ``name`` of ``defaults`` (``name: (with --quick, without)``) left unset on the
    command line set to its default; a count below 1 is a usage error (exits)."""
    for name, (small, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, small if args.quick else full)
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")


@contextlib.contextmanager
def output_folder(out: Path | None, prefix: str) -> Iterator[Path]:
    """``out`` (created if missing), or a fresh temporary folder named ``<prefix>...``, removed at
    the end."""
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        yield out
        return
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_selected(
    trainer: Any,
    out: Path,
    args: argparse.Namespace,
    progress: Callable[[Result], str],
    profile_steps: int,
    framework: str = "pytorch",
) -> None:
    """The warm-up, then :func:`measure` of each configuration of ``args.selected`` (a line
    ``<label>: <progress(result)>`` each), the report and, with ``--profile``, a cProfile of each
    (``profile_steps`` steps). ``trainer`` and ``framework`` as :func:`measure` takes them."""
    print(f"load average at start: {load_text()}", flush=True)
    warm = [trainer.step() for _ in range(args.warmup)]
    print(f"warm-up: {args.warmup} steps, last {1000 * warm[-1]:.1f} ms", flush=True)
    results = []
    for cfg in args.selected:
        res = measure(cfg, trainer, out, args, framework=framework)
        results.append(res)
        print(f"  {cfg.label}: {progress(res)}", flush=True)
    print(f"final loss {trainer.last_loss:.3f}; load average at end: {load_text()}")
    print_report(results)
    if args.profile:
        for cfg in args.selected:
            profile_config(cfg, trainer, out, steps=profile_steps, top=25, framework=framework)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with output_folder(args.out, "trainprobe-bench-") as out:
        trainer = Trainer(args.seed)
        n_params = sum(p.numel() for p in trainer.model.parameters())
        print(
            f"TinyGPT {n_params / 1e6:.2f}M params, batch {BATCH_SIZE}, seq {trainer.cfg.seq_len}, AdamW; "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.clock} clock; "
            f"{args.blocks} blocks x {args.steps_per_block} steps per side; RSS run {args.rss_steps} steps; "
            f"output in {out}",
            flush=True,
        )
        run_selected(
            trainer,
            out,
            args,
            lambda res: (
                f"median ratio {res.median_ratio:.3f}x, RSS growth {res.rss_growth_pct:+.1f}%, "
                f"peak RSS {res.peak_rss_mib:.0f} MiB ({res.seconds:.0f} s)"
            ),
            profile_steps=max(args.steps_per_block, 3),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
