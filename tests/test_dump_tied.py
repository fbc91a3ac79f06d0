"""Level L0 and mix: a parameter shared by two modules (a head tied to the embedding) has a
``parameters_grad`` record in each module that holds it, as the reference tool writes them, each
with the parameter's total gradient; the dump leaves training bitwise unchanged."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from trainprobe.dump import PrecisionDebugger


class TiedHead(nn.Module):
    """Embedding → Linear → a head whose weight is the embedding's."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.block = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.block(self.embed(x))))


def train(dump_path: Path | None, level: str, steps: int = 2) -> tuple[TiedHead, list[torch.Tensor]]:
    """Train a fresh TiedHead for ``steps`` (dumped when ``dump_path`` is given); the model and
    the tied weight's gradient of each step."""
    torch.manual_seed(3)
    model = TiedHead()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(5)
    debugger = PrecisionDebugger(task="statistics", level=level, dump_path=str(dump_path)) if dump_path else None
    grads = []
    for _ in range(steps):
        x, y = torch.randint(0, 10, (3, 4), generator=gen), torch.randn(3, 4, 10, generator=gen)
        if debugger is not None:
            debugger.start(model)
        (model(x) - y).pow(2).mean().backward()
        if debugger is not None:
            debugger.stop()
            debugger.step()
        grads.append(model.embed.weight.grad.detach().clone())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, grads


def dump_data(root: Path, step: int) -> dict[str, Any]:
    [path] = (root / f"step{step}").glob("*/dump.json")
    return json.loads(path.read_text())["data"]


@pytest.mark.parametrize("level", ["L0", "mix"])
def test_a_tied_head_has_its_own_parameters_grad_record(tmp_path: Path, level: str) -> None:
    model, grads = train(tmp_path / "dump", level)
    plain, plain_grads = train(None, level)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads))  # training unchanged
    assert torch.equal(model.embed.weight, plain.embed.weight)
    for step, grad in enumerate(grads):
        data = dump_data(tmp_path / "dump", step)
        ref = grad.double()
        for record in ("Module.embed.Embedding.parameters_grad.0", "Module.head.Linear.parameters_grad.0"):
            [entry] = data[record]["weight"]
            assert entry["shape"] == [10, 8]
            assert entry["Max"] == pytest.approx(ref.max().item(), rel=1e-6)
            assert entry["Min"] == pytest.approx(ref.min().item(), rel=1e-6)
            assert entry["Norm"] == pytest.approx(ref.norm().item(), rel=1e-6)
            assert entry["Mean"] == pytest.approx(ref.mean().item(), rel=1e-5, abs=1e-9)
        assert set(data["Module.block.Linear.parameters_grad.0"]) == {"weight", "bias"}
        assert sorted(k for k in data if ".parameters_grad." in k) == [
            "Module.block.Linear.parameters_grad.0",
            "Module.embed.Embedding.parameters_grad.0",
            "Module.head.Linear.parameters_grad.0",
        ]
