"""TrainingMetricsMonitor on two gloo ranks under DDP: one event folder per rank, the gathered
grad-norm is the global (all-reduced) one, batch size counts every rank's samples."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from test_distributed_v2 import launch
from test_metrics_helpers import TINY, read_events, scalars, tiny_gpt
from trainprobe.demo.gpt import synthetic_batches
from trainprobe.frontdoors.metrics import TrainingMetricsMonitor

BATCH, STEPS = 4, 3


def _worker(rank: int, base: str) -> None:
    out = Path(base)
    model, opt = tiny_gpt()
    ddp = DDP(model)
    config = {
        "monitor_config": {"monitor_on": True, "dump_path": str(out / "dump"), "local_norm_format": "tensorboard"},
        "tensorboard": {"tensorboard_dir": str(out / "tb")},
    }
    mon = TrainingMetricsMonitor(config, model=ddp, optimizer=opt)
    torch.manual_seed(10 + rank)  # each rank sees other data
    batches = synthetic_batches(TINY, BATCH)
    ref: dict[int, dict[str, float]] = {}
    for step in range(1, STEPS + 1):
        idx = next(batches)
        logits = ddp(idx[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), idx[:, 1:].reshape(-1))
        loss.backward()
        grads = [p.grad.double() for p in model.parameters()]
        ref[step] = {
            "grad": math.sqrt(sum(float(g.pow(2).sum()) for g in grads)),
            "head": float(model.head.weight.grad.double().norm()),
        }
        opt.step()
        opt.zero_grad(set_to_none=True)
        mon.step(loss=loss, batch_size=BATCH * dist.get_world_size())
    mon.close()
    (out / f"ref{rank}.json").write_text(json.dumps(ref))


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="gloo is not available")
def test_two_ranks_write_their_own_events_with_global_grad_norm(tmp_path: Path) -> None:
    launch(_worker, str(tmp_path))  # parameter names are the DDP wrapper's ("module." prefix)
    norms = {}
    for rank in (0, 1):
        ref = {int(k): v for k, v in json.loads((tmp_path / f"ref{rank}.json").read_text()).items()}
        s = scalars(read_events(tmp_path / "tb" / f"rank_{rank}"))
        assert set(s["grad-norm"]) == set(range(1, STEPS + 1))
        for step, r in ref.items():
            assert s["grad-norm"][step] == pytest.approx(r["grad"], rel=1e-5)
            assert s["batch-size"][step] == BATCH * 2
            assert s["local_norm/module.head.weight"][step] == pytest.approx(r["head"], rel=1e-5)
        norms[rank] = s["grad-norm"]
    # DDP averages the gradients: both ranks see the same global norm although their data differ
    for step in range(1, STEPS + 1):
        assert norms[0][step] == pytest.approx(norms[1][step], rel=1e-6)
