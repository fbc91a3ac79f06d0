"""Finding the tensors inside call arguments and outputs (module probes, Monitor V1, the dump).

``tensor_type`` is always the framework's tensor class (a backend's ``tensor_type``): the walk
itself knows no framework. Containers looked into: tuples, lists and mappings (values in order,
e.g. a Hugging Face ``ModelOutput``); anything else is skipped.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

_MAX_DEPTH = 4
"""How deep the monitors look into nested arguments (the dump looks all the way)."""

TensorType = type | tuple[type, ...]

_LEAVES = (int, float, bool, str, bytes, type(None))
"""Values that are never containers: skipped without the slower ``Mapping`` check (the dump
walks every argument of every API call)."""


def tensors_in(value: Any, depth: int, tensor_type: TensorType) -> Iterator[Any]:
    """Tensors in ``value`` in order: a tensor itself, then container elements recursively,
    down to nesting level ``_MAX_DEPTH`` counted from ``depth``."""
    if isinstance(value, tensor_type):
        yield value
    elif depth < _MAX_DEPTH and isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item, depth + 1, tensor_type)
    elif depth < _MAX_DEPTH and isinstance(value, Mapping):
        for item in value.values():
            yield from tensors_in(item, depth + 1, tensor_type)


def call_tensors(args: tuple[Any, ...], kwargs: Mapping[str, Any] | None, tensor_type: TensorType) -> list[Any]:
    """Tensors of a call: positional arguments first, then keyword arguments in order."""
    found = list(tensors_in(args, 0, tensor_type))
    if kwargs:
        found.extend(tensors_in(kwargs, 0, tensor_type))
    return found


def named_tensors_in(value: Any, tensor_type: TensorType, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(path, tensor)`` for every tensor nested in ``value`` at any depth; a path joins the
    indices and keys on the way with dots (``"0.1"``, ``"logits"``, ``"1.key.0"``), ``prefix``
    first (the value itself is ``prefix``)."""
    if isinstance(value, tensor_type):
        yield prefix, value
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from named_tensors_in(item, tensor_type, f"{prefix}.{i}" if prefix else str(i))
    elif isinstance(value, dict) or (not isinstance(value, _LEAVES) and isinstance(value, Mapping)):
        for key, item in value.items():
            yield from named_tensors_in(item, tensor_type, f"{prefix}.{key}" if prefix else str(key))
