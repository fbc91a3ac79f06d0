"""Monitor V2 and V1 under DistributedDataParallel on two GPUs (NCCL): weight_grad's unreduced
rows are each rank's own gradient, the reduced rows the average (float64 references computed on
the CPU), and training is bitwise unchanged against an unmonitored DDP twin.

Runs only with two CUDA devices and NCCL (``make test-gpu`` on such a machine); skipped otherwise."""

from __future__ import annotations

import copy
import json
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from conftest import rows_of, stats64, write_config
from models import MLP
from trainprobe import TrainerMonitorV2

WORLD, STEPS, ACC = 2, 2, 2
OPS = ["min", "max", "mean", "norm", "nans"]
PARAMS = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.device_count() >= 2 and dist.is_nccl_available()),
    reason="needs 2 CUDA devices and NCCL (multi-GPU check of make test-gpu)",
)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, port: int, root: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
    )
    try:
        _worker(rank, Path(root))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _batch(rank: int, step: int, micro: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randn(4, 6, generator=g).to(device)


def _train(rank: int, out: Path | None) -> tuple[list[torch.Tensor], dict[tuple[int, int], dict[str, torch.Tensor]]]:
    """DDP training on this rank's GPU (monitored by V2 weight_grad when ``out`` is given):
    losses and final parameters on the CPU, and each micro-batch's local float64 gradients."""
    device = torch.device("cuda", rank)
    torch.manual_seed(0)
    model = MLP().to(device)
    ref = copy.deepcopy(model).double().cpu()
    ddp = DDP(model, device_ids=[rank])
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    mon = None
    if out is not None:
        cfg = {"output_dir": str(out), "monitors": {"weight_grad": {"enabled": True, "ops": OPS}}}
        mon = TrainerMonitorV2(write_config(out.parent, cfg, name=f"v2_rank{rank}.json"))
        mon.start(model=ddp, optimizer=opt, grad_acc_steps=ACC)
    local: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    losses = []
    for step in range(STEPS):
        ref.load_state_dict({k: v.double().cpu() for k, v in model.state_dict().items()})
        for micro in range(ACC):
            x = _batch(rank, step, micro, device)
            grads = torch.autograd.grad(ref(x.double().cpu()).pow(2).mean() / ACC, list(ref.parameters()))
            local[(step, micro)] = {f"module.{n}": g for (n, _), g in zip(ref.named_parameters(), grads)}
            ctx = ddp.no_sync() if micro < ACC - 1 else torch.enable_grad()
            with ctx:
                loss = ddp(x).pow(2).mean() / ACC
                loss.backward()
            losses.append(loss.detach().cpu())
        opt.step()
        opt.zero_grad(set_to_none=True)
    if mon is not None:
        mon.stop()
    losses.extend(p.detach().cpu() for p in model.parameters())
    return losses, local


def _worker(rank: int, root: Path) -> None:
    plain, _ = _train(rank, None)
    monitored, local = _train(rank, root / "out")
    same = all(torch.equal(a, b) for a, b in zip(plain, monitored, strict=True))
    torch.save(local, root / f"local_rank{rank}.pt")
    (root / f"same_rank{rank}.json").write_text(json.dumps(same))


@pytest.fixture(scope="module")
def nccl_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("nccl")
    ctx = mp.spawn(_entry, args=(_free_port(), str(root)), nprocs=WORLD, join=False)
    deadline = time.monotonic() + 180
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in ctx.processes:
                if process.is_alive():
                    process.kill()
            pytest.fail("NCCL workers did not finish within 180 s")
    return root


def test_nccl_training_is_bitwise_unchanged(nccl_run: Path) -> None:
    for rank in range(WORLD):
        assert json.loads((nccl_run / f"same_rank{rank}.json").read_text()) is True, rank


def test_nccl_weight_grad_unreduced_is_local_and_reduced_is_the_average(nccl_run: Path) -> None:
    local = [torch.load(nccl_run / f"local_rank{r}.pt") for r in range(WORLD)]
    for rank in range(WORLD):
        rows = rows_of(nccl_run / "out", "weight_grad", rank)
        got: dict[tuple[int, str, str], dict[str, Any]] = {
            (int(r["step"]), r["module_name"], r["scope"]): r for r in rows
        }
        for step in range(STEPS):
            for name in (f"module.{n}" for n in PARAMS):
                mine = sum(local[rank][(step, m)][name] for m in range(ACC))
                every = sum(local[q][(step, m)][name] for q in range(WORLD) for m in range(ACC)) / WORLD
                for scope, t in (("unreduced", mine), ("reduced", every)):
                    ref = stats64(t)
                    row = got[(step, name, scope)]
                    for op in OPS:
                        assert float(row[op]) == pytest.approx(ref[op], rel=1e-5, abs=1e-7), (rank, step, name, op)
