"""Names of the modules and parameters of a model or a list of model chunks.

A single model is ``vpp_stage`` 0 and its names are the framework's own (PyTorch's
``named_modules()`` / ``named_parameters()``, MindSpore's ``cells_and_names()`` /
``parameters_and_names()``). For a list of chunks (virtual pipeline stages), chunk ``i`` has
``vpp_stage`` i and its names carry the prefix ``"i:"`` (``"1:layers.0.mlp"``). The root module
itself keeps its framework name, the empty string (``""``; ``"0:"`` in a chunk list), as the
reference names it: its Monitor V2 rows are ``.input.0`` (``0:.input.0``).

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
class NamedParam:
    """A parameter with its output name and chunk index."""

    vpp_stage: int
    name: str
    param: Any  # the framework's parameter (torch.nn.Parameter, mindspore.Parameter)


class ModelView:
    """Read-only naming view over ``model`` (a module, a list of modules, or None).

    The framework shows through three methods only (``_is_model``, ``_named_modules``,
    ``_named_parameters``), ``model_kind`` and, where the framework compiles graphs,
    :meth:`compiled`; each backend's view subclasses this one and overrides them.
    """

    model_kind = "module"

    def __init__(self, model: Any, where: str = "start(model=...)", *, stage_prefix: bool | None = None) -> None:
        """``stage_prefix``: whether names carry the ``<vpp_stage>:`` prefix (None: only when
        ``model`` is a list of chunks; Monitor V1 always wants it).

        Raises ConfigError (naming ``where``, the argument) when ``model`` is neither a module of
        the framework nor a list of them."""
        if model is None:
            self.chunks: list[Any] = []  # the framework's modules
            is_list = False
        elif self._is_model(model):
            self.chunks, is_list = [model], False
        elif isinstance(model, (list, tuple)) and all(self._is_model(m) for m in model):
            self.chunks, is_list = list(model), True
        else:
            raise ConfigError(f"{where}: expected a {self.model_kind} or a list of them, got {type(model).__name__}")
        self.stage_prefix = is_list if stage_prefix is None else stage_prefix

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

    def compiled(self) -> set[int]:
        """``id()`` of the modules whose hooks would run inside a compiled graph (none here)."""
        return set()

    # -- names ---------------------------------------------------------------------------
    def prefix(self, vpp_stage: int) -> str:
        """Name prefix of chunk ``vpp_stage`` (empty for a single model)."""
        return f"{vpp_stage}{NAME_SEP}" if self.stage_prefix else ""

    def modules(self) -> Iterator[tuple[int, str, Any]]:
        """``(vpp_stage, name, module)`` for every module, each chunk in order, root first."""
        for vpp, chunk in enumerate(self.chunks):
            for name, module in self._named_modules(chunk):
                yield vpp, self.prefix(vpp) + (name or ROOT_NAME), module

    def parameters(self) -> list[NamedParam]:
        """Every parameter once, in model order (a shared parameter keeps its first name)."""
        seen: set[int] = set()
        out: list[NamedParam] = []
        for vpp, chunk in enumerate(self.chunks):
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
