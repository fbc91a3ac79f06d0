"""Sharded training on gloo (issue #32, "every row knows what it summarises" and "the read side
sees full tensors"): tensor parallelism (ColwiseParallel / RowwiseParallel on an uneven hidden
size) and FSDP2, two real ranks each. Each rank writes ``tensor_layout.json``; the query layer's
``weight_grad_full`` view merges the rank-local rows, and its statistics equal those of the
gathered full gradient (``DTensor.full_tensor()``, float64 reference): norm and mean within
1e-6 relative, min/max exact, NaN counts exact; unreduced FSDP2 rows stay one per rank."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytest.importorskip("duckdb")
pytest.importorskip("pyarrow")

from conftest import write_config  # noqa: E402
from test_distributed_v2 import launch  # noqa: E402
from trainprobe import TrainerMonitorV2  # noqa: E402

WORLD = 2
STEPS = 3
OPS = ["min", "max", "mean", "norm", "nans"]
HIDDEN = {"tp": 6, "fsdp2": 7}

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)


class Net(nn.Module):
    def __init__(self, hidden: int = 7) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, hidden)  # FSDP2: 7 rows, shards of 4 and 3 (uneven); TP: 6 (from_local needs even)
        self.fc2 = nn.Linear(hidden, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _entry(rank: int, root: Path) -> None:
    for layout in ("fsdp2", "tp"):  # fsdp2 first: its run must not say what warn_once says once a process
        _train(rank, root, layout)
        dist.barrier()


def _train(rank: int, root: Path, layout: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = Net(HIDDEN[layout])
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp" if layout == "tp" else "dp",))
    if layout == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    else:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.fc1, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    out = root / layout
    monitors: dict[str, Any] = {m: {"enabled": True, "ops": OPS} for m in ("weight_grad", "param", "optimizer")}
    monitors["cc"] = {"enabled": True, "ops": OPS}
    cfg = {"output_dir": str(out), "monitors": monitors}
    mon = TrainerMonitorV2(write_config(root, cfg, name=f"{layout}_rank{rank}.json"))
    with _warnings() as said:
        mon.start(model=model, optimizer=opt)
    (root / f"{layout}_warnings_rank{rank}.json").write_text(json.dumps(said))
    full: dict[str, Any] = {}
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 + step + (rank if layout == "fsdp2" else 0))  # TP: one batch for all
        x = torch.randn(5, 8, generator=gen)
        model(x).square().mean().backward()
        grads = {n: p.grad.full_tensor().double() for n, p in model.named_parameters()}  # a collective: every rank
        full[str(step)] = {n: g.tolist() for n, g in grads.items()}
        opt.step()
        opt.zero_grad()
    mon.stop()
    if rank == 0:
        (root / f"{layout}_full_grads.json").write_text(json.dumps(full))


@contextlib.contextmanager
def _warnings() -> Iterator[list[str]]:
    """The trainprobe logger's warnings meanwhile."""
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logging.getLogger("trainprobe").addHandler(handler)
    try:
        yield said
    finally:
        logging.getLogger("trainprobe").removeHandler(handler)


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sharded")
    launch(_entry, root, timeout=300, world=WORLD)
    return root


def _reference(values: Any) -> dict[str, float]:
    t = torch.tensor(values, dtype=torch.float64)
    return {"min": t.min().item(), "max": t.max().item(), "mean": t.mean().item(),
            "norm": t.norm().item(), "nans": float(t.isnan().sum().item()), "numel": float(t.numel())}


@pytest.mark.parametrize("layout", ["tp", "fsdp2"])
def test_each_rank_describes_its_pieces(sharded_runs: Path, layout: str) -> None:
    docs = [json.loads((sharded_runs / layout / f"rank_{r}" / "tensor_layout.json").read_text()) for r in range(WORLD)]
    by_name = [{(e["monitor"], e["name"], e["scope"]): e for e in d["tensors"]} for d in docs]
    assert all(d["world_size"] == WORLD and d["rank"] == r for r, d in enumerate(docs))
    w0, w1 = (b[("weight_grad", "fc1.weight", None)] for b in by_name)
    hidden = HIDDEN[layout]
    assert w0["kind"] == w1["kind"] == "shard" and w0["global_shape"] == [hidden, 8]
    first = -(-hidden // WORLD)
    assert (w0["local_shape"], w1["local_shape"]) == ([first, 8], [hidden - first, 8])
    assert (w0["offsets"], w1["offsets"]) == ([0, 0], [first, 0])
    assert w0["numel"] + w1["numel"] == hidden * 8
    assert ("optimizer", "fc1.weight.exp_avg", None) in by_name[0]
    bias2 = by_name[0][("weight_grad", "fc2.bias", None)]
    if layout == "tp":  # RowwiseParallel keeps the bias replicated
        assert bias2["kind"] == "replica" and bias2["placements"] == ["R"]
        assert ("weight_grad", "fc1.weight", "unreduced") not in by_name[0]
    else:
        assert by_name[0][("weight_grad", "fc1.weight", "unreduced")]["kind"] == "rank_local"


@pytest.mark.parametrize("layout", ["tp", "fsdp2"])
def test_full_view_equals_the_gathered_gradient(sharded_runs: Path, layout: str) -> None:
    from trainprobe.tools.query.layer import connect

    full = json.loads((sharded_runs / f"{layout}_full_grads.json").read_text())
    con = connect(sharded_runs / layout)
    rows = con.execute(
        "SELECT step, name, min, max, mean, norm, nans, numel, pieces, complete, ranks FROM weight_grad_full "
        "WHERE scope = 'reduced' ORDER BY step, name"
    ).fetchall()
    assert len(rows) == STEPS * 4
    for step, name, lo, hi, mean, norm, nans, numel, pieces, complete, ranks in rows:
        want = _reference(full[str(step)][name])
        assert lo == pytest.approx(want["min"], rel=1e-6, abs=1e-12) and hi == pytest.approx(want["max"], rel=1e-6, abs=1e-12)
        assert float(lo) == float(torch.tensor(want["min"], dtype=torch.float32))  # exact: the float32 values
        assert float(hi) == float(torch.tensor(want["max"], dtype=torch.float32))
        assert norm == pytest.approx(want["norm"], rel=1e-6)
        assert mean == pytest.approx(want["mean"], rel=1e-6, abs=1e-9)
        assert nans == want["nans"] and numel == want["numel"] and complete
        replicated = layout == "tp" and name == "fc2.bias"
        assert (pieces, ranks) == ((1, "0") if replicated else (2, "0,1")), (name, pieces, ranks)


def test_rank_local_rows_are_kept_one_per_rank(sharded_runs: Path) -> None:
    from trainprobe.tools.query.layer import connect, describe

    con = connect(sharded_runs / "fsdp2")
    [(kinds, per_rank)] = con.execute(
        "SELECT list(DISTINCT kind), count(*) FROM weight_grad_full WHERE scope = 'unreduced'"
    ).fetchall()
    assert kinds == ["rank_local"] and per_rank == STEPS * 4 * WORLD
    assert "weight_grad_full" not in describe(con) and "weight_grad_full" in describe(con, full=True)


def test_cc_says_once_that_tensor_parallel_collectives_are_not_recorded(sharded_runs: Path) -> None:
    for layout, expected in (("tp", True), ("fsdp2", False)):
        said = json.loads((sharded_runs / f"{layout}_warnings_rank0.json").read_text())
        hits = [m for m in said if "functional collectives" in m]
        assert len(hits) == (1 if expected else 0), (layout, said)


def test_a_single_process_run_writes_no_layout_file(tmp_path: Path) -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"output_dir": str(tmp_path / "out"), "monitors": {"weight_grad": {"enabled": True}}}
    mon = TrainerMonitorV2(write_config(tmp_path, cfg))
    mon.start(model=model, optimizer=opt)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    mon.stop()
    assert not (tmp_path / "out" / "rank_0" / "tensor_layout.json").exists()
