"""What a person sees: the CLI in a subprocess, and the files a killed run leaves behind."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from conftest import write_config

PY = sys.executable


def test_demo_command_trains_and_summarises(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run(
        [PY, "-m", "trainprobe", "demo", "--out", str(out), "--steps", "12"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "trained 12 steps" in proc.stdout
    assert "Monitor V2 wrote" in proc.stdout and "No NaN found." in proc.stdout
    for monitor in ("module", "weight_grad", "optimizer", "param"):
        assert (out / "rank_0" / f"{monitor}_step0-9.csv").exists()
        assert (out / "rank_0" / f"{monitor}_step10-19.csv").exists()  # the whole window's name, as the reference cuts it


def test_demo_bad_steps_exit_code_2(tmp_path):
    proc = subprocess.run(
        [PY, "-m", "trainprobe", "demo", "--out", str(tmp_path), "--steps", "0"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "--steps" in proc.stderr and "Traceback" not in proc.stderr


TRAIN_FOREVER = textwrap.dedent(
    """
    import sys, torch
    from torch import nn
    from trainprobe import TrainerMonitorV2
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    opt = torch.optim.AdamW(model.parameters())
    mon = TrainerMonitorV2(sys.argv[1])
    mon.start(model=model, optimizer=opt)
    step = 0
    while True:
        model(torch.randn(8, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        step += 1
        if step == 20:
            print("ready", flush=True)
    """
)


def test_killed_run_leaves_parseable_csv(tmp_path):
    out = tmp_path / "out"
    cfg = write_config(
        tmp_path,
        {
            "output_dir": str(out),
            "step_count_per_record": 100000,
            "monitors": {"module": {}, "weight_grad": {"enabled": True}, "param": {"enabled": True}},
        },
    )
    script = tmp_path / "train.py"
    script.write_text(TRAIN_FOREVER, encoding="utf-8")
    proc = subprocess.Popen([PY, str(script), str(cfg)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(1.0)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    files = list((out / "rank_0").glob("*.csv"))
    assert {f.name.split("_step")[0] for f in files} == {"module", "weight_grad", "param"}
    for f in files:
        check_whole_rows(f)


def check_whole_rows(path: Path) -> None:
    """Every line the killed run finished is a whole row. Only the line being written when the
    kill came may be cut short: Linux ends a ``write()`` of several pages at a page boundary
    once SIGKILL is pending, so no appending writer can promise more; the readers skip such a
    last line (docs/csv2db.md, "Only the last line can be torn")."""
    raw = path.read_bytes()
    if not raw.endswith(b"\n"):
        cut = raw.rsplit(b"\n", 1)
        assert len(cut) == 2 and cut[1], f"{path}: no complete line"
        raw = cut[0] + b"\n"
    rows = list(csv.reader(raw.decode("utf-8").splitlines()))
    header, body = rows[0], rows[1:]
    assert len(body) > 20, path
    for row in body:
        assert len(row) == len(header), (path, row)
        for cell in row[len(header) - 5 :]:
            float(cell)
