"""Finding the tensors inside module arguments and outputs."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

_MAX_DEPTH = 4

TensorType = type | tuple[type, ...]


def tensors_in(value: Any, depth: int = 0, tensor_type: TensorType = torch.Tensor) -> Iterator[Any]:
    """Tensors in ``value`` in order: a tensor itself, then tuple/list elements and mapping
    values (e.g. Hugging Face ``ModelOutput``), recursively; anything else is skipped.
    ``tensor_type`` is the framework's tensor class (a backend's ``tensor_type``)."""
    if isinstance(value, tensor_type):
        yield value
    elif depth < _MAX_DEPTH and isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item, depth + 1, tensor_type)
    elif depth < _MAX_DEPTH and isinstance(value, Mapping):
        for item in value.values():
            yield from tensors_in(item, depth + 1, tensor_type)


def call_tensors(
    args: tuple[Any, ...], kwargs: Mapping[str, Any] | None, tensor_type: TensorType = torch.Tensor
) -> list[Any]:
    """Tensors of a call: positional arguments first, then keyword arguments in order."""
    found = list(tensors_in(args, 0, tensor_type))
    if kwargs:
        found.extend(tensors_in(kwargs, 0, tensor_type))
    return found
