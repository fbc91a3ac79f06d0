"""Real monitor output for the tools' tests: two gloo ranks train a small model under Monitor V1
and, separately, under Monitor V2; the result is made once per test session.

Layout of :func:`make_monitor_runs`'s ``base``::

    base/v1/<MonDD_HH-MM-SS>-rank<r>-<id>/*.csv   (xy, wg, mv, param, cc; 2 micro-batches)
    base/v1/anomaly_detected/rank1/anomaly.json   (a NaN injected on rank 1 at step NAN_STEP)
    base/v2/rank_<r>/*_step<a>-<b>.csv             (module, weight_grad, optimizer, param, cc)

The NaN is put into rank 1's fc2.bias gradient after the all-reduce at ``NAN_STEP``, so from
that step on the parameters of rank 1 are NaN: the tools must find it first at that step.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from models import MLP
from test_distributed_v2 import launch
from trainprobe import TrainerMonitorV2
from trainprobe.frontdoors.monitor_v1 import TrainerMon

STEPS = 6
NAN_STEP = 4
NAN_RANK = 1
OPS = ["min", "max", "mean", "norm", "nans"]


@dataclass(frozen=True)
class MonitorRuns:
    """Where the output of the two runs lies."""

    v1: Path
    v2: Path


def _train(model: MLP, opt: torch.optim.Optimizer, rank: int, step: int, micro_batches: int = 1) -> None:
    torch.manual_seed(100 * rank + step)
    for _ in range(micro_batches):
        model(torch.randn(4, 6)).pow(2).mean().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    if step == NAN_STEP and rank == NAN_RANK:
        model.fc2.bias.grad[0] = math.nan


def _v1(rank: int, out: Path) -> None:
    os.environ["MONITOR_OUTPUT_DIR"] = str(out)
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "targets": {},
        "all_xy": True,
        "xy_distribution": True,
        "wg_distribution": True,
        "mv_distribution": True,
        "param_distribution": True,
        "cc_distribution": {"enable": True},
        "ops": OPS,
        "step_count_per_record": 2,
        "alert": {"rules": [{"rule_name": "AnomalyNan"}], "dump": True},
    }
    path = out / f"config{rank}.json"
    path.write_text(json.dumps(config))
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    mon = TrainerMon(str(path), process_group=dist.group.WORLD, params_have_main_grad=False)
    mon.set_monitor(model, grad_acc_steps=2, optimizer=opt)
    for step in range(STEPS):
        _train(model, opt, rank, step, micro_batches=2)
        opt.step()
        opt.zero_grad()
    mon.stop()


def _v2(rank: int, out: Path) -> None:
    config = {
        "output_dir": str(out),
        "step_count_per_record": 3,
        "monitors": {
            "module": {"enabled": True, "ops": OPS},
            "weight_grad": {"enabled": True, "ops": OPS},
            "optimizer": {"enabled": True, "ops": OPS},
            "param": {"enabled": True, "ops": OPS},
            "cc": {"enabled": True, "ops": OPS},
        },
    }
    path = out.parent / f"v2_config{rank}.json"
    path.write_text(json.dumps(config))
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    mon = TrainerMonitorV2(str(path))
    mon.start(model=model, optimizer=opt)
    for step in range(STEPS):
        _train(model, opt, rank, step)
        opt.step()
        opt.zero_grad()
    mon.stop()


def _worker(rank: int, base: str) -> None:
    _v1(rank, Path(base) / "v1")
    _v2(rank, Path(base) / "v2")


def make_monitor_runs(base: Path) -> MonitorRuns:
    """Train the two runs on two gloo processes and return where their output is.

    This only makes data for the tools' tests (the distributed monitors have their own tests),
    so a worker that dies at process exit on an overloaded machine (seen once: "terminate called
    without an active exception" from a C++ thread) is retried once in a fresh folder."""
    try:
        return _run_in(base / "attempt0")
    except mp.ProcessExitedException as exc:
        print(f"monitor_runs: a worker died ({exc}); retrying once")
        return _run_in(base / "attempt1")


def _run_in(folder: Path) -> MonitorRuns:
    folder.mkdir(parents=True, exist_ok=True)
    launch(_worker, str(folder))
    return MonitorRuns(v1=folder / "v1", v2=folder / "v2")
