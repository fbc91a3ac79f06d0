"""Finding the tensors inside module arguments and outputs."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

_MAX_DEPTH = 4


def tensors_in(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors in ``value`` in order: a tensor itself, then tuple/list elements and mapping
    values (e.g. Hugging Face ``ModelOutput``), recursively; anything else is skipped."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < _MAX_DEPTH and isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item, depth + 1)
    elif depth < _MAX_DEPTH and isinstance(value, Mapping):
        for item in value.values():
            yield from tensors_in(item, depth + 1)


def call_tensors(args: tuple[Any, ...], kwargs: Mapping[str, Any] | None) -> list[torch.Tensor]:
    """Tensors of a call: positional arguments first, then keyword arguments in order."""
    found = list(tensors_in(args))
    if kwargs:
        found.extend(tensors_in(kwargs))
    return found
