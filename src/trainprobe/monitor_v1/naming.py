"""Monitor V1 names: parameter squashing, target matching, and the module probe's naming.

Names always carry the chunk prefix ``<vpp_stage>:`` (``0:layers.0.mlp``), also for a single
model, as the reference writes them. Activation rows are ``<module>.input`` / ``<module>.output``
(file ``actv``) and gradient rows ``<module>.input_grad`` / ``<module>.output_grad`` (file
``actv_grad``); when a call has several tensors and the target does not pick one with
``"tuple[N]:i"``, each gets its index: ``<module>.input.0``, ``<module>.input.1``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from trainprobe.config.monitor_v1 import MonitorV1Config, TensorSpec
from trainprobe.probes.module import Picked

_SQUASH = tuple(
    re.compile(p)
    for p in (r"^.*\.(layers?\..*)", r"^.*\.(embeddings?\..*)", r"^.*\.(final.*)", r"^.*\.(output.*)", r"^.*\.(norm.*)")
)


def squash_name(name: str) -> str:
    """Shorten a parameter name to its meaningful tail (``module.language_model.encoder.layers.0.
    mlp.weight`` → ``layers.0.mlp.weight``); names no pattern matches are kept."""
    for pattern in _SQUASH:
        m = pattern.match(name)
        if m:
            return m.group(1)
    return name


def bare(name: str) -> str:
    """``name`` without its ``<vpp_stage>:`` prefix."""
    head, sep, tail = name.partition(":")
    return tail if sep and head.isdigit() else name


def param_targeted(config: MonitorV1Config, name: str) -> bool:
    """Whether parameter ``name`` is monitored: no targets, or a target is the parameter or
    one of the modules holding it."""
    if not config.targets:
        return True
    plain = bare(name)
    for t in config.targets:
        for candidate in (name, plain):
            if candidate == t.name or candidate.startswith(t.name + "."):
                return True
    return False


def _pick(spec: TensorSpec | None, row: str, tensors: list[torch.Tensor]) -> Picked:
    if spec is not None and spec.index is not None:
        return [(row, tensors[spec.index])] if spec.index < len(tensors) else []
    if len(tensors) == 1:
        return [(row, tensors[0])]
    return [(f"{row}.{i}", t) for i, t in enumerate(tensors)]


@dataclass(frozen=True, slots=True)
class V1Naming:
    """:class:`~trainprobe.probes.module.ModuleNaming` of Monitor V1 (``targets``, ``all_xy``,
    ``forward_only``, ``backward_only``, per-tensor specs)."""

    config: MonitorV1Config
    forward_scope: str = "actv"
    backward_scope: str = "actv_grad"

    def wants(self, vpp_stage: int, name: str, module: nn.Module) -> bool:
        return self.config.all_xy or self.config.target(name) is not None

    def forward(self, name: str, kind: str, tensors: list[torch.Tensor]) -> Picked:
        if self.config.backward_only:
            return []
        return self._select(name, kind, f"{name}.{kind}", tensors)

    def backward(self, name: str, kind: str, tensors: list[torch.Tensor]) -> Picked:
        if self.config.forward_only:
            return []
        return self._select(name, f"{kind}_grad", f"{name}.{kind}_grad", tensors)

    def _select(self, name: str, kind: str, row: str, tensors: list[torch.Tensor]) -> Picked:
        target = self.config.target(name)
        if target is not None and not target.wants(kind):
            return []
        spec = target.specs.get(kind) if target is not None else None
        return _pick(spec, row, tensors)
