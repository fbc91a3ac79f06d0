"""Output folders are made through ``make_output_folder`` everywhere (docs/architecture.md,
"Output folders"): a folder whose parent is a regular file (we run as root, so permissions
cannot be used) is a ConfigError naming the field at start, and a folder that becomes unusable
during training (replaced by a file) is one log line, without a traceback, that disables that
monitor only while training goes on. Monitor V2 and V1 (CSV, and ``format: api`` with
``cc_log_only``), and ``write_atomically`` itself. (V2's and V1's folders under a file at start:
tests/test_front_doors.py.)"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import trainprobe.engine.log
from conftest import write_config
from models import MLP
from test_v1_support import make_v1, run_dir
from trainprobe import TrainerMonitorV2
from trainprobe.engine.errors import ConfigError
from trainprobe.engine.sinks.files import write_atomically, write_json_atomically


@pytest.fixture(autouse=True)
def _fresh_once_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trainprobe.engine.log, "_seen", set())


def errors_of(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.ERROR]


def replace_by_file(folder: Path) -> None:
    """``folder`` removed and a regular file put in its place."""
    shutil.rmtree(folder)
    folder.write_text("not a folder any more")


def test_write_atomically_under_a_file_is_a_config_error_naming_the_field(tmp_path: Path) -> None:
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ConfigError, match=r"^some_field: cannot create the output folder .*a_file/sub': Not a directory"):
        write_atomically(tmp_path / "a_file" / "sub" / "f.txt", "data", field="some_field")
    with pytest.raises(ConfigError, match=r"^output folder: cannot create the output folder .*a_file/sub'"):
        write_json_atomically(tmp_path / "a_file" / "sub" / "f.json", {})
    write_json_atomically(tmp_path / "made" / "f.json", {"a": 1}, field="some_field")  # parents made as before
    assert (tmp_path / "made" / "f.json").read_text() == '{\n  "a": 1\n}'


def v2_run(tmp_path: Path, caplog: pytest.LogCaptureFixture, steps: int, replace_at: int) -> TrainerMonitorV2:
    """A V2 run of ``steps`` steps, weight_grad only, files of 2 steps; ``rank_0`` is replaced by
    a file after step ``replace_at``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"output_dir": str(tmp_path / "out"), "step_count_per_record": 2,
           "monitors": {"weight_grad": {"enabled": True, "ops": ["min", "norm"]}}}  # fmt: skip
    mon = TrainerMonitorV2(write_config(tmp_path, cfg))
    with caplog.at_level(logging.ERROR, logger="trainprobe"):
        mon.start(model=model, optimizer=opt)
        for step in range(steps):
            model(torch.randn(2, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
            if step == replace_at:
                replace_by_file(tmp_path / "out" / "rank_0")
        mon.stop()
    return mon


def test_v2_rank_folder_replaced_by_a_file_mid_run_is_one_line_and_training_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Step 2 opens the file of steps 2-3 in ``rank_0``, now a file: one ERROR line in the one
    text of an unusable folder (before: ``FileExistsError: [Errno 17] File exists``), no
    traceback, the weight_grad monitor off; the loop ran its 5 steps."""
    v2_run(tmp_path, caplog, steps=5, replace_at=1)
    errors = errors_of(caplog)
    assert len(errors) == 1, [r.getMessage() for r in errors]
    message = errors[0].getMessage()
    assert "writing the weight_grad output failed (ConfigError: output_dir: cannot create the output folder " in message
    assert "out/rank_0': File exists); the weight_grad monitor is disabled for the rest of the run" in message
    assert not errors[0].exc_info
    assert (tmp_path / "out" / "rank_0").read_text() == "not a folder any more"


def v1_train(mon: object, model: nn.Module, opt: torch.optim.Optimizer, steps: int, after: object = None) -> None:
    """``steps`` steps of ``model``; ``after(step)`` is called after each."""
    for step in range(steps):
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
        opt.zero_grad()
        if callable(after):
            after(step)


def test_v1_run_folder_replaced_by_a_file_mid_run_is_one_line_and_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Step 2 opens a new CSV file in the run folder, now a file: the CSV output is off (one line,
    the one text of an unusable folder; before: ``FileExistsError``), the loop ran its 5 steps."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = make_v1(tmp_path, monkeypatch, {"wg_distribution": True, "step_count_per_record": 2})
    with caplog.at_level(logging.ERROR, logger="trainprobe"):
        mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
        folder = run_dir(tmp_path)

        def replace(step: int) -> None:
            if step == 1:
                mon._control.session.flush()  # steps 0-1 written: the writer opens nothing meanwhile
                replace_by_file(folder)

        v1_train(mon, model, opt, 5, replace)
    errors = errors_of(caplog)
    assert len(errors) == 1, [r.getMessage() for r in errors]
    message = errors[0].getMessage()
    assert message == (
        "trainprobe: the CsvSink output failed and is disabled (ConfigError: MONITOR_OUTPUT_DIR: cannot create the "
        f"output folder '{folder}': File exists)"
    )
    assert not errors[0].exc_info
    assert mon.generate_wgrad_metrics()  # the in-memory output (format api's) goes on


@contextmanager
def world_of_one() -> Iterator[None]:
    """A single-process gloo group (world size 1) for the duration of the block."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=timedelta(seconds=30)
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


CC_API = {"format": "api", "cc_distribution": {"enable": True, "cc_log_only": True}}


def test_v1_api_cc_log_folder_under_a_file_fails_at_set_monitor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``format: api`` makes no folder at start; ``cc_log-rank0`` is checked there (before: the
    first call site logged failed during training)."""
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with world_of_one():
        mon = make_v1(tmp_path, monkeypatch, CC_API)
        (tmp_path / "a_file").write_text("x")
        monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "a_file" / "out"))
        with pytest.raises(
            ConfigError, match=r"^MONITOR_OUTPUT_DIR: cannot create the output folder .*a_file/out/cc_log-rank0'"
        ):
            mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
        assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


def test_v1_api_cc_log_folder_unusable_mid_run_is_one_line_and_the_collective_still_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with world_of_one(), caplog.at_level(logging.ERROR, logger="trainprobe"):
        mon = make_v1(tmp_path, monkeypatch, CC_API)
        mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
        (tmp_path / "out").write_text("the output folder became a file")
        for _ in range(2):
            t = torch.full((2,), 2.0)
            dist.all_reduce(t)
            assert t.tolist() == [2.0, 2.0]  # the collective ran
        model(torch.randn(4, 6)).sum().backward()
        with pytest.raises(SystemExit) as ended:  # cc_log_only ends the run after its first step, by design,
            opt.step()
        assert ended.value.code == 1  # with exit code 1: cc_log.json, what it was asked for, could not be written
    errors = errors_of(caplog)
    assert len(errors) == 1, [r.getMessage() for r in errors]
    message = errors[0].getMessage()
    assert "the cc monitor failed and is disabled for the rest of the run; training continues (ConfigError: " in message
    assert "MONITOR_OUTPUT_DIR: cannot create the output folder " in message
    assert "out/cc_log-rank0': Not a directory)" in message
    assert not errors[0].exc_info
