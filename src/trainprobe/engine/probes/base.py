"""What every probe shares: removable hook handles, fault isolation, a row buffer.

A probe attaches to the framework through public hook APIs and keeps the handles, so
:meth:`Probe.detach` leaves the model, the optimizer and torch as they were. Any exception in a
probe's own code is caught by :meth:`Probe.guard` (the shared :mod:`trainprobe.engine.guard`): it is logged once with the monitor's name, the
probe stops producing rows, and training goes on. Handles are removed at the end of the step,
never from inside a hook (PyTorch iterates its hook dicts while calling them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from trainprobe.engine.folders import one_line_fault
from trainprobe.engine.guard import guarded
from trainprobe.engine.log import error_once
from trainprobe.engine.records import RowBuffer

if TYPE_CHECKING:
    from trainprobe.engine.backend import Backend

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(slots=True)
class StepClock:
    """The step being trained and whether it is collected; shared by a session's probes."""

    step: int = 0
    collecting: bool = False
    micro_batches: int = 1
    stepping: frozenset[int] | None = None
    """Ids of the tensors the optimizer now stepping steps, while one of several optimizers'
    step hooks runs (the optimizer probes read only those); None: every parameter."""


@dataclass(frozen=True, slots=True)
class ProbeSpec:
    """What a probe takes from a monitor's settings: the statistics it computes (names from
    :data:`trainprobe.engine.stats.ops.ALL_OPS`, in column order) and the ``eps`` they use. The config
    dialects build it from their own fields; a probe that needs more (its switches) extends it
    (:class:`~trainprobe.engine.probes.module.ModuleSpec`, :class:`~trainprobe.engine.probes.collectives.CcSpec`)
    or takes them as arguments."""

    ops: tuple[str, ...]
    eps: float


class Probe:
    """Base class of the monitors. Subclasses set ``name`` and ``with_micro_step`` and
    implement :meth:`attach`; optimizer-driven probes override :meth:`before_optimizer_step`
    and :meth:`after_optimizer_step`. ``backend`` is the framework adapter (given by the
    caller: the probes never import a backend, which imports the probes); ``self.stats`` is its
    statistics kernel, built from ``spec`` (a :class:`ProbeSpec` or a probe's own extension of
    it), kept as ``self.spec``."""

    name: str = "probe"
    with_micro_step: bool = False

    def __init__(self, clock: StepClock, spec: ProbeSpec, *, backend: Backend) -> None:
        self.clock = clock
        self.spec = spec
        self.backend: Backend = backend
        self.stats = backend.stats(spec.ops, spec.eps)
        self.rows = RowBuffer(backend.device_copy)
        self.disabled = False
        self._handles: list[Any] = []

    # -- lifecycle -----------------------------------------------------------------------
    def attach(self) -> None:
        """Register hooks; the base probe has none."""

    def detach(self) -> None:
        """Remove every hook this probe registered and stop recording (idempotent); hooks that
        autograd still holds on live tensors become no-ops."""
        self.disabled = True
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()

    def keep(self, handle: Any) -> None:
        """Remember a handle (anything with ``remove()``) for :meth:`detach`."""
        self._handles.append(handle)

    @property
    def active(self) -> bool:
        """Whether hooks should record now."""
        return self.clock.collecting and not self.disabled

    # -- step events ---------------------------------------------------------------------
    def before_optimizer_step(self) -> None:
        """Called just before ``optimizer.step()`` on collected steps."""

    def after_optimizer_step(self) -> None:
        """Called just after ``optimizer.step()`` on collected steps."""

    def end_step(self) -> None:
        """Called once at the end of every step, collected or not, before the rows are taken."""

    # -- trailing rows (see trainprobe.engine.session) ------------------------------------------
    records_after_step: bool = False
    """Whether calls made after ``optimizer.step()`` still belong to the step that ended
    (``cc``); such a probe implements the three methods below."""

    def open_tail(self, collecting: bool) -> None:
        """The optimizer ended the step: keep recording for it (when ``collecting``, whatever the
        clock now says) until :meth:`close_tail`."""

    def close_tail(self) -> None:
        """The next step started: record for the clock's step again (``end_step`` follows, then
        the rows are taken for the step that ended)."""

    def watch_next_step(self, callback: Callable[[], None]) -> Any:
        """Call ``callback`` once when the next step's first activity starts; returns a handle
        with ``remove()``, or None where the framework cannot tell (no trailing then)."""
        return None

    # -- fault isolation -----------------------------------------------------------------
    def has_work(self) -> bool:
        """Whether this step left rows to write (or, for probes that record later, work that
        ``end_step`` turns into rows): what a mid-step ``stop()`` must still flush."""
        return len(self.rows) > 0

    def fail(self, exc: BaseException) -> None:
        """Log ``exc`` once, stop this probe and drop its pending rows."""
        self.disabled = True
        self.rows.clear()
        error_once(
            f"probe-failed-{self.name}-{id(self)}",
            f"trainprobe: the {self.name} monitor failed and is disabled for the rest of the run; "
            f"training continues ({type(exc).__name__}: {exc})",
            traceback=not one_line_fault(exc),
        )

    def eager(self, hook: F, traced: Callable[[object], None] | None = None) -> F:
        """``hook`` under :meth:`guard`, doing nothing while a graph compiler (``torch.compile``)
        traces it. Nothing of the probe is read or changed there, so the compiler neither puts
        the hook into its graph nor guards on the probe's state (a counter bumped while traced
        would make it recompile on every call, then fall back to eager). ``traced`` (a
        module-level function, see :meth:`Backend.at_trace_time`) runs once per trace."""
        run = self.guard(hook)
        is_compiling = self.backend.is_compiling
        at_trace_time = self.backend.at_trace_time

        def eager_only(*args: Any, **kwargs: Any) -> Any:
            if is_compiling():
                if traced is not None:
                    at_trace_time(traced)
                return None
            return run(*args, **kwargs)

        return eager_only  # type: ignore[return-value]

    def guard(self, fn: F) -> F:
        """Wrap a hook so that it never raises into training and returns None on failure (the
        shared :func:`trainprobe.engine.guard.guarded`: a fault disables this probe)."""
        return guarded(fn, off=lambda: self.disabled, fail=self.fail)
