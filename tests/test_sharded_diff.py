"""``trainprobe diff`` across parallel layouts (issue #32, "two layouts compare"): the same
training at TP=1 and TP=2, and under DDP and FSDP2, compared in full tensors (the default on a
sharded run) find no divergence in the parameter tables (weight_grad, param, optimizer); a fault
injected into one run is found at its step and tensor; ``--rank-local`` compares the rows as
written (and so finds the layouts different)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("duckdb")

from conftest import write_config  # noqa: E402
from test_distributed_v2 import launch  # noqa: E402
from test_sharded_full_tensors import OPS, Net  # noqa: E402
from trainprobe import TrainerMonitorV2  # noqa: E402
from trainprobe.tools.rundiff.answer import diff  # noqa: E402

WORLD, STEPS, FAULT_STEP = 2, 4, 2
MONITORS = ("weight_grad", "param", "optimizer")


def _train(out: Path, model: torch.nn.Module, data_rank: int, fault: bool, tag: str) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    cfg = {"output_dir": str(out), "monitors": {m: {"enabled": True, "ops": OPS} for m in MONITORS}}
    mon = TrainerMonitorV2(write_config(out.parent, cfg, name=f"{out.name}_{tag}.json"))
    mon.start(model=model, optimizer=opt)
    for step in range(STEPS):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(100 * step + data_rank))
        model(x).square().mean().backward()
        if fault and step == FAULT_STEP:
            with torch.no_grad():
                model.fc1.weight.grad.mul_(10.0)  # after backward: the reduced gradient is the first to differ
        opt.step()
        opt.zero_grad()
    mon.stop()


def _entry(rank: int, base: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel

    for name, fault in (("tp2", False), ("tp2_fault", True)):
        torch.manual_seed(0)
        model = Net(6)
        parallelize_module(model, init_device_mesh("cpu", (WORLD,)), {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        _train(base / name, model, 0, fault, f"rank{rank}")  # one batch for both ranks, as at TP=1
    torch.manual_seed(0)
    _train(base / "ddp", DistributedDataParallel(Net(7)), rank, False, f"rank{rank}")
    torch.manual_seed(0)
    model = Net(7)
    mesh = init_device_mesh("cpu", (WORLD,))
    fully_shard(model.fc1, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _train(base / "fsdp2", model, rank, False, f"rank{rank}")


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("layouts")
    launch(_entry, root, timeout=300, world=WORLD)
    torch.manual_seed(0)
    _train(root / "tp1", Net(6), 0, False, "single")  # this process: no process group, TP=1
    return root


def _summary(result: Any) -> str:
    return f"{result.answer()} {result.counts}"


def test_tp1_and_tp2_of_the_same_training_do_not_diverge(layouts: Path) -> None:
    result = diff(layouts / "tp1", layouts / "tp2")
    assert not result.diverged, _summary(result)
    assert result.counts["compared"] > 0
    assert result.counts["only_baseline"] == result.counts["only_candidate"] == 0, _summary(result)


def test_a_fault_in_the_tp2_run_is_found_at_its_step_and_tensor(layouts: Path) -> None:
    result = diff(layouts / "tp1", layouts / "tp2_fault")
    first = result.first
    assert first is not None, _summary(result)
    assert (first.step, first.table, first.scope, first.name) == (FAULT_STEP, "weight_grad", "reduced", "fc1.weight")


def test_ddp_and_fsdp2_of_the_same_training_do_not_diverge(layouts: Path) -> None:
    result = diff(layouts / "ddp", layouts / "fsdp2")
    assert not result.diverged, _summary(result)
    assert result.counts["only_baseline"] == result.counts["only_candidate"] == 0, _summary(result)


def test_rank_local_compares_the_rows_as_written(layouts: Path) -> None:
    result = diff(layouts / "tp1", layouts / "tp2", rank_local=True)
    assert result.diverged or result.counts["only_candidate"] > 0, _summary(result)
