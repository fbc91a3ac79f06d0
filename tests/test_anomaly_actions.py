"""Acting during the run (Monitor V2's ``anomaly`` block) on real training: stop before the bad
update, the callback's events worded as diagnose's first line, the dump of the next steps read by
``compare``, Lightning stopping its trainer, a healthy run left alone, and two gloo ranks stopping
at the same step."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from test_distributed_v2 import launch
from trainprobe import AnomalyStop, ConfigError, TrainerMonitorV2
from trainprobe.demo.gpt import GPTConfig, TinyGPT, synthetic_batches
from trainprobe.engine.anomaly.events import AnomalyEvent, read_events

CFG = GPTConfig(vocab_size=100, seq_len=16, d_model=32, n_heads=2, n_layers=2)
OPS = ["min", "max", "mean", "norm", "nans"]
NAN_PARAM = "layers.0.mlp.fc2.weight"
SPIKE_PARAM = "layers.1.mlp.fc1.weight"


def _config(out: Path, anomaly: dict[str, Any], tables: tuple[str, ...] = ("module", "weight_grad", "optimizer", "param")) -> dict[str, Any]:
    return {
        "output_dir": str(out),
        "step_count_per_record": 8,
        "monitors": {t: {"enabled": True, "ops": OPS} for t in tables},
        "anomaly": anomaly,
    }


def _gpt() -> tuple[TinyGPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def _loop(
    model: TinyGPT,
    opt: torch.optim.Optimizer,
    steps: int,
    *,
    nan_step: int | None = None,
    spike_step: int | None = None,
    after: dict[int, Any] | None = None,
) -> int:
    """Train; returns the steps done. ``after[s]`` receives a copy of the state after step s."""
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
    return steps


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"p {n}": p.detach().clone() for n, p in model.named_parameters()}
    for i, state in enumerate(opt.state.values()):
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                out[f"s {i} {k}"] = v.clone()
    return out


def test_a_nan_gradient_stops_at_its_step_before_the_update(tmp_path: Path) -> None:
    model, opt = _gpt()
    mon = TrainerMonitorV2(_config(tmp_path / "run", {"rules": ["nonfinite"], "actions": ["log", "stop"], "before_update": True}))
    mon.start(model=model, optimizer=opt)
    after: dict[int, Any] = {}
    with pytest.raises(AnomalyStop, match=r"stopped the run at step 7: step 7, rank 0, weight_grad/reduced layers.0.mlp.fc2.weight: min = nan") as stop:
        _loop(model, opt, 12, nan_step=7, after=after)
    assert stop.value.step == 7 and stop.value.ranks == (0,) and stop.value.events[0].kind == "nonfinite"
    assert sorted(after) == list(range(7))
    now = _snapshot(model, opt)
    assert now.keys() == after[6].keys()
    for key, value in after[6].items():
        assert torch.equal(now[key], value), key  # the parameters and Adam's state are those after step 6
    mon.stop()
    events = read_events(tmp_path / "run" / "rank_0")
    assert [e["step"] for e in events] == [7] and events[0]["actions"] == ["log", "stop"]
    from trainprobe.tools.diagnosis.answer import diagnose

    assert diagnose(tmp_path / "run").line() == "first anomaly: " + events[0]["line"]


def test_without_before_update_the_stop_comes_after_the_steps_update(tmp_path: Path) -> None:
    model, opt = _gpt()
    mon = TrainerMonitorV2(_config(tmp_path / "run", {"rules": ["nonfinite"], "actions": ["stop"]}))
    mon.start(model=model, optimizer=opt)
    with pytest.raises(AnomalyStop, match="at step 7"):
        _loop(model, opt, 12, nan_step=7)
    assert torch.isnan(dict(model.named_parameters())[NAN_PARAM]).any()  # the NaN step was applied
    mon.stop()


def test_a_spike_reaches_the_callback_worded_as_diagnoses_first_line(tmp_path: Path) -> None:
    model, opt = _gpt()
    seen: list[AnomalyEvent] = []
    cfg = _config(tmp_path / "run", {"spike_rule": "median", "actions": ["log"]})
    with TrainerMonitorV2(cfg, on_anomaly=seen.append) as mon:
        mon.start(model=model, optimizer=opt)
        _loop(model, opt, 24, spike_step=14)
    from trainprobe.tools.diagnosis.answer import diagnose

    assert seen and seen[0].step == 14 and seen[0].kind == "spike"
    assert diagnose(tmp_path / "run", rule="median").line() == "first anomaly: " + seen[0].line()
    per_step: dict[int, int] = {}
    for event in seen:
        per_step[event.step] = per_step.get(event.step, 0) + 1
    assert max(per_step.values()) <= 2  # at most one event per kind and step
    assert [e["line"] for e in read_events(tmp_path / "run" / "rank_0")] == [e.line() for e in seen]


def test_the_dump_action_writes_the_next_steps_and_compare_reads_them(tmp_path: Path) -> None:
    model, opt = _gpt()
    cfg = _config(tmp_path / "run", {"rules": ["nonfinite"], "actions": ["log", "dump"], "dump": {"steps": 2}})
    with TrainerMonitorV2(cfg) as mon:
        mon.start(model=model, optimizer=opt)
        _loop(model, opt, 20, nan_step=14)
    dump = tmp_path / "run" / "anomaly_dump"
    assert sorted(p.name for p in dump.iterdir()) == ["step15", "step16"]
    for step in ("step15", "step16"):
        found = list((dump / step).glob("*/dump.json"))
        assert len(found) == 1
        records = json.loads(found[0].read_text())["data"]
        assert any(name.startswith("Functional.linear") for name in records), list(records)[:5]
    from trainprobe.dump.compare import compare_dumps

    results = compare_dumps(dump / "step15", dump / "step15", tmp_path / "cmp")
    assert results and list((tmp_path / "cmp").iterdir())
    from trainprobe.tools import diagnose

    first = diagnose(tmp_path / "run").first  # the dumps inside the run do not make it a dump
    assert first is not None and (first.step, first.kind) == (14, "nonfinite")
    with pytest.raises(ConfigError, match="is a precision dump"):
        diagnose(dump)  # the dump folder itself is one


def test_a_healthy_run_gets_no_event(tmp_path: Path) -> None:
    model, opt = _gpt()
    seen: list[AnomalyEvent] = []
    cfg = _config(tmp_path / "run", {"actions": ["log", "stop"], "before_update": True})
    with TrainerMonitorV2(cfg, on_anomaly=seen.append) as mon:
        mon.start(model=model, optimizer=opt)
        _loop(model, opt, 30)
    assert seen == [] and read_events(tmp_path / "run" / "rank_0") == []


def test_bad_blocks_fail_at_start_naming_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"anomaly.actions\[0\]: 'halt' is not one of"):
        TrainerMonitorV2(_config(tmp_path, {"actions": ["halt"]}))
    with pytest.raises(ConfigError, match=r"anomaly.before_update: needs monitors.weight_grad"):
        TrainerMonitorV2(_config(tmp_path, {"before_update": True}, tables=("module",)))
    with pytest.raises(ConfigError, match=r"on_anomaly: must be callable"):
        TrainerMonitorV2(_config(tmp_path, {}), on_anomaly=3)  # type: ignore[arg-type]


def _two_ranks(rank: int, out: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    cfg = _config(Path(out), {"rules": ["nonfinite"], "actions": ["stop"], "before_update": True}, ("module", "weight_grad"))
    mon = TrainerMonitorV2(cfg)
    mon.start(model=ddp, optimizer=opt)
    steps_done = 0
    try:
        for step in range(10):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step * 2 + rank))
            if rank == 1 and step == 5:
                x[0, 0] = math.nan  # rank 1's batch breaks in forward
            ddp(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            steps_done += 1
    except AnomalyStop as stop:
        assert stop.step == 5 and stop.ranks == (0, 1)
        assert steps_done == 5
        mine = stop.events[0]
        if rank == 1:  # its batch broke: its first row is the model's forward input
            assert (mine.table, mine.scope, mine.name) == ("module", "forward", ".input.0")
        else:  # its own forward and backward were fine: the all-reduced gradient brought the NaN
            assert (mine.table, mine.scope) == ("weight_grad", "reduced")
    else:
        raise AssertionError("no AnomalyStop")
    finally:
        mon.stop()
    dist.barrier()


def test_two_ranks_stop_at_the_same_step_and_the_broken_rank_reports_the_forward_row(tmp_path: Path) -> None:
    launch(_two_ranks, str(tmp_path / "run"), timeout=240)
    from trainprobe.tools.diagnosis.answer import diagnose

    answer = diagnose(tmp_path / "run")
    assert answer.first is not None and answer.first.rank == 1 and answer.first.step == 5
    first_rank1 = read_events(tmp_path / "run" / "rank_1")[0]
    assert answer.line() == "first anomaly: " + first_rank1["line"]


def test_lightning_stops_its_trainer_at_the_anomaly(tmp_path: Path) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from trainprobe.integrations.lightning import TrainProbeCallback

    class Broken(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            if self.trainer.global_step == 4:
                x = x.clone()
                x[0, 0] = math.nan
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=0.01)

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    module = Broken()
    cfg = _config(tmp_path / "run", {"rules": ["nonfinite"], "actions": ["stop"], "before_update": True}, ("module", "weight_grad"))
    trainer = pl.Trainer(
        max_steps=12, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[TrainProbeCallback(monitor_v2_config=cfg)],
        default_root_dir=str(tmp_path),
    )
    trainer.fit(module, data)
    assert trainer.should_stop
    assert all(torch.isfinite(p).all() for p in module.parameters())  # the NaN update was not applied
    events = read_events(tmp_path / "run" / "rank_0")
    assert events and events[0]["step"] == 5  # the callbacks number steps from 1: global step 4 + 1
