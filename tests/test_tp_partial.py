"""No partial sum written as a statistic under tensor parallelism (issue #32): DTensor
``ColwiseParallel`` / ``RowwiseParallel`` on a 1-D mesh of two gloo ranks, the module monitor on
every module.

A module's input rows are read before its own forward pre-hooks, so before a parallel style
turns the input into a DTensor: ``up.grad_input.0`` (a ``ColwiseParallel`` module, whose
DTensor input's gradient is a ``Partial(sum)``) is the gradient of the tensor the caller passed,
which the style's backward has already all-reduced, the full gradient on every rank. Where the
module itself receives a DTensor (``blk`` prepares its input as a replicated DTensor kept as such,
``PrepareModuleInput(use_local_output=False)``), ``blk.up``'s input gradient is a ``Partial``
DTensor: that row is left out, with one warning naming ``blk.up``.

Every other row equals a float64 reference of the same model without parallelism: the full
tensor for the rows the layout replicates, this rank's column block for the sharded ones (the
colwise layer's output up to the rowwise layer's input); training is bitwise the unmonitored one.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from conftest import rows_of, stats64
from test_distributed_v2 import launch
from test_pipeline_monitor import warnings_said
from trainprobe import TrainerMonitorV2

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)

WORLD = 2
STEPS = 2
D, H = 8, 8
OPS = ["min", "max", "mean", "norm"]

SHARDED = {"up.output.0", "act.input.0", "act.output.0", "down.input.0",
           "blk.up.output.0", "blk.act.input.0", "blk.act.output.0", "blk.down.input.0"}
"""Rows (gradients: their ``grad_`` rows too) of a tensor split by columns across the ranks."""
PARTIAL = {"blk.up.grad_input.0"}
"""Rows whose tensor is a ``Partial`` DTensor: never written."""


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, H)
        self.act = nn.Tanh()
        self.down = nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


class TPNet(nn.Module):
    """``inp`` (replicated), a colwise/rowwise pair at the top level, the same pair inside ``blk``,
    ``head`` (replicated)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.up = nn.Linear(D, H)
        self.act = nn.Tanh()
        self.down = nn.Linear(H, D)
        self.blk = Block()
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = self.down(self.act(self.up(h)))
        return self.head(self.blk(h))


def parallel(model: TPNet) -> TPNet:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    plan = {
        "up": ColwiseParallel(),
        "down": RowwiseParallel(),
        "blk": PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Replicate(), use_local_output=False),
        "blk.up": ColwiseParallel(),
        "blk.down": RowwiseParallel(),
    }
    return parallelize_module(model, mesh, plan)  # type: ignore[return-value]


class Reference:
    """Every module's input, output and their gradients in a float64 copy of the model (no
    parallelism), per step: ``{step: {row name: tensor}}``."""

    def __init__(self, model: nn.Module) -> None:
        self.model = copy.deepcopy(model).double()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.seen: dict[int, dict[str, torch.Tensor]] = {}
        self.step = 0
        for name, module in self.model.named_modules():
            module.register_forward_pre_hook(self._keep(name, "input"))
            module.register_forward_hook(lambda m, a, out, n=name: self._tensor(n, "output", out))

    def _keep(self, name: str, kind: str) -> Any:
        return lambda m, args: self._tensor(name, kind, args[0])

    def _tensor(self, name: str, kind: str, t: torch.Tensor) -> None:
        rows = self.seen.setdefault(self.step, {})
        rows[f"{name}.{kind}.0"] = t.detach().clone()
        if t.requires_grad:
            t.register_hook(lambda g: rows.__setitem__(f"{name}.grad_{kind}.0", g.detach().clone()))

    def train(self, x: torch.Tensor, step: int) -> None:
        self.step = step
        self.model(x.double()).pow(2).mean().backward()
        self.opt.step()
        self.opt.zero_grad()


def expected(ref: torch.Tensor, row: str, rank: int) -> list[float]:
    """The statistics row ``row`` should hold on ``rank``: of the full tensor, or of this rank's
    column block where the row's tensor is sharded."""
    base = row.replace("grad_", "")
    if base in SHARDED:
        ref = ref.chunk(WORLD, dim=-1)[rank]
    stats = stats64(ref)
    return [stats[op] for op in OPS]


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, reference: Reference | None = None) -> None:
    gen = torch.Generator().manual_seed(3)  # the same batch on both ranks, as tensor parallelism needs
    for step in range(steps):
        x = torch.randn(4, D, generator=gen)
        if reference is not None:
            reference.train(x, step)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def entry(rank: int, root: Path) -> None:
    torch.manual_seed(0)
    plain = TPNet()
    reference = Reference(plain)
    model, untouched = parallel(copy.deepcopy(plain)), parallel(copy.deepcopy(plain))
    mon = TrainerMonitorV2({"output_dir": str(root / "tp"), "monitors": {"module": {"ops": OPS}}})
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with warnings_said() as said:
        mon.start(model=model, optimizer=opt)
        train(model, opt, STEPS, reference)
        mon.stop()
    train(untouched, torch.optim.SGD(untouched.parameters(), lr=0.05), STEPS)
    want = {
        f"{step}|{row}": expected(t, row, rank) for step, rows in reference.seen.items() for row, t in rows.items()
    }
    bitwise = all(torch.equal(a.to_local(), b.to_local()) if hasattr(a, "to_local") else torch.equal(a, b)
                  for a, b in zip(model.parameters(), untouched.parameters()))
    (root / f"rank{rank}.json").write_text(json.dumps({"expected": want, "warnings": said, "bitwise": bitwise}))


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tp_partial")
    launch(entry, root, timeout=300, world=WORLD)
    return root


def result(root: Path, rank: int) -> dict[str, Any]:
    return json.loads((root / f"rank{rank}.json").read_text())


def written(root: Path, rank: int) -> dict[str, list[float]]:
    rows = rows_of(root / "tp", "module", rank)
    return {f"{r['step']}|{r['module_name']}": [float(r[op]) for op in OPS] for r in rows}


def test_every_row_written_equals_the_full_tensor_or_the_ranks_piece(tp_run: Path) -> None:
    for rank in range(WORLD):
        want = result(tp_run, rank)["expected"]
        got = written(tp_run, rank)
        assert "0|.input.0" in want and "0|up.grad_input.0" in want  # the root's rows, the colwise gradient
        assert set(got) == {k for k in want if k.split("|")[1] not in PARTIAL}
        for key, values in got.items():
            assert values == pytest.approx(want[key], rel=1e-5, abs=1e-7), f"rank {rank} {key}"


def test_colwise_input_gradient_is_the_reduced_one_on_every_rank(tp_run: Path) -> None:
    """``up.grad_input.0`` is the full gradient (not the rank's summand), the same on both ranks."""
    rows = [written(tp_run, rank) for rank in range(WORLD)]
    want = result(tp_run, 0)["expected"]
    for step in range(STEPS):
        key = f"{step}|up.grad_input.0"
        assert rows[0][key] == rows[1][key]
        assert rows[0][key] == pytest.approx(want[key], rel=1e-5, abs=1e-7)


def test_partial_rows_left_out_with_one_warning(tp_run: Path) -> None:
    for rank in range(WORLD):
        got = written(tp_run, rank)
        assert not [k for k in got if k.split("|")[1] in PARTIAL]
        assert "0|blk.up.input.0" in got and "0|blk.grad_input.0" in got
        said = [w for w in result(tp_run, rank)["warnings"] if "Partial" in w]
        assert said == [
            "trainprobe module: rows of 1 module(s) are left out (blk.up): the tensor is a DTensor with a Partial "
            "placement (each rank holds a summand, not a piece: a gradient before its reduction), whose statistics "
            "describe no tensor. The module's other rows are written"
        ]


def test_tp_training_bitwise_unchanged(tp_run: Path) -> None:
    for rank in range(WORLD):
        assert result(tp_run, rank)["bitwise"]
