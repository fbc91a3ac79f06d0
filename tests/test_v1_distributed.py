"""Two gloo processes: cc_distribution, dp_group / tp_group redundancy, pipeline group in alerts."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from models import MLP
from test_distributed_v2 import launch
from test_v1_support import by_name, full_name, table
from trainprobe.frontdoors.monitor_v1 import TrainerMon


def _line_of(text: str) -> int:
    """The line number of the first line of this file containing ``text``."""
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line and "_line_of" not in line)


GRAD_LINE = _line_of("dist.all_reduce(p.grad)")
LOG_LINE = _line_of("# logged after optimizer.step()")


def _folder(out: Path, rank: int) -> Path:
    (folder,) = [p for p in out.iterdir() if f"-rank{rank}-" in p.name]
    return folder


def _run(
    out: Path,
    config: dict,
    rank: int,
    steps: int = 2,
    nan_rank: int | None = None,
    metric_sync: bool = False,
    log_loss: bool = False,
    **groups,
) -> None:
    os.environ["MONITOR_OUTPUT_DIR"] = str(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"config{rank}.json"
    path.write_text(json.dumps(config))
    torch.manual_seed(0)
    model = MLP()
    model.fc1.weight.tensor_model_parallel = True
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(str(path), process_group=groups.pop("process_group", None), params_have_main_grad=False)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt, **groups)
    for step in range(steps):
        torch.manual_seed(100 * rank + step)
        loss = model(torch.randn(4, 6)).pow(2).mean()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= 2
        if metric_sync:
            dist.all_reduce(torch.ones(1))  # a collective that cc_codeline leaves out
        if step == 1 and rank == nan_rank:
            model.fc2.bias.grad[0] = math.nan
        opt.step()
        opt.zero_grad()
        if log_loss:
            dist.all_reduce(loss.detach())  # logged after optimizer.step(): belongs to this step
    mon.stop()


def _worker(rank: int, base: str) -> None:
    base_dir = Path(base)
    world = dist.group.WORLD
    cc = {"wg_distribution": True, "cc_distribution": {"enable": True}, "ops": ["norm", "max"], "ndigits": 12}
    _run(base_dir / "cc", cc, rank)
    codeline = {
        "enable": True,
        "cc_codeline": [rf"test_v1_distributed\.py\[{GRAD_LINE}\]"],
        "cc_pre_hook": True,
    }
    _run(base_dir / "codeline", {"cc_distribution": codeline, "ndigits": 12}, rank, metric_sync=True)
    _run(base_dir / "dp", {"wg_distribution": True}, rank, dp_group=world)
    _run(base_dir / "tp", {"wg_distribution": True}, rank, tp_group=world)
    alert = {"wg_distribution": True, "alert": {"rules": [{"rule_name": "AnomalyNan"}], "dump": True}}
    _run(base_dir / "alert", alert, rank, nan_rank=1, process_group=world)


def test_two_ranks_cc_dp_tp_and_pipeline_group(tmp_path):
    launch(_worker, str(tmp_path))
    for rank in (0, 1):
        folder = _folder(tmp_path / "cc", rank)
        other = table(folder, "other")
        names = {r["name"] for r in other}
        assert any(n.startswith("all_reduce.0.out.0@test_v1_distributed.py[") for n in names), names
        assert {r["step"] for r in other} == {"0", "1"}
        # the gradient after the collective equals the reduced gradient of the first parameter
        first = [r for r in other if r["name"].startswith("all_reduce.0.out") and r["step"] == "0"][0]
        reduced = by_name([r for r in table(folder, "grad_reduced") if r["step"] == "0"], "0:fc1.weight")[0]
        assert float(first["norm"]) == pytest.approx(2 * float(reduced["norm"]), rel=1e-9)
    # cc_codeline (a regular expression naming the gradient all_reduce line) and cc_pre_hook
    rows = table(_folder(tmp_path / "codeline", 0), "other")
    sites = {r["name"].split("@", 1)[1] for r in rows}
    assert sites == {f"test_v1_distributed.py[{GRAD_LINE}]"}, sites
    assert {r["name"].split("@")[0] for r in rows if r["step"] == "0"} == {
        f"all_reduce.{i}.{side}.0" for i in range(4) for side in ("in", "out")
    }
    dp0, dp1 = (_folder(tmp_path / "dp", r) for r in (0, 1))
    assert table(dp0, "grad_reduced") and not table(dp1, "grad_reduced")
    assert table(dp1, "grad_unreduced")
    tp0, tp1 = (_folder(tmp_path / "tp", r) for r in (0, 1))
    assert {full_name(r) for r in table(tp0, "grad_reduced")} == {
        "0:fc1.weight",
        "0:fc1.bias",
        "0:fc2.weight",
        "0:fc2.bias",
    }
    assert {full_name(r) for r in table(tp1, "grad_reduced")} == {"0:fc1.weight"}
    assert not (tmp_path / "alert" / "anomaly_detected" / "rank0").exists()
    dump = json.loads((tmp_path / "alert" / "anomaly_detected" / "rank1" / "anomaly.json").read_text())
    assert {(e["rank"], e["pp_stage"], tuple(e["group_mates"]), e["step"]) for e in dump.values()} == {
        (1, 1, (0, 1), 1)
    }


def test_a_collective_after_optimizer_step_belongs_to_the_step_that_trained(tmp_path):
    """V1 files a collective issued after ``optimizer.step()`` (the loss all-reduced for logging)
    under the step that trained, as V2 does, and writes no file for step 2, which never trained
    (2 steps: 0 and 1)."""
    launch(_trailing_worker, str(tmp_path))
    for rank in (0, 1):
        folder = _folder(tmp_path, rank)
        assert sorted(p.name for p in folder.glob("*.csv")) == ["other_0-0.csv", "other_1-1.csv"]
        rows = table(folder, "other")
        logged = [r for r in rows if r["name"].endswith(f"@test_v1_distributed.py[{LOG_LINE}]")]
        assert sorted(r["step"] for r in logged) == ["0", "1"]  # the "out" row (no cc_pre_hook)
        grads = [r for r in rows if r["name"].endswith(f"@test_v1_distributed.py[{GRAD_LINE}]")]
        assert {r["step"] for r in grads} == {"0", "1"}


def _trailing_worker(rank: int, base: str) -> None:
    _run(Path(base), {"cc_distribution": {"enable": True}, "ops": ["norm"]}, rank, log_loss=True)
