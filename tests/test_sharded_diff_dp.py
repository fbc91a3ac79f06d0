"""``trainprobe diff`` across data-parallel sizes (issue #32 item 5): the same global batch of 8 on
one process (DP=1) and on two DDP ranks (DP=2, 4 samples each).

What compares: the reduced gradients, the parameters and the optimizer states are the same tensors
at both sizes (DDP averages the ranks' gradients of a mean loss over equal batch pieces: the
full-batch gradient). What does not: ``unreduced`` gradients (and activations) are each rank's own
batch piece (``rank_local`` in ``tensor_layout.json``), whose statistics combine into no statistic
of the full batch's. The default diff of runs whose ranks differ leaves those rows out, with one
note line; ``--rank-local`` compares them as written (and finds rank 0's half batch different from
the whole batch, rank 1's rows only in the candidate)."""

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


def test_dp1_and_dp2_of_the_same_training_exit_0(runs: Path) -> None:
    done = _cli(str(runs / "dp1"), str(runs / "dp2"))
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("No divergence") or lines[0].startswith("no divergence"), done.stdout
    notes = [line for line in lines if line.startswith("note:")]
    assert len(notes) == 1 and "weight_grad unreduced" in notes[0] and "1 rank vs 2 ranks" in notes[0], done.stdout
    result = diff(runs / "dp1", runs / "dp2")
    assert result.counts["compared"] > 0 and result.counts["only_baseline"] == result.counts["only_candidate"] == 0
    assert result.tables["weight_grad"]["equal"] + result.tables["weight_grad"]["within_tolerance"] > 0
    assert len(result.notes) == 1


def test_rank_local_compares_the_batch_pieces_as_written(runs: Path) -> None:
    done = _cli(str(runs / "dp1"), str(runs / "dp2"), "--rank-local")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "note:" not in done.stdout
    result = diff(runs / "dp1", runs / "dp2", rank_local=True)
    assert result.first is not None and result.first.scope == "unreduced", result.answer()
    assert result.only_candidate and all(r.rank == 1 for r in result.only_candidate)  # rows as written


def test_two_runs_of_the_same_ranks_compare_their_rank_local_rows(runs: Path) -> None:
    result = diff(runs / "dp2", runs / "dp2_fault")
    assert not result.notes, result.notes
    unreduced = [d for d in result.divergences if d.scope == "unreduced"]
    assert unreduced and unreduced[0].step == FAULT_STEP, result.answer()


def test_a_fault_at_dp2_is_found_at_its_step_and_tensor(runs: Path) -> None:
    done = _cli(str(runs / "dp1"), str(runs / "dp2_fault"), "--tables", *COMPARABLE)
    assert done.returncode == 1, done.stdout + done.stderr
    first = diff(runs / "dp1", runs / "dp2_fault", tables=COMPARABLE).first
    assert first is not None
    assert (first.step, first.table, first.scope, first.name) == (FAULT_STEP, "param", "param_origin", "fc2.weight")


def test_the_default_diff_finds_the_fault_at_its_step(runs: Path) -> None:
    """The default diff (rank-local rows left out) names step 2; the first row of it in execution
    order is a reduced gradient (the monitor reads ``param_origin`` at the optimizer step, after
    the backward), and the weight itself is the first parameter row that differs, by x100."""
    done = _cli(str(runs / "dp1"), str(runs / "dp2_fault"))
    assert done.returncode == 1, done.stdout + done.stderr
    result = diff(runs / "dp1", runs / "dp2_fault", limit=1000)
    assert result.first is not None and result.first.step == FAULT_STEP, result.answer()
    assert all(d.step >= FAULT_STEP and d.scope != "unreduced" for d in result.divergences)
    params = [d for d in result.divergences if d.table == "param"]
    assert (params[0].step, params[0].scope, params[0].name) == (FAULT_STEP, "param_origin", "fc2.weight")
    assert params[0].factor is not None and 90 < params[0].factor < 110
