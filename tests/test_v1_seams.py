"""Monitor V1's seams: the backend comes from ``backend_for``, sinks are built with what they
need, a monitor that records nothing holds a null session, and folders are made through
``make_output_folder``."""

from __future__ import annotations

import io
import json

import pytest
import torch
from torch import nn

from models import MLP
from test_v1_support import make_v1
from trainprobe.backends.torch.backend import TORCH, read_main_grad
from trainprobe.engine.errors import ConfigError
from trainprobe.frontdoors.monitor_v1.alerts import AlertDetector, PipelineContext
from trainprobe.frontdoors.monitor_v1.config import AlertRule


def test_an_unknown_framework_is_a_config_error(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"^framework: 'tensorflow' is not one of pytorch, mindspore"):
        make_v1(tmp_path, monkeypatch, {"wg_distribution": True}, framework="tensorflow")


def test_torch_backend_reads_groups_and_main_grad_as_v1_did():
    """Without torch.distributed a group has no ranks to read and asking this rank's place in
    one names the argument; ``main_grad`` is read only when asked for, and only where it is a
    tensor."""
    assert TORCH.group_ranks(object()) is None
    with pytest.raises(ConfigError, match=r"^set_monitor\(dp_group=...\): needs torch.distributed to be initialised"):
        TORCH.group_rank(object(), "set_monitor(dp_group=...)")
    assert TORCH.grad_reader(False) is None and TORCH.grad_reader(True) is read_main_grad
    p = nn.Parameter(torch.ones(2))
    p.grad = torch.zeros(2)
    assert read_main_grad(p) is p.grad
    p.main_grad = torch.full((2,), 3.0)  # type: ignore[attr-defined]
    assert read_main_grad(p) is p.main_grad  # type: ignore[attr-defined]


def test_latest_step_keeps_its_own_ops_after_an_ops_change(tmp_path, monkeypatch):
    """``monitor.ops = [...]`` starts a session whose memory is built with the new ops; the
    latest collected step, still what ``generate_xy_metrics`` returns until the next one, is read
    with the ops it was collected with (the memory's ops were re-aimed before: the new op names
    labelled the old values)."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = make_v1(
        tmp_path, monkeypatch, {"xy_distribution": True, "all_xy": True, "format": "api", "ops": ["min", "max", "norm"]}
    )
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    out = {}
    model.fc1.register_forward_hook(lambda m, a, o: out.update(h=o.detach().double().clone()))
    model(torch.randn(4, 6)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    mon.ops = ["norm"]  # between steps: the next session starts now
    actv, _ = mon.generate_xy_metrics()
    row = actv["0:fc1.output:0"]
    assert set(row) == {"min", "max", "norm"}
    assert row["norm"] == pytest.approx(out["h"].norm().item(), rel=1e-6)
    assert row["min"] == pytest.approx(out["h"].min().item(), rel=1e-6)
    model(torch.randn(4, 6)).pow(2).mean().backward()
    opt.step()
    actv, _ = mon.generate_xy_metrics()
    assert set(actv["0:fc1.output:0"]) == {"norm"}  # the new session's step, with its ops
    mon.stop()


def test_alerts_go_on_across_a_reconfiguration(tmp_path, monkeypatch, capsys):
    """A session started by an ops change builds its detector with the new ops and takes over the
    previous one's running state: one ``anomaly.json`` with both steps' anomalies, call ids
    counting on."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # a weight that never changes: only the injected values fire
    cfg = {
        "wg_distribution": True,
        "ops": ["norm", "max"],
        "alert": {"rules": [{"rule_name": "AnomalyNan", "args": {"threshold": 1000.0}}], "dump": True},
    }
    mon = make_v1(tmp_path, monkeypatch, cfg)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    x = torch.randn(8, 6)
    for step in range(3):
        model(x).pow(2).mean().backward()
        if step in (0, 2):
            model.fc1.weight.grad[0, 0] = 1e6
        opt.step()
        opt.zero_grad()
        if step == 0:
            mon.ops = ["norm"]
    mon.stop()
    dump = json.loads((tmp_path / "out" / "anomaly_detected" / "rank0" / "anomaly.json").read_text())
    entries = [e for e in dump.values() if e["tag_name"] == "0:fc1.weight/rank0/post_grad"]
    assert [e["step"] for e in entries] == [0, 2]
    assert entries[0]["message"].endswith("('0:fc1.weight/rank0/post_grad', 'max') at step 0.")
    assert entries[1]["message"].endswith("('0:fc1.weight/rank0/post_grad', 'norm') at step 2.")
    assert entries[1]["call_id"] > entries[0]["call_id"]


def test_a_detector_goes_on_only_from_one_with_the_same_settings(tmp_path):
    ctx = PipelineContext(rank=0, pp_stage=0, group_mates=(0,))
    nan = (AlertRule(rule_name="AnomalyNan", threshold=None),)
    first = AlertDetector(nan, {"actv": ("norm",)}, lambda m, k: "actv", ctx, tmp_path, io.StringIO())
    with pytest.raises(ValueError, match="other rules or another dump folder"):
        AlertDetector(nan, {"actv": ("norm",)}, lambda m, k: "actv", ctx, None, io.StringIO(), earlier=first)


def test_a_monitor_that_collects_nothing_runs_the_one_null_session(tmp_path, monkeypatch):
    """Before its window, after it, and with dynamic mode off, a V1 monitor's session is the run's
    one null session (chosen when ``set_monitor`` attaches): its steps move the clock, its
    metrics are empty, and stopping it is a no-op."""
    from trainprobe.engine.session import NullSession

    monkeypatch.setenv("DYNAMIC_MONITOR", "True")
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = make_v1(tmp_path, monkeypatch, {"wg_distribution": True, "dynamic_on": False})
    assert isinstance(mon._control.session, NullSession)  # nothing attached yet
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt, start_iteration=5)
    idle = mon._control.session
    assert isinstance(idle, NullSession) and idle.clock is mon._attachment.clock
    for _ in range(2):
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert mon._control.session is idle and mon.current_step == 7
    assert mon.generate_wgrad_metrics() == ({}, {}) and mon.generate_xy_metrics() == ({}, {})
    mon.stop()
    assert mon._control.session is idle and not (tmp_path / "out").exists()


def _blocker(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    return blocker


@pytest.mark.parametrize(
    "bad",
    [
        lambda root: _blocker(root) / "out" / "rank0",  # under a file
        lambda root: _blocker(root),  # a file itself
        lambda root: root / ("x" * 300) / "rank0",  # a name too long
        lambda root: root / "nul\0here",
    ],
)
def test_check_output_folder_raises_what_make_output_folder_would_and_creates_nothing(tmp_path, bad):
    from trainprobe.engine.folders import check_output_folder, make_output_folder

    path = bad(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(ConfigError) as checked:
        check_output_folder(path, "FIELD")
    assert sorted(tmp_path.rglob("*")) == before
    with pytest.raises(ConfigError) as made:
        make_output_folder(path, "FIELD")
    assert str(checked.value) == str(made.value) and str(made.value).startswith("FIELD: ")


def test_check_output_folder_accepts_a_new_or_existing_folder_and_creates_nothing(tmp_path):
    from trainprobe.engine.folders import check_output_folder

    assert check_output_folder(tmp_path / "a" / "b", "FIELD") == tmp_path / "a" / "b"
    assert check_output_folder(tmp_path, "FIELD") == tmp_path
    assert not (tmp_path / "a").exists()


def test_an_unusable_anomaly_folder_fails_set_monitor(tmp_path, monkeypatch):
    """``alert.dump``'s ``anomaly_detected/rank<r>`` is created with the first anomaly, through
    ``make_output_folder``; a path that cannot be created is a ConfigError at ``set_monitor``
    (it was an error logged at the first anomaly), also with ``format: api``, which creates
    nothing at start."""
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rules = {"rules": [{"rule_name": "AnomalyNan"}], "dump": True}
    mon = make_v1(tmp_path, monkeypatch, {"wg_distribution": True, "format": "api", "alert": rules})
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(_blocker(tmp_path) / "out"))
    with pytest.raises(ConfigError, match=r"^MONITOR_OUTPUT_DIR: cannot create the output folder .*a_file/out/anomaly"):
        mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


def test_an_unusable_module_struct_folder_fails_set_monitor(tmp_path, monkeypatch):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = make_v1(tmp_path, monkeypatch, {"print_struct": True})
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "module_struct").write_text("a file")
    with pytest.raises(
        ConfigError, match=r"^MONITOR_OUTPUT_DIR: cannot create the output folder .*module_struct/rank0"
    ):
        mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


def test_random_save_to_an_unusable_folder_is_a_config_error_at_the_call(tmp_path):
    from trainprobe.dump import seed

    try:
        with pytest.raises(ConfigError, match=r"^random_save\(output_path=...\): cannot create the output folder"):
            seed.random_save(_blocker(tmp_path) / "out")
        assert seed._random_log is None  # nothing was wrapped
    finally:
        if seed._random_log is not None:
            seed.restore_patches()


def test_compare_to_an_unusable_folder_fails_before_reading_the_dumps(tmp_path):
    from trainprobe.dump.compare import compare_dumps

    with pytest.raises(ConfigError, match=r"^output_path: cannot create the output folder .*a_file/out"):
        compare_dumps(tmp_path / "no_target", tmp_path / "no_golden", _blocker(tmp_path) / "out")
