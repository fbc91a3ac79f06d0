"""GradScaler's skipped steps (issue #32 item 3, issue #34 item 1): real fp16 autocast training on
CPU with ``torch.amp.GradScaler`` and a huge ``init_scale``, so that the first steps overflow and
the scaler skips them while it calibrates. Monitor V2 labels each skipped step in
``rank_<r>/amp_skips.jsonl`` (whole lines even when killed); ``trainprobe diagnose`` and
``report`` name them "skipped by GradScaler" instead of calling their inf the first anomaly, and
still find a real NaN at its step. Training is bitwise unchanged by the monitor."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import write_config
from trainprobe import TrainerMonitorV2
from trainprobe.engine.skip_log import SKIP_FILE, SkipLog, read_skips

pytest.importorskip("duckdb")

STEPS = 14
INIT_SCALE = 2.0**24  # fp16 gradients of this model overflow for the first 7 steps
OPS = ["min", "max", "mean", "norm", "nans"]
MONITORS = ("module", "weight_grad", "optimizer", "param")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def train(out: Path | None, fault: str = "", steps: int = STEPS) -> dict[str, Any]:
    """fp16-autocast training with GradScaler; monitored into ``out`` (None: unmonitored).
    ``fault``: ``"batch"`` (a NaN in step 10's batch) or ``"param"`` (a NaN written into
    ``0.weight`` by an optimizer post-step hook at step 9, a step the scaler does not skip).
    Returns the steps the scaler skipped (its scale fell), their scales, and the final weights."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    state: dict[str, Any] = {"step": 0, "skipped": [], "scales": []}
    if fault == "param":
        def corrupt(optimizer: Any, args: Any, kwargs: Any) -> None:
            if state["step"] == 9:
                with torch.no_grad():
                    model[0].weight[0, 0] = float("nan")
        opt.register_step_post_hook(corrupt)  # before the monitor's: its param_updated row sees the NaN
    mon = None
    if out is not None:
        cfg = {"output_dir": str(out), "monitors": {m: {"enabled": True, "ops": OPS} for m in MONITORS}}
        mon = TrainerMonitorV2(write_config(out.parent, cfg, name=f"{out.name}.json"))
        mon.start(model=model, optimizer=opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        state["step"] = step
        x = torch.randn(4, 8, generator=gen)
        if fault == "batch" and step == 10:
            x[0, 0] = float("nan")
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().square().mean()
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if scaler.get_scale() < before:
            state["skipped"].append(step)
            state["scales"].append(before)
        opt.zero_grad()
    if mon is not None:
        mon.stop()
    return {"skipped": state["skipped"], "scales": state["scales"], "weights": [p.detach().clone() for p in model.parameters()]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("gradscaler")
    return {
        "root": root,
        "clean": train(root / "clean"),
        "plain": train(None),
        "batch": train(root / "batch", "batch"),
        "param": train(root / "param", "param"),
    }


def test_each_skipped_step_is_written_with_its_scale(runs: dict[str, Any]) -> None:
    truth = runs["clean"]
    assert truth["skipped"] == list(range(7))  # the calibration: the run needs it to mean anything
    lines = read_skips(runs["root"] / "clean" / "rank_0" / SKIP_FILE)
    assert lines == list(zip(truth["skipped"], truth["scales"]))
    text = (runs["root"] / "clean" / "rank_0" / SKIP_FILE).read_text()
    assert text.splitlines()[0] == json.dumps({"step": 0, "scale": INIT_SCALE})


def test_the_monitor_leaves_training_bitwise_unchanged(runs: dict[str, Any]) -> None:
    assert runs["clean"]["skipped"] == runs["plain"]["skipped"]
    for monitored, plain in zip(runs["clean"]["weights"], runs["plain"]["weights"]):
        assert torch.equal(monitored, plain)


def test_calibration_is_not_the_first_anomaly(runs: dict[str, Any]) -> None:
    from trainprobe.tools.diagnosis.answer import diagnose

    run = runs["root"] / "clean"
    result = diagnose(run)
    assert result.first is None and result.skipped == {0: list(range(7))}
    assert result.line() == "no anomaly: no NaN/inf and no spike by the rule recent_max in 1 rank(s); 7 step(s) skipped by GradScaler (0-6)"
    assert "skipped by GradScaler: steps 0-6 (the inf/NaN of their scaled gradients is not an anomaly)" in result.lines()
    assert result.to_json()["skipped_by_gradscaler"] == {"0": list(range(7))}
    done = subprocess.run([sys.executable, "-m", "trainprobe", "diagnose", str(run)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_without_the_skip_file_the_calibration_reads_as_step_0(runs: dict[str, Any], tmp_path: Path) -> None:
    import shutil

    from trainprobe.tools.diagnosis.answer import diagnose

    copy = tmp_path / "copy"
    shutil.copytree(runs["root"] / "clean", copy)
    (copy / "rank_0" / SKIP_FILE).unlink()
    first = diagnose(copy).first
    assert first is not None and (first.step, first.kind) == (0, "nonfinite")  # what the file prevents


def test_a_nan_in_a_batch_is_found_at_its_step(runs: dict[str, Any]) -> None:
    from trainprobe.tools.diagnosis.answer import diagnose

    truth = runs["batch"]
    assert 10 in truth["skipped"]  # the NaN makes the scaler skip that step too
    result = diagnose(runs["root"] / "batch")
    first = result.first
    assert first is not None
    assert (first.kind, first.step, first.table, first.scope) == ("nonfinite", 10, "module", "forward")
    assert result.line().endswith("(NaN/inf) (a step GradScaler skipped)")
    assert all(a.step == 10 and a.scope == "forward" for a in result.anomalies)  # its inf gradients left out


def test_a_nan_in_a_step_that_was_not_skipped_is_found_at_its_step(runs: dict[str, Any]) -> None:
    from trainprobe.tools.diagnosis.answer import diagnose

    truth = runs["param"]
    assert 9 not in truth["skipped"] and all(s in truth["skipped"] for s in range(10, STEPS))
    result = diagnose(runs["root"] / "param")
    first = result.first
    assert first is not None
    assert (first.kind, first.step, first.table, first.scope, first.name) == (
        "nonfinite", 9, "param", "param_updated", "0.weight"
    )
    assert "GradScaler skipped" not in result.line()
    assert result.skipped[0] == truth["skipped"]


def test_the_report_names_the_skipped_steps(runs: dict[str, Any], tmp_path: Path) -> None:
    pytest.importorskip("plotly")
    from trainprobe.tools.reporting.report import write_report

    page = write_report(runs["root"] / "clean", tmp_path / "r.html").read_text()
    assert "7 step(s) skipped by GradScaler (0-6)" in page
    assert "skipped by GradScaler: steps 0-6" in page


def test_torn_and_foreign_lines_are_left_out(tmp_path: Path) -> None:
    path = tmp_path / SKIP_FILE
    path.write_bytes(b'{"step": 0, "scale": 8.0}\nnot json\n{"step": -1}\n{"scale": 2}\n{"step": 3, "scale": null}\n{"st')
    assert read_skips(path) == [(0, 8.0), (3, None)]
    log = SkipLog(path, first_step=1)  # a run started again at step 1: step 3's line and the torn tail dropped
    assert read_skips(path) == [(0, 8.0)]
    log.record(5, 4.0)
    assert path.read_text() == '{"step": 0, "scale": 8.0}\n{"step": 5, "scale": 4.0}\n'


_KILLED = """
import sys, time
sys.path.insert(0, {tests!r})
from test_gradscaler_skips import train
from pathlib import Path
train(Path({out!r}), steps=10**6)
"""


def test_a_killed_run_keeps_whole_lines(tmp_path: Path) -> None:
    out = tmp_path / "killed"
    script = _KILLED.format(tests=str(Path(__file__).parent), out=str(out))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", script], env=env)
    path = out / "rank_0" / SKIP_FILE
    try:
        deadline = time.monotonic() + 240
        while not (path.exists() and len(read_skips(path)) >= 5) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    text = path.read_bytes()
    assert text.endswith(b"\n")
    assert [s for s, _ in read_skips(path)] == list(range(len(text.splitlines())))
