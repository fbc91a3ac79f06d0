"""``trainprobe diagnose`` shows the events the online rules wrote during a run
(``rank_<r>/anomaly_events.jsonl``): real runs of a tiny GPT under Monitor V2 with an
``anomaly`` block (a NaN gradient at step 7 stopping the run before its update; a x100 spike
logged), and none for a run without the block."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from trainprobe import AnomalyStop, TrainerMonitorV2
from trainprobe.demo.gpt import GPTConfig, TinyGPT, synthetic_batches
from trainprobe.engine.anomaly.events import read_events
from trainprobe.tools.diagnosis.answer import diagnose

pytest.importorskip("duckdb")
CFG = GPTConfig(vocab_size=100, seq_len=16, d_model=32, n_heads=2, n_layers=2)
OPS = ["min", "max", "mean", "norm", "nans"]
NAN_PARAM = "layers.0.mlp.fc2.weight"


def _train(out: Path, anomaly: dict[str, Any] | None, *, nan_step: int | None = None, spike_step: int | None = None) -> None:
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    config: dict[str, Any] = {
        "output_dir": str(out), "step_count_per_record": 8,
        "monitors": {t: {"enabled": True, "ops": OPS} for t in ("module", "weight_grad", "optimizer", "param")},
    }
    if anomaly is not None:
        config["anomaly"] = anomaly
    mon = TrainerMonitorV2(config)
    mon.start(model=model, optimizer=opt)
    params = dict(model.named_parameters())
    batches = synthetic_batches(CFG, batch_size=4, seed=0)
    try:
        for step in range(16):
            model.loss(next(batches)).backward()
            if step == nan_step:
                params[NAN_PARAM].grad[0, 0] = math.nan
            if step == spike_step:
                params["layers.1.mlp.fc1.weight"].grad *= 100
            opt.step()
            opt.zero_grad()
    finally:
        mon.stop()


def test_a_stopped_run_shows_its_online_event(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with pytest.raises(AnomalyStop, match="at step 7"):
        _train(run, {"rules": ["nonfinite"], "actions": ["log", "stop"], "before_update": True}, nan_step=7)
    [event] = read_events(run / "rank_0")
    result = diagnose(run)
    expected = (
        "online: 1 event(s) during the run; the run was stopped at step 7 "
        f"(rank 0: weight_grad/reduced {NAN_PARAM}: min = nan (NaN/inf))"
    )
    assert result.online.line() == expected
    assert expected in result.lines()
    assert result.line() == "first anomaly: " + event["line"]
    doc = result.to_json()
    assert doc["online"]["line"] == expected and doc["online"]["events"] == [event]
    assert doc["online"]["events"][0]["actions"] == ["log", "stop"] and doc["online"]["events"][0]["value"] == "nan"
    done = subprocess.run([sys.executable, "-m", "trainprobe", "diagnose", str(run), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and expected in done.stdout.splitlines(), done.stdout + done.stderr
    assert json.loads((tmp_path / "out" / "diagnosis.json").read_text())["online"]["events"] == [event]


def test_logged_events_are_counted_and_the_first_named(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _train(run, {}, spike_step=12)
    events = read_events(run / "rank_0")
    assert events and events[0]["step"] == 12 and events[0]["rule"] == "recent_max"
    result = diagnose(run)
    line = result.online.line()
    assert line == f"online: {len(events)} event(s) during the run; the first: {events[0]['line']}"
    assert result.line() == "first anomaly: " + events[0]["line"]  # one rule, one answer


def test_a_run_without_online_rules_has_no_online_line(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _train(run, None)
    result = diagnose(run)
    assert result.online.line() is None and not any(line.startswith("online:") for line in result.lines())
    assert result.to_json()["online"] == {"line": None, "events": []}
    _train(tmp_path / "healthy", {})  # online rules on, nothing found: no event file is written
    assert not (tmp_path / "healthy" / "rank_0" / "anomaly_events.jsonl").exists()
    assert diagnose(tmp_path / "healthy").online.line() is None
