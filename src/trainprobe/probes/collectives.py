"""``cc`` monitor: statistics of collective communication calls, on any framework whose adapter
describes its collectives (:class:`CollectiveApi`).

Each call of a supported function is one or more rows (scope ``comm``), never merged across
calls. ``module_name`` is ``<op>.<call>.<side>.<i>@<file>[<line>]``: the function name, the
call's index among calls of that function in the step, ``in`` (before the op, with
``cc_pre_hook``) or ``out`` (after it), the tensor's index in that argument, and the call site.
``send``/``isend`` have no output: their tensor is always written as ``in``. Asynchronous calls
(``async_op=True``, ``isend``/``irecv``) are recorded when their work completes.

Two kinds of entry points are wrapped, both restored exactly on :meth:`Probe.detach`:

* functions in the style of ``torch.distributed`` (:data:`FUNCTIONS` gives their argument
  names; PyTorch: ``torch.distributed``, MindSpore: ``mindspore.mint.distributed``), replaced in
  every namespace the adapter lists. Code that imported a function by name before ``start()``
  keeps the original: start the monitor early.
* communication primitive classes (MindSpore's ``ops.AllReduce`` and friends, which
  ``nn.DistributedGradReducer`` calls): their ``__call__`` is wrapped at class level, so
  instances created before ``start()`` are seen too. Inputs are the call's tensors, outputs the
  tensors it returns.

``cc_log_only`` prints each distinct call site once per rank (op, dtypes, shapes, group, stack)
and keeps them in ``rank_<r>/cc_log.json``; it records no statistics and does not interrupt
training.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, ModuleType
from typing import TYPE_CHECKING, Any, Protocol

from trainprobe.config.monitor_v2 import CcConfig
from trainprobe.probes.base import Probe, StepClock
from trainprobe.records import RowKey
from trainprobe.sinks.files import write_json_atomically

if TYPE_CHECKING:
    from trainprobe.adapters import Backend

# op -> (argument names holding its inputs, argument names holding its outputs)
FUNCTIONS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "all_reduce": (("tensor",), ("tensor",)),
    "all_gather": (("tensor",), ("tensor_list",)),
    "all_gather_into_tensor": (("input_tensor",), ("output_tensor",)),
    "_all_gather_base": (("input_tensor",), ("output_tensor",)),
    "all_gather_single": (("input_tensor",), ("output_tensor",)),
    "reduce_scatter": (("input_list",), ("output",)),
    "reduce_scatter_tensor": (("input",), ("output",)),
    "_reduce_scatter_base": (("input",), ("output",)),
    "reduce_scatter_single": (("input",), ("output",)),
    "broadcast": (("tensor",), ("tensor",)),
    "reduce": (("tensor",), ("tensor",)),
    "all_to_all": (("input_tensor_list",), ("output_tensor_list",)),
    "all_to_all_single": (("input",), ("output",)),
    "send": (("tensor",), ()),
    "isend": (("tensor",), ()),
    "recv": ((), ("tensor",)),
    "irecv": ((), ("tensor",)),
    "scatter": (("scatter_list",), ("tensor",)),
    "gather": (("tensor",), ("gather_list",)),
}


class CollectiveApi(Protocol):
    """A framework's collectives, as the ``cc`` probe needs them (one per adapter)."""

    tensor_type: type | tuple[type, ...]

    def namespaces(self) -> tuple[ModuleType, ...]:
        """Modules exposing the :data:`FUNCTIONS`; the first defines them (originals are read there)."""
        ...

    def primitives(self) -> Mapping[type, str]:
        """Communication primitive classes whose instances are called, and the op name of each
        (for rows and logs); empty where the framework has none."""
        ...

    def defer(self, result: Any, record: Callable[[], None]) -> Any:
        """None when a call's outputs are ready now (``record`` is then called by the probe); else
        something :meth:`settle` completes at the end of the step, after which ``record`` has run
        (an asynchronous call: ``result`` is its work handle)."""
        ...

    def settle(self, pending: Any) -> None:
        """Wait for a deferred call and make sure its ``record`` ran (end of the step)."""
        ...

    def describe_group(self, group: Any) -> Any:
        """A JSON-able description of a communication group (``"world"`` for the default)."""
        ...


def _tensors(api: CollectiveApi, bound: Mapping[str, Any], names: tuple[str, ...]) -> list[Any]:
    out: list[Any] = []
    for name in names:
        out.extend(tensors_of(api, bound.get(name)))
    return out


def tensors_of(api: CollectiveApi, value: Any) -> list[Any]:
    """The tensors in ``value``: itself, or those of a list or tuple."""
    if isinstance(value, api.tensor_type):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, api.tensor_type)]
    return []


def call_site(frame: FrameType | None) -> tuple[str, str]:
    """``(full "path[line]", short "file.py[line]")`` of ``frame``."""
    if frame is None:
        return "?[0]", "?[0]"
    path = frame.f_code.co_filename
    return f"{path}[{frame.f_lineno}]", f"{os.path.basename(path)}[{frame.f_lineno}]"


class CollectivePatch:
    """Replaces collective functions and primitive ``__call__`` methods by wrappers and restores
    exactly what was there."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []  # (owner, attribute, original or _ABSENT)

    def install(
        self,
        api: CollectiveApi,
        wrap_function: Callable[[str, Callable[..., Any]], Callable[..., Any]],
        wrap_primitive: Callable[[str, Callable[..., Any]], Callable[..., Any]],
    ) -> None:
        namespaces = api.namespaces()
        for op in FUNCTIONS:
            original = getattr(namespaces[0], op, None)
            if original is None:
                continue
            wrapper = wrap_function(op, original)
            for namespace in namespaces:
                if getattr(namespace, op, None) is original:
                    self._saved.append((namespace, op, original))
                    setattr(namespace, op, wrapper)
        for cls, op in api.primitives().items():
            self._saved.append((cls, "__call__", cls.__dict__.get("__call__", _ABSENT)))
            cls.__call__ = wrap_primitive(op, cls.__call__)

    def remove(self) -> None:
        saved, self._saved = self._saved, []
        for owner, attribute, original in reversed(saved):
            if original is _ABSENT:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, original)


_ABSENT = object()


@dataclass(slots=True)
class _Call:
    op: str
    index: int
    tag_site: str
    outputs: list[Any]


class CollectiveProbe(Probe):
    """Statistics (or a call-site log) of a framework's collectives."""

    name = "cc"

    def __init__(
        self, clock: StepClock, config: CcConfig, rank: int, rank_dir: Path, *, backend: Backend | None = None
    ) -> None:
        super().__init__(clock, config.ops, config.eps, backend=backend)
        api = self.backend.collective_api()
        assert api is not None, "the trainer refuses cc for a backend without collectives"
        self.api: CollectiveApi = api
        self.config = config
        self.rank = rank
        self.log_path = rank_dir / "cc_log.json"
        self._patch = CollectivePatch()
        self._signatures: dict[str, inspect.Signature] = {}
        self._counts: dict[str, int] = {}
        self._pending: list[Any] = []
        self._sites: dict[tuple[str, str], dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._nesting = threading.local()

    def attach(self) -> None:
        self._patch.install(self.api, self._wrap_function, self._wrap_primitive)
        self.keep(self._patch)

    def _wrap_function(self, op: str, original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)
        inputs_names, outputs_names = FUNCTIONS[op]

        def arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], list[Any], Any]:
            bound = signature.bind_partial(*args, **kwargs).arguments
            api = self.api
            return _tensors(api, bound, inputs_names), _tensors(api, bound, outputs_names), bound.get("group")

        collective = self._wrapper(op, original, arguments, outputs_returned=False)
        collective.__wrapped__ = original  # type: ignore[attr-defined]
        collective.__name__ = getattr(original, "__name__", op)
        collective.__doc__ = original.__doc__
        return collective

    def _wrap_primitive(self, op: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], list[Any], Any]:
            inputs = [t for value in (*args[1:], *kwargs.values()) for t in tensors_of(self.api, value)]
            return inputs, [], getattr(args[0], "group", None)

        return self._wrapper(op, original, arguments, outputs_returned=True)

    def _wrapper(
        self,
        op: str,
        original: Callable[..., Any],
        arguments: Callable[[tuple[Any, ...], dict[str, Any]], tuple[list[Any], list[Any], Any]],
        *,
        outputs_returned: bool,
    ) -> Callable[..., Any]:
        before = self.guard(self._before)
        after = self.guard(self._after)

        def collective(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._nesting, "depth", 0):
                # called by another collective (all_gather_into_tensor -> all_gather_single):
                # the outer call is the one recorded
                return original(*args, **kwargs)
            call = None
            if not self.disabled:
                call = before(op, arguments, args, kwargs, outputs_returned, sys._getframe(1))
            self._nesting.depth = 1
            try:
                result = original(*args, **kwargs)
            finally:
                self._nesting.depth = 0
            if call is not None:
                if outputs_returned:
                    call.outputs = tensors_of(self.api, result)
                after(call, result if not outputs_returned else None)
            return result

        return collective

    def _before(
        self,
        op: str,
        arguments: Callable[[tuple[Any, ...], dict[str, Any]], tuple[list[Any], list[Any], Any]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        outputs_returned: bool,
        frame: FrameType,
    ) -> _Call | None:
        full_site, short_site = call_site(frame)
        inputs, outputs, group = arguments(args, kwargs)
        if self.config.cc_log_only:
            self._log_site(op, full_site, inputs + outputs, group, frame)
            return None
        if not self.clock.collecting or not self._selected(full_site):
            return None
        index = self._counts.get(op, 0)
        self._counts[op] = index + 1
        tag_site = f"@{short_site}"
        has_outputs = outputs_returned or bool(FUNCTIONS[op][1])
        if self.config.cc_pre_hook or not has_outputs:
            self._record(op, index, "in", inputs, tag_site)
        return _Call(op, index, tag_site, outputs) if has_outputs else None

    def _selected(self, full_site: str) -> bool:
        lines = self.config.cc_codeline
        return not lines or any(full_site.endswith(line) for line in lines)

    def _after(self, call: _Call, result: Any) -> None:
        if not call.outputs:
            return
        pending = self.api.defer(result, self.guard(lambda: self._record_call(call)))
        if pending is None:
            self._record_call(call)
        else:
            self._pending.append(pending)

    def _record_call(self, call: _Call) -> None:
        self._record(call.op, call.index, "out", call.outputs, call.tag_site)

    def _record(self, op: str, index: int, side: str, tensors: list[Any], tag_site: str) -> None:
        keys = [RowKey(0, f"{op}.{index}.{side}.{i}{tag_site}", "comm") for i in range(len(tensors))]
        self.rows.extend(keys, self.stats.rows(tensors))

    def end_step(self) -> None:
        pending, self._pending = self._pending, []
        for item in pending:
            self.api.settle(item)
        self._counts.clear()

    # -- cc_log_only ---------------------------------------------------------------------
    def _log_site(self, op: str, full_site: str, tensors: list[Any], group: Any, frame: FrameType) -> None:
        key = (op, full_site)
        if key in self._sites:
            return
        entry = {
            "op": op,
            "codeline": full_site,
            "dtypes": sorted({str(t.dtype) for t in tensors}),
            "shapes": [list(t.shape) for t in tensors],
            "group": self.api.describe_group(group),
            "stack": [line.rstrip() for line in traceback.format_stack(frame, limit=12)],
        }
        with self._lock:
            self._sites[key] = entry
            snapshot = list(self._sites.values())
        print(
            f"[trainprobe cc rank {self.rank}] {op} at {full_site} dtypes={entry['dtypes']} "
            f"shapes={entry['shapes']} group={entry['group']}",
            flush=True,
        )
        write_json_atomically(self.log_path, snapshot)
