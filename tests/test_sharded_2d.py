"""2-D FSDP2 + tensor parallelism on a 2×2 gloo mesh (issue #32): ``unreduced`` rows exist for
the tensor-parallel parameters (before, none was written: the unsharded FSDP2 parameter is
itself a DTensor on the TP mesh and was skipped), and the merged ``reduced`` rows of
``weight_grad_full`` equal the gathered gradient."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("duckdb")

from conftest import rows_of, write_config  # noqa: E402
from test_distributed_v2 import launch  # noqa: E402
from test_sharded_full_tensors import OPS, Net, _reference  # noqa: E402
from trainprobe import TrainerMonitorV2  # noqa: E402

WORLD, STEPS = 4, 2


def _entry(rank: int, root: Path) -> None:
    _train(rank, root)


def _train(rank: int, root: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = Net(8)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"output_dir": str(root / "run"), "monitors": {"weight_grad": {"enabled": True, "ops": OPS}}}
    mon = TrainerMonitorV2(write_config(root, cfg, name=f"rank{rank}.json"))
    mon.start(model=model, optimizer=opt)
    full = {}
    for step in range(STEPS):
        dp = mesh["dp"].get_local_rank()
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + dp))
        model(x).square().mean().backward()
        full[str(step)] = {n: p.grad.full_tensor().double().tolist() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    mon.stop()
    if rank == 0:
        (root / "full_grads.json").write_text(json.dumps(full))


@pytest.fixture(scope="module")
def run_2d(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("two_d")
    launch(_entry, root, timeout=300, world=WORLD)
    return root


def test_tensor_parallel_parameters_get_unreduced_rows(run_2d: Path) -> None:
    for rank in range(WORLD):
        rows = [r for r in rows_of(run_2d / "run", "weight_grad", rank) if r["scope"] == "unreduced"]
        assert sorted({r["module_name"] for r in rows}) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
        assert len(rows) == STEPS * 4


def test_merged_reduced_rows_equal_the_gathered_gradient(run_2d: Path) -> None:
    from trainprobe.tools.query.layer import connect

    full = json.loads((run_2d / "full_grads.json").read_text())
    con = connect(run_2d / "run")
    rows = con.execute(
        "SELECT step, name, min, max, mean, norm, nans, numel, complete FROM weight_grad_full "
        "WHERE scope = 'reduced' ORDER BY step, name"
    ).fetchall()
    assert len(rows) == STEPS * 4
    for step, name, lo, hi, mean, norm, nans, numel, complete in rows:
        want = _reference(full[str(step)][name])
        assert norm == pytest.approx(want["norm"], rel=1e-6), name
        assert mean == pytest.approx(want["mean"], rel=1e-6, abs=1e-9), name
        assert lo == pytest.approx(want["min"], rel=1e-6) and hi == pytest.approx(want["max"], rel=1e-6)
        assert nans == 0 and numel == want["numel"] and complete, (name, numel, want["numel"])
