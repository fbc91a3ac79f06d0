"""Per-tensor statistics time with and without the fused single pass (``trainprobe.backends.torch.fused_stats``).

What is timed: ``TensorStats(["min", "max", "mean", "norm", "nans"]).rows([x])`` for one float32
tensor of each ``--sizes`` (default 4k, 64k, 1M, 16M elements), with the fused pass forced on
(``mode="on"``) and off (the eager kernels: ``aminmax``, row sums, row norms). Each size is
timed over enough distinct tensors to fill 64 MB (at least 2), so that they come from memory
as in a training step, best of ``--repeats`` (default 5) rounds, in process CPU time with one
torch thread by default (steadier than wall time on a shared machine). Printed first: the time
the first use takes (compilation and exactness check), and what ``auto`` chooses per size
class on this machine. Then the same on the tensors of one training step of the benchmark GPT
(``trainprobe.demo.gpt``, 4.2M parameters: parameters, gradients, both Adam moments; one
``rows()`` call per set, as the monitors make them), with ``auto`` too.

``--device cuda`` runs the same on the GPU (wall time between synchronisations instead of CPU
time): the measurement that decides whether the pass, compiled to Triton there, should replace
the eager reductions on CUDA (off by default until measured; docs/performance.md, "GPU").

Usage::

    python bench/bench_fused_stats.py
    python bench/bench_fused_stats.py --device cuda --sizes 65536 1048576 16777216
    python bench/bench_fused_stats.py --threads 2 --sizes 65536 1048576
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch

from trainprobe.backends.torch.fused_stats import FusedStats
from trainprobe.backends.torch.stats import TensorStats, eager_reductions
from trainprobe.engine.stats.ops import DEFAULT_OPS

_POOL_BYTES = 64 << 20
_DEVICE = torch.device("cpu")


def _clock() -> float:
    """CPU seconds of the process on the CPU; on CUDA wall seconds after a synchronisation."""
    if _DEVICE.type == "cuda":
        torch.cuda.synchronize(_DEVICE)
        return time.perf_counter()
    return time.process_time()


def _time_rows(stats: TensorStats, xs: list[torch.Tensor], repeats: int) -> float:
    """Best CPU seconds per tensor of ``stats.rows([x])`` over ``xs``."""
    best = float("inf")
    for _ in range(repeats):
        started = _clock()
        for x in xs:
            stats.rows([x])
        best = min(best, (_clock() - started) / len(xs))
    return best


def _gpt_sets() -> list[list[torch.Tensor]]:
    """Parameters, gradients and Adam moments of the benchmark GPT after one step."""
    from trainprobe.demo.gpt import benchmark_setup

    setup = benchmark_setup(seed=0)
    setup.model.to(_DEVICE)
    setup.model.loss(next(setup.batches).to(_DEVICE)).backward()
    setup.optimizer.step()
    params = list(setup.model.parameters())
    state = [setup.optimizer.state[p] for p in params]
    return [params, [p.grad for p in params], [s["exp_avg"] for s in state], [s["exp_avg_sq"] for s in state]]


def _time_sets(stats: TensorStats, sets: list[list[torch.Tensor]], repeats: int) -> float:
    """Best CPU seconds of one ``rows()`` call per set."""
    best = float("inf")
    for _ in range(repeats):
        started = _clock()
        for tensors in sets:
            stats.rows(tensors)
        best = min(best, _clock() - started)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[1 << 12, 1 << 16, 1 << 20, 1 << 24])
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    args = p.parse_args(argv)
    global _DEVICE
    _DEVICE = torch.device(args.device)
    if _DEVICE.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False")
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), load average {os.getloadavg()[0]:.2f}", flush=True)

    fused = TensorStats(DEFAULT_OPS, fused=FusedStats(eager_reductions, mode="on"))
    eager = TensorStats(DEFAULT_OPS, fused=FusedStats(eager_reductions, mode="off"))
    started = time.perf_counter()
    fused.rows([torch.randn(1 << 16, device=_DEVICE)])
    print(f"first use (compile + exactness check): {time.perf_counter() - started:.1f} s wall", flush=True)

    logging.basicConfig(level=logging.WARNING, format="  %(message)s")
    logging.getLogger("trainprobe.backends.torch.fused_stats").setLevel(logging.DEBUG)
    auto = FusedStats(eager_reductions, mode="auto")
    print("auto's choices:", flush=True)
    for n in args.sizes:
        auto(torch.randn(n, device=_DEVICE))
    logging.getLogger("trainprobe.backends.torch.fused_stats").setLevel(logging.WARNING)

    print(f"{'elements':>10} {'eager µs':>10} {'fused µs':>10} {'speed-up':>9}")
    for n in args.sizes:
        xs = [torch.randn(n, device=_DEVICE) for _ in range(max(2, _POOL_BYTES // (4 * n)))]
        t_eager = t_fused = float("inf")
        for _ in range(2):  # interleaved, so that a burst of load hits both
            t_eager = min(t_eager, _time_rows(eager, xs, args.repeats))
            t_fused = min(t_fused, _time_rows(fused, xs, args.repeats))
        print(f"{n:>10} {t_eager * 1e6:>10.1f} {t_fused * 1e6:>10.1f} {t_eager / t_fused:>8.2f}x", flush=True)
    sets = _gpt_sets()
    auto_stats = TensorStats(DEFAULT_OPS, fused=auto)
    logging.getLogger("trainprobe.backends.torch.fused_stats").setLevel(logging.DEBUG)
    _time_sets(auto_stats, sets, 1)  # auto's choices for the GPT's size classes
    logging.getLogger("trainprobe.backends.torch.fused_stats").setLevel(logging.WARNING)
    times = {"eager": float("inf"), "fused": float("inf"), "auto": float("inf")}
    for _ in range(3):
        for name, stats in (("eager", eager), ("fused", fused), ("auto", auto_stats)):
            times[name] = min(times[name], _time_sets(stats, sets, args.repeats))
    n_values = sum(t.numel() for tensors in sets for t in tensors)
    print(
        f"GPT step ({sum(map(len, sets))} tensors, {n_values / 1e6:.1f}M values): eager {times['eager'] * 1e3:.2f} ms,"
        f" fused {times['fused'] * 1e3:.2f} ms, auto {times['auto'] * 1e3:.2f} ms"
    )
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
