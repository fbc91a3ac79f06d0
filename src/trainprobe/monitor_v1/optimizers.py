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
