"""Which configuration is in force, and which session runs it, from one step to the next.

* Static mode: one session from ``set_monitor`` on, collecting per ``start_step``,
  ``step_interval`` and ``collect_times``.
* Dynamic mode (``DYNAMIC_MONITOR=True``): a session runs only while the file says
  ``dynamic_on: true``; it starts at the step after the one where that was read. After every
  step the file's modification time is checked: a valid edit replaces the configuration and
  restarts collection at the next step with ``collect_times`` counted afresh (``dynamic_on:
  false`` stops it); an invalid edit is logged and ignored. Reaching ``collect_times`` sets
  ``dynamic_on`` to false in the file, unless the file was edited meanwhile: an edit read at the
  end of the last collected step wins (it restarts collection at the next step as any edit
  does), and the switch-off never overwrites an edit it has not read.
* Changes made through the API (``reload_xy``, ``monitor.ops = [...]``) apply from the next step:
  at once when made between ``optimizer.step()`` and the next forward, else at the end of the
  running step. The running session keeps its collection window. In dynamic mode while nothing
  is monitored they wait for monitoring to start.

While nothing is collected the session is the run's one
:class:`~trainprobe.engine.session.NullSession` (:attr:`SessionFactory.idle
<trainprobe.frontdoors.monitor_v1.assembly.SessionFactory.idle>`): its steps only move the clock.
"""

from __future__ import annotations

from pathlib import Path

from trainprobe.engine.log import logger
from trainprobe.engine.probes.base import Probe, StepClock
from trainprobe.engine.session import NullSession, Session
from trainprobe.frontdoors.monitor_v1.assembly import SessionFactory
from trainprobe.frontdoors.monitor_v1.config import MonitorV1Config
from trainprobe.frontdoors.monitor_v1.dynamic import ConfigWatcher


class MonitorControl:
    """Holds the configuration in force, a pending change, and the running session.

    Args:
        config: the configuration read at construction.
        config_path: the file watched in dynamic mode.
        dynamic: whether dynamic mode is on.
    """

    def __init__(self, config: MonitorV1Config, config_path: Path, dynamic: bool) -> None:
        self.config = config
        self.config_path = config_path
        self.dynamic = dynamic
        self.watcher = ConfigWatcher(config_path) if dynamic else None
        self.session: Session | NullSession = NullSession(StepClock())
        """The running session; a null one while nothing is collected (before ``set_monitor``,
        one that counts no step of the run)."""
        self.active_from: int | None = None
        """The first step of the configuration in force: ``set_monitor``'s first step (static
        mode), the step after ``dynamic_on: true`` was read (dynamic mode); None while dynamic
        mode monitors nothing (``dynamic_on`` false, or ``collect_times`` reached)."""
        self._factory: SessionFactory | None = None
        self._pending: MonitorV1Config | None = None
        self._between_steps = True

    @property
    def wanted(self) -> MonitorV1Config:
        """The configuration of the next steps (a pending change, else the one in force)."""
        return self._pending or self.config

    @property
    def probes(self) -> list[Probe]:
        """The running session's probes (empty when nothing runs)."""
        return list(self.session.probes)

    @property
    def collecting(self) -> bool:
        """Whether a session collects (else the null session runs, or the one that collected
        has just finished)."""
        return not self.session.closed

    def begin(self, factory: SessionFactory) -> None:
        """Start monitoring for ``set_monitor`` (a change made before it is in force already)."""
        self._factory, self.session = factory, factory.idle
        clock = factory.attachment.clock
        if self._pending is not None:
            self.config, self._pending = self._pending, None
        if not self.dynamic:
            self.active_from = clock.step
            self._start(self.config, None)
        elif self.config.dynamic_on:
            self.active_from = clock.step + 1
            self._start(self.config, clock.step + 1)

    def change(self, cfg: MonitorV1Config) -> None:
        """Make ``cfg`` the configuration of the next steps."""
        self._pending = cfg
        if self._factory is not None and self._between_steps:
            self._apply_pending()

    # -- steps ---------------------------------------------------------------------------
    def step_begins(self) -> None:
        """The model's forward started: changes now wait for the end of the step."""
        self._between_steps = False

    def before_optimizer_step(self) -> None:
        """Just before ``optimizer.step()``: the probes' pre-step work."""
        self.session.optimizer_pre_step()

    def end_step(self, post_step: bool = True) -> None:
        """Just after ``optimizer.step()``: the probes' post-step work (unless ``post_step`` is
        False: each of several optimizers' was done after its own step), the step's rows to the
        writer, the clock moved on."""
        if post_step:
            self.session.optimizer_post_step()
        self.session.end_step()
        self._between_steps = True

    def after_step(self) -> None:
        """Between steps: end a finished session, apply a file edit or a pending change.

        In dynamic mode the file is read before a finished collection switches it off, so a valid
        edit made up to the end of the last collected step is applied (collection restarts at the
        next step, ``collect_times`` counted afresh) rather than overwritten; an invalid one is
        ignored as always. ``dynamic_on`` is set to false only in the file as last read: an edit
        saved while switching off is never overwritten, it is applied instead.
        """
        assert self._factory is not None
        finished = self.session is not self._factory.idle and self.session.closed  # its schedule ended
        if finished:
            self.session = self._factory.idle
        if self.watcher is not None:
            fresh = self.watcher.poll()
            if fresh is None and finished:
                fresh = self._switch_off()
            if fresh is not None:
                self._reconfigure(fresh)
                return
        if self._pending is not None:
            self._apply_pending()

    def close(self) -> None:
        """Close the running session (its pending rows written)."""
        self.session.close()
        if self._factory is not None:
            self.session = self._factory.idle

    # -- internals -----------------------------------------------------------------------
    def _switch_off(self) -> MonitorV1Config | None:
        """``collect_times`` reached (dynamic mode): monitoring stops and ``dynamic_on`` is set to
        false in the file, unless the user saved it since it was last read: then the file stays as
        written and its configuration (if valid) is returned, to apply as any edit."""
        self.active_from = None
        assert self.watcher is not None
        if self.watcher.switch_off():
            logger.info("trainprobe: collect_times reached; dynamic_on set to false in %s", self.config_path)
            return None
        return self.watcher.poll()  # edited while switching off (or the write failed: nothing new)

    def _reconfigure(self, fresh: MonitorV1Config) -> None:
        """A valid edit of the file (dynamic mode): restart from the next step, or stop."""
        self.config, self._pending = fresh, None
        self.close()
        self.active_from = None
        if fresh.dynamic_on and self._factory is not None:
            self.active_from = self._factory.attachment.clock.step
            self._start(fresh, self.active_from)

    def _apply_pending(self) -> None:
        cfg, self._pending = self._pending, None
        assert cfg is not None
        self.config = cfg
        if self.dynamic and not self.collecting:
            return  # not monitoring: the change applies when monitoring starts
        start = self.session.schedule.start_step if isinstance(self.session, Session) else None  # keep the window
        self.close()
        self._start(cfg, start)

    def _start(self, cfg: MonitorV1Config, start_step: int | None) -> None:
        assert self._factory is not None
        self.session = self._factory.start(cfg, start_step)
