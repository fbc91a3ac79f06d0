"""``trainprobe diff`` across data-parallel sizes (issue #32 item 5): the same global batch of 8 on
one process (DP=1) and on two DDP ranks (DP=2, 4 samples each).

What compares: the reduced gradients, the parameters and the optimizer states are the same tensors
at both sizes (DDP averages the ranks' gradients of a mean loss over equal batch pieces: the
full-batch gradient). What does not: ``unreduced`` gradients (and activations) are each rank's own
batch piece (``rank_local`` in ``tensor_layout.json``), whose statistics combine into no statistic
of the full batch's; they are not merged, and a full-tensor diff across DP sizes finds them
different (rank 0's piece against the whole batch) and rank 1's only in the candidate. Leaving
``rank_local`` rows out of a diff whose two runs' ranks differ (with one note) is the diff's
business (``tools/engines``); until it does, the exit-0 expectation is a strict xfail and the
tests compare the tables that are comparable, plus the reduced rows through the full view."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("duckdb")

from conftest import write_config  # noqa: E402
from test_distributed_v2 import launch  # noqa: E402
from test_sharded_full_tensors import OPS, Net  # noqa: E402
from trainprobe import TrainerMonitorV2  # noqa: E402
from trainprobe.tools.rundiff.answer import diff  # noqa: E402

WORLD, STEPS, FAULT_STEP, BATCH = 2, 4, 2, 8
MONITORS = ("weight_grad", "param", "optimizer")
COMPARABLE = ["param", "optimizer"]


def _train(out: Path, model: torch.nn.Module, rank: int, world: int, fault: bool) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    cfg = {"output_dir": str(out), "monitors": {m: {"enabled": True, "ops": OPS} for m in MONITORS}}
    mon = TrainerMonitorV2(write_config(out.parent, cfg, name=f"{out.name}_rank{rank}.json"))
    mon.start(model=model, optimizer=opt)
    inner = getattr(model, "module", model)
    for step in range(STEPS):
        x = torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(100 + step))
        piece = x.chunk(world)[rank]  # the same global batch, cut among the ranks
        if fault and step == FAULT_STEP:
            with torch.no_grad():
                inner.fc2.weight.mul_(100.0)  # x100 weight at step k, before its forward
        model(piece).square().mean().backward()
        opt.step()
        opt.zero_grad()
    mon.stop()


def _entry(rank: int, base: Path) -> None:
    from torch.nn.parallel import DistributedDataParallel

    for name, fault in (("dp2", False), ("dp2_fault", True)):
        torch.manual_seed(0)
        _train(base / name, DistributedDataParallel(Net(7)), rank, WORLD, fault)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dp_sizes")
    launch(_entry, root, timeout=300, world=WORLD)
    torch.manual_seed(0)
    _train(root / "dp1", Net(7), 0, 1, False)  # this process: DP=1
    return root


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainprobe", "diff", *args], capture_output=True, text=True, timeout=300)


def test_dp1_and_dp2_params_and_optimizer_states_do_not_diverge(runs: Path) -> None:
    done = _cli(str(runs / "dp1"), str(runs / "dp2"), "--tables", *COMPARABLE)
    assert done.returncode == 0, done.stdout + done.stderr
    result = diff(runs / "dp1", runs / "dp2", tables=COMPARABLE)
    assert result.counts["compared"] > 0 and result.counts["only_baseline"] == result.counts["only_candidate"] == 0


def test_dp1_and_dp2_reduced_gradients_are_the_same_full_tensors(runs: Path) -> None:
    result = diff(runs / "dp1", runs / "dp2", tables=["weight_grad"], limit=1000)
    wrong = [d for d in result.divergences if d.scope != "unreduced"]
    assert not wrong, wrong[:3]
    assert all(r.scope == "unreduced" for r in result.only_candidate), result.only_candidate[:3]


@pytest.mark.xfail(strict=True, reason="diff compares rank_local rows (unreduced: batch pieces) across DP sizes; "
                   "leaving them out when the runs' ranks differ is tools/engines' (issue #32 report)")
def test_dp1_and_dp2_of_the_same_training_exit_0(runs: Path) -> None:
    done = _cli(str(runs / "dp1"), str(runs / "dp2"))
    assert done.returncode == 0, done.stdout


def test_a_fault_at_dp2_is_found_at_its_step_and_tensor(runs: Path) -> None:
    done = _cli(str(runs / "dp1"), str(runs / "dp2_fault"), "--tables", *COMPARABLE)
    assert done.returncode == 1, done.stdout + done.stderr
    first = diff(runs / "dp1", runs / "dp2_fault", tables=COMPARABLE).first
    assert first is not None
    assert (first.step, first.table, first.scope, first.name) == (FAULT_STEP, "param", "param_origin", "fc2.weight")
