"""The ``shape`` and ``dtype`` columns of Monitor V1's CSV rows.

Every statistics table ends with ``shape,dtype``: the shape and dtype of the tensor a row
summarises, written like the reference (``"[6, 16]"``, ``torch.float32``; a 0-dim value is
``[]``). They are metadata, read without touching the tensor's data (no device sync), and each row
key is described once, when its first line is written (see
:class:`~trainprobe.engine.sinks.csv_sink.TableLayout`), so an activation whose shape changes between
steps keeps the shape of its first collected call.

Sources: activations are noted by :class:`~trainprobe.frontdoors.monitor_v1.naming.V1Naming` when it picks
their tensors (a gradient has its tensor's shape and dtype: autograd checks both); parameter rows
(gradients, moments, parameters, update/ratio) describe the parameter (the gradient that is read,
``main_grad`` included, when it exists); ``mg_direction`` is one float64 number (``[]``). Rows
with nothing known (collectives, l2 features) get empty cells.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from trainprobe.engine.probes.model_view import NamedParam
from trainprobe.engine.records import RowKey

GRAD_SCOPES = frozenset({"unreduced", "reduced"})
SCALAR = ("[]", str(torch.float64))
"""``mg_direction``: one number, computed in float64."""
UNKNOWN = ("", "")


def describe(tensor: torch.Tensor) -> tuple[str, str]:
    """``("[6, 16]", "torch.float32")``: the shape (as a list) and dtype of ``tensor``."""
    return str(list(tensor.shape)), str(tensor.dtype)


class ShapeBook:
    """Shape and dtype of the rows of one run, by ``(scope, name)``. Everything is read from
    tensors on the training thread (:meth:`note`, :meth:`add_params`); the writer thread only
    looks the texts up.

    Args:
        grad_of: the gradient V1 reads for a parameter (``main_grad`` or ``.grad``), or None.
    """

    def __init__(self, grad_of: Callable[[torch.Tensor], torch.Tensor | None] | None = None) -> None:
        self.grad_of = grad_of
        self._known: dict[tuple[str, str], tuple[str, str]] = {}
        self._params: dict[str, tuple[str, str]] = {}
        self._grads: dict[str, tuple[str, str]] = {}

    def note(self, scope: str, name: str, tensor: torch.Tensor) -> None:
        """Remember the shape and dtype of row ``name`` of ``scope`` (the first noted wins)."""
        if (scope, name) not in self._known:
            self._known[(scope, name)] = describe(tensor)

    def add_params(self, params: Iterable[NamedParam]) -> None:
        """Parameters whose rows (by their written name) describe them. A gradient row describes
        the parameter's ``main_grad`` where ``grad_of`` finds one now (``.grad`` always has the
        parameter's shape and dtype)."""
        for named in params:
            if named.name in self._params:
                continue
            self._params[named.name] = own = describe(named.param)
            grad = self.grad_of(named.param) if self.grad_of is not None else None
            self._grads[named.name] = describe(grad) if isinstance(grad, torch.Tensor) else own

    def __call__(self, key: RowKey) -> tuple[str, str]:
        """The ``shape,dtype`` cells of ``key`` (empty when unknown)."""
        found = self._known.get((key.scope, key.name))
        if found is not None:
            return found
        if key.scope == "mg_direction":
            return SCALAR
        table = self._grads if key.scope in GRAD_SCOPES else self._params
        return table.get(key.name, UNKNOWN)
