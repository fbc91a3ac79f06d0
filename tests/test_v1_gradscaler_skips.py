"""GradScaler's skipped steps under Monitor V1 (issue #34 item 1, as tests/test_gradscaler_skips.py
for Monitor V2): real fp16 autocast training on CPU with a huge ``init_scale``, so the first steps
overflow while the scaler calibrates. TrainerMon writes each skipped step to its run folder's
``amp_skips.jsonl``; ``trainprobe diagnose`` on the V1 run then names them "skipped by GradScaler"
instead of calling their inf the first anomaly, and still finds a real NaN at its step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from trainprobe import TrainerMon
from trainprobe.engine.skip_log import SKIP_FILE, read_skips, run_skips

pytest.importorskip("duckdb")

STEPS = 12
INIT_SCALE = 2.0**24


def train(out: Path, monkeypatch: pytest.MonkeyPatch, nan_step: int | None = None) -> list[int]:
    """fp16 training with GradScaler under TrainerMon (csv); the steps the scaler skipped."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
    out.mkdir(parents=True)
    config = out / "config.json"
    config.write_text(json.dumps({"targets": {}, "wg_distribution": True, "xy_distribution": True, "all_xy": True,
                                  "mv_distribution": True, "ops": ["min", "max", "norm", "nans"], "format": "csv"}))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    mon = TrainerMon(str(config), process_group=None, params_have_main_grad=False)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    gen = torch.Generator().manual_seed(1)
    skipped: list[int] = []
    for step in range(STEPS):
        x = torch.randn(4, 8, generator=gen)
        if step == nan_step:
            x[0, 0] = float("nan")
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().square().mean()
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if scaler.get_scale() < before:
            skipped.append(step)
        opt.zero_grad()
    mon.stop()
    return skipped


def _folder(out: Path) -> Path:
    (folder,) = [p for p in out.iterdir() if p.is_dir() and "-rank0-" in p.name]
    return folder


def test_v1_writes_the_skipped_steps_and_diagnose_names_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trainprobe.tools import diagnose

    out = tmp_path / "v1"
    skipped = train(out, monkeypatch)
    assert skipped == list(range(7))
    assert [step for step, _ in read_skips(_folder(out) / SKIP_FILE)] == skipped
    assert read_skips(_folder(out) / SKIP_FILE)[0] == (0, INIT_SCALE)
    assert run_skips(out) == {0: skipped}
    result = diagnose(out)
    assert result.first is None, result.line()
    assert "7 step(s) skipped by GradScaler (0-6)" in result.line()


def test_v1_a_nan_after_calibration_is_found_at_its_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trainprobe.tools import diagnose

    out = tmp_path / "v1nan"
    skipped = train(out, monkeypatch, nan_step=10)
    assert 10 in skipped  # the NaN batch overflows too: the scaler skips it
    first: Any = diagnose(out).first
    assert first is not None and (first.step, first.table) == (10, "actv")  # its forward rows are still checked
