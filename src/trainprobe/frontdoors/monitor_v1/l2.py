"""L2 interpretable features (``recording_l2_features`` with ``l2_targets``).

* ``linear_hook`` (table ``linear_hook``, columns ``sr``, ``kernel_norm``): for each listed module
  with a 2-D ``weight`` (or ``wg``) that is not an embedding (an empty list: every such module),
  on its first forward call of a collected step, ``kernel_norm`` = the spectral norm ``‖W‖₂``
  (largest singular value, exact: how much the layer can amplify an input) and ``sr`` =
  ``‖W‖_F / ‖W‖₂``, the stable rank as the reference defines it. Rows are named
  ``<module>.linear``, as the reference names them.
* ``attention_hook`` (table ``attention_hook``, columns ``entropy``, ``softmax_max``): the listed
  modules' first two tensor inputs are Q and K, laid out as ``sa_order`` says (``s,b,h,d`` or
  ``b,s,h,d``); with ``P = softmax(Q Kᵀ / √d)`` over the keys, ``entropy`` is the mean over batch,
  heads and queries of ``-Σ p log p`` and ``softmax_max`` the mean of ``max p``. No attention
  mask is applied. Computed in float32 without gradients, and on an accelerator without a host
synchronisation (the values stay on the device until the step's rows are copied).

Names are module names with the ``<vpp_stage>:`` prefix; modules are matched with or without it.
An embedding (``nn.Embedding``, or a module with ``num_embeddings``/``vocab_start_index``) is a
lookup table, not a linear map: ``linear_hook`` skips it even when listed, as the reference does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trainprobe.backends.torch.backend import TORCH
from trainprobe.backends.torch.stats import RowValues
from trainprobe.engine.probes.base import Probe, ProbeSpec, StepClock
from trainprobe.engine.probes.model_view import ModelView
from trainprobe.engine.records import RowKey
from trainprobe.engine.tensor_walk import call_tensors
from trainprobe.frontdoors.monitor_v1.config import L2Config
from trainprobe.frontdoors.monitor_v1.naming import bare

LINEAR_SUFFIX = ".linear"
"""What a ``linear_hook`` row's name adds to its module's name."""


def linear_weight(module: nn.Module) -> torch.Tensor | None:
    """The 2-D ``weight`` (else ``wg``) of a linear-like module; None for an embedding or a
    module without one."""
    if isinstance(module, nn.Embedding) or hasattr(module, "num_embeddings") or hasattr(module, "vocab_start_index"):
        return None
    for attr in ("weight", "wg"):
        value = getattr(module, attr, None)
        if isinstance(value, torch.Tensor) and value.dim() == 2:
            return value
    return None


def _row(values: list[torch.Tensor]) -> RowValues:
    """Host floats on the CPU, a float64 device tensor elsewhere."""
    row = torch.stack(values).to(torch.float64)
    return row.tolist() if row.device.type == "cpu" else row


def linear_features(weight: torch.Tensor) -> RowValues:
    """``[sr, kernel_norm]`` of a 2-D weight (``sr`` NaN for a zero matrix)."""
    with torch.no_grad():
        w = weight.detach().float()
        spectral = torch.linalg.matrix_norm(w, ord=2)
        frobenius = torch.linalg.matrix_norm(w)
        return _row([frobenius / spectral, spectral])


def attention_features(q: torch.Tensor, k: torch.Tensor, sa_order: str) -> RowValues:
    """``[entropy, softmax_max]`` of ``softmax(Q Kᵀ/√d)`` (see the module docstring)."""
    with torch.no_grad():
        q, k = q.detach().float(), k.detach().float()
        if sa_order == "s,b,h,d":
            q, k = q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3)
        else:
            q, k = q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3)
        p = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1).mean()
        return _row([entropy, p.amax(-1).mean()])


class L2Probe(Probe):
    """Linear and attention features of the configured modules."""

    name = "l2_features"

    def __init__(self, clock: StepClock, l2: L2Config, view: ModelView) -> None:
        super().__init__(clock, ProbeSpec(("norm",), 1e-8), backend=TORCH)
        self.l2 = l2
        self.view = view
        self._done: set[str] = set()

    @staticmethod
    def _listed(names: tuple[str, ...], name: str) -> bool:
        return name in names or bare(name) in names

    def attach(self) -> None:
        cfg = self.l2
        for vpp, name, module in self.view.modules():
            has_2d = linear_weight(module) is not None
            if cfg.linear_hook is not None and has_2d and (not cfg.linear_hook or self._listed(cfg.linear_hook, name)):
                self.keep(module.register_forward_hook(self.eager(self._linear(vpp, name))))
            if cfg.attention_hook and self._listed(cfg.attention_hook, name):
                self.keep(module.register_forward_hook(self.eager(self._attention(vpp, name)), with_kwargs=True))

    def end_step(self) -> None:
        self._done.clear()

    def _first(self, key: str) -> bool:
        if not self.active or key in self._done:
            return False
        self._done.add(key)
        return True

    def _linear(self, vpp: int, name: str) -> Any:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            weight = linear_weight(module)
            if weight is not None and self._first("linear:" + name):
                self.rows.add(RowKey(vpp, name + LINEAR_SUFFIX, "linear_hook"), linear_features(weight))

        return hook

    def _attention(self, vpp: int, name: str) -> Any:
        def hook(module: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
            tensors = [t for t in call_tensors(args, kwargs, torch.Tensor) if t.dim() == 4]
            if len(tensors) >= 2 and self._first("attention:" + name):
                feats = attention_features(tensors[0], tensors[1], self.l2.sa_order)
                self.rows.add(RowKey(vpp, name, "attention_hook"), feats)

        return hook
