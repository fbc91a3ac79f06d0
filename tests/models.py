"""Small real models for the tests."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """Linear → ReLU → Linear."""

    def __init__(self, d_in: int = 6, hidden: int = 16, d_out: int = 3) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class TinyTransformer(nn.Module):
    """Embedding → one TransformerEncoderLayer (nn.MultiheadAttention(x, x, x)) → head."""

    def __init__(self, vocab: int = 50, d: int = 16, heads: int = 2, dropout: float = 0.1) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.encoder = nn.TransformerEncoderLayer(d, heads, dim_feedforward=32, dropout=dropout, batch_first=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.emb(idx)))

    def loss(self, idx: torch.Tensor) -> torch.Tensor:
        logits = self(idx)
        return nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten())


def no_hooks_left(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> bool:
    """True when no module, parameter or optimizer hook is registered."""
    for m in model.modules():
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
            return False
    for p in model.parameters():
        if p._backward_hooks:
            return False
        if getattr(p, "_post_accumulate_grad_hooks", None):
            return False
    if optimizer is not None and (optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks):
        return False
    return True
