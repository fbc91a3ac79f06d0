"""Step time and rows per step over a long run whose module input lives across steps.

What is trained: ``LatentModel``, a learned latent ``nn.Parameter`` (``--tokens`` x ``--dim``)
passed as the input of a submodule (``sub``: Linear, GELU, Linear) in every forward, as learned
queries are, plus a batch path (``enc``) and a ``head``; AdamW, on the CPU, batches drawn from a
fixed seed. The module monitor hooks the latent's gradient in every step; the hook must go at the
step's end, so step time and rows per step stay flat over the run.

Method (one process): two twins of the model with the same weights and batches, one under the
monitor, one without, trained ``--steps`` steps side by side, one step of each in turn (the order
alternates every step so that neither side is favoured by a drift of the machine). Only the steps
are timed (forward, backward, ``optimizer.step()`` and ``zero_grad``), by the wall clock
(``perf_counter``) and by the training thread's CPU time (``thread_time``: hardly moved by other
jobs on a shared machine, which only lengthen wall time; the writer thread's work is not in it,
it is in the wall time and the ratio). Reported per monitor:

* the median step time of the first and of the last ``--window`` monitored steps and their ratio,
  wall and CPU (flat: about 1.0 within noise; a hook left per step makes it grow with the run);
* the monitored/unmonitored ratio of the whole run (median over the steps of the ratio of the two
  twins' step times) and of the first and last window;
* rows per step (the monitor's CSV files read back: every step must have the same count) and the
  tensor hooks the latent holds after each backward (min/max over the run) and after ``stop()``;
* whether the two twins' parameters are bitwise equal at the end.

Monitors: ``v2`` (Monitor V2 ``module`` monitor, every module, inputs, outputs and gradients) and
``v1`` (Monitor V1 ``xy_distribution`` with ``all_xy``: ``actv`` and ``actv_grad``).

Usage::

    python bench/bench_hook_pileup.py                    # both monitors, 1000 steps each
    python bench/bench_hook_pileup.py --monitors v2 --steps 300 --window 50
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import os
import shutil
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

os.environ.setdefault("TRAINPROBE_FUSED_STATS", "off")  # the same kernels from the first step on

from trainprobe import TrainerMon, TrainerMonitorV2  # noqa: E402 - after the environment is set

OPS = ["min", "max", "mean", "norm"]


class LatentModel(nn.Module):
    """A learned latent is the input of ``sub`` in every forward; the batch enters through ``enc``."""

    def __init__(self, tokens: int, dim: int) -> None:
        super().__init__()
        self.latent = nn.Parameter(torch.randn(tokens, dim) * 0.1)
        self.sub = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.enc = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(x) + self.sub(self.latent))


@dataclass
class Result:
    """What one monitor's run measured."""

    monitor: str
    first_ms: float
    last_ms: float
    first_cpu_ms: float
    last_cpu_ms: float
    ratio_all: float
    ratio_first: float
    ratio_last: float
    rows_per_step: list[int]
    hooks_min: int
    hooks_max: int
    hooks_after_stop: int
    bitwise: bool


class Twin:
    """One model, its optimizer and the step times of its run."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.times: list[float] = []
        self.cpu: list[float] = []

    def step(self, x: torch.Tensor, after_backward: Callable[[], None] | None = None) -> None:
        """One timed training step on ``x`` (``after_backward`` runs untimed, before the update)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        self.model(x).pow(2).mean().backward()
        t1, c1 = time.perf_counter(), time.thread_time()
        if after_backward is not None:
            after_backward()
        t2, c2 = time.perf_counter(), time.thread_time()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.times.append((t1 - t0) + (time.perf_counter() - t2))
        self.cpu.append((c1 - c0) + (time.thread_time() - c2))


def rows_per_step(folder: Path, pattern: str) -> list[int]:
    """The rows of each step, in step order, over every CSV file matching ``pattern``."""
    per_step: Counter[int] = Counter()
    for path in folder.rglob(pattern):
        with path.open(newline="", encoding="utf-8") as fh:
            for row in csv.DictReader(fh):
                per_step[int(row["step"])] += 1
    return [per_step[step] for step in sorted(per_step)]


def start_monitor(name: str, model: nn.Module, opt: torch.optim.Optimizer, out: Path) -> Callable[[], None]:
    """Attach monitor ``name`` to ``model``; returns its ``stop``."""
    if name == "v2":
        v2 = TrainerMonitorV2({"output_dir": str(out), "monitors": {"module": {"enabled": True, "ops": OPS}}})
        v2.start(model=model, optimizer=opt)
        return v2.stop
    config = out / "monitor_config.json"
    out.mkdir(parents=True)
    config.write_text(json.dumps({"targets": {}, "xy_distribution": True, "all_xy": True, "ops": OPS}))
    os.environ["MONITOR_OUTPUT_DIR"] = str(out)
    v1 = TrainerMon(str(config))
    v1.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    return v1.stop


def median_ratio(a: list[float], b: list[float]) -> float:
    """Median over the steps of ``a[i] / b[i]``."""
    return statistics.median(x / y for x, y in zip(a, b))


def run(name: str, args: argparse.Namespace, out: Path) -> Result:
    """Train the twins ``args.steps`` steps, one under monitor ``name``."""
    torch.manual_seed(0)
    base = LatentModel(args.tokens, args.dim)
    watched, plain = Twin(copy.deepcopy(base)), Twin(copy.deepcopy(base))
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(args.tokens, args.dim, generator=g) for _ in range(args.steps)]
    stop = start_monitor(name, watched.model, watched.opt, out)
    latent = watched.model.latent
    hooks: list[int] = []

    def count_hooks() -> None:
        hooks.append(len(latent._backward_hooks or {}))

    for i, x in enumerate(data):
        if i % 2:
            plain.step(x)
            watched.step(x, count_hooks)
        else:
            watched.step(x, count_hooks)
            plain.step(x)
    stop()
    w = args.window
    bitwise = all(torch.equal(a, b) for a, b in zip(watched.model.parameters(), plain.model.parameters()))
    return Result(
        monitor=name,
        first_ms=statistics.median(watched.times[:w]) * 1e3,
        last_ms=statistics.median(watched.times[-w:]) * 1e3,
        first_cpu_ms=statistics.median(watched.cpu[:w]) * 1e3,
        last_cpu_ms=statistics.median(watched.cpu[-w:]) * 1e3,
        ratio_all=median_ratio(watched.times, plain.times),
        ratio_first=median_ratio(watched.times[:w], plain.times[:w]),
        ratio_last=median_ratio(watched.times[-w:], plain.times[-w:]),
        rows_per_step=rows_per_step(out, "module_step*.csv" if name == "v2" else "actv*.csv"),
        hooks_min=min(hooks),
        hooks_max=max(hooks),
        hooks_after_stop=len(latent._backward_hooks or {}),
        bitwise=bitwise,
    )


def report(r: Result, window: int) -> None:
    """Print one monitor's figures."""
    rows = r.rows_per_step
    shape = "flat" if min(rows) == max(rows) else f"NOT flat, min {min(rows)}, max {max(rows)}"
    counts = f"{rows[0]} in the first step, {rows[-1]} in the last, over {len(rows)} steps ({shape})"
    print(f"[{r.monitor}]")
    print(
        f"  monitored step time: first {window} {r.first_ms:.3f} ms, last {window} {r.last_ms:.3f} ms "
        f"(last/first {r.last_ms / r.first_ms:.2f}); CPU {r.first_cpu_ms:.3f} ms, {r.last_cpu_ms:.3f} ms "
        f"(last/first {r.last_cpu_ms / r.first_cpu_ms:.2f})"
    )
    print(
        f"  monitored/unmonitored: {r.ratio_all:.2f}x over the run "
        f"(first {window} {r.ratio_first:.2f}x, last {window} {r.ratio_last:.2f}x)"
    )
    print(f"  rows per step ({'module' if r.monitor == 'v2' else 'actv + actv_grad'}): {counts}")
    print(f"  hooks on the latent after backward: {r.hooks_min}..{r.hooks_max}; after stop(): {r.hooks_after_stop}")
    print(f"  parameters bitwise equal to the unmonitored twin: {r.bitwise}")


def main() -> None:
    """Parse the arguments, run each monitor, print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--window", type=int, default=100, help="steps at the start and the end compared")
    parser.add_argument("--monitors", default="v2,v1", help="comma-separated: v2, v1")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", type=Path, default=None, help="keep the CSV files here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.steps < 2 * args.window:
        parser.error("--steps must be at least twice --window")
    root = args.out if args.out is not None else Path(tempfile.mkdtemp(prefix="trainprobe-pileup-"))
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.steps} steps, "
        f"latent {args.tokens}x{args.dim}, load {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    try:
        for name in args.monitors.split(","):
            if name not in ("v2", "v1"):
                parser.error(f"--monitors: unknown monitor {name!r}")
            report(run(name, args, root / name), args.window)
    finally:
        print(f"load at the end {os.getloadavg()[0]:.1f}")
        if args.out is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
