"""Names of the modules and parameters of a model or a list of model chunks.

A single model is ``vpp_stage`` 0 and its names are PyTorch's ``named_modules()`` /
``named_parameters()`` names. For a list of chunks (virtual pipeline stages), chunk ``i`` has
``vpp_stage`` i and its names carry the prefix ``"i:"`` (``"1:layers.0.mlp"``). The root module
itself, whose PyTorch name is the empty string, is called ``root`` (``"0:root"`` in a chunk list).

``torch.compile``: the ``_orig_mod`` component an ``OptimizedModule`` (``torch.compile(module)``)
adds to the names of what it wraps is left out, so a compiled model has the names of the model
it compiles (``fc1.weight``, not ``_orig_mod.fc1.weight``). The wrapped module itself is not
listed: the ``OptimizedModule`` stands for it under the same name. :meth:`ModelView.compiled`
lists the modules whose hooks run inside a compiled graph.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainprobe.errors import ConfigError
from trainprobe.optimizer_view import OptimizerView

NAME_SEP = ":"
ROOT_NAME = "root"
COMPILED_WRAPPED = "_orig_mod"
"""Attribute of ``torch.compile``'s ``OptimizedModule`` holding the module it compiles."""


def _plain_name(name: str) -> str:
    """``name`` without the ``_orig_mod`` components ``torch.compile`` wrappers add."""
    if COMPILED_WRAPPED not in name:
        return name
    return ".".join(part for part in name.split(".") if part != COMPILED_WRAPPED)


def _is_compiled_wrapper(module: Any) -> bool:
    """Whether ``module`` is ``torch.compile``'s ``OptimizedModule``."""
    return isinstance(getattr(module, COMPILED_WRAPPED, None), nn.Module) and hasattr(module, "dynamo_ctx")


@dataclass(frozen=True, slots=True)
class NamedParam:
    """A parameter with its output name and chunk index."""

    vpp_stage: int
    name: str
    param: Any  # the framework's parameter (torch.nn.Parameter, mindspore.Parameter)


class ModelView:
    """Read-only naming view over ``model`` (a module, a list of modules, or None).

    The framework shows through three methods only (``_is_model``, ``_named_modules``,
    ``_named_parameters``) and ``model_kind``; another framework's adapter
    subclasses this view and overrides them.
    """

    model_kind = "torch.nn.Module"

    def __init__(self, model: nn.Module | Sequence[nn.Module] | None, where: str = "start(model=...)") -> None:
        """Raises ConfigError (naming ``where``, the argument) when ``model`` is neither a
        module of the framework nor a list of them."""
        if model is None:
            self.chunks: list[Any] = []  # the framework's modules
            self.is_list = False
        elif self._is_model(model):
            self.chunks, self.is_list = [model], False
        elif isinstance(model, (list, tuple)) and all(self._is_model(m) for m in model):
            self.chunks, self.is_list = list(model), True
        else:
            raise ConfigError(f"{where}: expected a {self.model_kind} or a list of them, got {type(model).__name__}")

    # -- the framework ---------------------------------------------------------------------
    def _is_model(self, obj: object) -> bool:
        """Whether ``obj`` is a module of the framework."""
        return isinstance(obj, nn.Module)

    def _named_modules(self, chunk: Any) -> Iterator[tuple[str, Any]]:
        """``(name, module)`` of every module of ``chunk``, the chunk itself first as ``""``."""
        return chunk.named_modules()

    def _named_parameters(self, chunk: Any) -> Iterator[tuple[str, Any]]:
        """``(name, parameter)`` of every parameter of ``chunk``."""
        return chunk.named_parameters()

    def prefix(self, vpp_stage: int) -> str:
        """Name prefix of chunk ``vpp_stage`` (empty for a single model)."""
        return f"{vpp_stage}{NAME_SEP}" if self.is_list else ""

    def modules(self) -> Iterator[tuple[int, str, nn.Module]]:
        """``(vpp_stage, name, module)`` for every module, each chunk in order, root first; the
        module a ``torch.compile`` wrapper holds is represented by the wrapper."""
        for vpp, chunk in enumerate(self.chunks):
            for name, module in self._named_modules(chunk):
                if name == COMPILED_WRAPPED or name.endswith("." + COMPILED_WRAPPED):
                    continue
                yield vpp, self.prefix(vpp) + (_plain_name(name) or ROOT_NAME), module

    def compiled(self) -> set[int]:
        """``id()`` of the modules whose forward hooks would run inside a graph that
        ``torch.compile`` traces: what an ``OptimizedModule``'s wrapped module calls (the wrapped
        module's own hooks run outside, before dynamo takes its ``forward``), and a module
        compiled in place (``module.compile()``) with everything it calls."""
        inside: set[int] = set()
        for chunk in self.chunks:
            if not isinstance(chunk, nn.Module):
                continue
            for _, module in chunk.named_modules():
                if id(module) in inside:
                    continue
                if getattr(module, "_compiled_call_impl", None) is not None:
                    inside.update(id(m) for m in module.modules())
                elif _is_compiled_wrapper(module):
                    wrapped = getattr(module, COMPILED_WRAPPED)
                    inside.update(id(m) for m in wrapped.modules() if m is not wrapped)
        return inside

    def parameters(self) -> list[NamedParam]:
        """Every parameter once, in model order (a shared parameter keeps its first name)."""
        seen: set[int] = set()
        out: list[NamedParam] = []
        for vpp, chunk in enumerate(self.chunks):
            for name, p in self._named_parameters(chunk):
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(NamedParam(vpp, self.prefix(vpp) + _plain_name(name), p))
        return out

    def optimizer_parameters(self, optimizer: OptimizerView | torch.optim.Optimizer) -> list[NamedParam]:
        """The optimizer's parameters, in model order; ones the model does not hold are named
        ``param_group<g>.<i>`` and come last."""
        found = optimizer.param_groups if isinstance(optimizer, torch.optim.Optimizer) else optimizer.groups()
        groups = [list(group["params"]) for group in found]
        in_optimizer = {id(p) for group in groups for p in group}
        named = [np for np in self.parameters() if id(np.param) in in_optimizer]
        known = {id(np.param) for np in named}
        for g, group in enumerate(groups):
            for i, p in enumerate(group):
                if id(p) not in known:
                    known.add(id(p))
                    named.append(NamedParam(0, f"param_group{g}.{i}", p))
        return named
