"""Module (activation) rows in ``tensor_layout.json`` (issue #32 item 4), two gloo ranks: under DDP
a module's rows are the rank's own batch piece (``rank_local``, forward and gradient rows); a
DTensor activation (``ColwiseParallel(use_local_output=False)``) is described by its placements at
first sight. Read once, by one-shot hooks that remove themselves at the module's first call:
from the second step on the model carries exactly the hooks of the monitor without layouts, and
``stop()`` leaves none."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from conftest import write_config
from test_distributed_v2 import launch
from test_sharded_full_tensors import Net
from trainprobe import TrainerMonitorV2

WORLD, STEPS, BATCH = 2, 3, 5

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def _train(rank: int, root: Path, layout: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model: torch.nn.Module = Net(6)
    if layout == "tp":
        plan = {"fc1": ColwiseParallel(use_local_output=False), "fc2": RowwiseParallel()}
        parallelize_module(model, init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",)), plan)
    else:
        model = DistributedDataParallel(model)
    before = _hooks(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"output_dir": str(root / layout), "monitors": {"module": {"enabled": True, "ops": ["norm"]}}}
    mon = TrainerMonitorV2(write_config(root, cfg, name=f"{layout}_rank{rank}.json"))
    mon.start(model=model, optimizer=opt)
    counts = []
    for step in range(STEPS):
        x = torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(step + (rank if layout == "ddp" else 0)))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        counts.append(_hooks(model))
    mon.stop()
    (root / f"{layout}_hooks_rank{rank}.json").write_text(json.dumps({"before": before, "steps": counts,
                                                                      "after": _hooks(model)}))


def _entry(rank: int, root: Path) -> None:
    for layout in ("ddp", "tp"):
        _train(rank, root, layout)
        dist.barrier()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("module_layout")
    launch(_entry, root, timeout=300, world=WORLD)
    return root


def _modules(root: Path, rank: int) -> dict[tuple[str, str], dict[str, Any]]:
    doc = json.loads((root / f"rank_{rank}" / "tensor_layout.json").read_text())
    return {(e["name"], e["scope"]): e for e in doc["tensors"] if e["monitor"] == "module"}


def test_ddp_module_rows_are_each_ranks_own_batch_piece(runs: Path) -> None:
    for rank in range(WORLD):
        rows = _modules(runs / "ddp", rank)
        fc1 = rows[("module.fc1.output.0", "forward")]
        assert (fc1["kind"], fc1["numel"], fc1["local_shape"]) == ("rank_local", BATCH * 6, [BATCH, 6])
        assert rows[("module.fc1.grad_output.0", "backward")]["kind"] == "rank_local"
        assert rows[("module.fc2.input.0", "forward")]["local_shape"] == [BATCH, 6]
        written = {r.split(",")[2] for r in (runs / "ddp" / f"rank_{rank}" / "module_step0-0.csv").read_text().splitlines()[1:]}
        assert written <= {name for name, _ in rows}, written - {name for name, _ in rows}  # every row described


def test_dtensor_activation_is_described_by_its_placements(runs: Path) -> None:
    for rank in range(WORLD):
        rows = _modules(runs / "tp", rank)
        out = rows[("fc1.output.0", "forward")]
        assert out["kind"] == "shard" and out["global_shape"] == [BATCH, 6] and out["local_shape"] == [BATCH, 3]
        assert out["offsets"] == [0, 3 * rank] and out["mesh"]["dim_names"] == ["tp"]
        assert ("fc1.grad_output.0", "backward") not in rows  # a DTensor's gradient placements: not known ahead
        plain = rows[("fc2.output.0", "forward")]  # RowwiseParallel's local output: the rank's tensor
        assert plain["kind"] == "rank_local"


@pytest.mark.parametrize("layout", ["ddp", "tp"])
def test_one_shot_hooks_are_gone_after_the_first_step_and_after_stop(runs: Path, layout: str) -> None:
    for rank in range(WORLD):
        hooks = json.loads((runs / f"{layout}_hooks_rank{rank}.json").read_text())
        assert hooks["steps"][0] == hooks["steps"][-1], hooks  # none left after the first forward
        assert hooks["after"] == hooks["before"], hooks
