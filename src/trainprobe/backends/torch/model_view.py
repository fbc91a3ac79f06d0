"""Names of the modules and parameters of a PyTorch model (``nn.Module`` or a list of chunks).

The names are ``named_modules()`` / ``named_parameters()`` names (see
:class:`~trainprobe.engine.probes.model_view.ModelView` for chunks and ``root``).

``torch.compile``: the ``_orig_mod`` component an ``OptimizedModule`` (``torch.compile(module)``)
adds to the names of what it wraps is left out, so a compiled model has the names of the model
it compiles (``fc1.weight``, not ``_orig_mod.fc1.weight``). The wrapped module itself is not
listed: the ``OptimizedModule`` stands for it under the same name. :meth:`TorchModelView.compiled`
lists the modules whose hooks run inside a compiled graph.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import nn

from trainprobe.engine.probes.model_view import ModelView

COMPILED_WRAPPED = "_orig_mod"
"""Attribute of ``torch.compile``'s ``OptimizedModule`` holding the module it compiles."""


def plain_name(name: str) -> str:
    """``name`` without the ``_orig_mod`` components ``torch.compile`` wrappers add."""
    if COMPILED_WRAPPED not in name:
        return name
    return ".".join(part for part in name.split(".") if part != COMPILED_WRAPPED)


def _is_compiled_wrapper(module: Any) -> bool:
    """Whether ``module`` is ``torch.compile``'s ``OptimizedModule``."""
    return isinstance(getattr(module, COMPILED_WRAPPED, None), nn.Module) and hasattr(module, "dynamo_ctx")


class TorchModelView(ModelView):
    r""":class:`ModelView` over ``torch.nn.Module``\ s, ``torch.compile`` wrappers seen through."""

    model_kind = "torch.nn.Module"

    def _is_model(self, obj: object) -> bool:
        return isinstance(obj, nn.Module)

    def _named_modules(self, chunk: Any) -> Iterator[tuple[str, Any]]:
        for name, module in chunk.named_modules():
            if name == COMPILED_WRAPPED or name.endswith("." + COMPILED_WRAPPED):
                continue  # the wrapper stands for it
            yield plain_name(name), module

    def _named_parameters(self, chunk: Any) -> Iterator[tuple[str, Any]]:
        for name, p in chunk.named_parameters():
            yield plain_name(name), p

    def compiled(self) -> set[int]:
        """``id()`` of the modules whose forward hooks would run inside a graph that
        ``torch.compile`` traces: what an ``OptimizedModule``'s wrapped module calls (the wrapped
        module's own hooks run outside, before dynamo takes its ``forward``), and a module
        compiled in place (``module.compile()``) with everything it calls."""
        inside: set[int] = set()
        for chunk in self.chunks:
            for _, module in chunk.named_modules():
                if id(module) in inside:
                    continue
                if getattr(module, "_compiled_call_impl", None) is not None:
                    inside.update(id(m) for m in module.modules())
                elif _is_compiled_wrapper(module):
                    wrapped = getattr(module, COMPILED_WRAPPED)
                    inside.update(id(m) for m in wrapped.modules() if m is not wrapped)
        return inside
