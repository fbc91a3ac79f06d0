"""Small real models for the precision-dump tests (the spec's ModuleOP, a conv net, a tiny GPT)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ModuleOP(nn.Module):
    """The spec's example: Linear(8, 4) → ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features=8, out_features=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.linear(x))


class TwoLinear(nn.Module):
    """The spec's module_dump / cross-file example: Linear(8, 4) → Linear(4, 2) → ReLU."""

    def __init__(self, cross_file: bool = False) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_features=8, out_features=4)
        self.linear_2 = nn.Linear(in_features=4, out_features=2)
        self.cross_file = cross_file

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from trainprobe.dump import PrecisionDebugger

        if self.cross_file:
            PrecisionDebugger.start()
        x1 = self.linear_1(x)
        if self.cross_file:
            PrecisionDebugger.stop()
        x2 = self.linear_2(x1)
        return F.relu(x2)


class ConvNet(nn.Module):
    """conv1 → ReLU → conv2 → leaky ReLU → pool → Linear; ``perturbed`` changes the leaky ReLU's
    slope (one API, same call structure) for the compare tests."""

    def __init__(self, perturbed: bool = False) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1, bias=True)
        self.fc = nn.Linear(16, 5)
        self.slope = 0.2 if perturbed else 0.01

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.leaky_relu(self.conv2(x), self.slope)
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)


class TinyGPT(nn.Module):
    """Embedding → two pre-norm blocks (MultiheadAttention(x, x, x), MLP) → head."""

    def __init__(self, vocab: int = 40, d: int = 16, heads: int = 2, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d, heads, dim_feedforward=32, dropout=0.1, batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def loss(self, idx: torch.Tensor) -> torch.Tensor:
        logits = self(idx)
        return F.cross_entropy(logits.flatten(0, 1), idx.flatten())
