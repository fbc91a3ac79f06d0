"""Alerts: NaN and loss-spike anomalies are reported (console and anomaly.json); a clean run
raises none."""

from __future__ import annotations

import io
import json
import math

import pytest
import torch

from models import MLP
from test_v1_support import by_name, forget_warnings, make_v1, run_dir, table
from trainprobe.engine.records import RowKey, StepBatch
from trainprobe.frontdoors.monitor_v1.alerts import AlertDetector, PipelineContext
from trainprobe.frontdoors.monitor_v1.config import AlertRule


def train(tmp_path, monkeypatch, capsys, rules, *, nan_at=None, spike_at=None, steps=8, ops=("norm",)):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cfg = {"wg_distribution": True, "ops": list(ops), "alert": {"rules": rules, "dump": True}}
    mon = make_v1(tmp_path, monkeypatch, cfg)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    x = torch.randn(8, 6)
    for step in range(steps):
        loss = model(x).pow(2).mean()
        if step == spike_at:
            loss = loss * 100
        loss.backward()
        if step == nan_at:
            model.fc1.weight.grad[0, 0] = math.nan
        opt.step()
        opt.zero_grad()
    mon.stop()
    dump = tmp_path / "out" / "anomaly_detected" / "rank0" / "anomaly.json"
    return capsys.readouterr().out, (json.loads(dump.read_text()) if dump.exists() else {})


def test_nan_is_reported_and_dumped(tmp_path, monkeypatch, capsys):
    out, dump = train(tmp_path, monkeypatch, capsys, [{"rule_name": "AnomalyNan"}], nan_at=3, steps=4)
    assert out.count("trainprobe alert:") == 1
    assert "\033[" not in out  # not a terminal: no colour codes
    ((key, entry),) = dump.items()
    assert key.startswith("0:fc1.weight/rank0/post_grad_step_3_call_")
    assert entry["rank"] == 0 and entry["step"] == 3 and entry["pp_stage"] == 0 and entry["vpp_stage"] == 0
    assert entry["group_mates"] == [0] and entry["tag_name"] == "0:fc1.weight/rank0/post_grad"
    assert set(entry) == {
        "rank",
        "step",
        "micro_step",
        "pp_stage",
        "vpp_stage",
        "call_id",
        "tag_name",
        "message",
        "group_mates",
    }
    assert (
        "Rule AnomalyNan reports anomaly signal in ('0:fc1.weight/rank0/post_grad', 'norm') at step 3."
        == entry["message"]
    )


def test_loss_spike_is_reported_and_clean_run_is_not(tmp_path, monkeypatch, capsys):
    rules = [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}]
    out, dump = train(tmp_path / "clean", monkeypatch, capsys, rules)
    assert out == "" and dump == {}
    out, dump = train(tmp_path / "spike", monkeypatch, capsys, rules, spike_at=5)
    assert out.count("trainprobe alert:") == 8  # every gradient jumps x100, reduced and unreduced
    assert {e["step"] for e in dump.values()} == {5}
    assert all("AnomalyTurbulence" in e["message"] for e in dump.values())


def test_rules_in_order_first_fires_and_every_op_kept(tmp_path, monkeypatch, capsys):
    rules = [
        {"rule_name": "AnomalyNan", "args": {"threshold": 1e10}},
        {"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}},
    ]
    out, dump = train(tmp_path, monkeypatch, capsys, rules, nan_at=3, steps=4, ops=("min", "max", "norm", "nans"))
    ((entry),) = dump.values()
    assert entry["message"].startswith("Rule AnomalyNan reports anomaly signal in ")
    for op in ("min", "max", "norm", "nans"):
        assert f"'{op}')" in entry["message"]


def test_detector_units_turbulence_both_directions_and_threshold_nan():
    ctx = PipelineContext(rank=1, pp_stage=1, group_mates=(0, 1))
    stream = io.StringIO()
    det = AlertDetector(
        (AlertRule(rule_name="AnomalyTurbulence", threshold=0.5), AlertRule(rule_name="AnomalyNan", threshold=100.0)),
        {"grad_reduced": ("norm", "max")},
        lambda m, k: "grad_reduced",
        ctx,
        None,
        stream,
    )
    key = RowKey(0, "0:w", "reduced")
    found = []
    for step, norm, mx in [(0, 1.0, 1.0), (1, 1.2, 1.0), (2, 0.4, 1.0), (3, 1.0, 500.0)]:
        before = det.count
        det.write(StepBatch("weight_grad", step, [key], _host={0: [norm, mx]}))
        if det.count > before:
            found.extend(det.latest.values())
    assert [e["step"] for e in found] == [2, 3]  # 0.4 is more than 50% below the average 1.1; 500 > 100
    assert found[0]["message"].startswith("Rule AnomalyTurbulence") and found[1]["message"].startswith(
        "Rule AnomalyNan"
    )
    assert all(e["pp_stage"] == 1 and e["group_mates"] == [0, 1] for e in found)


def test_missing_gradient_is_never_an_anomaly(tmp_path, monkeypatch, capsys):
    model = MLP()
    model.unused = torch.nn.Linear(2, 2)  # in the optimizer, never gets a gradient
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rules = [{"rule_name": "AnomalyNan"}, {"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.9}}]
    cfg = {"wg_distribution": True, "ops": ["norm", "nans"], "alert": {"rules": rules, "dump": True}}
    mon = make_v1(tmp_path, monkeypatch, cfg)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    x = torch.randn(8, 6)
    for _ in range(3):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    mon.stop()
    assert "trainprobe alert" not in capsys.readouterr().out
    assert not (tmp_path / "out" / "anomaly_detected").exists()


class _Terminal(io.StringIO):
    """A text stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_console_line_is_coloured_only_on_a_terminal():
    rules = (AlertRule(rule_name="AnomalyNan", threshold=None),)
    batch = StepBatch("weight_grad", 0, [RowKey(0, "0:w", "reduced")], _host={0: [math.nan]})
    ctx = PipelineContext(rank=0, pp_stage=0, group_mates=(0,))
    lines = {}
    for kind, stream in (("tty", _Terminal()), ("file", io.StringIO())):
        det = AlertDetector(rules, {"grad_reduced": ("norm",)}, lambda m, k: "grad_reduced", ctx, None, stream)
        det.write(batch)
        lines[kind] = stream.getvalue()
    assert lines["tty"].startswith("\033[") and lines["tty"].count("\n") == 1
    assert "\033[" not in lines["file"] and lines["file"].startswith("trainprobe alert: Rule AnomalyNan")


def test_histogram_rows_are_not_judged():
    det = AlertDetector(
        (AlertRule(rule_name="AnomalyNan", threshold=1.0),),
        {"adam_update": ("norm",)},
        lambda m, k: k.scope,
        PipelineContext(rank=0, pp_stage=0, group_mates=(0,)),
        None,
        io.StringIO(),
    )
    det.write(StepBatch("ur_histogram", 0, [RowKey(0, "0:w", "adam_update_histogram")], _host={0: [0.0, 5.0, 9.0]}))
    assert det.count == 0 and det.latest == {}


def test_dump_stays_valid_json_and_keeps_every_anomaly(tmp_path):
    det = AlertDetector(
        (AlertRule(rule_name="AnomalyNan", threshold=None),),
        {"grad_reduced": ("norm",)},
        lambda m, k: "grad_reduced",
        PipelineContext(rank=0, pp_stage=0, group_mates=(0,)),
        tmp_path / "anomaly_detected" / "rank0",
        io.StringIO(),
    )
    path = tmp_path / "anomaly_detected" / "rank0" / "anomaly.json"
    keys = [RowKey(0, "0:a", "reduced"), RowKey(0, "0:b", "reduced")]
    for step in range(3):
        det.write(StepBatch("weight_grad", step, keys, _host={0: [math.nan], 1: [1.0 if step else math.nan]}))
        dump = json.loads(path.read_text())  # valid after every write
        assert len(dump) == det.count == step + 2
    assert sorted((e["step"], e["tag_name"]) for e in dump.values()) == [
        (0, "0:a/rank0/post_grad"),
        (0, "0:b/rank0/post_grad"),
        (1, "0:a/rank0/post_grad"),
        (2, "0:a/rank0/post_grad"),
    ]
    assert path.read_text().startswith('{\n    "0:a/rank0/post_grad_step_0_call_1": {\n        "rank": 0,')


class _Moe(torch.nn.Module):
    """A router and one expert that never receives a token: the expert runs on ``(0, 4)``."""

    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(4, 1)
        self.expert = torch.nn.Linear(4, 4)

    def forward(self, x):
        chosen = self.router(x).squeeze(1) > 1e9  # no token is routed to the expert
        out = x.clone()
        out[chosen] = self.expert(x[chosen])
        return out.pow(2).mean() + self.router(x).sum()


def test_empty_tensor_is_never_a_nan_anomaly(tmp_path, monkeypatch, capsys):
    model = _Moe()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cfg = {
        "xy_distribution": True,
        "all_xy": True,
        "wg_distribution": True,
        "ops": ["min", "max", "mean", "norm", "nans"],
        "alert": {"rules": [{"rule_name": "AnomalyNan", "args": {"threshold": 1e6}}], "dump": True},
    }
    mon = make_v1(tmp_path, monkeypatch, cfg)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    for _ in range(3):
        model(torch.randn(5, 4)).backward()
        opt.step()
        opt.zero_grad()
    mon.stop()
    assert "trainprobe alert" not in capsys.readouterr().out
    assert not (tmp_path / "out" / "anomaly_detected").exists()
    rows = by_name(table(run_dir(tmp_path), "actv"), "0:expert.input")
    assert len(rows) == 3  # the CSV keeps the empty-tensor convention
    assert all(r["min"] == r["max"] == r["mean"] == "nan" and r["norm"] == "0.0" and r["nans"] == "0" for r in rows)


def _nan_detector(ops):
    stream = io.StringIO()
    det = AlertDetector(
        (AlertRule(rule_name="AnomalyNan", threshold=None),),
        {"actv": ops},
        lambda m, k: "actv",
        PipelineContext(rank=0, pp_stage=0, group_mates=(0,)),
        None,
        stream,
    )
    return det, stream


def _judge(det, row):
    det.write(StepBatch("module", 0, [RowKey(0, "0:expert.input", "actv", 0)], _host={0: list(row)}))
    return det.count


@pytest.mark.parametrize(
    ("ops", "empty", "holding_nan"),
    [
        (("min", "norm"), (math.nan, 0.0), (math.nan, math.nan)),
        (("max", "mean", "nans"), (math.nan, math.nan, 0.0), (math.nan, math.nan, 2.0)),
        (("min", "nans"), (math.nan, 0.0), (math.nan, 1.0)),
        (("mean", "zeros", "norm"), (math.nan, 0.0, 0.0), (math.nan, 0.25, math.nan)),
    ],
)
def test_detector_tells_an_empty_tensor_from_a_nan_one(ops, empty, holding_nan):
    det, _ = _nan_detector(ops)
    assert _judge(det, empty) == 0
    assert _judge(det, holding_nan) == 1


def test_detector_warns_once_when_ops_cannot_tell_empty_from_nan(monkeypatch, caplog):
    forget_warnings(monkeypatch)
    det, stream = _nan_detector(("min", "max"))
    with caplog.at_level("WARNING", logger="trainprobe"):
        assert _judge(det, (math.nan, math.nan)) == 0
        assert _judge(det, (math.nan, math.nan)) == 0
        assert _judge(det, (1.0, math.nan)) == 1  # a finite min: the tensor has elements, its NaN max is real
    warnings = [r.getMessage() for r in caplog.records if "cannot tell" in r.getMessage()]
    assert len(warnings) == 1 and "add 'norm' or 'nans' to ops" in warnings[0]


def test_console_lines_carry_value_and_baseline_and_a_flood_is_summed_up():
    """One line per anomalous row with its value and baseline; the same row of later micro-batches
    folds into it; beyond MAX_LINES_PER_STEP rows of a step one summary line; the dump keeps all."""
    from trainprobe.frontdoors.monitor_v1.alerts import MAX_LINES_PER_STEP

    rules = (AlertRule(rule_name="AnomalyTurbulence", threshold=0.5),)
    ctx = PipelineContext(rank=0, pp_stage=0, group_mates=(0,))
    stream = io.StringIO()
    det = AlertDetector(rules, {"actv": ("norm",)}, lambda m, k: "actv", ctx, None, stream)
    names = [f"0:layer{i}.output" for i in range(MAX_LINES_PER_STEP + 5)]

    def batch(step: int, value: float, micro: int = 0) -> StepBatch:
        keys = [RowKey(0, n, "forward", micro) for n in names]
        return StepBatch("module", step, keys, _host={i: [value] for i in range(len(keys))})

    for step in range(3):
        det.write(batch(step, 1.0, micro=0))
        det.write(batch(step, 1.0, micro=1))
    assert stream.getvalue() == ""
    det.write(batch(3, 100.0, micro=0))
    det.write(batch(3, 100.0, micro=1))  # the same rows, next micro-batch
    lines = stream.getvalue().splitlines()
    assert len(lines) == MAX_LINES_PER_STEP + 2
    assert (
        lines[0]
        == "trainprobe alert: Rule AnomalyTurbulence at step 3: 0:layer0.output:0/rank0/actv norm = 100 (baseline 1)"
    )
    assert lines[MAX_LINES_PER_STEP] == "trainprobe alert: step 3: 5 more anomalies (anomaly.json has all)"
    assert lines[-1] == f"trainprobe alert: step 3: {len(names)} more anomalies (anomaly.json has all)"
    assert det.count == 2 * len(names)


def test_a_nan_that_stays_prints_one_line_per_step_then_a_summary(tmp_path, monkeypatch, capsys):
    """A NaN weight poisons every later step: the first bad step names each row, each later step
    prints one line for the rule, the end of the run one summary; anomaly.json keeps every event."""
    rules = [{"rule_name": "AnomalyNan", "args": {"threshold": 1e10}}]
    out, dump = train(tmp_path, monkeypatch, capsys, rules, nan_at=2, steps=8, ops=("min", "norm", "nans"))
    lines = [line for line in out.splitlines() if line.startswith("trainprobe alert:")]
    per_step = {s: sum(e["step"] == s for e in dump.values()) for s in range(8)}
    assert per_step[0] == per_step[1] == 0 and all(per_step[s] > 0 for s in range(3, 8))
    first = [line for line in lines if "at step 2:" in line]
    assert len(first) == per_step[2] and all("baseline" not in line for line in first)
    for step in range(3, 8):
        assert [line for line in lines if f"at step {step}:" in line] == [
            f"trainprobe alert: Rule AnomalyNan at step {step}: {per_step[step]} anomalies again, "
            f"e.g. {min((e for e in dump.values() if e['step'] == step), key=lambda e: e['call_id'])['tag_name']} "
            "(anomaly.json has all)"
        ]
    assert lines[-1] == (
        f"trainprobe alert: Rule AnomalyNan: {len(dump)} anomalies over 6 steps (2-7); anomaly.json has all"
    )
    assert len(lines) == per_step[2] + 5 + 1


def test_a_streak_that_stops_is_summed_up_when_the_next_clean_step_is_over():
    """Steps 1-3 hold NaN, step 4 is clean: step 1 names its rows, steps 2 and 3 one line each,
    and the summary comes once step 4 is over (the first batch of step 5 arrives), before any
    line of step 5; a single-step streak (step 6) needs no summary."""
    det, stream = _nan_detector(("norm",))
    names = ["0:a.input", "0:b.input"]

    def step(s: int, value: float) -> None:
        keys = [RowKey(0, n, "actv", 0) for n in names]
        det.write(StepBatch("module", s, keys, _host={i: [value] for i in range(len(keys))}))

    for s, value in [(0, 1.0), (1, math.nan), (2, math.nan), (3, math.nan), (4, 1.0), (5, 1.0), (6, math.nan)]:
        step(s, value)
    det.close()
    lines = [line.removeprefix("trainprobe alert: ") for line in stream.getvalue().splitlines()]
    assert lines == [
        "Rule AnomalyNan at step 1: 0:a.input:0/rank0/actv norm = nan",
        "Rule AnomalyNan at step 1: 0:b.input:0/rank0/actv norm = nan",
        "Rule AnomalyNan at step 2: 2 anomalies again, e.g. 0:a.input:0/rank0/actv (anomaly.json has all)",
        "Rule AnomalyNan at step 3: 2 anomalies again, e.g. 0:a.input:0/rank0/actv (anomaly.json has all)",
        "Rule AnomalyNan: 6 anomalies over 3 steps (1-3); anomaly.json has all",
        "Rule AnomalyNan at step 6: 0:a.input:0/rank0/actv norm = nan",
        "Rule AnomalyNan at step 6: 0:b.input:0/rank0/actv norm = nan",
    ]
    assert det.count == 8
