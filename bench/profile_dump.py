"""Where the precision dump's CPU time goes, on the GPT benchmark model (statistics task).

One process per level, one torch thread, ``process_time`` (CPU seconds of the whole process, the
``.pt`` writer thread included). Steps come in triples, the order rotating through all six
permutations so that a drift of the machine favours none:

* an undumped step of a twin model that is never dumped (same initial weights, its own AdamW);
* a dumped step (``start(model)``, forward, backward, ``optimizer.step()``, ``zero_grad``,
  ``stop()``, ``step()``) with the statistics computed as now;
* the same dumped step with ``--baseline-stats``: the statistics through the per-tensor kernels
  used before the fused float32 path (``aminmax``, ``sum64``, ``norm64``; the same values).

Reported: the median over the triples of dumped / undumped for both, and, for the current
dumped steps, the dump's own CPU time per step by where it is spent: the statistics kernels
(``Max``/``Min``/``Mean``/``Norm`` of each tensor), the module forward hooks, the backward and
parameter-gradient hooks, the API wrappers' recording (L1/mix) and ``start``/``stop``/``step``
(``stop`` writes the JSON files). These are self times (the statistics computed inside a hook
count as statistics, not as that hook), measured on the same steps as the ratio; the rest of the
overhead (torch calling the hooks, the L1 wrappers' pass-through, the training's own work slowed
by caches the dump's reads evicted, the timers themselves: ~1 us per timed call) is "not
attributed". On a shared machine a single figure moves by several percent from run to run; the
two dumped variants share their undumped steps, so their difference is the reliable part.

Usage::

    python bench/profile_dump.py                      # L0, L1, mix
    python bench/profile_dump.py --levels L0 --triples 30
"""

from __future__ import annotations

import argparse
import collections
import copy
import itertools
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


def _worker(level: str, triples: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    import trainprobe.backends.torch.stats as torch_stats
    from trainprobe.demo.gpt import benchmark_setup
    from trainprobe.dump import PrecisionDebugger, entries
    from trainprobe.dump.collector import Collector

    fused = torch_stats._chunked_float32
    timer = SelfTimer()
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
    calls = {n: timer.wrap(n, getattr(debugger, n)) for n in ("start", "stop", "step")}

    def step(kind: str) -> float:
        dumped = kind != "undumped"
        torch_stats._chunked_float32 = fused if kind == "current" else (lambda *a: None)  # type: ignore[assignment]
        m, opt = (model, optimizer) if dumped else (twin, twin_optimizer)
        batch = next(batches)
        before = dict(timer.total)
        t0 = time.process_time()
        if dumped:
            calls["start"](m)
        m.loss(batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dumped:
            calls["stop"]()
            calls["step"]()
        elapsed = time.process_time() - t0
        if kind != "current":  # the breakdown is of the current code's steps only
            timer.total.clear()
            timer.total.update(before)
        return elapsed

    orders = list(itertools.permutations(("undumped", "current", "baseline")))
    try:
        for kind in ("current", "baseline", "undumped") * 2:
            step(kind)
        timer.total.clear()
        times: dict[str, list[float]] = {"undumped": [], "current": [], "baseline": []}
        for i in range(triples):
            for kind in orders[i % len(orders)]:
                times[kind].append(step(kind))
    finally:
        shutil.rmtree(out, ignore_errors=True)
    plain = times["undumped"]
    return {
        "ratio": statistics.median(a / b for a, b in zip(times["current"], plain)),
        "baseline_ratio": statistics.median(a / b for a, b in zip(times["baseline"], plain)),
        "dumped_ms": 1000 * statistics.median(times["current"]),
        "baseline_ms": 1000 * statistics.median(times["baseline"]),
        "plain_ms": 1000 * statistics.median(plain),
        "breakdown_ms": {k: 1000 * v / triples for k, v in timer.total.items()},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--levels", default="L0,L1,mix")
    p.add_argument("--triples", type=int, default=30, help="triples of steps per level (default 30)")
    p.add_argument("--worker", metavar="LEVEL", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(args.worker, args.triples)))
        return 0
    for level in [v.strip() for v in args.levels.split(",") if v.strip()]:
        cmd = [sys.executable, __file__, "--worker", level, "--triples", str(args.triples)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        r = json.loads(done.stdout.strip().splitlines()[-1])
        b = r["breakdown_ms"]
        overhead = r["dumped_ms"] - r["plain_ms"]
        print(f"\n{level} (median of {args.triples} triples): dumped/undumped {r['ratio']:.3f}x, with the "
              f"baseline statistics {r['baseline_ratio']:.3f}x; steps: undumped {r['plain_ms']:.0f} ms, "
              f"dumped {r['dumped_ms']:.0f} ms, baseline {r['baseline_ms']:.0f} ms")  # fmt: skip
        print("| where | ms per step | % of the undumped step |\n|---|---|---|")
        for key, label in CATEGORIES:
            if key in b:
                print(f"| {label} | {b[key]:.1f} | {100 * b[key] / r['plain_ms']:.1f}% |")
        rest = overhead - sum(b.values())
        print(f"| not attributed | {rest:.1f} | {100 * rest / r['plain_ms']:.1f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
