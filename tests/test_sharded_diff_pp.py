"""``trainprobe diff`` across pipeline splits (issue #32 item 5): the same four-layer model trained
with GPipe on two stages (two gloo ranks, layers 0-1 and 2-3) and on one stage (one process), the
same micro-batches, seed and batches. The stages are cut from one model (its layers keep their
names, as torchtitan does), so a layer is named alike in both runs; the diff matches whole
tensors by that name, not by rank and stage."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("duckdb")

from test_distributed_v2 import launch  # noqa: E402
from trainprobe import TrainerMonitorV2  # noqa: E402
from trainprobe.tools.rundiff.answer import diff  # noqa: E402

STEPS, M, D, BATCH, FAULT_STEP = 4, 2, 6, 8, 2
OPS = ["min", "max", "mean", "norm", "nans"]
SPLITS = {1: [["0", "1", "2", "3"]], 2: [["0", "1"], ["2", "3"]]}


class Net(nn.Module):
    """Four tanh layers in a ModuleDict (a stage deletes the others; the names stay)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleDict({str(i): nn.Linear(D, D) for i in range(4)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = torch.tanh(layer(x))
        return x


def _train(rank: int, root: Path, world: int, name: str, fault: bool) -> None:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    chunk = copy.deepcopy(Net())
    for key in [k for k in chunk.layers if k not in SPLITS[world][rank]]:
        del chunk.layers[key]
    stage = PipelineStage(chunk, rank, world, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, M, loss_fn=lambda out, y: (out - y).pow(2).mean())
    opt = torch.optim.Adam(chunk.parameters(), lr=0.01)
    mon = TrainerMonitorV2({"output_dir": str(root / name), "monitors": {
        m: {"enabled": True, "ops": OPS} for m in ("module", "weight_grad", "param", "optimizer")}})
    mon.start(model=stage, optimizer=opt, micro_batch_number=M)
    gen = torch.Generator().manual_seed(7)
    for step in range(STEPS):
        x, y = torch.randn(BATCH, D, generator=gen), torch.randn(BATCH, D, generator=gen)
        if fault and step == FAULT_STEP and "2" in chunk.layers:
            with torch.no_grad():
                chunk.layers["2"].weight.mul_(100.0)  # x100 weight at step k, before its forward
        if world == 1:
            schedule.step(x, target=y)
        elif rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
        opt.step()
        opt.zero_grad()
    mon.stop()


def _two_stages(rank: int, root: Path) -> None:
    _train(rank, root, 2, "pp2", False)
    _train(rank, root, 2, "pp2_fault", True)


def _one_stage(rank: int, root: Path) -> None:
    _train(rank, root, 1, "pp1", False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pp_splits")
    launch(_two_stages, root, timeout=300, world=2)
    launch(_one_stage, root, timeout=300, world=1)
    return root


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainprobe", "diff", *args], capture_output=True, text=True, timeout=300)


def test_two_stages_and_one_stage_of_the_same_training_exit_0(runs: Path) -> None:
    done = _cli(str(runs / "pp1"), str(runs / "pp2"))
    assert done.returncode == 0, done.stdout + done.stderr
    result = diff(runs / "pp1", runs / "pp2")
    assert result.counts["only_baseline"] == result.counts["only_candidate"] == 0, result.answer()
    assert set(result.tables) >= {"module", "weight_grad", "param", "optimizer"}
    assert all(t["equal"] + t["within_tolerance"] > 0 for t in result.tables.values()), result.tables
    assert any("pipeline" in n for n in result.notes), result.notes


def test_a_fault_in_the_second_stage_is_found_at_its_step_and_tensor(runs: Path) -> None:
    done = _cli(str(runs / "pp1"), str(runs / "pp2_fault"))
    assert done.returncode == 1, done.stdout + done.stderr
    first = diff(runs / "pp1", runs / "pp2_fault").first
    assert first is not None
    assert (first.step, first.table, first.name) == (FAULT_STEP, "module", "layers.2.output.0"), first
