"""Overhead of Monitor V2 on MindSpore (PyNative, CPU): the GPT benchmark ported to MindSpore.

What is trained: the MindSpore ``TinyGPT`` of ``trainprobe.demo.gpt_mindspore`` (the PyTorch
benchmark's model: 4 layers, d_model 256, 4 heads, sequence 128, vocabulary 2000, about 4.2M
parameters, same names) on synthetic tokens, batch 8, ``nn.AdamWeightDecay``, with the usual
PyNative loop: ``loss, grads = value_and_grad(...)(batch)`` then ``optimizer(grads)``. A step
is timed until PyNative's operator queue is drained (it runs operators asynchronously).

Method: the one of ``bench/bench_monitor_v2.py``, whose ``measure()`` this script calls: after a
warm-up, alternating monitored and unmonitored blocks of steps in one process with one model,
a pair's ratio is the mean step time of its monitored block over that of its unmonitored block,
and the figure reported is the median over the pairs with the interquartile range; ``control``
runs the same schedule with no monitor on either side (the noise floor). See that script's
docstring for the RSS readings and the noise notes.

Targets (issue 8): weight_grad ≤ 1.05x, weight_grad+optimizer+param ≤ 1.10x, module on every
cell ≤ 1.5x.

Usage::

    python bench/bench_mindspore.py                       # full run (MindSpore steps are slow on a CPU)
    python bench/bench_mindspore.py --quick               # smoke run
    python bench/bench_mindspore.py --configs control,weight_grad --blocks 10
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import mindspore as ms
from mindspore.common.api import _pynative_executor

from bench_monitor_v2 import (
    BenchConfig,
    _on,
    fill_counts,
    output_folder,
    run_selected,
)
from trainprobe.demo.gpt_mindspore import benchmark_setup

BATCH_SIZE = 8


CONFIGS: tuple[BenchConfig, ...] = (
    BenchConfig("control", "control", None),
    BenchConfig("weight_grad", "weight_grad", _on("weight_grad"), ratio_target=1.05),
    BenchConfig(
        "weight_grad+optimizer+param",
        "weight_grad+optimizer+param",
        _on("weight_grad", "optimizer", "param"),
        ratio_target=1.10,
    ),
    BenchConfig("module", "module(all cells)", _on("module"), ratio_target=1.5),
)
CONFIG_KEYS = {c.key: c for c in CONFIGS}


class MsTrainer:
    """The MindSpore model, its optimizer, its gradient function and a stream of batches."""

    def __init__(self, seed: int) -> None:
        run = benchmark_setup(seed, BATCH_SIZE)
        self.cfg, self.model, self.optimizer = run.cfg, run.model, run.optimizer
        self.grad_fn, self.batches = run.grad_fn, run.batches
        self.last_loss = float("nan")

    def step(self) -> float:
        """One training step, finished on the device; returns its wall-clock seconds."""
        batch = next(self.batches)
        t0 = time.perf_counter()
        loss, grads = self.grad_fn(batch)
        self.optimizer(grads)
        _pynative_executor.sync()  # mindspore.runtime.synchronize() refuses the CPU device
        elapsed = time.perf_counter() - t0
        self.last_loss = float(loss.asnumpy())
        return elapsed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps-per-block", type=int, default=None, help="timed steps per block (default 3)")
    p.add_argument("--blocks", type=int, default=None, help="blocks per side and configuration (default 6)")
    p.add_argument("--rss-steps", type=int, default=None, help="steps of the RSS-growth run (default 6)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps before everything (default 3)")
    p.add_argument("--quick", action="store_true", help="small counts for a smoke run")
    p.add_argument("--configs", default=",".join(CONFIG_KEYS), help=f"subset of: {', '.join(CONFIG_KEYS)}")
    p.add_argument("--out", type=Path, default=None, help="keep the CSV output here (default: a temp dir, removed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="also print a cProfile of each monitored config")
    args = p.parse_args(argv)
    fill_counts(p, args, {"steps_per_block": (1, 3), "blocks": (2, 6), "rss_steps": (2, 6), "warmup": (1, 3)})
    args.warmup_block_steps = 1
    wanted = [s.strip() for s in args.configs.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in CONFIG_KEYS]
    if unknown:
        p.error(f"unknown config(s) {unknown}; choose from {', '.join(CONFIG_KEYS)}")
    args.selected = [c for c in CONFIGS if c.key in wanted]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    with output_folder(args.out, "trainprobe-bench-ms-") as out:
        trainer = MsTrainer(args.seed)
        n_params = sum(p.size for p in trainer.model.trainable_params())
        print(
            f"MindSpore TinyGPT {n_params / 1e6:.2f}M params, batch {BATCH_SIZE}, seq {trainer.cfg.seq_len}, "
            f"AdamWeightDecay; mindspore {ms.__version__} PyNative on {ms.get_context('device_target')}, "
            f"{os.cpu_count()} CPUs; {args.blocks} blocks x {args.steps_per_block} steps per side; "
            f"RSS run {args.rss_steps} steps; output in {out}",
            flush=True,
        )
        run_selected(
            trainer,
            out,
            args,
            lambda res: (
                f"median ratio {res.median_ratio:.3f}x (IQR {res.iqr[0]:.3f}-{res.iqr[1]:.3f}), "
                f"RSS growth {res.rss_growth_pct:+.1f}% ({res.seconds:.0f} s)"
            ),
            profile_steps=max(args.steps_per_block, 2),
            framework="mindspore",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
