"""The small GPT of :mod:`trainprobe.demo.gpt`, in MindSpore (PyNative), for the MindSpore
benchmark and the cross-framework tests.

Same structure, same cell and parameter names as the PyTorch model (``tok_emb.weight``,
``layers.0.ln1.weight``, ``layers.0.attn.qkv.weight``, ...), so that monitor outputs of the two
compare row by row and :func:`load_torch_weights` can copy weights across. Built only from
operators that MindSpore's CPU build has (its ``mint.nn`` LayerNorm, Embedding and GELU have no
CPU kernels; ``nn.LayerNorm`` would name its parameters ``gamma``/``beta``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from trainprobe.demo.gpt import GPTConfig

_CROSS_ENTROPY = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")  # not a child cell


class LayerNorm(nn.Cell):
    """LayerNorm over the last axis with PyTorch's parameter names (``weight``, ``bias``)."""

    def __init__(self, d: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = Parameter(Tensor(np.ones(d, np.float32)), name="weight")
        self.bias = Parameter(Tensor(np.zeros(d, np.float32)), name="bias")
        self.eps = eps

    def construct(self, x: Tensor) -> Tensor:
        mean = x.mean(-1, keep_dims=True)
        centred = x - mean
        var = (centred * centred).mean(-1, keep_dims=True)
        return centred * ops.rsqrt(var + self.eps) * self.weight + self.bias


class Embedding(nn.Cell):
    """Lookup table with PyTorch's parameter name (``weight``)."""

    def __init__(self, n: int, d: int) -> None:
        super().__init__()
        self.weight = Parameter(Tensor(np.random.standard_normal((n, d)).astype(np.float32)), name="weight")

    def construct(self, idx: Tensor) -> Tensor:
        return ops.gather(self.weight, idx, 0)


class CausalSelfAttention(nn.Cell):
    """Multi-head causal self-attention with a fused qkv projection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Dense(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Dense(cfg.d_model, cfg.d_model)
        self.mask = Tensor(np.triu(np.ones((cfg.seq_len, cfg.seq_len), dtype=np.bool_), 1))

    def construct(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        h = self.n_heads
        q, k, v = ops.split(self.qkv(x), d, axis=-1)
        q, k, v = (z.reshape(b, t, h, d // h).transpose(0, 2, 1, 3) for z in (q, k, v))
        att = ops.matmul(q, k.swapaxes(-1, -2)) * (1.0 / math.sqrt(d // h))
        att = ops.softmax(ops.masked_fill(att, self.mask[:t, :t], float("-inf")), axis=-1)
        y = ops.matmul(att, v).transpose(0, 2, 1, 3).reshape(b, t, d)
        return self.proj(y)


class MLP(nn.Cell):
    """Two linear layers with (exact) GELU, 4x wide."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Dense(cfg.d_model, 4 * cfg.d_model)
        self.fc2 = nn.Dense(4 * cfg.d_model, cfg.d_model)

    def construct(self, x: Tensor) -> Tensor:
        return self.fc2(ops.gelu(self.fc1(x), approximate="none"))


class Block(nn.Cell):
    """Pre-norm transformer block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def construct(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Cell):
    """Token + position embeddings, ``n_layers`` blocks, final LayerNorm, LM head."""

    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg or GPTConfig()
        c = self.cfg
        self.tok_emb = Embedding(c.vocab_size, c.d_model)
        self.pos_emb = Embedding(c.seq_len, c.d_model)
        self.layers = nn.CellList([Block(c) for _ in range(c.n_layers)])
        self.ln_f = LayerNorm(c.d_model)
        self.head = nn.Dense(c.d_model, c.vocab_size)

    def construct(self, idx: Tensor) -> Tensor:
        pos = Tensor(np.arange(idx.shape[1], dtype=np.int32))
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln_f(x))

    def loss(self, idx: Tensor) -> Tensor:
        """Next-token cross-entropy on ``idx`` (batch, seq)."""
        logits = self(idx[:, :-1])
        return _CROSS_ENTROPY(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))


def load_torch_weights(cell: nn.Cell, module: Any) -> None:
    """Copy the weights of a PyTorch module with the same parameter names into ``cell``.

    Raises:
        KeyError: a parameter of ``cell`` has no PyTorch counterpart.
    """
    state = {name: p.detach().cpu().numpy() for name, p in module.named_parameters()}
    for name, p in cell.parameters_and_names():
        p.set_data(Tensor(state[name].copy()))


def synthetic_batches(cfg: GPTConfig, batch_size: int, seed: int = 0) -> Iterator[Tensor]:
    """An endless stream of learnable token batches (int32), as :func:`trainprobe.demo.gpt.synthetic_batches`."""
    rng = np.random.default_rng(seed)
    steps = np.arange(cfg.seq_len + 1)
    while True:
        start = rng.integers(0, cfg.vocab_size, (batch_size, 1))
        yield Tensor(((start + steps) % cfg.vocab_size).astype(np.int32))


@dataclass
class TrainingSetup:
    """The MindSpore benchmark's run: model, optimizer, gradient function and a batch stream."""

    cfg: GPTConfig
    model: TinyGPT
    optimizer: nn.Optimizer
    grad_fn: Any
    batches: Iterator[Tensor]


def benchmark_setup(seed: int, batch_size: int = 8, cfg: GPTConfig | None = None) -> TrainingSetup:
    """The GPT benchmark's run in MindSpore (default size, AdamWeightDecay lr 3e-4, weight decay
    0.01, eps 1e-8), seeded, PyNative on the current device target."""
    ms.set_seed(seed)
    np.random.seed(seed)
    cfg = cfg or GPTConfig()
    model = TinyGPT(cfg)
    optimizer = nn.AdamWeightDecay(model.trainable_params(), learning_rate=3e-4, eps=1e-8, weight_decay=0.01)
    grad_fn = ms.value_and_grad(model.loss, None, optimizer.parameters)
    return TrainingSetup(cfg, model, optimizer, grad_fn, synthetic_batches(cfg, batch_size, seed=seed))
