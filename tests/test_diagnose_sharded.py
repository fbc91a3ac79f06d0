"""``trainprobe diagnose`` on sharded runs (issue #32, "diagnose answers in full tensors"): tensor
parallelism (ColwiseParallel / RowwiseParallel) and FSDP2 on two real gloo ranks, Monitor V2 with
every monitor on. A NaN, or a 30x spike, is injected into rank 1's shard of ``fc1.weight``'s
gradient after backward. Diagnose names the step, the tensor, its full-tensor value (equal to
the gathered gradient's, float64 reference) and the ranks that held it (and whose shard held
the NaN); ``--rank-local`` answers with rank 1's own row; a healthy sharded run exits 0."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("duckdb")
pytest.importorskip("pyarrow")

from conftest import write_config  # noqa: E402
from test_distributed_v2 import launch  # noqa: E402
from test_sharded_full_tensors import OPS, Net  # noqa: E402
from trainprobe import TrainerMonitorV2  # noqa: E402
from trainprobe.tools.diagnosis.answer import diagnose  # noqa: E402

WORLD, STEPS, NAN_STEP, SPIKE_STEP, BAD_RANK = 2, 14, 6, 12, 1
LAYOUTS = ("tp", "fsdp2")
VARIANTS = ("healthy", "nan", "spike")
MONITORS = ("module", "weight_grad", "param", "optimizer")

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)


def make_model(layout: str) -> torch.nn.Module:
    """The test's Net, parallelised: TP=2 (Colwise fc1, Rowwise fc2) or FSDP2 over both ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = Net(6 if layout == "tp" else 7)
    mesh = init_device_mesh("cpu", (WORLD,))
    if layout == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    else:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.fc1, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _inject(model: torch.nn.Module, variant: str, step: int, rank: int) -> None:
    """The fault, into ``BAD_RANK``'s shard of fc1.weight's gradient (after backward); ``bias``:
    a NaN into ``BAD_RANK``'s copy of TP's replicated fc2.bias gradient."""
    local = model.fc1.weight.grad.to_local()
    with torch.no_grad():
        if variant == "bias" and step == NAN_STEP and rank == BAD_RANK:
            model.fc2.bias.grad.to_local()[0] = float("nan")
        if variant == "nan" and step == NAN_STEP and rank == BAD_RANK:
            local[0, 0] = float("nan")
        if variant == "spike" and step == SPIKE_STEP and rank == BAD_RANK:
            local.mul_(30.0)


def train(out: Path, layout: str, variant: str, rank: int, monitors: tuple[str, ...] = MONITORS) -> dict[str, Any]:
    """One monitored run; returns, for the fault step, float64 statistics of the gathered
    fc1.weight gradient (``full``) and of rank ``BAD_RANK``'s shard (``local``)."""
    model = make_model(layout)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    cfg = {"output_dir": str(out), "monitors": {m: {"enabled": True, "ops": OPS} for m in monitors}}
    mon = TrainerMonitorV2(write_config(out.parent, cfg, name=f"{out.name}_rank{rank}.json"))
    mon.start(model=model, optimizer=opt)
    truth: dict[str, Any] = {}
    for step in range(STEPS):
        data_rank = rank if layout == "fsdp2" else 0  # TP: one batch for both ranks
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(100 * step + data_rank))
        model(x).square().mean().backward()
        _inject(model, variant, step, rank)
        if step == {"nan": NAN_STEP, "spike": SPIKE_STEP}.get(variant, -1):
            full = model.fc1.weight.grad.full_tensor().double()  # a collective: every rank
            local = model.fc1.weight.grad.to_local().double()
            truth = {"full": _stats(full), "local": _stats(local)}
        opt.step()
        opt.zero_grad()
    mon.stop()
    return truth


def _stats(t: torch.Tensor) -> dict[str, float]:
    return {"norm": t.norm().item(), "max": t.max().item(), "nans": float(t.isnan().sum().item())}


def _entry(rank: int, root: Path) -> None:
    for layout in LAYOUTS:
        for variant in VARIANTS + (("bias",) if layout == "tp" else ()):
            truth = train(root / f"{layout}_{variant}", layout, variant, rank)
            if rank == BAD_RANK and truth:
                (root / f"{layout}_{variant}_truth.json").write_text(json.dumps(truth))
            dist.barrier()


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("diagnose_sharded")
    launch(_entry, root, timeout=600, world=WORLD)
    return root


def _truth(root: Path, name: str) -> dict[str, Any]:
    return json.loads((root / f"{name}_truth.json").read_text())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_nan_in_one_shard_is_named_with_its_full_tensor_and_ranks(sharded: Path, layout: str) -> None:
    result = diagnose(sharded / f"{layout}_nan")
    first = result.first
    assert first is not None and result.sharded and result.tensors == "full"
    assert (first.kind, first.step, first.table, first.scope, first.name) == (
        "nonfinite", NAN_STEP, "weight_grad", "reduced", "fc1.weight"
    )
    assert (first.ranks, first.held, first.bad_ranks, first.rank) == ((0, 1), "shards", (BAD_RANK,), BAD_RANK)
    assert first.op == "min" and first.value is not None and math.isnan(first.value)  # NaN in min and max: min is first
    assert math.isnan(_truth(sharded, f"{layout}_nan")["full"]["max"])
    line = result.line()
    assert line.startswith(f"first anomaly: step {NAN_STEP}, full tensor, weight_grad/reduced fc1.weight: min = nan")
    assert "held by ranks 0,1 (shards), NaN/inf in rank 1's shard" in line
    doc = result.to_json()
    assert doc["first"]["ranks"] == [0, 1] and doc["first"]["bad_ranks"] == [1] and doc["tensors"] == "full"
    assert doc["line"] == line
    # rank 1 broke first; rank 0 only once the NaN reached it through the next step's forward
    assert result.first_step_by_rank[BAD_RANK] == NAN_STEP and result.first_step_by_rank[0] > NAN_STEP
    assert "rank 1 alone first" in result.ranks_line()


def test_a_nan_in_one_replica_is_not_hidden_by_the_other_copy(sharded: Path) -> None:
    result = diagnose(sharded / "tp_bias")
    first = result.first
    assert first is not None
    assert (first.step, first.table, first.scope, first.name) == (NAN_STEP, "weight_grad", "reduced", "fc2.bias")
    assert (first.ranks, first.held, first.bad_ranks, first.rank) == ((0, 1), "replicas, counted once", (1,), 1)
    assert "held by ranks 0,1 (replicas, counted once), NaN/inf in rank 1's replica" in result.line()


def _full_row(run: Path, step: int, op: str) -> float:
    from trainprobe.tools.query.layer import connect

    con = connect(run)
    [(value,)] = con.execute(
        f"SELECT {op} FROM weight_grad_full WHERE step = {step} AND name = 'fc1.weight' AND scope = 'reduced'"
    ).fetchall()
    return float(value)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_spike_in_one_shard_is_a_spike_of_the_full_tensor(sharded: Path, layout: str) -> None:
    run, truth = sharded / f"{layout}_spike", _truth(sharded, f"{layout}_spike")
    result = diagnose(run)
    first = result.first
    assert first is not None
    assert (first.kind, first.step, first.table, first.scope, first.name, first.op) == (
        "spike", SPIKE_STEP, "weight_grad", "reduced", "fc1.weight", "norm"
    )
    assert first.value == pytest.approx(truth["full"]["norm"], rel=1e-6)  # √Σ norm² of the shards
    assert first.value == pytest.approx(_full_row(run, SPIKE_STEP, "norm"), rel=1e-12)
    assert (first.ranks, first.held, first.bad_ranks, first.rank) == ((0, 1), "shards", (BAD_RANK,), BAD_RANK)
    assert "held by ranks 0,1 (shards), spike in rank 1's shard" in result.line() and ", full tensor," in result.line()
    assert result.ranks_line().startswith(f"ranks: rank {BAD_RANK} alone first (step {SPIKE_STEP})")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rank_local_answers_with_the_ranks_own_rows(sharded: Path, layout: str) -> None:
    run, truth = sharded / f"{layout}_spike", _truth(sharded, f"{layout}_spike")
    result = diagnose(run, rank_local=True)
    first = result.first
    assert first is not None and result.tensors == "rank-local" and result.sharded
    assert (first.step, first.rank, first.name, first.op) == (SPIKE_STEP, BAD_RANK, "fc1.weight", "norm")
    assert first.ranks is None and first.value == pytest.approx(truth["local"]["norm"], rel=1e-6)
    assert truth["local"]["norm"] != pytest.approx(truth["full"]["norm"], rel=1e-5)  # rank 0's shard left out
    assert result.line().startswith(f"first anomaly: step {SPIKE_STEP}, rank {BAD_RANK}, weight_grad/reduced fc1.weight")
    assert "tensors: rank-local (each rank's pieces as written)" in result.lines()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainprobe", "diagnose", *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_healthy_sharded_run_exits_0(sharded: Path, layout: str) -> None:
    done = _cli(str(sharded / f"{layout}_healthy"))
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "no anomaly: no NaN/inf and no spike by the rule recent_max in 2 rank(s)"
    assert lines[1].startswith("tensors: full (a sharded run: shards merged, replicas counted once")


def test_cli_rank_local_flag(sharded: Path, tmp_path: Path) -> None:
    done = _cli(str(sharded / "tp_nan"), "--rank-local", "--out", str(tmp_path))
    assert done.returncode == 1, done.stderr
    assert done.stdout.startswith(f"first anomaly: step {NAN_STEP}, rank {BAD_RANK}, weight_grad/reduced fc1.weight")
    assert json.loads((tmp_path / "diagnosis.json").read_text())["tensors"] == "rank-local"
    full = _cli(str(sharded / "tp_nan"))
    assert "held by ranks 0,1 (shards), NaN/inf in rank 1's shard" in full.stdout.splitlines()[0]
