"""An optimizer replaced mid-run (a new optimizer object over the same parameters, stepped
instead of the one given to the monitor) is followed by Monitor V2 and V1: every step's rows
are filed under their own step, weight_grad has its reduced rows, the optimizer monitors read
the new optimizer's state; one INFO line says so. An optimizer the monitor cannot follow gives
one true warning saying what to do (before: every later step's rows under the switch step and
a warning about grad_acc_steps saying the gradient was accumulated over the passes)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.optim.optimizer import _global_optimizer_pre_hooks

import trainprobe.engine.log
from conftest import rows_of, write_config
from models import MLP, no_hooks_left
from test_v1_support import make_v1, run_dir, table
from trainprobe import TrainerMonitorV2

STEPS, SWITCH = 5, 2


@pytest.fixture(autouse=True)
def _fresh_once_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trainprobe.engine.log, "_seen", set())


def train_switching(
    model: nn.Module,
    first: torch.optim.Optimizer,
    second: Callable[[], torch.optim.Optimizer],
    *,
    after_step: Callable[[], None] | None = None,
) -> tuple[torch.optim.Optimizer, list[dict[str, float]]]:
    """``STEPS`` steps, ``first`` stepping until ``SWITCH``, a new optimizer ``second()`` from then
    on; returns it and, per step, the norm of each parameter's ``exp_avg`` after the step."""
    opt, moments = first, []
    for step in range(STEPS):
        if step == SWITCH:
            opt = second()
        model(torch.randn(4, 6)).pow(2).mean().backward()
        opt.step()
        if after_step is not None:
            after_step()
        opt.zero_grad()
        moments.append({n: opt.state[p]["exp_avg"].norm().item() for n, p in model.named_parameters()})
    return opt, moments


def weight_grad_monitor(tmp_path: Path, out: Path) -> TrainerMonitorV2:
    """A V2 monitor of weight_grad alone, writing under ``out``."""
    return TrainerMonitorV2(
        write_config(tmp_path, {"output_dir": str(out), "monitors": {"weight_grad": {"enabled": True}}})
    )


def messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level and r.name.startswith("trainprobe")]


def test_v2_follows_a_new_optimizer_and_files_every_step(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = MLP()
    first = torch.optim.Adam(model.parameters(), lr=0.01)
    out = tmp_path / "out"
    monitors = {
        "module": {},
        "weight_grad": {"enabled": True},
        "optimizer": {"enabled": True},
        "param": {"enabled": True},
    }
    mon = TrainerMonitorV2(write_config(tmp_path, {"output_dir": str(out), "monitors": monitors}))
    global_hooks = len(_global_optimizer_pre_hooks)
    with caplog.at_level(logging.INFO):
        mon.start(model=model, optimizer=first)
        second, moments = train_switching(model, first, lambda: torch.optim.AdamW(model.parameters(), lr=0.01))
        assert mon.current_step == STEPS
        mon.stop()
    steps = [str(s) for s in range(STEPS)]
    for monitor in ("module", "weight_grad", "optimizer", "param"):
        per_step = Counter(r["step"] for r in rows_of(out, monitor))
        assert sorted(per_step) == steps, (monitor, per_step)
        assert len(set(per_step.values())) == 1, (monitor, per_step)  # the same rows every step
    grads = rows_of(out, "weight_grad")
    assert Counter(r["scope"] for r in grads if r["step"] == str(SWITCH)) == {"unreduced": 4, "reduced": 4}
    for row in rows_of(out, "optimizer"):
        if row["scope"] == "exp_avg":  # the state of the optimizer that stepped, before and after the switch
            name = row["module_name"].removesuffix(".exp_avg")
            assert float(row["norm"]) == pytest.approx(moments[int(row["step"])][name], rel=1e-5)
    assert messages(caplog, logging.WARNING) == []  # no word of grad_acc_steps
    followed = [m for m in messages(caplog, logging.INFO) if "a new optimizer" in m]
    assert followed == [
        "trainprobe: a new optimizer (AdamW) steps the monitored parameters in place of Adam; the monitor "
        "follows it from this step on (its steps end the monitored steps, its state is the one read)"
    ]
    assert no_hooks_left(model, first) and no_hooks_left(model, second)
    assert len(_global_optimizer_pre_hooks) == global_hooks


def test_v1_follows_a_new_optimizer_and_files_every_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    model = MLP()
    first = torch.optim.Adam(model.parameters(), lr=0.01)
    mon = make_v1(
        tmp_path,
        monkeypatch,
        {"wg_distribution": True, "mv_distribution": True, "xy_distribution": True, "all_xy": True, "ndigits": 12},
    )
    with caplog.at_level(logging.INFO):
        mon.set_monitor(model, grad_acc_steps=1, optimizer=first)
        second, moments = train_switching(model, first, lambda: torch.optim.Adam(model.parameters(), lr=0.001))
        assert mon.current_step == STEPS
        mon.stop()
    folder = run_dir(tmp_path)
    steps = [str(s) for s in range(STEPS)]
    for name in ("grad_reduced", "grad_unreduced", "exp_avg", "exp_avg_sq", "actv"):
        per_step = Counter(r["step"] for r in table(folder, name))
        assert sorted(per_step) == steps, (name, per_step)
        assert len(set(per_step.values())) == 1, (name, per_step)
    for row in table(folder, "exp_avg"):
        assert float(row["norm"]) == pytest.approx(moments[int(row["step"])][row["name"]], rel=1e-5)
    assert messages(caplog, logging.WARNING) == []
    assert len([m for m in messages(caplog, logging.INFO) if "a new optimizer (Adam)" in m]) == 1
    assert no_hooks_left(model, first) and no_hooks_left(model, second)


def test_v2_own_steps_keep_the_reduced_rows_of_a_new_optimizer(tmp_path: Path) -> None:
    """``patch_optimizer_step: false``, the loop calls ``mon.step()``: the pre-step hook that
    takes the reduced rows moves to the new optimizer."""
    torch.manual_seed(0)
    model = MLP()
    first = torch.optim.Adam(model.parameters(), lr=0.01)
    out = tmp_path / "out"
    cfg = {"output_dir": str(out), "patch_optimizer_step": False, "monitors": {"weight_grad": {"enabled": True}}}
    mon = TrainerMonitorV2(write_config(tmp_path, cfg))
    mon.start(model=model, optimizer=first)
    train_switching(model, first, lambda: torch.optim.Adam(model.parameters(), lr=0.1), after_step=mon.step)
    mon.stop()
    per_step = Counter((r["step"], r["scope"]) for r in rows_of(out, "weight_grad"))
    assert per_step == {(str(s), scope): 4 for s in range(STEPS) for scope in ("unreduced", "reduced")}


def test_the_left_optimizer_stepping_again_is_not_followed_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Both optimizers step the parameters after the switch: the monitor keeps following the
    new one (one step per iteration, not two) and says so once."""
    torch.manual_seed(0)
    model = MLP()
    first = torch.optim.SGD(model.parameters(), lr=0.01)
    second = torch.optim.SGD(model.parameters(), lr=0.02)
    out = tmp_path / "out"
    mon = weight_grad_monitor(tmp_path, out)
    with caplog.at_level(logging.INFO):
        mon.start(model=model, optimizer=first)
        for step in range(4):
            model(torch.randn(4, 6)).pow(2).mean().backward()
            if step >= 1:
                second.step()
            first.step()
            first.zero_grad()
        assert mon.current_step == 4
        mon.stop()
    warnings = messages(caplog, logging.WARNING)
    assert warnings == [
        "trainprobe: SGD, which SGD replaced, steps the monitored parameters again; the monitor follows SGD only "
        "(its steps end the monitored steps, its state is the one read); pass the optimizer you step to the "
        "monitor if that is not the one"
    ]
    assert sorted(Counter(r["step"] for r in rows_of(out, "weight_grad")).items()) == [(str(s), 8) for s in range(4)]


def test_an_optimizer_over_other_parameters_is_left_alone(tmp_path: Path) -> None:
    """A second optimizer over other tensors (a GAN's discriminator) steps without moving the
    monitor's hooks."""
    torch.manual_seed(0)
    model, other = MLP(), nn.Linear(2, 2)
    opt, other_opt = torch.optim.SGD(model.parameters(), lr=0.01), torch.optim.SGD(other.parameters(), lr=0.01)
    out = tmp_path / "out"
    mon = weight_grad_monitor(tmp_path, out)
    mon.start(model=model, optimizer=opt)
    for _ in range(3):
        other(torch.randn(3, 2)).sum().backward()
        other_opt.step()
        model(torch.randn(4, 6)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    assert mon.current_step == 3
    mon.stop()
    assert {r["module_name"] for r in rows_of(out, "weight_grad")} == {n for n, _ in model.named_parameters()}


def test_a_scaler_skip_after_the_switch_still_ends_the_step(tmp_path: Path) -> None:
    """GradScaler's skipped steps are watched on the optimizer followed."""
    torch.manual_seed(0)
    model = MLP()
    first = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    out = tmp_path / "out"
    mon = weight_grad_monitor(tmp_path, out)
    mon.start(model=model, optimizer=first)
    opt = first
    for step in range(4):
        if step == 1:
            opt = torch.optim.SGD(model.parameters(), lr=0.02)
        x = torch.randn(4, 6)
        if step == 2:
            x[0, 0] = float("inf")
        scaler.scale(model(x).pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert mon.current_step == 4
    mon.stop()
    scopes = Counter((r["step"], r["scope"]) for r in rows_of(out, "weight_grad"))
    assert scopes == {
        **{(s, "unreduced"): 4 for s in ("0", "1", "2", "3")},
        **{(s, "reduced"): 4 for s in ("0", "1", "3")},  # step 2 was skipped: no optimizer step ran
    }


def test_an_optimizer_that_cannot_be_followed_gets_one_true_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A new optimizer over copies of the parameters (a hand-made float32 master copy): its steps
    cannot be seen; the warning says what happened and what to do, not that grad_acc_steps is
    wrong or that the gradient was accumulated."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    out = tmp_path / "out"
    mon = weight_grad_monitor(tmp_path, out)
    with caplog.at_level(logging.INFO):
        mon.start(model=model, optimizer=opt)
        masters = [p.detach().clone() for p in model.parameters()]
        for step in range(4):
            model(torch.randn(4, 6)).pow(2).mean().backward()
            if step < SWITCH:
                opt.step()
                opt.zero_grad()
                continue
            if step == SWITCH:
                opt = torch.optim.SGD(masters, lr=0.01)
            for master, p in zip(masters, model.parameters()):
                master.grad = p.grad.clone()
            opt.step()
            model.zero_grad()
            with torch.no_grad():
                for master, p in zip(masters, model.parameters()):
                    p.copy_(master)
        mon.stop()
    warnings = messages(caplog, logging.WARNING)
    assert warnings == [
        f"trainprobe weight_grad: at step {SWITCH} the gradients were cleared (zero_grad) between two backward "
        "passes with no step of the optimizer given to the monitor in between. If another optimizer steps now, "
        f"the monitor does not see its steps (the rows that follow are filed under step {SWITCH}, without reduced "
        "rows): give it to the monitor (Monitor V2: stop(), then start(model=..., optimizer=new); Monitor V1: "
        "stop(), then set_monitor(...) of a new TrainerMon); a torch optimizer over the same parameters is "
        "followed by itself. Otherwise zero_grad() runs between the micro-batches of one step, and each "
        "optimizer step sees the gradient of its last micro-batch only"
    ]
    assert not any("a new optimizer" in m for m in messages(caplog, logging.INFO))
