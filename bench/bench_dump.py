"""Overhead of the precision dump (PrecisionDebugger) on a small GPT trained on the CPU.

What is trained: ``TinyGPT`` (4 layers, d_model 256, 4 heads, sequence 128, vocabulary 2000) on
synthetic tokens, batch 8, AdamW, torch's default thread count, fixed seeds.

Method (one process, one model, one optimizer for every configuration); ``bench_paired.py`` measures
the way users run instead, twin models with the tool left on; on the same code and load the two
methods agree, see docs/performance.md):

* A dumped step is what a user's loop does: ``start(model)``, forward, backward,
  ``optimizer.step()``, ``zero_grad``, ``stop()``, ``step()``; the whole of it is timed
  (``perf_counter``), JSON writing included. An undumped step is the same without the debugger.
* Blocks of ``--steps-per-block`` steps alternate, dumped and undumped, ``--blocks`` pairs; the
  order inside a pair alternates so that a drift of the machine favours neither side. A pair's
  ratio is its dumped block's mean step time over its undumped block's; the figure reported is
  the median over the pairs (with the range). ``control`` runs the same schedule with no dump on
  either side: its ratio is the noise floor of the method on this machine.
* ``--clock wall`` (default) times steps with ``perf_counter``; ``--clock cpu`` with
  ``process_time`` (CPU seconds of the whole process, writer thread included). On a machine
  shared with other jobs, wall-clock ratios swing by 2x from one block to the next; with
  ``--threads 1 --clock cpu`` a step's CPU time varies by about 3%, so that combination is the
  one to compare code changes with (it measures the work added, not the waiting).
* Tensor mode (``tensor-L0``, ``tensor-L1``, ``tensor-mix``): MB/s = tensor bytes of the ``.pt``
  files produced during the dumped blocks / the dumped blocks' wall time ("MB/s files");
  "MB/s serialised" counts only the bytes actually serialised (a tensor saved under several names
  in one step is written once and hard-linked). The disk's sequential write speed is measured the
  same way (no fsync on either side, the same folder): the same number of bytes written as 4 MiB
  chunks, timed. Step directories are deleted between blocks to bound disk use.

Usage::

    python bench/bench_dump.py            # full run
    python bench/bench_dump.py --quick    # smoke run
    python bench/bench_dump.py --configs control,statistics-L0 --blocks 6
    python bench/bench_dump.py --threads 1 --clock cpu   # stable on a shared machine
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench_monitor_v2 import output_folder
from trainprobe.demo.gpt import benchmark_setup
from trainprobe.dump import PrecisionDebugger

BATCH_SIZE = 8


@dataclass(frozen=True)
class BenchConfig:
    """One configuration: task, level and target."""

    key: str
    task: str | None  # None: the control
    level: str = "L1"
    target: float | None = None


CONFIGS = (
    BenchConfig("control", None),
    BenchConfig("statistics-L0", "statistics", "L0", 1.15),
    BenchConfig("statistics-L1", "statistics", "L1", 1.6),
    BenchConfig("statistics-mix", "statistics", "mix", 1.8),
    BenchConfig("tensor-L0", "tensor", "L0"),
    BenchConfig("tensor-L1", "tensor", "L1"),
    BenchConfig("tensor-mix", "tensor", "mix"),
)
BY_KEY = {c.key: c for c in CONFIGS}


class Trainer:
    """The model, its optimizer and a stream of batches."""

    def __init__(self, seed: int) -> None:
        run = benchmark_setup(seed, BATCH_SIZE)
        self.cfg, self.model, self.optimizer, self.batches = run.cfg, run.model, run.optimizer, run.batches

    clock = staticmethod(time.perf_counter)
    last_wall = 0.0
    last_loss = float("nan")

    def step(self, debugger: PrecisionDebugger | None) -> float:
        """One training step (with the debugger's calls around it); its seconds on :attr:`clock`
        (its wall seconds go to :attr:`last_wall`, its loss to :attr:`last_loss`)."""
        batch = next(self.batches)
        w0 = time.perf_counter()
        t0 = self.clock()
        if debugger is not None:
            debugger.start(self.model)
        loss = self.model.loss(batch)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if debugger is not None:
            debugger.stop()
            debugger.step()
        elapsed = self.clock() - t0
        self.last_wall = time.perf_counter() - w0
        self.last_loss = loss.item()
        return elapsed


@dataclass
class Result:
    """What was measured for one configuration."""

    config: BenchConfig
    ratios: list[float] = field(default_factory=list)
    dumped_ms: list[float] = field(default_factory=list)
    plain_ms: list[float] = field(default_factory=list)
    bytes_written: int = 0
    bytes_serialised: int = 0
    dumped_wall: float = 0.0


def run_block(
    trainer: Trainer, steps: int, debugger: PrecisionDebugger | None, dump_dir: Path | None
) -> tuple[list[float], float]:
    """``steps`` steps: their times on the trainer's clock, and their wall seconds in all."""
    gc.collect()
    times, wall = [], 0.0
    for _ in range(steps):
        times.append(trainer.step(debugger))
        wall += trainer.last_wall
    if dump_dir is not None and dump_dir.exists():
        shutil.rmtree(dump_dir, ignore_errors=True)  # bound the disk use of tensor mode
    return times, wall


def measure(cfg: BenchConfig, trainer: Trainer, out: Path, args: argparse.Namespace) -> Result:
    dump_dir = out / cfg.key
    debugger = None
    if cfg.task is not None:
        debugger = PrecisionDebugger(task=cfg.task, level=cfg.level, dump_path=str(dump_dir))
    res = Result(cfg)
    run_block(trainer, 1, debugger, dump_dir)  # warm-up
    run_block(trainer, 1, None, None)
    for i in range(args.blocks):
        first_dumped = i % 2 == 0
        sides: dict[bool, list[float]] = {}
        for dumped in (first_dumped, not first_dumped):
            files = debugger.files if debugger is not None else None
            before = _bytes(files)
            sides[dumped], wall = run_block(trainer, args.steps_per_block, debugger if dumped else None, dump_dir)
            if dumped and files is not None:
                after = _bytes(files)
                res.bytes_written += after[0] - before[0]
                res.bytes_serialised += after[1] - before[1]
                res.dumped_wall += wall
        a, b = statistics.fmean(sides[True]), statistics.fmean(sides[False])
        res.ratios.append(a / b)
        res.dumped_ms.append(1000 * a)
        res.plain_ms.append(1000 * b)
    return res


def _bytes(files: object) -> tuple[int, int]:
    """(bytes of files produced, bytes serialised) so far by a debugger's writer."""
    if files is None:
        return 0, 0
    produced = int(getattr(files, "bytes_written", 0))
    return produced, int(getattr(files, "bytes_serialised", produced))


def disk_write_mb_s(folder: Path, nbytes: int) -> float:
    """Sequential write speed of ``folder`` (no fsync, 4 MiB chunks, ``nbytes`` in all)."""
    nbytes = max(nbytes, 64 << 20)
    chunk = os.urandom(4 << 20)
    path = folder / "disk_speed.bin"
    t0 = time.perf_counter()
    written = 0
    with path.open("wb") as fh:
        while written < nbytes:
            fh.write(chunk)
            written += len(chunk)
    seconds = time.perf_counter() - t0
    path.unlink()
    return written / seconds / 1e6


def print_report(results: list[Result], disk: float | None, args: argparse.Namespace) -> None:
    print(f"\nclock: {args.clock}, {args.blocks} block pairs of {args.steps_per_block} steps")
    print(
        "\n| config | median dumped/undumped | range | target | pass | dumped step | undumped step "
        "| MB/s files | MB/s serialised |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        med = statistics.median(r.ratios)
        target = f"≤ {r.config.target:.2f}x" if r.config.target else "—"
        ok = "—" if r.config.target is None else ("yes" if med <= r.config.target else "**NO**")
        mbs = f"{r.bytes_written / r.dumped_wall / 1e6:.0f}" if r.bytes_written else "—"
        ser = f"{r.bytes_serialised / r.dumped_wall / 1e6:.0f}" if r.bytes_written else "—"
        print(
            f"| {r.config.key} | {med:.3f}x | {min(r.ratios):.3f}–{max(r.ratios):.3f} | {target} | {ok} "
            f"| {statistics.median(r.dumped_ms):.0f} ms | {statistics.median(r.plain_ms):.0f} ms | {mbs} | {ser} |"
        )
    if disk is not None:
        print(f"\nDisk sequential write (same folder, no fsync, 4 MiB chunks): {disk:.0f} MB/s")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps-per-block", type=int, default=None)
    p.add_argument("--blocks", type=int, default=None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--configs", default=",".join(c.key for c in CONFIGS))
    p.add_argument("--out", type=Path, default=None, help="where dumps go (default: a temp dir, removed)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="what a step's time is (see above)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        Trainer.clock = staticmethod(time.process_time)
    args.steps_per_block = args.steps_per_block or (2 if args.quick else 4)
    args.blocks = args.blocks or (2 if args.quick else 6)
    keys = [k.strip() for k in args.configs.split(",") if k.strip()]
    unknown = [k for k in keys if k not in BY_KEY]
    if unknown:
        p.error(f"unknown config(s) {unknown}; choose from {', '.join(BY_KEY)}")
    with output_folder(args.out, "trainprobe-bench-dump-") as out:
        trainer = Trainer(seed=0)
        for _ in range(3):
            trainer.step(None)
        results = []
        for key in keys:
            res = measure(BY_KEY[key], trainer, out, args)
            results.append(res)
            print(f"{key}: median {statistics.median(res.ratios):.3f}x", file=sys.stderr, flush=True)
        total = max((r.bytes_written for r in results), default=0)
        disk = disk_write_mb_s(out, total) if any(r.bytes_written for r in results) else None
        print_report(results, disk, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
