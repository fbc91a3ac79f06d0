"""Real trainings of the demo GPT (tiny size) under Monitor V2, for the ``trainprobe diff`` tests."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import torch

from trainprobe.demo.gpt import GPTConfig, TinyGPT, synthetic_batches
from trainprobe.frontdoors.monitor_v2.trainer import TrainerMonitorV2

CONFIG = {
    "framework": "pytorch",
    "start_step": 0,
    "step_interval": 1,
    "step_count_per_record": 4,
    "monitors": {
        "module": {"enabled": True, "targets": ["layers.0", "layers.1.mlp.fc1", "head"], "ops": ["min", "max", "mean", "norm", "nans"]},
        "weight_grad": {"enabled": True, "ops": ["min", "max", "mean", "norm", "nans"], "monitor_mbs_grad": False},
        "optimizer": {"enabled": True},
        "param": {"enabled": True},
    },
}
SCALED = "layers.1.mlp.fc1.weight"
"""The weight :func:`train` scales in the candidate of the perturbation test."""


def train(
    out: Path,
    *,
    steps: int = 8,
    seed: int = 0,
    scale_after: int | None = None,
    bf16: bool = False,
    fmt: str = "csv",
) -> Path:
    """Train the tiny GPT for ``steps`` steps with Monitor V2 writing to ``out``; with
    ``scale_after``, :data:`SCALED` is multiplied by 1.001 once step ``scale_after`` is over
    (after its optimizer step, so from step ``scale_after + 1`` on); with ``bf16``, the
    forward runs under CPU bf16 autocast."""
    os.environ.setdefault("TRAINPROBE_FUSED_STATS", "off")  # seconds of compilation a short run does not amortise
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "monitor_v2_config.json"
    config_path.write_text(json.dumps(dict(CONFIG, output_dir=str(out), format=fmt)), encoding="utf-8")
    torch.manual_seed(seed)
    cfg = GPTConfig(n_layers=2, d_model=32, n_heads=2, vocab_size=64, seq_len=16)
    model = TinyGPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = synthetic_batches(cfg, batch_size=4, seed=seed)
    monitor = TrainerMonitorV2(config_path, fr="pytorch")
    monitor.start(model=model, optimizer=optimizer, grad_acc_steps=1)
    for step in range(steps):
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        with autocast:
            loss = model.loss(next(batches))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == scale_after:
            with torch.no_grad():
                dict(model.named_parameters())[SCALED].mul_(1.001)
    monitor.stop()
    return out


def resumed_copy(src: Path, dst: Path) -> Path:
    """A copy of the V2 run ``src`` as a resumed run leaves it: its steps 2-3 of ``param`` (rank 0)
    written again in a file of their own, ``param_step2-3.csv``, with every ``norm`` doubled (a
    key repeated across files, with other values)."""
    shutil.copytree(src, dst)
    lines = (dst / "rank_0" / "param_step0-3.csv").read_text().splitlines()
    header = lines[0].split(",")
    step, norm = header.index("step"), header.index("norm")
    again = []
    for line in lines[1:]:
        cells = line.split(",")
        if int(cells[step]) >= 2:
            cells[norm] = str(float(cells[norm]) * 2)
            again.append(",".join(cells))
    (dst / "rank_0" / "param_step2-3.csv").write_text("\n".join([lines[0], *again]) + "\n")
    return dst
