"""Names of the cells and parameters of a MindSpore model (``nn.Cell`` or a list of chunks).

The same naming as PyTorch models (:class:`~trainprobe.engine.probes.model_view.ModelView`): cell
names from ``cells_and_names()`` (the root is ``root``), parameter names from
``parameters_and_names()`` (the attribute path, ``fc1.weight``, not ``Parameter.name``, which
MindSpore lets users set freely), ``"i:"`` prefixes for a list of chunks. A model built the same
way in both frameworks therefore gets the same row names.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from mindspore import nn

from trainprobe.engine.probes.model_view import ModelView


class CellView(ModelView):
    """:class:`ModelView` over MindSpore cells."""

    model_kind = "mindspore.nn.Cell"

    def _is_model(self, obj: object) -> bool:
        return isinstance(obj, nn.Cell)

    def _named_modules(self, chunk: Any) -> Iterator[tuple[str, Any]]:
        return chunk.cells_and_names()

    def _named_parameters(self, chunk: Any) -> Iterator[tuple[str, Any]]:
        return chunk.parameters_and_names()
