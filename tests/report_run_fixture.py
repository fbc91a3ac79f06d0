"""A tiny real training run for the report's Run and top-offenders tests: Monitor V2 with
weight_grad, and the training metrics writing ``training_state.jsonl`` and TensorBoard events,
with every number the report draws recorded in float64 as the reference.

The model is an embedding with a large gradient (the "embedding row" that washed the heatmaps
out) and two small linear layers; the learning rate changes every step (LambdaLR).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from trainprobe import TrainerMonitorV2
from trainprobe.frontdoors.metrics import TrainingMetricsMonitor

STEPS = 8
OPS = ["min", "max", "mean", "norm"]


class EmbedMLP(nn.Module):
    """Embedding (scaled up: its gradient dominates) → Linear → ReLU → Linear → mean square."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(50.0 * self.embed(ids)))).pow(2).mean()


@dataclass
class RunReference:
    """Where the run wrote and what it computed (float64), per optimizer step in order."""

    v2: Path
    dump: Path
    tensorboard: Path
    names: list[str]
    losses: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    grad_norms: list[dict[str, float]] = field(default_factory=list)  # parameter → |grad|

    def global_norm(self, step: int) -> float:
        return math.sqrt(math.fsum(v * v for v in self.grad_norms[step].values()))


def make_run(base: Path) -> RunReference:
    """Train :class:`EmbedMLP` for :data:`STEPS` steps under both monitors."""
    torch.manual_seed(0)
    model = EmbedMLP()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    ref = RunReference(base / "v2", base / "dump", base / "tb", [n for n, _ in model.named_parameters()])
    v2_config = base / "v2.json"
    base.mkdir(parents=True, exist_ok=True)
    v2_config.write_text(
        json.dumps({"output_dir": str(ref.v2), "monitors": {"weight_grad": {"enabled": True, "ops": OPS}}})
    )
    fmt = "tensorboard"
    metrics_config = {
        "monitor_config": {
            "monitor_on": True,
            "dump_path": str(ref.dump),
            "local_loss_format": fmt,
            "device_local_loss_format": fmt,
            "local_norm_format": fmt,
            "device_local_norm_format": fmt,
        },
        "tensorboard": {"tensorboard_dir": str(ref.tensorboard)},
    }
    v2 = TrainerMonitorV2(str(v2_config))
    v2.start(model=model, optimizer=opt)
    metrics = TrainingMetricsMonitor(metrics_config, model=model, optimizer=opt)
    for _ in range(STEPS):
        loss = model(torch.randint(0, 20, (6, 3)))
        loss.backward()
        ref.losses.append(loss.item())
        ref.lrs.append(opt.param_groups[0]["lr"])
        ref.grad_norms.append({n: math.sqrt(float(p.grad.double().pow(2).sum())) for n, p in model.named_parameters()})
        opt.step()
        scheduler.step()
        opt.zero_grad(set_to_none=True)
        metrics.step(loss=loss)
    metrics.close()
    v2.stop()
    return ref
