"""The online rules (trainprobe.engine.anomaly) judge a run's rows as diagnose judges its files:
the config block's checks, and on a real V2 run (a NaN, a spike) the first online event is worded
as diagnose's first line."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from trainprobe import ConfigError, TrainerMonitorV2
from trainprobe.demo.gpt import GPTConfig, TinyGPT, synthetic_batches
from trainprobe.engine.anomaly.config import AnomalyConfig, parse_anomaly
from trainprobe.engine.anomaly.online import OnlineRules
from trainprobe.engine.fields import ConfigObject
from trainprobe.engine.records import RowKey

CFG = GPTConfig(vocab_size=100, seq_len=16, d_model=32, n_heads=2, n_layers=2)
OPS = ("min", "max", "mean", "norm", "nans")
TABLES = ("module", "weight_grad", "optimizer", "param")


def _parse(block: Any) -> AnomalyConfig | None:
    return parse_anomaly(ConfigObject({"anomaly": block}).section("anomaly"))


def test_the_block_defaults_and_each_bad_field_is_named() -> None:
    assert parse_anomaly(ConfigObject({}).section("anomaly")) is None
    cfg = _parse({})
    assert cfg is not None and cfg.rules == ("nonfinite", "spike") and cfg.actions == ("log",)
    assert not cfg.before_update and cfg.dump.steps == 1 and cfg.spike_factor is None
    full = _parse({"rules": ["spike"], "spike_rule": "median", "spike_factor": 5, "actions": ["log", "stop", "dump"],
                   "dump": {"steps": 2}, "before_update": True})
    assert full is not None and full.stops and full.dumps and full.spike().describe().startswith("median")
    with pytest.raises(ConfigError, match=r"anomaly.actions\[1\]: 'halt' is not one of log, stop, dump"):
        _parse({"actions": ["log", "halt"]})
    with pytest.raises(ConfigError, match=r"anomaly.before_updates: unknown field; did you mean 'before_update'\?"):
        _parse({"before_updates": True})
    with pytest.raises(ConfigError, match=r"anomaly.rules: must name at least one of nonfinite, spike"):
        _parse({"rules": []})
    with pytest.raises(ConfigError, match=r"anomaly.spike_factor: must be greater than 0"):
        _parse({"spike_factor": 0})
    with pytest.raises(ConfigError, match=r"anomaly.spike_factor: the spike rule 'ema_z' takes no factor"):
        _parse({"spike_rule": "ema_z", "spike_factor": 3})
    with pytest.raises(ConfigError, match=r"anomaly.dump: is set but \"dump\" is not in anomaly.actions"):
        _parse({"dump": {"steps": 2}})
    with pytest.raises(ConfigError, match=r"anomaly.dump.steps: .*1"):
        _parse({"actions": ["dump"], "dump": {"steps": 0}})
    with pytest.raises(ConfigError, match=r"anomaly.spike_rule: 'zclip' is not one of"):
        _parse({"spike_rule": "zclip"})


def _train(
    out: Path, *, spike_step: int | None, nan_step: int | None, steps: int = 24, anomaly: dict[str, Any] | None = None
) -> Path:
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = synthetic_batches(CFG, batch_size=4, seed=0)
    monitors = {t: {"enabled": True, "ops": list(OPS)} for t in TABLES}
    config: dict[str, Any] = {"output_dir": str(out), "step_count_per_record": 8, "monitors": monitors}
    if anomaly is not None:
        config["anomaly"] = anomaly
    mon = TrainerMonitorV2(config)
    mon.start(model=model, optimizer=opt)
    params = dict(model.named_parameters())
    for step in range(steps):
        model.loss(next(batches)).backward()
        if step == spike_step:
            params["layers.1.mlp.fc1.weight"].grad *= 100
        if step == nan_step:
            params["layers.0.mlp.fc2.weight"].grad[0, 0] = math.nan
        opt.step()
        opt.zero_grad()
    mon.stop()
    return out


def _replay(run: Path, rules: OnlineRules) -> list[Any]:
    """Feed the run's rows to ``rules`` step by step, each monitor's rows in file order."""
    from trainprobe.tools.query.layer import connect

    con = connect(run)
    by_step: dict[int, list[tuple[str, list[tuple[RowKey, list[float]]]]]] = {}
    for table in TABLES:
        cols = ", ".join(f'"{op}"' for op in OPS)
        rows = con.execute(
            f"SELECT step, vpp_stage, name, scope, micro_step, {cols} FROM {table} ORDER BY step, file, file_row"
        ).fetchall()
        per_step: dict[int, list[tuple[RowKey, list[float]]]] = {}
        for step, vpp, name, scope, micro, *values in rows:
            per_step.setdefault(step, []).append((RowKey(vpp, name, scope, micro), [float(v) for v in values]))
        for step, found in per_step.items():
            by_step.setdefault(step, []).append((table, found))
    events = []
    for step in sorted(by_step):
        for table, found in by_step[step]:
            rules.judge(table, step, OPS, found)
        events += rules.end_step(step)
    return events


@pytest.mark.parametrize(("spike", "nan"), [(14, None), (None, 7), (14, 18)])
def test_the_first_online_event_is_diagnoses_first_line(tmp_path: Path, spike: int | None, nan: int | None) -> None:
    from trainprobe.tools.diagnosis.answer import diagnose

    run = _train(tmp_path / "run", spike_step=spike, nan_step=nan)
    answer = diagnose(run, rule="median")
    events = _replay(run, OnlineRules(AnomalyConfig(spike_rule="median"), rank=0))
    assert answer.first is not None and events
    assert "first anomaly: " + events[0].line() == answer.line()
    assert events[0].step == (spike if spike is not None else nan)
    assert len([e for e in events if e.step == events[0].step and e.kind == events[0].kind]) == 1  # one per kind


def test_a_healthy_run_gets_no_event(tmp_path: Path) -> None:
    run = _train(tmp_path / "run", spike_step=None, nan_step=None)
    assert _replay(run, OnlineRules(AnomalyConfig(spike_rule="median"), rank=0)) == []
    assert _replay(run, OnlineRules(AnomalyConfig(), rank=0)) == []


@pytest.mark.parametrize(("spike", "nan"), [(14, None), (None, 7), (14, 18), (3, None)])
def test_with_default_configs_the_first_online_event_is_diagnoses_first_line(
    tmp_path: Path, spike: int | None, nan: int | None
) -> None:
    """``AnomalyConfig()`` and ``diagnose(run)``, both on their defaults (one rule, ``recent_max``):
    the events the monitor wrote during the run (an ``anomaly`` block of defaults) and the rows
    replayed afterwards both start with diagnose's first line, at the fault's step (a x100
    spike at step 3 too: no blind warm-up)."""
    from trainprobe.engine.anomaly.events import read_events
    from trainprobe.engine.rules import DEFAULT_RULE
    from trainprobe.tools.diagnosis.answer import diagnose

    assert AnomalyConfig().spike_rule == DEFAULT_RULE == "recent_max"
    run = _train(tmp_path / "run", spike_step=spike, nan_step=nan, anomaly={})
    answer = diagnose(run)
    assert answer.rule == DEFAULT_RULE and answer.first is not None
    written = read_events(run / "rank_0")
    replayed = _replay(run, OnlineRules(AnomalyConfig(), rank=0))
    assert written and replayed
    assert answer.line() == "first anomaly: " + written[0]["line"] == "first anomaly: " + replayed[0].line()
    assert written[0]["step"] == replayed[0].step == (spike if spike is not None else nan)
    assert [(e["step"], e["kind"]) for e in written] == [(e.step, e.kind) for e in replayed]
    if spike is not None:
        assert written[0]["rule"] == "recent_max" and written[0]["line"].endswith("(spike, recent_max)")
