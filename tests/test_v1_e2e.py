"""Monitor V1 end to end on real models: output layout, values, every collection field."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

from conftest import read_csv, stats64
from models import MLP, TinyTransformer, no_hooks_left
from test_v1_support import by_name, forget_warnings, full_name, make_v1, run_dir, table
from trainprobe.engine.errors import ConfigError

ALL_OPS = ["min", "max", "norm", "mean", "zeros", "nans"]
FULL = {
    "targets": {},
    "xy_distribution": True,
    "all_xy": True,
    "wg_distribution": True,
    "mv_distribution": True,
    "param_distribution": True,
    "ops": ALL_OPS,
    "ndigits": 12,
}


def train(model, opt, steps, micro=1, data=None):
    for s in range(steps):
        for _ in range(micro):
            x = data[s] if data is not None else torch.randn(4, 6)
            model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def close(row, ref, rel=1e-6):
    for op in ("min", "max", "norm", "mean"):
        if op in row:
            assert float(row[op]) == pytest.approx(ref[op], rel=rel, abs=1e-11), (row["name"], op)


def test_folder_files_headers_and_rounding(tmp_path, monkeypatch):
    model, opt = MLP(), torch.optim.Adam(MLP().parameters())
    opt = torch.optim.Adam(model.parameters())
    mon = make_v1(tmp_path, monkeypatch, {**FULL, "ndigits": 3, "mg_direction": True})
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    train(model, opt, 2)
    mon.stop()
    folder = run_dir(tmp_path)
    assert re.fullmatch(r"[A-Z][a-z]{2}\d{2}_\d{2}-\d{2}-\d{2}-rank0-[0-9a-f]{8}", folder.name)
    names = {p.name for p in folder.iterdir()}
    for kind in (
        "actv",
        "actv_grad",
        "grad_unreduced",
        "grad_reduced",
        "exp_avg",
        "exp_avg_sq",
        "param_origin",
        "param_updated",
    ):
        assert {f"{kind}_0-0.csv", f"{kind}_1-1.csv"} <= names
    assert "other_1-1.csv" in names  # mg_direction needs the momentum of step 0
    trailing = ["shape", "dtype"]
    assert read_csv(folder / "actv_0-0.csv")[0] == ["vpp_stage", "name", "step", "micro_step", *ALL_OPS, *trailing]
    assert read_csv(folder / "grad_reduced_0-0.csv")[0] == ["vpp_stage", "name", "step", *ALL_OPS, *trailing]
    assert read_csv(folder / "grad_unreduced_0-0.csv")[0] == ["vpp_stage", "name", "step", *ALL_OPS, *trailing]
    assert read_csv(folder / "other_1-1.csv")[0] == ["vpp_stage", "name", "step", *ALL_OPS, *trailing]
    for row in table(folder, "grad_reduced"):
        for op in ("min", "max", "norm", "mean"):
            assert len(row[op].split(".")[-1]) <= 3
    # the name column has no chunk prefix (vpp_stage is its own column), the root module's name is
    # empty and gradient rows have the names of their tensors (the file says they are gradients)
    names = {r["name"] for r in table(folder, "actv")}
    assert {".input", ".output", "fc1.input", "fc1.output", "act.output", "fc2.output"} <= names
    assert {"fc2.input", "fc2.output", ".output"} <= {r["name"] for r in table(folder, "actv_grad")}
    assert {r["name"] for r in table(folder, "other")} == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    fc1 = by_name(table(folder, "actv"), "0:fc1.output")[0]
    assert (fc1["shape"], fc1["dtype"]) == ("[4, 16]", "torch.float32")
    fc1_grad = by_name(table(folder, "actv_grad"), "0:fc1.output")[0]
    assert (fc1_grad["shape"], fc1_grad["dtype"]) == ("[4, 16]", "torch.float32")
    weight = by_name(table(folder, "exp_avg"), "0:fc1.weight")[0]
    assert (weight["shape"], weight["dtype"]) == ("[16, 6]", "torch.float32")
    assert [(r["shape"], r["dtype"]) for r in table(folder, "other")][0] == ("[]", "torch.float64")


def test_values_match_float64_reference(tmp_path, monkeypatch):
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    mon = make_v1(tmp_path, monkeypatch, FULL)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    seen = {}
    model.fc1.register_forward_hook(lambda m, a, o: seen.update(x=a[0].detach().clone(), h=o.detach().clone()))
    train(model, opt, 1)
    before = model.fc2.weight.detach().clone()
    model(torch.randn(4, 6)).pow(2).mean().backward()
    grad = model.fc2.weight.grad.clone()
    x, h = seen["x"], seen["h"]
    opt.step()
    opt.zero_grad()
    mon.stop()
    folder = run_dir(tmp_path)
    step1 = lambda rows: [r for r in rows if r["step"] == "1"]  # noqa: E731
    close(by_name(step1(table(folder, "grad_reduced")), "0:fc2.weight")[0], stats64(grad))
    close(by_name(step1(table(folder, "grad_unreduced")), "0:fc2.weight")[0], stats64(grad))
    close(by_name(step1(table(folder, "param_origin")), "0:fc2.weight")[0], stats64(before))
    close(by_name(step1(table(folder, "param_updated")), "0:fc2.weight")[0], stats64(model.fc2.weight))
    state = opt.state[model.fc2.weight]
    close(by_name(step1(table(folder, "exp_avg")), "0:fc2.weight")[0], stats64(state["exp_avg"]))
    close(by_name(step1(table(folder, "exp_avg_sq")), "0:fc2.weight")[0], stats64(state["exp_avg_sq"]))
    close(by_name(step1(table(folder, "actv")), "0:fc1.input")[0], stats64(x))
    close(by_name(step1(table(folder, "actv")), "0:fc1.output")[0], stats64(h))
    zeros = by_name(step1(table(folder, "actv")), "0:act.output")[0]
    assert float(zeros["zeros"]) == pytest.approx((torch.relu(h).abs() < 1e-8).double().mean().item())


class Pair(nn.Module):
    """Returns a tuple (y, y * 2)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        y = self.lin(x)
        return y, y * 2


class PairNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pair = Pair()
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        a, b = self.pair(x)
        return self.head(a + b)


def test_targets_pick_modules_elements_and_parameters(tmp_path, monkeypatch):
    model = PairNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {
        "targets": {"pair": {"input": "tensor", "output": "tuple[2]:1", "output_grad": "tuple[2]:0"}},
        "xy_distribution": True,
        "wg_distribution": True,
        "ops": ["norm"],
        "ndigits": 12,
    }
    mon = make_v1(tmp_path, monkeypatch, cfg)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    out = {}
    model.pair.register_forward_hook(lambda m, a, o: out.update(b=o[1].detach().clone()))
    train(model, opt, 1)
    mon.stop()
    folder = run_dir(tmp_path)
    actv = table(folder, "actv")
    assert {full_name(r) for r in actv} == {"0:pair.input", "0:pair.output"}
    assert float(by_name(actv, "0:pair.output")[0]["norm"]) == pytest.approx(out["b"].double().norm().item(), rel=1e-6)
    assert {full_name(r) for r in table(folder, "actv_grad")} == {"0:pair.output"}
    assert {full_name(r) for r in table(folder, "grad_reduced")} == {"0:pair.lin.weight", "0:pair.lin.bias"}


@pytest.mark.parametrize(
    ("flags", "actv", "grad"),
    [({"forward_only": True}, True, False), ({"backward_only": True}, False, True), ({}, True, True)],
)
def test_forward_only_and_backward_only(tmp_path, monkeypatch, flags, actv, grad):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = make_v1(tmp_path, monkeypatch, {"xy_distribution": True, "all_xy": True, **flags})
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    train(model, opt, 1)
    mon.stop()
    folder = run_dir(tmp_path)
    assert bool(table(folder, "actv")) is actv
    assert bool(table(folder, "actv_grad")) is grad


def test_forward_and_backward_only_warns_and_collects_nothing(tmp_path, monkeypatch, caplog):
    forget_warnings(monkeypatch)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"xy_distribution": True, "all_xy": True, "forward_only": True, "backward_only": True}
    mon = make_v1(tmp_path, monkeypatch, cfg)
    with caplog.at_level("WARNING", logger="trainprobe"):
        mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
        train(model, opt, 1)
    mon.stop()
    assert "forward_only and backward_only are both true" in caplog.text
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*/actv*"))


def test_step_window_and_records(tmp_path, monkeypatch):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"wg_distribution": True, "start_step": 1, "step_interval": 2, "collect_times": 3, "step_count_per_record": 2}
    mon = make_v1(tmp_path, monkeypatch, cfg)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    train(model, opt, 9)
    mon.stop()
    folder = run_dir(tmp_path)
    # windows of 2 steps counted from step 0, as the reference's V1 writer cuts them
    names = sorted(p.name for p in folder.glob("grad_reduced_*"))
    assert names == ["grad_reduced_0-1.csv", "grad_reduced_2-3.csv", "grad_reduced_4-5.csv"]
    assert sorted({r["step"] for r in table(folder, "grad_reduced")}) == ["1", "3", "5"]
    assert no_hooks_left(model, opt)


def test_start_iteration_shifts_steps(tmp_path, monkeypatch):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = make_v1(tmp_path, monkeypatch, {"wg_distribution": True, "start_step": 10})
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt, start_iteration=9)
    train(model, opt, 2)
    mon.stop()
    assert sorted({r["step"] for r in table(run_dir(tmp_path), "grad_reduced")}) == ["10"]


def test_monitor_mbs_grad_rows_per_micro_batch(tmp_path, monkeypatch):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = make_v1(tmp_path, monkeypatch, {"wg_distribution": True, "monitor_mbs_grad": True, "ndigits": 12})
    mon.set_monitor(model, grad_acc_steps=3, optimizer=opt)
    grads = []
    for _ in range(3):
        before = model.fc2.bias.grad.clone() if model.fc2.bias.grad is not None else torch.zeros(3)
        model(torch.randn(4, 6)).pow(2).mean().backward()
        grads.append(model.fc2.bias.grad - before)
    opt.step()
    mon.stop()
    folder = run_dir(tmp_path)
    assert read_csv(folder / "grad_unreduced_0-0.csv")[0][:4] == ["vpp_stage", "name", "step", "micro_step"]
    rows = by_name(table(folder, "grad_unreduced"), "0:fc2.bias")
    assert [r["micro_step"] for r in rows] == ["0", "1", "2"]
    for row, g in zip(rows, grads):
        assert float(row["norm"]) == pytest.approx(g.double().norm().item(), rel=1e-6)


def run_transformer(steps, monitor_factory=None):
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = monitor_factory() if monitor_factory else None
    if mon is not None:
        mon.set_monitor(model, grad_acc_steps=2, optimizer=opt)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        for _ in range(2):
            loss = model.loss(torch.randint(0, 50, (2, 8), generator=gen))
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    if mon is not None:
        mon.stop()
    return losses, model, opt


@pytest.mark.parametrize("mbs", [True, False])  # per-parameter gradient hooks / backward-end capture
def test_monitoring_does_not_change_training_bitwise(tmp_path, monkeypatch, mbs):
    cfg = {**FULL, "mg_direction": True, "stack_info": True, "monitor_mbs_grad": mbs, "ur_distribution": True}
    ref_losses, ref_model, _ = run_transformer(3)
    losses, model, opt = run_transformer(3, lambda: make_v1(tmp_path, monkeypatch, cfg))
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    for (name, a), (_, b) in zip(ref_model.named_parameters(), model.named_parameters()):
        assert torch.equal(a, b), name
    assert table(run_dir(tmp_path), "actv")
    assert no_hooks_left(model, opt)


def test_main_grad_is_read_where_it_exists(tmp_path, monkeypatch):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = make_v1(tmp_path, monkeypatch, {"wg_distribution": True, "ndigits": 12})
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    model(torch.randn(4, 6)).sum().backward()
    model.fc1.weight.main_grad = torch.full_like(model.fc1.weight, 3.0)  # Megatron keeps fp32 grads here
    opt.step()
    mon.stop()
    rows = table(run_dir(tmp_path), "grad_reduced")
    assert float(by_name(rows, "0:fc1.weight")[0]["norm"]) == pytest.approx(3.0 * model.fc1.weight.numel() ** 0.5)
    assert float(by_name(rows, "0:fc2.weight")[0]["norm"]) == pytest.approx(
        model.fc2.weight.grad.double().norm().item()
    )


class Wrapper:
    """DeepSpeed/accelerate style: the real optimizer is in .optimizer."""

    def __init__(self, inner):
        self.optimizer = inner

    def step(self):
        self.optimizer.step()

    def zero_grad(self):
        self.optimizer.zero_grad()


class Chain:
    """Megatron ChainedOptimizer style."""

    def __init__(self, *optimizers):
        self.chained_optimizers = [Wrapper(o) for o in optimizers]

    def step(self):
        for o in self.chained_optimizers:
            o.step()

    def zero_grad(self):
        for o in self.chained_optimizers:
            o.zero_grad()


@pytest.mark.parametrize("kind", ["wrapper", "chain"])
def test_wrapped_and_chained_optimizers(tmp_path, monkeypatch, kind):
    model = MLP()
    if kind == "wrapper":
        opt = Wrapper(torch.optim.Adam(model.parameters()))
    else:
        opt = Chain(torch.optim.Adam(model.fc1.parameters()), torch.optim.Adam(model.fc2.parameters()))
    mon = make_v1(tmp_path, monkeypatch, {"wg_distribution": True, "mv_distribution": True, "param_distribution": True})
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    train(model, opt, 2)
    mon.stop()
    folder = run_dir(tmp_path)
    for kind_ in ("grad_reduced", "exp_avg", "param_updated"):
        rows = table(folder, kind_)
        assert {full_name(r) for r in rows} == {"0:fc1.weight", "0:fc1.bias", "0:fc2.weight", "0:fc2.bias"}, kind_
        assert {r["step"] for r in rows} == {"0", "1"}


def test_api_format_keeps_metrics_in_memory(tmp_path, monkeypatch):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {**FULL, "format": "api"}
    mon = make_v1(tmp_path, monkeypatch, cfg)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    out = {}
    model.fc1.register_forward_hook(lambda m, a, o: out.update(h=o.detach().clone()))
    model(torch.randn(4, 6)).pow(2).mean().backward()
    reduced, unreduced = mon.generate_wgrad_metrics()
    g = model.fc2.weight.grad.double()
    assert reduced["0:fc2.weight"]["norm"] == pytest.approx(g.norm().item(), rel=1e-6)
    assert unreduced["0:fc2.weight"]["max"] == pytest.approx(g.max().item(), rel=1e-6)
    actv, actv_grad = mon.generate_xy_metrics()
    assert actv["0:fc1.output:0"]["mean"] == pytest.approx(out["h"].double().mean().item(), rel=1e-6)
    assert "0:fc1.output:0" in actv_grad
    opt.step()
    opt.zero_grad()
    actv_after, _ = mon.generate_xy_metrics()  # the latest collected step, from memory
    assert actv_after["0:fc1.output:0"] == pytest.approx(actv["0:fc1.output:0"])
    mon.stop()
    assert not (tmp_path / "out").exists()


def test_tensorboard_format_writes_events(tmp_path, monkeypatch):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = make_v1(tmp_path, monkeypatch, {**FULL, "format": "tensorboard", "ops": ["norm", "max"]})
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    train(model, opt, 2)
    mon.stop()
    folder = run_dir(tmp_path)
    assert not list(folder.glob("*.csv"))
    acc = event_accumulator.EventAccumulator(str(folder))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert "0:fc1.output:0/rank0/actv_norm" in tags
    assert "0:fc1.output:0/rank0/actv_grad_norm" in tags
    assert "0:.input:0/rank0/actv_norm" in tags  # the root module's name is empty
    assert "0:fc1.weight/rank0/post_grad_max" in tags
    assert "0:fc1.weight/rank0/acc_grad_max" in tags
    assert "0:fc1.weight/rank0/param_updated_norm" in tags
    assert [e.step for e in acc.Scalars("0:fc1.weight/rank0/post_grad_norm")] == [0, 1]


def test_reload_xy_and_ops_take_effect_next_step(tmp_path, monkeypatch):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = make_v1(tmp_path, monkeypatch, {"wg_distribution": True, "all_xy": True, "ops": ["norm"]})
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    train(model, opt, 1)
    mon.reload_xy(xy_distribution=True)
    mon.ops = ["min", "max"]
    assert mon.ops == ("min", "max")
    train(model, opt, 2)
    mon.reload_xy(False)
    train(model, opt, 1)
    mon.stop()
    folder = run_dir(tmp_path)
    assert sorted({r["step"] for r in table(folder, "actv")}) == ["1", "2"]
    assert read_csv(folder / "grad_reduced_0-0.csv")[0][-3:] == ["norm", "shape", "dtype"]
    assert read_csv(folder / "grad_reduced_1-1.csv")[0][-4:] == ["min", "max", "shape", "dtype"]
    with pytest.raises(ConfigError, match=r"ops\[0\]: 'nrom' is not one of"):
        mon.ops = ["nrom"]


def test_a_session_started_inside_a_window_names_its_file_from_its_first_step(tmp_path, monkeypatch):
    """With step_count_per_record 4, an ops change made in step 0 starts a new session at step 1,
    inside the window 0-3: its file is ``*_1-3.csv``, beside the first session's ``*_0-3.csv``
    (named by its whole window, holding step 0 only), never a second ``*_0-3.csv``."""
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"wg_distribution": True, "ops": ["norm"], "step_count_per_record": 4}
    mon = make_v1(tmp_path, monkeypatch, cfg)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    train(model, opt, 1)
    mon.ops = ["max"]  # from the next step on
    train(model, opt, 7)
    mon.stop()
    names = sorted(p.name for p in run_dir(tmp_path).glob("grad_reduced_*.csv"))
    assert names == ["grad_reduced_0-3.csv", "grad_reduced_1-3.csv", "grad_reduced_4-7.csv"]
    assert sorted({r["step"] for r in read_csv(run_dir(tmp_path) / "grad_reduced_0-3.csv")[1]}) == ["0"]
    assert sorted({r["step"] for r in read_csv(run_dir(tmp_path) / "grad_reduced_1-3.csv")[1]}) == ["1", "2", "3"]


def test_legacy_api_warns_once_and_works(tmp_path, monkeypatch, caplog):
    forget_warnings(monkeypatch)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mon = make_v1(tmp_path, monkeypatch, {"wg_distribution": True}, opt_ty="Megatron_DistributedOptimizer")
        mon.set_wrapped_optimizer(opt)
        mon.monitor_gnorm_with_ad(model, grad_acc_steps=1)
    assert {str(w.message).split(";")[0] for w in caught if w.category is DeprecationWarning} == {
        "TrainerMon(opt_ty=...) is deprecated and ignored",
        "TrainerMon.set_wrapped_optimizer() is deprecated",
        "TrainerMon.monitor_gnorm_with_ad() is deprecated",
    }
    with pytest.warns(DeprecationWarning):
        mon.set_wrapped_optimizer(opt)  # a second call: no second log line
    train(model, opt, 1)
    mon.stop()
    assert table(run_dir(tmp_path), "grad_reduced")
    assert caplog.text.count("set_wrapped_optimizer() is deprecated") == 1


def test_append_output_continues_existing_folder(tmp_path, monkeypatch):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = make_v1(tmp_path, monkeypatch, {"wg_distribution": True, "collect_times": 2})
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    train(model, opt, 2)
    mon.stop()
    folder = run_dir(tmp_path)
    stamp = folder.name.split("-rank")[0]
    cfg = {"wg_distribution": True, "start_step": 2, "append_output": [stamp, stamp]}
    mon2 = make_v1(tmp_path, monkeypatch, cfg)
    mon2.set_monitor(model, grad_acc_steps=1, optimizer=opt, start_iteration=2)
    train(model, opt, 1)
    mon2.stop()
    assert run_dir(tmp_path) == folder
    assert sorted({r["step"] for r in table(folder, "grad_reduced")}) == ["0", "1", "2"]


class Deep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Module()
        self.module.encoder = nn.Module()
        self.module.encoder.layers = nn.ModuleList([nn.Linear(6, 6)])

    def forward(self, x):
        return self.module.encoder.layers[0](x)


@pytest.mark.parametrize(("squash", "name"), [(True, "0:layers.0"), (False, "0:module.encoder.layers.0")])
def test_squash_name(tmp_path, monkeypatch, squash, name):
    """Parameter and module names are squashed alike; targets match the squashed name too."""
    model = Deep()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    target = "layers.0" if squash else "module.encoder.layers.0"
    cfg = {"wg_distribution": True, "xy_distribution": True, "targets": {target: {}}, "squash_name": squash}
    mon = make_v1(tmp_path, monkeypatch, cfg)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    train(model, opt, 1)
    mon.stop()
    folder = run_dir(tmp_path)
    assert {full_name(r) for r in table(folder, "grad_reduced")} == {f"{name}.weight", f"{name}.bias"}
    assert {full_name(r) for r in table(folder, "actv")} == {f"{name}.input", f"{name}.output"}


def test_xy_without_all_xy_or_module_targets_warns(tmp_path, monkeypatch, caplog):
    forget_warnings(monkeypatch)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = make_v1(tmp_path, monkeypatch, {"xy_distribution": True, "wg_distribution": True})
    with caplog.at_level("WARNING", logger="trainprobe"):
        mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    train(model, opt, 1)
    mon.stop()
    assert 'xy_distribution is true but no module is selected: set "all_xy": true' in caplog.text
    assert not table(run_dir(tmp_path), "actv") and table(run_dir(tmp_path), "grad_reduced")


def test_model_chunks_and_module_ranks(tmp_path, monkeypatch):
    chunks = [MLP(), MLP(d_in=3)]
    opt = torch.optim.SGD([p for c in chunks for p in c.parameters()], lr=0.1)
    mon = make_v1(tmp_path, monkeypatch, {"xy_distribution": True, "all_xy": True, "wg_distribution": True})
    mon.set_monitor(chunks, grad_acc_steps=1, optimizer=opt)
    chunks[1](chunks[0](torch.randn(4, 6))).sum().backward()
    opt.step()
    mon.stop()
    folder = run_dir(tmp_path)
    rows = table(folder, "grad_reduced")
    assert {(r["vpp_stage"], r["name"]) for r in rows} >= {("0", "fc1.weight"), ("1", "fc1.weight")}
    assert {"0:fc1.output", "1:fc1.output"} <= {full_name(r) for r in table(folder, "actv")}
    mon2 = make_v1(tmp_path / "b", monkeypatch, {"xy_distribution": True, "all_xy": True, "module_ranks": [1]})
    mon2.set_monitor(chunks, grad_acc_steps=1, optimizer=opt)
    chunks[1](chunks[0](torch.randn(4, 6))).sum().backward()
    opt.step()
    mon2.stop()
    assert not (tmp_path / "b" / "out").exists()


def test_stack_info(tmp_path, monkeypatch):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = make_v1(tmp_path, monkeypatch, {"stack_info": True})
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    train(model, opt, 2)
    mon.stop()
    header, rows = read_csv(run_dir(tmp_path) / "stack_info.csv")
    assert header == ["module_name", "stack_info"]
    assert {r["module_name"] for r in rows} == {"0:", "0:fc1", "0:act", "0:fc2"}
    assert all("test_v1_e2e.py" in r["stack_info"] for r in rows)


def test_set_monitor_bad_arguments(tmp_path, monkeypatch):
    model = MLP()
    mon = make_v1(tmp_path, monkeypatch, {"wg_distribution": True})
    with pytest.raises(ConfigError, match="optimizer is required"):
        mon.set_monitor(model, grad_acc_steps=1, optimizer=None)
    with pytest.raises(ConfigError, match=r"grad_acc_steps=...\): must be an integer >= 1"):
        mon.set_monitor(model, grad_acc_steps=0, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ConfigError, match="expected a torch.optim.Optimizer"):
        mon.set_monitor(model, grad_acc_steps=1, optimizer=object())


def test_params_have_main_grad_plain_pytorch_and_fault_isolation(tmp_path, monkeypatch, caplog):
    """A failing statistic disables that monitor once; training goes on."""
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = make_v1(tmp_path, monkeypatch, {"wg_distribution": True, "param_distribution": True})
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    probe = next(p for p in mon._control.probes if p.name == "param")
    probe.stats.rows = lambda ts: 1 / 0  # a fault inside the monitor
    with caplog.at_level("ERROR", logger="trainprobe"):
        train(model, opt, 2)
    mon.stop()
    assert caplog.text.count("the param monitor failed") == 1
    assert table(run_dir(tmp_path), "grad_reduced")


def test_compat_import_path():
    from trainprobe.frontdoors.monitor_v1 import TrainerMon
    from trainprobe.pytorch.monitor.module_hook import TrainerMon as Compat

    assert Compat is TrainerMon


def test_public_import_paths():
    import trainprobe
    import trainprobe.pytorch
    from trainprobe.frontdoors.monitor_v1 import TrainerMon

    assert trainprobe.TrainerMon is TrainerMon and trainprobe.pytorch.TrainerMon is TrainerMon


def test_parameter_name_target_selects_that_parameter(tmp_path, monkeypatch):
    model = MLP()
    opt = torch.optim.Adam(model.parameters())
    cfg = {"targets": {"fc1.weight": {}, "0:fc2": {}}, "wg_distribution": True, "mv_distribution": True}
    mon = make_v1(tmp_path, monkeypatch, cfg)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    train(model, opt, 1)
    mon.stop()
    folder = run_dir(tmp_path)
    for kind in ("grad_reduced", "grad_unreduced", "exp_avg"):
        assert {full_name(r) for r in table(folder, kind)} == {"0:fc1.weight", "0:fc2.weight", "0:fc2.bias"}, kind


def test_all_xy_with_targets_keeps_the_targets_choice(tmp_path, monkeypatch):
    """all_xy hooks every module; a module named in targets keeps only what its entry lists."""
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"targets": {"fc1": {"output": "tensor"}}, "xy_distribution": True, "all_xy": True}
    mon = make_v1(tmp_path, monkeypatch, cfg)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    train(model, opt, 1)
    mon.stop()
    folder = run_dir(tmp_path)
    actv = {full_name(r) for r in table(folder, "actv")}
    grads = {full_name(r) for r in table(folder, "actv_grad")}
    assert "0:fc1.output" in actv and "0:fc1.input" not in actv
    assert not any(n.startswith("0:fc1.") for n in grads)
    assert {"0:fc2.input", "0:fc2.output"} <= actv and {"0:fc2.input", "0:fc2.output"} <= grads


def test_default_output_dir_is_monitor_output(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MONITOR_OUTPUT_DIR", raising=False)
    (tmp_path / "c.json").write_text('{"wg_distribution": true}')
    from trainprobe.frontdoors.monitor_v1 import TrainerMon

    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon("c.json", params_have_main_grad=False)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    train(model, opt, 1)
    mon.stop()
    (folder,) = (tmp_path / "monitor_output").iterdir()
    assert mon.output_dir is not None and mon.output_dir.resolve() == folder.resolve()
    assert (folder / "grad_reduced_0-0.csv").exists()


def test_eps_sets_the_zeros_threshold(tmp_path, monkeypatch):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = make_v1(tmp_path, monkeypatch, {"param_distribution": True, "ops": ["zeros"], "eps": 0.1, "ndigits": 12})
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    train(model, opt, 1)
    mon.stop()
    (row,) = by_name(table(run_dir(tmp_path), "param_origin"), "0:fc1.weight")
    expected = (model.fc1.weight.abs() < 0.1).double().mean().item()
    assert float(row["zeros"]) == pytest.approx(expected) and 0 < expected < 1


def test_ops_set_before_set_monitor_apply_from_the_first_step(tmp_path, monkeypatch):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = make_v1(tmp_path, monkeypatch, {"wg_distribution": True})
    mon.ops = ["max"]
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    train(model, opt, 1)
    mon.stop()
    header = read_csv(run_dir(tmp_path) / "grad_reduced_0-0.csv")[0]
    assert header == ["vpp_stage", "name", "step", "max", "shape", "dtype"]


def test_tensorboard_missing_is_a_config_error_not_a_fallback(tmp_path, monkeypatch):
    import sys

    # as if tensorboard were not installed: the one event writer imports its EventFileWriter
    monkeypatch.setitem(sys.modules, "tensorboard.summary.writer.event_file_writer", None)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = make_v1(tmp_path, monkeypatch, {"wg_distribution": True, "format": "tensorboard"})
    with pytest.raises(ConfigError, match=r"format: 'tensorboard' needs the tensorboard package"):
        mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    assert no_hooks_left(model, opt)
    assert not list((tmp_path / "out").glob("*/*.csv"))


def test_append_output_rank_without_a_folder_in_range_starts_a_new_one(tmp_path, monkeypatch, caplog):
    """Ranks with no folder in the range are not continued: they write to a new folder (one
    warning); other ranks' folders are left alone."""
    forget_warnings(monkeypatch)
    other = tmp_path / "out" / "Dec03_21-34-40-rank1-abcdef01"  # only rank 1 of the earlier run is in range
    other.mkdir(parents=True)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"wg_distribution": True, "append_output": ["Dec03_21-34-40", "Dec03_21-34-41"]}
    mon = make_v1(tmp_path, monkeypatch, cfg)
    with caplog.at_level("WARNING", logger="trainprobe"):
        mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
        train(model, opt, 2)
    mon.stop()
    folder = run_dir(tmp_path)
    assert folder != other and mon.output_dir == folder and not list(other.iterdir())
    assert sorted({r["step"] for r in table(folder, "grad_reduced")}) == ["0", "1"]
    assert caplog.text.count("append_output: no folder of rank 0") == 1
    assert "this rank is not continued and writes to a new folder" in caplog.text


def test_append_output_with_an_impossible_date_is_a_config_error(tmp_path, monkeypatch):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"wg_distribution": True, "append_output": ["Feb30_00-00-00", "Mar01_00-00-01"]}
    mon = make_v1(tmp_path, monkeypatch, cfg)
    with pytest.raises(ConfigError, match=r"append_output\[0\]: 'Feb30_00-00-00' is not a valid timestamp"):
        mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    assert no_hooks_left(model, opt)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        return self.norm(self.mlp(x))


class Stacked(nn.Module):
    """``layers.<i>.norm`` all squash to ``norm``; ``encoder.final_ln`` squashes to ``final_ln``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.encoder = nn.Module()
        self.encoder.final_ln = nn.Linear(4, 4)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.encoder.final_ln(x)


def test_squash_name_keeps_different_objects_apart(tmp_path, monkeypatch, caplog):
    """Parameters that squashing would merge: the first keeps the squashed name, the later
    ones their full names, as the reference names them; modules that would merge keep their full
    names (one warning per kind); other names are still squashed, and targets still match the
    squashed names."""
    forget_warnings(monkeypatch)
    model = Stacked()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"wg_distribution": True, "xy_distribution": True, "targets": {"norm": {}, "final_ln": {}}, "ndigits": 12}
    mon = make_v1(tmp_path, monkeypatch, cfg)
    with caplog.at_level("WARNING", logger="trainprobe"):
        mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
        model(torch.randn(2, 4)).pow(2).sum().backward()
        reduced, _ = mon.generate_wgrad_metrics()
        expected = model.layers[1].norm.weight.grad.norm().item()
        opt.step()
        opt.zero_grad()
    mon.stop()
    norms = ["0:norm.weight", "0:norm.bias", "0:layers.1.norm.weight", "0:layers.1.norm.bias"]
    assert set(reduced) == {*norms, "0:final_ln.weight", "0:final_ln.bias"}
    assert reduced["0:layers.1.norm.weight"]["norm"] == pytest.approx(expected)
    folder = run_dir(tmp_path)
    rows = table(folder, "grad_reduced")
    assert sorted(full_name(r) for r in rows) == sorted({*norms, "0:final_ln.weight", "0:final_ln.bias"})
    actv = {full_name(r) for r in table(folder, "actv")}
    assert actv == {f"0:layers.{i}.norm.{k}" for i in (0, 1) for k in ("input", "output")} | {
        "0:final_ln.input",
        "0:final_ln.output",
    }
    assert caplog.text.count("squash_name would give different parameters the same name") == 1
    assert "these keep their full names: 0:layers.1.norm.weight, 0:layers.1.norm.bias" in caplog.text
    assert caplog.text.count("squash_name would give different modules the same name") == 1


def test_display_names_resolve_chained_clashes():
    """A name given back its full name may clash with another squashed name: that one keeps its
    full name too; names that clash with nothing stay squashed."""
    from trainprobe.frontdoors.monitor_v1.config import load_monitor_v1_config
    from trainprobe.frontdoors.monitor_v1.naming import display_names

    names = ["0:norm.weight", "0:layers.0.norm.weight", "0:model.layers.0.norm.weight", "0:model.layers.1.mlp"]
    shown = display_names(load_monitor_v1_config({}), names)
    assert [shown(n) for n in names] == [
        "0:norm.weight",
        "0:layers.0.norm.weight",
        "0:model.layers.0.norm.weight",
        "0:layers.1.mlp",
    ]
    assert shown.kept == ("0:layers.0.norm.weight", "0:model.layers.0.norm.weight")
    assert shown.forms("0:layers.0.norm.weight") == ("0:layers.0.norm.weight", "0:norm.weight")
    plain = display_names(load_monitor_v1_config({"squash_name": False}), names)
    assert [plain(n) for n in names] == names and plain.kept == ()


def test_targets_that_name_nothing_warn_with_close_names(tmp_path, monkeypatch, caplog):
    forget_warnings(monkeypatch)
    model = MLP()
    opt = torch.optim.Adam(model.parameters())
    targets = {"fc3": {}, "fc1.weight": {}, "0:fc2": {}, "act": {}}
    cfg = {"targets": targets, "wg_distribution": True, "mv_distribution": True, "param_distribution": True}
    mon = make_v1(tmp_path, monkeypatch, cfg)
    with caplog.at_level("WARNING", logger="trainprobe"):
        mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
        train(model, opt, 2)
    mon.stop()
    assert caplog.text.count("targets name no module or parameter of the model") == 1
    assert "'fc3' (closest: 'fc1'" in caplog.text or "'fc3' (closest: 'fc2'" in caplog.text
    assert not any(f"'{t}' (closest" in caplog.text for t in ("fc1.weight", "0:fc2", "act"))
    names = {full_name(r) for r in table(run_dir(tmp_path), "grad_reduced")}
    assert names == {"0:fc1.weight", "0:fc2.weight", "0:fc2.bias"}


def test_v1_a_step_grad_scaler_skips_keeps_its_own_step(tmp_path, monkeypatch):
    """V1 too: the iteration whose step GradScaler skipped is its own step (grad_unreduced only)."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    mon = make_v1(tmp_path, monkeypatch, {"wg_distribution": True, "ops": ["norm"]})
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    for i in range(3):
        x = torch.randn(4, 6)
        if i == 1:
            x[0, 0] = float("inf")
        scaler.scale(model(x).pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    mon.stop()
    folder = run_dir(tmp_path)
    assert sorted({r["step"] for r in table(folder, "grad_unreduced")}) == ["0", "1", "2"]
    assert sorted({r["step"] for r in table(folder, "grad_reduced")}) == ["0", "2"]
