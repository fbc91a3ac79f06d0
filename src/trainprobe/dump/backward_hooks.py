"""Backward records of the precision dump: the gradients around one API or module call.

A backward record (``Functional.relu.0.backward``, ``Module.fc.Linear.backward.0``) holds
``input`` (the gradients of the call's forward outputs) and ``output`` (the gradients of its
forward inputs that require gradients: what this call passes back to each, see
:meth:`BackwardHooks.watch`). Gradients come from ``Tensor.register_hook`` on the forward outputs
and from hooks on the autograd nodes the call made, which only read the gradients and never change
the graph (training stays bitwise identical). The record is stored when its first gradient
arrives and refreshed as the others come in.

Task ``overflow_check`` holds a record's gradients until it overflows (then it is stored with its
files) or all of them arrived without overflowing (then they are forgotten); at the step's end
:meth:`BackwardHooks.drop_unoverflowed` drops the records whose verdict changed since.

Every hook runs under the collector's guard (:meth:`Collector.guarded`): a fault disables
dumping, never the training. The hook handles go to :attr:`Collector.handles`, removed at every
step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from trainprobe.dump.entries import tensors_in, value_entry
from trainprobe.dump.overflow import DeferredFiles, backward_overflows, data_names
from trainprobe.dump.store import StepStore

if TYPE_CHECKING:
    from trainprobe.dump.collector import Collector

next_sequence_nr: Callable[[], int] | None = getattr(torch._C._autograd, "_get_sequence_nr", None)
"""The sequence number the next autograd node made on this thread gets (None: unknown here)."""
LOCAL_GRAPH_LIMIT = 4096
"""At most this many autograd nodes are walked to find a call's own gradient edges."""


@dataclass(slots=True)
class PendingBackward:
    """One backward record being filled by its gradient hooks.

    ``pending`` counts the hooks registered whose gradient has not arrived yet; ``stored``: the
    record is in the store; ``deferred``: overflow_check's holder of the record's tensors (None
    for the other tasks)."""

    name: str
    record: dict[str, Any]
    parent: str | None
    deferred: DeferredFiles | None = None
    stored: bool = False
    pending: int = 0


class BackwardHooks:
    """The backward records of one :class:`~trainprobe.dump.collector.Collector`: it registers the
    gradient hooks and stores what they see in the collector's current store, with its options
    (statistics, .pt files), its overflow_check count and its construct parents."""

    def __init__(self, collector: Collector) -> None:
        self.collector = collector

    def watch(
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
        argument of the node (``null`` for ``2`` in ``x * 2``), the reference tool's layout.
        ``parent``: the record's construct.json parent (used only with a construct). Nothing is
        registered when the config leaves out backward, gradients are off, or no output requires
        gradients."""
        cfg = self.collector.config
        if not cfg.backward or not torch.is_grad_enabled():
            return
        outs = _grad_outputs(output)
        if outs is None:
            return
        ins = [t for _, t in tensors_in(inputs) if t.requires_grad]
        node = _single_node(outs, ins) if api else None
        record: dict[str, Any] = {"input": [None] * len(outs) if cfg.inputs else [], "output": []}
        if cfg.outputs:
            record["output"] = [None] * (len(node.next_functions) if node is not None else len(ins))
        rec = PendingBackward(name, record, parent, DeferredFiles() if self.collector.overflow_task else None)
        if cfg.inputs:
            for i, t in enumerate(outs):
                self._grad_hook(t, rec, "input", i)
        if not cfg.outputs:
            return
        if node is not None:
            self._node_hook(node, rec)
            return
        edges = _own_edges(outs, ins, seq0) if seq0 is not None else None
        if edges:
            self._edge_hooks(edges, ins, rec)
            return
        for i, t in enumerate(ins):
            self._grad_hook(t, rec, "output", i)

    def _register(self, target: Any, rec: PendingBackward, hook: Callable[..., None]) -> None:
        """Register ``hook`` (guarded) on the tensor or autograd node ``target`` for one more
        gradient of ``rec``; its handle goes to the collector's handles."""
        c = self.collector
        rec.pending += 1
        c.handles.append(target.register_hook(c.guarded(f"backward hook of {rec.name}", hook)))

    def _grad_hook(self, t: torch.Tensor, rec: PendingBackward, side: str, i: int) -> None:
        """``rec.record[side][i]`` from the gradient of ``t`` (nothing when ``t`` needs none)."""
        if not t.requires_grad:
            return
        c = self.collector

        def hook(grad: torch.Tensor) -> None:
            if c.store is None:
                return
            rec.record[side][i] = value_entry(grad, f"{rec.name}.{side}.{i}", c.options(rec.name, rec.deferred))
            self._arrived(rec)

        self._register(t, rec, hook)

    def _node_hook(self, node: Any, rec: PendingBackward) -> None:
        """``rec.record["output"]`` from the input gradients of the autograd ``node`` (read only)."""
        c = self.collector

        def hook(grad_inputs: tuple[torch.Tensor | None, ...], grad_outputs: Any) -> None:
            if c.store is None:
                return
            opts = c.options(rec.name, rec.deferred)
            rec.record["output"] = [
                None if g is None else value_entry(g, f"{rec.name}.output.{i}", opts) for i, g in enumerate(grad_inputs)
            ]
            self._arrived(rec)

        self._register(node, rec, hook)

    def _edge_hooks(
        self, edges: dict[Any, list[tuple[int, int]]], ins: list[torch.Tensor], rec: PendingBackward
    ) -> None:
        """``rec.record["output"][i]``: the sum of the gradients autograd passes along this call's
        own edges into input ``i`` (node hooks only read them); an input passed several times gets
        that sum in each place (the same tensor object in ``ins``: two inputs whose gradients
        autograd happens to pass as one object, ``x + 1`` and ``x - 1``, keep their own entries)."""
        c = self.collector
        n_inputs = len(ins)
        sums: list[torch.Tensor | None] = [None] * n_inputs
        for node, pairs in edges.items():

            def hook(grad_inputs: tuple[torch.Tensor | None, ...], grad_outputs: Any, pairs: Any = pairs) -> None:
                if c.store is None:
                    return
                opts = c.options(rec.name, rec.deferred)
                changed = set()
                for j, i in pairs:
                    g = grad_inputs[j]
                    if g is not None:
                        sums[i] = g if sums[i] is None else sums[i] + g  # type: ignore[operator]
                        changed.add(i)
                for i in changed:
                    entry = value_entry(sums[i], f"{rec.name}.output.{i}", opts)
                    for k in range(n_inputs):
                        if sums[k] is sums[i] and ins[k] is ins[i]:
                            rec.record["output"][k] = entry
                self._arrived(rec)

            self._register(node, rec, hook)

    def _arrived(self, rec: PendingBackward) -> None:
        """One more gradient of ``rec`` is in: store or refresh the record."""
        c = self.collector
        store = c.store
        if store is None:
            return
        rec.pending -= 1
        if rec.deferred is not None:
            self._judge(rec, rec.deferred, store)
        elif not rec.stored:
            rec.stored = True
            store.add(rec.name, rec.record, parent=rec.parent if c.with_construct else None)
        else:
            store.touch()

    def _judge(self, rec: PendingBackward, deferred: DeferredFiles, store: StepStore) -> None:
        """overflow_check: store ``rec`` (and write its files) as soon as it overflows; forget its
        held gradients once all arrived without it overflowing."""
        c = self.collector
        if deferred.kept:
            store.touch()
        elif backward_overflows(rec.name, rec.record) and c.take_overflow():
            rec.stored = True
            store.add(rec.name, rec.record, parent=rec.parent if c.with_construct else None)
            deferred.keep(store)
        elif rec.pending <= 0:
            deferred.drop()

    def drop_unoverflowed(self) -> None:
        """overflow_check: drop the backward records kept early whose verdict changed since (an
        ``input`` gradient that arrived late overflowed too), with their files; each gives its
        place in ``overflow_nums`` back. Nothing for the other tasks."""
        c = self.collector
        store = c.store
        if store is None or not c.overflow_task:
            return
        with store.lock:
            for name in [n for n in store.data if ".backward" in n or ".parameters_grad." in n]:
                record = store.data[name]
                if backward_overflows(name, record):
                    continue
                del store.data[name]
                store.construct.pop(name, None)
                c.give_back_overflow()
                store.files.wait()
                for file_name in data_names(record):
                    (store.tensor_dir / file_name).unlink(missing_ok=True)


def backward_name(forward_parent: str | None) -> str | None:
    """The construct.json parent of a backward record whose forward record's parent is
    ``forward_parent`` (``Module.fc.Linear.forward.0`` → ``Module.fc.Linear.backward.0``)."""
    if forward_parent is None:
        return None
    return forward_parent.replace(".forward.", ".backward.")


def _grad_outputs(output: Any) -> list[torch.Tensor] | None:
    """The tensors of ``output`` (all of them, for positions), or None when none requires gradients."""
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad else None
    outs = [t for _, t in tensors_in(output)]
    return outs if any(t.requires_grad for t in outs) else None


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
