"""The ``shape`` and ``dtype`` columns of Monitor V1's CSV rows.

Every statistics table ends with ``shape,dtype``: the shape and dtype of the tensor a row
summarises, written like the reference (``"[6, 16]"``, ``torch.float32``; a 0-dim value is
``[]``). They are metadata, read without touching the tensor's data (no device sync). A DTensor
(tensor parallelism, FSDP2) is described by its local piece, the tensor its statistics are
computed from (``[4, 8]`` for rank 0's half of a ``[8, 8]`` weight); so is a Megatron-style
shard (its shape is already the local one).

Sources: activations are noted by :class:`~trainprobe.frontdoors.monitor_v1.naming.V1Naming` when it picks
their tensors (a gradient has its tensor's shape and dtype: autograd checks both) and bound to the
row of that call by :class:`ShapedModuleProbe`, so a row states the shape of the call it
summarises, also when a module's batch changes from step to step or from micro-batch to
micro-batch (an MoE expert receiving 1 token, then 2); a row key's first shape is its usual
cells (:meth:`ShapeBook.__call__`), and the steps where a call had another come to the sinks
through :meth:`ShapeBook.changed`. Parameter rows (gradients, moments, parameters,
update/ratio) describe the parameter (the gradient that is read, ``main_grad`` included, when it
exists), except ``grad_unreduced`` rows of an FSDP2 (``fully_shard``) parameter: they summarise
the gradient of the unsharded parameter FSDP gathers for forward and backward (before the
reduce-scatter), so they have its shape, the whole parameter's under 1-D FSDP2 (``[7, 6]`` where
the ``grad_reduced`` row of rank 0's shard says ``[4, 6]``) and the tensor-parallel piece's
under 2-D FSDP2 + TP; ``mg_direction`` is one float64 number (``[]``). Rows with nothing known (collectives,
l2 features) get empty cells.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from trainprobe.backends.torch.placement import fsdp_mesh_dims, is_dtensor, unsharded_piece
from trainprobe.engine.probes.model_view import NamedParam
from trainprobe.engine.probes.module import ModuleProbe
from trainprobe.engine.records import RowKey

GRAD_SCOPES = frozenset({"unreduced", "reduced"})
SCALAR = ("[]", str(torch.float64))
"""``mg_direction``: one number, computed in float64."""
UNKNOWN = ("", "")


def describe(tensor: Any) -> tuple[str, str]:
    """``("[6, 16]", "torch.float32")``: the shape (as a list) and dtype of ``tensor``, of its
    local piece for a DTensor (the texts made once per shape and dtype: this runs per call)."""
    local = tensor if type(tensor) in _PLAIN or not is_dtensor(tensor) else tensor.to_local()
    shape, dtype = local.shape, local.dtype
    found = _TEXTS.get((shape, dtype))
    if found is None:
        if len(_TEXTS) > _MAX_TEXTS:
            _TEXTS.clear()
        found = _TEXTS[(shape, dtype)] = (str(list(shape)), str(dtype))
    return found


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_TEXTS: dict[tuple[Any, Any], tuple[str, str]] = {}
"""``shape,dtype`` texts by (shape, dtype)."""
_MAX_TEXTS = 1 << 14


_KEEP_STEPS = 1024
"""Steps of per-call shapes kept for a writer that lags (its queue holds far fewer)."""


class ShapeBook:
    """Shape and dtype of the rows of one run. Everything is read from tensors on the training
    thread (:meth:`note`, :meth:`bind`, :meth:`add_params`); the writer thread only looks the
    texts up (:meth:`__call__`, :meth:`changed`).

    Args:
        grad_of: the gradient V1 reads for a parameter (``main_grad`` or ``.grad``), or None.
        per_call: keep the steps where a row's call had another shape than the row's first
            (false where no file is written: nothing would ask, so nothing is kept).
    """

    def __init__(
        self, grad_of: Callable[[torch.Tensor], torch.Tensor | None] | None = None, *, per_call: bool = True
    ) -> None:
        self.grad_of = grad_of
        self.per_call = per_call
        self._known: dict[tuple[str, str], tuple[str, str]] = {}
        self._noted: dict[tuple[str, str], tuple[str, str]] = {}
        self._first: dict[RowKey, tuple[str, str]] = {}
        self._at: dict[int, dict[RowKey, tuple[str, str]]] = {}
        self._lock = threading.Lock()
        self._params: dict[str, tuple[str, str]] = {}
        self._grads: dict[str, tuple[str, str]] = {}
        self._unreduced: dict[str, tuple[str, str]] = {}

    def note(self, scope: str, name: str, tensor: torch.Tensor) -> None:
        """The tensor of the call being recorded as row ``name`` of ``scope``; :meth:`bind` gives
        it to that call's row key."""
        cells = self._noted[(scope, name)] = describe(tensor)
        self._known.setdefault((scope, name), cells)

    def bind(self, key: RowKey, step: int) -> None:
        """Row ``key`` of ``step`` summarises the tensor last noted for its scope and name."""
        cells = self._noted.get((key.scope, key.name))
        if cells is None:
            return
        first = self._first.setdefault(key, cells)
        if not self.per_call or (cells == first and step not in self._at):
            return  # the common case: the row's usual cells, nothing to undo
        with self._lock:
            if cells != first:
                if step not in self._at:
                    self._forget(step - _KEEP_STEPS)
                self._at.setdefault(step, {})[key] = cells
            elif step in self._at:
                self._at[step].pop(key, None)  # a later call of the same row had its first shape

    def changed(self, step: int) -> Mapping[RowKey, tuple[str, ...]]:
        """The rows of ``step`` whose call had another shape than their first (writer thread,
        steps in order: earlier steps are forgotten)."""
        with self._lock:
            self._forget(step)
            return dict(self._at.get(step, {}))

    def _forget(self, before: int) -> None:
        for old in [s for s in self._at if s < before]:
            del self._at[old]

    def add_params(self, params: Iterable[NamedParam], chunks: Sequence[Any] = ()) -> None:
        """Parameters whose rows (by their written name) describe them. A gradient row describes
        the parameter's ``main_grad`` where ``grad_of`` finds one now (``.grad`` always has the
        parameter's shape and dtype); an unreduced gradient row of an FSDP2 parameter of
        ``chunks`` (the model's modules) describes the unsharded parameter."""
        gathered = fsdp_mesh_dims(chunks) if chunks else {}
        for named in params:
            if named.name in self._params:
                continue
            self._params[named.name] = own = describe(named.param)
            grad = self.grad_of(named.param) if self.grad_of is not None else None
            self._grads[named.name] = describe(grad) if isinstance(grad, torch.Tensor) else own
            dims = gathered.get(id(named.param))
            if dims is not None:
                shape = unsharded_piece(named.param, dims)[1]
                self._unreduced[named.name] = (str(shape), own[1])

    def __call__(self, key: RowKey) -> tuple[str, str]:
        """The ``shape,dtype`` cells of ``key`` (its first call's for an activation; empty when
        unknown)."""
        found = self._first.get(key) or self._known.get((key.scope, key.name))
        if found is not None:
            return found
        if key.scope == "mg_direction":
            return SCALAR
        if key.scope == "unreduced" and key.name in self._unreduced:
            return self._unreduced[key.name]
        table = self._grads if key.scope in GRAD_SCOPES else self._params
        return table.get(key.name, UNKNOWN)


class ShapedModuleProbe(ModuleProbe):
    """Monitor V1's module probe: each activation row key it makes is bound, in :attr:`shapes`,
    to the tensor :class:`~trainprobe.frontdoors.monitor_v1.naming.V1Naming` noted for that call."""

    def __init__(self, *args: Any, shapes: ShapeBook, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shapes = shapes

    def _key(self, *args: Any, **kwargs: Any) -> RowKey:
        """The probe's row key of the call being recorded (made right after the naming picked and
        noted the call's tensors), bound to them for this step."""
        key = super()._key(*args, **kwargs)
        self.shapes.bind(key, self.clock.step)
        return key
