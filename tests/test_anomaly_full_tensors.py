"""Online rules on full tensors (issue #36 with #32's live statistics): on real TP=2 gloo ranks
with ``"global_stats": true``, a NaN in one rank's shard of a gradient is an event on every rank,
at the step it happened in, naming the full tensor and the rank whose shard holds it, worded as
``trainprobe diagnose``'s first line of the same run. Without ``global_stats`` the clean rank's
rules see only its own clean shard and find nothing at that step."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("duckdb")

from conftest import write_config  # noqa: E402
from test_distributed_v2 import launch  # noqa: E402
from test_sharded_full_tensors import Net  # noqa: E402
from trainprobe import TrainerMonitorV2  # noqa: E402
from trainprobe.engine.anomaly.events import AnomalyEvent  # noqa: E402

OPS = ["min", "max", "mean", "norm", "nans"]
STEPS = 4
NAN_STEP = 2  # rank 1's shard of fc1.weight's gradient gets a NaN

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)


def _train(rank: int, root: Path, name: str, live: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = Net(6)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {
        "output_dir": str(root / name),
        "global_stats": live,
        "monitors": {"weight_grad": {"enabled": True, "ops": OPS}},
        "anomaly": {"rules": ["nonfinite"], "actions": ["log"]},
    }
    seen: list[AnomalyEvent] = []
    mon = TrainerMonitorV2(write_config(root, cfg, name=f"{name}_rank{rank}.json"), on_anomaly=seen.append)
    mon.start(model=model, optimizer=opt)
    for step in range(STEPS):
        model(torch.randn(5, 8, generator=torch.Generator().manual_seed(step))).square().mean().backward()
        if step == NAN_STEP and rank == 1:
            model.fc1.weight.grad.to_local()[0, 0] = math.nan
        opt.step()
        opt.zero_grad()
    mon.stop()
    events: list[dict[str, Any]] = [
        {"step": e.step, "rank": e.rank, "name": e.name, "scope": e.scope, "line": e.line(), "json": e.to_json()}
        for e in seen
    ]
    (root / f"{name}_events{rank}.json").write_text(json.dumps(events))


def _entry(rank: int, root: Path) -> None:
    _train(rank, root, "full", True)
    dist.barrier()
    _train(rank, root, "local", False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("anomaly_full")
    launch(_entry, root, timeout=300, world=2)
    return root


def _events(root: Path, name: str, rank: int) -> list[dict[str, Any]]:
    return list(json.loads((root / f"{name}_events{rank}.json").read_text()))


def test_a_nan_in_one_shard_is_an_event_on_every_rank_naming_the_full_tensor(runs: Path) -> None:
    for rank in range(2):
        first = _events(runs, "full", rank)[0]
        assert (first["step"], first["name"], first["scope"]) == (NAN_STEP, "fc1.weight", "reduced"), rank
        assert first["rank"] == 1  # the rank whose shard holds the NaN, on both ranks
        assert first["line"] == (
            f"step {NAN_STEP}, full tensor, weight_grad/reduced fc1.weight: min = nan (NaN/inf), "
            "held by ranks 0,1 (shards), NaN/inf in rank 1's shard"
        ), rank
        assert first["json"]["ranks"] == [0, 1] and first["json"]["bad_ranks"] == [1]


def test_the_first_online_event_is_diagnoses_first_line(runs: Path) -> None:
    from trainprobe.tools.diagnosis.answer import diagnose

    answer = diagnose(runs / "full")
    assert answer.first is not None
    for rank in range(2):
        assert answer.line() == "first anomaly: " + _events(runs, "full", rank)[0]["line"], rank


def test_without_live_statistics_the_clean_rank_sees_nothing_at_that_step(runs: Path) -> None:
    clean = _events(runs, "local", 0)
    assert not any(e["step"] == NAN_STEP for e in clean)
    holder = _events(runs, "local", 1)[0]
    assert (holder["step"], holder["line"]) == (
        NAN_STEP, f"step {NAN_STEP}, rank 1, weight_grad/reduced fc1.weight: min = nan (NaN/inf)"
    )
