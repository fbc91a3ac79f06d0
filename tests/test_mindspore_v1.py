"""Monitor V1 on MindSpore: ``from trainprobe.mindspore import TrainerMon`` on real PyNative loops."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from conftest import read_csv
from mindspore_support import MsMLP, Tensor, assert_row_matches, cell_hooks_left, ms, nn
from test_v1_support import by_name, full_name, run_dir, table
from trainprobe.engine.errors import ConfigError
from trainprobe.mindspore import TrainerMon

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
PARAMS = ["0:fc1.weight", "0:fc1.bias", "0:fc2.weight", "0:fc2.bias"]


def make_mon(tmp_path, monkeypatch, config, **kwargs) -> TrainerMon:
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "monitor_config.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    return TrainerMon(str(path), **kwargs)


def train(net, opt, steps, *, acc=1, seed=0, nan_at=None, capture=None):
    """``value_and_grad`` loop summing ``acc`` micro-batches; ``nan_at``: a NaN in the first
    gradient handed to the optimizer at that step."""
    rng = np.random.default_rng(seed)
    grad_fn = ms.value_and_grad(lambda x: (net(x) ** 2).mean(), None, opt.parameters)
    for step in range(steps):
        total, micro = None, []
        for _ in range(acc):
            grads = grad_fn(Tensor(rng.standard_normal((4, 6)).astype(np.float32)))[1]
            micro.append([g.asnumpy().copy() for g in grads])
            total = grads if total is None else tuple(a + b for a, b in zip(total, grads))
        if step == nan_at:
            first = total[0].asnumpy().copy()
            first[0, 0] = math.nan
            total = (Tensor(first), *total[1:])
        if capture is not None:
            capture.append({"micro": micro, "grads": [g.asnumpy().copy() for g in total]})
        opt(total)
        if capture is not None and hasattr(opt, "moment1"):
            capture[-1]["exp_avg"] = [m.asnumpy().copy() for m in opt.moment1]


def test_csv_files_headers_and_values(tmp_path, monkeypatch):
    net = MsMLP()
    opt = nn.Adam(net.trainable_params(), learning_rate=1e-2)
    mon = make_mon(tmp_path, monkeypatch, FULL)
    mon.set_monitor(net, grad_acc_steps=1, optimizer=opt)
    snaps: list[dict] = []
    train(net, opt, 2, capture=snaps)
    mon.stop()
    folder = run_dir(tmp_path)
    names = {p.name for p in folder.iterdir()}
    for kind in ("actv", "actv_grad", "grad_unreduced", "grad_reduced", "exp_avg", "exp_avg_sq", "param_origin"):
        assert {f"{kind}_0-0.csv", f"{kind}_1-1.csv"} <= names, kind
    assert read_csv(folder / "actv_0-0.csv")[0] == [
        "vpp_stage",
        "name",
        "step",
        "micro_step",
        *ALL_OPS,
        "shape",
        "dtype",
    ]
    assert read_csv(folder / "grad_reduced_0-0.csv")[0] == ["vpp_stage", "name", "step", *ALL_OPS, "shape", "dtype"]
    for step, snap in enumerate(snaps):
        for kind, source in (("grad_reduced", "grads"), ("grad_unreduced", "grads"), ("exp_avg", "exp_avg")):
            rows = [r for r in table(folder, kind) if r["step"] == str(step)]
            assert [full_name(r) for r in rows] == PARAMS, kind
            for row, value in zip(rows, snap[source]):
                assert_row_matches({"module_name": row["name"], **row}, value)
    actv = {full_name(r) for r in table(folder, "actv")}
    assert {"0:fc1.input", "0:fc1.output", "0:act.output", "0:fc2.output"} <= actv
    assert {"0:fc2.input", "0:fc2.output"} <= {full_name(r) for r in table(folder, "actv_grad")}
    assert cell_hooks_left(net, opt) == 0


class Pair(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Dense(6, 6)

    def construct(self, x):
        return self.lin(x), x * 2


class PairNet(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.pair = Pair()
        self.head = nn.Dense(6, 3)

    def construct(self, x):
        a, b = self.pair(x)
        return self.head(a + b)


def test_targets_specs_ops_and_ndigits(tmp_path, monkeypatch):
    net = PairNet()
    opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
    cfg = {
        "targets": {"pair": {"input": "tensor", "output": "tuple[2]:1", "output_grad": "tuple[2]:0"}},
        "xy_distribution": True,
        "wg_distribution": True,
        "ops": ["norm", "max"],
        "ndigits": 3,
    }
    mon = make_mon(tmp_path, monkeypatch, cfg)
    mon.set_monitor(net, grad_acc_steps=1, optimizer=opt)
    seen = {}
    net.pair.register_forward_hook(lambda cell, args, out: seen.update(b=out[1].asnumpy().copy()))
    train(net, opt, 1)
    mon.stop()
    folder = run_dir(tmp_path)
    actv = table(folder, "actv")
    assert {full_name(r) for r in actv} == {"0:pair.input", "0:pair.output"}
    assert read_csv(folder / "actv_0-0.csv")[0] == [
        "vpp_stage",
        "name",
        "step",
        "micro_step",
        "norm",
        "max",
        "shape",
        "dtype",
    ]
    norm = float(by_name(actv, "0:pair.output")[0]["norm"])
    assert norm == pytest.approx(np.linalg.norm(seen["b"].astype(np.float64)), abs=5e-4)
    assert all(len(r["norm"].split(".")[-1]) <= 3 for r in actv)
    assert {full_name(r) for r in table(folder, "actv_grad")} == {"0:pair.output"}
    assert {full_name(r) for r in table(folder, "grad_reduced")} == {"0:pair.lin.weight", "0:pair.lin.bias"}


def test_monitor_mbs_grad_rows_per_micro_batch(tmp_path, monkeypatch):
    net = MsMLP()
    opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
    mon = make_mon(tmp_path, monkeypatch, {"wg_distribution": True, "monitor_mbs_grad": True, "ndigits": 12})
    mon.set_monitor(net, grad_acc_steps=3, optimizer=opt)
    snaps: list[dict] = []
    train(net, opt, 1, acc=3, capture=snaps)
    mon.stop()
    folder = run_dir(tmp_path)
    assert read_csv(folder / "grad_unreduced_0-0.csv")[0][:4] == ["vpp_stage", "name", "step", "micro_step"]
    rows = by_name(table(folder, "grad_unreduced"), "0:fc2.bias")
    assert [r["micro_step"] for r in rows] == ["0", "1", "2"]
    for row, micro in zip(rows, snaps[0]["micro"]):
        assert float(row["norm"]) == pytest.approx(np.linalg.norm(micro[3].astype(np.float64)), rel=1e-6)


def test_stack_info_names_the_user_code(tmp_path, monkeypatch):
    net = MsMLP()
    opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
    mon = make_mon(tmp_path, monkeypatch, {"stack_info": True, "wg_distribution": True})
    mon.set_monitor(net, grad_acc_steps=1, optimizer=opt)
    train(net, opt, 2)
    mon.stop()
    header, rows = read_csv(run_dir(tmp_path) / "stack_info.csv")
    assert header == ["module_name", "stack_info"]
    assert {r["module_name"] for r in rows} == {"0:", "0:fc1", "0:act", "0:fc2"}
    assert all("test_mindspore_v1.py" in r["stack_info"] for r in rows)
    assert not any(f"{os.sep}mindspore{os.sep}" in r["stack_info"] for r in rows)


def test_nan_alert_is_reported_and_dumped(tmp_path, monkeypatch, capsys):
    net = MsMLP()
    opt = nn.SGD(net.trainable_params(), learning_rate=0.01)
    cfg = {"wg_distribution": True, "ops": ["norm"], "alert": {"rules": [{"rule_name": "AnomalyNan"}], "dump": True}}
    mon = make_mon(tmp_path, monkeypatch, cfg)
    mon.set_monitor(net, grad_acc_steps=1, optimizer=opt)
    train(net, opt, 4, nan_at=3)
    mon.stop()
    out = capsys.readouterr().out
    assert out.count("trainprobe alert:") == 1
    dump = json.loads((tmp_path / "out" / "anomaly_detected" / "rank0" / "anomaly.json").read_text())
    ((key, entry),) = dump.items()
    assert key.startswith("0:fc1.weight/rank0/post_grad_step_3_call_")
    assert entry["step"] == 3 and entry["tag_name"] == "0:fc1.weight/rank0/post_grad"


def test_dynamic_mode_switches_on_and_off(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNAMIC_MONITOR", "True")
    net = MsMLP()
    opt = nn.SGD(net.trainable_params(), learning_rate=0.01)
    mon = make_mon(tmp_path, monkeypatch, {"wg_distribution": True, "dynamic_on": False, "collect_times": 2})
    mon.set_monitor(net, grad_acc_steps=1, optimizer=opt)
    train(net, opt, 2)
    data = json.loads(mon.config_file_path.read_text())
    data["dynamic_on"] = True
    mon.config_file_path.write_text(json.dumps(data))
    t = mon.config_file_path.stat().st_mtime_ns + 2_000_000_000
    os.utime(mon.config_file_path, ns=(t, t))
    train(net, opt, 5, seed=1)
    mon.stop()
    assert sorted({int(r["step"]) for r in table(run_dir(tmp_path), "grad_reduced")}) == [3, 4]
    assert json.loads(mon.config_file_path.read_text())["dynamic_on"] is False


def test_api_format_and_metrics_on_demand(tmp_path, monkeypatch):
    net = MsMLP()
    opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
    mon = make_mon(tmp_path, monkeypatch, {**FULL, "format": "api"})
    mon.set_monitor(net, grad_acc_steps=1, optimizer=opt)
    snaps: list[dict] = []
    train(net, opt, 1, capture=snaps)
    reduced, unreduced = mon.generate_wgrad_metrics()
    expected = np.linalg.norm(snaps[0]["grads"][2].astype(np.float64))
    assert reduced["0:fc2.weight"]["norm"] == pytest.approx(expected, rel=1e-6)
    assert unreduced["0:fc2.weight"]["norm"] == pytest.approx(expected, rel=1e-6)
    actv, actv_grad = mon.generate_xy_metrics()
    assert "0:fc1.output:0" in actv and "0:fc1.output:0" in actv_grad
    mon.stop()
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("field", "config"),
    [
        ("print_struct", {"print_struct": True}),
        ("ur_distribution", {"ur_distribution": True}),
        ("mg_direction", {"mg_direction": True}),
        ("recording_l2_features", {"recording_l2_features": True, "l2_targets": {"attention_hook": ["0:fc1"]}}),
    ],
)
def test_pytorch_only_fields_are_config_errors(tmp_path, monkeypatch, field, config):
    with pytest.raises(ConfigError, match=rf"^{field}: not supported on the MindSpore backend"):
        make_mon(tmp_path, monkeypatch, {"wg_distribution": True, **config})


def test_set_monitor_bad_arguments(tmp_path, monkeypatch):
    import torch

    net = MsMLP()
    opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
    mon = make_mon(tmp_path, monkeypatch, {"wg_distribution": True})
    with pytest.raises(ConfigError, match=r"^set_monitor\(optimizer=...\): the optimizer is required"):
        mon.set_monitor(net, grad_acc_steps=1, optimizer=None)
    with pytest.raises(ConfigError, match=r"^set_monitor\(grad_acc_steps=...\): must be an integer >= 1"):
        mon.set_monitor(net, grad_acc_steps=0, optimizer=opt)
    with pytest.raises(ConfigError, match=r"^set_monitor\(model=...\): expected a mindspore.nn.Cell"):
        mon.set_monitor(torch.nn.Linear(2, 2), grad_acc_steps=1, optimizer=opt)
    with pytest.raises(ConfigError, match=r"^set_monitor\(optimizer=...\): expected a MindSpore optimizer"):
        mon.set_monitor(net, grad_acc_steps=1, optimizer=torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1))
    with pytest.raises(ConfigError, match=r"^set_monitor\(dp_group=...\): needs mindspore.communication"):
        mon.set_monitor(net, grad_acc_steps=1, optimizer=opt, dp_group=object())
    assert cell_hooks_left(net, opt) == 0


def test_one_front_door_picks_mindspore_through_the_backend(tmp_path, monkeypatch):
    """``trainprobe.mindspore.TrainerMon`` is the one ``TrainerMon`` with ``framework="mindspore"``
    (resolved by ``backend_for``): the same class, the same files as the PyTorch front door asked
    for MindSpore by name."""
    from trainprobe.backends.mindspore.backend import MINDSPORE
    from trainprobe.frontdoors.monitor_v1.trainer import TrainerMon as OneFrontDoor

    assert isinstance(make_mon(tmp_path / "a", monkeypatch, {"wg_distribution": True}), OneFrontDoor)
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "b" / "out"))
    path = tmp_path / "a" / "monitor_config.json"
    mon = OneFrontDoor(str(path), framework="mindspore")
    net = MsMLP()
    opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
    mon.set_monitor(net, grad_acc_steps=1, optimizer=opt)
    train(net, opt, 2)
    mon.stop()
    assert [full_name(r) for r in table(run_dir(tmp_path / "b"), "grad_reduced")] == PARAMS * 2
    assert cell_hooks_left(net, opt) == 0
    assert MINDSPORE.group_ranks(object()) is None and MINDSPORE.grad_reader(True) is None
    with pytest.raises(ConfigError, match=r"^set_monitor\(tp_group=...\): needs mindspore.communication"):
        MINDSPORE.group_rank(object(), "set_monitor(tp_group=...)")
