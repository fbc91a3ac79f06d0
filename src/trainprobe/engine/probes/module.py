"""``module`` monitor: statistics of module inputs/outputs and of their gradients.

Rows (``module_<a>-<b>.csv``): ``module_name`` is ``<module>.<input|output>.<i>`` with scope
``forward`` and ``<module>.<grad_input|grad_output>.<i>`` with scope ``backward``; ``i`` counts
the tensors of the call (positional arguments, then keyword arguments, nested tuples/lists
flattened). The root module's name is empty (``.input.0``; ``0:.input.0`` in a chunk list).
``micro_step`` is the index of the forward pass of the model chunk within the step (a column of
the Monitor V2 table only when micro-batches are configured).

The tensors handed to a :class:`ModuleNaming` may hold ``None`` holes: a tuple or list output of
several entries gives one slot per entry (:func:`output_slots`), ``None`` for an entry without a
tensor, so that a dialect numbering by position (Monitor V1's ``output_0`` of ``(out, None)``)
can; Monitor V2 numbers the tensors only, as the reference does.

Gradients are read with tensor hooks (``Tensor.register_hook``), never with module full backward
hooks, so the autograd graph is left exactly as it was and training stays bitwise identical.
``grad_output.i`` is the gradient of output ``i``; ``grad_input.i`` is the gradient of input ``i``
as autograd accumulates it for that tensor (it includes other uses of the same tensor, such as
a residual connection). Modules in eval mode are skipped unless ``record_eval_mode`` is true.

A tensor gets at most one gradient hook per step, however many recorded calls see it (a module's
output that is the next module's input, a learned latent ``nn.Parameter`` passed to a submodule
every forward, a receive buffer a pipeline refills every micro-batch): the hook carries the row
names of every call that saw the tensor and writes one row per name each time the gradient
arrives, from one statistics pass. The hooks are removed at the end of every step (and by
``stop()``, and when the monitor is disabled after a fault), never kept for a later step: a
tensor that lives across steps is hooked afresh by the next step's first forward, so every step
writes the rows a freshly started monitor would write for it, a step that is not collected
carries no hook, and nothing of the monitor outlives the step on the user's tensors. With
several forward passes per step (micro-batches, pipeline schedules), each arrival of the
gradient of a tensor that all of them see goes to the oldest forward not yet given one
(backward passes run in forward order); an arrival with none left (a second backward through
a retained graph) repeats the last one's rows.

A module's ``input`` rows are read by a forward pre-hook placed before the module's own
pre-hooks (a chunk's root: after the hooks it already had, those of the front door's step
clock), so they are the call's arguments as the caller passes them, before a tensor-parallel
style or FSDP converts them: the gradient of such an input is the one the style's backward has
already reduced. ``output`` rows are read after the module's forward hooks: what the caller gets.
A tensor that is a partial sum (:meth:`ModelView.is_partial`: a DTensor with a ``Partial``
placement) has no row, forward or gradient; one warning per module names those left out, at the
end of the step that found them.

Model chunks are named by :class:`ModelView` (``vpp_stage``: the chunk's list index, or a
pipeline stage's global index). Each chunk's forward pre-hook asks the view how the chunk runs
(:meth:`ModelView.chunk_call`): a pipeline's metadata-inference pass is not recorded at all (no
row, no gradient hook, no micro step), and under a pipeline schedule ``micro_step`` is the
schedule's micro-batch index. A forward that recomputes activations during the backward pass
(:meth:`ModelView.recomputing`: activation checkpointing) writes no forward row (the forward it
repeats wrote them) and is not counted as a forward pass; its tensors still get their gradient
hooks, since a reentrant checkpoint's backward runs through the recomputed tensors (a
non-reentrant one's never reaches them), tagged with the micro step of the latest gradient row
of that chunk in the step (the backward running), else of its latest forward.

A tensor without values (``device="meta"``: a shape and a dtype, as shape-only code and deferred
initialisation pass around) has no row and no gradient row, as in every monitor (the statistics
kernel gives None for it and the row buffer keeps nothing, see
:meth:`~trainprobe.engine.records.RowBuffer.add`); the call's other tensors keep their rows and
indices, and the monitor goes on (one INFO line says so). No row rather than a row of NaN: NaN in
a statistic means the tensor holds NaN values, which the alerts and anomaly-analyse would report
as a numerical fault; a meta tensor holds no values at all.

``torch.compile``: hooks on the modules a compiled graph calls would be traced into that graph
(changing what the compiler builds, and so the training's last bits) or break it. They are not
registered; the monitor warns once naming those modules, and the compiled module's boundary
(the ``OptimizedModule``, named like the module it compiles) is recorded as usual. A hook that
finds itself traced anyway (the model passed to ``start()`` is called through a compiled
wrapper it does not know about, ``mon.start(model)`` then ``torch.compile(model)``) does
nothing, reads and changes no state of the monitor (dynamo would guard on it and recompile on
every call), and the monitor warns once, when the graph is traced.
"""

from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from trainprobe.engine.log import logger, warn_once
from trainprobe.engine.probes.base import Probe, ProbeSpec, StepClock
from trainprobe.engine.probes.model_view import ModelView
from trainprobe.engine.records import RowKey
from trainprobe.engine.tensor_walk import call_tensors, tensors_in

if TYPE_CHECKING:
    from trainprobe.engine.backend import Backend

_SHOWN_NAMES = 8
"""How many module names a warning lists before it gives a count."""

_MAX_KEYS = 1 << 16
"""Row keys remembered by a module probe before it starts over (names that change every call)."""

Picked = list[tuple[str, Any]]
"""``(row name, tensor)`` pairs chosen from a call's tensors."""


def output_slots(output: Any, tensor_type: Any) -> list[Any]:
    """The tensors of a module's ``output``: for a tuple or list of two or more entries, one slot
    per entry (its tensor, ``None`` where it holds none; an entry nesting several tensors gives
    them all, in order); otherwise every tensor in it, nested ones flattened."""
    if isinstance(output, (list, tuple)) and len(output) > 1:
        slots: list[Any] = []
        for item in output:
            found = list(tensors_in(item, 1, tensor_type))
            slots.extend(found if found else [None])
        return slots
    return list(tensors_in(output, 0, tensor_type))


class ModuleNaming(Protocol):
    """Which modules are hooked and how their tensors are chosen and named (one per dialect)."""

    @property
    def forward_scope(self) -> str:
        """Scope of the forward rows."""
        ...

    @property
    def backward_scope(self) -> str:
        """Scope of the backward rows."""
        ...

    def wants(self, vpp_stage: int, name: str, module: Any) -> bool:
        """Whether module ``name`` is hooked."""
        ...

    def forward(self, name: str, kind: str, tensors: list[Any]) -> Picked:
        """Forward rows of ``kind`` (``input``/``output``) of module ``name``; ``tensors`` may
        hold ``None`` holes (entries of a tuple output without a tensor), never picked."""
        ...

    def backward(self, name: str, kind: str, tensors: list[Any]) -> Picked:
        """Tensors whose gradient is recorded, with the gradient rows' names."""
        ...


@dataclass(frozen=True, slots=True)
class V2Naming:
    """Monitor V2: modules whose name contains a target; ``<module>.<kind>.<i>`` forward rows and
    ``<module>.grad_<kind>.<i>`` backward rows for every tensor of the call."""

    targets: tuple[str, ...]
    forward_scope: str = "forward"
    backward_scope: str = "backward"

    def wants(self, vpp_stage: int, name: str, module: Any) -> bool:
        return not self.targets or any(t in name for t in self.targets)

    def forward(self, name: str, kind: str, tensors: list[Any]) -> Picked:
        found = [t for t in tensors if t is not None]
        return [(f"{name}.{kind}.{i}", t) for i, t in enumerate(found)]

    def backward(self, name: str, kind: str, tensors: list[Any]) -> Picked:
        found = [t for t in tensors if t is not None]
        return [(f"{name}.grad_{kind}.{i}", t) for i, t in enumerate(found)]


@dataclass(frozen=True, slots=True)
class ModuleSpec(ProbeSpec):
    """The module probe's settings: statistics, the default naming's ``targets`` (module names;
    empty: every module) and whether forwards in eval mode are recorded too."""

    targets: tuple[str, ...] = ()
    record_eval_mode: bool = False


@dataclass(slots=True, eq=False)
class GradWatch:
    """The one gradient hook a :class:`ModuleProbe` holds on one tensor during one step.

    ``ref`` is a weak reference to the tensor (None where the framework's tensors take none:
    then every call gets a hook of its own, as without this record), so the record never keeps
    a tensor alive. ``pending`` holds, per forward pass that saw the tensor and whose gradient
    has not arrived yet, the row keys of its calls (in call order, each key once); ``tag`` is the
    ``(model chunk, forward pass)`` of the newest such group; ``last`` is the group the latest
    arrival used."""

    ref: Any
    tag: tuple[int, int] | None = None
    pending: deque[list[RowKey]] = field(default_factory=deque)
    last: list[RowKey] = field(default_factory=list)

    def holds(self, t: Any) -> bool:
        """Whether this record is the one of the live tensor ``t`` (not of a dead tensor whose
        ``id`` ``t`` took over)."""
        return self.ref is not None and self.ref() is t

    def add(self, tag: tuple[int, int], key: RowKey) -> None:
        """One more recorded call of forward pass ``tag`` saw the tensor, as row ``key``."""
        if self.pending and self.tag == tag:
            group = self.pending[-1]
            if key not in group:
                group.append(key)
            return
        self.pending.append([key])
        self.tag = tag

    def take(self) -> list[RowKey]:
        """The row keys of the gradient arriving now: the oldest forward pass's group not yet
        given a gradient, else (none left) the group the latest arrival used."""
        if self.pending:
            self.last = self.pending.popleft()
            if not self.pending:
                self.tag = None
        return self.last


def _weak(t: Any) -> Any:
    """A weak reference to ``t``, or None where its type takes none."""
    try:
        return weakref.ref(t)
    except TypeError:
        return None


class ModuleProbe(Probe):
    """Forward/backward statistics of the target modules.

    ``naming`` (default :class:`V2Naming` over ``spec.targets``) picks the modules, the tensors
    and the row names and scopes. ``backend`` is the framework adapter (PyTorch by default):
    modules need PyTorch's ``register_forward_pre_hook(hook, prepend=, with_kwargs=)`` and
    ``register_forward_hook(hook, with_kwargs=)``, which MindSpore's ``Cell`` has too; gradient
    hooks (one per tensor per step, :class:`GradWatch`) are removed at the end of every step, by
    :meth:`detach` (``stop()``) and when the probe is disabled after a fault (the session detaches
    it at the step's end), where the backend returns a handle for them.
    """

    name = "module"
    with_micro_step = True
    """Rows carry the forward pass's index; Monitor V2 writes the column only when micro-batches
    are configured (``trainer._with_micro_step``), as the reference's header has none."""

    def __init__(
        self,
        clock: StepClock,
        spec: ModuleSpec,
        view: ModelView,
        naming: ModuleNaming | None = None,
        *,
        backend: Backend,
    ) -> None:
        super().__init__(clock, spec, backend=backend)
        self.spec: ModuleSpec = spec
        self.view = view
        self.naming: ModuleNaming = naming if naming is not None else V2Naming(spec.targets)
        self._micro = dict.fromkeys(view.stages, 0)
        """Per ``vpp_stage``, the training forwards of the chunk this step (the last one's index + 1)."""
        self._backward_micro: dict[int, int] = {}
        """Per ``vpp_stage``, the micro step of the latest gradient row this step."""
        self._skipping: set[int] = set()
        """The ``vpp_stage`` of chunks running a metadata-inference pass now (not recorded)."""
        self._partial_warned: set[str] = set()
        self._partial_seen: list[str] = []
        self._tensor_type = self.backend.tensor_type
        self._step_handles: list[Any] = []
        self._watched: dict[int, GradWatch] = {}
        self._keys: dict[tuple[int, str, str, int], RowKey] = {}
        self._module_of: dict[RowKey, str] = {}

    def targets(self) -> list[tuple[int, str, Any]]:
        """The hooked modules, in model order (modules inside a compiled graph are left out)."""
        wanted = [(v, n, m) for v, n, m in self.view.modules() if self.naming.wants(v, n, m)]
        compiled = self.view.compiled()
        if not compiled:
            return wanted
        _warn_compiled([n for _, n, m in wanted if id(m) in compiled])
        return [(v, n, m) for v, n, m in wanted if id(m) not in compiled]

    def attach(self) -> None:
        compiled = self.view.compiled()
        roots = {id(chunk) for chunk in self.view.chunks}
        for vpp, name, module in self.targets():
            # a module's inputs as its caller passes them: before its own pre-hooks (a tensor
            # parallel style's, FSDP's) convert them; a chunk's root after the hooks already there
            pre = self._eager(self._pre_hook(vpp, name))
            self.keep(module.register_forward_pre_hook(pre, with_kwargs=True, prepend=id(module) not in roots))
            self.keep(module.register_forward_hook(self._eager(self._post_hook(vpp, name)), with_kwargs=True))
        for vpp, chunk in self.view.staged_chunks():
            if id(chunk) in compiled:
                continue  # compiled in place: its hooks would run inside the graph
            self.keep(chunk.register_forward_pre_hook(self._eager(self._counter(vpp)), prepend=True))
            self.keep(chunk.register_forward_hook(self._eager(self._chunk_done(vpp))))

    def _eager(self, hook: Any) -> Any:
        """``hook`` doing nothing while ``torch.compile`` traces it (:meth:`Probe.eager`); the
        trace warns once that those modules have no rows."""
        return self.eager(hook, _warn_traced)

    def end_step(self) -> None:
        self._micro = dict.fromkeys(self._micro, 0)
        self._backward_micro = {}
        self._drop_step_handles()
        if self._partial_seen:
            _warn_partial(self._partial_seen)
            self._partial_seen = []

    def detach(self) -> None:
        super().detach()
        self._drop_step_handles()

    def _drop_step_handles(self) -> None:
        """Remove this step's gradient hooks and forget which tensors hold one."""
        handles, self._step_handles = self._step_handles, []
        self._watched = {}
        for handle in handles:
            handle.remove()

    def hooked_tensors(self) -> int:
        """How many tensors hold one of this probe's gradient hooks now (this step's)."""
        return sum(1 for w in self._watched.values() if w.ref is not None and w.ref() is not None)

    def _records(self, module: Any) -> bool:
        return self.active and self.backend.records_forward(module, self.spec.record_eval_mode)

    def _counter(self, vpp: int) -> Any:
        """The chunk's forward pre-hook: counts its training forwards (the schedule's
        micro-batch index under a pipeline schedule); a metadata-inference pass and a
        recomputation are not counted, and the first is not recorded at all."""

        def count(module: Any, args: tuple[Any, ...]) -> None:
            if not self._records(module) or self.view.recomputing():
                return
            call = self.view.chunk_call()
            if not call.record:
                self._skipping.add(vpp)
                return
            self._skipping.discard(vpp)
            if call.stage is not None and not self.view.pipelined:
                _warn_unstaged(vpp, call.stage)
            self._micro[vpp] = call.micro_batch + 1 if call.micro_batch is not None else self._micro[vpp] + 1

        return count

    def _chunk_done(self, vpp: int) -> Any:
        """The chunk's forward hook: its metadata-inference pass (if it was one) is over."""

        def done(module: Any, args: tuple[Any, ...], output: Any) -> None:
            self._skipping.discard(vpp)

        return done

    def _pre_hook(self, vpp: int, name: str) -> Any:
        def pre(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self._records(module) and vpp not in self._skipping:
                self._record(vpp, name, "input", call_tensors(args, kwargs, self._tensor_type))
            return None

        return pre

    def _post_hook(self, vpp: int, name: str) -> Any:
        def post(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if self._records(module) and vpp not in self._skipping:
                self._record(vpp, name, "output", output_slots(output, self._tensor_type))
            return None

        return post

    def _record(self, vpp: int, name: str, kind: str, tensors: list[Any]) -> None:
        """Rows of one call's ``tensors`` and gradient hooks on them. In a recomputation
        (activation checkpointing) the forward rows were written by the forward it repeats:
        only the gradient hooks are added (a reentrant checkpoint's backward runs through the
        recomputed tensors), tagged with the micro step of the backward running."""
        recompute = self.view.recomputing()
        forward_micro = max(self._micro.get(vpp, 0) - 1, 0)
        micro = self._backward_micro.get(vpp, forward_micro) if recompute else forward_micro
        if not recompute:
            self._forward_rows(vpp, name, kind, tensors, micro)
        if self.backend.grad_recording():
            self._watch_grads(vpp, name, kind, tensors, micro)

    def _forward_rows(self, vpp: int, name: str, kind: str, tensors: list[Any], micro: int) -> None:
        """The forward rows of one call (a partial sum left out, see :meth:`_partial`)."""
        picked = self.naming.forward(name, kind, tensors)
        if not picked:
            return
        is_partial = self.view.is_partial
        if any(is_partial(t) for _, t in picked):
            picked = [(row, t) for row, t in picked if not is_partial(t) or self._partial(name)]
        scope = self.naming.forward_scope
        key_of = self._key
        keys = [key_of(vpp, row, scope, micro, name) for row, _ in picked]
        self.rows.extend(keys, self.stats.rows([t for _, t in picked]))

    def _watch_grads(self, vpp: int, name: str, kind: str, tensors: list[Any], micro: int) -> None:
        """One gradient hook per tensor of the call that needs one this step (:class:`GradWatch`)."""
        backend = self.backend
        scope = self.naming.backward_scope
        tag = (vpp, micro)
        watched = self._watched
        for row, t in self.naming.backward(name, kind, tensors):
            if not backend.wants_grad(t):
                continue
            watch = watched.get(id(t))
            if watch is None or not watch.holds(t):
                watch = GradWatch(_weak(t))
                handle = backend.hook_grad(t, self._grad_hook(watch))
                if handle is not None:
                    self._step_handles.append(handle)
                if watch.ref is not None:
                    watched[id(t)] = watch
            watch.add(tag, self._key(vpp, row, scope, micro, name))

    def _partial(self, module: str) -> bool:
        """Note that a row of ``module`` would hold a partial sum and is left out (False): the
        step's end warns once naming the module."""
        if module not in self._partial_warned:
            self._partial_warned.add(module)
            self._partial_seen.append(module)
        return False

    def _key(self, vpp: int, row: str, scope: str, micro: int, module: str) -> RowKey:
        """The row key (made once, reused every step: the writer recognises a step's keys) of a
        row of ``module``."""
        found = self._keys.get((vpp, row, scope, micro))
        if found is None:
            if len(self._keys) >= _MAX_KEYS:
                self._keys.clear()
                self._module_of.clear()
            found = self._keys[(vpp, row, scope, micro)] = RowKey(vpp, row, scope, micro)
            self._module_of[found] = module
        return found

    def _grad_hook(self, watch: GradWatch) -> Any:
        """The gradient hook of one tensor: one statistics pass per arrival, one row per key
        :meth:`GradWatch.take` gives (guarded like :meth:`Probe.guard`, without its per-call
        wrapper: one is made per tensor and step)."""

        def on_grad(grad: Any) -> None:
            if not self.disabled and grad is not None:
                try:
                    keys = watch.take()
                    if not keys:
                        return
                    self._backward_micro[keys[0].vpp_stage] = keys[0].micro_step or 0
                    if self.view.is_partial(grad):
                        self._partial(self._module_of.get(keys[0], keys[0].name))
                        return
                    row = self.stats.row(grad)
                    if len(keys) == 1:
                        self.rows.add(keys[0], row)
                    else:
                        self.rows.extend(keys, [_shared(row) for _ in keys])
                except Exception as exc:  # noqa: BLE001 - a monitor must never break training
                    self.fail(exc)

        return on_grad


def _shared(row: Any) -> Any:
    """``row`` for one more key: host rows (lists) copied, device rows (tensors) shared."""
    return list(row) if isinstance(row, list) else row


def _warn_partial(modules: list[str]) -> None:
    """Warn (once per module) that ``modules`` had rows holding partial sums, left out."""
    shown = ", ".join(map(_shown_name, modules[:_SHOWN_NAMES]))
    more = f" and {len(modules) - _SHOWN_NAMES} more" if len(modules) > _SHOWN_NAMES else ""
    logger.warning(
        f"trainprobe module: rows of {len(modules)} module(s) are left out ({shown}{more}): the tensor is a "
        "DTensor with a Partial placement (each rank holds a summand, not a piece: a gradient before its "
        "reduction), whose statistics describe no tensor. The module's other rows are written",
    )


def _warn_unstaged(vpp: int, stage: int) -> None:
    """Warn once that a chunk runs as a pipeline stage but is named by its chunk index."""
    warn_once(
        "module-unstaged-pipeline",
        f"trainprobe module: model chunk {vpp} runs as pipeline stage {stage} (torch.distributed.pipelining) "
        "but its rows are named by its chunk index; pass the PipelineStage object(s) to start(model=...) to "
        "name every chunk by its global stage",
    )


def _warn_traced(ctx: object = None) -> None:
    """Warn once that module hooks were traced by ``torch.compile`` (runs at trace time)."""
    warn_once(
        "module-traced-hooks",
        "trainprobe module: the model passed to start() runs inside torch.compile (a compiled "
        "wrapper or function calls it), where its module hooks cannot record; those modules have "
        "no rows. Pass the compiled model (the torch.compile(...) result) to start() to record "
        "its boundary, or train without torch.compile to record every module",
    )


def _shown_name(name: str) -> str:
    """``name`` as a message lists it: the root module's empty name as ``<root>`` (``0:<root>``)."""
    head, sep, tail = name.rpartition(":")
    return name + "<root>" if not tail and (not sep or head.isdigit()) else name


def _warn_compiled(names: list[str]) -> None:
    """Warn once that the modules ``names`` run inside a compiled graph and have no rows."""
    if not names:
        return
    shown = ", ".join(map(_shown_name, names[:_SHOWN_NAMES]))
    more = f" and {len(names) - _SHOWN_NAMES} more" if len(names) > _SHOWN_NAMES else ""
    warn_once(
        "module-compiled",
        f"trainprobe module: {len(names)} module(s) run inside a torch.compile graph and are not "
        f"recorded ({shown}{more}): hooks there would be compiled into the graph and change "
        "training. The compiled module's own inputs and outputs are recorded; compile the blocks "
        "separately (torch.compile on each block) to record each block's boundary",
    )
