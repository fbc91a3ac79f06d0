"""The one optimizer view of each backend (PyTorch here): wrappers, chains and mixed-precision
master copies seen as one optimizer, its state read without inserting entries, and Monitor V2
running over a chain of optimizers."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_row_matches, rows_of, write_config
from models import MLP
from trainprobe import TrainerMonitorV2
from trainprobe.backends.torch.backend import TORCH
from trainprobe.backends.torch.optimizer import TorchOptimizerView, torch_optimizer_view
from trainprobe.engine.errors import ConfigError


class Wrapper:
    """DeepSpeed/accelerate style: the real optimizer is in .optimizer."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.optimizer = inner

    def step(self) -> None:
        self.optimizer.step()


class Chain:
    """Megatron ChainedOptimizer style: several wrapped optimizers stepped in order."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.chained_optimizers = [Wrapper(o) for o in optimizers]

    def step(self) -> None:
        for o in self.chained_optimizers:
            o.step()

    def zero_grad(self) -> None:
        for o in self.chained_optimizers:
            o.optimizer.zero_grad()


class Float16Wrapper:
    """Megatron Float16OptimizerWithFloat16Params layout: the inner optimizer steps float32 copies."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.float16_groups = [params]
        self.fp32_from_float16_groups = [[p.detach().float().clone().requires_grad_() for p in params]]
        self.optimizer = torch.optim.Adam(self.fp32_from_float16_groups[0], lr=1e-2)


def _train(model: MLP, step: object, steps: int = 1) -> None:
    for _ in range(steps):
        model(torch.randn(4, 6)).pow(2).mean().backward()
        step()
        for p in model.parameters():
            p.grad = None


def test_chain_is_one_view_with_its_members_state():
    model = MLP()
    adam = torch.optim.Adam(model.fc1.parameters(), lr=1e-2)
    sgd = torch.optim.SGD(model.fc2.parameters(), lr=1e-2)
    view = TORCH.optimizer_view(Chain(adam, sgd))
    assert isinstance(view, TorchOptimizerView)
    assert view.optimizers == [adam, sgd]
    assert view.class_name == "Adam/SGD"
    assert [g["params"] for g in view.groups()] == [list(model.fc1.parameters()), list(model.fc2.parameters())]
    # before any step: Adam's class keeps exp_avg, so the chain does
    assert view.keeps_state(("exp_avg",)) is True
    assert view.state_of(model.fc1.weight) is None and view.moments_of(model.fc1.weight) == {}
    assert len(adam.state) == 0  # looking up never inserts into the state's defaultdict
    _train(model, Chain(adam, sgd).step)
    assert set(view.moments_of(model.fc1.weight)) == {"exp_avg", "exp_avg_sq"}
    assert view.moments_of(model.fc1.weight)["exp_avg"] is adam.state[model.fc1.weight]["exp_avg"]
    assert view.moments_of(model.fc2.weight) == {}
    assert torch_optimizer_view(view) is view


def test_optimizer_without_adam_state_is_judged_from_the_optimizer():
    model = MLP()
    view = TORCH.optimizer_view(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert view.keeps_state(("exp_avg",), every=False) is False
    assert view.keeps_state(("momentum_buffer",)) is True


def test_master_copies_are_seen_through_the_model_parameters():
    model = MLP()
    wrapper = Float16Wrapper(list(model.parameters()))
    view = torch_optimizer_view(wrapper)
    masters = wrapper.fp32_from_float16_groups[0]
    assert view.groups()[0]["params"] == list(model.parameters())
    assert view.groups()[0]["lr"] == 1e-2
    assert view.copy_of(model.fc1.weight) is masters[0]
    for master in masters:
        master.grad = torch.ones_like(master)
    wrapper.optimizer.step()
    assert view.state_of(model.fc1.weight) is wrapper.optimizer.state[masters[0]]
    other = torch.zeros(2, requires_grad=True)
    assert view.copy_of(other) is other and view.state_of(other) is None


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("start(optimizer=...)", r"^start\(optimizer=\.\.\.\): expected a torch\.optim\.Optimizer"),
        ("set_monitor(optimizer=...)", r"^set_monitor\(optimizer=\.\.\.\): expected a torch\.optim\.Optimizer"),
    ],
)
def test_no_optimizer_inside_names_the_argument(where, message):
    with pytest.raises(ConfigError, match=message + r".* got Wrapper$"):
        TORCH.optimizer_view(Wrapper(object()), where)


def test_monitor_v2_reads_the_moments_of_every_optimizer_of_a_chain(tmp_path):
    model = MLP()
    first = torch.optim.Adam(model.fc1.parameters(), lr=1e-2)
    second = torch.optim.AdamW(model.fc2.parameters(), lr=1e-2)
    chain = Chain(first, second)
    out = tmp_path / "out"
    cfg = {"output_dir": str(out), "monitors": {"optimizer": {"enabled": True, "ops": ["norm", "max"]}}}
    mon = TrainerMonitorV2(write_config(tmp_path, cfg))
    mon.start(model=model, optimizer=chain)
    _train(model, chain.step, steps=2)
    mon.stop()
    rows = rows_of(out, "optimizer")
    assert sorted({r["step"] for r in rows}) == ["0", "1"]
    last = {r["module_name"]: r for r in rows if r["step"] == "1"}
    assert sorted(last) == sorted(f"{n}.{m}" for n, _ in model.named_parameters() for m in ("exp_avg", "exp_avg_sq"))
    assert_row_matches(last["fc2.weight.exp_avg_sq"], second.state[model.fc2.weight]["exp_avg_sq"])
    assert_row_matches(last["fc1.bias.exp_avg"], first.state[model.fc1.bias]["exp_avg"])


def test_monitor_v2_reads_the_master_copies_a_mixed_precision_wrapper_steps(tmp_path):
    model = MLP()
    wrapper = Float16Wrapper(list(model.parameters()))
    masters = wrapper.fp32_from_float16_groups[0]
    out = tmp_path / "out"
    monitors = {"optimizer": {"enabled": True, "ops": ["norm"]}, "param": {"enabled": True, "ops": ["norm"]}}
    mon = TrainerMonitorV2(write_config(tmp_path, {"output_dir": str(out), "monitors": monitors}))
    mon.start(model=model, optimizer=wrapper)
    model(torch.randn(4, 6)).pow(2).mean().backward()
    for p, master in zip(model.parameters(), masters):
        master.grad = p.grad.float()
    wrapper.optimizer.step()  # the copies step; the model gets them back only afterwards
    with torch.no_grad():
        for p, master in zip(model.parameters(), masters):
            p.copy_(master)
    mon.stop()
    moments = {r["module_name"] for r in rows_of(out, "optimizer")}
    assert "fc1.weight.exp_avg" in moments and not any(n.startswith("param_group") for n in moments)
    updated = {r["module_name"]: r for r in rows_of(out, "param") if r["scope"] == "param_updated"}
    assert_row_matches(updated["fc1.weight"], masters[0])
