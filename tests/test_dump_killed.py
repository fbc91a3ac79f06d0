"""A dump whose run was killed in step N stays comparable: ``compare`` compares steps 0..N-1 and
skips the unfinished step with one warning naming it (issue #27.2). A real SIGKILL of a dumping
training subprocess, and constructed unfinished folders for the exact cases."""

from __future__ import annotations

import json
import logging
import os
import runpy
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from trainprobe.dump.cli import main
from trainprobe.dump.compare import compare_dumps
from trainprobe.engine.errors import ConfigError

TRAIN = textwrap.dedent(
    """
    import sys, time, torch
    from torch import nn
    from trainprobe.dump import PrecisionDebugger

    root, steps, kill_step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    debugger = PrecisionDebugger(task="tensor", level="L1", dump_path=root)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        x = torch.randn(32, 64)
        debugger.start()
        loss = model(x).square().mean()
        if step == kill_step:
            print("forward", step, flush=True)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step == kill_step:
            time.sleep(120)  # killed before stop(): this step never gets its dump.json
        debugger.stop()
        debugger.step()
        print("done", step, flush=True)
    """
)


def train(root: Path, steps: int, kill_step: int = -1) -> subprocess.Popen[str]:
    script = root.parent / "train.py"
    script.write_text(TRAIN, encoding="utf-8")
    return subprocess.Popen(
        [sys.executable, str(script), str(root), str(steps), str(kill_step)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_dump_killed_mid_step_compares_its_finished_steps(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    golden, target = tmp_path / "golden", tmp_path / "target"
    killed = train(target, steps=3, kill_step=2)
    assert killed.stdout is not None
    lines = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = killed.stdout.readline()
        lines.append(line)
        if line.startswith("forward 2") or not line:
            break
    assert lines[-1].startswith("forward 2"), (lines, killed.stderr.read() if killed.stderr else "")
    time.sleep(0.05)  # the writer thread is busy with the step's .pt files
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait(timeout=60)
    assert killed.returncode == -signal.SIGKILL
    monkeypatch.setattr(sys, "argv", ["train.py", str(golden), "3", "-1"])
    runpy.run_path(str(tmp_path / "train.py"), run_name="__main__")  # the same run, not killed, in process

    (unfinished,) = list((target / "step2").iterdir())
    assert not (unfinished / "dump.json").exists()
    with caplog.at_level(logging.WARNING, logger="trainprobe"):
        code = main(["compare", "-tp", str(target), "-gp", str(golden), "-o", str(tmp_path / "out")])
    assert code == 0
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and str(target / "step2") in warnings[0] and unfinished.name in warnings[0], warnings
    tables = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert [t.split("_proc")[0] for t in tables] == ["compare_result_step0", "compare_result_step1"]
    assert capsys.readouterr().out.count("every tensor passed") == 2


def write_rank(rank_dir: Path, value: float) -> Path:
    rank_dir.mkdir(parents=True)
    entry = {"type": "torch.Tensor", "dtype": "torch.float32", "shape": [2], "Max": value, "Min": value,
             "Mean": value, "Norm": value, "requires_grad": False}  # fmt: skip
    data = {"task": "statistics", "level": "L1", "data": {"Torch.relu.0.forward": {"input_args": [entry]}}}
    (rank_dir / "dump.json").write_text(json.dumps(data), encoding="utf-8")
    return rank_dir


def unfinished_rank(rank_dir: Path) -> Path:
    """What a kill leaves: partial tensor files and a JSON temporary file, no dump.json."""
    (rank_dir / "dump_tensor_data").mkdir(parents=True)
    (rank_dir / "dump_tensor_data" / "Torch.relu.0.forward.input.0.pt").write_bytes(b"PK\x03\x04torn")
    (rank_dir / ".dump.json.x1y2.tmp").write_text('{"task": "stat', encoding="utf-8")
    return rank_dir


def test_an_unfinished_step_is_skipped_with_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    target, golden = tmp_path / "t", tmp_path / "g"
    for step in range(3):
        write_rank(golden / f"step{step}" / "rank0", 1.0)
    write_rank(target / "step0" / "rank0", 1.0)
    write_rank(target / "step1" / "rank0", 1.0)
    unfinished_rank(target / "step2" / "rank0")
    with caplog.at_level(logging.WARNING, logger="trainprobe"):
        results = compare_dumps(target, golden, tmp_path / "out")
    assert [r.label for r in results] == ["step0_rank0", "step1_rank0"]
    assert all(r.first is None for r in results)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and str(target / "step2") in messages[0] and "rank0" in messages[0]


def test_unfinished_ranks_of_a_step_are_left_out_and_the_others_compared(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    target, golden = tmp_path / "t" / "step4", tmp_path / "g" / "step4"
    for rank in range(3):
        write_rank(golden / f"rank{rank}", 1.0)
    write_rank(target / "rank0", 1.0)
    unfinished_rank(target / "rank1")
    unfinished_rank(target / "rank2")
    with caplog.at_level(logging.WARNING, logger="trainprobe"):
        results = compare_dumps(target, golden, tmp_path / "out")
    assert [r.label for r in results] == ["rank0"]
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "rank1, rank2" in messages[0] and str(target) in messages[0]


def test_a_golden_killed_in_its_first_step_or_an_unfinished_rank_dir_is_one_line(tmp_path: Path) -> None:
    target, golden = tmp_path / "t", tmp_path / "g"
    write_rank(target / "step0" / "proc11", 1.0)
    unfinished_rank(golden / "step0" / "proc22")
    with pytest.raises(ConfigError, match="no finished step/rank directory in common"):
        compare_dumps(target, golden, tmp_path / "out")
    with pytest.raises(ConfigError, match=r"proc22: an unfinished rank directory \(no dump.json"):
        compare_dumps(target / "step0" / "proc11", golden / "step0" / "proc22", tmp_path / "out")


def test_loading_a_rank_directory_without_its_json_names_the_folder(tmp_path: Path) -> None:
    from trainprobe.dump.compare_load import load_rank

    folder = unfinished_rank(tmp_path / "step0" / "rank0")
    with pytest.raises(ConfigError, match=r"rank0: no dump.json or debug.json \(an unfinished step"):
        load_rank(folder)
