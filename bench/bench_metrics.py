"""Overhead of the training-metrics monitor on a small GPT trained on the CPU.

What is trained: ``TinyGPT`` with its default size (4 layers, d_model 256, 4 heads, sequence
128, vocabulary 2000, about 4.2M parameters) on synthetic tokens, batch 8, AdamW, on the CPU
with torch's default thread count.

What is monitored: every metric, every step (``step_interval: 1``): the loss family with
timers, loss scale and expert load to TensorBoard and the log (the ``trainprobe.frontdoors.metrics``
logger at INFO, into a file), and ``local_norm`` (all parameters), ``device_local_norm``,
``local_loss``, ``device_accum_local_loss``, ``adam_m_norm``/``adam_v_norm`` (all
parameters), ``weight_norm`` and ``throughput_linearity``, each to TensorBoard and the log,
plus the dump file.

Method (one process, one model): after a warm-up, blocks of ``--steps-per-block`` steps run
alternately with a monitor (created before the block, closed after it; creation and close are
not timed) and without, ``--blocks`` pairs, the order inside a pair alternating. A pair's ratio
is the mean step time of its monitored block over its unmonitored block; the figure reported is
the median over pairs; the same ratio on process CPU time (every thread, the writer included)
is printed too, steadier when other processes load the machine. ``control`` runs the same schedule with no monitor on either side: its
median is the noise floor of the method on this machine. Step time covers forward, backward,
``optimizer.step()``, ``zero_grad`` and ``mon.step()``.

Usage::

    python bench/bench_metrics.py            # full run
    python bench/bench_metrics.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import gc
import logging
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench_monitor_v2 import in_turn
from trainprobe.demo.gpt import benchmark_setup
from trainprobe.frontdoors.metrics import TrainingMetricsMonitor

BATCH_SIZE = 8
TARGET = 1.05
BOTH = ["log", "tensorboard"]


def metrics_config(out: Path) -> dict[str, Any]:
    """Every metric on, every step."""
    return {
        "monitor_config": {
            "monitor_on": True,
            "dump_path": str(out / "dump"),
            "step_interval": 1,
            "local_loss_format": BOTH,
            "device_local_loss_format": BOTH,
            "local_norm_format": BOTH,
            "device_local_norm_format": BOTH,
            "optimizer_state_format": BOTH,
            "weight_state_format": BOTH,
            "throughput_baseline": 10.0,
        },
        "tensorboard": {
            "tensorboard_dir": str(out / "tb"),
            "log_loss_scale_to_tensorboard": True,
            "log_timers_to_tensorboard": True,
            "log_expert_load_to_tensorboard": True,
        },
    }


class Trainer:
    """The model, its optimizer and a stream of batches."""

    def __init__(self, seed: int) -> None:
        run = benchmark_setup(seed, BATCH_SIZE)
        self.cfg, self.model, self.optimizer, self.batches = run.cfg, run.model, run.optimizer, run.batches
        self.expert_counts = torch.tensor([5.0, 3.0, 7.0, 1.0])
        self.in_thread: list[float] = []  # seconds the monitor took on the training thread, per step
        self.capture_s = 0.0  # gradient capture of the current step
        self.plain_blocks: list[float] = []  # mean wall seconds per step of unmonitored blocks

    def step(self, mon: TrainingMetricsMonitor | None) -> tuple[float, float]:
        """One training step; returns (wall seconds, process CPU seconds of all threads)."""
        batch = next(self.batches)
        c0 = time.process_time()
        t0 = time.perf_counter()
        loss = self.model.loss(batch)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if mon is not None:
            t1 = time.perf_counter()
            mon.step(loss=loss, loss_scale=1.0, expert_load={"layers.0.moe": self.expert_counts})
            self.in_thread.append(time.perf_counter() - t1 + self.capture_s)
            self.capture_s = 0.0
        return time.perf_counter() - t0, time.process_time() - c0


def timed_monitor(trainer: Trainer, config: dict[str, Any]) -> TrainingMetricsMonitor:
    """A monitor whose gradient capture (run by the optimizer pre-hook) is timed too."""
    mon = TrainingMetricsMonitor(config, trainer.model, trainer.optimizer)
    capture = mon.capture_gradients

    def timed_capture() -> None:
        t0 = time.perf_counter()
        capture()
        trainer.capture_s += time.perf_counter() - t0

    mon.capture_gradients = timed_capture  # type: ignore[method-assign]
    return mon


def run_block(trainer: Trainer, steps: int, config: dict[str, Any] | None) -> tuple[float, float]:
    """One untimed lead-in step, then ``steps`` timed steps; mean (wall, CPU) seconds per step."""
    gc.collect()
    mon = timed_monitor(trainer, config) if config is not None else None
    trainer.step(mon)
    times = [trainer.step(mon) for _ in range(steps)]
    if mon is not None:
        mon.close()
    else:
        trainer.plain_blocks.append(statistics.fmean(w for w, _ in times))
    return statistics.fmean(w for w, _ in times), statistics.fmean(c for _, c in times)


def measure(
    trainer: Trainer, config: dict[str, Any] | None, blocks: int, steps: int
) -> tuple[list[float], list[float]]:
    """Pair ratios (monitored / unmonitored) of wall and CPU time, order alternating in pairs."""
    ratios, cpu_ratios = [], []
    run_block(trainer, 1, config)  # warm-up pair, discarded
    run_block(trainer, 1, None)
    for i in range(blocks):
        a, b = in_turn(i, lambda: run_block(trainer, steps, config), lambda: run_block(trainer, steps, None))
        ratios.append(a[0] / b[0])
        cpu_ratios.append(a[1] / b[1])
    return ratios, cpu_ratios


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps-per-block", type=int, default=None, help="timed steps per block (default 5)")
    p.add_argument("--blocks", type=int, default=None, help="pairs of blocks per configuration (default 8)")
    p.add_argument("--warmup", type=int, default=5, help="warm-up steps")
    p.add_argument("--quick", action="store_true", help="small counts for a smoke run")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    steps = args.steps_per_block or (2 if args.quick else 5)
    blocks = args.blocks or (2 if args.quick else 8)
    out = Path(tempfile.mkdtemp(prefix="trainprobe-bench-metrics-"))
    log = logging.getLogger("trainprobe.frontdoors.metrics")
    handler = logging.FileHandler(out / "metrics.log")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        trainer = Trainer(args.seed)
        n_params = sum(q.numel() for q in trainer.model.parameters())
        print(
            f"TinyGPT {n_params / 1e6:.2f}M params, batch {BATCH_SIZE}, seq {trainer.cfg.seq_len}, AdamW; "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads; {blocks} pairs x {steps} steps",
            flush=True,
        )
        for _ in range(args.warmup):
            trainer.step(None)
        rows = []
        for label, config in (("control", None), ("all metrics, step_interval 1", metrics_config(out))):
            t0 = time.perf_counter()
            ratios, cpu_ratios = measure(trainer, config, blocks, steps)
            rows.append((label, ratios, cpu_ratios, time.perf_counter() - t0))
            print(f"  {label}: median {statistics.median(ratios):.3f}x", flush=True)
        lines = sum(1 for _ in (out / "metrics.log").open(encoding="utf-8"))
        cost = statistics.median(trainer.in_thread)
        plain = statistics.median(trainer.plain_blocks)
        print(
            f"\nUnmonitored step: median {1000 * plain:.0f} ms. Monitor work on the training thread (gradient "
            f"capture + mon.step): median {1000 * cost:.1f} ms per step over {len(trainer.in_thread)} steps "
            f"= {100 * cost / plain:.2f}% of a step; {lines} log lines written\n"
        )
        print("| config | median ratio | IQR | min–max | CPU-time ratio | target | pass | wall |")
        print("|---|---|---|---|---|---|---|---|")
        for label, ratios, cpu_ratios, wall in rows:
            med = statistics.median(ratios)
            q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else [med, med, med]
            target = "—" if label == "control" else f"≤ {TARGET:.2f}x"
            ok = "—" if label == "control" else ("yes" if med <= TARGET else "**NO**")
            print(
                f"| {label} | {med:.3f}x | {q[0]:.3f}–{q[2]:.3f} | {min(ratios):.3f}–{max(ratios):.3f} "
                f"| {statistics.median(cpu_ratios):.3f}x | {target} | {ok} | {wall:.0f} s |"
            )
    finally:
        log.removeHandler(handler)
        handler.close()
        shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
