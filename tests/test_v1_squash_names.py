"""Monitor V1 parameter names under ``squash_name`` where squashing would clash: the first
parameter in model order keeps the squashed name, later ones their full names, as the reference
(mindstudio-probe 26.2.0) writes them (``blocks.0.norm1.weight`` → ``norm1.weight``,
``blocks.1.norm1.weight`` stays); modules that would clash keep their full names (the reference
writes two rows of the same name, see docs/compatibility.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from test_v1_support import by_name, forget_warnings, full_name, make_v1, run_dir, table
from trainprobe.frontdoors.monitor_v1.config import load_monitor_v1_config
from trainprobe.frontdoors.monitor_v1.naming import first_come_names


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(4)
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm1(x))


class Net(nn.Module):
    """``blocks.<i>.norm1`` squash to ``norm1``; ``norm`` is a top-level name already."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


REFERENCE_NAMES = [
    "norm1.weight",
    "norm1.bias",
    "blocks.0.fc.weight",
    "blocks.0.fc.bias",
    "blocks.1.norm1.weight",
    "blocks.1.norm1.bias",
    "blocks.1.fc.weight",
    "blocks.1.fc.bias",
    "norm.weight",
    "norm.bias",
    "head.weight",
    "head.bias",
]
"""``grad_reduced`` names the reference writes for :class:`Net` (all_xy, wg, squash_name)."""


def test_clashing_parameters_are_named_first_come_as_the_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    forget_warnings(monkeypatch)
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters())
    cfg = {"wg_distribution": True, "mv_distribution": True, "param_distribution": True, "ndigits": 12}
    mon = make_v1(tmp_path, monkeypatch, {**cfg, "xy_distribution": True, "all_xy": True})
    with caplog.at_level("WARNING", logger="trainprobe"):
        mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
        model(torch.randn(3, 4)).pow(2).sum().backward()
        reduced, _ = mon.generate_wgrad_metrics()
        expected = {
            "0:norm1.weight": model.blocks[0].norm1.weight.grad.double().norm().item(),
            "0:blocks.1.norm1.weight": model.blocks[1].norm1.weight.grad.double().norm().item(),
        }
        opt.step()
        opt.zero_grad()
    mon.stop()
    folder = run_dir(tmp_path)
    for name in ("grad_reduced", "grad_unreduced", "exp_avg", "exp_avg_sq", "param_origin", "param_updated"):
        assert [r["name"] for r in table(folder, name)] == REFERENCE_NAMES, name
    rows = table(folder, "grad_reduced")
    for name, norm in expected.items():
        assert float(by_name(rows, name)[0]["norm"]) == pytest.approx(norm, rel=1e-6)
        assert reduced[name]["norm"] == pytest.approx(norm, rel=1e-6)
    assert "these keep their full names: 0:blocks.1.norm1.weight, 0:blocks.1.norm1.bias" in caplog.text
    # modules: both norm1 keep their full names (the reference writes two 'norm1.input' rows)
    actv = {full_name(r) for r in table(folder, "actv")}
    assert {"0:blocks.0.norm1.input", "0:blocks.1.norm1.input", "0:norm.input"} <= actv
    assert "0:norm1.input" not in actv


def test_targets_pick_the_clash_among_monitored_parameters_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As in the reference, a name is taken only by a monitored parameter: with ``targets``
    naming block 1 alone, its norm is squashed (block 0's, not monitored, takes nothing)."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = make_v1(tmp_path, monkeypatch, {"wg_distribution": True, "targets": {"blocks.1": {}}})
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    mon.stop()
    names = [r["name"] for r in table(run_dir(tmp_path), "grad_reduced")]
    assert names == ["norm1.weight", "norm1.bias", "blocks.1.fc.weight", "blocks.1.fc.bias"]


def test_first_come_names_keep_different_parameters_apart() -> None:
    """A full name that is an earlier parameter's squashed name: the earlier one takes its full
    name, so no two parameters share one; squash_name false writes full names."""
    cfg = load_monitor_v1_config({})
    names = ["0:a.layers.0.w", "0:layers.0.w", "0:b.norm.w", "0:c.norm.w", "1:c.norm.w"]
    shown = first_come_names(cfg, names, names)
    assert [shown(n) for n in names] == ["0:a.layers.0.w", "0:layers.0.w", "0:norm.w", "0:c.norm.w", "1:norm.w"]
    assert shown.kept == ("0:a.layers.0.w", "0:c.norm.w")
    plain = first_come_names(load_monitor_v1_config({"squash_name": False}), names, names)
    assert [plain(n) for n in names] == names and plain.kept == ()
