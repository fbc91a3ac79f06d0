"""A real training run with two faults for the report's consistency tests (issue #35): the
demo's tiny GPT under Monitor V2 (module and weight_grad), a batch reaching the first block
1000x too large at :data:`SPIKE_STEP` (a spike, no NaN) and a NaN put into one gradient at
:data:`NAN_STEP`. ``diagnose`` names the spike first; the CSVs' first NaN/inf row is later.

The loop writes ``loss.csv`` beside the run (``step,loss``, as ``trainprobe demo`` does) and
keeps every loss as the float64 reference.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trainprobe import TrainerMonitorV2
from trainprobe.demo.gpt import GPTConfig, TinyGPT, synthetic_batches

STEPS = 30
SPIKE_STEP = 16
NAN_STEP = 24
NAN_PARAM = "layers.0.mlp.fc1.weight"
CFG = GPTConfig(vocab_size=100, seq_len=16, d_model=32, n_heads=2, n_layers=1)
OPS = ["min", "max", "mean", "norm", "nans"]


@dataclass
class FaultRun:
    """Where the run wrote, and its losses per step (float64, as ``loss.item()`` gave them)."""

    root: Path
    losses: list[float] = field(default_factory=list)


def make_fault_run(root: Path) -> FaultRun:
    """Train for :data:`STEPS` steps with both faults; returns the run."""
    root.mkdir(parents=True, exist_ok=True)
    config = root.parent / f"{root.name}_config.json"
    config.write_text(json.dumps({
        "output_dir": str(root),
        "step_count_per_record": 10,
        "monitors": {
            "module": {"enabled": True, "targets": ["layers.0", "ln_f", "head"], "ops": OPS},
            "weight_grad": {"enabled": True, "ops": OPS, "monitor_mbs_grad": False},
        },
    }))
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = synthetic_batches(CFG, batch_size=4, seed=0)
    monitor = TrainerMonitorV2(str(config))
    monitor.start(model=model, optimizer=opt)
    run = FaultRun(root)
    for step in range(STEPS):
        handle = model.tok_emb.register_forward_hook(lambda m, a, out: out * 1000.0) if step == SPIKE_STEP else None
        loss = model.loss(next(batches))
        if handle is not None:
            handle.remove()
        loss.backward()
        if step == NAN_STEP:
            with torch.no_grad():
                model.get_parameter(NAN_PARAM).grad.view(-1)[0] = float("nan")  # type: ignore[union-attr]
        opt.step()
        opt.zero_grad(set_to_none=True)
        run.losses.append(loss.item())
    monitor.stop()
    (root / "loss.csv").write_text("step,loss\n" + "".join(f"{s},{v!r}\n" for s, v in enumerate(run.losses)))
    return run
