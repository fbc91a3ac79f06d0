"""Real runs for ``trainprobe diagnose``'s tests: two gloo ranks train a tiny GPT for
:data:`STEPS` steps, three times: under Monitor V2 with faults, under Monitor V1 (alerts on) with
the same faults, and under Monitor V2 without faults (a normal loss curve).

The faults, on rank :data:`BAD_RANK` only, after the gradient all-reduce (so the other rank
does not see them at once):

* step :data:`SPIKE_STEP`: :data:`SPIKE_PARAM`'s gradient multiplied by 50;
* step :data:`NAN_STEP`: one element of :data:`NAN_PARAM`'s gradient set to NaN.

Layout of :func:`make_diagnose_runs`'s ``base``: ``v2/rank_<r>/...``, ``v1/<...>-rank<r>-<id>/...``
(with ``v1/anomaly_detected/rank<r>/anomaly.json``), ``clean/rank_<r>/...``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from test_distributed_v2 import launch
from trainprobe import TrainerMonitorV2
from trainprobe.demo.gpt import GPTConfig, TinyGPT, synthetic_batches
from trainprobe.frontdoors.monitor_v1 import TrainerMon

STEPS = 36
SPIKE_STEP = 20
NAN_STEP = 30
BAD_RANK = 1
SPIKE_PARAM = "layers.1.mlp.fc1.weight"
NAN_PARAM = "layers.0.mlp.fc2.weight"
OPS = ["min", "max", "mean", "norm", "nans"]
CFG = GPTConfig(vocab_size=200, seq_len=32, d_model=64, n_heads=4, n_layers=2)


@dataclass(frozen=True)
class DiagnoseRuns:
    """Where the three runs' output lies."""

    v2: Path
    v1: Path
    clean: Path


def _train(rank: int, start: object, faults: bool) -> None:
    """Train the tiny GPT for :data:`STEPS` steps; ``start(model, optimizer)`` starts the monitor."""
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = synthetic_batches(CFG, batch_size=4, seed=rank)
    params = dict(model.named_parameters())
    stop = start(model, opt)  # type: ignore[operator]
    for step in range(STEPS):
        model.loss(next(batches)).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        if faults and rank == BAD_RANK and step == SPIKE_STEP:
            params[SPIKE_PARAM].grad *= 50
        if faults and rank == BAD_RANK and step == NAN_STEP:
            params[NAN_PARAM].grad[0, 0] = math.nan
        opt.step()
        opt.zero_grad()
    stop()


def _v2(rank: int, out: Path, faults: bool) -> None:
    config = {
        "output_dir": str(out),
        "step_count_per_record": 10,
        "monitors": {
            "module": {"enabled": True, "ops": OPS},
            "weight_grad": {"enabled": True, "ops": OPS},
            "optimizer": {"enabled": True, "ops": OPS},
            "param": {"enabled": True, "ops": OPS},
        },
    }
    path = out.parent / f"{out.name}_config{rank}.json"
    path.write_text(json.dumps(config))

    def start(model: TinyGPT, opt: torch.optim.Optimizer) -> object:
        mon = TrainerMonitorV2(str(path))
        mon.start(model=model, optimizer=opt)
        return mon.stop

    _train(rank, start, faults)


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
        "ops": OPS,
        "step_count_per_record": 10,
        "alert": {"rules": [{"rule_name": "AnomalyNan"}], "dump": True},
    }
    path = out.parent / f"v1_config{rank}.json"
    path.write_text(json.dumps(config))

    def start(model: TinyGPT, opt: torch.optim.Optimizer) -> object:
        mon = TrainerMon(str(path), process_group=dist.group.WORLD, params_have_main_grad=False)
        mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
        return mon.stop

    _train(rank, start, faults=True)


def _worker(rank: int, base: str) -> None:
    _v2(rank, Path(base) / "v2", faults=True)
    _v1(rank, Path(base) / "v1")
    _v2(rank, Path(base) / "clean", faults=False)


def make_diagnose_runs(base: Path) -> DiagnoseRuns:
    """Train the three runs on two gloo processes; return where their output is."""
    base.mkdir(parents=True, exist_ok=True)
    launch(_worker, str(base), timeout=600.0)
    return DiagnoseRuns(v2=base / "v2", v1=base / "v1", clean=base / "clean")
