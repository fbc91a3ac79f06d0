"""Names of the modules and parameters of a model or a list of model chunks.

A single model is ``vpp_stage`` 0 and its names are the framework's own (PyTorch's
``named_modules()`` / ``named_parameters()``, MindSpore's ``cells_and_names()`` /
``parameters_and_names()``). For a list of chunks (virtual pipeline stages), chunk ``i`` has
``vpp_stage`` i and its names carry the prefix ``"i:"`` (``"1:layers.0.mlp"``). The root module
itself keeps its framework name, the empty string (``""``; ``"0:"`` in a chunk list), as the
reference names it: its Monitor V2 rows are ``.input.0`` (``0:.input.0``).

Pipeline stages (PyTorch's ``torch.distributed.pipelining.PipelineStage``, one or a list of them,
passed where a model goes) are named by their **global stage index**, not by their place in the
list: on rank 1 of a two-rank interleaved pipeline of four stages, the stages 1 and 3 are
``vpp_stage`` 1 and 3, their names ``"1:..."`` and ``"3:..."`` (also for a single stage: a
``GPipe`` stage 1 is ``"1:..."``), so that every stage of the pipeline has one name on every
rank. The view's chunks are the stages' modules (``stage.submod``).

A view also says how the framework runs a chunk now (:meth:`ModelView.chunk_call`: under a
pipeline schedule, or in its metadata-inference pass), whether a forward is a recomputation
(:meth:`ModelView.recomputing`: activation checkpointing) and whether a tensor is a partial sum
(:meth:`ModelView.is_partial`); the defaults here say "a plain forward", "no", "no".

:class:`ModelView` is framework-neutral; each backend subclasses it
(:class:`trainprobe.backends.torch.model_view.TorchModelView`,
:class:`trainprobe.backends.mindspore.model_view.CellView`) with three methods and a kind.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.optimizer_view import OptimizerView

NAME_SEP = ":"
ROOT_NAME = ""
"""The root module's name: empty, as PyTorch's ``named_modules()`` and the reference give it."""


@dataclass(frozen=True, slots=True)
class ChunkCall:
    """How the framework runs a model chunk's forward pass that starts now.

    ``record`` is False for a pass that is no training forward (a pipeline's metadata-inference
    forward on placeholder inputs); ``micro_batch`` is the pipeline schedule's micro-batch index
    (None outside a schedule); ``stage`` is the global index of the pipeline stage running the
    chunk (None outside a schedule)."""

    record: bool = True
    micro_batch: int | None = None
    stage: int | None = None


PLAIN_CALL = ChunkCall()
"""A forward outside any pipeline schedule."""


@dataclass(frozen=True, slots=True)
class NamedParam:
    """A parameter with its output name and its chunk's ``vpp_stage`` (the chunk's list index, or
    its global pipeline stage index)."""

    vpp_stage: int
    name: str
    param: Any  # the framework's parameter (torch.nn.Parameter, mindspore.Parameter)


class ModelView:
    """Read-only naming view over ``model`` (a module, a list of modules, or None).

    The framework shows through three methods (``_is_model``, ``_named_modules``,
    ``_named_parameters``), ``model_kind`` and, where the framework has them, pipeline stages
    (``_pipeline_stage``), compiled graphs (:meth:`compiled`) and the run-time questions of
    :meth:`chunk_call`, :meth:`recomputing` and :meth:`is_partial`; each backend's view subclasses
    this one and overrides them.
    """

    model_kind = "module"

    def __init__(self, model: Any, where: str = "start(model=...)", *, stage_prefix: bool | None = None) -> None:
        """``stage_prefix``: whether names carry the ``<vpp_stage>:`` prefix (None: only when
        ``model`` is a list of chunks; Monitor V1 always wants it; pipeline stages always have it).

        Raises ConfigError (naming ``where``, the argument) when ``model`` is neither a module of
        the framework nor a list of them, nor a pipeline stage or a list of them (a list mixing
        stages and modules, or naming one stage twice, is refused too)."""
        is_list = isinstance(model, (list, tuple))
        items = list(model) if is_list else [] if model is None else [model]
        staged = self._stages_of(items, where)
        self.pipelined = staged is not None
        """Whether the chunks are pipeline stages (named by their global stage index)."""
        if staged is not None:
            self.chunks: list[Any] = [chunk for chunk, _ in staged]  # the framework's modules
            self.stages = [index for _, index in staged]  # each chunk's vpp_stage
        elif all(map(self._is_model, items)):
            self.chunks, self.stages = items, list(range(len(items)))
        else:
            raise ConfigError(f"{where}: expected a {self.model_kind} or a list of them, got {type(model).__name__}")
        self.stage_prefix = True if self.pipelined else is_list if stage_prefix is None else stage_prefix

    def _stages_of(self, items: list[Any], where: str) -> list[tuple[Any, int]] | None:
        """``(module, global stage index)`` of each of ``items`` when they are all pipeline stages;
        None when none is. Raises ConfigError for a mix, or a stage named twice."""
        staged = [self._pipeline_stage(item) for item in items]
        found = [s for s in staged if s is not None]
        if not found:
            return None
        if len(found) != len(staged):
            raise ConfigError(f"{where}: a list of pipeline stages or of {self.model_kind}s, not a mix of both")
        indices = [index for _, index in found]
        if len(set(indices)) != len(indices):
            raise ConfigError(f"{where}: pipeline stages {indices} name one stage more than once")
        return found

    # -- the framework ---------------------------------------------------------------------
    def _is_model(self, obj: object) -> bool:
        """Whether ``obj`` is a module of the framework."""
        raise NotImplementedError

    def _named_modules(self, chunk: Any) -> Iterator[tuple[str, Any]]:
        """``(name, module)`` of every module of ``chunk`` to list, the chunk itself first as ``""``."""
        raise NotImplementedError

    def _named_parameters(self, chunk: Any) -> Iterator[tuple[str, Any]]:
        """``(name, parameter)`` of every parameter of ``chunk``."""
        raise NotImplementedError

    def _pipeline_stage(self, obj: object) -> tuple[Any, int] | None:
        """``(module, global stage index)`` when ``obj`` is a pipeline stage of the framework
        (none here)."""
        return None

    def compiled(self) -> set[int]:
        """``id()`` of the modules whose hooks would run inside a compiled graph (none here)."""
        return set()

    # -- how the framework runs the chunks (called from hooks: cheap) ------------------------
    def chunk_call(self) -> ChunkCall:
        """How the chunk forward that starts now runs (called from the chunk's forward
        pre-hook): :data:`PLAIN_CALL` here."""
        return PLAIN_CALL

    def recomputing(self) -> bool:
        """Whether the forward running now recomputes activations during a backward pass
        (activation checkpointing); never here."""
        return False

    def is_partial(self, t: Any) -> bool:
        """Whether ``t`` holds a partial sum (a summand of the tensor, not a piece of it); never
        here."""
        return False

    # -- names ---------------------------------------------------------------------------
    def prefix(self, vpp_stage: int) -> str:
        """Name prefix of the chunk whose ``vpp_stage`` is ``vpp_stage`` (empty for a single model)."""
        return f"{vpp_stage}{NAME_SEP}" if self.stage_prefix else ""

    def staged_chunks(self) -> list[tuple[int, Any]]:
        """``(vpp_stage, chunk)`` of every chunk, in order."""
        return list(zip(self.stages, self.chunks))

    def modules(self) -> Iterator[tuple[int, str, Any]]:
        """``(vpp_stage, name, module)`` for every module, each chunk in order, root first."""
        for vpp, chunk in self.staged_chunks():
            for name, module in self._named_modules(chunk):
                yield vpp, self.prefix(vpp) + (name or ROOT_NAME), module

    def parameters(self) -> list[NamedParam]:
        """Every parameter once, in model order (a shared parameter keeps its first name)."""
        seen: set[int] = set()
        out: list[NamedParam] = []
        for vpp, chunk in self.staged_chunks():
            for name, p in self._named_parameters(chunk):
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(NamedParam(vpp, self.prefix(vpp) + name, p))
        return out

    def optimizer_parameters(self, optimizer: OptimizerView) -> list[NamedParam]:
        """The optimizer's parameters, in model order; ones the model does not hold are named
        ``param_group<g>.<i>`` and come last."""
        groups = [list(group["params"]) for group in optimizer.groups()]
        in_optimizer = {id(p) for group in groups for p in group}
        named = [np for np in self.parameters() if id(np.param) in in_optimizer]
        known = {id(np.param) for np in named}
        for g, group in enumerate(groups):
            for i, p in enumerate(group):
                if id(p) not in known:
                    known.add(id(p))
                    named.append(NamedParam(0, f"param_group{g}.{i}", p))
        return named
