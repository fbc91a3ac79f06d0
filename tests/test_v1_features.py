"""mg_direction, ur_distribution and l2 features against float64 references."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import read_csv
from test_v1_support import by_name, make_v1, run_dir, table


class Core(nn.Module):
    """Attention core taking Q, K, V laid out (s, b, h, d)."""

    def forward(self, q, k, v):
        p = torch.softmax(q.permute(1, 2, 0, 3) @ k.permute(1, 2, 3, 0) / q.shape[-1] ** 0.5, dim=-1)
        return (p @ v.permute(1, 2, 0, 3)).permute(2, 0, 1, 3)


class AttnNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.core = Core()
        self.out = nn.Linear(8, 2)

    def forward(self, x):  # x: (s, b, 8)
        s, b, _ = x.shape
        q, k, v = self.qkv(x).view(s, b, 3, 2, 4).unbind(2)
        return self.out(self.core(q, k, v).reshape(s, b, 8))


def test_l2_linear_and_attention_features(tmp_path, monkeypatch):
    model = AttnNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {
        "recording_l2_features": True,
        "l2_targets": {"attention_hook": ["core"], "linear_hook": []},
        "sa_order": "s,b,h,d",
        "ndigits": 12,
    }
    mon = make_v1(tmp_path, monkeypatch, cfg)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    seen = {}
    model.core.register_forward_hook(lambda m, a, o: seen.update(q=a[0].detach().clone(), k=a[1].detach().clone()))
    w = model.qkv.weight.detach().double().clone()
    model(torch.randn(5, 2, 8)).sum().backward()
    opt.step()
    mon.stop()
    folder = run_dir(tmp_path)
    assert read_csv(folder / "linear_hook_0-0.csv")[0] == ["vpp_stage", "name", "step", "sr", "kernel_norm"]
    lin = table(folder, "linear_hook")
    assert {r["name"] for r in lin} == {"0:qkv", "0:out"}
    sv = torch.linalg.svdvals(w)
    row = by_name(lin, "0:qkv")[0]
    assert float(row["kernel_norm"]) == pytest.approx(sv[0].item(), rel=1e-5)
    assert float(row["sr"]) == pytest.approx((w.norm() / sv[0]).item(), rel=1e-5)
    q, k = seen["q"].double().permute(1, 2, 0, 3), seen["k"].double().permute(1, 2, 0, 3)
    p = torch.softmax(q @ k.transpose(-1, -2) / 2.0, dim=-1)
    (att,) = table(folder, "attention_hook")
    assert att["name"] == "0:core"
    assert float(att["entropy"]) == pytest.approx(-(p * p.log()).sum(-1).mean().item(), rel=1e-5)
    assert float(att["softmax_max"]) == pytest.approx(p.amax(-1).mean().item(), rel=1e-5)


def test_ur_distribution_and_mg_direction(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9), eps=1e-6)
    cfg = {"ur_distribution": True, "mg_direction": True, "ops": ["norm", "mean"], "ndigits": 12}
    mon = make_v1(tmp_path, monkeypatch, cfg)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    for step in range(2):
        model(torch.randn(4, 6)).pow(2).mean().backward()
        if step == 1:
            grad = model.weight.grad.double().clone()
            momentum = opt.state[model.weight]["exp_avg"].double().clone()
        opt.step()
        opt.zero_grad()
    mon.stop()
    folder = run_dir(tmp_path)
    state = opt.state[model.weight]
    m_hat = state["exp_avg"].double() / (1 - 0.8**2)
    root = (state["exp_avg_sq"].double() / (1 - 0.9**2)).sqrt()
    update = by_name([r for r in table(folder, "adam_update") if r["step"] == "1"], "0:weight")[0]
    ratio = by_name([r for r in table(folder, "adam_ratio") if r["step"] == "1"], "0:weight")[0]
    assert float(update["norm"]) == pytest.approx((m_hat / (root + 1e-6)).norm().item(), rel=1e-5)
    assert float(ratio["mean"]) == pytest.approx((m_hat / root).mean().item(), rel=1e-5)
    (mg,) = by_name(table(folder, "other"), "0:weight.mg_direction")
    assert mg["step"] == "1"
    assert float(mg["mean"]) == pytest.approx((grad.sign() == momentum.sign()).double().mean().item())
