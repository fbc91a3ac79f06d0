"""Turns API calls and module calls into dump records: names, filters and forward data.

Names (per step; counters restart at every ``step()``):

* API: ``{Prefix}.{api}.{n}.forward`` / ``.backward`` (``Functional.relu.0.forward``).
* Module: ``Module.{name}.{Class}.forward.{n}`` / ``backward.{n}`` and
  ``Module.{name}.{Class}.parameters_grad.{k}`` (``k`` counts gradient arrivals, not calls).

A forward record holds ``input_args``, ``input_kwargs``, ``output`` (and ``parameters`` for
modules). Its backward record is filled by the gradient hooks of the collector's
:class:`~trainprobe.dump.backward_hooks.BackwardHooks` (:attr:`Collector.backward`), registered
when the forward record is complete. APIs whose records are left out by ``risk_level`` still
count, so the numbers do not depend on the filter.

Task ``overflow_check`` keeps only the records that overflow, with their tensors
(:mod:`trainprobe.dump.overflow`), at most ``overflow_nums`` of them (:meth:`Collector.take_overflow`).

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
from trainprobe.dump.backward_hooks import BackwardHooks, backward_name, next_sequence_nr
from trainprobe.dump.config import DumpConfig
from trainprobe.dump.entries import EntryOptions, as_list, tensors_in, value_entry
from trainprobe.dump.overflow import DeferredFiles, forward_overflows, writes_inputs
from trainprobe.dump.store import StepStore
from trainprobe.engine.guard import guarded
from trainprobe.engine.log import error_once

SMALL_POOL = 4
"""With at most this many intra-op threads, the dump's own kernels (statistics, copies) run on one
thread: a reduction over one activation gains little from 2-4 threads, and an OpenMP region
stalls for milliseconds whenever one of its cores is busy with another process (measured: 12 ms
instead of 0.5 ms for the min/max of 2M floats on a shared 2-core machine). The training's own
ops keep torch's setting; set/restore costs under a microsecond and only affects this thread."""
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
        self.backward = BackwardHooks(self)
        """The backward records: :meth:`BackwardHooks.watch` after each forward record."""

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
        """Whether this thread is inside trainprobe's own code now (or is a trainprobe thread)."""
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
        """Write ``tensor`` as ``file_name`` into the current store's tensor folder (none: nothing)."""
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

    def give_back_overflow(self) -> None:
        """Un-count one kept overflow_check record (dropped at the step's end): one more may be kept."""
        self.overflows -= 1
        self.overflow_done = False

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
        """Before an API call: count it and, when selected, its name, forward record (inputs),
        construct parent and call stack at ``frame``; None when the filters leave it out."""
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
        """After an API call: complete and store its forward record with ``result`` and watch its
        backward (``seq0``: the autograd sequence number before the call); an identity dropout gets
        no backward record."""
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
            self.backward.watch(bname, [args, kwargs], result, backward_name(parent), api=True, seq0=seq0)
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


def _matches(name: str, pattern: str) -> bool:
    """Whether the record ``name`` is the ``scope`` bound ``pattern`` (a name or a name's prefix)."""
    return name == pattern or name.startswith(pattern + ".") or name.startswith(pattern)
