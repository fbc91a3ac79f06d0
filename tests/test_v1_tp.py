"""Monitor V1 under tensor parallelism on two gloo ranks: with ``tp_group`` every rank writes the
reduced-gradient rows of its shards (ColwiseParallel / RowwiseParallel DTensors, and Megatron-style
parameters marked ``tensor_model_parallel``/``partition_dim``), replicas are written once (by the
group's first rank), and the ``shape`` column is the local shard's; each row equals the float64
statistics of its rank's piece of the gathered full gradient, and training is bitwise unchanged."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from test_distributed_v2 import launch
from test_v1_support import table

D_IN, HIDDEN, D_OUT, BATCH, STEPS = 6, 8, 4, 5, 2
CFG = {"wg_distribution": True, "param_distribution": True, "xy_distribution": True, "all_xy": True, "ndigits": 12}

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)


class Net(nn.Module):
    """fc1 (column-parallel) → fc2 (row-parallel) → norm (replicated everywhere)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D_IN, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, D_OUT)
        self.norm = nn.LayerNorm(D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc2(torch.relu(self.fc1(x))))


def _dtensor_model() -> tuple[nn.Module, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = Net()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    return model, mesh.get_group(0)


def _megatron_model(rank: int) -> nn.Module:
    """fc1's weight and bias are this rank's half along dim 0, marked as Megatron marks them
    (fc2 takes that half; its parameters, like norm's, are the same on both ranks)."""
    torch.manual_seed(0)
    model = Net()
    model.fc1 = nn.Linear(D_IN, HIDDEN // 2)
    model.fc2 = nn.Linear(HIDDEN // 2, D_OUT)
    for p in model.fc1.parameters():
        p.tensor_model_parallel = True  # type: ignore[attr-defined]
        p.partition_dim = 0  # type: ignore[attr-defined]
    return model


def _train(model: nn.Module, steps: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """``steps`` steps; per step, each parameter's local gradient before the optimizer's step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(seed)
    grads = []
    for _ in range(steps):
        _loss(model, gen).backward()
        grads.append({n: _local(p.grad).detach().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return grads


def _loss(model: nn.Module, gen: torch.Generator) -> torch.Tensor:
    """A squared error against a random target (the same batch and target on every rank)."""
    x, target = torch.randn(BATCH, D_IN, generator=gen), torch.randn(BATCH, D_OUT, generator=gen)
    return (model(x) - target).pow(2).sum()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _run(out: Path, model: nn.Module, tp_group: Any) -> list[dict[str, torch.Tensor]]:
    from trainprobe.frontdoors.monitor_v1 import TrainerMon

    os.environ["MONITOR_OUTPUT_DIR"] = str(out)
    path = out.parent / f"{out.name}_config_{dist.get_rank()}.json"
    path.write_text(json.dumps(CFG), encoding="utf-8")
    mon = TrainerMon(str(path))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt, tp_group=tp_group)
    gen = torch.Generator().manual_seed(1)
    grads = []
    for _ in range(STEPS):
        _loss(model, gen).backward()
        grads.append({n: _local(p.grad).detach().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    mon.stop()
    return grads


def _save(base: Path, name: str, rank: int, grads: list[dict[str, torch.Tensor]], model: nn.Module) -> None:
    """Each row's float64 reference (norm, max of the local gradient) and local shapes."""
    expected = {
        "norms": [{n: g.double().norm().item() for n, g in step.items()} for step in grads],
        "shapes": {n: list(_local(p).shape) for n, p in model.named_parameters()},
        "params": {n: _local(p).detach().tolist() for n, p in model.named_parameters()},
    }
    (base / f"{name}_expected_{rank}.json").write_text(json.dumps(expected), encoding="utf-8")


def _worker(rank: int, base_text: str) -> None:
    base = Path(base_text)
    model, group = _dtensor_model()
    grads = _run(base / "dtensor", model, group)
    _save(base, "dtensor", rank, grads, model)
    # the full gradient, gathered, sliced back: what each rank's rows must equal
    gathered, _ = _dtensor_model()
    full = _train(_as_full(gathered), STEPS)
    pieces = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1}
    sliced = [
        {n: (torch.chunk(g, 2, dim=pieces[n])[rank] if n in pieces else g) for n, g in step.items()} for step in full
    ]
    (base / f"full_{rank}.json").write_text(
        json.dumps([{n: g.double().norm().item() for n, g in s.items()} for s in sliced]), encoding="utf-8"
    )
    plain, _ = _dtensor_model()
    _train(plain, STEPS)  # unmonitored: the monitored run's parameters must be these, bitwise
    unchanged = all(torch.equal(_local(a), _local(b)) for a, b in zip(model.parameters(), plain.parameters()))
    (base / f"unchanged_{rank}.json").write_text(json.dumps(unchanged), encoding="utf-8")
    mega = _megatron_model(rank)
    _save(base, "megatron", rank, _run(base / "megatron", mega, dist.group.WORLD), mega)


def _as_full(model: nn.Module) -> nn.Module:
    """A plain copy of a parallelised model with its full (gathered) parameters."""
    torch.manual_seed(0)
    plain = Net()
    with torch.no_grad():
        for p, q in zip(plain.parameters(), model.parameters()):
            p.copy_(q.full_tensor() if hasattr(q, "full_tensor") else q)
    return plain


def _folder(out: Path, rank: int) -> Path:
    (found,) = [p for p in out.iterdir() if f"-rank{rank}-" in p.name]
    return found


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("v1_tp")
    launch(_worker, str(base), timeout=300)
    return base


SHARDS = {"fc1.weight", "fc1.bias", "fc2.weight"}
REPLICAS = {"fc2.bias", "norm.weight", "norm.bias"}


@pytest.mark.parametrize("rank", [0, 1])
def test_dtensor_shards_on_every_rank_replicas_once(runs: Path, rank: int) -> None:
    folder = _folder(runs / "dtensor", rank)
    expected = json.loads((runs / f"dtensor_expected_{rank}.json").read_text())
    full = json.loads((runs / f"full_{rank}.json").read_text())
    rows = table(folder, "grad_reduced")
    assert {r["name"] for r in rows} == (SHARDS | REPLICAS if rank == 0 else SHARDS)
    for r in rows:
        step, name = int(r["step"]), r["name"]
        assert float(r["norm"]) == pytest.approx(expected["norms"][step][name], rel=1e-9, abs=1e-12)
        assert float(r["norm"]) == pytest.approx(full[step][name], rel=1e-5)  # the gathered tensor's piece
        assert json.loads(r["shape"]) == expected["shapes"][name]
    assert json.loads(next(r for r in rows if r["name"] == "fc1.weight")["shape"]) == [HIDDEN // 2, D_IN]
    assert json.loads(next(r for r in rows if r["name"] == "fc2.weight")["shape"]) == [D_OUT, HIDDEN // 2]
    # every rank's parameter rows and unreduced rows: the local piece's shape
    for name in ("param_origin", "grad_unreduced"):
        for r in table(folder, name):
            assert json.loads(r["shape"]) == expected["shapes"][r["name"]], (name, r["name"])
    actv = {r["name"]: json.loads(r["shape"]) for r in table(folder, "actv")}
    assert actv["fc1.output"] == [BATCH, HIDDEN // 2]
    assert json.loads((runs / f"unchanged_{rank}.json").read_text()) is True


@pytest.mark.parametrize("rank", [0, 1])
def test_megatron_attributes_still_mark_shards(runs: Path, rank: int) -> None:
    folder = _folder(runs / "megatron", rank)
    expected = json.loads((runs / f"megatron_expected_{rank}.json").read_text())
    rows = table(folder, "grad_reduced")
    everything = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "norm.weight", "norm.bias"}
    assert {r["name"] for r in rows} == (everything if rank == 0 else {"fc1.weight", "fc1.bias"})
    for r in rows:
        assert float(r["norm"]) == pytest.approx(expected["norms"][int(r["step"])][r["name"]], rel=1e-9, abs=1e-12)
        assert json.loads(r["shape"]) == expected["shapes"][r["name"]]
    assert json.loads(next(r for r in rows if r["name"] == "fc1.weight")["shape"]) == [HIDDEN // 2, D_IN]
