"""The optimizers behind what users pass to ``set_monitor``: torch optimizers, wrappers holding
the real one in ``.optimizer`` (DeepSpeed, accelerate, Megatron), and chains of optimizers
(Megatron's ``ChainedOptimizer``: ``.chained_optimizers``)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from trainprobe.errors import ConfigError
from trainprobe.probes.model_view import unwrap_optimizer


def unwrap_all(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside ``optimizer``, in step order.

    Raises:
        ConfigError: none is found.
    """
    chain = getattr(optimizer, "chained_optimizers", None)
    if isinstance(chain, (list, tuple)) and chain:
        return [o for inner in chain for o in unwrap_all(inner)]
    try:
        return [unwrap_optimizer(optimizer)]
    except ConfigError:
        raise ConfigError(
            f"set_monitor(optimizer=...): expected a torch.optim.Optimizer, a wrapper holding one in "
            f".optimizer, or a chain (.chained_optimizers), got {type(optimizer).__name__}"
        ) from None


class OptimizerGroup:
    """Several torch optimizers seen as one: their ``param_groups`` concatenated and their
    ``state`` merged (what the parameter and moment probes read)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> _MergedState:
        return _MergedState([o.state for o in self.optimizers])


class _MergedState(Mapping):
    """Read-only union of optimizer states that never inserts (``Optimizer.state`` is a
    defaultdict, so a plain lookup would add empty entries)."""

    def __init__(self, states: list[Mapping[Any, Any]]) -> None:
        self._states = states

    def __getitem__(self, key: Any) -> Any:
        for state in self._states:
            if key in state:
                return state[key]
        raise KeyError(key)

    def __iter__(self) -> Iterator[Any]:
        for state in self._states:
            yield from state

    def __len__(self) -> int:
        return sum(len(s) for s in self._states)


_MASTER_LAYOUTS: tuple[tuple[str, str], ...] = (
    ("float16_groups", "fp32_from_float16_groups"),  # Megatron Float16OptimizerWithFloat16Params
    ("model_float16_groups", "shard_fp32_from_float16_groups"),  # Megatron DistributedOptimizer
    ("model_fp32_groups", "shard_fp32_groups"),  # its fp32 parameters' shards
)
"""Attribute pairs by which mixed-precision wrappers hold (model parameters, the optimizer's
copies of them), group by group."""


def master_pairs(optimizer: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(model parameter, the copy the inner optimizer steps)`` for every parameter a
    mixed-precision wrapper (Megatron's ``Float16OptimizerWithFloat16Params`` and
    ``DistributedOptimizer``, chains of them) keeps a float32 master copy or shard of; empty for
    anything else. DeepSpeed ZeRO keeps flat partitions with no per-parameter copy: not mapped."""
    chain = getattr(optimizer, "chained_optimizers", None)
    if isinstance(chain, (list, tuple)) and chain:
        return [pair for inner in chain for pair in master_pairs(inner)]
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for model_attr, master_attr in _MASTER_LAYOUTS:
        models, masters = getattr(optimizer, model_attr, None), getattr(optimizer, master_attr, None)
        if not isinstance(models, (list, tuple)) or not isinstance(masters, (list, tuple)):
            continue
        for model_group, master_group in zip(models, masters):
            pairs += [(m, c) for m, c in zip(model_group, master_group) if m is not c]
    return pairs


class MasterMapped:
    """An optimizer (or :class:`OptimizerGroup`) seen through the model's parameters: its
    ``param_groups`` list the model parameter where the optimizer holds a master copy, and its
    ``state`` is looked up through the copy. Rows are then named after the model's parameters,
    ``targets`` select them, gradients come from them (``main_grad``), and moments and parameter
    values (``param_origin``/``param_updated``) from the copies the optimizer steps (this rank's
    shard under Megatron's distributed optimizer): the wrapper copies them back into the model
    only after the inner optimizer's step, when its post-step hook has already run."""

    def __init__(self, optimizer: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.inner = optimizer
        self._model_of = {id(copy): model for model, copy in pairs}
        self._copy_of = {id(model): copy for model, copy in pairs}

    def copy_of(self, param: torch.Tensor) -> torch.Tensor:
        """The copy the optimizer steps for a model parameter (the parameter itself if none)."""
        return self._copy_of.get(id(param), param)

    @property
    def class_name(self) -> str:
        """The inner optimizer's class name (for messages)."""
        return type(self.inner).__name__

    @property
    def param_groups(self) -> list[Mapping[str, Any]]:
        return [_ModelGroup(group, self._model_of) for group in self.inner.param_groups]

    @property
    def state(self) -> _ThroughCopies:
        return _ThroughCopies(self.inner.state, self._copy_of, self._model_of)


class _ModelGroup(Mapping):
    """A live view of a parameter group whose ``params`` name model parameters."""

    def __init__(self, group: Mapping[str, Any], model_of: dict[int, torch.Tensor]) -> None:
        self._group = group
        self._model_of = model_of

    def __getitem__(self, key: str) -> Any:
        value = self._group[key]
        if key == "params":
            return [self._model_of.get(id(p), p) for p in value]
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._group)

    def __len__(self) -> int:
        return len(self._group)


class _ThroughCopies(Mapping):
    """Optimizer state keyed by model parameters, read from the state of their copies."""

    def __init__(
        self, state: Mapping[Any, Any], copy_of: dict[int, torch.Tensor], model_of: dict[int, torch.Tensor]
    ) -> None:
        self._state = state
        self._copy_of = copy_of
        self._model_of = model_of

    def __getitem__(self, key: Any) -> Any:
        copy = self._copy_of.get(id(key), key)
        if copy not in self._state:  # never insert into a defaultdict
            raise KeyError(key)
        return self._state[copy]

    def __iter__(self) -> Iterator[Any]:
        for key in self._state:
            yield self._model_of.get(id(key), key)

    def __len__(self) -> int:
        return len(self._state)


def model_facing(wrapper: Any, optimizer: Any) -> Any:
    """``optimizer`` (what :func:`unwrap_all` found inside ``wrapper``) as the parameter and
    moment probes should see it: through the model's parameters when ``wrapper`` steps float32
    master copies of them (:func:`master_pairs`), else unchanged."""
    pairs = master_pairs(wrapper)
    return MasterMapped(optimizer, pairs) if pairs else optimizer
