"""Monitor V2 on models trained through ``torch.compile`` (CPU): names without ``_orig_mod``, the
compiled boundary recorded, modules inside a compiled graph named in one warning, and training
bitwise equal to the same compiled run without monitoring."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from conftest import rows_of
from models import MLP
from trainprobe import TrainerMon, TrainerMonitorV2

ALL = ("module", "weight_grad", "optimizer", "param")


class TwoBlocks(nn.Module):
    """Two MLP blocks in a ModuleList and a head: blocks can be compiled one by one."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([MLP(6, 8, 6), MLP(6, 8, 6)])
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _config(out: Path) -> dict:
    return {
        "output_dir": str(out),
        "start_step": 0,
        "step_interval": 1,
        "monitors": {name: {"enabled": True} for name in ALL},
    }


def _train(
    make: Callable[[nn.Module], tuple[nn.Module, nn.Module]],
    out: Path | None,
    *,
    model_cls: type[nn.Module] = MLP,
    steps: int = 3,
) -> list[torch.Tensor]:
    """Train ``model_cls`` through the module ``make`` returns (``(called, passed to start)``);
    monitored when ``out`` is given. Returns the final parameters."""
    torch.manual_seed(0)
    model = model_cls()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    called, watched = make(model)
    mon = None
    if out is not None:
        mon = TrainerMonitorV2(_config(out))
        mon.start(model=watched, optimizer=opt)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        loss = called(torch.randn(4, 6, generator=gen)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    if mon is not None:
        mon.stop()
    return [p.detach().clone() for p in model.parameters()]


def _whole(backend: str) -> Callable[[nn.Module], tuple[nn.Module, nn.Module]]:
    def make(model: nn.Module) -> tuple[nn.Module, nn.Module]:
        compiled = torch.compile(model, backend=backend)
        return compiled, compiled

    return make


def _assert_bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("trainprobe.engine.log._seen", set())
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_compiled_model_trains_bitwise_as_without_monitoring(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, backend: str
) -> None:
    caplog.set_level(logging.WARNING, logger="trainprobe")
    plain = _train(_whole(backend), None)
    torch._dynamo.reset()
    watched = _train(_whole(backend), tmp_path)
    _assert_bitwise(plain, watched)
    module = rows_of(tmp_path, "module")
    # the compiled boundary is recorded every step, named like the model it compiles
    assert sorted({r["module_name"] for r in module}) == [".grad_output.0", ".input.0", ".output.0"]
    assert len(module) == 3 * 3
    for monitor in ("weight_grad", "param", "optimizer"):
        names = {
            r["module_name"].removesuffix(".exp_avg_sq").removesuffix(".exp_avg") for r in rows_of(tmp_path, monitor)
        }
        assert names == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}, monitor
    warnings = [r.getMessage() for r in caplog.records if "torch.compile graph" in r.getMessage()]
    assert len(warnings) == 1
    assert "3 module(s)" in warnings[0] and "(fc1, act, fc2)" in warnings[0]
    assert "_orig_mod" not in caplog.text


def test_blocks_compiled_one_by_one_record_each_block(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="trainprobe")

    def make(model: nn.Module) -> tuple[nn.Module, nn.Module]:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, backend="eager")
        return model, model

    plain = _train(make, None, model_cls=TwoBlocks)
    torch._dynamo.reset()
    watched = _train(make, tmp_path, model_cls=TwoBlocks)
    _assert_bitwise(plain, watched)
    names = {r["module_name"] for r in rows_of(tmp_path, "module")}
    assert {"blocks.0.input.0", "blocks.1.output.0", "blocks.1.grad_output.0", "head.input.0"} <= names
    assert not any(n.startswith("blocks.0.fc1") for n in names)
    assert {r["module_name"] for r in rows_of(tmp_path, "weight_grad")} >= {"blocks.0.fc1.weight", "head.bias"}
    assert "6 module(s)" in caplog.text and "blocks.0.fc1, blocks.0.act" in caplog.text


def test_a_module_compiled_in_place_is_named_in_the_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="trainprobe")

    def make(model: nn.Module) -> tuple[nn.Module, nn.Module]:
        model.blocks[1].compile(backend="eager")
        return model, model

    plain = _train(make, None, model_cls=TwoBlocks)
    torch._dynamo.reset()
    watched = _train(make, tmp_path, model_cls=TwoBlocks)
    _assert_bitwise(plain, watched)
    names = {r["module_name"] for r in rows_of(tmp_path, "module")}
    assert "blocks.0.fc1.input.0" in names and not any(n.startswith("blocks.1") for n in names)
    assert "4 module(s)" in caplog.text and "(blocks.1, blocks.1.fc1, blocks.1.act, blocks.1.fc2)" in caplog.text


def test_a_model_called_through_a_wrapper_it_was_not_given_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trainprobe")

    def make(model: nn.Module) -> tuple[nn.Module, nn.Module]:
        return torch.compile(model, backend="eager"), model

    plain = _train(make, None)
    torch._dynamo.reset()
    watched = _train(make, tmp_path)
    _assert_bitwise(plain, watched)
    assert rows_of(tmp_path, "module") == []
    assert caplog.text.count("runs inside torch.compile") == 1
    assert len(rows_of(tmp_path, "weight_grad")) == 3 * 8


def test_a_model_compiled_in_place_warns_once_and_trains_bitwise(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trainprobe")

    def make(model: nn.Module) -> tuple[nn.Module, nn.Module]:
        model.compile(backend="eager")
        return model, model

    plain = _train(make, None)
    torch._dynamo.reset()
    watched = _train(make, tmp_path)
    _assert_bitwise(plain, watched)
    assert rows_of(tmp_path, "module") == []
    assert "4 module(s)" in caplog.text and "(<root>, fc1, act, fc2)" in caplog.text
    assert "runs inside torch.compile" not in caplog.text
    assert len(rows_of(tmp_path, "param")) == 3 * 8


# -- compiling after attaching (the usual nanoGPT order) ---------------------------------------
ORDER_STEPS = 5


def _attach(kind: str, model: nn.Module, opt: torch.optim.Optimizer, out: Path) -> Callable[[], None]:
    """Attach monitor ``kind`` (``v2``: module + weight_grad; ``v1``: xy) to ``model``; returns
    its stop."""
    if kind == "v2":
        cfg = {"output_dir": str(out), "monitors": {"module": {"enabled": True}, "weight_grad": {"enabled": True}}}
        v2 = TrainerMonitorV2(cfg)
        v2.start(model=model, optimizer=opt)
        return v2.stop
    path = out / "v1.json"
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"targets": {}, "all_xy": True, "xy_distribution": True}), encoding="utf-8")
    v1 = TrainerMon(str(path), params_have_main_grad=False)
    v1.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    return v1.stop


def _losses(kind: str | None, order: str, out: Path) -> tuple[list[float], int]:
    """Losses of ``ORDER_STEPS`` steps of an MLP compiled (``eager`` backend) before or after
    monitor ``kind`` attached (None: no monitor), and the graphs dynamo compiled."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    compiled = torch.compile(model, backend="eager") if order == "compile-then-attach" else None
    stop = _attach(kind, model if compiled is None else compiled, opt, out) if kind is not None else None
    if compiled is None:
        compiled = torch.compile(model, backend="eager")
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(ORDER_STEPS):
        loss = compiled(torch.randn(4, 6, generator=gen)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if stop is not None:
        stop()
    return losses, counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("order", ["attach-then-compile", "compile-then-attach"])
@pytest.mark.parametrize("kind", ["v2", "v1"])
def test_compiling_before_or_after_attaching_never_recompiles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, kind: str, order: str
) -> None:
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "v1"))
    caplog.set_level(logging.WARNING, logger="trainprobe")
    plain, plain_graphs = _losses(None, order, tmp_path / "plain")
    watched, graphs = _losses(kind, order, tmp_path / "watched")
    assert plain_graphs == 1
    assert graphs == 1  # before the fix: one graph per call (the hooks' counter was guarded on)
    assert watched == plain  # bitwise
    traced = caplog.text.count("runs inside torch.compile")
    assert traced == (1 if order == "attach-then-compile" else 0)
