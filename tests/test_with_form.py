"""``with TrainerMonitorV2(...)``, ``with TrainerMon(...)`` and ``with PrecisionDebugger(...)``:
a training loop that raises inside the block leaves no hook behind and the files written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import rows_of
from models import MLP, no_hooks_left
from test_v1_support import make_v1, run_dir, table
from trainprobe import PrecisionDebugger, TrainerMonitorV2


class LoopFailed(RuntimeError):
    """What the training loops below raise at their third step."""


def _train(model: MLP, opt: torch.optim.Optimizer, step_done: object = None, fail_at: int = 2) -> None:
    for s in range(fail_at + 1):
        if s == fail_at:
            raise LoopFailed("the loop failed")
        model(torch.randn(4, 6)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if callable(step_done):
            step_done()


def test_v2_with_block_that_raises_removes_hooks_and_flushes(tmp_path: Path) -> None:
    model = MLP()
    opt = torch.optim.Adam(model.parameters())
    config = {
        "output_dir": str(tmp_path),
        "async_write": True,
        "monitors": {"module": {"enabled": True}, "weight_grad": {"enabled": True}, "param": {"enabled": True}},
    }
    step = torch.optim.Adam.step
    with pytest.raises(LoopFailed, match="the loop failed"), TrainerMonitorV2(config) as monitor:
        monitor.start(model=model, optimizer=opt)
        _train(model, opt)
    assert no_hooks_left(model, opt)
    assert torch.optim.Adam.step is step and "step" not in vars(opt)
    assert {int(r["step"]) for r in rows_of(tmp_path, "param")} == {0, 1}
    assert {int(r["step"]) for r in rows_of(tmp_path, "module")} == {0, 1}
    monitor.stop()  # still callable (idempotent)


def test_v1_with_block_that_raises_removes_hooks_and_flushes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = MLP()
    opt = torch.optim.Adam(model.parameters())
    config = {"targets": {}, "xy_distribution": True, "all_xy": True, "wg_distribution": True, "ops": ["norm", "max"]}
    with pytest.raises(LoopFailed, match="the loop failed"), make_v1(tmp_path, monkeypatch, config) as monitor:
        monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
        _train(model, opt)
    assert no_hooks_left(model, opt)
    folder = run_dir(tmp_path)
    assert {r["step"] for r in table(folder, "actv")} == {"0", "1"}
    assert {r["step"] for r in table(folder, "grad_reduced")} == {"0", "1"}
    monitor.stop()


def test_dump_with_block_that_raises_removes_hooks_and_writes_the_step(tmp_path: Path) -> None:
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        pytest.raises(LoopFailed, match="the loop failed"),
        PrecisionDebugger(task="statistics", level="L0", dump_path=str(tmp_path)) as debugger,
    ):
        debugger.start(model)
        _train(model, opt, fail_at=1)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    (rank_dir,) = (tmp_path / "step0").iterdir()
    data = json.loads((rank_dir / "dump.json").read_text(encoding="utf-8"))["data"]
    assert "Module.fc1.Linear.forward.0" in data
    debugger.stop()
