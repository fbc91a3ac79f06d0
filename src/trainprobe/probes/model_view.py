"""Names of the modules and parameters of a model or a list of model chunks.

A single model is ``vpp_stage`` 0 and its names are PyTorch's ``named_modules()`` /
``named_parameters()`` names. For a list of chunks (virtual pipeline stages), chunk ``i`` has
``vpp_stage`` i and its names carry the prefix ``"i:"`` (``"1:layers.0.mlp"``). The root module
itself, whose PyTorch name is the empty string, is called ``root`` (``"0:root"`` in a chunk list).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from trainprobe.errors import ConfigError

NAME_SEP = ":"
ROOT_NAME = "root"


@dataclass(frozen=True, slots=True)
class NamedParam:
    """A parameter with its output name and chunk index."""

    vpp_stage: int
    name: str
    param: torch.nn.Parameter


class ModelView:
    """Read-only naming view over ``model`` (a module, a list of modules, or None)."""

    def __init__(self, model: nn.Module | Sequence[nn.Module] | None) -> None:
        if model is None:
            self.chunks: list[nn.Module] = []
            self.is_list = False
        elif isinstance(model, nn.Module):
            self.chunks, self.is_list = [model], False
        elif isinstance(model, (list, tuple)) and all(isinstance(m, nn.Module) for m in model):
            self.chunks, self.is_list = list(model), True
        else:
            raise ConfigError(
                f"start(model=...): expected a torch.nn.Module or a list of them, got {type(model).__name__}"
            )

    def prefix(self, vpp_stage: int) -> str:
        """Name prefix of chunk ``vpp_stage`` (empty for a single model)."""
        return f"{vpp_stage}{NAME_SEP}" if self.is_list else ""

    def modules(self) -> Iterator[tuple[int, str, nn.Module]]:
        """``(vpp_stage, name, module)`` for every module, each chunk in order, root first."""
        for vpp, chunk in enumerate(self.chunks):
            for name, module in chunk.named_modules():
                yield vpp, self.prefix(vpp) + (name or ROOT_NAME), module

    def parameters(self) -> list[NamedParam]:
        """Every parameter once, in model order (a shared parameter keeps its first name)."""
        seen: set[int] = set()
        out: list[NamedParam] = []
        for vpp, chunk in enumerate(self.chunks):
            for name, p in chunk.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(NamedParam(vpp, self.prefix(vpp) + name, p))
        return out

    def optimizer_parameters(self, optimizer: torch.optim.Optimizer) -> list[NamedParam]:
        """The optimizer's parameters, in model order; ones the model does not hold are named
        ``param_group<g>.<i>`` and come last."""
        in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
        named = [np for np in self.parameters() if id(np.param) in in_optimizer]
        known = {id(np.param) for np in named}
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                if id(p) not in known:
                    known.add(id(p))
                    named.append(NamedParam(0, f"param_group{g}.{i}", p))
        return named


def unwrap_optimizer(optimizer: object) -> torch.optim.Optimizer:
    """The torch optimizer inside ``optimizer``, following ``.optimizer`` attributes of wrappers
    (DeepSpeed, accelerate, Megatron style). A wrapper that subclasses ``Optimizer`` itself
    (accelerate's ``AcceleratedOptimizer``) is followed too, down to the innermost optimizer.

    Raises:
        ConfigError: no ``torch.optim.Optimizer`` is found.
    """
    current, found = optimizer, None
    for _ in range(8):
        if isinstance(current, torch.optim.Optimizer):
            found = current
        inner = getattr(current, "optimizer", None)
        if inner is None or inner is current:
            break
        current = inner
    if found is not None:
        return found
    raise ConfigError(
        f"start(optimizer=...): expected a torch.optim.Optimizer or a wrapper holding one in "
        f".optimizer, got {type(optimizer).__name__}"
    )
