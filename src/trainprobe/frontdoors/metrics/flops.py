"""Training FLOPs estimates for ``model-flops-throughput-per-device``.

For transformer models the estimate is the usual one (Kaplan et al. 2020; PaLM appendix B):
per token, forward and backward, ``6 * N + 12 * L * d * T`` FLOPs, where ``N`` counts the
weights of every matrix multiply (``nn.Linear`` and Hugging Face ``Conv1D`` weights, counted
per module so a tied output head counts; embeddings and norms excluded), ``L`` the layers,
``d`` the hidden size and ``T`` the sequence length (tokens / samples of the step). ``L`` and
``d`` are read from ``model.config`` (Hugging Face names, e.g. ``num_hidden_layers``,
``hidden_size``, ``n_layer``, ``n_embd``) or ``model.cfg`` (``n_layers``, ``d_model``); when
they are not found the attention term is left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

_LAYER_NAMES = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
_WIDTH_NAMES = ("hidden_size", "n_embd", "d_model", "dim")


@dataclass(frozen=True, slots=True)
class FlopsEstimate:
    """FLOPs of one training step: ``per_sample * samples + per_token * tokens
    + attention * tokens * (tokens / samples)``."""

    per_sample: float = 0.0
    per_token: float = 0.0
    attention: float = 0.0

    def step_flops(self, samples: int, tokens: int | None) -> float | None:
        """FLOPs of a step of ``samples`` samples and ``tokens`` tokens (None: not known)."""
        total = self.per_sample * samples
        if self.per_token or self.attention:
            if tokens is None or samples <= 0:
                return None
            total += self.per_token * tokens + self.attention * tokens * (tokens / samples)
        return total


def matmul_weights(model: nn.Module) -> int:
    """Elements of the weights of every ``nn.Linear`` and ``Conv1D`` module (per module)."""
    total = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, nn.Linear) or (type(module).__name__ == "Conv1D" and weight is not None):
            if weight is not None and weight.dim() == 2:
                total += weight.numel()
    return total


def _find(config: object, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def transformer_estimate(model: nn.Module) -> FlopsEstimate | None:
    """The estimate above for ``model``, or None when it has no matrix-multiply weights."""
    n = matmul_weights(model)
    if n == 0:
        return None
    attention = 0.0
    for attr in ("config", "cfg"):
        cfg = getattr(model, attr, None)
        if cfg is None:
            continue
        layers, width = _find(cfg, _LAYER_NAMES), _find(cfg, _WIDTH_NAMES)
        if layers and width:
            attention = 12.0 * layers * width
            break
    return FlopsEstimate(per_token=6.0 * n, attention=attention)
