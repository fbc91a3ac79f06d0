"""A tensor without values (``device="meta"``: a shape and a dtype only) is treated the same by
every monitor, because the statistics kernel decides it (``TensorStats.row`` gives None, the row
buffer keeps no row for it): Monitor V2's module, weight_grad, param and optimizer monitors and
Monitor V1's xy, wg, mv and param distributions write no row for it and go on with every other
tensor, step after step; the dump keeps its record with null statistics."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

import trainprobe.engine.log
from conftest import rows_of
from test_v1_support import make_v1, run_dir, table
from trainprobe import PrecisionDebugger, TrainerMonitorV2
from trainprobe.backends.torch.stats import TensorStats
from trainprobe.engine.records import RowBuffer, RowKey
from trainprobe.engine.stats.ops import DEFAULT_OPS

STEPS = 3


class _ShapeCarrier(nn.Module):
    """Returns its real input doubled and an empty tensor shaped like its meta one."""

    def forward(self, x: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, torch.empty_like(like)


class MetaModel(nn.Module):
    """A real MLP with a meta parameter (deferred initialisation, stepped by the optimizer with a
    meta gradient), a meta buffer, and a submodule that passes a meta tensor along."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(16, 3)
        self.carrier = _ShapeCarrier()
        self.deferred = nn.Parameter(torch.empty(4, 5, device="meta"))
        self.register_buffer("shape_only", torch.empty(2, 2, device="meta"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.carrier(self.fc2(self.act(self.fc1(x))), self.shape_only)
        return y


def train(model: MetaModel, opt: torch.optim.Optimizer, steps: int = STEPS) -> None:
    """One backward pass a step reaches every parameter, the meta one included (a meta gradient)."""
    for _ in range(steps):
        loss = model(torch.randn(4, 6)).pow(2).mean()
        torch.autograd.backward([loss, (model.deferred * 2).sum()])
        opt.step()
        opt.zero_grad()


REAL = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}


@pytest.fixture
def quiet_once(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """Once-only log lines said afresh, INFO captured."""
    monkeypatch.setattr(trainprobe.engine.log, "_seen", set())
    caplog.set_level(logging.INFO)
    return caplog


def test_the_kernel_gives_no_row_for_a_meta_tensor() -> None:
    stats = TensorStats(DEFAULT_OPS)
    real = torch.randn(5)
    assert stats.row(torch.empty(4, device="meta")) is None
    assert stats.row(torch.empty(0, device="meta")) is None
    rows = stats.rows([real, torch.empty(3, device="meta"), torch.empty(7, 9, device="meta").t(), real])
    assert rows[1] is None and rows[2] is None and rows[0] == rows[3] == stats.row(real)
    meta_int = torch.empty(3, dtype=torch.int64, device="meta")
    assert stats.row(meta_int) is None


def test_the_row_buffer_keeps_no_row_for_none(quiet_once: pytest.LogCaptureFixture) -> None:
    buffer = RowBuffer()
    a, b, c = (RowKey(0, name, "s") for name in "abc")
    buffer.extend([a, b], [[1.0], None])
    buffer.add(c, None)
    buffer.add(c, [3.0])
    assert buffer.snapshot() == [(a, [1.0]), (c, [3.0])]
    assert buffer.drain("m", 0).rows() == [(a, [1.0]), (c, [3.0])]
    assert quiet_once.text.count("b (s) is a tensor without values (device='meta')") == 1


def test_v2_monitors_write_no_row_for_meta_tensors_and_go_on(tmp_path: Path, quiet_once) -> None:
    torch.manual_seed(0)
    model = MetaModel()
    opt = torch.optim.AdamW(model.parameters())
    monitors = {name: {"enabled": True} for name in ("module", "weight_grad", "param", "optimizer")}
    mon = TrainerMonitorV2({"output_dir": str(tmp_path), "monitors": monitors})
    mon.start(model=model, optimizer=opt)
    train(model, opt)
    mon.stop()
    assert "failed" not in quiet_once.text and "switched off" not in quiet_once.text
    assert quiet_once.text.count("tensor without values (device='meta')") == 1
    for monitor in ("weight_grad", "param", "optimizer"):
        rows = rows_of(tmp_path, monitor)
        for step in range(STEPS):
            names = {r["module_name"].removesuffix(f".{r['scope']}") for r in rows if r["step"] == str(step)}
            assert names == REAL, (monitor, step, names)  # every real parameter, never the meta one
    modules = rows_of(tmp_path, "module")
    for step in range(STEPS):
        names = {r["module_name"] for r in modules if r["step"] == str(step)}
        assert "carrier.output.0" in names and "carrier.input.0" in names
        assert "carrier.output.1" not in names and "carrier.input.1" not in names


def test_v1_monitors_write_no_row_for_meta_tensors_and_go_on(tmp_path: Path, monkeypatch, quiet_once) -> None:
    torch.manual_seed(0)
    model = MetaModel()
    opt = torch.optim.AdamW(model.parameters())
    config = {
        "targets": {},
        "xy_distribution": True,
        "all_xy": True,
        "wg_distribution": True,
        "mv_distribution": True,
        "param_distribution": True,
        "ops": ["min", "max", "norm"],
    }
    mon = make_v1(tmp_path, monkeypatch, config)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    train(model, opt)
    mon.stop()
    assert "failed" not in quiet_once.text
    folder = run_dir(tmp_path)
    for name in ("grad_reduced", "grad_unreduced", "exp_avg", "exp_avg_sq", "param_origin", "actv"):
        rows = table(folder, name)
        for step in range(STEPS):
            names = {r["name"] for r in rows if r["step"] == str(step)}
            assert names, (name, step)
            assert not any("deferred" in n for n in names), (name, names)
            if name != "actv":
                assert REAL <= names, (name, step, names)
    actv = {r["name"] for r in table(folder, "actv")}
    assert "carrier.output_0" in actv and "carrier.input_0" in actv
    assert "carrier.output_1" not in actv and "carrier.input_1" not in actv


def test_the_dump_keeps_a_meta_tensor_with_null_statistics(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = MetaModel()
    opt = torch.optim.AdamW(model.parameters())
    debugger = PrecisionDebugger(task="statistics", level="L0", dump_path=str(tmp_path))
    for _ in range(2):
        debugger.start(model)
        train(model, opt, 1)
        debugger.stop()
        debugger.step()
    for step in ("step0", "step1"):
        (rank_dir,) = (tmp_path / step).iterdir()
        data = json.loads((rank_dir / "dump.json").read_text(encoding="utf-8"))["data"]
        carrier = data["Module.carrier._ShapeCarrier.forward.0"]
        real, meta = carrier["output"]
        assert real["Max"] is not None and real["Norm"] is not None
        assert meta["shape"] == [2, 2] and [meta[k] for k in ("Max", "Min", "Mean", "Norm")] == [None] * 4
        assert "md5" not in meta and "data_name" not in meta
        assert data["Module.fc1.Linear.forward.0"]["output"][0]["Max"] is not None
