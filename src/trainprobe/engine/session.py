"""One monitoring session: probes, the step clock, optimizer step hooks and the writer.

Framework-neutral orchestration shared by the monitors' front doors. A session is created by
``start()`` and ended by ``close()``; it owns every hook, so closing it leaves the model and
the optimizer exactly as they were.

Step protocol: hooks record rows for ``clock.step`` while ``clock.collecting``;
:meth:`Session.end_step` hands each probe's rows to the writer as one batch and moves the clock
on. With ``patch_step`` the optimizer's step post-hook ends the step, and so does a
``GradScaler.step`` that skips the optimizer's step, where the front door passes ``skip_watch``
(the backend's ``watch_skipped_steps``: :mod:`trainprobe.backends.torch.amp_skips`).

Trailing rows (``patch_step``, or ``trailing=True`` for a front door whose own optimizer post-step
hook calls :meth:`Session.end_step`, as Monitor V1's does): a probe whose :meth:`~Probe.watch_next_step` returns a
handle (``cc``) keeps recording for the step that just ended until the next step's first
activity (the next ``nn.Module`` forward in the process), so a collective issued after
``optimizer.step()`` (``dist.all_reduce(loss)`` for logging) belongs to the step that trained.
That "tail" is written when the trigger fires, at the next step end if it never fired (and
trailing is then turned off for the run: the loop calls no module between two steps), or at
:meth:`Session.close`; rows of a step that never had a forward are thus never written under its
own number. A schedule that finishes at that step end detaches everything once the tail is
written.
"""

from __future__ import annotations

import atexit
import functools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from trainprobe.engine.folders import one_line_fault
from trainprobe.engine.log import error_once, logger
from trainprobe.engine.optimizer_view import Removable, SeveralOptimizers, StepHooks
from trainprobe.engine.probes.base import Probe, StepClock
from trainprobe.engine.records import StepBatch
from trainprobe.engine.schedule import Schedule
from trainprobe.engine.sinks.background import Sink, Writer
from trainprobe.engine.sinks.fanout import FanOut

_WHOLE_STEP = frozenset({"global_stats"})
"""Probes whose post-step work reads every row of the step: run once, after the last of several
optimizers."""


class StepWatch(Protocol):
    """Something that reads each step's rows as the session hands them to the writer, on the
    training thread, and may act at the step's boundary (Monitor V2's online anomaly rules,
    :mod:`trainprobe.frontdoors.monitor_v2.anomaly_watch`). Its methods may raise to stop the
    run (the session has then written the step and closed)."""

    def on_batch(self, probe: Probe, batch: StepBatch) -> None:
        """A probe's rows of a collected step, about to be written."""

    def before_update(self, probes: Sequence[Probe]) -> None:
        """The probes' pre-step work is done (the reduced gradients are known)."""

    def skipped(self, step: int) -> None:
        """GradScaler skipped the optimizer step of ``step``."""

    def at_boundary(self, step: int, close: Callable[[], None] | None) -> None:
        """``step`` ended and its rows went to the writer; ``close()`` closes the session (None:
        the session is closing now, nothing may be raised)."""


SkipWatcher = Callable[[StepHooks, Callable[[], None]], "Removable | None"]
"""``watch(optimizer, on_skip)``: call ``on_skip()`` whenever a step of ``optimizer`` is skipped
(AMP's loss scaler found inf/NaN gradients); returns a handle to remove, or None where the
framework has no such skips."""


@dataclass
class _TrailingStep:
    """The rows still arriving for ``step`` after the optimizer ended it (see the module doc)."""

    step: int
    collecting: bool
    probes: list[Probe]
    handles: list[Any] = field(default_factory=list)
    finish: bool = False  # the schedule finished with this step: detach once the tail is written


class Session:
    """Runs ``probes`` on ``schedule`` and writes their rows to ``sink``; ``trailing`` (default:
    ``patch_step``) keeps trailing probes recording for the step that ended until the next
    step's first forward (see the module doc): only right when :meth:`end_step` runs right after
    ``optimizer.step()``.

    The session owns its :class:`~trainprobe.engine.sinks.background.Writer`: on a background
    thread when ``background`` is true, else on the caller's; a sequence of sinks is fanned out
    (:class:`~trainprobe.engine.sinks.fanout.FanOut`: a failing member is reported once and
    skipped). A batch the sink fails to write disables that batch's monitor (one error line);
    training goes on.
    """

    def __init__(
        self,
        *,
        probes: Sequence[Probe],
        schedule: Schedule,
        sink: Sink[StepBatch] | Sequence[Sink[StepBatch]],
        background: bool,
        clock: StepClock,
        optimizer: StepHooks | None = None,
        patch_step: bool = False,
        pre_step_hook: bool = True,
        skip_watch: SkipWatcher | None = None,
        trailing: bool | None = None,
        watch: StepWatch | None = None,
    ) -> None:
        self.probes = list(probes)
        self.schedule = schedule
        self.writer: Writer[StepBatch] = Writer(
            FanOut(sink) if isinstance(sink, Sequence) else sink, background=background, on_error=self._on_write_error
        )
        self.clock = clock
        self.optimizer = optimizer
        self.patch_step = patch_step
        self.pre_step_hook = pre_step_hook
        self.skip_watch = skip_watch
        self.watch = watch
        self.closed = False
        self._attached = False
        self._optimizer_handles: list[Removable] = []
        self._by_name = {p.name: p for p in self.probes}
        self._tail: _TrailingStep | None = None
        self._trailing = patch_step if trailing is None else trailing
        self._at_exit = functools.partial(_close_at_exit, weakref.ref(self))
        clock.collecting = schedule.collects(clock.step)

    # -- lifecycle -----------------------------------------------------------------------
    def attach(self) -> None:
        """Register every probe's hooks and the optimizer step hooks."""
        try:
            for probe in self.probes:
                probe.attach()
            if self.optimizer is not None:
                # first: its counting hook must run before the post-step hook, which may detach
                # everything (torch iterates the hooks while they run)
                skips = self.skip_watch if self.patch_step else None
                watch = skips(self.optimizer, self._skipped_step) if skips is not None else None
                self._optimizer_handles = [watch] if watch is not None else []
                self._optimizer_handles += self._step_hooks(self.optimizer)
        except BaseException:
            self._detach()
            raise
        self._attached = True
        atexit.register(self._at_exit)
        if self.schedule.finished(self.clock.step):
            self._finish(None)

    def _step_hooks(self, optimizer: StepHooks) -> list[Removable]:
        """The optimizer step hooks: around each optimizer's own step when the view holds several
        (:class:`~trainprobe.engine.optimizer_view.SeveralOptimizers`; the last one ends the
        step), else around the one step."""
        if getattr(optimizer, "several", False) and self.pre_step_hook:
            several: SeveralOptimizers = optimizer  # type: ignore[assignment]
            return [several.register_member_hooks(self.optimizer_pre_step, self.optimizer_post_step, self._last_step)]
        handles = [optimizer.register_step_post_hook(self._post_step)]
        if self.pre_step_hook:
            handles.append(optimizer.register_step_pre_hook(self._pre_step))
        return handles

    def _last_step(self) -> None:
        """The last of several optimizers stepped: the work that reads the whole step's rows
        (``global_stats``), then the step ends (``patch_step``)."""
        if not self.closed and self.clock.collecting:
            for probe in self.probes:
                if probe.name in _WHOLE_STEP and not probe.disabled:
                    probe.guard(probe.after_optimizer_step)()
        if self.patch_step:
            self.end_step()

    def close(self) -> None:
        """Write the current step's rows if it was collected, remove every hook, close files."""
        if self.closed:
            return
        reached = self.clock.step - 1
        self._close_tail()
        if self.closed:  # the tail was the end of a finished schedule
            return
        if self._attached and self.clock.collecting and any(p.has_work() for p in self.probes):
            self._flush_rows()
            reached = self.clock.step
            if self.watch is not None:
                self.watch.at_boundary(self.clock.step, None)
        self._finish(reached)

    def _finish(self, reached: int | None) -> None:
        """Remove hooks and close the output. ``reached``: training stopped (``close()``) at that
        step; None: the schedule finished. Either way every window keeps the name of its full
        range (``step5-6`` even when training stopped after step 5 or step 6 is not collected,
        as the reference names it); ``reached`` is passed on to the sinks, which change no name
        with it."""
        self._detach()
        if not self.closed:
            self.closed = True
            atexit.unregister(self._at_exit)
            self.writer.close(reached=reached)

    def _detach(self) -> None:
        self._drop_tail_trigger()
        for handle in self._optimizer_handles:
            handle.remove()
        self._optimizer_handles = []
        for probe in self.probes:
            probe.detach()
        self._attached = False

    # -- steps ---------------------------------------------------------------------------
    def end_step(self) -> None:
        """Finish the current step: write its rows (if collected) and advance the clock. Under
        ``patch_step``, trailing probes keep their rows open for this step (see the module doc)."""
        if self.closed:
            self.clock.step += 1
            return
        if self._tail is not None:  # no module forward during a whole step: stop trailing
            self._trailing = False
            logger.info(
                "trainprobe: cc saw no nn.Module forward between two optimizer steps (a functional loop, or "
                "a model compiled in place with module.compile()); from now on a collective issued after "
                "optimizer.step() counts in the next step"
            )
            self._close_tail()
        trailing = self._trailing_probes()
        for probe in self.probes:
            if probe not in trailing:
                self._end_probe_step(probe, self.clock.step, self.clock.collecting)
        for probe in self.probes:
            if probe.disabled:
                probe.detach()
            else:
                probe.stats.between_steps()  # a faster kernel built aside since start: from the next step
        step = self.clock.step
        self._open_tail(step, trailing)
        self.clock.step += 1
        self.clock.collecting = self.schedule.collects(self.clock.step)
        if self.schedule.finished(self.clock.step):
            if self._tail is not None and self._tail.collecting:
                self._tail.finish = True  # detach once the tail is written
            else:
                self._close_tail()
                self._finish(None)
        if self.watch is not None:
            self.watch.at_boundary(step, self.close)

    def _end_probe_step(self, probe: Probe, step: int, collecting: bool) -> None:
        """Run ``probe``'s end of step and, on a collected step, hand its rows to the writer."""
        probe.guard(probe.end_step)()
        if not collecting:
            return
        if probe.disabled:
            probe.rows.clear()
            return
        batch = probe.guard(probe.rows.drain)(probe.name, step)
        if batch is not None:
            if self.watch is not None:
                self.watch.on_batch(probe, batch)
            self.writer.submit(batch)

    def _flush_rows(self) -> None:
        for probe in self.probes:
            self._end_probe_step(probe, self.clock.step, True)

    # -- trailing rows -------------------------------------------------------------------
    def _trailing_probes(self) -> list[Probe]:
        if not self._trailing:
            return []
        return [p for p in self.probes if not p.disabled and p.records_after_step]

    def _open_tail(self, step: int, probes: list[Probe]) -> None:
        """Keep ``probes`` recording for ``step`` until the next step's first activity."""
        if not probes:
            return
        tail = _TrailingStep(step, self.clock.collecting, probes)
        for probe in probes:
            probe.guard(probe.open_tail)(tail.collecting)
        handle = probes[0].guard(probes[0].watch_next_step)(self._tail_trigger)
        if handle is None:  # the framework cannot say when the next step starts: no trailing
            self._trailing = False
            self._tail = tail
            self._close_tail()
            return
        tail.handles.append(handle)
        self._tail = tail

    def _tail_trigger(self) -> None:
        """The next step started (a module forward): write the tail. Runs inside a forward
        pre-hook, so it never raises."""
        try:
            self._close_tail()
        except Exception as exc:  # noqa: BLE001 - a monitor must never break training
            error_once(f"tail-{id(self)}", f"trainprobe: writing the rows of the last step failed ({exc})")

    def _close_tail(self) -> None:
        """Write the open tail's rows under its step (if it was collected) and end it."""
        tail, self._tail = self._tail, None
        if tail is None:
            return
        self._drop_tail_trigger(tail)
        for probe in tail.probes:
            probe.guard(probe.close_tail)()
            self._end_probe_step(probe, tail.step, tail.collecting)
        if tail.finish:
            self._finish(None)

    def _drop_tail_trigger(self, tail: _TrailingStep | None = None) -> None:
        tail = tail if tail is not None else self._tail
        if tail is None:
            return
        handles, tail.handles = tail.handles, []
        for handle in handles:
            handle.remove()

    def flush(self) -> None:
        """Wait until every batch handed to the writer is written (the sinks are current)."""
        self.writer.flush()

    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.optimizer_pre_step()

    def optimizer_pre_step(self, stepping: frozenset[int] | None = None) -> None:
        """Run the probes' pre-step work; for front doors that own the optimizer hooks (a
        session built with ``optimizer=None``) or that know better than the pre-step hook when
        the gradients are ready (``pre_step_hook=False``: the loop runs forward and backward
        inside ``optimizer.step(closure)``, as Lightning does). ``stepping``: one of several
        optimizers is about to step those tensors (:attr:`StepClock.stepping`), only theirs are
        read."""
        if self.closed:
            return
        if self.clock.collecting:
            self.clock.stepping = stepping
            try:
                for probe in self.probes:
                    if not probe.disabled:
                        probe.guard(probe.before_optimizer_step)()
            finally:
                self.clock.stepping = None
            if self.watch is not None:
                self.watch.before_update(self.probes)

    def _post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.optimizer_post_step()
        if self.patch_step:
            self.end_step()

    def _skipped_step(self) -> None:
        if not self.closed:
            if self.watch is not None:
                self.watch.skipped(self.clock.step)
            self.end_step()

    def optimizer_post_step(self, stepping: frozenset[int] | None = None) -> None:
        """Run the probes' post-step work (see :meth:`optimizer_pre_step`); with ``stepping``
        (one of several optimizers stepped), the whole step's work waits for the last one."""
        if self.closed:
            return
        if self.clock.collecting:
            self.clock.stepping = stepping
            try:
                for probe in self.probes:
                    if not probe.disabled and (stepping is None or probe.name not in _WHOLE_STEP):
                        probe.guard(probe.after_optimizer_step)()
            finally:
                self.clock.stepping = None

    def _on_write_error(self, monitor: str, exc: BaseException) -> None:
        probe = self._by_name.get(monitor)
        message = f"trainprobe: writing the {monitor} output failed ({type(exc).__name__}: {exc})"
        if probe is not None:
            probe.disabled = True
            message += f"; the {monitor} monitor is disabled for the rest of the run, training continues"
        error_once(f"write-failed-{monitor}-{id(self)}", message, traceback=not one_line_fault(exc))


class NullSession:
    """The session of a monitor that records nothing (Monitor V2: a rank outside the config's
    ``rank`` list, or a stopped monitor; Monitor V1: a configuration that collects nothing,
    outside a collection, dynamic mode switched off): chosen once, so a front door never asks
    whether it has a session. Its steps only move ``clock`` on; nothing is hooked or written."""

    patch_step = False
    closed = True
    probes: tuple[Probe, ...] = ()

    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    def attach(self) -> None:
        """Nothing to hook."""

    def close(self) -> None:
        """Nothing to write."""

    def end_step(self) -> None:
        """Move the clock to the next step."""
        self.clock.step += 1

    def optimizer_pre_step(self, stepping: frozenset[int] | None = None) -> None:
        """Nothing recorded."""

    def optimizer_post_step(self, stepping: frozenset[int] | None = None) -> None:
        """Nothing recorded."""

    def flush(self) -> None:
        """Nothing to write."""


def _close_at_exit(ref: weakref.ref[Session]) -> None:
    session = ref()
    if session is not None and not session.closed:
        try:
            session.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: best effort
            pass
