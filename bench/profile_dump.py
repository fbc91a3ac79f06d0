"""Where the precision dump's CPU time goes, on the GPT benchmark model (statistics task).

Two measurements per level, each in its own process (one torch thread, ``process_time``: CPU
seconds of the whole process, the ``.pt`` writer thread included):

* **ratio**: a dumped step (``start(model)``, forward, backward, ``optimizer.step()``,
  ``zero_grad``, ``stop()``, ``step()``) against the same step of a twin model that is never
  dumped (same initial weights, its own AdamW), one of each per pair, the order alternating;
  the median over the pairs of dumped / undumped.
* **breakdown**: the dump's own CPU time per step by where it is spent: the statistics kernels
  (``Max``/``Min``/``Mean``/``Norm`` of each tensor), the module forward hooks, the backward and
  parameter-gradient hooks, the API wrappers' recording (L1/mix) and ``start``/``stop``/``step``
  (``stop`` writes the JSON files). Times are self times: the statistics computed inside a hook
  count as statistics, not as that hook. What the breakdown does not attribute (torch calling
  the hooks, the L1 wrappers' pass-through, caches evicted by the dump's reads) is the
  difference between the ratio's overhead and the attributed sum.

``--unfused`` runs the statistics through the kernels used before the fused float32 path
(``aminmax``, ``sum64``, ``norm64`` per tensor; the same values) for comparison.

Usage::

    python bench/profile_dump.py                      # L0, L1, mix
    python bench/profile_dump.py --levels L0 --pairs 30 --unfused
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

CATEGORIES = (
    ("statistics", "statistics kernels"),
    ("forward pre-hook", "module forward pre-hooks"),
    ("forward hook", "module forward hooks"),
    ("backward hook", "backward hooks (module/API gradients)"),
    ("gradient hook", "parameter-gradient hooks"),
    ("recording an API's inputs", "API wrappers: inputs"),
    ("recording an API's outputs", "API wrappers: outputs"),
    ("start", "start()"),
    ("stop", "stop() (JSON files)"),
    ("step", "step()"),
)


class SelfTimer:
    """Self CPU time per key: time inside nested timed calls goes to the inner key only."""

    def __init__(self) -> None:
        self.total: dict[str, float] = collections.defaultdict(float)
        self._inner: list[float] = []

    def wrap(self, key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.process_time()
            self._inner.append(0.0)
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.process_time() - t0
                self.total[key] += elapsed - self._inner.pop()
                if self._inner:
                    self._inner[-1] += elapsed

        return timed


def _worker(level: str, mode: str, pairs: int, unfused: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    import trainprobe.stats.torch_stats as torch_stats
    from trainprobe.demo.gpt import benchmark_setup
    from trainprobe.dump import PrecisionDebugger, entries
    from trainprobe.dump.collector import Collector

    if unfused:
        torch_stats._fused_float32 = lambda *a: None  # type: ignore[assignment]
    timer = SelfTimer()
    if mode == "breakdown":
        plain_guarded = Collector.guarded

        def guarded(self: Collector, where: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            return plain_guarded(self, where, timer.wrap(re.sub(r" of .*| \(.*", "", where), fn))

        Collector.guarded = guarded  # type: ignore[method-assign]
        entries._STATS.row = timer.wrap("statistics", entries._STATS.row)  # type: ignore[method-assign]
    run = benchmark_setup(0, 8)
    model, optimizer, batches = run.model, run.optimizer, run.batches
    twin = copy.deepcopy(model)
    twin_optimizer = torch.optim.AdamW(twin.parameters(), lr=3e-4)
    out = tempfile.mkdtemp(prefix="trainprobe-profile-dump-")
    debugger = PrecisionDebugger(task="statistics", level=level, dump_path=out)
    calls = {n: getattr(debugger, n) for n in ("start", "stop", "step")}
    if mode == "breakdown":
        calls = {n: timer.wrap(n, f) for n, f in calls.items()}

    def step(m: torch.nn.Module, opt: torch.optim.Optimizer, dumped: bool) -> float:
        batch = next(batches)
        t0 = time.process_time()
        if dumped:
            calls["start"](m)
        m.loss(batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dumped:
            calls["stop"]()
            calls["step"]()
        return time.process_time() - t0

    try:
        for _ in range(3):
            step(model, optimizer, True)
            step(twin, twin_optimizer, False)
        timer.total.clear()
        ratios, dumped_s, plain_s = [], [], []
        for i in range(pairs):
            if i % 2 == 0:
                a, b = step(model, optimizer, True), step(twin, twin_optimizer, False)
            else:
                b, a = step(twin, twin_optimizer, False), step(model, optimizer, True)
            ratios.append(a / b)
            dumped_s.append(a)
            plain_s.append(b)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return {
        "ratio": statistics.median(ratios),
        "dumped_ms": 1000 * statistics.median(dumped_s),
        "plain_ms": 1000 * statistics.median(plain_s),
        "breakdown_ms": {k: 1000 * v / pairs for k, v in timer.total.items()},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--levels", default="L0,L1,mix")
    p.add_argument("--pairs", type=int, default=30, help="pairs for the ratio (default 30)")
    p.add_argument("--breakdown-steps", type=int, default=10)
    p.add_argument("--unfused", action="store_true", help="statistics through the pre-fusion kernels")
    p.add_argument("--worker", nargs=2, metavar=("LEVEL", "MODE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        level, mode = args.worker
        steps = args.pairs if mode == "ratio" else args.breakdown_steps
        print(json.dumps(_worker(level, mode, steps, args.unfused)))
        return 0
    for level in [v.strip() for v in args.levels.split(",") if v.strip()]:
        res = {}
        for mode in ("ratio", "breakdown"):
            cmd = [sys.executable, __file__, "--worker", level, mode, "--pairs", str(args.pairs)]
            cmd += ["--breakdown-steps", str(args.breakdown_steps)] + (["--unfused"] if args.unfused else [])
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            res[mode] = json.loads(done.stdout.strip().splitlines()[-1])
        r, b = res["ratio"], res["breakdown"]["breakdown_ms"]
        overhead = r["dumped_ms"] - r["plain_ms"]
        print(f"\n{level}: dumped/undumped {r['ratio']:.3f}x (median of {args.pairs} pairs), "
              f"dumped {r['dumped_ms']:.0f} ms, undumped {r['plain_ms']:.0f} ms, overhead {overhead:.0f} ms")  # fmt: skip
        print("| where | ms per step | share of the undumped step |\n|---|---|---|")
        for key, label in CATEGORIES:
            if key in b:
                print(f"| {label} | {b[key]:.1f} | {100 * b[key] / r['plain_ms']:.1f}% |")
        rest = overhead - sum(b.values())
        print(f"| not attributed (hook calls by torch, wrappers, cache effects) | {rest:.1f} | "
              f"{100 * rest / r['plain_ms']:.1f}% |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
