"""``before_update`` on full tensors (issue #36 item 2): on two real gloo ranks under FSDP2 with
``"global_stats": true``, the pre-step check judges the reduced gradient's *full* tensor, gathered
in the optimizer's pre-step hook by the live statistics' one collective per step. A ×100 spike in
rank 1's shard of ``fc1.weight``'s gradient is an event on both ranks (rank 0's own shard is
clean), its value the gathered tensor's norm within 1e-6; both ranks stop at that step before the
update, their shards bitwise those after the step before; the probe issued one collective per
collected step."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from conftest import write_config
from test_distributed_v2 import launch
from test_sharded_full_tensors import Net
from trainprobe import AnomalyStop, TrainerMonitorV2
from trainprobe.engine.anomaly.events import AnomalyEvent

SPIKE_STEP = 12
OPS = ["min", "max", "mean", "norm", "nans"]

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)


def _train(rank: int, root: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Net(7)  # fc1.weight: 7 rows, shards of 4 and 3
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    cfg = {
        "output_dir": str(root / "run"),
        "global_stats": True,
        "monitors": {"weight_grad": {"enabled": True, "ops": OPS}},
        "anomaly": {"rules": ["spike"], "spike_rule": "median", "actions": ["stop"], "before_update": True},
    }
    seen: list[AnomalyEvent] = []
    mon = TrainerMonitorV2(write_config(root, cfg, name=f"rank{rank}.json"), on_anomaly=seen.append)
    mon.start(model=model, optimizer=opt)
    live = mon._live
    assert live is not None
    out: dict[str, Any] = {}
    shards: dict[str, torch.Tensor] = {}
    try:
        for step in range(SPIKE_STEP + 4):
            x = torch.randn(6, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            model(x).square().mean().backward()
            grad = model.fc1.weight.grad
            if step == SPIKE_STEP and rank == 1:
                grad.to_local().mul_(100)  # only rank 1's shard spikes
            out["full_norm"] = float(grad.full_tensor().double().norm())  # the gathered tensor, every rank
            shards = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
    except AnomalyStop as stop:
        out["stop_step"], out["stop_ranks"] = stop.step, list(stop.ranks)
        out["unchanged"] = all(torch.equal(p.to_local(), shards[n]) for n, p in model.named_parameters())
    finally:
        mon.stop()
    out["collectives"] = live.collectives
    out["events"] = [{"step": e.step, "name": e.name, "scope": e.scope, "value": e.value, "line": e.line()} for e in seen]
    (root / f"rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    root = tmp_path_factory.mktemp("before_update_full")
    launch(_train, root, timeout=300)
    return {rank: json.loads((root / f"rank{rank}.json").read_text()) for rank in (0, 1)}


def test_both_ranks_stop_before_the_update_at_the_spike(ranks: dict[int, dict[str, Any]]) -> None:
    for rank, seen in ranks.items():
        assert seen["stop_step"] == SPIKE_STEP, rank
        assert seen["stop_ranks"] == [0, 1], rank  # both saw it: the full tensor's event
        assert seen["unchanged"], rank  # the spiked update was not applied


def test_the_event_is_the_full_tensors_norm(ranks: dict[int, dict[str, Any]]) -> None:
    for rank, seen in ranks.items():
        first = seen["events"][0]
        assert (first["step"], first["name"], first["scope"]) == (SPIKE_STEP, "fc1.weight", "reduced"), rank
        assert math.isclose(first["value"], seen["full_norm"], rel_tol=1e-6), (rank, first["value"], seen["full_norm"])
        assert first["line"].startswith(f"step {SPIKE_STEP}, full tensor, weight_grad/reduced fc1.weight: norm = "), rank
        assert "held by ranks 0,1 (shards)" in first["line"], rank
    assert ranks[0]["events"][0]["line"] == ranks[1]["events"][0]["line"]


def test_one_collective_per_collected_step(ranks: dict[int, dict[str, Any]]) -> None:
    for rank, seen in ranks.items():
        assert seen["collectives"] == SPIKE_STEP + 1, rank  # steps 0..12, the last before its update
