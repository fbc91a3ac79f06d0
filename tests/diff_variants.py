"""Real trainings of the demo GPT under Monitor V2 that differ only by rounding or by a real change,
for the tolerance tests of ``trainprobe diff`` (issue #34).

Rounding-level variants of one training (same seed, same data): the attention as
``F.scaled_dot_product_attention`` (the fused kernel, the default), as ``(q·s)kᵀ`` or as
``(qkᵀ)·s`` written out; another number of intra-op threads. Real changes: the learning rate ×3
from a step on (an LR bug), AdamW's fused or for-loop kernel, LayerNorm's eps 1e-5 → 1e-2, the token embeddings' output ×50 at one
step, a NaN written into a weight, and bf16 autocast.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from trainprobe.demo.gpt import CausalSelfAttention, GPTConfig, TinyGPT, synthetic_batches
from trainprobe.frontdoors.monitor_v2.trainer import TrainerMonitorV2

OPS = ["min", "max", "mean", "norm", "nans"]
CONFIG = {
    "framework": "pytorch",
    "start_step": 0,
    "step_interval": 1,
    "step_count_per_record": 8,
    "monitors": {
        "module": {"enabled": True, "ops": OPS},  # every module
        "weight_grad": {"enabled": True, "ops": OPS, "monitor_mbs_grad": False},
        "optimizer": {"enabled": True},
        "param": {"enabled": True},
    },
}
SIZE = GPTConfig(n_layers=2, d_model=48, n_heads=4, vocab_size=96, seq_len=32)
"""Heads of 12: the scale 1/√12 is not a power of two, so ``(q·s)kᵀ`` and ``(qkᵀ)·s`` round differently."""
NAN_WEIGHT = "layers.1.mlp.fc1.weight"
"""The weight :attr:`Variant.nan_at` writes a NaN into."""


@dataclass(frozen=True)
class Variant:
    """How one training differs from the baseline (all defaults: the baseline itself).

    attention: ``"sdpa"`` (fused), ``"qs_k"`` (``(q·s)kᵀ``) or ``"qk_s"`` (``(qkᵀ)·s``).
    threads: intra-op threads (None: torch's default).
    lr_bug_from: from this step on the learning rate is 3× the intended one.
    ln_eps: every LayerNorm's eps.
    spike_at: the token embeddings' output ×50 at this step.
    nan_at: a NaN written into :data:`NAN_WEIGHT` after this step's optimizer step.
    bf16: the forward under CPU bf16 autocast.
    adam: AdamW's kernel: ``"foreach"`` (torch's default on CPU), ``"fused"`` or ``"loop"``.
    """

    attention: str = "sdpa"
    threads: int | None = None
    lr_bug_from: int | None = None
    ln_eps: float = 1e-5
    spike_at: int | None = None
    nan_at: int | None = None
    bf16: bool = False
    adam: str = "foreach"


class _Attention(CausalSelfAttention):
    """The demo's attention with the softmax(qkᵀ/√d)v written out in one of two orders."""

    def __init__(self, cfg: GPTConfig, order: str) -> None:
        super().__init__(cfg)
        self.order = order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        scale = 1.0 / math.sqrt(d // self.n_heads)
        scores = (q * scale) @ k.transpose(-2, -1) if self.order == "qs_k" else (q @ k.transpose(-2, -1)) * scale
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        y = F.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class _GPT(TinyGPT):
    """The demo GPT with :class:`Variant`'s attention, eps and embedding spike."""

    def __init__(self, cfg: GPTConfig, variant: Variant) -> None:
        super().__init__(cfg)
        if variant.attention != "sdpa":
            for layer in self.layers:
                old = layer.attn
                layer.attn = _Attention(cfg, variant.attention)
                layer.attn.load_state_dict(old.state_dict())
        for module in self.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.eps = variant.ln_eps
        self.spike = False

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        tokens = self.tok_emb(idx)
        x = (tokens * 50 if self.spike else tokens) + self.pos_emb(pos)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln_f(x))


def train(out: Path, variant: Variant = Variant(), *, steps: int = 12, seed: int = 0) -> Path:
    """Train the tiny GPT (:data:`SIZE`, AdamW lr 3e-3) for ``steps`` steps as ``variant`` says,
    Monitor V2 (:data:`CONFIG`, CSV) writing to ``out``; ``out``."""
    os.environ.setdefault("TRAINPROBE_FUSED_STATS", "off")  # seconds of compilation a short run does not amortise
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "monitor_v2_config.json"
    config_path.write_text(json.dumps(dict(CONFIG, output_dir=str(out), format="csv")), encoding="utf-8")
    with _threads(variant.threads):
        torch.manual_seed(seed)
        model = _GPT(SIZE, variant)
        kernel = {"fused": {"fused": True}, "loop": {"foreach": False}, "foreach": {"foreach": True}}[variant.adam]
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, **kernel)
        monitor = TrainerMonitorV2(config_path, fr="pytorch")
        monitor.start(model=model, optimizer=optimizer, grad_acc_steps=1)
        _loop(model, optimizer, synthetic_batches(SIZE, batch_size=8, seed=seed), variant, steps)
        monitor.stop()
    return out


def _loop(model: _GPT, optimizer: torch.optim.Optimizer, batches: Iterator[torch.Tensor], variant: Variant,
          steps: int) -> None:
    for step in range(steps):
        if step == variant.lr_bug_from:
            for group in optimizer.param_groups:
                group["lr"] *= 3
        model.spike = step == variant.spike_at
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if variant.bf16 else contextlib.nullcontext()
        with autocast:
            loss = model.loss(next(batches))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == variant.nan_at:
            with torch.no_grad():
                dict(model.named_parameters())[NAN_WEIGHT][0, 0] = float("nan")


@contextlib.contextmanager
def _threads(count: int | None) -> Iterator[None]:
    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
