"""``cc`` monitor: statistics of torch.distributed collectives.

Each call of a supported function is one or more rows (scope ``comm``), never merged across
calls. ``module_name`` is ``<op>.<call>.<side>.<i>@<file>[<line>]``: the function name, the
call's index among calls of that function in the step, ``in`` (before the op, with
``cc_pre_hook``) or ``out`` (after it), the tensor's index in that argument, and the call site.
``send``/``isend`` have no output: their tensor is always written as ``in``. Calls with
``async_op=True`` (and ``isend``/``irecv``) are recorded when their work completes.

The functions are replaced in ``torch.distributed`` and ``torch.distributed.distributed_c10d``
by one :class:`CollectivePatch`, which puts the originals back on :meth:`Probe.detach`. Code that
imported a function by name before :meth:`TrainerMonitorV2.start` keeps the original: start the
monitor early. ``cc_log_only`` prints each distinct call site once per rank (op, dtypes, shapes,
group, stack) and keeps them in ``rank_<r>/cc_log.json``; it records no statistics and does not
interrupt training.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from trainprobe.config.monitor_v2 import CcConfig
from trainprobe.probes.base import Probe, StepClock
from trainprobe.records import RowKey
from trainprobe.sinks.files import write_json_atomically

# op -> (argument names holding its inputs, argument names holding its outputs)
COLLECTIVES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
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
_NAMESPACES: tuple[ModuleType, ...] = (dist, c10d)


def _tensors(bound: dict[str, Any], names: tuple[str, ...]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for name in names:
        value = bound.get(name)
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(v for v in value if isinstance(v, torch.Tensor))
    return out


def call_site(frame: FrameType | None) -> tuple[str, str]:
    """``(full "path[line]", short "file.py[line]")`` of ``frame``."""
    if frame is None:
        return "?[0]", "?[0]"
    path = frame.f_code.co_filename
    return f"{path}[{frame.f_lineno}]", f"{os.path.basename(path)}[{frame.f_lineno}]"


class CollectivePatch:
    """Replaces the collective functions by wrappers and restores exactly what was there."""

    def __init__(self) -> None:
        self._saved: list[tuple[ModuleType, str, Any]] = []

    def install(self, make_wrapper: Callable[[str, Callable[..., Any]], Callable[..., Any]]) -> None:
        for op in COLLECTIVES:
            original = getattr(c10d, op, None)
            if original is None:
                continue
            wrapper = make_wrapper(op, original)
            for namespace in _NAMESPACES:
                if getattr(namespace, op, None) is original:
                    self._saved.append((namespace, op, original))
                    setattr(namespace, op, wrapper)

    def remove(self) -> None:
        saved, self._saved = self._saved, []
        for namespace, op, original in reversed(saved):
            setattr(namespace, op, original)


@dataclass(slots=True)
class _Call:
    op: str
    index: int
    tag_site: str
    outputs: list[torch.Tensor]


class CollectiveProbe(Probe):
    """Statistics (or a call-site log) of torch.distributed collectives."""

    name = "cc"

    def __init__(self, clock: StepClock, config: CcConfig, rank: int, rank_dir: Path) -> None:
        super().__init__(clock, config.ops, config.eps)
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
        self._patch.install(self._wrap)
        self.keep(self._patch)

    def _wrap(self, op: str, original: Callable[..., Any]) -> Callable[..., Any]:
        self._signatures[op] = inspect.signature(original)
        before = self.guard(self._before)
        after = self.guard(self._after)

        def collective(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._nesting, "depth", 0):
                # called by another collective (all_gather_into_tensor -> all_gather_single):
                # the outer call is the one recorded
                return original(*args, **kwargs)
            call = before(op, args, kwargs, sys._getframe(1)) if not self.disabled else None
            self._nesting.depth = 1
            try:
                result = original(*args, **kwargs)
            finally:
                self._nesting.depth = 0
            if call is not None:
                after(call, result)
            return result

        collective.__wrapped__ = original  # type: ignore[attr-defined]
        collective.__name__ = getattr(original, "__name__", op)
        collective.__doc__ = original.__doc__
        return collective

    def _before(self, op: str, args: tuple[Any, ...], kwargs: dict[str, Any], frame: FrameType) -> _Call | None:
        full_site, short_site = call_site(frame)
        bound = self._signatures[op].bind_partial(*args, **kwargs).arguments
        inputs_names, outputs_names = COLLECTIVES[op]
        if self.config.cc_log_only:
            self._log_site(op, full_site, bound, frame)
            return None
        if not self.clock.collecting or not self._selected(full_site):
            return None
        index = self._counts.get(op, 0)
        self._counts[op] = index + 1
        tag_site = f"@{short_site}"
        if self.config.cc_pre_hook or not outputs_names:
            self._record(op, index, "in", _tensors(bound, inputs_names), tag_site)
        return _Call(op, index, tag_site, _tensors(bound, outputs_names))

    def _selected(self, full_site: str) -> bool:
        lines = self.config.cc_codeline
        return not lines or any(full_site.endswith(line) for line in lines)

    def _after(self, call: _Call, result: Any) -> None:
        if not call.outputs:
            return
        future = None
        if result is not None and hasattr(result, "get_future"):
            try:
                future = result.get_future()
            except RuntimeError:
                self._pending.append((result, call))  # backend has no futures: read after wait()
                return
        if future is None:
            self._record_call(call)
            return
        self._pending.append(future.then(self.guard(lambda _f: self._record_call(call))))

    def _record_call(self, call: _Call) -> None:
        self._record(call.op, call.index, "out", call.outputs, call.tag_site)

    def _record(self, op: str, index: int, side: str, tensors: list[torch.Tensor], tag_site: str) -> None:
        keys = [RowKey(0, f"{op}.{index}.{side}.{i}{tag_site}", "comm") for i in range(len(tensors))]
        self.rows.extend(keys, self.stats.rows(tensors))

    def end_step(self) -> None:
        pending, self._pending = self._pending, []
        for item in pending:
            if isinstance(item, tuple):
                work, call = item
                if not work.is_completed():
                    # never wait twice: a second wait() on a gloo irecv blocks for another message
                    work.wait()
                self._record_call(call)
            else:
                item.wait()
        self._counts.clear()

    # -- cc_log_only ---------------------------------------------------------------------
    def _log_site(self, op: str, full_site: str, bound: dict[str, Any], frame: FrameType) -> None:
        key = (op, full_site)
        if key in self._sites:
            return
        inputs_names, outputs_names = COLLECTIVES[op]
        tensors = _tensors(bound, inputs_names + outputs_names)
        entry = {
            "op": op,
            "codeline": full_site,
            "dtypes": sorted({str(t.dtype) for t in tensors}),
            "shapes": [list(t.shape) for t in tensors],
            "group": _describe_group(bound.get("group")),
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


def _describe_group(group: Any) -> Any:
    if group is None or group is dist.GroupMember.WORLD:
        return "world"
    try:
        return dist.get_process_group_ranks(group)
    except Exception:  # noqa: BLE001 - a description only
        return str(group)
