"""A small GPT-style language model (pre-norm transformer blocks) built from plain ``torch.nn``.

The default size is the benchmark's: 4 layers, d_model 256, 4 heads, sequence 128, vocabulary
2000, about 4.2M parameters. Nothing is downloaded: tokens are synthetic.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True, kw_only=True)
class GPTConfig:
    """Model size."""

    vocab_size: int = 2000
    seq_len: int = 128
    d_model: int = 256
    n_heads: int = 4
    n_layers: int = 4


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused qkv projection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    """Two linear layers with GELU, 4x wide."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.fc2 = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Token + position embeddings, ``n_layers`` blocks, final LayerNorm, LM head."""

    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg or GPTConfig()
        c = self.cfg
        self.tok_emb = nn.Embedding(c.vocab_size, c.d_model)
        self.pos_emb = nn.Embedding(c.seq_len, c.d_model)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.ln_f = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln_f(x))

    def loss(self, idx: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy on ``idx`` (batch, seq)."""
        logits = self(idx[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))


def synthetic_batches(cfg: GPTConfig, batch_size: int, seed: int = 0, device: str | torch.device = "cpu"):
    """An endless stream of learnable token batches: each sequence counts up from a random start
    modulo the vocabulary, so the loss falls quickly."""
    gen = torch.Generator().manual_seed(seed)
    steps = torch.arange(cfg.seq_len + 1)
    while True:
        start = torch.randint(0, cfg.vocab_size, (batch_size, 1), generator=gen)
        yield ((start + steps) % cfg.vocab_size).to(device)


@dataclass
class TrainingSetup:
    """The benchmarks' training run: model, AdamW optimizer and a batch stream."""

    cfg: GPTConfig
    model: TinyGPT
    optimizer: torch.optim.Optimizer
    batches: Iterator[torch.Tensor]


def benchmark_setup(seed: int, batch_size: int = 8, cfg: GPTConfig | None = None) -> TrainingSetup:
    """The GPT benchmark's run (default size, AdamW lr 3e-4), seeded, on the CPU."""
    torch.manual_seed(seed)
    cfg = cfg or GPTConfig()
    model = TinyGPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    return TrainingSetup(cfg, model, optimizer, synthetic_batches(cfg, batch_size, seed=seed))
