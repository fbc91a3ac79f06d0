"""TrainingMetricsMonitor end to end on a tiny GPT: event files read back with TensorBoard's
reader, every value checked against an independent float64 computation."""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from test_metrics_helpers import TINY, read_events, scalars, texts, tiny_gpt
from trainprobe.demo.gpt import synthetic_batches
from trainprobe.engine.errors import ConfigError
from trainprobe.frontdoors.metrics import TrainingMetricsMonitor

BATCH = 4
F32 = 1.2e-7  # a float64 value stored as a float32 event: its rounding only (2**-24 = 6e-8, and the reference's)
F64 = 5e-7  # norms of rows of 256 in float32 combined in float64, as the monitors: a row's float32 sum is
# within ~log2(256) float32 roundings of exact, and its SIMD order differs between CPUs (1e-8 held on one
# machine and failed by 1.2e-8 on an AMD EPYC one; flat float32 needed 1e-6)


def full_config(tmp_path: Path, **monitor: Any) -> dict[str, Any]:
    return {
        "seed": 1234,
        "model": {"n_layers": 2},
        "monitor_config": {
            "monitor_on": True,
            "dump_path": str(tmp_path / "dump"),
            "target": ["layers\\.0\\."],
            "local_loss_format": ["log", "tensorboard"],
            "device_local_loss_format": "tensorboard",
            "local_norm_format": "tensorboard",
            "device_local_norm_format": ["log", "tensorboard"],
            "optimizer_state_format": "tensorboard",
            "weight_state_format": "tensorboard",
            "throughput_baseline": 2.5,
            **monitor,
        },
        "tensorboard": {
            "tensorboard_dir": str(tmp_path / "tb"),
            "tensorboard_queue_size": 3,
            "log_loss_scale_to_tensorboard": True,
            "log_timers_to_tensorboard": True,
            "log_expert_load_to_tensorboard": True,
        },
    }


def f64_norm(tensors: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.detach().double().pow(2).sum()) for t in tensors))


def test_every_metric_matches_independent_values(tmp_path: Path) -> None:
    model, opt = tiny_gpt()
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    mon = TrainingMetricsMonitor(full_config(tmp_path), model=model, optimizer=opt)
    batches = synthetic_batches(TINY, BATCH)
    counts = torch.tensor([3.0, 1.0, 0.0, 4.0])
    ref: dict[int, dict[str, Any]] = {}
    for step in range(1, 4):
        loss = model.loss(next(batches))
        loss.backward()
        r: dict[str, Any] = {"loss": loss.item(), "lr": opt.param_groups[0]["lr"]}
        r["grad_total"] = float(torch.nn.utils.get_total_norm([p.grad for p in params]))
        r["grad_f64"] = f64_norm([p.grad for p in params])
        r["local"] = {n: f64_norm([p.grad]) for n, p in zip(names, params)}
        opt.step()
        opt.zero_grad(set_to_none=True)
        r["m"] = {n: f64_norm([opt.state[p]["exp_avg"]]) for n, p in zip(names, params)}
        r["v"] = {n: f64_norm([opt.state[p]["exp_avg_sq"]]) for n, p in zip(names, params)}
        r["weight"] = f64_norm(params)
        mon.step(loss=loss, loss_scale=1024.0, expert_load={"layers.0.moe": counts * step})
        ref[step] = r
    mon.close()

    acc = read_events(tmp_path / "tb" / "rank_0")
    s = scalars(acc)
    steps = {1, 2, 3}
    samples = {BATCH * k for k in steps}
    for tag in ("learning-rate", "batch-size", "loss", "loss-scale", "grad-norm", "iteration-time", "throughput"):
        assert set(s[tag]) == steps, tag
        assert set(s[f"{tag}-vs-samples"]) == samples, tag
    for tag in ("model-flops-throughput-per-device", "B-samples-per-day", "device_local_norm", "local_loss"):
        assert set(s[tag]) == steps, tag
    targeted = [n for n in names if n.startswith("layers.0.")]
    assert {t.removeprefix("local_norm/") for t in s if t.startswith("local_norm/")} == set(targeted)
    assert {t.removeprefix("adam_m_norm/") for t in s if t.startswith("adam_m_norm/")} == set(targeted)
    assert {t.removeprefix("adam_v_norm/") for t in s if t.startswith("adam_v_norm/")} == set(targeted)

    d, L, T = TINY.d_model, TINY.n_layers, TINY.seq_len
    n_matmul = L * (3 * d * d + d * d + 4 * d * d + 4 * d * d) + d * TINY.vocab_size
    flops_per_step = BATCH * T * (6 * n_matmul + 12 * L * d * T)
    for step, r in ref.items():
        approx = lambda v, rel=2e-6: pytest.approx(v, rel=rel, abs=1e-9)  # noqa: E731 - float32 events
        assert s["loss"][step] == approx(r["loss"])
        assert s["loss-vs-samples"][BATCH * step] == approx(r["loss"])
        assert s["learning-rate"][step] == approx(r["lr"])
        assert s["batch-size"][step] == BATCH
        assert s["loss-scale"][step] == 1024.0
        assert s["grad-norm"][step] == approx(r["grad_total"], 1e-5)
        assert s["grad-norm"][step] == approx(r["grad_f64"], F32)
        assert s["device_local_norm"][step] == approx(r["grad_f64"], F32)
        for n in targeted:
            assert s[f"local_norm/{n}"][step] == approx(r["local"][n], F32), n
            assert s[f"adam_m_norm/{n}"][step] == approx(r["m"][n], F32), n
            assert s[f"adam_v_norm/{n}"][step] == approx(r["v"][n], F32), n
        assert s["weight_norm"][step] == approx(r["weight"], F32)
        assert s["local_loss"][step] == approx(r["loss"])
        assert s["device_accum_local_loss"][step] == approx(r["loss"])
        seconds = s["iteration-time"][step] / 1000.0
        assert seconds > 0
        throughput = BATCH / seconds
        assert s["throughput"][step] == approx(throughput, 1e-5)
        assert s["B-samples-per-day"][step] == approx(throughput * 86400 / 1e9, 1e-5)
        assert s["throughput_linearity"][step] == approx(throughput / 2.5, 1e-5)
        assert s["model-flops-throughput-per-device"][step] == approx(flops_per_step / seconds / 1e12, 1e-5)
        for i, c in enumerate([3.0, 1.0, 0.0, 4.0]):
            assert s[f"expert_load/layers.0.moe/expert_{i}"][step] == approx(c / 8.0)

    text = texts(acc)
    assert set(text) == {"seed", "model", "monitor_config", "tensorboard"}
    assert text["seed"] == "1234" and '"n_layers": 2' in text["model"]

    lines = (tmp_path / "dump" / "rank_0" / "training_state.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert [row["samples"] for row in rows] == [4, 8, 12]
    assert rows[1]["device_local_norm"] == pytest.approx(ref[2]["grad_f64"], rel=F64)
    assert rows[2]["local_loss"] == pytest.approx(ref[3]["loss"], rel=1e-6)
    for n in targeted:
        assert rows[0][f"local_norm/{n}"] == pytest.approx(ref[1]["local"][n], rel=F64), n
    assert "adam_m_norm/" + targeted[0] not in rows[0]


def test_interval_log_only_and_model_loss(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """No tensorboard section: 'tensorboard' formats fall back to the log; step_interval 2; the
    loss and batch size come from the model's outputs and inputs."""

    class WithLoss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gpt, _ = tiny_gpt()

        def forward(self, idx: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": self.gpt.loss(idx)}

    model = WithLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {
        "monitor_config": {
            "monitor_on": True,
            "step_interval": 2,
            "dump_path": str(tmp_path / "dump"),
            "local_loss_format": "tensorboard",
            "optimizer_state_format": "log",
        }
    }
    batches = synthetic_batches(TINY, 3)
    losses = []
    with caplog.at_level(logging.INFO, logger="trainprobe"), TrainingMetricsMonitor(cfg, model, opt) as mon:
        for _ in range(4):
            loss = model(next(batches))["loss"]
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            mon.step()
        mon.flush()
    assert not (tmp_path / "tb").exists()
    summaries = [r.getMessage() for r in caplog.records if "batch-size" in r.getMessage()]
    assert len(summaries) == 2 and summaries[0].startswith("step:[    2]") and "batch-size: 3," in summaries[0]
    assert f"loss: {losses[1]:.6g}" in summaries[0] and f"loss: {losses[3]:.6g}" in summaries[1]
    local = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("step:") and "local_loss" in r.getMessage()
    ]
    assert local == summaries  # one line per step: the summary, then the log metrics
    assert [line.endswith(f", local_loss: {loss:.6g}") for line, loss in zip(local, losses[1::2])] == [True, True]
    assert any("no exp_avg/exp_avg_sq" in r.getMessage() for r in caplog.records)  # SGD has no Adam moments
    rows = [json.loads(x) for x in (tmp_path / "dump" / "rank_0" / "training_state.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4] and [r["samples"] for r in rows] == [6, 12]


def test_micro_batch_losses_and_user_flops(tmp_path: Path) -> None:
    model, opt = tiny_gpt()
    cfg = full_config(tmp_path, local_norm_format=None, optimizer_state_format=None)
    mon = TrainingMetricsMonitor(cfg, model=model, optimizer=opt, flops_per_token=1e6)
    batches = synthetic_batches(TINY, 2)
    micro = []
    for _ in range(3):
        loss = model.loss(next(batches)) / 3
        loss.backward()
        micro.append(loss.detach())
    opt.step()
    mon.step(loss=micro, grad_norm=torch.tensor(7.0))
    mon.close()
    s = scalars(read_events(tmp_path / "tb" / "rank_0"))
    values = [float(x) for x in micro]
    assert s["local_loss"][1] == pytest.approx(sum(values) / 3, rel=1e-6)
    assert s["device_accum_local_loss"][1] == pytest.approx(sum(values), rel=1e-6)
    assert s["loss"][1] == pytest.approx(sum(values) / 3, rel=1e-6)
    assert s["grad-norm"][1] == 7.0  # the loop's (pre-clip) norm wins
    assert s["batch-size"][1] == 6
    seconds = s["iteration-time"][1] / 1000
    assert s["model-flops-throughput-per-device"][1] == pytest.approx(1e6 * 6 * TINY.seq_len / seconds / 1e12, rel=1e-5)


def test_monitoring_changes_nothing_and_leaves_no_hook(tmp_path: Path) -> None:
    def train(monitored: bool) -> list[torch.Tensor]:
        model, opt = tiny_gpt(seed=3)
        mon = TrainingMetricsMonitor(full_config(tmp_path / str(monitored)), model, opt) if monitored else None
        batches = synthetic_batches(TINY, 2, seed=5)
        for _ in range(3):
            model.loss(next(batches)).backward()
            opt.step()
            opt.zero_grad()
            if mon is not None:
                mon.step()
        if mon is not None:
            mon.close()
            assert not model._forward_hooks and not model._forward_pre_hooks
            assert not opt._optimizer_step_pre_hooks
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(train(False), train(True)):
        assert torch.equal(a, b)


def test_print_struct_prints_names_and_exits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, opt = tiny_gpt()
    mon = TrainingMetricsMonitor(full_config(tmp_path, print_struct=True), model, opt)
    model.loss(next(synthetic_batches(TINY, 2))).backward()
    opt.step()
    with pytest.raises(SystemExit) as exc:
        mon.step()
    assert exc.value.code == 0 and mon.stop_requested
    assert capsys.readouterr().out.split() == [n for n, _ in model.named_parameters()]
    assert "loss" not in scalars(read_events(tmp_path / "tb" / "rank_0"))


def test_a_failing_gatherer_is_turned_off_and_the_rest_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, opt = tiny_gpt()
    mon = TrainingMetricsMonitor(full_config(tmp_path), model, opt)
    batches = synthetic_batches(TINY, 2)
    with caplog.at_level(logging.ERROR, logger="trainprobe"):
        for _ in range(2):
            model.loss(next(batches)).backward()
            opt.step()
            opt.zero_grad()
            mon.step(expert_load={"moe": ["not", "numbers"]})  # type: ignore[dict-item]
    mon.close()
    assert sum("expert load" in r.getMessage() for r in caplog.records) == 1
    s = scalars(read_events(tmp_path / "tb" / "rank_0"))
    assert set(s["grad-norm"]) == {1, 2} and not any(t.startswith("expert_load") for t in s)


def test_bad_arguments() -> None:
    model, opt = tiny_gpt()
    with pytest.raises(ConfigError, match="flops_per_sample / flops_per_token"):
        TrainingMetricsMonitor({}, model, opt, flops_per_sample=1.0, flops_per_token=1.0)
    with pytest.raises(ConfigError, match="flops_per_token: must be a positive number"):
        TrainingMetricsMonitor({}, model, opt, flops_per_token=0)
    with pytest.raises(ConfigError, match="optimizer"):
        TrainingMetricsMonitor({}, model, optimizer=object())


def test_unwritable_dump_path_fails_at_setup_without_hooks(tmp_path: Path) -> None:
    model, opt = tiny_gpt()
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    cfg = {"monitor_config": {"monitor_on": True, "dump_path": str(blocker), "local_loss_format": "log"}}
    with pytest.raises(ConfigError, match="monitor_config.dump_path: cannot create the output folder"):
        TrainingMetricsMonitor(cfg, model, opt)
    assert not model._forward_hooks and not opt._optimizer_step_pre_hooks


def _metric_steps(tmp_path: Path, steps: int, initial_step: int = 0) -> None:
    model, opt = tiny_gpt()
    batches = synthetic_batches(TINY, BATCH)
    with TrainingMetricsMonitor(full_config(tmp_path), model=model, optimizer=opt, initial_step=initial_step) as mon:
        for _ in range(steps):
            loss = model.loss(next(batches))
            loss.backward()
            opt.step()
            opt.zero_grad()
            mon.step(loss=loss)


def test_a_resumed_run_keeps_the_earlier_steps_and_purges_the_rest(tmp_path: Path) -> None:
    """Killed after 5 steps, resumed from the checkpoint of step 3: training_state.jsonl holds
    steps 1-3 of the first run then 4-5 of the second, once each; the event files carry
    TensorBoard's purge marker at step 4."""
    _metric_steps(tmp_path, 5)
    state = tmp_path / "dump" / "rank_0" / "training_state.jsonl"
    first = [json.loads(x) for x in state.read_text().splitlines()]
    _metric_steps(tmp_path, 2, initial_step=3)
    rows = [json.loads(x) for x in state.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[:3] == first[:3]
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    purges = []
    for path in sorted((tmp_path / "tb" / "rank_0").glob("events.*")):
        for event in EventFileLoader(str(path)).Load():
            if event.HasField("session_log") and event.session_log.status == event.session_log.START:
                purges.append(event.step)
    assert purges == [4]


def test_a_new_run_from_step_0_replaces_training_state(tmp_path: Path) -> None:
    """As the reference clears ``dump_path/rank_x``. (The earlier event files would make the second
    run refused: tests/test_metrics_reruns.py.)"""
    _metric_steps(tmp_path, 3)
    shutil.rmtree(tmp_path / "tb")
    _metric_steps(tmp_path, 2)
    rows = (tmp_path / "dump" / "rank_0" / "training_state.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in rows] == [1, 2]
