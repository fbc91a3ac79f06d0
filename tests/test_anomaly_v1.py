"""Acting during the run with Monitor V1 (issue #36: "and V1 where its alert rules already run"):
the ``anomaly`` block of a V1 config on real training. A NaN gradient stops before its update
with the parameters and Adam's state bitwise those after the last healthy step; a ×100 spike
reaches the callback worded as ``trainprobe diagnose``'s first line of the V1 run; the dump
action writes the next steps for ``trainprobe compare``; a healthy run gets no event; V1's own
alert rules still write their ``anomaly.json``; two gloo ranks stop at the same step."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from test_distributed_v2 import launch
from test_v1_support import make_v1
from trainprobe import AnomalyStop, ConfigError
from trainprobe.demo.gpt import GPTConfig, TinyGPT, synthetic_batches
from trainprobe.engine.anomaly.events import AnomalyEvent, read_events
from trainprobe.frontdoors.monitor_v1 import TrainerMon

CFG = GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_heads=2, n_layers=2)
OPS = ["min", "max", "mean", "norm", "nans"]
NAN_PARAM = "layers.0.mlp.fc2.weight"
SPIKE_PARAM = "layers.1.mlp.fc1.weight"


def _config(anomaly: dict[str, Any] | None, **fields: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "targets": {},
        "wg_distribution": True,
        "mv_distribution": True,
        "ops": OPS,
        "step_count_per_record": 8,
        **fields,
    }
    if anomaly is not None:
        cfg["anomaly"] = anomaly
    return cfg


def _gpt() -> tuple[TinyGPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"p {n}": p.detach().clone() for n, p in model.named_parameters()}
    for i, state in enumerate(opt.state.values()):
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                out[f"s {i} {k}"] = v.clone()
    return out


def _loop(
    model: TinyGPT,
    opt: torch.optim.Optimizer,
    steps: int,
    *,
    nan_step: int | None = None,
    spike_step: int | None = None,
    after: dict[int, Any] | None = None,
) -> None:
    batches = synthetic_batches(CFG, batch_size=4, seed=0)
    params = dict(model.named_parameters())
    for step in range(steps):
        model.loss(next(batches)).backward()
        if step == nan_step:
            params[NAN_PARAM].grad[0, 0] = math.nan
        if step == spike_step:
            params[SPIKE_PARAM].grad *= 100
        opt.step()
        opt.zero_grad()
        if after is not None:
            after[step] = _snapshot(model, opt)


def _run_folder(tmp_path: Path, rank: int = 0) -> Path:
    found = [p for p in (tmp_path / "out").iterdir() if f"-rank{rank}-" in p.name]
    assert len(found) == 1, found
    return found[0]


def test_a_nan_gradient_stops_at_its_step_before_the_update(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = _gpt()
    anomaly = {"rules": ["nonfinite"], "actions": ["log", "stop"], "before_update": True}
    mon = make_v1(tmp_path, monkeypatch, _config(anomaly), params_have_main_grad=False)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    after: dict[int, Any] = {}
    with pytest.raises(AnomalyStop, match=rf"stopped the run at step 7: step 7, rank 0, grad_reduced {NAN_PARAM}: min = nan") as stop:
        _loop(model, opt, 12, nan_step=7, after=after)
    assert stop.value.step == 7 and stop.value.ranks == (0,)
    assert sorted(after) == list(range(7))
    now = _snapshot(model, opt)
    assert now.keys() == after[6].keys()
    for key, value in after[6].items():
        assert torch.equal(now[key], value), key  # parameters and Adam's state as after step 6
    assert not model._forward_pre_hooks and not opt._optimizer_step_pre_hooks  # the monitor stopped itself
    mon.stop()
    events = read_events(_run_folder(tmp_path))
    assert [e["step"] for e in events] == [7] and events[0]["actions"] == ["log", "stop"]
    from trainprobe.tools.diagnosis.answer import diagnose

    answer = diagnose(tmp_path / "out")
    assert answer.line() == "first anomaly: " + events[0]["line"]
    assert answer.online.line() == f"online: 1 event(s) during the run; the run was stopped at step 7 (rank 0: grad_reduced {NAN_PARAM}: min = nan (NaN/inf))"


def test_a_spike_reaches_the_callback_worded_as_diagnoses_first_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = _gpt()
    seen: list[AnomalyEvent] = []
    cfg = _config({"spike_rule": "median", "actions": ["log"]}, xy_distribution=True, all_xy=True)
    with make_v1(tmp_path, monkeypatch, cfg, params_have_main_grad=False, on_anomaly=seen.append) as mon:
        mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
        _loop(model, opt, 24, spike_step=14)
        assert mon.anomaly_events == seen
    from trainprobe.tools.diagnosis.answer import diagnose

    assert seen and (seen[0].step, seen[0].kind, seen[0].table, seen[0].name) == (14, "spike", "grad_reduced", SPIKE_PARAM)
    answer = diagnose(tmp_path / "out", rule="median")
    assert answer.line() == "first anomaly: " + seen[0].line()
    per_step: dict[int, int] = {}
    for event in seen:
        per_step[event.step] = per_step.get(event.step, 0) + 1
    assert max(per_step.values()) <= 2  # at most one event per kind and step
    assert [e["line"] for e in read_events(_run_folder(tmp_path))] == [e.line() for e in seen]
    assert any(line.startswith(f"online: {len(seen)} event(s) during the run; the first: step 14") for line in answer.lines())


def test_the_dump_action_writes_the_next_steps_and_compare_reads_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = _gpt()
    cfg = _config({"rules": ["nonfinite"], "actions": ["dump"], "dump": {"steps": 2}})
    with make_v1(tmp_path, monkeypatch, cfg, params_have_main_grad=False) as mon:
        mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
        _loop(model, opt, 18, nan_step=14)
    dump = tmp_path / "out" / "anomaly_dump"
    assert sorted(p.name for p in dump.iterdir()) == ["step15", "step16"]
    for step in ("step15", "step16"):
        found = list((dump / step).glob("*/dump.json"))
        assert len(found) == 1
        assert any(name.startswith("Functional.linear") for name in json.loads(found[0].read_text())["data"])
    from trainprobe.dump.compare import compare_dumps

    assert compare_dumps(dump / "step15", dump / "step16", tmp_path / "cmp")
    assert read_events(_run_folder(tmp_path))[0]["step"] == 14


def test_a_healthy_run_gets_no_event_and_the_alert_rules_still_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = _gpt()
    seen: list[AnomalyEvent] = []
    alert = {"rules": [{"rule_name": "AnomalyNan"}], "dump": True}
    cfg = _config({"actions": ["log", "stop"], "before_update": True}, alert=alert)
    with make_v1(tmp_path, monkeypatch, cfg, params_have_main_grad=False, on_anomaly=seen.append) as mon:
        mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
        _loop(model, opt, 30)
    assert seen == [] and read_events(_run_folder(tmp_path)) == []
    model, opt = _gpt()
    cfg = _config({"rules": ["nonfinite"], "actions": ["log"]}, alert=alert)
    with make_v1(tmp_path / "nan", monkeypatch, cfg, params_have_main_grad=False) as mon:
        mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
        _loop(model, opt, 9, nan_step=7)
    alerts = json.loads((tmp_path / "nan" / "out" / "anomaly_detected" / "rank0" / "anomaly.json").read_text())
    assert alerts and {entry["step"] for entry in alerts.values()} >= {7}  # V1's own alert dump unchanged
    assert [e["step"] for e in read_events(_run_folder(tmp_path / "nan"))][0] == 7


def test_bad_blocks_fail_at_start_naming_the_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"anomaly.actions\[0\]: 'halt' is not one of"):
        make_v1(tmp_path, monkeypatch, _config({"actions": ["halt"]}))
    with pytest.raises(ConfigError, match=r"anomaly.spike_factor: must be"):
        make_v1(tmp_path, monkeypatch, _config({"spike_factor": -1}))
    with pytest.raises(ConfigError, match=r'anomaly.before_update: .*needs "wg_distribution": true'):
        make_v1(tmp_path, monkeypatch, _config({"before_update": True}, wg_distribution=False))
    with pytest.raises(ConfigError, match=r"on_anomaly: must be callable"):
        make_v1(tmp_path, monkeypatch, _config({}), on_anomaly=3)
    with pytest.raises(ConfigError, match=r'on_anomaly: needs an "anomaly" block'):
        make_v1(tmp_path, monkeypatch, _config(None), on_anomaly=print)
    with pytest.raises(TypeError):
        TrainerMon(str(tmp_path / "monitor_config.json"), None, False, None, print)  # type: ignore[misc]


def _two_ranks(rank: int, out: str) -> None:
    os.environ["MONITOR_OUTPUT_DIR"] = out
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    path = Path(out).parent / f"v1_rank{rank}.json"
    path.write_text(json.dumps(_config({"rules": ["nonfinite"], "actions": ["stop"]}, mv_distribution=False)))
    mon = TrainerMon(str(path), params_have_main_grad=False)
    mon.set_monitor(ddp, grad_acc_steps=1, optimizer=opt)
    steps_done = 0
    try:
        for step in range(10):
            ddp(torch.randn(4, 6, generator=torch.Generator().manual_seed(step * 2 + rank))).pow(2).mean().backward()
            if rank == 1 and step == 5:
                model[0].weight.grad[0, 0] = math.nan  # only rank 1's reduced gradient breaks
            opt.step()
            opt.zero_grad()
            steps_done += 1
    except AnomalyStop as stop:
        assert stop.step == 5 and stop.ranks == (1,), (rank, stop.step, stop.ranks)
        assert steps_done == 5
        assert bool(stop.events) == (rank == 1)  # rank 0 saw nothing itself: it stops because rank 1 did
    else:
        raise AssertionError("no AnomalyStop")
    finally:
        mon.stop()
    dist.barrier()


def test_two_ranks_stop_at_the_same_step(tmp_path: Path) -> None:
    launch(_two_ranks, str(tmp_path / "out"), timeout=240)
    events = {rank: read_events(_run_folder(tmp_path, rank)) for rank in (0, 1)}
    assert events[0] == [] and [e["step"] for e in events[1]] == [5]
    from trainprobe.tools.diagnosis.answer import diagnose

    answer = diagnose(tmp_path / "out")
    assert answer.first is not None and (answer.first.rank, answer.first.step) == (1, 5)
    assert answer.line() == "first anomaly: " + events[1][0]["line"]
