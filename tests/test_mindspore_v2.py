"""Monitor V2 on MindSpore (PyNative, CPU): real training loops, the CSVs read back and checked."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

from conftest import read_csv, rows_of, write_config
from mindspore_support import OPS, MsMLP, Tensor, assert_row_matches, cell_hooks_left, ms, nn, snapshot
from trainprobe import TrainerMonitorV2
from trainprobe.demo.gpt import GPTConfig
from trainprobe.demo.gpt_mindspore import TinyGPT, synthetic_batches

ALL_ON = {name: {"enabled": True, "ops": OPS} for name in ("module", "weight_grad", "optimizer", "param")}


def make_monitor(tmp_path, monitors: dict[str, Any], **top: Any) -> tuple[TrainerMonitorV2, Any]:
    out = tmp_path / "out"
    path = write_config(tmp_path, {"output_dir": str(out), "framework": "mindspore", "monitors": monitors, **top})
    return TrainerMonitorV2(path), out


def names_of(net: nn.Cell) -> dict[int, str]:
    return {id(p): n for n, p in net.parameters_and_names()}


def train(net: nn.Cell, opt: nn.Optimizer, steps: int, *, acc: int = 1, scale: float = 1.0, capture=None, seed=0):
    """``value_and_grad`` + ``optimizer(grads)``, the user summing ``acc`` micro-batches and
    multiplying the sum by ``scale``; ``capture`` gets per-step numpy snapshots."""
    rng = np.random.default_rng(seed)
    grad_fn = ms.value_and_grad(lambda x: (net(x) ** 2).mean(), None, opt.parameters)
    name = names_of(net)
    order = [name[id(p)] for p in opt.parameters]
    losses = []
    for _ in range(steps):
        total, micro = None, []
        for _ in range(acc):
            loss, grads = grad_fn(Tensor(rng.standard_normal((4, 6)).astype(np.float32)))
            losses.append(float(loss.asnumpy()))
            micro.append(dict(zip(order, (g.asnumpy().copy() for g in grads))))
            total = grads if total is None else tuple(a + b for a, b in zip(total, grads))
        if scale != 1.0:
            total = tuple(g * scale for g in total)
        snap = {"micro": micro, "grads": dict(zip(order, (g.asnumpy().copy() for g in total)))}
        snap["origin"] = snapshot(net.parameters_and_names())
        opt(total)
        snap["updated"] = snapshot(net.parameters_and_names())
        if hasattr(opt, "moment1"):
            snap["exp_avg"] = dict(zip(order, (m.asnumpy().copy() for m in opt.moment1)))
            snap["exp_avg_sq"] = dict(zip(order, (m.asnumpy().copy() for m in opt.moment2)))
        if capture is not None:
            capture.append(snap)
    return losses


def test_mlp_all_monitors_rows_match_the_training_tensors(tmp_path):
    net = MsMLP()
    opt = nn.Adam(net.trainable_params(), learning_rate=1e-2)
    mon, out = make_monitor(tmp_path, ALL_ON)
    mon.start(model=net, optimizer=opt)
    snaps: list[dict] = []
    train(net, opt, 3, capture=snaps)
    mon.stop()

    rank_dir = out / "rank_0"
    expected = [f"{m}_step{s}-{s}.csv" for m in ("module", "optimizer", "param", "weight_grad") for s in range(3)]
    assert sorted(p.name for p in rank_dir.iterdir()) == sorted(expected)
    keyed = ["vpp_stage", "step", "module_name", "scope"]
    assert read_csv(rank_dir / "weight_grad_step1-1.csv")[0] == [*keyed, "micro_step", *OPS]
    assert read_csv(rank_dir / "optimizer_step0-0.csv")[0] == [*keyed, *OPS]
    for step, snap in enumerate(snaps):
        wg = [r for r in rows_of(out, "weight_grad") if int(r["step"]) == step]
        for scope in ("unreduced", "reduced"):
            rows = [r for r in wg if r["scope"] == scope]
            assert [r["module_name"] for r in rows] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
            for row in rows:
                assert row["micro_step"] == "1"
                assert_row_matches(row, snap["grads"][row["module_name"]])
        for row in (r for r in rows_of(out, "param") if int(r["step"]) == step):
            source = snap["origin"] if row["scope"] == "param_origin" else snap["updated"]
            assert_row_matches(row, source[row["module_name"]])
        moments = [r for r in rows_of(out, "optimizer") if int(r["step"]) == step]
        assert len(moments) == 8
        for row in moments:
            name, moment = row["module_name"].rsplit(".", 1)
            assert row["scope"] == moment
            assert_row_matches(row, snap[moment][name])
    step0 = {(r["module_name"], r["scope"]) for r in rows_of(out, "module") if r["step"] == "0"}
    for name in ("", "fc1", "act", "fc2"):  # the root's name is "": ".input.0"
        assert {(f"{name}.input.0", "forward"), (f"{name}.output.0", "forward")} <= step0
        assert (f"{name}.grad_output.0", "backward") in step0
    assert ("fc2.grad_input.0", "backward") in step0
    assert (".grad_input.0", "backward") not in step0  # no gradient flows into the data
    assert cell_hooks_left(net, opt) == 0


def test_module_rows_match_the_forward_tensors_and_manual_step(tmp_path):
    net = MsMLP()
    seen: dict[str, np.ndarray] = {}
    net.fc1.register_forward_hook(
        lambda cell, args, out: seen.update(fc1_in=args[0].asnumpy().copy(), fc1_out=out.asnumpy().copy())
    )
    opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
    mon, out = make_monitor(tmp_path, {"module": {"targets": ["fc1"], "ops": OPS}}, patch_optimizer_step=False)
    mon.start(model=net)
    train(net, opt, 1)
    mon.step()
    assert mon.current_step == 1
    mon.stop()
    rows = {r["module_name"]: r for r in rows_of(out, "module")}
    assert set(rows) == {"fc1.input.0", "fc1.output.0", "fc1.grad_output.0"}
    assert_row_matches(rows["fc1.input.0"], seen["fc1_in"])
    assert_row_matches(rows["fc1.output.0"], seen["fc1_out"])


@pytest.mark.parametrize("mbs", [True, False])
def test_user_gradient_accumulation(tmp_path, mbs):
    """unreduced = each micro-batch's gradient (mbs) or their sum; reduced = what the optimizer
    receives (here the sum scaled by 1/3)."""
    net = MsMLP()
    opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
    mon, out = make_monitor(tmp_path, {"weight_grad": {"enabled": True, "ops": OPS, "monitor_mbs_grad": mbs}})
    mon.start(model=net, optimizer=opt, grad_acc_steps=3)
    snaps: list[dict] = []
    train(net, opt, 2, acc=3, scale=1 / 3, capture=snaps)
    mon.stop()
    for step, snap in enumerate(snaps):
        rows = [r for r in rows_of(out, "weight_grad") if int(r["step"]) == step]
        reduced = [r for r in rows if r["scope"] == "reduced"]
        unreduced = [r for r in rows if r["scope"] == "unreduced"]
        assert len(reduced) == 4 and all(r["micro_step"] == "3" for r in reduced)
        for row in reduced:
            assert_row_matches(row, snap["grads"][row["module_name"]])
        if mbs:
            assert [(r["micro_step"], r["module_name"]) for r in unreduced] == [
                (str(i), n) for i in range(3) for n in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
            ]
            for row in unreduced:
                assert_row_matches(row, snap["micro"][int(row["micro_step"])][row["module_name"]])
        else:
            assert len(unreduced) == 4 and all(r["micro_step"] == "3" for r in unreduced)
            for row in unreduced:
                summed = sum(m[row["module_name"]].astype(np.float64) for m in snap["micro"])
                assert_row_matches(row, summed, rel=1e-5)


def test_train_one_step_cell(tmp_path):
    net = MsMLP()
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.1, momentum=0.9)
    step_cell = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), opt)
    mon, out = make_monitor(tmp_path, {**ALL_ON, "optimizer": {"enabled": False}})
    mon.start(model=net, optimizer=opt)
    rng = np.random.default_rng(0)
    snaps = []
    for _ in range(3):
        before = snapshot(net.parameters_and_names())
        step_cell(Tensor(rng.standard_normal((4, 6)).astype(np.float32)), Tensor(np.zeros((4, 3), np.float32)))
        snaps.append((before, snapshot(net.parameters_and_names())))
    assert mon.current_step == 3
    mon.stop()
    for step, (before, after) in enumerate(snaps):
        for row in (r for r in rows_of(out, "param") if int(r["step"]) == step):
            assert_row_matches(
                row, before[row["module_name"]] if row["scope"] == "param_origin" else after[row["module_name"]]
            )
        wg = [r for r in rows_of(out, "weight_grad") if int(r["step"]) == step]
        by_scope = {s: {r["module_name"]: r for r in wg if r["scope"] == s} for s in ("reduced", "unreduced")}
        assert set(by_scope["reduced"]) == set(by_scope["unreduced"]) == set(before)
        for name, row in by_scope["reduced"].items():
            assert {op: row[op] for op in OPS} == {op: by_scope["unreduced"][name][op] for op in OPS}
    backward = {r["module_name"] for r in rows_of(out, "module") if r["scope"] == "backward"}
    assert {"fc1.grad_output.0", "fc2.grad_output.0", "fc2.grad_input.0"} <= backward
    assert cell_hooks_left(step_cell) == 0


def run_gpt(steps: int, monitors: dict[str, Any] | None, tmp_path, acc: int = 2):
    cfg = GPTConfig(vocab_size=40, seq_len=8, d_model=16, n_heads=2, n_layers=1)
    ms.set_seed(3)
    np.random.seed(3)
    model = TinyGPT(cfg)
    opt = nn.AdamWeightDecay(model.trainable_params(), learning_rate=1e-2, weight_decay=0.01)
    mon = None
    if monitors is not None:
        mon, _ = make_monitor(tmp_path, monitors)
        mon.start(model=model, optimizer=opt, grad_acc_steps=acc)
    grad_fn = ms.value_and_grad(model.loss, None, opt.parameters)
    batches = synthetic_batches(cfg, 3, seed=1)
    losses = []
    for _ in range(steps):
        total = None
        for _ in range(acc):
            loss, grads = grad_fn(next(batches))
            losses.append(loss.asnumpy().copy())
            total = grads if total is None else tuple(a + b for a, b in zip(total, grads))
        opt(tuple(g / acc for g in total))
    if mon is not None:
        mon.stop()
    return losses, model, opt


@pytest.mark.parametrize("mbs", [True, False])
def test_monitoring_does_not_change_training(tmp_path, mbs):
    """Every monitor on, module on every cell: losses and final parameters are bitwise those
    of an unmonitored run; no hook is left on any cell afterwards."""
    monitors = {name: dict(spec) for name, spec in ALL_ON.items()}
    monitors["weight_grad"]["monitor_mbs_grad"] = mbs
    monitors["module"]["ops"] = [*OPS, "zeros"]
    ref_losses, ref_model, _ = run_gpt(3, None, tmp_path)
    losses, model, opt = run_gpt(3, monitors, tmp_path)
    assert all(np.array_equal(a, b) for a, b in zip(ref_losses, losses))
    for (name, a), (_, b) in zip(ref_model.parameters_and_names(), model.parameters_and_names()):
        assert np.array_equal(a.asnumpy(), b.asnumpy()), name
    assert len(rows_of(tmp_path / "out", "module")) > 0
    assert cell_hooks_left(model, opt) == 0


class Float8Output(nn.Cell):
    """Returns a float8 tensor besides its result: NumPy cannot read float8, so summarising it fails."""

    def construct(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x * 2, Tensor(np.ones(3), ms.float8_e4m3fn)


class WithOdd(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.odd = Float8Output()
        self.fc = nn.Dense(6, 2)

    def construct(self, x: Tensor) -> Tensor:
        return self.fc(self.odd(x)[0])


def test_fault_in_a_hook_is_logged_once_and_disables_only_that_monitor(tmp_path, caplog):
    def run(monitored: bool) -> tuple[np.ndarray, Any]:
        ms.set_seed(0)
        net = WithOdd()
        opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
        mon = None
        if monitored:
            mon, out = make_monitor(tmp_path, {"module": {}, "weight_grad": {"enabled": True}})
            mon.start(model=net, optimizer=opt)
        grad_fn = ms.value_and_grad(lambda x: net(x).sum(), None, opt.parameters)
        rng = np.random.default_rng(0)
        for _ in range(3):
            opt(grad_fn(Tensor(rng.standard_normal((3, 6)).astype(np.float32)))[1])
        if mon is not None:
            mon.stop()
        return net.fc.weight.asnumpy(), net

    reference, _ = run(False)
    with caplog.at_level(logging.ERROR, logger="trainprobe"):
        weights, net = run(True)
    assert np.array_equal(reference, weights)
    failures = [r for r in caplog.records if "module monitor failed" in r.getMessage()]
    assert len(failures) == 1
    assert len({r["step"] for r in rows_of(tmp_path / "out", "weight_grad")}) == 3
    assert cell_hooks_left(net) == 0


def test_manual_step_is_ignored_with_one_warning_when_the_optimizer_steps(tmp_path, caplog):
    net = MsMLP()
    opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
    mon, out = make_monitor(tmp_path, {"weight_grad": {"enabled": True}})
    mon.start(model=net, optimizer=opt)
    with caplog.at_level(logging.WARNING, logger="trainprobe"):
        rng = np.random.default_rng(0)
        grad_fn = ms.value_and_grad(lambda x: (net(x) ** 2).mean(), None, opt.parameters)
        for _ in range(2):
            opt(grad_fn(Tensor(rng.standard_normal((4, 6)).astype(np.float32)))[1])
            mon.step()
    mon.stop()
    assert mon.current_step == 2
    assert sorted(p.name for p in (out / "rank_0").iterdir()) == ["weight_grad_step0-0.csv", "weight_grad_step1-1.csv"]
    assert sum("step() is ignored" in r.getMessage() for r in caplog.records) <= 1
