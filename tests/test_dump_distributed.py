"""PrecisionDebugger on two gloo processes: rank directories, Distributed APIs, a DDP model at
mix level, and compare across the two runs' rank directories."""

from __future__ import annotations

import json
import socket
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from dump_models import ModuleOP
from trainprobe.dump import PrecisionDebugger
from trainprobe.dump.compare import compare_dumps

WORLD = 2

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
    )
    try:
        all_reduce = dist.all_reduce
        debugger = PrecisionDebugger(task="statistics", level="mix", dump_path=out)
        torch.manual_seed(0)
        model = DDP(ModuleOP())
        for _ in range(2):
            debugger.start(model)
            y = torch.full((3,), float(rank + 1)) * 2
            dist.all_reduce(y)
            torch.relu(y)
            model(torch.randn(4, 8) + rank).sum().backward()
            debugger.stop()
            debugger.step()
        assert dist.all_reduce is all_reduce
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _launch(out: Path, timeout: float = 120.0) -> None:
    ctx = mp.spawn(_worker, args=(_free_port(), str(out)), nprocs=WORLD, join=False)
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail("distributed workers did not finish")


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist") / "dump"
    _launch(out)
    return out


def test_rank_directories_and_distributed_apis(dumps: Path) -> None:
    assert sorted(p.name for p in dumps.iterdir()) == ["step0", "step1"]
    for step in ("step0", "step1"):
        assert sorted(p.name for p in (dumps / step).iterdir()) == ["rank0", "rank1"]
    for rank in range(WORLD):
        data: dict[str, Any] = json.loads((dumps / "step0" / f"rank{rank}" / "dump.json").read_text())["data"]
        reduce = data["Distributed.all_reduce.0.forward"]
        assert reduce["input_args"][0]["Max"] == 2.0 * (rank + 1)
        assert reduce["output"][0]["Max"] == 6.0  # 2 + 4, after the collective
        assert "Module.module.linear.Linear.forward.0" in data  # DDP's inner module, root left out
        assert "Module.module.linear.Linear.parameters_grad.0" in data
        construct = json.loads((dumps / "step0" / f"rank{rank}" / "construct.json").read_text())
        assert construct["Functional.linear.0.forward"] == "Module.module.linear.Linear.forward.0"


def test_compare_two_ranks(dumps: Path, tmp_path: Path) -> None:
    results = compare_dumps(dumps / "step0", dumps / "step1", tmp_path)
    assert [r.label for r in results] == ["rank0", "rank1"]
    first = results[0].first
    # the collective and relu repeat exactly; the first difference is the fresh random batch
    assert first is not None and first.record == "Tensor.__add__.0.forward"
