"""A rerun into the folders of an earlier run keeps that run and never mixes with it: Monitor V2's
``rank_<r>`` and the training metrics' ``rank_<r>`` folders move to ``<dir>.N/rank_<r>`` (one line
says so), Monitor V1 writes a new timestamped run folder (the reference's layout); a run that is
still going is refused, and nothing is moved for it."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import rows_of
from test_distributed_v2 import launch
from test_metrics_helpers import TINY, read_events, tiny_gpt
from trainprobe import TrainerMon, TrainerMonitorV2
from trainprobe.demo.gpt import synthetic_batches
from trainprobe.engine.errors import ConfigError
from trainprobe.frontdoors.metrics import TrainingMetricsMonitor

README = Path(__file__).resolve().parents[1] / "README.md"


def _quick_start() -> tuple[str, str]:
    """The README's Monitor V2 quick start: its config file and its script."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Monitor V2 quick start") :]
    config = re.search(r"```json\n(.*?)```", section, re.S)
    script = re.search(r"```python\n(.*?)```", section, re.S)
    assert config and script
    return config[1], script[1]


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_the_readme_quick_start_run_three_times_keeps_every_run(tmp_path: Path) -> None:
    config, script = _quick_start()
    (tmp_path / "monitor_v2_config.json").write_text(config, encoding="utf-8")
    (tmp_path / "train.py").write_text(script, encoding="utf-8")
    kept = []
    for attempt in range(3):
        done = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr and "ConfigError" not in done.stderr
        moved = [line for line in done.stderr.splitlines() if "earlier run" in line]
        if attempt == 0:
            assert moved == []
        else:
            assert moved == [
                f"INFO trainprobe: monitor_v2_out/rank_0 holds an earlier run; it was moved to "
                f"monitor_v2_out.{attempt}/rank_0"
            ]
            assert _files(tmp_path / f"monitor_v2_out.{attempt}" / "rank_0") == kept[-1]
        kept.append(_files(tmp_path / "monitor_v2_out" / "rank_0"))
        rows = rows_of(tmp_path / "monitor_v2_out", "weight_grad")
        assert sorted({int(r["step"]) for r in rows}) == list(range(100))  # one run, each step once
        assert len(rows) == 100 * 4 * 2  # 4 parameter tensors, unreduced and reduced
    assert kept[0] != kept[1]  # a new run (new random batches), not a copy


def _config(out: Path | str) -> dict[str, object]:
    return {"output_dir": str(out), "step_count_per_record": 4, "monitors": {"weight_grad": {"enabled": True}}}


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _train(mon: TrainerMonitorV2, steps: int, **start: object) -> None:
    model, opt = _model()
    mon.start(model=model, optimizer=opt, **start)
    for _ in range(steps):
        model(torch.randn(3, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    mon.stop()


def _steps(out: Path, rank: int = 0) -> list[int]:
    return sorted({int(r["step"]) for r in rows_of(out, "weight_grad", rank)})


def test_a_live_run_is_refused_and_nothing_is_moved_for_it(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _train(TrainerMonitorV2(_config(out)), 3)
    earlier = _files(out / "rank_0")
    live = TrainerMonitorV2(_config(out))
    model, opt = _model()
    live.start(model=model, optimizer=opt)  # moves the earlier run aside, holds the new folder
    try:
        assert _files(tmp_path / "out.1" / "rank_0") == earlier
        for how in ({}, {"overwrite": True}, {"initial_step": 2}):
            with pytest.raises(ConfigError, match=r"output_dir: .*out/rank_0' is being written by another run that is still going"):
                _train(TrainerMonitorV2(_config(out)), 2, **how)
        model(torch.randn(3, 4)).square().mean().backward()
        opt.step()
    finally:
        live.stop()
    assert not (tmp_path / "out.2").exists()
    assert _steps(out) == [0]
    assert _files(tmp_path / "out.1" / "rank_0") == earlier


def test_a_run_folder_without_a_name_keeps_the_earlier_run_inside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``output_dir: "./"`` (the reference's default): ``<output_dir>.1`` would lie outside it, so the
    earlier run goes to ``./earlier_run.1/rank_0``, which a reader of ``./`` does not take for a rank."""
    monkeypatch.chdir(tmp_path)
    _train(TrainerMonitorV2(_config("./")), 5)
    _train(TrainerMonitorV2(_config("./")), 2)
    assert _steps(tmp_path / "earlier_run.1") == [0, 1, 2, 3, 4]
    assert _steps(tmp_path) == [0, 1]
    query = pytest.importorskip("trainprobe.tools.query.layer")
    con = query.connect(".")
    assert con.sql("SELECT DISTINCT step FROM weight_grad ORDER BY step").fetchall() == [(0,), (1,)]


def test_an_earlier_run_that_cannot_be_moved_is_one_error_and_stays(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _train(TrainerMonitorV2(_config(out)), 3)
    earlier = _files(out / "rank_0")
    (tmp_path / "out.1").write_text("a file in the way")
    with pytest.raises(
        ConfigError,
        match=r"output_dir: '.*out/rank_0' holds an earlier run, which could not be moved to '.*out\.1/rank_0' to "
        r"keep it \(.*\); choose another output_dir, move or delete that run, or pass overwrite to replace it",
    ):
        _train(TrainerMonitorV2(_config(out)), 2)
    assert _files(out / "rank_0") == earlier
    _train(TrainerMonitorV2(_config(out)), 2, overwrite=True)  # the failed start left no lock behind
    assert _steps(out) == [0, 1]


def _two_runs_per_rank(rank: int, out: Path) -> None:
    for steps in (3, 2):
        _train(TrainerMonitorV2(_config(out)), steps)


def test_each_rank_moves_its_own_folder_into_one_earlier_run(tmp_path: Path) -> None:
    out = tmp_path / "out"
    launch(_two_runs_per_rank, out, timeout=300, world=2)
    for rank in (0, 1):
        assert _steps(tmp_path / "out.1", rank) == [0, 1, 2]
        assert _steps(out, rank) == [0, 1]
    assert sorted(p.name for p in (tmp_path / "out.1").iterdir()) == ["rank_0", "rank_1"]


def _metrics_run(tmp_path: Path, steps: int) -> None:
    cfg = {
        "monitor_config": {"monitor_on": True, "dump_path": str(tmp_path / "dump"), "local_loss_format": "log"},
        "tensorboard": {"tensorboard_dir": str(tmp_path / "tb")},
    }
    model, opt = tiny_gpt()
    batches = synthetic_batches(TINY, 2)
    with TrainingMetricsMonitor(cfg, model=model, optimizer=opt) as mon:
        for _ in range(steps):
            loss = model.loss(next(batches))
            loss.backward()
            opt.step()
            opt.zero_grad()
            mon.step(loss=loss)


def test_a_metrics_rerun_keeps_the_earlier_tensorboard_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _metrics_run(tmp_path, 3)
    with caplog.at_level(logging.INFO):
        _metrics_run(tmp_path, 2)
    moved = [r.getMessage() for r in caplog.records if "earlier run" in r.getMessage()]
    assert moved == [
        f"trainprobe: {tmp_path}/tb/rank_0 holds an earlier run; it was moved to {tmp_path}/tb.1/rank_0",
        f"trainprobe: {tmp_path}/dump/rank_0 holds an earlier run; it was moved to {tmp_path}/dump.1/rank_0",
    ]
    assert [e.step for e in read_events(tmp_path / "tb.1" / "rank_0").Scalars("loss")] == [1, 2, 3]
    assert [e.step for e in read_events(tmp_path / "tb" / "rank_0").Scalars("loss")] == [1, 2]


def _v1_run(config: Path, steps: int) -> None:
    model, opt = _model()
    monitor = TrainerMon(str(config), process_group=None, params_have_main_grad=True)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt, dp_group=None, tp_group=None, start_iteration=0)
    for _ in range(steps):
        model(torch.randn(3, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    monitor.stop()


def test_a_v1_rerun_writes_a_new_run_folder_as_the_reference_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "monitor_config.json"
    config.write_text('{"targets": {}, "all_xy": true, "xy_distribution": true, "wg_distribution": true}')
    out = tmp_path / "monitor_output"
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
    _v1_run(config, 3)
    _v1_run(config, 2)
    folders = sorted(out.iterdir())
    assert len(folders) == 2
    assert all(re.fullmatch(r"[A-Z][a-z]{2}\d\d_\d\d-\d\d-\d\d-rank0-[0-9a-f]{8}", f.name) for f in folders)
    written = sorted((sorted(p.name for p in f.glob("*.csv")) for f in folders), key=len)
    tables = ("actv", "actv_grad", "grad_reduced", "grad_unreduced")
    assert written == [sorted(f"{t}_{s}-{s}.csv" for t in tables for s in range(n)) for n in (2, 3)]
