"""Monitor V1 names: parameter squashing, target matching, and the module probe's naming.

Names always carry the chunk prefix ``<vpp_stage>:`` (``0:layers.0.mlp``), also for a single
model, as the reference writes them. Activation rows are ``<module>.input`` / ``<module>.output``
(file ``actv``) and gradient rows ``<module>.input_grad`` / ``<module>.output_grad`` (file
``actv_grad``); when a call has several tensors and the target does not pick one with
``"tuple[N]:i"``, each gets its index: ``<module>.input.0``, ``<module>.input.1``.

With ``squash_name`` (the default) parameter and module names are shortened to their meaningful
tail (:func:`squash_name`); ``targets`` entries match the full or the shortened name, with or
without the ``<vpp_stage>:`` prefix. Activations are collected for every module with
``all_xy``, else for the modules ``targets`` names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from trainprobe.config.monitor_v1 import MonitorV1Config, TargetConfig, TensorSpec
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


def display_name(config: MonitorV1Config, name: str) -> str:
    """``name`` (``<vpp_stage>:<module or parameter>``) as written, squashed with ``squash_name``."""
    if not config.squash_name:
        return name
    head, sep, tail = name.partition(":")
    if sep and head.isdigit():
        return f"{head}:{squash_name(tail)}"
    return squash_name(name)


@dataclass(frozen=True, slots=True)
class V1Naming:
    """:class:`~trainprobe.probes.module.ModuleNaming` of Monitor V1 (``targets``, ``all_xy``,
    ``forward_only``, ``backward_only``, per-tensor specs, ``squash_name``). Each module's row
    name and ``targets`` entry are worked out once and remembered (hooks run for every call)."""

    config: MonitorV1Config
    forward_scope: str = "actv"
    backward_scope: str = "actv_grad"
    _known: dict[str, tuple[str, TargetConfig | None]] = field(default_factory=dict, compare=False, repr=False)

    def wants(self, vpp_stage: int, name: str, module: nn.Module) -> bool:
        return self.config.all_xy or self._lookup(name)[1] is not None

    def forward(self, name: str, kind: str, tensors: list[torch.Tensor]) -> Picked:
        if self.config.backward_only:
            return []
        return self._select(name, kind, tensors)

    def backward(self, name: str, kind: str, tensors: list[torch.Tensor]) -> Picked:
        if self.config.forward_only:
            return []
        return self._select(name, f"{kind}_grad", tensors)

    def _lookup(self, name: str) -> tuple[str, TargetConfig | None]:
        """``(row name of the module, its targets entry or None)``."""
        try:
            return self._known[name]
        except KeyError:
            shown = display_name(self.config, name)
            target = self.config.target(name) or (self.config.target(shown) if shown != name else None)
            found = self._known[name] = (shown, target)
            return found

    def _select(self, name: str, kind: str, tensors: list[torch.Tensor]) -> Picked:
        shown, target = self._lookup(name)
        row = f"{shown}.{kind}"
        if target is None:
            return _pick(None, row, tensors)
        if not target.wants(kind):
            return []
        return _pick(target.specs.get(kind), row, tensors)
