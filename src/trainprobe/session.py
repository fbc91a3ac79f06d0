"""One monitoring session: probes, the step clock, optimizer step hooks and the writer.

Framework-neutral orchestration shared by the monitors' front doors. A session is created by
``start()`` and ended by ``close()``; it owns every hook, so closing it leaves the model and
the optimizer exactly as they were.

Step protocol: hooks record rows for ``clock.step`` while ``clock.collecting``;
:meth:`Session.end_step` hands each probe's rows to the writer as one batch and moves the clock
on. With ``patch_step`` the optimizer's step post-hook ends the step, and so does a
``GradScaler.step`` that skips the optimizer's step (:mod:`trainprobe.amp_skips`).
"""

from __future__ import annotations

import atexit
import functools
import weakref
from collections.abc import Sequence
from typing import Any

from trainprobe.amp_skips import watch_skipped_steps
from trainprobe.log import error_once
from trainprobe.probes.base import Probe, StepClock
from trainprobe.schedule import Schedule
from trainprobe.sinks.background import Writer


class Session:
    """Runs ``probes`` on ``schedule`` and writes their rows through ``writer``."""

    def __init__(
        self,
        *,
        probes: Sequence[Probe],
        schedule: Schedule,
        writer: Writer,
        clock: StepClock,
        optimizer: Any = None,
        patch_step: bool = False,
        pre_step_hook: bool = True,
    ) -> None:
        self.probes = list(probes)
        self.schedule = schedule
        self.writer = writer
        self.clock = clock
        self.optimizer = optimizer
        self.patch_step = patch_step
        self.pre_step_hook = pre_step_hook
        self.closed = False
        self._attached = False
        self._optimizer_handles: list[Any] = []
        self._by_name = {p.name: p for p in self.probes}
        self._at_exit = functools.partial(_close_at_exit, weakref.ref(self))
        writer.on_error = self._on_write_error
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
                watch = watch_skipped_steps(self.optimizer, self._skipped_step) if self.patch_step else None
                self._optimizer_handles = [watch] if watch is not None else []
                self._optimizer_handles.append(self.optimizer.register_step_post_hook(self._post_step))
                if self.pre_step_hook:
                    self._optimizer_handles.append(self.optimizer.register_step_pre_hook(self._pre_step))
        except BaseException:
            self._detach()
            raise
        self._attached = True
        atexit.register(self._at_exit)
        if self.schedule.finished(self.clock.step):
            self._finish(self.clock.step - 1)

    def close(self) -> None:
        """Write the current step's rows if it was collected, remove every hook, close files."""
        if self.closed:
            return
        reached = self.clock.step - 1
        if self._attached and self.clock.collecting and any(p.has_work() for p in self.probes):
            self._flush_rows()
            reached = self.clock.step
        self._finish(reached)

    def _finish(self, reached: int) -> None:
        """Remove hooks and close the output; ``reached`` is the last step that has rows."""
        self._detach()
        if not self.closed:
            self.closed = True
            atexit.unregister(self._at_exit)
            self.writer.close(reached=reached)

    def _detach(self) -> None:
        for handle in self._optimizer_handles:
            handle.remove()
        self._optimizer_handles = []
        for probe in self.probes:
            probe.detach()
        self._attached = False

    # -- steps ---------------------------------------------------------------------------
    def end_step(self) -> None:
        """Finish the current step: write its rows (if collected) and advance the clock."""
        if self.closed:
            self.clock.step += 1
            return
        if self.clock.collecting:
            self._flush_rows()
        else:
            for probe in self.probes:
                probe.guard(probe.end_step)()
        for probe in self.probes:
            if probe.disabled:
                probe.detach()
        self.clock.step += 1
        self.clock.collecting = self.schedule.collects(self.clock.step)
        if self.schedule.finished(self.clock.step):
            self._finish(self.clock.step - 1)

    def _flush_rows(self) -> None:
        for probe in self.probes:
            probe.guard(probe.end_step)()
            if probe.disabled:
                probe.rows.clear()
                continue
            batch = probe.guard(probe.rows.drain)(probe.name, self.clock.step)
            if batch is not None:
                self.writer.submit(batch)

    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.optimizer_pre_step()

    def optimizer_pre_step(self) -> None:
        """Run the probes' pre-step work; for front doors that own the optimizer hooks (a
        session built with ``optimizer=None``) or that know better than the pre-step hook when
        the gradients are ready (``pre_step_hook=False``: the loop runs forward and backward
        inside ``optimizer.step(closure)``, as Lightning does)."""
        if self.closed:
            return
        if self.clock.collecting:
            for probe in self.probes:
                if not probe.disabled:
                    probe.guard(probe.before_optimizer_step)()

    def _post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.optimizer_post_step()
        if self.patch_step:
            self.end_step()

    def _skipped_step(self) -> None:
        if not self.closed:
            self.end_step()

    def optimizer_post_step(self) -> None:
        """Run the probes' post-step work (see :meth:`optimizer_pre_step`)."""
        if self.closed:
            return
        if self.clock.collecting:
            for probe in self.probes:
                if not probe.disabled:
                    probe.guard(probe.after_optimizer_step)()

    def _on_write_error(self, monitor: str, exc: BaseException) -> None:
        probe = self._by_name.get(monitor)
        message = f"trainprobe: writing the {monitor} output failed ({type(exc).__name__}: {exc})"
        if probe is not None:
            probe.disabled = True
            message += f"; the {monitor} monitor is disabled for the rest of the run, training continues"
        error_once(f"write-failed-{monitor}-{id(self)}", message, traceback=not isinstance(exc, OSError))


def _close_at_exit(ref: weakref.ref[Session]) -> None:
    session = ref()
    if session is not None and not session.closed:
        try:
            session.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: best effort
            pass
