"""Names of the modules and parameters of a PyTorch model (``nn.Module`` or a list of chunks).

The names are ``named_modules()`` / ``named_parameters()`` names (see
:class:`~trainprobe.engine.probes.model_view.ModelView` for chunks and ``root``).

``torch.compile``: the ``_orig_mod`` component an ``OptimizedModule`` (``torch.compile(module)``)
adds to the names of what it wraps is left out, so a compiled model has the names of the model
it compiles (``fc1.weight``, not ``_orig_mod.fc1.weight``). The wrapped module itself is not
listed: the ``OptimizedModule`` stands for it under the same name. :meth:`TorchModelView.compiled`
lists the modules whose hooks run inside a compiled graph.

Pipelining (``torch.distributed.pipelining``): a ``PipelineStage`` (or a list of them) passed as
the model is named by its global ``stage_index`` (:class:`~trainprobe.engine.probes.model_view.ModelView`);
its chunk is ``stage.submod``. :meth:`TorchModelView.chunk_call` tells a schedule's forward of a
micro-batch (``forward_one_chunk``: its ``fwd_chunk_id`` and the stage) from the stage's metadata
inference (``_forward_metadata_inference`` on torch 2.13, ``_shape_inference`` before), which runs
the chunk once on placeholder inputs (``torch.empty``) at the first step and is not recorded. It
reads the calling frames (at most :data:`_SCHEDULE_DEPTH`), once per chunk forward, and only
while ``torch.distributed.pipelining`` is loaded.

Activation checkpointing (``torch.utils.checkpoint``, reentrant or not) recomputes the forward of
the checkpointed region during the backward pass: :meth:`TorchModelView.recomputing` is true
while autograd runs a backward graph task (``torch._C._current_graph_task_id() != -1``), which a
training forward never does. Checked on torch 2.13 (both modes); torch 2.1's checkpoint uses the
same function for its own bookkeeping. A torch without it recomputes with rows (never fails).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from types import CodeType, FrameType
from typing import Any

import torch
from torch import nn

from trainprobe.backends.torch.placement import is_partial
from trainprobe.engine.probes.model_view import PLAIN_CALL, ChunkCall, ModelView

COMPILED_WRAPPED = "_orig_mod"
"""Attribute of ``torch.compile``'s ``OptimizedModule`` holding the module it compiles."""


def plain_name(name: str) -> str:
    """``name`` without the ``_orig_mod`` components ``torch.compile`` wrappers add."""
    if COMPILED_WRAPPED not in name:
        return name
    return ".".join(part for part in name.split(".") if part != COMPILED_WRAPPED)


_PIPELINING = "torch.distributed.pipelining.stage"
"""The module of ``PipelineStage``: looked up in ``sys.modules``, never imported here."""

_METADATA_PASSES = ("_forward_metadata_inference", "_backward_metadata_inference", "_shape_inference")
"""``PipelineStage`` methods that run the chunk on placeholder inputs (torch 2.13; before 2.7)."""

_SCHEDULE_DEPTH = 32
"""How many calling frames :meth:`TorchModelView.chunk_call` reads, at most: the hook's own,
``nn.Module``'s call and the schedule's (a chunk wrapped by DDP or FSDP adds a few)."""

METADATA_CALL = ChunkCall(record=False)
"""A pipeline stage's metadata-inference forward."""

_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)


def _stage_codes() -> tuple[dict[CodeType, bool], type] | None:
    """The code of ``forward_one_chunk`` (True) and of the metadata passes (False) of
    ``PipelineStage``, and its base class; None while pipelining is not loaded."""
    module = sys.modules.get(_PIPELINING)
    base = getattr(module, "_PipelineStageBase", None)
    if base is None:
        return None
    codes: dict[CodeType, bool] = {}
    for cls in (base, *_subclasses(base)):
        for name in (*_METADATA_PASSES, "forward_one_chunk"):
            fn = cls.__dict__.get(name)
            if fn is not None and hasattr(fn, "__code__"):
                codes[fn.__code__] = name == "forward_one_chunk"
    return codes, base


def _subclasses(cls: type) -> list[type]:
    """Every subclass of ``cls``, depth first."""
    out: list[type] = []
    sub: type
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


def _is_compiled_wrapper(module: Any) -> bool:
    """Whether ``module`` is ``torch.compile``'s ``OptimizedModule``."""
    return isinstance(getattr(module, COMPILED_WRAPPED, None), nn.Module) and hasattr(module, "dynamo_ctx")


class TorchModelView(ModelView):
    r""":class:`ModelView` over ``torch.nn.Module``\ s, ``torch.compile`` wrappers seen through."""

    model_kind = "torch.nn.Module"
    _codes: dict[CodeType, bool] | None = None

    def _is_model(self, obj: object) -> bool:
        return isinstance(obj, nn.Module)

    def _pipeline_stage(self, obj: object) -> tuple[Any, int] | None:
        found = _stage_codes()
        if found is None or not isinstance(obj, found[1]):
            return None
        submod = getattr(obj, "submod", None)
        return (submod, int(getattr(obj, "stage_index", 0))) if isinstance(submod, nn.Module) else None

    def chunk_call(self) -> ChunkCall:
        """The schedule's micro-batch and stage of the chunk forward starting now, or
        :data:`METADATA_CALL` in a stage's metadata inference (see the module docstring)."""
        if _PIPELINING not in sys.modules:
            return PLAIN_CALL
        codes = self._codes
        if codes is None:
            found = _stage_codes()
            if found is None:
                return PLAIN_CALL
            codes = self._codes = found[0]
        frame: FrameType | None = sys._getframe(1)
        for _ in range(_SCHEDULE_DEPTH):
            if frame is None:
                break
            kind = codes.get(frame.f_code)
            if kind is not None:
                return _scheduled(frame) if kind else METADATA_CALL
            frame = frame.f_back
        return PLAIN_CALL

    def recomputing(self) -> bool:
        return _graph_task_id is not None and _graph_task_id() != -1

    def is_partial(self, t: Any) -> bool:
        return is_partial(t)

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


def _scheduled(frame: FrameType) -> ChunkCall:
    """The call ``forward_one_chunk(fwd_chunk_id, ...)`` of a stage (``self``) running in ``frame``."""
    local = frame.f_locals
    micro, stage = local.get("fwd_chunk_id"), getattr(local.get("self"), "stage_index", None)
    return ChunkCall(True, micro if isinstance(micro, int) else None, stage if isinstance(stage, int) else None)
