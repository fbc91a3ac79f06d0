"""Dynamic mode: the six scenarios of the reference, driven by editing the config file mid-run."""

from __future__ import annotations

import json
import os

import torch

from models import MLP
from test_v1_support import make_v1, run_dir, table
from trainprobe.frontdoors.monitor_v1 import dynamic
from trainprobe.frontdoors.monitor_v1.dynamic import ConfigWatcher

_bump = [0]


def edit(path, **changes):
    """Change keys of the config file and move its modification time forward."""
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))
    _bump[0] += 1
    t = path.stat().st_mtime_ns + _bump[0] * 1_000_000_000
    os.utime(path, ns=(t, t))


class Run:
    def __init__(self, tmp_path, monkeypatch, config, dynamic=True):
        if dynamic:
            monkeypatch.setenv("DYNAMIC_MONITOR", "True")
        else:
            monkeypatch.delenv("DYNAMIC_MONITOR", raising=False)
        self.tmp_path = tmp_path
        self.model = MLP()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.mon = make_v1(tmp_path, monkeypatch, {"wg_distribution": True, **config})
        self.path = self.mon.config_file_path
        self.mon.set_monitor(self.model, grad_acc_steps=1, optimizer=self.opt)

    def steps(self, n):
        for _ in range(n):
            self.model(torch.randn(4, 6)).sum().backward()
            self.opt.step()
            self.opt.zero_grad()

    def collected(self):
        self.mon.stop()
        if not (self.tmp_path / "out").exists():
            return []
        return sorted({int(r["step"]) for r in table(run_dir(self.tmp_path), "grad_reduced")})


def test_scenario1_static_mode_ignores_dynamic_on(tmp_path, monkeypatch):
    run = Run(tmp_path, monkeypatch, {"dynamic_on": False, "collect_times": 2}, dynamic=False)
    run.steps(3)
    assert run.collected() == [0, 1]
    assert json.loads(run.path.read_text())["dynamic_on"] is False


def test_scenario2_dynamic_off_collects_nothing(tmp_path, monkeypatch):
    run = Run(tmp_path, monkeypatch, {})
    run.steps(3)
    assert run.collected() == []


def test_scenario3_dynamic_on_from_the_start(tmp_path, monkeypatch):
    run = Run(tmp_path, monkeypatch, {"dynamic_on": True, "collect_times": 2, "ndigits": 4})
    run.steps(5)
    assert run.collected() == [1, 2]
    data = json.loads(run.path.read_text())
    assert data["dynamic_on"] is False and data["ndigits"] == 4 and data["collect_times"] == 2


def test_scenario4_switched_on_mid_run(tmp_path, monkeypatch):
    run = Run(tmp_path, monkeypatch, {"dynamic_on": False, "collect_times": 2})
    run.steps(2)
    edit(run.path, dynamic_on=True)
    run.steps(4)
    assert run.collected() == [3, 4]


def test_scenario5_edit_while_collecting_restarts_count(tmp_path, monkeypatch):
    run = Run(tmp_path, monkeypatch, {"dynamic_on": True, "collect_times": 3})
    run.steps(2)  # steps 1 collected (started at 1)
    edit(run.path, ops=["max"])  # step 2 still with the old config, from step 3 the new one
    run.steps(5)
    assert run.collected() == [1, 2, 3, 4, 5]
    folder = run_dir(tmp_path)
    assert "max" in next(iter(folder.glob("grad_reduced_3-3.csv"))).read_text().splitlines()[0]


def test_scenario5_collect_times_zero_stops_early(tmp_path, monkeypatch):
    run = Run(tmp_path, monkeypatch, {"dynamic_on": True, "collect_times": 100})
    run.steps(2)
    edit(run.path, collect_times=0)
    run.steps(3)
    assert run.collected() == [1, 2]


def test_scenario6_restart_after_collect_times(tmp_path, monkeypatch):
    run = Run(tmp_path, monkeypatch, {"dynamic_on": True, "collect_times": 1})
    run.steps(3)
    assert json.loads(run.path.read_text())["dynamic_on"] is False
    edit(run.path, dynamic_on=True)
    run.steps(3)
    assert run.collected() == [1, 4]


def test_invalid_edit_keeps_current_config(tmp_path, monkeypatch, caplog):
    run = Run(tmp_path, monkeypatch, {"dynamic_on": True, "collect_times": 4})
    run.steps(2)
    edit(run.path, ops=["nrom"])
    with caplog.at_level("ERROR", logger="trainprobe"):
        run.steps(2)
    assert "the current configuration stays in force" in caplog.text and "ops[0]" in caplog.text
    assert run.collected() == [1, 2, 3]


def test_scenario5_edit_during_the_last_collected_step_is_applied(tmp_path, monkeypatch):
    """An edit read at the end of the last collected step restarts collection instead of being
    overwritten by the switch-off."""
    run = Run(tmp_path, monkeypatch, {"dynamic_on": True, "collect_times": 3})
    run.steps(3)  # steps 1, 2 collected; step 3 is the last one of collect_times 3
    edit(run.path, collect_times=2, ops=["max"])
    run.steps(5)
    assert run.collected() == [1, 2, 3, 4, 5]
    folder = run_dir(tmp_path)
    assert "norm" in (folder / "grad_reduced_3-3.csv").read_text().splitlines()[0]
    assert "max" in (folder / "grad_reduced_4-4.csv").read_text().splitlines()[0]
    data = json.loads(run.path.read_text())
    assert (data["dynamic_on"], data["collect_times"], data["ops"]) == (False, 2, ["max"])


def test_edit_while_switching_off_is_not_overwritten(tmp_path, monkeypatch):
    """The user saves the file just after the monitor read it at the end of collection: the
    switch-off leaves the edit alone and it applies from the next step."""
    run = Run(tmp_path, monkeypatch, {"dynamic_on": True, "collect_times": 1})
    watcher = run.mon._control.watcher
    poll = watcher.poll

    def poll_then_user_saves():
        fresh = poll()
        if not run.mon._control.collecting and not getattr(watcher, "saved", False):
            watcher.saved = True
            edit(run.path, collect_times=2, ops=["max"])
        return fresh

    monkeypatch.setattr(watcher, "poll", poll_then_user_saves)
    run.steps(6)
    assert run.collected() == [1, 2, 3]
    data = json.loads(run.path.read_text())
    assert (data["dynamic_on"], data["collect_times"], data["ops"]) == (False, 2, ["max"])


def test_switch_off_never_replaces_a_file_edited_while_writing(tmp_path, monkeypatch):
    """The file changes between reading it and replacing it: the user's file stays."""
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"dynamic_on": True, "wg_distribution": True}))
    watcher = ConfigWatcher(path)
    real_load = dynamic.load_json_object

    def load_then_user_saves(p):
        data = real_load(p)
        edit(path, ops=["max"])
        return data

    monkeypatch.setattr(dynamic, "load_json_object", load_then_user_saves)
    assert watcher.switch_off() is False
    assert json.loads(path.read_text()) == {"dynamic_on": True, "wg_distribution": True, "ops": ["max"]}
    assert not list(tmp_path.glob(".*.tmp")) and watcher.edited()
    monkeypatch.setattr(dynamic, "load_json_object", real_load)
    assert watcher.poll() is not None and watcher.switch_off() is True
    assert json.loads(path.read_text())["dynamic_on"] is False and not watcher.edited()


def test_invalid_edit_in_the_last_step_is_ignored(tmp_path, monkeypatch, caplog):
    """An invalid edit read at the end of the last collected step is ignored like any invalid
    edit: collection ends and dynamic_on is set to false, the user's other keys kept."""
    run = Run(tmp_path, monkeypatch, {"dynamic_on": True, "collect_times": 2})
    run.steps(2)
    edit(run.path, ops=["nrom"])
    with caplog.at_level("ERROR", logger="trainprobe"):
        run.steps(2)
    assert "the current configuration stays in force" in caplog.text
    data = json.loads(run.path.read_text())
    assert data["dynamic_on"] is False and data["ops"] == ["nrom"]
    edit(run.path, ops=["max"], dynamic_on=True)  # fixed and switched on again: read at the end of step 4
    run.steps(2)
    assert run.collected() == [1, 2, 5]
