"""Task ``overflow_check``: which records are kept, and the ``.pt`` files of the kept ones.

A forward record is kept when one of its outputs holds inf or NaN while none of its inputs did; a
backward record when one of its ``output`` gradients (those of the forward inputs) holds inf/NaN
while none of its ``input`` gradients (those of the forward outputs) did; a ``parameters_grad``
record when one of its gradients holds inf/NaN. At most ``overflow_nums`` records are kept over
the whole run (-1: no limit); after that nothing more is recorded.

Every tensor of a kept record is saved in ``dump_tensor_data/`` as in task ``tensor`` (its entry
names it in ``data_name``). Whether a record overflows is known only once its outputs exist, so its
tensors are held by reference until then (:class:`DeferredFiles`) and written or dropped at that
moment: inputs and outputs of a forward call at its end; the gradients of a backward record as
they arrive (those that arrived before the record was known to overflow are held until all its
gradients have arrived, at most until the step ends). Inputs that the call itself may change in
place (in-place APIs such as ``Tensor.add_``, ``out=``, ``inplace=True``, modules with
``inplace=True``) are copied before the call; any other input found changed in place when its
file is due is not saved (its entry then has no ``data_name``; the reason goes to
``dump_error_info.log``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from trainprobe.dump.entries import has_overflow
from trainprobe.dump.store import snapshot, version_of

if TYPE_CHECKING:
    from trainprobe.dump.store import StepStore

_INPLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                              "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
                              "__imatmul__"})  # fmt: skip


def writes_inputs(api_name: str, kwargs: dict[str, Any], module: torch.nn.Module | None = None) -> bool:
    """Whether a call may change its inputs in place: ``api_name`` (``Tensor.add_``, or a record
    name such as ``Tensor.add_.0.forward``) ends with a
    single ``_`` or is an in-place operator, ``out=`` or ``inplace=True`` is passed, or
    ``module`` has ``inplace = True``."""
    parts = [p for p in api_name.split(".") if not p.isdigit() and p not in ("forward", "backward")]
    api = parts[-1] if parts else ""
    if api in _INPLACE_DUNDERS or (api.endswith("_") and not api.endswith("__")):
        return True
    if kwargs.get("out") is not None or kwargs.get("inplace") is True:
        return True
    return module is not None and getattr(module, "inplace", False) is True


class DeferredFiles:
    """The tensors of one record, held until the record is known to be kept (then written, and
    every later one written at once) or dropped.

    Used as :attr:`EntryOptions.save`. ``copy``: copy tensors given from now on (inputs of a call
    that may change them in place).
    """

    __slots__ = ("copy", "items", "store")

    def __init__(self, copy: bool = False) -> None:
        self.copy = copy
        self.items: list[tuple[dict[str, Any], str, torch.Tensor, int | None]] = []
        self.store: StepStore | None = None

    def __call__(self, file_name: str, tensor: torch.Tensor, entry: dict[str, Any]) -> None:
        if self.store is not None:
            self.store.save_tensor(file_name, tensor)
            return
        t = snapshot(tensor) if self.copy else tensor.detach()
        self.items.append((entry, file_name, t, None if self.copy else version_of(tensor)))

    @property
    def kept(self) -> bool:
        """Whether the record was kept (its files are written)."""
        return self.store is not None

    def keep(self, store: StepStore) -> None:
        """Write every held tensor to ``store`` now, and later ones as they come."""
        self.store = store
        items, self.items = self.items, []
        for entry, file_name, tensor, version in items:
            if version is not None and version_of(tensor) != version:
                entry.pop("data_name", None)
                store.log_error(f"overflow_check: {file_name} not saved: the tensor was changed in place since")
                continue
            store.save_tensor(file_name, tensor)

    def drop(self) -> None:
        """Forget the held tensors."""
        self.items.clear()


def forward_overflows(record: dict[str, Any]) -> bool:
    """A forward record's verdict: outputs overflow, inputs do not."""
    return has_overflow(record.get("output")) and not has_overflow(
        [record.get("input_args"), record.get("input_kwargs")]
    )


def backward_overflows(name: str, record: Any) -> bool:
    """A backward or ``parameters_grad`` record's verdict (see the module docstring)."""
    if ".parameters_grad." in name:
        return has_overflow(record)
    return has_overflow(record["output"]) and not has_overflow(record["input"])


def data_names(entry: Any) -> list[str]:
    """Every ``data_name`` in ``entry`` (nested)."""
    if isinstance(entry, dict):
        out = [entry["data_name"]] if isinstance(entry.get("data_name"), str) else []
        for v in entry.values():
            if isinstance(v, (dict, list)):
                out.extend(data_names(v))
        return out
    if isinstance(entry, list):
        return [n for v in entry for n in data_names(v)]
    return []
