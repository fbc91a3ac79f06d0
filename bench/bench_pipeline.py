"""Hooks, rows and step time over a long pipelined run under the module monitor (issue #32).

What is trained: a pipeline of ``torch.distributed.pipelining`` stages on two gloo ranks (CPU),
each stage ``Linear(--dim, --dim)`` + ``Tanh``; ``--schedule`` ``gpipe``, ``1f1b`` (one stage per
rank) or ``interleaved`` (Interleaved1F1B, stages r and r + 2 on rank r), ``--micro``
micro-batches per step, SGD. Monitor V2's ``module`` monitor records every module of every stage
(inputs, outputs, their gradients), the ``PipelineStage`` objects passed to ``start(model=...)``.

Method (per rank): two twin pipelines with the same weights and batches, one under the monitor,
one without, trained ``--steps`` steps side by side, one step of each in turn (the order alternates
every step; both ranks run the same order, so the schedules' sends and receives pair up). Only
the steps are timed (the schedule's forward and backward of every micro-batch, ``optimizer.step()``,
``zero_grad``), wall clock. Reported per rank:

* hooks per step: the gradient hooks the monitor registered in the step (read after its
  backward), at the first and last step (and the min/max over the run), and the tensors still
  holding one after ``stop()``;
* rows per step: the monitor's CSV files read back, first and last step (min/max over the run);
* the median step time of the first and last ``--window`` monitored steps and their ratio (flat:
  about 1.0 within noise), and the monitored/unmonitored ratio of the first and last window;
* whether the twins' parameters are bitwise equal at the end.

Usage::

    python bench/bench_pipeline.py                          # 1F1B, 1000 steps
    python bench/bench_pipeline.py --schedule interleaved --steps 300 --window 50
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import socket
import statistics
import tempfile
import time
import warnings
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

os.environ.setdefault("TRAINPROBE_FUSED_STATS", "off")  # the same kernels from the first step on

from trainprobe import TrainerMonitorV2  # noqa: E402 - after the environment is set
from trainprobe.engine.probes.module import ModuleProbe  # noqa: E402

WORLD = 2
OPS = ["min", "max", "mean", "norm"]


class Twin:
    """One pipeline on this rank: its chunks, stages, schedule, optimizer and step times."""

    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        indices = [rank, rank + WORLD] if args.schedule == "interleaved" else [rank]
        self.chunks: list[nn.Module] = []
        for index in indices:
            torch.manual_seed(100 + index)
            self.chunks.append(nn.Sequential(nn.Linear(args.dim, args.dim), nn.Tanh()))
        n = WORLD * len(indices)
        self.stages = [PipelineStage(c, i, n, torch.device("cpu")) for c, i in zip(self.chunks, indices)]
        kinds = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
        if args.schedule == "interleaved":
            self.runner: Any = ScheduleInterleaved1F1B(self.stages, args.micro, loss_fn=_loss)
        else:
            self.runner = kinds[args.schedule](self.stages[0], args.micro, loss_fn=_loss)
        self.opt = torch.optim.SGD([p for c in self.chunks for p in c.parameters()], lr=1e-3)
        self.rank = rank
        self.times: list[float] = []

    def step(self, x: torch.Tensor, y: torch.Tensor, probe: ModuleProbe | None, hooks: list[int]) -> None:
        t0 = time.perf_counter()
        if self.rank == 0:
            self.runner.step(x)
        else:
            self.runner.step(target=y)
        t1 = time.perf_counter()
        if probe is not None:
            hooks.append(len(probe._step_handles))  # the gradient hooks this step registered
        t2 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad()
        self.times.append((t1 - t0) + (time.perf_counter() - t2))


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).mean()


def rows_per_step(folder: Path) -> list[int]:
    """The module rows of each step, in step order."""
    per_step: Counter[int] = Counter()
    for path in folder.glob("module_step*.csv"):
        with path.open(newline="", encoding="utf-8") as fh:
            for row in csv.DictReader(fh):
                per_step[int(row["step"])] += 1
    return [per_step[s] for s in sorted(per_step)]


def worker(rank: int, port: int, args: argparse.Namespace, out: Path) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))
    try:
        _bench(rank, args, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _bench(rank: int, args: argparse.Namespace, out: Path) -> None:
    watched, plain = Twin(args, rank), Twin(args, rank)
    mon = TrainerMonitorV2({"output_dir": str(out / "run"), "monitors": {"module": {"ops": OPS}}})
    stages = watched.stages
    mon.start(model=stages if len(stages) > 1 else stages[0], optimizer=watched.opt, micro_batch_number=args.micro)
    (probe,) = [p for p in mon._session.probes if isinstance(p, ModuleProbe)]
    gen = torch.Generator().manual_seed(1)
    hooks: list[int] = []
    for step in range(args.steps):
        x, y = torch.randn(args.batch, args.dim, generator=gen), torch.randn(args.batch, args.dim, generator=gen)
        order = [(watched, probe), (plain, None)] if step % 2 == 0 else [(plain, None), (watched, probe)]
        for twin, p in order:
            twin.step(x, y, p, hooks)
    mon.stop()
    w = args.window
    first, last = statistics.median(watched.times[:w]), statistics.median(watched.times[-w:])
    ratios = [a / b for a, b in zip(watched.times, plain.times)]
    rows = rows_per_step(out / "run" / f"rank_{rank}")
    result = {
        "rank": rank,
        "hooks_first": hooks[0], "hooks_last": hooks[-1], "hooks_min": min(hooks), "hooks_max": max(hooks),
        "hooks_after_stop": probe.hooked_tensors(),
        "rows_first": rows[0], "rows_last": rows[-1], "rows_min": min(rows), "rows_max": max(rows), "steps": len(rows),
        "first_ms": first * 1e3, "last_ms": last * 1e3, "last_over_first": last / first,
        "ratio_first": statistics.median(ratios[:w]), "ratio_last": statistics.median(ratios[-w:]),
        "bitwise": all(torch.equal(a, b) for c, d in zip(watched.chunks, plain.chunks)
                       for a, b in zip(c.parameters(), d.parameters())),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved"], default="1f1b")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--window", type=int, default=100)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_pipeline_") as tmp:
        out = Path(tmp)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(worker, args=(port, args, out), nprocs=WORLD)
        print(f"{args.schedule}, {args.steps} steps, {args.micro} micro-batches, 2 gloo ranks")
        for rank in range(WORLD):
            r = json.loads((out / f"rank{rank}.json").read_text())
            print(
                f"rank {rank}: hooks/step first {r['hooks_first']} last {r['hooks_last']} "
                f"(min {r['hooks_min']}, max {r['hooks_max']}; after stop {r['hooks_after_stop']}); "
                f"rows/step first {r['rows_first']} last {r['rows_last']} (min {r['rows_min']}, max {r['rows_max']}, "
                f"{r['steps']} steps); step first {args.window} {r['first_ms']:.2f} ms, last {args.window} "
                f"{r['last_ms']:.2f} ms (x{r['last_over_first']:.2f}); monitored/unmonitored first "
                f"{r['ratio_first']:.2f} last {r['ratio_last']:.2f}; bitwise {r['bitwise']}"
            )


if __name__ == "__main__":
    main()
