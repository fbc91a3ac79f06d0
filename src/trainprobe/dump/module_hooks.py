"""Level L0 (and mix): modules' forward, backward and parameter gradients.

Every submodule of the model given to ``start()`` (not the model itself) gets a forward pre-hook
and a forward hook (both with kwargs) and each of its own parameters a tensor hook. A model list
names its modules ``Module.{i}.{name}...``. Everything registered here is removed by
:meth:`ModuleHooks.remove`; nothing else on the model is touched.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from trainprobe.dump import backward_hooks
from trainprobe.dump.backward_hooks import backward_name
from trainprobe.dump.collector import Collector, call_stack
from trainprobe.dump.entries import value_entry
from trainprobe.dump.overflow import DeferredFiles, backward_overflows
from trainprobe.dump.store import StepStore


def named_submodules(model: nn.Module | Sequence[nn.Module]) -> list[tuple[str, nn.Module]]:
    """``(dump prefix, module)`` for every submodule, e.g. ``Module.layers.0.Linear``; model
    lists add the list index (``Module.0.layers.0.Linear``); the root(s) are left out."""
    chunks = [model] if isinstance(model, nn.Module) else list(model)
    is_list = not isinstance(model, nn.Module)
    out = []
    for i, chunk in enumerate(chunks):
        for name, module in chunk.named_modules():
            if not name:
                continue
            full = f"{i}.{name}" if is_list else name
            out.append((f"Module.{full}.{type(module).__name__}", module))
    return out


class ModuleHooks:
    """Forward/backward/parameter-gradient capture for a set of modules."""

    def __init__(self, collector: Collector) -> None:
        self.collector = collector
        self._forward_handles: list[Any] = []
        self._param_handles: list[Any] = []
        self._hooked_params: set[tuple[int, int]] = set()  # (module, parameter): a tied one per module
        self._pending: dict[int, tuple[str, dict[str, Any], str | None, list[str] | None, bool]] = {}
        self._seq0: dict[int, int] = {}  # module → the autograd sequence number when its forward began

    def attach(self, modules: list[tuple[str, nn.Module]], *, only_self: bool = False) -> None:
        """Hook ``modules``; with ``only_self`` (module_dump) their insides are not dumped."""
        for prefix, module in modules:
            pre = self._outer(
                self.collector.guarded(f"forward pre-hook of {prefix}", self._make_pre(prefix, only_self))
            )
            post = self.collector.guarded(f"forward hook of {prefix}", self._make_post(prefix, only_self))
            self._forward_handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            self._forward_handles.append(module.register_forward_hook(post, with_kwargs=True, always_call=True))

    def attach_param_grads(self, modules: list[tuple[str, nn.Module]]) -> None:
        """Tensor hooks on each module's own parameters (``parameters_grad`` records). A parameter
        shared by several modules (a head tied to the embedding) is in each one's record: every
        module that holds it gets its own hook, all of them reading the same total gradient."""
        for prefix, module in modules:
            state: dict[str, Any] = {"record": None, "index": -1}
            for pname, param in module.named_parameters(recurse=False):
                key = (id(module), id(param))
                if not param.requires_grad or key in self._hooked_params:
                    continue
                self._hooked_params.add(key)
                hook = self.collector.guarded(
                    f"gradient hook of {prefix}.{pname}", self._make_param_hook(prefix, pname, state)
                )
                self._param_handles.append(param.register_hook(hook))

    def remove_forward(self) -> None:
        """Remove the forward hooks (gradient hooks stay until :meth:`remove`)."""
        handles, self._forward_handles = self._forward_handles, []
        for h in handles:
            h.remove()
        self._pending.clear()
        self._seq0.clear()

    def remove(self) -> None:
        """Remove every hook this object registered."""
        self.remove_forward()
        handles, self._param_handles = self._param_handles, []
        for h in handles:
            h.remove()
        self._hooked_params.clear()

    # -- hooks -----------------------------------------------------------------------------
    def _outer(self, guarded_pre: Any) -> Any:
        c = self.collector

        def pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            guarded_pre(module, args, kwargs, c.active)  # read before guarded() pauses dumping

        return pre

    def _make_pre(self, prefix: str, only_self: bool) -> Any:
        c = self.collector

        def pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], active: bool) -> None:
            if not active:
                if only_self:
                    c.suppress += 1
                    self._pending[id(module)] = ("", {}, None, None, False)
                return
            n = c.next_index(prefix)
            name = f"{prefix}.forward.{n}"
            selected = c.select(name)
            parent = c.module_stack[-1] if c.module_stack else None
            if selected:
                c.selected_modules.add(prefix)
                record = c.forward_inputs(name, args, kwargs, module)
                stack = call_stack(sys._getframe())
                self._pending[id(module)] = (name, record, parent, stack, True)
            else:
                self._pending[id(module)] = (name, {}, parent, None, False)
            c.module_stack.append(name)
            if only_self:
                c.suppress += 1
            next_seq = backward_hooks.next_sequence_nr
            if selected and next_seq is not None:
                self._seq0[id(module)] = next_seq()

        return pre

    def _make_post(self, prefix: str, only_self: bool) -> Any:
        c = self.collector

        def post(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            pending = self._pending.pop(id(module), None)
            seq0 = self._seq0.pop(id(module), None)
            if pending is None:
                return
            name, record, parent, stack, selected = pending
            if only_self:
                c.suppress = max(0, c.suppress - 1)
            if not name:
                return
            if c.module_stack and c.module_stack[-1] == name:
                c.module_stack.pop()
            if not selected or c.store is None or c.disabled:
                return
            params = dict(module.named_parameters(recurse=False))
            c.finish_forward(name, record, output, parameters=params, stack=stack, parent=parent)
            bname = f"{prefix}.backward.{name.rsplit('.', 1)[1]}"
            c.backward.watch(bname, [args, kwargs], output, backward_name(parent), seq0=seq0)
            c.end_scope(name)

        return post

    def _make_param_hook(self, prefix: str, pname: str, state: dict[str, Any]) -> Any:
        c = self.collector

        def hook(grad: torch.Tensor) -> None:
            current, cfg = c.store, c.config
            if current is None or not cfg.backward or prefix not in c.selected_modules:
                return
            store: StepStore = current
            record = state["record"]
            if record is None or pname in record or store is not state.get("step_store"):
                state["index"] = c.next_index(f"{prefix}.parameters_grad")
                record = {}
                state["record"] = record
                state["step_store"] = store
                name = f"{prefix}.parameters_grad.{state['index']}"
                state["name"] = name
                state["deferred"] = DeferredFiles() if c.overflow_task else None
                if not c.overflow_task:
                    store.add(name, record, parent=None)
            name = state["name"]
            deferred: DeferredFiles | None = state["deferred"]
            record[pname] = [value_entry(grad, f"{name}.{pname}", c.options(name, deferred))]
            if deferred is None or deferred.kept:
                store.touch()
            elif backward_overflows(name, record) and c.take_overflow():
                store.add(name, record, parent=None)
                deferred.keep(store)

        return hook
