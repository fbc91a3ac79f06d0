"""A CSV window's file is opened on the training thread, at the step that starts the window,
not whenever the background writer thread gets to it: a folder replaced by a file after a step
gives the same one line whether the writer is fast or slow (before: a slow writer opened the
file of steps 0-1 after the replacement, a raw NotADirectoryError, or made the folder again
under the user's feet)."""

from __future__ import annotations

import logging
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import trainprobe.engine.log
from conftest import read_csv, write_config
from trainprobe import TrainerMonitorV2
from trainprobe.engine.sinks.csv_sink import CsvSink


@pytest.fixture(autouse=True)
def _fresh_once_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trainprobe.engine.log, "_seen", set())


def slow_writer(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Every batch the writer thread writes waits ``seconds`` first (a slow disk)."""
    write = CsvSink.write

    def slow(self: CsvSink, batch: object) -> None:
        if threading.current_thread() is not threading.main_thread():
            time.sleep(seconds)
        write(self, batch)  # type: ignore[arg-type]

    monkeypatch.setattr(CsvSink, "write", slow)


def test_folder_replaced_behind_a_slow_writer_is_the_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    slow_writer(monkeypatch, 0.3)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = tmp_path / "out"
    cfg = {"output_dir": str(out), "step_count_per_record": 2, "monitors": {"weight_grad": {"enabled": True}}}
    mon = TrainerMonitorV2(write_config(tmp_path, cfg))
    with caplog.at_level(logging.ERROR, logger="trainprobe"):
        mon.start(model=model, optimizer=opt)
        for step in range(5):
            model(torch.randn(2, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
            if step == 0:  # the writer sleeps on step 0's rows: the window's file is open already
                assert read_csv(out / "rank_0" / "weight_grad_step0-1.csv") == (
                    ["vpp_stage", "step", "module_name", "scope", "micro_step", "min", "max", "mean", "norm", "nans"],
                    [],
                )
            if step == 1:  # the writer has not written step 0 yet
                shutil.rmtree(out / "rank_0")
                (out / "rank_0").write_text("not a folder any more")
        mon.stop()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, errors
    assert (
        "writing the weight_grad output failed (ConfigError: output_dir: cannot create the output folder " in errors[0]
    )
    assert "out/rank_0': File exists); the weight_grad monitor is disabled for the rest of the run" in errors[0]
    assert (out / "rank_0").read_text() == "not a folder any more"


def test_a_slow_writer_still_writes_every_window(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Files opened ahead of the writer thread get every row, in their windows (the last one,
    cut short by stop(), keeps its whole window's name)."""
    slow_writer(monkeypatch, 0.05)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = tmp_path / "out"
    cfg = {"output_dir": str(out), "step_count_per_record": 2, "monitors": {"weight_grad": {"enabled": True}}}
    mon = TrainerMonitorV2(write_config(tmp_path, cfg))
    mon.start(model=model, optimizer=opt)
    for _ in range(5):
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
    mon.stop()
    names = sorted(p.name for p in (out / "rank_0").glob("weight_grad_step*.csv"))
    assert names == ["weight_grad_step0-1.csv", "weight_grad_step2-3.csv", "weight_grad_step4-5.csv"]
    for name, steps in zip(names, (["0", "1"], ["2", "3"], ["4"])):
        rows = read_csv(out / "rank_0" / name)[1]
        assert sorted({r["step"] for r in rows}) == steps
        assert len(rows) == 8 * len(steps)  # four parameters, reduced and unreduced
