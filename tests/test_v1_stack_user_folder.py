"""Monitor V1's ``stack_info`` keeps the user's frames wherever the user's code lives: a frame is
left out because its file lies inside the installed torch / mindspore / trainprobe package, never
because its path contains one of those words (a clone into a folder named ``trainprobe``)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

import trainprobe

USER_SCRIPT = textwrap.dedent(
    """
    import sys

    import torch
    from torch import nn

    from trainprobe.frontdoors.monitor_v1 import TrainerMon


    def user_training_step(model, opt):
        model(torch.randn(4, 6)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


    def main():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        mon = TrainerMon(sys.argv[1])
        mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
        for _ in range(2):
            user_training_step(model, opt)
        mon.stop()


    main()
    """
)


def test_stack_info_keeps_user_frames_in_a_folder_named_like_the_libraries(tmp_path: Path) -> None:
    user = tmp_path / "trainprobe" / "torch" / "mindspore" / "user"
    user.mkdir(parents=True)
    script = user / "train_user.py"
    script.write_text(USER_SCRIPT, encoding="utf-8")
    config = user / "monitor_config.json"
    config.write_text(json.dumps({"stack_info": True}), encoding="utf-8")
    out = user / "out"
    env = {**os.environ, "MONITOR_OUTPUT_DIR": str(out)}
    done = subprocess.run(
        [sys.executable, str(script), str(config)], cwd=user, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    [folder] = [p for p in out.iterdir() if "-rank0-" in p.name]
    with (folder / "stack_info.csv").open(newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    assert {r["module_name"] for r in rows} == {"0:", "0:0", "0:1", "0:2"}
    library_dirs = [str(Path(trainprobe.__file__).resolve().parent), str(Path(torch.__file__).resolve().parent)]
    for row in rows:
        stack = row["stack_info"]
        assert f"File {script}" in stack, stack
        assert "in user_training_step" in stack and "in main" in stack, stack
        for line in stack.splitlines():
            path = line.removeprefix("File ").rsplit(", line ", 1)[0]
            assert not any(Path(path).resolve().is_relative_to(d) for d in library_dirs), line
