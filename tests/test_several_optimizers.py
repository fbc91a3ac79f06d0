"""Several models and optimizers (issue #35): a real GAN (two ``nn.Module``s, two Adams, D then G
updated each step) under Monitor V2 and V1.

* ``optimizer=[opt_d, opt_g]``: each optimizer's reduced weight_grad, param and optimizer rows
  are those around ITS OWN step of this training step (compared with float64 references of the
  gradients and parameters each optimizer applied); one step per training step, ended by the
  last optimizer (before: G's reduced row of step s held step s-1's gradient).
* ``optimizer=opt_g`` alone: one warning at start naming D's parameters and how to include them
  (before: D silently had no rows).
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.optimizer import _global_optimizer_pre_hooks

import trainprobe.engine.log
from conftest import assert_row_matches, rows_of, write_config
from test_v1_support import by_name, make_v1, run_dir, table
from trainprobe import TrainerMonitorV2
from trainprobe.engine.errors import ConfigError

STEPS = 3
V2_MONITORS = {"weight_grad": {"enabled": True}, "optimizer": {"enabled": True}, "param": {"enabled": True}}


@pytest.fixture(autouse=True)
def _fresh_once_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trainprobe.engine.log, "_seen", set())


def gan() -> tuple[nn.ModuleDict, torch.optim.Optimizer, torch.optim.Optimizer]:
    """G (4 -> 6) and D (6 -> 1) in one ModuleDict, an Adam for each."""
    torch.manual_seed(0)
    models = nn.ModuleDict(
        {
            "G": nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6)),
            "D": nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1)),
        }
    )
    opt_d = torch.optim.Adam(models["D"].parameters(), lr=0.01)
    opt_g = torch.optim.Adam(models["G"].parameters(), lr=0.01)
    return models, opt_d, opt_g


Refs = list[dict[str, dict[str, torch.Tensor]]]


def snapshot(prefix: str, module: nn.Module, what: str, opt: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Float64 copies of ``module``'s gradients, parameters or exp_avg, by row name."""
    out: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        if what == "grad":
            assert p.grad is not None
            out[f"{prefix}.{name}"] = p.grad.detach().double().clone()
        elif what == "param":
            out[f"{prefix}.{name}"] = p.detach().double().clone()
        else:
            assert opt is not None
            out[f"{prefix}.{name}"] = opt.state[p]["exp_avg"].detach().double().clone()
    return out


def train_gan(models: nn.ModuleDict, opt_d: torch.optim.Optimizer, opt_g: torch.optim.Optimizer) -> Refs:
    """``STEPS`` GAN steps (D's update, then G's; G's backward also reaches D's gradients);
    per step, the float64 references of what each optimizer applied."""
    g, d = models["G"], models["D"]
    bce = nn.BCEWithLogitsLoss()
    refs: Refs = []
    for _ in range(STEPS):
        real, z = torch.randn(16, 6), torch.randn(16, 4)
        ref: dict[str, dict[str, torch.Tensor]] = {}
        opt_d.zero_grad()
        d_loss = bce(d(real), torch.ones(16, 1)) + bce(d(g(z).detach()), torch.zeros(16, 1))
        d_loss.backward()
        ref["grad"] = snapshot("D", d, "grad")
        ref["param_origin"] = snapshot("D", d, "param")
        opt_d.step()
        ref["param_updated"] = snapshot("D", d, "param")
        ref["exp_avg"] = snapshot("D", d, "exp_avg", opt_d)
        opt_g.zero_grad()
        bce(d(g(z)), torch.ones(16, 1)).backward()
        ref["grad"] |= snapshot("G", g, "grad")
        ref["param_origin"] |= snapshot("G", g, "param")
        opt_g.step()
        ref["param_updated"] |= snapshot("G", g, "param")
        ref["exp_avg"] |= snapshot("G", g, "exp_avg", opt_g)
        refs.append(ref)
    return refs


def check_rows(rows: dict[str, list[dict[str, str]]], refs: Refs, name_col: str) -> None:
    """Every reference tensor of every step has exactly one row, equal to it in float64."""
    for table_name, scope, key in rows_spec():
        found = rows[table_name]
        for step, ref in enumerate(refs):
            for name, tensor in ref[key].items():
                row_name = f"{name}.exp_avg" if table_name == "optimizer" and name_col == "module_name" else name
                hits = [
                    r
                    for r in found
                    if r["step"] == str(step) and r[name_col].endswith(row_name) and r.get("scope", scope) == scope
                ]
                assert len(hits) == 1, (table_name, scope, step, name, hits)
                assert_row_matches(hits[0], tensor)


def rows_spec() -> list[tuple[str, str, str]]:
    return [
        ("weight_grad", "reduced", "grad"),
        ("param", "param_origin", "param_origin"),
        ("param", "param_updated", "param_updated"),
        ("optimizer", "exp_avg", "exp_avg"),
    ]


def test_v2_chain_takes_each_optimizers_rows_around_its_own_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    models, opt_d, opt_g = gan()
    out = tmp_path / "out"
    mon = TrainerMonitorV2(write_config(tmp_path, {"output_dir": str(out), "monitors": V2_MONITORS}))
    global_hooks = len(_global_optimizer_pre_hooks)
    with caplog.at_level(logging.WARNING):
        mon.start(model=models, optimizer=[opt_d, opt_g])
        refs = train_gan(models, opt_d, opt_g)
        assert mon.current_step == STEPS  # one step per training step: the last optimizer ends it
        mon.stop()
    rows = {t: rows_of(out, t) for t in ("weight_grad", "param", "optimizer")}
    check_rows(rows, refs, "module_name")
    per_step = Counter(r["step"] for r in rows["weight_grad"] if r["scope"] == "reduced")
    assert per_step == {str(s): 8 for s in range(STEPS)}
    assert not [r for r in caplog.records if "stepped by no optimizer" in r.getMessage()]
    assert len(_global_optimizer_pre_hooks) == global_hooks
    assert not opt_d._optimizer_step_pre_hooks and not opt_g._optimizer_step_post_hooks


def test_v2_one_optimizer_of_two_warns_once_naming_the_parameters_left_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    models, opt_d, opt_g = gan()
    out = tmp_path / "out"
    mon = TrainerMonitorV2(write_config(tmp_path, {"output_dir": str(out), "monitors": V2_MONITORS}))
    with caplog.at_level(logging.WARNING):
        mon.start(model=models, optimizer=opt_g)
        train_gan(models, opt_d, opt_g)
        mon.stop()
    warned = [r.getMessage() for r in caplog.records if "stepped by no optimizer" in r.getMessage()]
    assert len(warned) == 1
    assert "4 trainable parameters" in warned[0] and "D.0.weight, D.0.bias, D.2.weight, D.2.bias" in warned[0]
    assert "optimizer=[opt_d, opt_g]" in warned[0] and "G.0.weight" not in warned[0]
    assert {r["module_name"] for r in rows_of(out, "weight_grad")} == {
        "G.0.weight",
        "G.0.bias",
        "G.2.weight",
        "G.2.bias",
    }


def test_v2_frozen_parameters_are_not_left_out(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    models, _, opt_g = gan()
    models["D"].requires_grad_(False)
    mon = TrainerMonitorV2(write_config(tmp_path, {"output_dir": str(tmp_path / "out"), "monitors": V2_MONITORS}))
    with caplog.at_level(logging.WARNING):
        mon.start(model=models, optimizer=opt_g)
        mon.stop()
    assert not [r for r in caplog.records if "stepped by no optimizer" in r.getMessage()]


def test_v2_chain_in_the_wrong_order_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    models, opt_d, opt_g = gan()
    mon = TrainerMonitorV2(write_config(tmp_path, {"output_dir": str(tmp_path / "out"), "monitors": V2_MONITORS}))
    with caplog.at_level(logging.WARNING):
        mon.start(model=models, optimizer=[opt_g, opt_d])  # the loop steps D first
        train_gan(models, opt_d, opt_g)
        mon.stop()
    warned = [r.getMessage() for r in caplog.records if "did not step" in r.getMessage()]
    assert len(warned) == 1 and "Adam, the last of the optimizers passed" in warned[0]
    assert "in the order each training step steps them" in warned[0]


def test_an_empty_list_is_a_config_error(tmp_path: Path) -> None:
    models, _, _ = gan()
    mon = TrainerMonitorV2(write_config(tmp_path, {"output_dir": str(tmp_path / "out"), "monitors": V2_MONITORS}))
    with pytest.raises(ConfigError, match=r"start\(optimizer=\.\.\.\): an empty list"):
        mon.start(model=models, optimizer=[])


def test_v1_chain_takes_each_optimizers_rows_around_its_own_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    models, opt_d, opt_g = gan()
    config = {"wg_distribution": True, "mv_distribution": True, "param_distribution": True, "ndigits": 12}
    mon = make_v1(tmp_path, monkeypatch, config)
    with caplog.at_level(logging.WARNING):
        mon.set_monitor(models, grad_acc_steps=1, optimizer=[opt_d, opt_g])
        refs = train_gan(models, opt_d, opt_g)
        assert mon.current_step == STEPS
        mon.stop()
    folder = run_dir(tmp_path)
    for step, ref in enumerate(refs):
        for table_name, key in (("grad_reduced", "grad"), ("exp_avg", "exp_avg"), ("param_origin", "param_origin")):
            rows = [r for r in table(folder, table_name) if r["step"] == str(step)]
            for name, tensor in ref[key].items():
                hits = by_name(rows, f"0:{name}")
                assert len(hits) == 1, (table_name, step, name, rows)
                assert_row_matches(hits[0], tensor, rel=1e-6)
    assert not [r for r in caplog.records if "stepped by no optimizer" in r.getMessage()]


def test_v1_one_optimizer_of_two_warns_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    models, opt_d, opt_g = gan()
    mon = make_v1(tmp_path, monkeypatch, {"wg_distribution": True})
    with caplog.at_level(logging.WARNING):
        mon.set_monitor(models, grad_acc_steps=1, optimizer=opt_g)
        train_gan(models, opt_d, opt_g)
        mon.stop()
    warned = [r.getMessage() for r in caplog.records if "stepped by no optimizer" in r.getMessage()]
    assert len(warned) == 1 and "D.0.weight" in warned[0] and "optimizer=[opt_d, opt_g]" in warned[0]
