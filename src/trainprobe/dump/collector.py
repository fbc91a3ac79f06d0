"""Turns API calls and module calls into dump records: names, filters, forward and backward data.

Names (per step; counters restart at every ``step()``):

* API: ``{Prefix}.{api}.{n}.forward`` / ``.backward`` (``Functional.relu.0.forward``).
* Module: ``Module.{name}.{Class}.forward.{n}`` / ``backward.{n}`` and
  ``Module.{name}.{Class}.parameters_grad.{k}`` (``k`` counts gradient arrivals, not calls).

A forward record holds ``input_args``, ``input_kwargs``, ``output`` (and ``parameters`` for
modules); a backward record ``input`` (gradients of the forward outputs) and ``output``
(gradients of the forward inputs that require gradients: what this call passes back to each, see
:meth:`Collector.watch_backward`). Gradients come from ``Tensor.register_hook`` on the forward
outputs and from hooks on the autograd nodes the call made, which observe the gradients without
changing the graph (training stays bitwise identical). APIs whose records are left out by
``risk_level`` still count, so the numbers do not depend on the filter.

Task ``overflow_check`` keeps only the records that overflow, with their tensors
(:mod:`trainprobe.dump.overflow`).

Fault isolation: any exception in the collector's own code is logged once, written to
``dump_error_info.log`` and disables dumping; the training goes on. The user's function itself is
always called outside that protection, so its own errors propagate unchanged.
"""

from __future__ import annotations

import linecache
import os
import sys
import threading
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any

import torch

from trainprobe.dump.api_catalog import DISTRIBUTED_PREFIX, api_risk
from trainprobe.dump.config import DumpConfig
from trainprobe.dump.entries import EntryOptions, as_list, tensors_in, value_entry
from trainprobe.dump.overflow import DeferredFiles, backward_overflows, data_names, forward_overflows, writes_inputs
from trainprobe.dump.store import StepStore
from trainprobe.engine.guard import guarded
from trainprobe.engine.log import error_once

SMALL_POOL = 4
"""With at most this many intra-op threads, the dump's own kernels (statistics, copies) run on one
thread: a reduction over one activation gains little from 2-4 threads, and an OpenMP region
stalls for milliseconds whenever one of its cores is busy with another process (measured: 12 ms
instead of 0.5 ms for the min/max of 2M floats on a shared 2-core machine). The training's own
ops keep torch's setting; set/restore costs under a microsecond and only affects this thread."""
next_sequence_nr: Callable[[], int] | None = getattr(torch._C._autograd, "_get_sequence_nr", None)
"""The sequence number the next autograd node made on this thread gets (None: unknown here)."""
LOCAL_GRAPH_LIMIT = 4096
"""At most this many autograd nodes are walked to find a call's own gradient edges."""
_SKIP_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
_STACK_CACHE: dict[tuple[Any, ...], list[str]] = {}


def call_stack(frame: FrameType | None) -> list[str]:
    """The user's call stack at ``frame`` (innermost first), torch's and trainprobe's frames left
    out, each as ``File <path>, line <n>, in <function>, \\n <code>``."""
    key: list[Any] = []
    f = frame
    while f is not None:
        code = f.f_code
        if not code.co_filename.startswith(_SKIP_DIRS):
            key.append((code, f.f_lineno))
        f = f.f_back
    frozen = tuple(key)
    lines = _STACK_CACHE.get(frozen)
    if lines is None:
        lines = [
            f"File {code.co_filename}, line {lineno}, in {code.co_name}, \n "
            f"{linecache.getline(code.co_filename, lineno).strip()}"
            for code, lineno in frozen
        ]
        if len(_STACK_CACHE) > 20000:
            _STACK_CACHE.clear()
        _STACK_CACHE[frozen] = lines
    return lines


class Collector:
    """Builds the records of the current step into a :class:`StepStore`.

    The debugger sets :attr:`store` (None: nothing is dumped) and :attr:`recording`.
    """

    def __init__(self, config: DumpConfig) -> None:
        self.config = config
        self.store: StepStore | None = None
        self.recording = False
        self.disabled = False
        self.suppress = 0  # > 0 inside a module_dump module
        self.with_construct = config.level in ("L0", "mix")
        self.counts: dict[str, int] = {}
        self.module_stack: list[str] = []
        self.phase: str | None = None  # "optimizer" / "clip_grad" while those run (mix: construct parent)
        self.handles: list[Any] = []
        self.selected_modules: set[str] = set()
        self._tls = threading.local()
        self._scope_state = 0 if config.scope else 1  # 0 before, 1 inside, 2 after
        self._scope_closing: str | None = None
        self._opts_cache: dict[bool, EntryOptions] = {}
        self.overflow_task = config.task == "overflow_check"
        self.overflows = 0  # records kept by overflow_check over the run
        self.overflow_done = False  # overflow_nums reached: nothing more is recorded
        self._deferred: dict[str, DeferredFiles] = {}

    # -- state ---------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """Whether calls are recorded now (on this thread; never on trainprobe's own threads,
        named ``trainprobe-...``, such as the ``.pt`` file writer)."""
        return (
            self.recording
            and self.store is not None
            and not self.disabled
            and not self.suppress
            and not self.overflow_done
            and not self._busy()
        )

    def _busy(self) -> bool:
        busy = getattr(self._tls, "busy", None)
        if busy is None:
            busy = self._tls.busy = threading.current_thread().name.startswith("trainprobe-")
        return busy

    def new_step(self) -> None:
        """Forget the counters and pending gradient hooks of the previous step."""
        self.remove_handles()
        self._deferred.clear()
        self.counts.clear()
        self.module_stack.clear()
        self.phase = None
        self.selected_modules.clear()
        self._scope_state = 0 if self.config.scope else 1
        self._scope_closing = None

    def remove_handles(self) -> None:
        """Remove every gradient hook registered so far."""
        handles, self.handles = self.handles, []
        for h in handles:
            h.remove()

    def fail(self, exc: BaseException, where: str) -> None:
        """Log ``exc`` once, record it in dump_error_info.log and stop dumping."""
        self.disabled = True
        error_once(
            f"dump-failed-{id(self)}",
            f"trainprobe dump: {where} failed; dumping is disabled, training continues ({type(exc).__name__}: {exc})",
        )
        store = self.store
        if store is not None:
            try:
                store.log_error(f"{where}: {type(exc).__name__}: {exc}")
            except OSError:
                pass

    def guarded(self, where: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` under the engine's guard (:func:`trainprobe.engine.guard.guarded`: it never
        raises, a fault disables dumping), marked busy so that our own torch calls are not
        dumped, on one thread where a small pool would only add hand-overs. (No
        ``functools.wraps``: one is made per gradient hook, and copying the metadata would cost
        more than the rest of the wrapper.)"""

        def run(*args: Any, **kwargs: Any) -> Any:
            tls = self._tls
            previous = self._busy()
            tls.busy = True
            threads = torch.get_num_threads()
            narrow = 1 < threads <= SMALL_POOL
            if narrow:
                torch.set_num_threads(1)
            try:
                return fn(*args, **kwargs)
            finally:
                if narrow:
                    torch.set_num_threads(threads)
                tls.busy = previous

        return guarded(run, off=lambda: self.disabled, fail=lambda exc: self.fail(exc, where), wraps=False)

    def call_quietly(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Call the user's ``func`` with dumping paused on this thread (nested calls not dumped)."""
        tls = self._tls
        previous = self._busy()
        tls.busy = True
        try:
            return func(*args, **kwargs)
        finally:
            tls.busy = previous

    # -- naming and filters --------------------------------------------------------------
    def next_index(self, base: str) -> int:
        """The next call index of ``base`` in this step."""
        n = self.counts.get(base, 0)
        self.counts[base] = n + 1
        return n

    def select(self, name: str) -> bool:
        """Whether the forward record ``name`` passes ``list`` and ``scope``."""
        cfg = self.config
        if cfg.names and not any(s == name or s in name for s in cfg.names):
            return False
        if not cfg.scope:
            return True
        first, last = cfg.scope
        if self._scope_state == 0 and _matches(name, first):
            self._scope_state = 1
        if self._scope_state != 1:
            return False
        if self._scope_closing is None and _matches(name, last):
            self._scope_closing = name
        return True

    def end_scope(self, name: str) -> None:
        """Called when the record ``name`` is complete (closes the scope after its last name)."""
        if self._scope_closing == name:
            self._scope_state = 2

    def options(self, name: str, deferred: DeferredFiles | None = None) -> EntryOptions:
        """How tensors of record ``name`` are described (statistics, checksum, .pt files);
        ``deferred``: overflow_check's holder of the record's tensors."""
        cfg = self.config
        if deferred is not None:
            return EntryOptions(statistics=True, summary_mode=cfg.summary_mode, save=deferred)
        save = cfg.task == "tensor" or (cfg.task == "statistics" and any(s in name for s in cfg.tensor_list))
        opts = self._opts_cache.get(save)
        if opts is None:
            store = self.store
            opts = EntryOptions(
                statistics=cfg.task != "structure",
                summary_mode=cfg.summary_mode,
                save=self._save_tensor if save and store is not None else None,
            )
            self._opts_cache[save] = opts
        return opts

    def _save_tensor(self, file_name: str, tensor: torch.Tensor, entry: dict[str, Any]) -> None:
        store = self.store
        if store is not None:
            store.save_tensor(file_name, tensor)

    def set_store(self, store: StepStore | None) -> None:
        """Write into ``store`` from now on."""
        self.store = store
        self._opts_cache.clear()

    # -- forward -------------------------------------------------------------------------
    def forward_inputs(
        self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], module: torch.nn.Module | None = None
    ) -> dict[str, Any]:
        """``input_args`` and ``input_kwargs`` entries of ``name`` (taken before the call;
        ``module``: the module called, for modules)."""
        cfg = self.config
        deferred = None
        if self.overflow_task:
            deferred = DeferredFiles(copy=writes_inputs(name, kwargs, module))
            self._deferred[name] = deferred
        if not (cfg.forward and cfg.inputs):
            return {"input_args": [], "input_kwargs": {}}
        opts = self.options(name, deferred)
        return {
            "input_args": [value_entry(a, f"{name}.input.{i}", opts) for i, a in enumerate(args)],
            "input_kwargs": {k: value_entry(v, f"{name}.input.{k}", opts) for k, v in kwargs.items()},
        }

    def finish_forward(
        self,
        name: str,
        record: dict[str, Any],
        output: Any,
        *,
        parameters: Mapping[str, torch.Tensor] | None = None,
        stack: list[str] | None = None,
        parent: str | None = None,
    ) -> None:
        """Complete the forward record ``name`` with its output (and parameters) and store it."""
        cfg = self.config
        deferred = self._deferred.pop(name, None) if self.overflow_task else None
        if deferred is not None:
            deferred.copy = False
        opts = self.options(name, deferred)
        record["output"] = (
            [value_entry(o, f"{name}.output.{i}", opts) for i, o in enumerate(as_list(output))]
            if cfg.forward and cfg.outputs
            else []
        )
        if parameters is not None:
            record["parameters"] = (
                {k: value_entry(p, f"{name}.parameters.{k}", opts) for k, p in parameters.items()}
                if cfg.forward
                else {}
            )
        store = self.store
        if store is None:
            return
        if not cfg.forward or (self.overflow_task and not (forward_overflows(record) and self.take_overflow())):
            store.remove(name)
            return
        store.add(name, record, stack=stack, parent=parent if self.with_construct else None)
        if deferred is not None:
            deferred.keep(store)

    def take_overflow(self) -> bool:
        """Count one more kept overflow_check record; False when ``overflow_nums`` are kept already."""
        limit = self.config.overflow_nums
        if self.overflow_done:
            return False
        self.overflows += 1
        if limit != -1 and self.overflows >= limit:
            self.overflow_done = True
        return True

    # -- backward ------------------------------------------------------------------------
    def watch_backward(
        self,
        name: str,
        inputs: Any,
        output: Any,
        parent: str | None,
        *,
        api: bool = False,
        seq0: int | None = None,
    ) -> None:
        """Register gradient hooks filling the backward record ``name``: ``input`` holds the
        gradients of ``output``'s tensors, ``output`` those of ``inputs``' tensors that require
        gradients, in argument order: the gradient that flows from this call into the tensor
        (its autograd edges made after ``seq0``, the sequence number taken before the call), or,
        without ``seq0`` or in a graph too large to walk, the tensor's gradient over all uses. An
        ``api`` whose output is made by one autograd node fed directly by its inputs (``relu``,
        ``x + y``, ``layer_norm``) gets that node's input gradients: one entry per differentiable
        argument of the node (``null`` for ``2`` in ``x * 2``), the reference tool's layout."""
        cfg = self.config
        if not cfg.backward or not torch.is_grad_enabled():
            return
        if isinstance(output, torch.Tensor):
            if not output.requires_grad:
                return
            outs = [output]
        else:
            outs = [t for _, t in tensors_in(output)]
            if not any(t.requires_grad for t in outs):
                return
        ins = [t for _, t in tensors_in(inputs) if t.requires_grad]
        node = _single_node(outs, ins) if api else None
        record: dict[str, Any] = {"input": [None] * len(outs) if cfg.inputs else [], "output": []}
        if cfg.outputs:
            record["output"] = [None] * (len(node.next_functions) if node is not None else len(ins))
        state: dict[str, Any] = {"stored": False, "pending": 0}
        if self.overflow_task:
            state["deferred"] = DeferredFiles()
        if cfg.inputs:
            for i, t in enumerate(outs):
                self._grad_hook(t, name, record, state, "input", i, parent)
        if not cfg.outputs:
            return
        if node is not None:
            self._node_hook(node, name, record, state, parent)
            return
        edges = _own_edges(outs, ins, seq0) if seq0 is not None else None
        if edges:
            self._edge_hooks(edges, ins, name, record, state, parent)
            return
        for i, t in enumerate(ins):
            self._grad_hook(t, name, record, state, "output", i, parent)

    def _grad_hook(
        self,
        t: torch.Tensor,
        name: str,
        record: dict[str, Any],
        state: dict[str, Any],
        side: str,
        i: int,
        parent: str | None,
    ) -> None:
        if not t.requires_grad:
            return
        state["pending"] += 1

        def hook(grad: torch.Tensor) -> None:
            if self.store is None:
                return
            record[side][i] = value_entry(grad, f"{name}.{side}.{i}", self.options(name, state.get("deferred")))
            self._arrived(name, record, state, parent)

        self.handles.append(t.register_hook(self.guarded(f"backward hook of {name}", hook)))

    def _node_hook(
        self, node: Any, name: str, record: dict[str, Any], state: dict[str, Any], parent: str | None
    ) -> None:
        """``record["output"]`` from the input gradients of the autograd ``node`` (read only)."""
        state["pending"] += 1

        def hook(grad_inputs: tuple[torch.Tensor | None, ...], grad_outputs: Any) -> None:
            if self.store is None:
                return
            opts = self.options(name, state.get("deferred"))
            record["output"] = [
                None if g is None else value_entry(g, f"{name}.output.{i}", opts) for i, g in enumerate(grad_inputs)
            ]
            self._arrived(name, record, state, parent)

        self.handles.append(node.register_hook(self.guarded(f"backward hook of {name}", hook)))

    def _edge_hooks(
        self,
        edges: dict[Any, list[tuple[int, int]]],
        ins: list[torch.Tensor],
        name: str,
        record: dict[str, Any],
        state: dict[str, Any],
        parent: str | None,
    ) -> None:
        """``record["output"][i]``: the sum of the gradients autograd passes along this call's own
        edges into input ``i`` (node hooks only read them); an input passed several times gets that
        sum in each place (the same tensor object in ``ins``: two inputs whose gradients autograd
        happens to pass as one object, ``x + 1`` and ``x - 1``, keep their own entries)."""
        n_inputs = len(ins)
        sums: list[torch.Tensor | None] = [None] * n_inputs
        for node, pairs in edges.items():
            state["pending"] += 1

            def hook(grad_inputs: tuple[torch.Tensor | None, ...], grad_outputs: Any, pairs: Any = pairs) -> None:
                if self.store is None:
                    return
                opts = self.options(name, state.get("deferred"))
                changed = set()
                for j, i in pairs:
                    g = grad_inputs[j]
                    if g is not None:
                        sums[i] = g if sums[i] is None else sums[i] + g  # type: ignore[operator]
                        changed.add(i)
                for i in changed:
                    entry = value_entry(sums[i], f"{name}.output.{i}", opts)
                    for k in range(n_inputs):
                        if sums[k] is sums[i] and ins[k] is ins[i]:
                            record["output"][k] = entry
                self._arrived(name, record, state, parent)

            self.handles.append(node.register_hook(self.guarded(f"backward hook of {name}", hook)))

    def _arrived(self, name: str, record: dict[str, Any], state: dict[str, Any], parent: str | None) -> None:
        """One more gradient of the backward record ``name`` is in: store or refresh the record."""
        store = self.store
        if store is None:
            return
        deferred: DeferredFiles | None = state.get("deferred")
        state["pending"] -= 1
        if deferred is not None:
            self._judge_backward(name, record, state, deferred, store, parent)
        elif not state["stored"]:
            state["stored"] = True
            store.add(name, record, parent=parent if self.with_construct else None)
        else:
            store.touch()

    def _judge_backward(
        self,
        name: str,
        record: dict[str, Any],
        state: dict[str, Any],
        deferred: DeferredFiles,
        store: StepStore,
        parent: str | None,
    ) -> None:
        """overflow_check: store the backward record ``name`` (and write its files) as soon as it
        overflows; forget its held gradients once all arrived without it overflowing."""
        if deferred.kept:
            store.touch()
        elif backward_overflows(name, record) and self.take_overflow():
            state["stored"] = True
            store.add(name, record, parent=parent if self.with_construct else None)
            deferred.keep(store)
        elif state["pending"] <= 0:
            deferred.drop()

    def drop_unoverflowed_backward(self) -> None:
        """overflow_check: drop the backward records kept early whose verdict changed since (an
        ``input`` gradient that arrived late overflowed too), with their files."""
        store = self.store
        if store is None or not self.overflow_task:
            return
        with store.lock:
            for name in [n for n in store.data if ".backward" in n or ".parameters_grad." in n]:
                record = store.data[name]
                if backward_overflows(name, record):
                    continue
                del store.data[name]
                store.construct.pop(name, None)
                self.overflows -= 1
                self.overflow_done = False
                store.files.wait()
                for file_name in data_names(record):
                    (store.tensor_dir / file_name).unlink(missing_ok=True)

    # -- APIs ------------------------------------------------------------------------------
    def api_call(self, base: str, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Call ``func`` and record it as ``base`` (``Functional.relu``) when selected."""
        prepared = self._api_before(base, args, kwargs, sys._getframe(1))
        seq0 = next_sequence_nr() if prepared is not None and next_sequence_nr is not None else None
        result = self.call_quietly(func, args, kwargs)
        if prepared is not None:
            self._api_after(prepared, args, kwargs, result, seq0)
        return result

    def _api_before_impl(
        self, base: str, args: tuple[Any, ...], kwargs: dict[str, Any], frame: FrameType
    ) -> tuple[str, dict[str, Any], str | None, list[str]] | None:
        n = self.next_index(base)
        name = f"{base}.{n}.forward"
        if not self.select(name) or not self.risk_selects(base):
            return None
        parent = self._phase_parent() or (self.module_stack[-1] if self.module_stack else None)
        return name, self.forward_inputs(name, args, kwargs), parent, call_stack(frame)

    def _phase_parent(self) -> str | None:
        """mix: ``optimizer`` / ``clip_grad`` while ``optimizer.step()`` / ``clip_grad_norm_()``
        run: the construct.json parent of their APIs, itself a root entry."""
        phase = self.phase
        store = self.store
        if phase is None or store is None or not self.with_construct:
            return None
        with store.lock:
            store.construct.setdefault(phase, None)
        return phase

    def _api_after_impl(
        self,
        prepared: tuple[str, dict[str, Any], str | None, list[str]],
        args: Any,
        kwargs: Any,
        result: Any,
        seq0: int | None,
    ) -> None:
        name, record, parent, stack = prepared
        output = result
        if result is None and name.startswith("Distributed."):
            # in-place collectives (all_reduce, broadcast, ...): their tensors after the call
            output = [t for _, t in tensors_in([args, kwargs])]
            if self.store is not None:
                self.store.files.new_step()
        self.finish_forward(name, record, output, stack=stack, parent=parent)
        if not _is_identity_dropout(name, args, kwargs):
            bname = name[: -len("forward")] + "backward"
            self.watch_backward(bname, [args, kwargs], result, _backward_name(parent), api=True, seq0=seq0)
        self.end_scope(name)

    def risk_selects(self, base: str) -> bool:
        """Whether the API ``base`` (``Tensor.view``) passes ``risk_level`` (FOCUS by default: no
        data-movement APIs); every API passes when ``scope`` or ``list`` is configured."""
        cfg = self.config
        level = cfg.risk_level
        if cfg.scope or cfg.names or level == "ALL":
            return True
        prefix, _, api = base.partition(".")
        risk = api_risk(api.rsplit(".", 1)[-1], distributed=prefix == DISTRIBUTED_PREFIX)
        return risk == "CORE" if level == "CORE" else risk != "LOW"

    def bind(self) -> None:
        """Create the guarded versions of the per-call steps (after construction)."""
        self._api_before = self.guarded("recording an API's inputs", self._api_before_impl)
        self._api_after = self.guarded("recording an API's outputs", self._api_after_impl)


_DROPOUTS = ("Functional.dropout.", "Functional.dropout1d.", "Functional.dropout2d.", "Functional.dropout3d.")


def _is_identity_dropout(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """A dropout with ``p == 0``: its output is its input, so it gets no backward record."""
    if not name.startswith(_DROPOUTS):
        return False
    p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
    return isinstance(p, (int, float)) and p == 0


def _single_node(outs: list[torch.Tensor], ins: list[torch.Tensor]) -> Any:
    """The autograd node that made ``outs[0]`` when each of its edges leads straight to one of
    ``ins`` (or nowhere), else None: the API ran as one differentiable operation."""
    node = outs[0].grad_fn if outs and outs[0].requires_grad else None
    if node is None or any(o is t for o in outs for t in ins):
        return None
    edges = node.next_functions
    if not edges:
        return None
    for target, nr in edges:
        if target is None:
            continue
        leaf = getattr(target, "variable", None)
        if leaf is not None:
            if not any(t is leaf for t in ins):
                return None
        elif not any(t.grad_fn is target and t.output_nr == nr for t in ins):
            return None
    return node


def _own_edges(outs: list[torch.Tensor], ins: list[torch.Tensor], seq0: int) -> dict[Any, list[tuple[int, int]]] | None:
    """The autograd edges by which the call that made ``outs`` (its nodes: sequence number >=
    ``seq0``) reads ``ins``: ``{node: [(edge index, input index), ...]}``; None when an output is
    an input, nothing leads to an input, or the walk passes :data:`LOCAL_GRAPH_LIMIT` nodes."""
    if any(o is t for o in outs for t in ins):
        return None
    by_node: dict[tuple[int, int], list[int]] = {}
    by_leaf: dict[int, list[int]] = {}
    for i, t in enumerate(ins):
        if t.grad_fn is None:
            by_leaf.setdefault(id(t), []).append(i)
        else:
            by_node.setdefault((id(t.grad_fn), t.output_nr), []).append(i)
    stack = [o.grad_fn for o in outs if o.grad_fn is not None]
    seen: set[int] = set()
    edges: dict[Any, list[tuple[int, int]]] = {}
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if len(seen) > LOCAL_GRAPH_LIMIT:
            return None
        for j, (target, nr) in enumerate(node.next_functions):
            if target is None:
                continue
            leaf = getattr(target, "variable", None)
            hits = by_leaf.get(id(leaf)) if leaf is not None else by_node.get((id(target), nr))
            if hits:
                edges.setdefault(node, []).extend((j, i) for i in hits)
            elif leaf is None and target._sequence_nr() >= seq0:
                stack.append(target)
    return edges or None


def _matches(name: str, pattern: str) -> bool:
    return name == pattern or name.startswith(pattern + ".") or name.startswith(pattern)


def _backward_name(forward_parent: str | None) -> str | None:
    if forward_parent is None:
        return None
    return forward_parent.replace(".forward.", ".backward.")
