"""mg_direction, ur_distribution and l2 features against float64 references."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import read_csv
from test_v1_support import by_name, forget_warnings, full_name, make_v1, run_dir, table
from trainprobe.frontdoors.monitor_v1.histogram import histogram_row


class Core(nn.Module):
    """Attention core taking Q, K, V laid out (s, b, h, d)."""

    def forward(self, q, k, v):
        p = torch.softmax(q.permute(1, 2, 0, 3) @ k.permute(1, 2, 3, 0) / q.shape[-1] ** 0.5, dim=-1)
        return (p @ v.permute(1, 2, 0, 3)).permute(2, 0, 1, 3)


class AttnNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(4, 8)  # 2-D weight, but a lookup: no linear_hook row
        self.qkv = nn.Linear(8, 24)
        self.core = Core()
        self.out = nn.Linear(8, 2)

    def forward(self, x):  # x: (s, b, 8)
        s, b, _ = x.shape
        x = x + self.table(torch.zeros(s, b, dtype=torch.long))
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
    assert {full_name(r) for r in lin} == {"0:qkv.linear", "0:out.linear"}  # the reference's names
    sv = torch.linalg.svdvals(w)
    row = by_name(lin, "0:qkv.linear")[0]
    assert float(row["kernel_norm"]) == pytest.approx(sv[0].item(), rel=1e-5)
    assert float(row["sr"]) == pytest.approx((w.norm() / sv[0]).item(), rel=1e-5)
    q, k = seen["q"].double().permute(1, 2, 0, 3), seen["k"].double().permute(1, 2, 0, 3)
    p = torch.softmax(q @ k.transpose(-1, -2) / 2.0, dim=-1)
    (att,) = table(folder, "attention_hook")
    assert full_name(att) == "0:core"
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
    (mg,) = by_name(table(folder, "other"), "0:weight")
    assert mg["step"] == "1"
    assert float(mg["mean"]) == pytest.approx((grad.sign() == momentum.sign()).double().mean().item())


def _adam_run(tmp_path, monkeypatch, cfg, steps=2):
    """A Linear trained ``steps`` steps with Adam under ``cfg``; returns (model, optimizer)."""
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9), eps=1e-6)
    mon = make_v1(tmp_path, monkeypatch, cfg)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    for _ in range(steps):
        model(torch.randn(4, 6)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    mon.stop()
    return model, opt


def _update_and_ratio(opt, param, t):
    state = opt.state[param]
    m_hat = state["exp_avg"].double() / (1 - 0.8**t)
    root = (state["exp_avg_sq"].double() / (1 - 0.9**t)).sqrt()
    return m_hat / (root + 1e-6), m_hat / root


def test_ur_distribution_histograms_in_tensorboard(tmp_path, monkeypatch):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    cfg = {"ur_distribution": True, "format": "tensorboard", "ops": ["norm", "max"]}
    model, opt = _adam_run(tmp_path, monkeypatch, cfg)
    folder = run_dir(tmp_path)
    acc = event_accumulator.EventAccumulator(
        str(folder), size_guidance={event_accumulator.HISTOGRAMS: 0, event_accumulator.SCALARS: 0}
    )
    acc.Reload()
    assert set(acc.Tags()["histograms"]) == {
        f"0:{p}/rank0/adam_{kind}_histogram" for p in ("weight", "bias") for kind in ("update", "ratio")
    }
    assert {"0:weight/rank0/adam_update_norm", "0:weight/rank0/adam_ratio_max"} <= set(acc.Tags()["scalars"])
    update, ratio = _update_and_ratio(opt, model.weight, 2)
    for tag, ref in (("0:weight/rank0/adam_update_histogram", update), ("0:weight/rank0/adam_ratio_histogram", ratio)):
        events = acc.Histograms(tag)
        assert [e.step for e in events] == [0, 1]
        h = events[-1].histogram_value
        assert h.min == pytest.approx(ref.min().item(), rel=1e-5)
        assert h.max == pytest.approx(ref.max().item(), rel=1e-5)
        assert h.num == ref.numel() == sum(h.bucket)
        assert h.sum == pytest.approx(ref.sum().item(), rel=1e-4, abs=1e-6)
        assert h.sum_squares == pytest.approx(ref.square().sum().item(), rel=1e-5)
        assert len(h.bucket) == len(h.bucket_limit) == 30 and h.bucket_limit[-1] == pytest.approx(h.max)
        expected = torch.histc(ref, bins=30, min=h.min, max=h.max).tolist()
        assert sum(abs(a - b) for a, b in zip(h.bucket, expected)) <= 2  # an element on an edge may move
    scalar = acc.Scalars("0:weight/rank0/adam_update_norm")[-1].value
    assert scalar == pytest.approx(update.norm().item(), rel=1e-5)


def test_ur_distribution_in_csv_has_statistics_only(tmp_path, monkeypatch, caplog):
    forget_warnings(monkeypatch)
    with caplog.at_level("WARNING", logger="trainprobe"):
        _adam_run(tmp_path, monkeypatch, {"ur_distribution": True, "ops": ["norm"]})
    assert "histograms only with format 'tensorboard'" in caplog.text
    names = {p.name for p in run_dir(tmp_path).iterdir()}
    assert {"adam_update_0-0.csv", "adam_ratio_1-1.csv"} <= names
    assert not any("histogram" in n for n in names)


class PlainDescent(torch.optim.Optimizer):
    """A third-party-style optimizer that keeps no per-parameter state at all."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


@pytest.mark.parametrize(
    ("make_opt", "kind"),
    [
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), "SGD"),  # state of another kind
        (lambda ps: torch.optim.SGD(ps, lr=0.1), "SGD"),  # no state at all
        (lambda ps: PlainDescent(ps), "PlainDescent"),  # unknown class, no state after a step
    ],
    ids=["sgd-momentum", "sgd", "stateless"],
)
def test_ur_mv_and_mg_with_a_non_adam_optimizer_warn_and_write_nothing(tmp_path, monkeypatch, caplog, make_opt, kind):
    forget_warnings(monkeypatch)
    model = nn.Linear(6, 3)
    opt = make_opt(model.parameters())
    cfg = {"ur_distribution": True, "mg_direction": True, "mv_distribution": True, "wg_distribution": True}
    mon = make_v1(tmp_path, monkeypatch, cfg)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    with caplog.at_level("WARNING", logger="trainprobe"):
        for _ in range(3):
            model(torch.randn(4, 6)).sum().backward()
            opt.step()
            opt.zero_grad()
    mon.stop()
    assert (
        f"ur_distribution needs an Adam-family optimizer (exp_avg, exp_avg_sq and step in its state, betas in its groups); {kind} has none"
        in caplog.text
    )
    assert f"mg_direction needs an Adam-family optimizer (exp_avg in its state); {kind} has none" in caplog.text
    assert f"optimizer monitor: {kind} keeps no exp_avg/exp_avg_sq state" in caplog.text
    folder = run_dir(tmp_path)
    assert not table(folder, "adam_update") and not table(folder, "other") and not table(folder, "exp_avg")
    assert table(folder, "grad_reduced")


class LateExpert(nn.Module):
    """A shared layer and an expert that is used only from the second step on."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.expert = nn.Linear(4, 4)

    def forward(self, x, use_expert: bool):
        h = self.shared(x)
        return (self.expert(h) if use_expert else h).pow(2).mean()


def test_mv_ur_mg_start_when_a_targeted_layer_gets_its_first_gradient_later(tmp_path, monkeypatch, caplog):
    """No Adam state for the targeted expert at the first step is not an unsupported optimizer:
    the expert has no rows until the optimizer keeps its moments, then every feature writes them."""
    forget_warnings(monkeypatch)
    model = LateExpert()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    cfg = {
        "targets": {"expert": {}},
        "mv_distribution": True,
        "ur_distribution": True,
        "mg_direction": True,
        "ops": ["norm", "nans"],
    }
    mon = make_v1(tmp_path, monkeypatch, cfg)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    with caplog.at_level("WARNING", logger="trainprobe"):
        for step in range(4):
            model(torch.randn(2, 4), use_expert=step > 0).backward()
            opt.step()
            opt.zero_grad()
    mon.stop()
    assert "Adam-family" not in caplog.text and "keeps no" not in caplog.text
    folder = run_dir(tmp_path)
    names = {"0:expert.weight", "0:expert.bias"}
    for name in ("exp_avg", "exp_avg_sq", "adam_update", "adam_ratio"):
        rows = table(folder, name)
        assert {full_name(r) for r in rows} == names, name
        assert sorted({r["step"] for r in rows}) == ["1", "2", "3"], name  # no state at step 0
    mg = table(folder, "other")
    assert {full_name(r) for r in mg} == names
    assert sorted({r["step"] for r in mg}) == ["2", "3"]  # momentum exists from the step after the first update


def test_ur_ratio_of_elements_never_updated_is_zero_and_nan_only_from_the_moments(tmp_path, monkeypatch, capsys):
    """Embedding rows never looked up keep exp_avg = exp_avg_sq = 0: their ratio 0/0 is written as
    0 (no NaN, no alert); a NaN planted in a moment still shows as NaN."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 1))  # rows 5..9 are never used
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.8, 0.9), eps=1e-6)
    cfg = {
        "ur_distribution": True,
        "ops": ["min", "max", "norm", "nans"],
        "ndigits": 12,
        "alert": {"rules": [{"rule_name": "AnomalyNan"}]},
    }
    mon = make_v1(tmp_path, monkeypatch, cfg)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    weight = model[0].weight
    for step in range(3):
        if step == 2:
            opt.state[weight]["exp_avg"][7, 1] = float("nan")  # an unused row: m NaN, v 0
        model(torch.randint(0, 5, (8,))).sum().backward()
        opt.step()
        opt.zero_grad()
        if step == 1:
            update, ratio = _update_and_ratio(opt, weight, 2)
    mon.stop()
    out = capsys.readouterr().out
    alerts = [line for line in out.splitlines() if line.startswith("trainprobe alert")]
    assert len(alerts) == 2 and all("at step 2:" in line for line in alerts)  # only the planted NaN
    assert "/adam_update " in alerts[0] and "/adam_ratio " in alerts[1]
    assert all(line.endswith("nans = 1") for line in alerts)
    assert torch.isnan(ratio).sum() >= 5 * 4  # the naive m̂/√v̂ of the unused rows is 0/0
    expected = torch.where(ratio.isnan(), torch.zeros_like(ratio), ratio)
    folder = run_dir(tmp_path)
    at_1 = {full_name(r): r for r in table(folder, "adam_ratio") if r["step"] == "1"}
    assert at_1["0:0.weight"]["nans"] == "0"
    assert float(at_1["0:0.weight"]["norm"]) == pytest.approx(expected.norm().item(), rel=1e-6)
    assert float(at_1["0:0.weight"]["min"]) == pytest.approx(expected.min().item(), rel=1e-6)
    upd_1 = by_name([r for r in table(folder, "adam_update") if r["step"] == "1"], "0:0.weight")[0]
    assert float(upd_1["norm"]) == pytest.approx(update.norm().item(), rel=1e-6) and upd_1["nans"] == "0"
    at_2 = by_name([r for r in table(folder, "adam_ratio") if r["step"] == "2"], "0:0.weight")[0]
    assert at_2["nans"] == "1" and at_2["norm"] == "nan"


@pytest.mark.parametrize("ops", [None, ["min", "max", "mean", "norm", "nans", "zeros"]], ids=["default-ops", "all-ops"])
def test_mg_direction_row_holds_the_fraction_whatever_the_ops(tmp_path, monkeypatch, ops):
    """Every op column of an mg_direction row is a statistic of the fraction of agreeing signs
    (default ops: just norm), not of the 0/1 mask (whose norm would be √count)."""
    torch.manual_seed(0)
    model = nn.Linear(16, 4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    cfg = {"mg_direction": True, "ndigits": 12} | ({"ops": ops} if ops else {})
    mon = make_v1(tmp_path, monkeypatch, cfg)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    for step in range(2):
        model(torch.randn(8, 16)).pow(2).sum().backward()
        if step == 1:
            g, m = model.weight.grad, opt.state[model.weight]["exp_avg"]
            fraction = (g.sign() == m.sign()).double().mean().item()
        opt.step()
        opt.zero_grad()
    mon.stop()
    assert 0 < fraction < 1
    (row,) = by_name(table(run_dir(tmp_path), "other"), "0:weight")
    expected = {"min": fraction, "max": fraction, "mean": fraction, "norm": fraction, "nans": 0, "zeros": 0}
    for op in ops or ["norm"]:
        assert float(row[op]) == pytest.approx(expected[op], abs=1e-12), op


def test_histogram_row_leaves_out_non_finite_values():
    row = histogram_row(torch.tensor([1.0, 2.0, float("nan"), 3.0, float("inf"), -1.0]), bins=4)
    assert row[:5] == pytest.approx([-1.0, 3.0, 4.0, 5.0, 15.0])
    assert row[5:] == [1.0, 0.0, 1.0, 2.0]
    assert histogram_row(torch.full((5,), 2.0), bins=3)[:3] == [2.0, 2.0, 5.0]
    assert histogram_row(torch.tensor([float("nan")]), bins=3)[2] == 0.0


@pytest.mark.parametrize("order", ["s,b,h,d", "b,s,h,d"])
def test_attention_sa_order_and_listed_linear_layers(tmp_path, monkeypatch, order):
    """Q, K laid out per sa_order give the same features as the float64 reference; an explicit
    linear_hook list hooks only the listed layers."""

    class Core(nn.Module):
        def forward(self, q, k):
            return q + k

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qk = nn.Linear(8, 16)
            self.core = Core()
            self.out = nn.Linear(8, 2)

        def forward(self, x):
            q, k = self.qk(x).view(*x.shape[:2], 2, 2, 4).unbind(2)
            return self.out(self.core(q, k).flatten(2))

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {
        "recording_l2_features": True,
        "l2_targets": {"attention_hook": ["0:core"], "linear_hook": ["out"]},
        "sa_order": order,
        "ndigits": 12,
    }
    mon = make_v1(tmp_path, monkeypatch, cfg)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    seen = {}
    model.core.register_forward_hook(lambda m, a, o: seen.update(q=a[0].detach().clone(), k=a[1].detach().clone()))
    model(torch.randn(5, 3, 8)).sum().backward()
    opt.step()
    mon.stop()
    folder = run_dir(tmp_path)
    assert {full_name(r) for r in table(folder, "linear_hook")} == {"0:out.linear"}
    perm = (1, 2, 0, 3) if order == "s,b,h,d" else (0, 2, 1, 3)
    q, k = seen["q"].double().permute(*perm), seen["k"].double().permute(*perm)
    p = torch.softmax(q @ k.transpose(-1, -2) / 2.0, dim=-1)
    (att,) = table(folder, "attention_hook")
    assert float(att["entropy"]) == pytest.approx(-(p * p.log()).sum(-1).mean().item(), rel=1e-5)
    assert float(att["softmax_max"]) == pytest.approx(p.amax(-1).mean().item(), rel=1e-5)
