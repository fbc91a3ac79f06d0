"""Monitor V2 end to end: real models train, the CSVs are read back and checked."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
from torch import nn

import trainprobe.engine.log
from conftest import assert_row_matches, read_csv, rows_of, write_config
from models import MLP, TinyTransformer, no_hooks_left
from trainprobe import TrainerMonitorV2
from trainprobe.core.monitor_v2.trainer import TrainerMonitorV2 as CompatTrainer

OPS = ["min", "max", "mean", "norm", "nans"]
ALL_ON = {
    "module": {"enabled": True, "ops": OPS},
    "weight_grad": {"enabled": True, "ops": OPS},
    "optimizer": {"enabled": True, "ops": OPS},
    "param": {"enabled": True, "ops": OPS},
}


def make_monitor(tmp_path, monitors, **top):
    out = tmp_path / "out"
    cfg = {"output_dir": str(out), "monitors": monitors, **top}
    return TrainerMonitorV2(write_config(tmp_path, cfg)), out


def train_mlp(model, opt, steps, *, capture=None, acc=1):
    """Plain loop; ``capture`` collects per-step snapshots of grads and params."""
    for _ in range(steps):
        for _ in range(acc):
            loss = model(torch.randn(4, 6)).pow(2).mean()
            loss.backward()
        if capture is not None:
            capture.append(
                {
                    "grad": {n: p.grad.clone() for n, p in model.named_parameters()},
                    "origin": {n: p.detach().clone() for n, p in model.named_parameters()},
                }
            )
        opt.step()
        if capture is not None:
            capture[-1]["updated"] = {n: p.detach().clone() for n, p in model.named_parameters()}
            capture[-1]["state"] = {
                n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()
            }
        opt.zero_grad(set_to_none=True)


def test_compat_import_path_is_the_same_class():
    assert CompatTrainer is TrainerMonitorV2


def test_mlp_all_monitors_headers_names_and_values(tmp_path):
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon, out = make_monitor(tmp_path, ALL_ON)
    mon.start(model=model, optimizer=opt)
    snaps = []
    train_mlp(model, opt, 3, capture=snaps)
    mon.stop()

    rank_dir = out / "rank_0"
    names = sorted(p.name for p in rank_dir.iterdir())
    expected = [f"{m}_step{s}-{s}.csv" for m in ("module", "optimizer", "param", "weight_grad") for s in range(3)]
    assert names == sorted(expected)
    # no micro-batches configured: no micro_step column, the reference's header
    assert read_csv(rank_dir / "module_step0-0.csv")[0] == ["vpp_stage", "step", "module_name", "scope", *OPS]
    assert read_csv(rank_dir / "weight_grad_step1-1.csv")[0] == [
        "vpp_stage",
        "step",
        "module_name",
        "scope",
        "micro_step",
        *OPS,
    ]
    assert read_csv(rank_dir / "optimizer_step2-2.csv")[0] == ["vpp_stage", "step", "module_name", "scope", *OPS]
    assert read_csv(rank_dir / "param_step0-0.csv")[0] == ["vpp_stage", "step", "module_name", "scope", *OPS]

    for step, snap in enumerate(snaps):
        wg = [r for r in rows_of(out, "weight_grad") if int(r["step"]) == step]
        reduced = {r["module_name"]: r for r in wg if r["scope"] == "reduced"}
        unreduced = {r["module_name"]: r for r in wg if r["scope"] == "unreduced"}
        assert set(reduced) == set(unreduced) == set(snap["grad"])
        for name, grad in snap["grad"].items():
            assert_row_matches(reduced[name], grad)
            assert_row_matches(unreduced[name], grad)
            assert reduced[name]["micro_step"] == unreduced[name]["micro_step"] == "1"
        params = [r for r in rows_of(out, "param") if int(r["step"]) == step]
        for row in params:
            source = snap["origin"] if row["scope"] == "param_origin" else snap["updated"]
            assert_row_matches(row, source[row["module_name"]])
        moments = [r for r in rows_of(out, "optimizer") if int(r["step"]) == step]
        assert {r["module_name"] for r in moments} == {
            f"{n}.{k}" for n in snap["grad"] for k in ("exp_avg", "exp_avg_sq")
        }
        for row in moments:
            name, moment = row["module_name"].rsplit(".", 1)
            assert row["scope"] == moment
            assert_row_matches(row, snap["state"][name][moment])

    module_rows = rows_of(out, "module")
    step0 = {(r["module_name"], r["scope"]) for r in module_rows if r["step"] == "0"}
    for name in ("", "fc1", "act", "fc2"):  # the root's name is empty: ".input.0"
        assert (f"{name}.input.0", "forward") in step0
        assert (f"{name}.output.0", "forward") in step0
        assert (f"{name}.grad_output.0", "backward") in step0
    assert ("fc2.grad_input.0", "backward") in step0
    assert (".grad_input.0", "backward") not in step0  # the data does not require grad


def test_module_values_match_forward_tensors(tmp_path):
    model = MLP()
    seen = {}
    model.fc1.register_forward_hook(
        lambda m, a, o: seen.update(fc1_in=a[0].detach().clone(), fc1_out=o.detach().clone())
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon, out = make_monitor(tmp_path, {"module": {"targets": ["fc1"], "ops": OPS}}, patch_optimizer_step=False)
    mon.start(model=model)
    x = torch.randn(5, 6)
    model(x).sum().backward()
    opt.step()
    mon.step()
    mon.stop()
    rows = {r["module_name"]: r for r in rows_of(out, "module")}
    assert set(rows) == {"fc1.input.0", "fc1.output.0", "fc1.grad_output.0"}
    assert_row_matches(rows["fc1.input.0"], seen["fc1_in"])
    assert_row_matches(rows["fc1.output.0"], seen["fc1_out"])


def run_transformer(steps, monitor_factory=None, acc=2):
    torch.manual_seed(1)
    model = TinyTransformer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = None
    if monitor_factory is not None:
        mon = monitor_factory()
        mon.start(model=model, optimizer=opt, grad_acc_steps=acc)
    losses = []
    data = torch.Generator().manual_seed(2)
    for _ in range(steps):
        for _ in range(acc):
            loss = model.loss(torch.randint(0, 50, (4, 7), generator=data)) / acc
            loss.backward()
            losses.append(loss.detach().clone())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    if mon is not None:
        mon.stop()
    return losses, model


@pytest.mark.parametrize("mbs", [True, False])
def test_monitoring_does_not_change_training_bitwise(tmp_path, mbs):
    """Every monitor on (module on every module, incl. nn.MultiheadAttention(x, x, x)):
    losses and final parameters are bitwise identical to an unmonitored run."""
    monitors = copy.deepcopy(ALL_ON)
    monitors["weight_grad"]["monitor_mbs_grad"] = mbs
    monitors["module"]["ops"] = ["min", "max", "mean", "norm", "nans", "zeros"]
    ref_losses, ref_model = run_transformer(4)
    losses, model = run_transformer(4, lambda: make_monitor(tmp_path, monitors)[0])
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    for (name, a), (_, b) in zip(ref_model.named_parameters(), model.named_parameters()):
        assert torch.equal(a, b), name
    assert len(rows_of(tmp_path / "out", "module")) > 0
    assert no_hooks_left(model)


def test_gradient_accumulation_micro_steps(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon, out = make_monitor(
        tmp_path, {"weight_grad": {"enabled": True, "monitor_mbs_grad": True}, "module": {"targets": ["fc2"]}}
    )
    mon.start(model=model, optimizer=opt, grad_acc_steps=3)
    micro_grads = []
    for _ in range(3):
        before = (
            model.fc2.weight.grad.clone() if model.fc2.weight.grad is not None else torch.zeros_like(model.fc2.weight)
        )
        model(torch.randn(4, 6)).pow(2).mean().backward()
        micro_grads.append(model.fc2.weight.grad - before)
    total = model.fc2.weight.grad.clone()
    opt.step()
    opt.zero_grad()
    mon.stop()
    wg = [r for r in rows_of(out, "weight_grad") if r["module_name"] == "fc2.weight"]
    unreduced = [r for r in wg if r["scope"] == "unreduced"]
    assert [r["micro_step"] for r in unreduced] == ["0", "1", "2"]
    for row, grad in zip(unreduced, micro_grads):
        assert_row_matches(row, grad, rel=1e-5)
    (reduced,) = [r for r in wg if r["scope"] == "reduced"]
    assert reduced["micro_step"] == "3"
    assert_row_matches(reduced, total)
    module_micro = sorted({r["micro_step"] for r in rows_of(out, "module")})
    assert module_micro == ["0", "1", "2"]


def test_accumulated_unreduced_once_per_step(tmp_path):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon, out = make_monitor(tmp_path, {"weight_grad": {"enabled": True, "grad_acc_steps": 2}})
    mon.start(model=model, optimizer=opt)
    snaps = []
    train_mlp(model, opt, 2, capture=snaps, acc=2)
    mon.stop()
    rows = rows_of(out, "weight_grad")
    for step, snap in enumerate(snaps):
        unreduced = [r for r in rows if r["scope"] == "unreduced" and int(r["step"]) == step]
        assert len(unreduced) == 4 and {r["micro_step"] for r in unreduced} == {"2"}
        for row in unreduced:
            assert_row_matches(row, snap["grad"][row["module_name"]], rel=1e-5)


def test_model_chunks_vpp_stage_and_prefix(tmp_path):
    chunks = [MLP(6, 8, 6), MLP(6, 8, 3)]
    opt = torch.optim.Adam([p for c in chunks for p in c.parameters()])
    mon, out = make_monitor(
        tmp_path, {"module": {"targets": ["fc1"]}, "weight_grad": {"enabled": True}, "param": {"enabled": True}}
    )
    mon.start(model=chunks, optimizer=opt)
    for _ in range(2):
        chunks[1](chunks[0](torch.randn(3, 6))).sum().backward()
        opt.step()
        opt.zero_grad()
    mon.stop()
    module_names = {(r["vpp_stage"], r["module_name"]) for r in rows_of(out, "module")}
    assert ("0", "0:fc1.input.0") in module_names and ("1", "1:fc1.output.0") in module_names
    wg = {(r["vpp_stage"], r["module_name"]) for r in rows_of(out, "weight_grad")}
    assert ("0", "0:fc1.weight") in wg and ("1", "1:fc2.bias") in wg
    assert all(r["module_name"].startswith(r["vpp_stage"] + ":") for r in rows_of(out, "param"))


def test_stop_leaves_no_hooks_and_training_goes_on(tmp_path):
    model = MLP()
    opt = torch.optim.AdamW(model.parameters())
    mon, out = make_monitor(tmp_path, ALL_ON)
    mon.start(model=model, optimizer=opt)
    train_mlp(model, opt, 2)
    mon.stop()
    assert no_hooks_left(model, opt)
    files = sorted(p.name for p in (out / "rank_0").iterdir())
    train_mlp(model, opt, 2)  # optimizer.step() still works, nothing more is written
    assert sorted(p.name for p in (out / "rank_0").iterdir()) == files
    mon.start(model=model, optimizer=opt)  # and the monitor starts again, continuing the step count
    train_mlp(model, opt, 1)
    mon.stop()
    assert (out / "rank_0" / "weight_grad_step2-2.csv").exists()
    assert no_hooks_left(model, opt)


def test_schedule_windows_and_truncated_window(tmp_path):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon, out = make_monitor(
        tmp_path,
        {"weight_grad": {"enabled": True}},
        start_step=1,
        step_interval=2,
        step_count_per_record=2,
        collect_times=10,
    )
    mon.start(model=model, optimizer=opt)
    train_mlp(model, opt, 8)  # collected: 1 3 5 7; windows of 2 steps from start_step, as the reference
    mon.stop()  # at step 8, inside the window 7-8: the file keeps the window's name, as the reference
    names = sorted(p.name for p in (out / "rank_0").iterdir())
    assert names == [
        "weight_grad_step1-2.csv",
        "weight_grad_step3-4.csv",
        "weight_grad_step5-6.csv",
        "weight_grad_step7-8.csv",
    ]
    assert sorted({r["step"] for r in rows_of(out, "weight_grad")}, key=int) == ["1", "3", "5", "7"]

    mon2, out2 = make_monitor(tmp_path / "b", {"weight_grad": {"enabled": True}}, step_count_per_record=4)
    mon2.start(model=model, optimizer=opt)
    train_mlp(model, opt, 6)
    mon2.stop()
    names = sorted(p.name for p in (out2 / "rank_0").iterdir())
    assert names == ["weight_grad_step0-3.csv", "weight_grad_step4-7.csv"]


@pytest.mark.parametrize("bound", [{"collect_times": 3}, {"stop_step": 6}])
def test_the_last_window_keeps_its_full_name_when_collection_ends(tmp_path, bound):
    """Collection ends by the schedule (step 5 is the last collected) while training goes on:
    the last file is named by its window, step5-6, as the reference and the docs say; only a
    stop() inside a window renames it (previous test)."""
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    on = {"enabled": True}
    mon, out = make_monitor(
        tmp_path,
        {"weight_grad": on, "param": on},
        start_step=1,
        step_interval=2,
        step_count_per_record=2,
        **bound,
    )
    mon.start(model=model, optimizer=opt)
    train_mlp(model, opt, 8)
    mon.stop()
    names = sorted(p.name for p in (out / "rank_0").iterdir())
    assert names == [f"{m}_step{w}.csv" for m in ("param", "weight_grad") for w in ("1-2", "3-4", "5-6")]
    assert sorted({r["step"] for r in rows_of(out, "param")}, key=int) == ["1", "3", "5"]


def test_stop_step_and_collect_times_detach_hooks(tmp_path):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon, out = make_monitor(tmp_path, {"weight_grad": {"enabled": True}, "module": {}}, start_step=0, stop_step=2)
    mon.start(model=model, optimizer=opt)
    train_mlp(model, opt, 2)
    assert no_hooks_left(model, opt)  # nothing left to collect: every hook is gone already
    train_mlp(model, opt, 2)
    mon.stop()
    assert sorted({r["step"] for r in rows_of(out, "weight_grad")}) == ["0", "1"]


def test_manual_step_mode_and_ignored_manual_step(tmp_path, caplog):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon, out = make_monitor(tmp_path, {"param": {"enabled": True}}, patch_optimizer_step=False)
    mon.start(model=model, optimizer=opt)
    for _ in range(2):
        train_mlp(model, opt, 1)
        train_mlp(model, opt, 1)
        mon.step()  # two optimizer steps make one monitor step
    mon.stop()
    steps = [r["step"] for r in rows_of(out, "param")]
    assert steps.count("0") == 2 * 2 * 4 and steps.count("1") == 16

    mon2, out2 = make_monitor(tmp_path / "b", {"param": {"enabled": True}})
    mon2.start(model=model, optimizer=opt)
    with caplog.at_level(logging.WARNING, logger="trainprobe"):
        train_mlp(model, opt, 1)
        mon2.step()
        mon2.step()
    mon2.stop()
    assert sum("TrainerMonitorV2.step() is ignored" in r.getMessage() for r in caplog.records) <= 1
    assert sorted({r["step"] for r in rows_of(out2, "param")}) == ["0"]


@pytest.mark.parametrize("momentum", [0.9, 0.0], ids=["momentum", "plain"])
def test_non_adam_optimizer_skips_optimizer_monitor_with_warning(tmp_path, caplog, monkeypatch, momentum):
    """SGD keeps a momentum buffer, or no state at all without momentum: either way one warning
    names the class and no optimizer CSV is written."""
    monkeypatch.setattr(trainprobe.engine.log, "_seen", set())  # the warning is once per process
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=momentum)
    mon, out = make_monitor(tmp_path, {"optimizer": {"enabled": True}, "weight_grad": {"enabled": True}})
    mon.start(model=model, optimizer=opt)
    with caplog.at_level(logging.WARNING, logger="trainprobe"):
        train_mlp(model, opt, 2)
    mon.stop()
    warnings = [r.getMessage() for r in caplog.records if "optimizer monitor" in r.getMessage()]
    assert len(warnings) == 1 and "SGD keeps no exp_avg/exp_avg_sq state" in warnings[0]
    assert not list((out / "rank_0").glob("optimizer_*.csv"))
    assert rows_of(out, "weight_grad")


def test_rank_filter_skips_unlisted_rank(tmp_path):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon, out = make_monitor(tmp_path, {"weight_grad": {"enabled": True}}, rank=[1])
    mon.start(model=model, optimizer=opt)
    train_mlp(model, opt, 2)
    mon.stop()
    assert not out.exists() or not any(out.rglob("*.csv"))
    assert no_hooks_left(model, opt)


def test_eval_mode_modules_skipped_unless_asked(tmp_path):
    model = MLP()
    mon, out = make_monitor(tmp_path, {"module": {}}, patch_optimizer_step=False)
    mon.start(model=model)
    model.eval()
    model(torch.randn(2, 6))
    mon.step()
    model.train()
    model(torch.randn(2, 6))
    mon.step()
    mon.stop()
    assert {r["step"] for r in rows_of(out, "module")} == {"1"}
    mon2, out2 = make_monitor(tmp_path / "b", {"module": {"record_eval_mode": True}}, patch_optimizer_step=False)
    mon2.start(model=model)
    model.eval()
    with torch.no_grad():
        model(torch.randn(2, 6))
    mon2.step()
    mon2.stop()
    assert rows_of(out2, "module")


def test_integer_and_low_precision_tensors(tmp_path):
    model = TinyTransformer(dropout=0.0).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters())
    mon, out = make_monitor(tmp_path, {"module": {"targets": ["emb", "head"]}, "weight_grad": {"enabled": True}})
    mon.start(model=model, optimizer=opt)
    idx = torch.randint(0, 50, (2, 5))
    model.loss(idx).backward()
    opt.step()
    mon.stop()
    rows = {r["module_name"]: r for r in rows_of(out, "module")}
    emb_in = rows["emb.input.0"]
    assert float(emb_in["min"]) == idx.min().item() and float(emb_in["max"]) == idx.max().item()
    assert float(emb_in["mean"]) == pytest.approx(idx.double().mean().item(), rel=1e-12)
    for r in rows_of(out, "weight_grad"):
        assert float(r["norm"]) == float(r["norm"])  # finite, not NaN


def test_nan_counted_exactly_and_training_unaffected(tmp_path):
    model = MLP()
    mon, out = make_monitor(tmp_path, {"module": {"targets": ["fc1"]}}, patch_optimizer_step=False)
    mon.start(model=model)
    x = torch.randn(4, 6)
    x[0, :3] = float("nan")
    model(x)
    mon.step()
    mon.stop()
    row = {r["module_name"]: r for r in rows_of(out, "module")}["fc1.input.0"]
    assert row["nans"] == "3" and row["max"] == "nan"


class OddOutput(torch.nn.Module):
    """A module whose second output is a quantized tensor, which the statistics cannot read (a
    meta tensor no longer does: it gets no row, see the meta test below)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, torch.quantize_per_tensor(x.detach(), 0.1, 0, torch.quint8)


class WithOdd(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.odd = OddOutput()
        self.fc = torch.nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.odd(x)[0])


def test_fault_in_a_hook_disables_that_monitor_only(tmp_path, caplog):
    torch.manual_seed(0)
    ref = WithOdd()
    model = copy.deepcopy(ref)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    mon, out = make_monitor(tmp_path, {"module": {}, "weight_grad": {"enabled": True}})
    mon.start(model=model, optimizer=opt)
    xs = [torch.randn(3, 6) for _ in range(3)]
    with caplog.at_level(logging.ERROR, logger="trainprobe"):
        for x in xs:
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    mon.stop()
    for x in xs:
        ref(x).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert torch.equal(ref.fc.weight, model.fc.weight)
    failures = [r for r in caplog.records if "module monitor failed" in r.getMessage()]
    assert len(failures) == 1
    assert len({r["step"] for r in rows_of(out, "weight_grad")}) == 3
    assert no_hooks_left(model, opt)


def test_write_error_disables_that_monitor_only(tmp_path, caplog):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon, out = make_monitor(tmp_path, {"weight_grad": {"enabled": True}, "param": {"enabled": True}})
    (out / "rank_0" / "weight_grad_step0-0.csv").mkdir(parents=True)  # the file cannot be created
    mon.start(model=model, optimizer=opt)
    with caplog.at_level(logging.ERROR, logger="trainprobe"):
        train_mlp(model, opt, 3)
        mon.stop()
    assert sum("writing the weight_grad output failed" in r.getMessage() for r in caplog.records) == 1
    assert not list((out / "rank_0").glob("weight_grad_step1*.csv"))
    assert len({r["step"] for r in rows_of(out, "param")}) == 3


@pytest.mark.parametrize("async_write", [True, False])
def test_async_write_modes_write_the_same_rows(tmp_path, async_write):
    torch.manual_seed(3)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon, out = make_monitor(tmp_path, {"weight_grad": {"enabled": True}}, async_write=async_write)
    mon.start(model=model, optimizer=opt)
    train_mlp(model, opt, 3)
    mon.stop()
    assert len(rows_of(out, "weight_grad")) == 3 * 8


class OptimizerSubclassWrapper(torch.optim.Optimizer):
    """Like accelerate's AcceleratedOptimizer: an Optimizer subclass holding the real one."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:  # no super().__init__: no hook dicts
        self.optimizer = inner

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def step(self, closure=None):
        return self.optimizer.step(closure)


def test_optimizer_wrappers_are_unwrapped_to_the_innermost(tmp_path):
    model = MLP()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    mon, out = make_monitor(tmp_path, {"param": {"enabled": True}})
    mon.start(model=model, optimizer=OptimizerSubclassWrapper(inner))
    train_mlp(model, inner, 2)
    mon.stop()
    assert sorted({r["step"] for r in rows_of(out, "param")}) == ["0", "1"]


def test_reduced_rows_see_gradient_clipping_between_backward_and_step(tmp_path):
    """reduced rows hold the gradients as the step sees them (after clipping), param_origin the
    parameters as they are before the step (after an in-place change between steps)."""
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon, out = make_monitor(tmp_path, {"weight_grad": {"enabled": True}, "param": {"enabled": True}})
    mon.start(model=model, optimizer=opt)
    clipped, raw = [], []
    for _ in range(2):
        model(torch.randn(4, 6)).pow(2).mean().backward()
        raw.append({n: p.grad.clone() for n, p in model.named_parameters()})
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        clipped.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            model.fc1.weight.mul_(0.5)  # an in-place change between steps: param_origin must see it
    mon.stop()
    for row in rows_of(out, "weight_grad"):
        source = raw if row["scope"] == "unreduced" else clipped
        assert_row_matches(row, source[int(row["step"])][row["module_name"]])
    origin = [r for r in rows_of(out, "param") if r["scope"] == "param_origin" and r["module_name"] == "fc1.weight"]
    updated = [r for r in rows_of(out, "param") if r["scope"] == "param_updated" and r["module_name"] == "fc1.weight"]
    assert float(origin[1]["norm"]) == pytest.approx(0.5 * float(updated[0]["norm"]), rel=1e-6)


def test_changes_that_bypass_the_version_counter_are_seen(tmp_path):
    """GradScaler.unscale_ and writes through ``.data`` do not bump autograd's version counter:
    reduced rows must still show the unscaled/edited gradient and param_origin the edited
    parameter (nothing is reused from the earlier scope)."""
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    mon, out = make_monitor(tmp_path, {"weight_grad": {"enabled": True}, "param": {"enabled": True}})
    mon.start(model=model, optimizer=opt)
    scaled, final, origin = [], [], []
    for _ in range(2):
        scaler.scale(model(torch.randn(4, 6)).pow(2).mean()).backward()
        scaled.append({n: p.grad.clone() for n, p in model.named_parameters()})
        scaler.unscale_(opt)
        model.fc1.weight.grad.data.mul_(0.25)  # a legacy in-place edit through .data
        final.append({n: p.grad.clone() for n, p in model.named_parameters()})
        origin.append({n: p.detach().clone() for n, p in model.named_parameters()})
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        model.fc2.weight.data.clamp_(-0.01, 0.01)  # weight clipping between steps, WGAN style
    mon.stop()
    assert scaled[0]["fc1.weight"].norm() > 100 * final[0]["fc1.weight"].norm()
    for row in rows_of(out, "weight_grad"):
        source = scaled if row["scope"] == "unreduced" else final
        assert_row_matches(row, source[int(row["step"])][row["module_name"]])
    for row in rows_of(out, "param"):
        if row["scope"] == "param_origin":
            assert_row_matches(row, origin[int(row["step"])][row["module_name"]])


def test_reentrant_checkpointing_keeps_every_unreduced_row(tmp_path):
    """With ``checkpoint(..., use_reentrant=True)`` the last parameters' gradients come from a
    nested backward: rows are still read once at the end of the outer backward, for every
    parameter, with their final values."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(4, 8)
            self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.body, self.embed(x), use_reentrant=True)

    model = Checkpointed()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon, out = make_monitor(tmp_path, {"weight_grad": {"enabled": True}})
    mon.start(model=model, optimizer=opt)
    grads = []
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    mon.stop()
    rows = [r for r in rows_of(out, "weight_grad") if r["scope"] == "unreduced"]
    assert sorted((r["step"], r["module_name"]) for r in rows) == sorted(
        (str(s), n) for s in range(2) for n, _ in model.named_parameters()
    )
    for row in rows:
        assert_row_matches(row, grads[int(row["step"])][row["module_name"]])


def test_single_process_weight_grad_hooks_only_sentinel_parameters(tmp_path):
    """One process, one row per step: unreduced rows are read once at the end of backward
    (hooks on three sentinel parameters only), with and without accumulation."""
    model = TinyTransformer()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    mon, out = make_monitor(tmp_path, {"weight_grad": {"enabled": True, "ops": OPS, "grad_acc_steps": 3}})
    mon.start(model=model, optimizer=opt)
    hooked = [i for i, p in enumerate(params) if p._backward_hooks]
    assert hooked == sorted({0, (len(params) - 1) // 2, len(params) - 1})
    assert not any(getattr(p, "_post_accumulate_grad_hooks", None) for p in params)
    snaps = []
    for _ in range(3):
        for _ in range(3):
            model.loss(torch.randint(0, 50, (2, 8))).backward()
        snaps.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    mon.stop()
    rows = rows_of(out, "weight_grad")
    for step, grads in enumerate(snaps):
        for scope in ("unreduced", "reduced"):
            got = [r for r in rows if r["scope"] == scope and int(r["step"]) == step]
            assert sorted(r["module_name"] for r in got) == sorted(grads), (step, scope)
            for row in got:
                assert row["micro_step"] == "3"
                assert_row_matches(row, grads[row["module_name"]], rel=1e-6)
    assert no_hooks_left(model, opt)


def test_loop_calling_submodules_directly_is_captured(tmp_path, caplog):
    """Lightning-style loops call submodules, not the model: the sentinels still see backward."""
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon, out = make_monitor(tmp_path, {"weight_grad": {"enabled": True, "ops": OPS}})
    mon.start(model=model, optimizer=opt)
    grads = []
    with caplog.at_level(logging.WARNING, logger="trainprobe"):
        for _ in range(2):
            model.fc2(model.act(model.fc1(torch.randn(4, 6)))).pow(2).mean().backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad(set_to_none=True)
    mon.stop()
    assert "reached none of the parameters" not in caplog.text
    rows = rows_of(out, "weight_grad")
    assert {(r["scope"], int(r["step"])) for r in rows} == {(s, k) for s in ("unreduced", "reduced") for k in (0, 1)}
    for row in rows:
        assert_row_matches(row, grads[int(row["step"])][row["module_name"]], rel=1e-6)


def test_backward_missing_every_sentinel_falls_back_to_parameter_hooks(tmp_path, caplog, monkeypatch):
    """A backward that reaches none of the sentinels (here only fc2.weight, parameter 2 of 4, gets a
    gradient) has no unreduced rows (said once); later steps use per-parameter hooks."""
    import trainprobe.engine.log

    monkeypatch.setattr(trainprobe.engine.log, "_seen", set())
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon, out = make_monitor(tmp_path, {"weight_grad": {"enabled": True, "ops": OPS}})
    mon.start(model=model, optimizer=opt)
    grads = []
    with caplog.at_level(logging.WARNING, logger="trainprobe"):
        for step in range(3):
            if step == 0:
                model.fc2.weight.pow(2).sum().backward()
            else:
                model(torch.randn(4, 6)).pow(2).mean().backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            opt.step()
            opt.zero_grad(set_to_none=True)
    mon.stop()
    assert caplog.text.count("reached none of the parameters watched for the end of backward") == 1
    rows = rows_of(out, "weight_grad")
    assert {int(r["step"]) for r in rows if r["scope"] == "unreduced"} == {1, 2}
    assert {int(r["step"]) for r in rows if r["scope"] == "reduced"} == {0, 1, 2}
    for row in rows:
        assert_row_matches(row, grads[int(row["step"])][row["module_name"]], rel=1e-6)
    assert no_hooks_left(model, opt)


def test_a_step_grad_scaler_skips_keeps_its_own_step(tmp_path):
    """An inf gradient makes GradScaler skip optimizer.step(): that iteration is still a step of
    its own (its unreduced rows, holding the inf, written; no reduced row, as no step ran) and the
    next iteration's rows are not merged into it. GradScaler.step is restored at stop()."""
    original = vars(torch.amp.GradScaler)["step"]
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    mon, out = make_monitor(tmp_path, {"weight_grad": {"enabled": True, "ops": ["norm"]}})
    mon.start(model=model, optimizer=opt)
    scaled = []
    for i in range(3):
        x = torch.randn(4, 6)
        if i == 1:
            x[0, 0] = float("inf")
        scaler.scale(model(x).pow(2).mean()).backward()
        scaled.append(model.fc1.weight.grad.norm().item())
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    mon.stop()
    assert vars(torch.amp.GradScaler)["step"] is original
    rows = [r for r in rows_of(out, "weight_grad") if r["module_name"] == "fc1.weight"]
    assert [(r["step"], r["scope"]) for r in rows] == [
        ("0", "unreduced"),
        ("0", "reduced"),
        ("1", "unreduced"),
        ("2", "unreduced"),
        ("2", "reduced"),
    ]
    assert not math.isfinite(float(rows[2]["norm"]))  # the inf iteration's gradient
    assert float(rows[3]["norm"]) == pytest.approx(scaled[2], rel=1e-6)


class _ShapeCarrier(nn.Module):
    """Takes a real tensor and a meta one (a shape only), returns one of each."""

    def forward(self, x, like):
        return x * 2, torch.empty_like(like)


class _WithMeta(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)
        self.carrier = _ShapeCarrier()

    def forward(self, x):
        y, _ = self.carrier(self.fc(x), torch.empty(5, 2, device="meta"))
        return y


def test_a_meta_tensor_gets_no_row_and_the_module_monitor_goes_on(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(trainprobe.engine.log, "_seen", set())
    caplog.set_level(logging.INFO)
    torch.manual_seed(0)
    model = _WithMeta()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon, out = make_monitor(tmp_path, {"module": {"enabled": True, "ops": OPS}})
    mon.start(model=model, optimizer=opt)
    train_mlp(model, opt, 3)
    mon.stop()
    rows = rows_of(out, "module")
    assert "failed" not in caplog.text
    assert caplog.text.count("tensor without values (device='meta')") == 1
    for step in ("0", "1", "2"):  # every step, every real tensor: the monitor stayed on
        names = {r["module_name"] for r in rows if r["step"] == step}
        assert names == {
            ".input.0",
            ".output.0",
            ".grad_output.0",
            "fc.input.0",
            "fc.output.0",
            "fc.grad_output.0",
            "carrier.input.0",  # input 1 (meta): no row; the real one keeps its index
            "carrier.output.0",  # output 1 (meta): no row
            "carrier.grad_input.0",
            "carrier.grad_output.0",
        }, step
