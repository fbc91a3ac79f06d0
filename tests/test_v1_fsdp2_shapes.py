"""Monitor V1 under 1-D FSDP2 (``fully_shard``) on two gloo ranks: every row's ``shape`` is the shape
of the tensor it summarises and its statistics are that tensor's (float64 reference).

``grad_unreduced`` rows hold this rank's whole gradient of the unsharded parameter (before the
reduce-scatter): the full parameter's shape. ``grad_reduced``, ``param_origin``/``param_updated``
and the Adam moments are this rank's shard (``torch.chunk`` of dim 0: uneven here, 7 rows cut as
4 + 3). Activations are plain tensors. Training is bitwise unchanged by the monitor."""

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

D_IN, HIDDEN, D_OUT, BATCH, STEPS = 6, 7, 4, 5, 2
CFG = {
    "wg_distribution": True,
    "param_distribution": True,
    "mv_distribution": True,
    "xy_distribution": True,
    "all_xy": True,
    "ndigits": 12,
    "ops": ["min", "max", "norm", "mean"],
}
TABLES = ("grad_unreduced", "grad_reduced", "param_origin", "param_updated", "exp_avg", "exp_avg_sq", "actv")

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)


class Net(nn.Module):
    """fc1 → relu → fc2 → norm."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D_IN, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, D_OUT)
        self.norm = nn.LayerNorm(D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc2(torch.relu(self.fc1(x))))


def _sharded() -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Net()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    fully_shard(model.fc1, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch and target (each rank draws its own: data parallelism)."""
    return torch.randn(BATCH, D_IN, generator=gen), torch.randn(BATCH, D_OUT, generator=gen)


def _local(t: Any) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _stats(t: torch.Tensor) -> dict[str, Any]:
    """The float64 reference of a row: shape and statistics."""
    d = t.detach().double()
    return {"shape": list(t.shape), "norm": d.norm().item(), "min": d.min().item(), "max": d.max().item(),
            "mean": d.mean().item()}


def _unreduced(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
    """This rank's gradient of its own loss for the full (gathered) parameters, from a plain copy."""
    plain = Net()
    with torch.no_grad():
        for p, q in zip(plain.parameters(), model.parameters()):
            p.copy_(q.full_tensor())
    (plain(x) - target).pow(2).sum().backward()
    return {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}


def _train(model: nn.Module, rank: int, monitored: bool, base: Path) -> list[dict[str, dict[str, Any]]]:
    """``STEPS`` steps of Adam; per step, the float64 reference of every row the monitor writes."""
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    mon = None
    if monitored:
        from trainprobe.frontdoors.monitor_v1 import TrainerMon

        os.environ["MONITOR_OUTPUT_DIR"] = str(base / "out")
        path = base / f"config_{rank}.json"
        path.write_text(json.dumps(CFG), encoding="utf-8")
        mon = TrainerMon(str(path))
        mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    seen: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        module.register_forward_hook(
            lambda m, a, o, name=name: seen.update({f"{name}.input": a[0].detach().clone(),
                                                    f"{name}.output": o.detach().clone()})
        )
    gen = torch.Generator().manual_seed(1 + rank)
    expected = []
    for _ in range(STEPS):
        x, target = _batch(gen)
        unreduced = _unreduced(model, x, target)
        before = {n: _local(p).detach().clone() for n, p in model.named_parameters()}
        (model(x) - target).pow(2).sum().backward()
        reduced = {n: _local(p.grad).detach().clone() for n, p in model.named_parameters()}
        opt.step()
        rows = {
            "grad_unreduced": {n: _stats(g) for n, g in unreduced.items()},
            "grad_reduced": {n: _stats(g) for n, g in reduced.items()},
            "param_origin": {n: _stats(t) for n, t in before.items()},
            "param_updated": {n: _stats(_local(p)) for n, p in model.named_parameters()},
            "exp_avg": {n: _stats(_local(opt.state[p]["exp_avg"])) for n, p in model.named_parameters()},
            "exp_avg_sq": {n: _stats(_local(opt.state[p]["exp_avg_sq"])) for n, p in model.named_parameters()},
            "actv": {n: _stats(t) for n, t in seen.items()},
        }
        expected.append(rows)
        opt.zero_grad()
    if mon is not None:
        mon.stop()
    return expected


def _worker(rank: int, base_text: str) -> None:
    base = Path(base_text)
    model = _sharded()
    expected = _train(model, rank, True, base)
    (base / f"expected_{rank}.json").write_text(json.dumps(expected), encoding="utf-8")
    plain = _sharded()
    _train(plain, rank, False, base)  # unmonitored: the monitored run's parameters must be these, bitwise
    unchanged = all(torch.equal(_local(a), _local(b)) for a, b in zip(model.parameters(), plain.parameters()))
    (base / f"unchanged_{rank}.json").write_text(json.dumps(unchanged), encoding="utf-8")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("v1_fsdp2")
    launch(_worker, str(base), timeout=300)
    return base


def _folder(out: Path, rank: int) -> Path:
    (found,) = [p for p in out.iterdir() if f"-rank{rank}-" in p.name]
    return found


@pytest.mark.parametrize("rank", [0, 1])
def test_every_row_has_the_shape_and_statistics_of_its_tensor(runs: Path, rank: int) -> None:
    folder = _folder(runs / "out", rank)
    expected = json.loads((runs / f"expected_{rank}.json").read_text())
    for name in TABLES:
        rows = table(folder, name)
        assert {int(r["step"]) for r in rows} == set(range(STEPS)), name
        for r in rows:
            ref = expected[int(r["step"])][name][r["name"]]
            assert json.loads(r["shape"]) == ref["shape"], (name, r["name"])
            assert r["dtype"] == "torch.float32"
            for op in ("norm", "min", "max", "mean"):
                assert float(r[op]) == pytest.approx(ref[op], rel=1e-5, abs=1e-7), (name, r["name"], op)
    # the reduced-gradient rows are this rank's shard (7 rows cut as 4 + 3), the unreduced ones the whole
    shapes = {(r["name"]): json.loads(r["shape"]) for r in table(folder, "grad_reduced")}
    assert shapes["fc1.weight"] == [4 if rank == 0 else 3, D_IN]
    assert {r["name"]: json.loads(r["shape"]) for r in table(folder, "grad_unreduced")}["fc1.weight"] == [HIDDEN, D_IN]
    # activation gradients have their activations' shapes
    actv = {r["name"]: r["shape"] for r in table(folder, "actv")}
    grads = table(folder, "actv_grad")
    assert grads and all(r["shape"] == actv[r["name"]] for r in grads)
    assert json.loads((runs / f"unchanged_{rank}.json").read_text()) is True
