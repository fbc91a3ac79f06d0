"""Monitor V2's ``anomaly`` block at work: the online rules judge each step's rows and act.

:class:`AnomalyWatch` is the session's :class:`~trainprobe.engine.session.StepWatch`. On the
training thread, as each monitor's rows of a collected step go to the writer, it judges them
(:class:`~trainprobe.engine.anomaly.online.OnlineRules`: the query layer's non-finite rule and
the spike rule ``trainprobe diagnose`` uses); at the step's boundary it acts on what it found:

* every event goes to ``rank_<r>/anomaly_events.jsonl``, and with ``log`` to one warning line;
* ``on_anomaly(event)`` (``TrainerMonitorV2(cfg, on_anomaly=fn)``) is called for each event
  (at most one per kind per step), with monitoring paused while it runs (a callback may run
  :func:`trainprobe.rerun_check`);
* ``dump``: a precision dump of the ``dump.steps`` steps after the run's first anomaly
  (``<output_dir>/anomaly_dump/step<N>/rank<R>/``, readable by ``trainprobe compare``; once per
  run: what follows the first anomaly is what explains it);
* ``stop``: every rank learns whether any rank saw an anomaly (one all-gather of one integer
  per step), and all stop at the same step: the session writes the step and closes, then
  :class:`~trainprobe.engine.anomaly.events.AnomalyStop` is raised (or, for the trainer
  callbacks, :attr:`AnomalyWatch.stop_requested` is set and they stop their trainer).

With ``before_update`` the rows known before ``optimizer.step()`` (module, weight_grad
``unreduced`` and ``reduced``) are judged in the optimizer's pre-step hook, after the monitors
have taken their statistics: one host read of them per step. A stop then skips the update
(``optimizer.step()`` returns without moving a parameter, or raises ``AnomalyStop``), so the
model and the optimizer are exactly as after the last healthy step.

Where live full-tensor statistics are on (``"global_stats": true``,
:mod:`trainprobe.backends.torch.live_stats`), the rules see full tensors: a ``weight_grad``
``reduced``, ``param`` or ``optimizer`` row of a sharded tensor is judged on the full tensor's
values (the same ops, the row's key; the live statistics of step ``s`` are computed after its
``optimizer.step()``, before the step's rows reach the watch), so every rank finds the same
anomaly, and its event is worded as ``trainprobe diagnose`` words the full-tensor row
(``step 7, full tensor, weight_grad/reduced fc1.weight: norm = nan (NaN/inf), held by ranks 0,1
(shards), NaN/inf in rank 1's shard``; its ``rank`` is the least rank whose piece holds the
NaN/inf). With ``before_update`` too, the live statistics gather the rows known before the update
(``weight_grad`` ``reduced``, ``param`` ``param_origin``) in the optimizer's pre-step hook
(:meth:`~trainprobe.backends.torch.live_stats.GlobalStatsProbe.judge_before_update`: the same
single collective, moved before ``optimizer.step()``), so the pre-step check judges full tensors
as well and every rank stops at the same step on the same full-tensor event. A full-tensor spike
names no piece.

A fault inside the watch itself (not an anomaly: a bug, a full disk for the event file) is logged
once and turns the watch off; training goes on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Protocol

from trainprobe.engine.anomaly.config import AnomalyConfig
from trainprobe.engine.anomaly.events import AnomalyEvent, AnomalyStop, EventLog
from trainprobe.engine.anomaly.finding import Anomaly
from trainprobe.engine.anomaly.online import OnlineRules
from trainprobe.engine.layout import ANOMALY_DUMP_FOLDER, V2_MONITORS
from trainprobe.engine.log import error_once, logger
from trainprobe.engine.probes.base import Probe, StepClock
from trainprobe.engine.records import RowKey, StepBatch

DUMP_FOLDER = ANOMALY_DUMP_FOLDER
"""The folder of ``output_dir`` the ``dump`` action writes its precision dumps into."""

Agree = Callable[[bool], tuple[int, ...]]
"""``agree(flag)``: the ranks whose flag is true (a collective every rank calls together)."""


FullKey = tuple[str, str, str]
"""(table, name, scope): a row of a tensor whose full-tensor values the live statistics give."""

Rows = list[tuple[RowKey, list[float]]]
"""A monitor's rows of a step, in the order it produced them."""
Group = tuple[str, int, Rows]
"""``(table, offset, rows)``: consecutive rows of one table as its files write them, the first being
the ``offset``-th of the monitor's rows."""


class RowTables(Protocol):
    """How a front door's rows are named in its files: which monitors are judged, and each row's
    table and key as written (so the events word them as ``trainprobe diagnose`` reads the files)."""

    def judged(self, monitor: str) -> bool:
        """Whether ``monitor``'s rows are judged."""
        ...

    def groups(self, monitor: str, rows: Rows) -> list[Group]:
        """``rows`` of ``monitor`` as written, cut into runs of one table (rows of tables not
        judged left out, the offsets still counting them)."""
        ...


class V2Tables:
    """Monitor V2: a monitor is its table; a row keeps its micro-step only where the table's
    files have a ``micro_step`` column (``micro_step_tables``)."""

    def __init__(self, micro_step_tables: frozenset[str] = frozenset(V2_MONITORS)) -> None:
        self.micro_step_tables = micro_step_tables

    def judged(self, monitor: str) -> bool:
        """The V2 monitors' rows are judged."""
        return monitor in V2_MONITORS

    def groups(self, monitor: str, rows: Rows) -> list[Group]:
        """One group: the monitor's rows, keyed as its files write them."""
        if monitor not in self.micro_step_tables:
            rows = [(replace(key, micro_step=None) if key.micro_step is not None else key, v) for key, v in rows]
        return [(monitor, 0, rows)] if rows else []


class FullTensors(Protocol):
    """What the watch reads of the live full-tensor statistics
    (:class:`~trainprobe.backends.torch.live_stats.GlobalStatsProbe`)."""

    def sharded(self) -> frozenset[Any]:
        """The sharded rows' keys ``(table, name, scope)``."""
        ...

    def global_stats(self, step: int | None = None) -> dict[Any, dict[str, float]]:
        """``{(table, name, scope): {op: value}}`` of ``step``."""
        ...

    def holders(self, step: int, key: Any) -> Any:
        """Who holds ``key``'s pieces (``ranks``, ``held``, ``bad_ranks``), or None."""
        ...

    def judge_before_update(self) -> None:
        """Gather the rows known before the update in the pre-step hook."""
        ...


@dataclass(frozen=True, slots=True)
class FullTensorEvent(AnomalyEvent):
    """An event on a sharded tensor's full-tensor values: worded as diagnose words the
    full-tensor row (``full tensor``, the ranks holding it, whose piece holds the NaN/inf).

    Attributes:
        ranks: every rank holding a piece.
        held: how they hold it (``"shards"``, ``"<n> shards, replicated"``).
        bad_ranks: for a NaN/inf, the ranks whose piece holds it (None: none known).
    """

    ranks: tuple[int, ...] = ()
    held: str = "shards"
    bad_ranks: tuple[int, ...] | None = None

    def as_anomaly(self) -> Anomaly:
        """The full-tensor row as ``trainprobe diagnose`` finds it."""
        return replace(AnomalyEvent.as_anomaly(self), ranks=self.ranks, held=self.held, bad_ranks=self.bad_ranks)

    def to_json(self) -> dict[str, Any]:
        """The event file's object, with ``ranks``, ``held`` and ``bad_ranks``."""
        out = AnomalyEvent.to_json(self)
        bad = list(self.bad_ranks) if self.bad_ranks is not None else None
        return {**out, "ranks": list(self.ranks), "held": self.held, "bad_ranks": bad}


class SkipUpdate(Exception):
    """Raised by the pre-step check to keep ``optimizer.step()`` from applying the update (caught
    by the step wrapper the front door installs, :func:`skip_update_wrapper`)."""


class AnomalyWatch:
    """See the module docstring.

    Args:
        config: the validated ``anomaly`` block.
        rank: this process's rank.
        rank_dir: the rank's output folder (``rank_<r>``), for the event file.
        output_dir: the run's output folder, for the dumps.
        first_step: the run's first step (event lines at or after it from an earlier run are dropped).
        clock: the session's step clock (paused while a callback runs).
        model: what a dump action dumps (the ``start(model=...)`` argument).
        on_anomaly: the user's callback, or None.
        agree: how ranks agree on a stop (None: this process alone).
        raise_on_stop: raise ``AnomalyStop`` (True) or only set :attr:`stop_requested` (the
            trainer callbacks).
        micro_step_tables: the tables whose files have a ``micro_step`` column (in the others
            a row's micro-step is not part of its name, as diagnose reads the files).
        tables: how rows are named in the files (default :class:`V2Tables` of
            ``micro_step_tables``; Monitor V1 passes its own,
            :class:`~trainprobe.frontdoors.monitor_v1.online.V1Tables`).
        dump_folder: where the ``dump`` action writes (default ``output_dir/anomaly_dump``).
    """

    def __init__(
        self,
        config: AnomalyConfig,
        *,
        rank: int,
        rank_dir: Path,
        output_dir: Path,
        first_step: int,
        clock: StepClock,
        model: Any,
        on_anomaly: Callable[[AnomalyEvent], Any] | None,
        agree: Agree | None,
        raise_on_stop: bool = True,
        micro_step_tables: frozenset[str] = frozenset(V2_MONITORS),
        tables: RowTables | None = None,
        dump_folder: Path | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self.rules = OnlineRules(config, rank)
        self.log = EventLog(rank_dir, first_step)
        self.output_dir = output_dir
        self.clock = clock
        self.model = model
        self.on_anomaly = on_anomaly
        self.agree = agree
        self.raise_on_stop = raise_on_stop
        self.tables: RowTables = tables if tables is not None else V2Tables(micro_step_tables)
        self.dump_folder = dump_folder if dump_folder is not None else output_dir / DUMP_FOLDER
        self.stop_requested: AnomalyStop | None = None
        self.events: list[AnomalyEvent] = []
        self.disabled = False
        self._judged: dict[str, int] = {}
        self._reported: dict[int, set[str]] = {}
        self._skipped: set[int] = set()
        self._dump: _DumpAfter | None = None
        self._dumped = False
        self._end_step: Callable[[], None] | None = None
        self._close: Callable[[], None] | None = None
        self.full: FullTensors | None = None
        self._full_keys: frozenset[FullKey] | None = None

    def see_full_tensors(self, live: FullTensors) -> None:
        """Judge the sharded rows on the full tensors' values of ``live`` (see the module doc;
        its rows are known once the session attached it: read at the first batch); with
        ``before_update``, ``live`` gathers the rows known before the update in the pre-step hook."""
        self.full, self._full_keys = live, None
        if self.config.before_update:
            live.judge_before_update()

    def _sharded(self) -> frozenset[FullKey]:
        if self.full is None:
            return frozenset()
        if self._full_keys is None:
            self._full_keys = frozenset((key[0], key[1], key[2]) for key in self.full.sharded())
        return self._full_keys

    def bind(self, end_step: Callable[[], None], close: Callable[[], None]) -> None:
        """The session's ``end_step`` and ``close`` (a stop before the update ends the step and
        closes the session itself, the optimizer's post-step hook never running)."""
        self._end_step, self._close = end_step, close

    # -- the session's calls -------------------------------------------------------------
    def on_batch(self, probe: Probe, batch: StepBatch) -> None:
        """Judge a monitor's rows of a step (those the pre-step check did not judge already)."""
        if self.disabled or not self.tables.judged(probe.name):
            return
        try:
            done = self._judged.pop(probe.name, 0) if batch.step == self.clock.step else 0
            self._judge(probe, batch.step, batch.rows()[done:], done)
        except Exception as exc:  # noqa: BLE001 - the watch never breaks training
            self._fail(exc)

    def _judge(self, probe: Probe, step: int, rows: Rows, done: int) -> None:
        """Judge ``rows`` of ``probe`` at ``step``, the first being its ``done``-th row of the step."""
        ops = probe.spec.ops
        for table, offset, group in self.tables.groups(probe.name, rows):
            self.rules.judge(
                table,
                step,
                ops,
                self._full_rows(table, step, ops, group),
                skipped=step in self._skipped,
                first_position=done + offset,
            )

    def before_update(self, probes: Sequence[Probe]) -> None:
        """With ``before_update``: judge the rows known before the update; on a stop, keep the
        update from being applied (:class:`SkipUpdate`)."""
        if not self.config.before_update:
            return
        step = self.clock.step
        fresh: list[AnomalyEvent] = []
        if not self.disabled:
            try:
                for probe in probes:
                    if self.tables.judged(probe.name) and not probe.disabled:
                        rows = probe.rows.snapshot()  # one host copy per device
                        done = self._judged.get(probe.name, 0)  # several optimizers: each pre-step sees more rows
                        self._judge(probe, step, rows[done:], done)
                        self._judged[probe.name] = len(rows)
                fresh = [self._marked(e) for e in self._fresh(step, self.rules.current(step))]
            except Exception as exc:  # noqa: BLE001 - the watch never breaks training
                self._fail(exc)
                fresh = []
        self._report(fresh)
        if self._stopping(step, fresh):  # a disabled watch still takes part: no rank waits for it
            if not self.raise_on_stop:
                raise SkipUpdate()  # the trainer callbacks' step wrapper ends the step, the trainer stops
            if self._end_step is not None and self._close is not None:
                self._end_step()  # the step's rows, written: no update, so no post-step hook
                self._close()
            raise self.stop_requested  # type: ignore[misc]

    def skipped(self, step: int) -> None:
        """GradScaler skipped ``step``'s update: its backward rows are not anomalies."""
        self._skipped.add(step)

    def at_boundary(self, step: int, close: Callable[[], None] | None) -> None:
        """``step`` ended: report its new events, run a dump, stop if a rank saw an anomaly."""
        self._skipped = {s for s in self._skipped if s >= step}
        self._judged.clear()
        fresh: list[AnomalyEvent] = []
        if not self.disabled:
            try:
                ended = [self._marked(e) for e in self.rules.end_step(step)]
                fresh = [e for e in ended if e.kind not in self._reported.get(e.step, set())]
                self._reported = {}
            except Exception as exc:  # noqa: BLE001 - the watch never breaks training
                self._fail(exc)
                fresh = []
        self._report(fresh)
        self._run_dump(step, bool(fresh), closing=close is None)
        if close is not None and self._stopping(step, fresh):  # a disabled watch still takes part
            if self.raise_on_stop:
                close()
                raise self.stop_requested  # type: ignore[misc]

    def _full_rows(self, table: str, step: int, ops: Sequence[str], rows: Rows) -> Rows:
        """``rows`` with each sharded row's values those of its full tensor (where known)."""
        sharded = self._sharded()
        if self.full is None or not any((table, key.name, key.scope) in sharded for key, _ in rows):
            return rows
        merged = self.full.global_stats(step)
        out = []
        for key, values in rows:
            full = merged.get((table, key.name, key.scope)) if (table, key.name, key.scope) in sharded else None
            out.append((key, [full.get(op, v) for op, v in zip(ops, values)] if full is not None else values))
        return out

    def _marked(self, event: AnomalyEvent) -> AnomalyEvent:
        """``event`` as a :class:`FullTensorEvent` where it is of a sharded row's full tensor."""
        if self.full is None or (event.table, event.name, event.scope) not in self._sharded():
            return event
        holders = self.full.holders(event.step, (event.table, event.name, event.scope))
        if holders is None:
            return event
        bad = holders.bad_ranks if event.kind == "nonfinite" and holders.bad_ranks else None
        given = {f.name: getattr(event, f.name) for f in fields(AnomalyEvent)}
        if bad:
            given["rank"] = min(bad)
        return FullTensorEvent(**given, ranks=holders.ranks, held=holders.held, bad_ranks=bad)

    # -- acting --------------------------------------------------------------------------
    def _fresh(self, step: int, events: list[AnomalyEvent]) -> list[AnomalyEvent]:
        """The events of ``step`` not reported yet (the pre-step check may have reported some)."""
        seen = self._reported.setdefault(step, set())
        fresh = [e for e in events if e.kind not in seen]
        seen.update(e.kind for e in fresh)
        return fresh

    def _report(self, events: list[AnomalyEvent]) -> None:
        for event in events:
            self.events.append(event)
            self.log.record(event, self.config.actions)
            if "log" in self.config.actions:
                logger.warning("trainprobe: anomaly: %s", event.line())
            if self.on_anomaly is not None:
                self._call_back(event)

    def _call_back(self, event: AnomalyEvent) -> None:
        collecting, self.clock.collecting = self.clock.collecting, False  # a rerun is not recorded
        try:
            assert self.on_anomaly is not None
            self.on_anomaly(event)
        except AnomalyStop:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's callback never breaks training
            error_once(f"on-anomaly-{id(self)}", f"trainprobe: the on_anomaly callback raised {type(exc).__name__}: {exc}")
        finally:
            self.clock.collecting = collecting

    def _stopping(self, step: int, fresh: list[AnomalyEvent]) -> bool:
        """Whether the run stops at ``step`` (every rank answers the same: they agree)."""
        if not self.config.stops or self.stop_requested is not None:
            return False
        mine = bool(fresh)
        ranks = self.agree(mine) if self.agree is not None else ((self.rank,) if mine else ())
        if not ranks:
            return False
        self.stop_requested = AnomalyStop(step, tuple(fresh), ranks)
        logger.warning("%s", self.stop_requested)
        return True

    def _run_dump(self, step: int, found: bool, *, closing: bool) -> None:
        if self._dump is not None:
            try:
                done = self._dump.at_boundary(step, closing)
            except Exception as exc:  # noqa: BLE001 - dumping never breaks training
                error_once(f"anomaly-dump-{id(self)}", f"trainprobe: the anomaly dump failed ({exc}); it is stopped")
                done = True
            if done:
                self._dump = None
            return
        if found and self.config.dumps and not closing and not self.config.stops and not self._dumped:
            self._dumped = True  # one dump per run: the steps after the first anomaly
            try:
                self._dump = _DumpAfter(self.config, self.dump_folder, step, self.model)
            except Exception as exc:  # noqa: BLE001 - as above
                error_once(f"anomaly-dump-{id(self)}", f"trainprobe: the anomaly dump could not start ({exc})")

    def close(self) -> None:
        """The monitor stops: end a dump still running."""
        if self._dump is not None:
            self._dump.finish()
            self._dump = None

    def _fail(self, exc: BaseException) -> None:
        self.disabled = True
        error_once(
            f"anomaly-watch-{id(self)}",
            f"trainprobe: the online anomaly rules failed ({type(exc).__name__}: {exc}); they are off for the rest "
            "of the run, training and the monitors go on",
            traceback=True,
        )


class _DumpAfter:
    """A precision dump of the steps after ``step`` (``config.dump.steps`` of them), driven from
    the monitor's step boundaries: started at the boundary of ``step``, each later boundary
    writes the step dumped and starts the next; the API wrappers are removed at the end."""

    def __init__(self, config: AnomalyConfig, folder: Path, step: int, model: Any) -> None:
        from trainprobe.dump import PrecisionDebugger

        self.previous = PrecisionDebugger._current
        dump = config.dump
        self.last = step + dump.steps
        self.model = model
        steps = list(range(step + 1, self.last + 1))
        if dump.config is None:
            self.debugger = PrecisionDebugger(dump_path=folder, task="statistics", level="L1", step=steps)
        else:
            self.debugger = PrecisionDebugger(dump.config, dump_path=folder, step=steps)
        self.debugger.set_init_step(step + 1)
        self._start()
        logger.info("trainprobe: anomaly at step %d: dumping steps %d-%d into %s", step, step + 1, self.last, folder)

    def _start(self) -> None:
        self.debugger.start(self.model)

    def at_boundary(self, step: int, closing: bool) -> bool:
        """The step dumped ended: write it; start the next one, or finish. True when finished."""
        self.debugger.step()
        if step >= self.last or closing:
            self.finish()
            return True
        self._start()
        return False

    def finish(self) -> None:
        """Stop dumping and remove what the dump installed (the debugger made before it, if
        any, becomes the current one again)."""
        from trainprobe.dump import PrecisionDebugger
        from trainprobe.dump.api_hooks import uninstall_api_wrappers

        self.debugger.stop()
        PrecisionDebugger._current = self.previous
        if self.previous is None:
            uninstall_api_wrappers()


def skip_update_wrapper(step: Callable[..., Any], end_step: Callable[[], None]) -> Callable[..., Any]:
    """``optimizer.step`` for ``before_update`` under a trainer callback: the original, unless the
    pre-step check raised :class:`SkipUpdate`; then no parameter moves, the step ends (its rows
    written) and the call returns None; the callback stops the trainer at its step end."""

    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return step(*args, **kwargs)
        except SkipUpdate:
            end_step()
            return None

    return guarded
