"""``cc`` monitor: statistics of collective communication calls, on any framework whose adapter
describes its collectives (:class:`CollectiveApi`).

Each call of a supported function is one or more rows (scope ``comm``), never merged across
calls. ``module_name`` is ``<op>.<call>.<side>.<i>@<file>[<line>]``: the function name, the
call's index among calls of that function in the step, ``in`` (before the op, with
``cc_pre_hook``) or ``out`` (after it), the tensor's index in that argument, and the call site.
``send``/``isend`` have no output: their tensor is always written as ``in``. Asynchronous calls
(``async_op=True``, ``isend``/``irecv``) are recorded when their work completes (see the adapter
for how it learns that: a future, or the loop's ``wait()``); a work that has not completed by the
end of its step is never waited for on the loop's behalf (:meth:`CollectiveApi.settle`).

``cc_codeline`` keeps the calls whose call site ``<path>[<line>]`` ends with an entry at a path
component boundary: ``"train.py[3]"`` selects ``.../train.py[3]``, not ``.../pretrain.py[3]``.

Two kinds of entry points are wrapped, both restored exactly when the last probe detaches:

* functions in the style of ``torch.distributed`` (:data:`FUNCTIONS` gives their argument
  names; PyTorch: ``torch.distributed``, MindSpore: ``mindspore.mint.distributed``), replaced in
  every namespace the adapter lists. Code that imported a function by name before ``start()``
  keeps the original: start the monitor early.
* communication primitive classes (MindSpore's ``ops.AllReduce`` and friends, which
  ``nn.DistributedGradReducer`` calls): their ``__call__`` is wrapped at class level, so
  instances created before ``start()`` are seen too. Inputs are the call's tensors, outputs the
  tensors it returns.

The wrappers are shared (:class:`CollectivePatch`): one per function and primitive, whatever the
number of running monitors. The first ``cc`` probe to attach installs them, every call is handed
to each attached probe, and the last probe to detach restores the originals, in whatever order
the monitors stop.

``cc_log_only`` prints each distinct call site once per rank (op, dtypes, shapes, group, then
the stack, one indented ``<path>[<line>] in <function>: <source>`` line per frame, innermost
last) and keeps them in the JSON file the front door names (``log_path``); it records no
statistics and does not interrupt training.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, ModuleType
from typing import TYPE_CHECKING, Any, Protocol

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.patching import AttrPatch
from trainprobe.engine.probes.base import Probe, ProbeSpec, StepClock
from trainprobe.engine.records import RowKey
from trainprobe.engine.sinks.files import write_json_atomically

if TYPE_CHECKING:
    from trainprobe.engine.backend import Backend

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

Wrap = Callable[[Callable[..., Any]], Callable[..., Any]]
"""Makes the replacement of an attribute from the original it replaces."""

_STACK_LIMIT = 12  # frames kept by cc_log_only (console and cc_log.json)


class CollectiveApi(Protocol):
    """A framework's collectives, as the ``cc`` probe needs them (one per adapter)."""

    @property
    def tensor_type(self) -> type | tuple[type, ...]:
        """The framework's tensor class(es)."""
        ...

    def namespaces(self) -> tuple[ModuleType, ...]:
        """Modules exposing the :data:`FUNCTIONS`; the first defines them (originals are read there)."""
        ...

    def primitives(self) -> Mapping[type, str]:
        """Communication primitive classes whose instances are called, and the op name of each
        (for rows and logs); empty where the framework has none."""
        ...

    def patches(self) -> Sequence[tuple[Any, str, Wrap]]:
        """Further attributes replaced while any ``cc`` probe is attached, as ``(owner, name,
        wrap)``: ``owner.name`` becomes ``wrap(original)`` and is restored exactly with the
        collectives (PyTorch: ``Work.wait``, to see when the loop waits for a work without a
        future); empty where the adapter needs none."""
        ...

    def defer(self, result: Any, record: Callable[[], None]) -> Any:
        """None when a call's outputs are ready now (``record`` is then called by the probe); else
        a pending item for :meth:`settle` at the end of the step (an asynchronous call:
        ``result`` is its work handle). ``record`` runs once, as soon as the adapter knows the
        work completed."""
        ...

    def settle(self, pending: Any) -> bool:
        """At the end of the step: make sure a deferred call's ``record`` ran and return True, or
        return False for a call that cannot complete without a wait the loop itself may still
        make (PyTorch: a gloo point-to-point work nobody waited for; it is recorded when the loop
        waits, in a later step, and never if the loop never waits)."""
        ...

    def describe_group(self, group: Any) -> Any:
        """A JSON-able description of a communication group (``"world"`` for the default)."""
        ...

    def on_next_forward(self, callback: Callable[[], None]) -> Any:
        """Call ``callback`` once, before the next model forward in this process, and return a
        handle with ``remove()``; None where the framework cannot tell (a collective issued after
        ``optimizer.step()`` then counts in the next step)."""
        ...

    def watch_ddp(self, model: Any, probe: CollectiveProbe) -> Any:
        """Record ``model``'s (a data-parallel wrapper's) gradient buckets as ``probe``'s calls
        (``probe.bucket_call`` / ``probe.bucket_done``) until the returned handle is removed; None
        when ``model`` is not such a wrapper. Raises ConfigError when it cannot be done."""
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


def codeline_matches(full_site: str, line: str) -> bool:
    """Whether the ``cc_codeline`` entry ``line`` selects the call site ``full_site``
    (``"<path>[<line>]"``): it is the whole site, or a suffix of it that starts a path component
    (preceded by ``/`` or ``\\``, or itself starting with one). ``"train.py[3]"`` selects
    ``/src/train.py[3]``, not ``/src/pretrain.py[3]`` nor ``/src/train.py[33]``."""
    if not line or not full_site.endswith(line):
        return False
    if len(full_site) == len(line) or line[0] in "/\\":
        return True
    return full_site[-len(line) - 1] in "/\\"


def _arguments_of_function(
    api: CollectiveApi, op: str, original: Callable[..., Any]
) -> Callable[[tuple[Any, ...], dict[str, Any]], tuple[list[Any], list[Any], Any]]:
    signature = inspect.signature(original)
    inputs_names, outputs_names = FUNCTIONS[op]

    def arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], list[Any], Any]:
        bound = signature.bind_partial(*args, **kwargs).arguments
        return _tensors(api, bound, inputs_names), _tensors(api, bound, outputs_names), bound.get("group")

    return arguments


def _arguments_of_primitive(
    api: CollectiveApi,
) -> Callable[[tuple[Any, ...], dict[str, Any]], tuple[list[Any], list[Any], Any]]:
    def arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], list[Any], Any]:
        inputs = [t for value in (*args[1:], *kwargs.values()) for t in tensors_of(api, value)]
        return inputs, [], getattr(args[0], "group", None)

    return arguments


class CallArguments:
    """One call's ``(inputs, outputs, group)``, read from its arguments once, when a listener
    first asks (a call no listener records costs no binding)."""

    __slots__ = ("_read", "_args", "_kwargs", "_value")

    def __init__(
        self,
        read: Callable[[tuple[Any, ...], dict[str, Any]], tuple[list[Any], list[Any], Any]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        self._read = read
        self._args = args
        self._kwargs = kwargs
        self._value: tuple[list[Any], list[Any], Any] | None = None

    def get(self) -> tuple[list[Any], list[Any], Any]:
        """``(input tensors, output tensors, group)``; raises what binding the arguments raises."""
        if self._value is None:
            self._value = self._read(self._args, self._kwargs)
        return self._value


class CollectivePatch:
    """The wrappers of one framework's collectives, shared by every ``cc`` probe listening to them
    (use :func:`listen`).

    Installed when the first listener arrives: each function of :data:`FUNCTIONS` the first
    namespace defines is replaced, in every namespace holding that same object, by one
    dispatching wrapper; each primitive class's ``__call__`` and each of the adapter's
    :meth:`~CollectiveApi.patches` likewise. A call is handed to every listener (in the order they
    arrived), the original runs once, then each listener sees the result. A collective called by
    another collective (``all_gather_into_tensor`` -> ``all_gather_single``) runs unobserved: the
    outer call is the one recorded. Removed when the last listener leaves: every replaced
    attribute gets back the exact object it held (a class attribute it did not hold is deleted).
    """

    def __init__(self, api: CollectiveApi) -> None:
        self.api = api
        self.listeners: tuple[CollectiveProbe, ...] = ()
        self._patch = AttrPatch()
        self._nesting = threading.local()

    def install(self) -> None:
        """Replace the collectives by the dispatching wrappers (all or, on an error, none)."""
        try:
            self._install()
        except BaseException:
            self.remove()
            raise

    def _install(self) -> None:
        api = self.api
        namespaces = api.namespaces()
        for op in FUNCTIONS:
            original = getattr(namespaces[0], op, None)
            if original is None:
                continue
            wrapper = self._function(op, original)
            for namespace in namespaces:
                if getattr(namespace, op, None) is original:
                    self._patch.replace(namespace, op, wrapper)
        for cls, op in api.primitives().items():
            self._patch.replace(cls, "__call__", self._primitive(op, cls.__call__))
        for owner, name, wrap in api.patches():
            self._patch.replace(owner, name, wrap(getattr(owner, name)))

    def remove(self) -> None:
        """Put back exactly what the collectives' attributes held before :meth:`install`."""
        self._patch.restore()

    @contextlib.contextmanager
    def unobserved(self) -> Iterator[None]:
        """Within the block, this thread's collectives run unobserved (a call recorded another
        way, such as a DDP bucket, whose implementation calls ``all_reduce``)."""
        depth = getattr(self._nesting, "depth", 0)
        self._nesting.depth = depth + 1
        try:
            yield
        finally:
            self._nesting.depth = depth

    # -- wrappers ------------------------------------------------------------------------
    def _function(self, op: str, original: Callable[..., Any]) -> Callable[..., Any]:
        collective = self._dispatcher(op, original, _arguments_of_function(self.api, op, original), False)
        functools.update_wrapper(collective, original)  # name, doc, __wrapped__
        return collective

    def _primitive(self, op: str, original: Callable[..., Any]) -> Callable[..., Any]:
        return self._dispatcher(op, original, _arguments_of_primitive(self.api), True)

    def _dispatcher(
        self,
        op: str,
        original: Callable[..., Any],
        read: Callable[[tuple[Any, ...], dict[str, Any]], tuple[list[Any], list[Any], Any]],
        outputs_returned: bool,
    ) -> Callable[..., Any]:
        nesting = self._nesting

        def collective(*args: Any, **kwargs: Any) -> Any:
            listeners = self.listeners
            depth: int = getattr(nesting, "depth", 0)
            if not listeners or depth:
                return original(*args, **kwargs)
            frame = sys._getframe(1)
            arguments = CallArguments(read, args, kwargs)
            calls = [(probe, probe.before_call(op, arguments, outputs_returned, frame)) for probe in listeners]
            del frame
            nesting.depth = 1
            try:
                result = original(*args, **kwargs)
            finally:
                nesting.depth = 0
            for probe, call in calls:
                if call is not None:
                    probe.after_call(call, result, outputs_returned)
            return result

        return collective


_PATCHES: dict[type, CollectivePatch] = {}
_PATCHES_LOCK = threading.Lock()


class Listening:
    """A probe's subscription to a :class:`CollectivePatch`; :meth:`remove` ends it (idempotent)
    and restores the collectives when it was the last one."""

    def __init__(self, patch: CollectivePatch, probe: CollectiveProbe) -> None:
        self._patch: CollectivePatch | None = patch
        self._probe = probe

    def unobserved(self) -> contextlib.AbstractContextManager[None]:
        """See :meth:`CollectivePatch.unobserved` (a no-op once removed)."""
        patch = self._patch
        return patch.unobserved() if patch is not None else contextlib.nullcontext()

    def remove(self) -> None:
        with _PATCHES_LOCK:
            patch, self._patch = self._patch, None
            if patch is None:
                return
            patch.listeners = tuple(p for p in patch.listeners if p is not self._probe)
            if not patch.listeners:
                if _PATCHES.get(type(patch.api)) is patch:
                    del _PATCHES[type(patch.api)]
                patch.remove()


def listen(api: CollectiveApi, probe: CollectiveProbe) -> Listening:
    """Hand ``api``'s collective calls to ``probe`` until the returned handle is removed.

    There is one :class:`CollectivePatch` per adapter type, installed by the first listener and
    removed with the last, so monitors may start and stop in any order and ``torch.distributed``
    (or ``mindspore``) ends exactly as it was once none listens."""
    with _PATCHES_LOCK:
        patch = _PATCHES.get(type(api))
        if patch is None:
            patch = CollectivePatch(api)
            patch.install()
            _PATCHES[type(api)] = patch
        patch.listeners = (*patch.listeners, probe)
    return Listening(patch, probe)


@dataclass(slots=True)
class _Call:
    op: str
    index: int
    tag_site: str
    outputs: list[Any]


@dataclass(frozen=True, slots=True)
class CcSpec(ProbeSpec):
    """The collective probe's settings: statistics, the call sites selected (``cc_codeline``;
    empty: every call), whether only the call sites are logged (``cc_log_only``), whether
    inputs are read before the call (``cc_pre_hook``) and whether DDP's gradient buckets are
    followed (``ddp_comm_hook``)."""

    cc_codeline: tuple[str, ...] = ()
    cc_log_only: bool = False
    cc_pre_hook: bool = False
    ddp_comm_hook: bool = False


class CollectiveProbe(Probe):
    """Statistics (or a call-site log) of a framework's collectives."""

    name = "cc"

    def __init__(
        self,
        clock: StepClock,
        spec: CcSpec,
        rank: int,
        log_path: Path,
        *,
        backend: Backend,
        models: Sequence[Any] = (),
        field: str = "output_dir",
    ) -> None:
        """``log_path``: where ``cc_log_only`` keeps the call sites (its folder made with
        :func:`~trainprobe.engine.folders.make_output_folder`, whose ConfigError names ``field``:
        a fault of this monitor); ``models``: the model chunks whose DistributedDataParallel
        buckets ``ddp_comm_hook`` follows."""
        super().__init__(clock, spec, backend=backend)
        api = self.backend.collective_api()
        assert api is not None, "the trainer refuses cc for a backend without collectives"
        self.api: CollectiveApi = api
        self.spec: CcSpec = spec
        self.rank = rank
        self.log_path = log_path
        self.field = field
        self.log_error: str | None = None
        """Why ``log_path`` could not be written (``cc_log_only``), or None: the run's end says so."""
        self._counts: dict[str, int] = {}
        self._pending: list[Any] = []
        self._sites: dict[tuple[str, str], dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._tail: bool | None = None  # open tail: whether the step that ended was collected
        self._listening: Listening | None = None
        self.records_after_step = not spec.cc_log_only
        self.models = list(models)
        self.before_call = self.guard(self._before)
        self.after_call = self.guard(self._after)
        self.bucket_call = self.guard(self._bucket_call)
        self.bucket_done = self.guard(self._bucket_done)

    def attach(self) -> None:
        """Listen to the collectives; with ``ddp_comm_hook``, also to the buckets of each
        DistributedDataParallel in :attr:`models` (raises ConfigError when there is none, or
        when DDP refuses the hook)."""
        self._listening = listen(self.api, self)
        self.keep(self._listening)
        if not self.spec.ddp_comm_hook or self.spec.cc_log_only:
            return
        handles = [h for h in (self.api.watch_ddp(m, self) for m in self.models) if h is not None]
        if not handles:
            from trainprobe.engine.errors import ConfigError

            raise ConfigError(
                "monitors.cc.ddp_comm_hook: needs the DistributedDataParallel model; call "
                'start(model=ddp_model) or set "ddp_comm_hook": false'
            )
        for handle in handles:
            self.keep(handle)

    def unobserved(self) -> contextlib.AbstractContextManager[None]:
        """A block whose collectives this probe's patch does not see (the DDP hook's allreduce)."""
        listening = self._listening
        return listening.unobserved() if listening is not None else contextlib.nullcontext()

    # -- trailing calls (see trainprobe.engine.session) -----------------------------------------
    def _collecting(self) -> bool:
        return self.clock.collecting if self._tail is None else self._tail

    def open_tail(self, collecting: bool) -> None:
        self._tail = collecting

    def close_tail(self) -> None:
        self._tail = None

    def watch_next_step(self, callback: Callable[[], None]) -> Any:
        return self.api.on_next_forward(callback)

    def detach(self) -> None:
        """Stop listening (the last ``cc`` probe to detach restores the collectives) and forget
        the asynchronous calls still pending."""
        super().detach()
        self._pending = []
        self._listening = None

    def _before(self, op: str, arguments: CallArguments, outputs_returned: bool, frame: FrameType) -> _Call | None:
        """Called before the original collective runs; the returned call, if any, is handed to
        :meth:`_after` with the result."""
        full_site, short_site = call_site(frame)
        if not self.spec.cc_log_only and (not self._collecting() or not self._selected(full_site)):
            return None
        try:
            inputs, outputs, group = arguments.get()
        except TypeError:  # the caller's own arguments do not fit: the collective raises it to them
            return None
        if self.spec.cc_log_only:
            self._log_site(op, full_site, inputs + outputs, group, frame)
            return None
        index = self._counts.get(op, 0)
        self._counts[op] = index + 1
        tag_site = f"@{short_site}"
        has_outputs = outputs_returned or bool(FUNCTIONS[op][1])
        if self.spec.cc_pre_hook or not has_outputs:
            self._record(op, index, "in", inputs, tag_site)
        return _Call(op, index, tag_site, outputs) if has_outputs else None

    def _selected(self, full_site: str) -> bool:
        """Whether ``cc_codeline`` keeps a call made at ``full_site`` (see :func:`codeline_matches`)."""
        lines = self.spec.cc_codeline
        return not lines or any(codeline_matches(full_site, line) for line in lines)

    def _after(self, call: _Call, result: Any, outputs_returned: bool) -> None:
        if outputs_returned:
            call.outputs = tensors_of(self.api, result)
            result = None
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

    # -- DDP buckets (ddp_comm_hook) -----------------------------------------------------
    def _bucket_call(self, index: int, tensor: Any) -> _Call | None:
        """Bucket ``index`` of a DDP is about to be all-reduced (``tensor``: this rank's
        gradients, before averaging); the returned call goes to :meth:`_bucket_done`."""
        if self.disabled or not self._collecting():
            return None
        call_index = self._counts.get("all_reduce", 0)
        self._counts["all_reduce"] = call_index + 1
        tag_site = f"@ddp.bucket_{index}"
        if self.spec.cc_pre_hook:
            self._record("all_reduce", call_index, "in", [tensor], tag_site)
        return _Call("all_reduce", call_index, tag_site, [])

    def _bucket_done(self, call: _Call | None, tensor: Any) -> None:
        """The bucket's all-reduce completed: ``tensor`` holds the averaged gradients."""
        if call is not None:
            self._record(call.op, call.index, "out", [tensor], call.tag_site)

    def has_work(self) -> bool:
        return len(self.rows) > 0 or bool(self._pending)

    def end_step(self) -> None:
        self._pending = [item for item in self._pending if not self.api.settle(item)]
        self._counts.clear()

    # -- cc_log_only ---------------------------------------------------------------------
    def _log_site(self, op: str, full_site: str, tensors: list[Any], group: Any, frame: FrameType) -> None:
        key = (op, full_site)
        if key in self._sites:
            return
        stack = traceback.extract_stack(frame, limit=_STACK_LIMIT)
        entry = {
            "op": op,
            "codeline": full_site,
            "dtypes": sorted({str(t.dtype) for t in tensors}),
            "shapes": [list(t.shape) for t in tensors],
            "group": self.api.describe_group(group),
            "stack": [line.rstrip() for line in stack.format()],
        }
        with self._lock:
            self._sites[key] = entry
            snapshot = list(self._sites.values())
        lines = [
            f"[trainprobe cc rank {self.rank}] {op} at {full_site} dtypes={entry['dtypes']} "
            f"shapes={entry['shapes']} group={entry['group']}"
        ]
        for fs in stack:  # outermost first: the call site is the last line
            source = (fs.line or "").strip()
            lines.append(f"    {fs.filename}[{fs.lineno}] in {fs.name}" + (f": {source}" if source else ""))
        print("\n".join(lines), flush=True)
        try:
            write_json_atomically(self.log_path, snapshot, field=self.field)
        except (OSError, ConfigError) as exc:
            self.log_error = str(exc)  # the run's end says so (V1 exits 1); the guard logs it once, disables us
            raise
