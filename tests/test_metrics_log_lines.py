"""The training metrics' ``log`` output is one INFO line per recorded step: the example
configuration of docs/training_metrics.md (4 targeted parameters, every state format with
``log``) logged 8 lines per step before (the summary, then one line per other metric)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from trainprobe import TrainingMetricsMonitor

DOC = Path(__file__).resolve().parent.parent / "docs" / "training_metrics.md"


def example_config() -> str:
    """The ``train.yaml`` block of docs/training_metrics.md."""
    text = DOC.read_text(encoding="utf-8")
    found = re.search(r"<!-- snippet: file train.yaml -->\n```yaml\n(.*?)```", text, re.DOTALL)
    assert found is not None, "docs/training_metrics.md has no train.yaml block"
    return found.group(1)


class Net(nn.Module):
    """The model of the page's example (train.yaml watches layers.0 and layers.1)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](torch.relu(self.layers[0](x)))


def test_the_example_config_logs_one_line_per_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.yaml").write_text(example_config(), encoding="utf-8")
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with caplog.at_level(logging.INFO):
        mon = TrainingMetricsMonitor("train.yaml", model=model, optimizer=optimizer)
        for _ in range(5):
            loss = model(torch.randn(4, 8)).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            mon.step(loss=loss)
        mon.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "trainprobe.metrics" and r.levelno == logging.INFO]
    assert [line[:12] for line in lines] == [f"step:[{s:5d}]" for s in range(1, 6)], lines  # steps count from 1
    for line in lines:  # everything asked for 'log' is on the step's line
        for tag in (
            "loss",
            "grad-norm",
            "local_norm/layers.0.weight",
            "local_norm/layers.1.bias",
            "device_local_norm",
            "local_loss",
            "device_accum_local_loss",
        ):
            assert f" {tag}: " in line, (tag, line)
