"""The backend interface: what the engine needs from a training framework.

What the monitors share (:class:`~trainprobe.engine.schedule.Schedule`, the probes' bookkeeping,
records, sinks, the session; above them the front doors' dialects and alerts, and the tools) is
written once. Everything that touches a
framework's tensors, modules, autograd or optimizers goes through one :class:`Backend`:

* statistics: ``stats(ops, eps)`` returns a :class:`StatsKernel` (tensor → one row of values
  in the order of ``ops``); ``device_copy`` brings a step's device rows to the host;
* module hooks: ``is_compiling`` (hooks stand aside while a graph compiler traces),
  ``tensor_type`` (what :func:`~trainprobe.engine.tensor_walk.tensors_in` looks
  for), ``records_forward`` (training mode), ``grad_recording``/``wants_grad``/``hook_grad``
  (gradient hooks on the tensors of a call);
* models and optimizers: ``model_view`` (names of modules and parameters), ``optimizer_view``
  (the one :class:`~trainprobe.engine.optimizer_view.OptimizerView` of what the user steps: its
  parameters, state, Adam-family moments and step hooks, which the session hooks;
  ``watch_skipped_steps``: a loss scaler's skipped steps),
  ``weight_grad_probe`` (gradients are where the frameworks differ most);
* process: ``rank``, ``distributed``, ``group_rank`` and ``group_ranks`` (a process group's view
  of this rank and its members, for Monitor V1's ``dp_group``/``tp_group``/``process_group``);
* gradients: ``grad_reader`` (where a parameter's gradient is read, Megatron's ``main_grad``);
* collectives: ``collective_api`` (a :class:`~trainprobe.engine.probes.collectives.CollectiveApi`: the
  namespaces and primitive classes the ``cc`` probe wraps, how asynchronous calls complete).

The engine names no backend: :func:`trainprobe.backends.backend_for` (in the backends' package)
resolves a framework name to one, importing only the framework asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from trainprobe.engine.optimizer_view import OptimizerView, Removable, StepHooks

__all__ = ["Backend", "OptimizerView", "ParamLayouts", "Removable", "StatsKernel", "StepHooks"]

ParamLayouts = tuple[int, dict[int, tuple[dict[str, Any], dict[str, Any]]]]
"""``(world size, {id(param): (layout of its rows, layout of its unreduced gradient rows)})``."""

if TYPE_CHECKING:
    from trainprobe.engine.probes.base import Probe, ProbeSpec, StepClock
    from trainprobe.engine.probes.collectives import CollectiveApi
    from trainprobe.engine.probes.model_view import ModelView, NamedParam
    from trainprobe.engine.records import HostCopy


class StatsKernel(Protocol):
    """Turns tensors into rows of statistics, in the order of ``ops``.

    A row is a ``list[float]`` (values already on the host) or, for the PyTorch backend on an
    accelerator, a float64 device tensor that :mod:`trainprobe.engine.records` copies to the host once
    per monitor per step. A tensor without values (PyTorch: ``device="meta"``, a shape and a
    dtype only) has None for its row, whoever asks: the monitors' row buffers keep no row for it
    (:meth:`~trainprobe.engine.records.RowBuffer.add`), the dump writes null statistics.
    """

    ops: tuple[str, ...]

    def row(self, t: Any) -> Any:
        """Statistics of one tensor (None: it holds no values)."""
        ...

    def rows(self, tensors: Sequence[Any]) -> list[Any]:
        """Statistics of several tensors, one row each (None for one without values), in order."""
        ...

    def between_steps(self) -> None:
        """Called by the session after each step's rows are taken, before the next step: the
        kernel may switch to a faster pass made ready aside meanwhile (PyTorch's one-read pass),
        so that one step's rows come from one kernel."""
        ...


class Backend(Protocol):
    """One training framework, as the engine uses it."""

    name: str
    """Framework name as the config dialects spell it (``pytorch``, ``mindspore``)."""

    @property
    def tensor_type(self) -> type | tuple[type, ...]:
        """The framework's tensor class(es)."""
        ...

    def collective_api(self) -> CollectiveApi | None:
        """The framework's collectives for the ``cc`` monitor, or None where it cannot run."""
        ...

    def stats(self, ops: Sequence[str], eps: float) -> StatsKernel:
        """A statistics kernel for ``ops`` (names from :data:`trainprobe.engine.stats.ops.ALL_OPS`)."""
        ...

    def device_copy(self, rows: list[Any]) -> HostCopy:
        """Start copying rows of one device to the host (a
        :data:`~trainprobe.engine.records.DeviceCopier`: one copy per device per step)."""
        ...

    def is_compiling(self) -> bool:
        """Whether a graph compiler is tracing the code running now (hooks then do nothing)."""
        ...

    def at_trace_time(self, note: Callable[[object], None]) -> None:
        """Called by a hook that finds itself traced (:meth:`is_compiling`): run ``note`` (a
        module-level function, no closure) once per trace, at trace time, putting nothing into
        the graph and reading no state the compiler would guard on (a counter bumped there
        would make it recompile on every call)."""
        ...

    def watch_skipped_steps(self, optimizer: StepHooks, on_skip: Callable[[], None]) -> Removable | None:
        """Call ``on_skip()`` whenever a loss scaler skips a step of ``optimizer`` (inf/NaN
        gradients); returns the handle to remove, or None where the framework has no such skip."""
        ...

    def records_forward(self, module: Any, record_eval_mode: bool) -> bool:
        """Whether a forward call of ``module`` is recorded (training, or ``record_eval_mode``)."""
        ...

    def grad_recording(self) -> bool:
        """Whether autograd records the operations running now (gradients will flow)."""
        ...

    def wants_grad(self, t: Any) -> bool:
        """Whether a gradient with values will be computed for ``t`` (only asked while recording;
        false for a tensor without values, PyTorch's ``device="meta"``)."""
        ...

    def hook_grad(self, t: Any, fn: Callable[[Any], None]) -> Removable | None:
        """Call ``fn(grad)`` when the gradient of ``t`` is computed, without changing it.
        Returns the hook's handle, which the caller removes at the end of the step (a tensor
        that outlives the step, such as a parameter passed as a module input, would otherwise
        keep one hook per step), or None only where the framework cannot remove a tensor hook."""
        ...

    def rank(self) -> int:
        """This process's rank (0 without a distributed setup)."""
        ...

    def distributed(self) -> bool:
        """Whether the framework's distributed communication is initialised."""
        ...

    def param_layouts(self, params: Sequence[NamedParam], chunks: Sequence[Any]) -> ParamLayouts:
        """What each of ``params`` is on this rank (:mod:`trainprobe.engine.tensor_layout`):
        the world size and, per parameter (``id``), the layout of its rows and of its
        ``unreduced`` gradient rows (``rank_local`` before a data-parallel reduction); an empty
        mapping where the framework's placements are not read. ``chunks`` may end with the
        :class:`OptimizerView` of the optimizer: where it keeps each parameter's state on one rank
        (ZeRO-style sharding), the rows' layout has that rank as ``state_rank``."""
        ...

    def group_rank(self, group: Any, where: str) -> int:
        """This process's rank within ``group`` (a process group of the framework).

        Raises:
            ConfigError: naming ``where`` (the argument that passed ``group``), when the
                framework's distributed communication is not initialised.
        """
        ...

    def group_ranks(self, group: Any) -> tuple[int, ...] | None:
        """The global ranks of ``group``'s members, in group order; None where the framework
        cannot tell (distributed communication not initialised, or groups not read)."""
        ...

    def grad_reader(self, main_grad: bool) -> Callable[[Any], Any] | None:
        """How a parameter's gradient is read (None: where the framework keeps it, ``.grad``).
        ``main_grad``: the user says parameters carry Megatron's ``main_grad``, to be read where
        it is a tensor."""
        ...

    def model_view(self, model: Any, where: str = "start(model=...)", *, stage_prefix: bool | None = None) -> ModelView:
        """Names of the modules and parameters of ``model`` (a module or a list of chunks);
        ``stage_prefix`` as :class:`~trainprobe.engine.probes.model_view.ModelView` takes it.

        Raises:
            ConfigError: naming ``where``, when ``model`` is not a module or a list of them.
        """
        ...

    def optimizer_view(self, optimizer: Any, where: str = "start(optimizer=...)") -> OptimizerView:
        """The one view of the optimizer inside ``optimizer`` (the optimizer itself, wrappers
        holding it, chains of them) that the probes read and the session hooks.

        Raises:
            ConfigError: naming ``where``, when no optimizer of this framework is found.
        """
        ...

    def weight_grad_probe(
        self,
        clock: StepClock,
        spec: ProbeSpec,
        params: list[NamedParam],
        micro_batches: int,
        view: ModelView,
        *,
        per_micro_batch: bool = False,
        optimizer: OptimizerView | None = None,
        grad_of: Callable[[Any], Any] | None = None,
        keep_reduced: Callable[[NamedParam], bool] | None = None,
    ) -> Probe:
        """The ``weight_grad`` probe of this framework (``unreduced`` and ``reduced`` rows)."""
        ...
