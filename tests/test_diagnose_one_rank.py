"""``trainprobe diagnose`` on a DDP run where one rank's batch breaks (issue #34): the NaN
reaches the other rank in the same step, through the gradient all-reduce, so both ranks' first
anomalous step is the same; the ranks line must still name the broken rank alone first, by
execution order within the step (its forward ran before the all-reduce)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from models import MLP
from test_distributed_v2 import _batch, _loss, _session, launch
from trainprobe.tools.diagnosis.answer import diagnose

BAD_RANK, BAD_STEP, STEPS = 1, 3, 5
OPS = ["min", "max", "mean", "norm", "nans"]


def _worker(rank: int, root: Path) -> None:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(MLP())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitors = {"module": {"enabled": True, "ops": OPS}, "weight_grad": {"enabled": True, "ops": OPS}}

    def train(mon: object) -> None:
        for step in range(STEPS):
            x = _batch(rank, step, 0)
            if rank == BAD_RANK and step == BAD_STEP:
                x[0, 0] = float("nan")  # a corrupted sample on this rank only
            _loss(model, x, 1.0).backward()
            opt.step()
            opt.zero_grad()

    _session(root / "run", rank, monitors, train, model=model, optimizer=opt)
    dist.barrier()


@pytest.fixture(scope="module")
def one_rank_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("one_rank")
    launch(_worker, root)
    return root / "run"


def test_the_broken_rank_is_named_alone_first_within_the_step(one_rank_run: Path) -> None:
    result = diagnose(one_rank_run)
    assert result.first is not None and (result.first.step, result.first.rank) == (BAD_STEP, BAD_RANK)
    assert result.first_step_by_rank == {0: BAD_STEP, 1: BAD_STEP}  # both ranks see it in that step
    assert result.first_ranks == [BAD_RANK]
    line = result.ranks_line()
    assert line.startswith(f"ranks: rank {BAD_RANK} alone first (step {BAD_STEP})"), line
    assert f"then rank 0 at step {BAD_STEP} (later in the step)" in line, line
