"""Alerts: rules over the statistics a step produced (they consume records; they write nothing
else).

Rules, checked in the configured order; the first that fires for a row is reported, naming every
op of that row it fired on:

* ``AnomalyTurbulence`` (``threshold`` t): a ``norm`` or ``mean`` value more than ``t`` times its
  running average away from it, above (``> (1+t)·avg``) or below (``< (1-t)·avg``, mirrored for a
  negative average). The running average is over the previous collected values of the same row
  (table, name, micro_step, op) that did not fire (an anomaly does not shift the baseline);
  the first value never fires.
* ``AnomalyNan`` (optional ``threshold`` t): a NaN value, a ``nans`` count above 0, or with ``t``
  any value with ``|value| > t``.

Only values that exist are judged: a parameter without a gradient produces no row, so it is never
an anomaly, and an empty tensor (a module called on a ``(0, n)`` batch, such as a mixture-of-experts
expert that received no token) is written with the engine's placeholders ``min = max = mean =
nan`` (:data:`~trainprobe.engine.stats.ops.EMPTY_TENSOR_VALUES`), which are not values: ``AnomalyNan``
never fires on them. The row itself tells an empty tensor from one holding NaN when its ops include
``norm`` (0 for an empty tensor, NaN for one holding NaN) or ``nans`` (the exact NaN count); with
neither, a row whose ``min``/``max``/``mean`` are all NaN could be either, so it is not reported and
one warning per table says to add ``norm`` or ``nans`` to ``ops``. Real values of an empty
tensor's row (``norm`` = 0, ``nans`` = 0) are judged like any other.

Rows are named by their tag without the op (:func:`~trainprobe.frontdoors.monitor_v1.output.task_tagger`:
``0:fc1.input:0/rank0/actv``, ``0:fc1.weight/rank0/post_grad``, ``0:fc1.weight/rank0/mg_direction``).
The console gets one line per anomalous row in the first step a rule fires, then one line per
step and rule while it keeps firing, and a summary when it stops or the run ends
(:class:`ConsoleBudget`; colour only when the stream is a terminal); with
``alert.dump`` every anomaly of the run is kept in ``<MONITOR_OUTPUT_DIR>/anomaly_detected/rank<r>/
anomaly.json`` (see :mod:`trainprobe.frontdoors.monitor_v1.anomaly_dump`: valid JSON after every step, each
write costing only the new entries). The detector runs on the writer thread.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from trainprobe.engine.layout import ANOMALY_FILE
from trainprobe.engine.log import warn_once
from trainprobe.engine.records import RowKey, StepBatch
from trainprobe.engine.stats.ops import EMPTY_TENSOR_VALUES
from trainprobe.frontdoors.monitor_v1.anomaly_dump import AnomalyFile
from trainprobe.frontdoors.monitor_v1.config import AlertRule
from trainprobe.frontdoors.monitor_v1.output import task_tagger

TURBULENCE = "AnomalyTurbulence"
TURBULENCE_OPS = ("norm", "mean")
PLACEHOLDER_OPS: frozenset[str] = frozenset(op for op, v in EMPTY_TENSOR_VALUES.items() if math.isnan(v))
"""Ops whose value for an empty tensor is a NaN placeholder (``min``, ``max``, ``mean``)."""
EMPTY_PROOF_OPS: frozenset[str] = frozenset({"norm", "nans"})
"""Ops that tell an empty tensor's row from a NaN tensor's: ``norm`` is 0 for an empty tensor and
NaN for any tensor holding NaN; ``nans`` counts NaN elements exactly."""


@dataclass(frozen=True, slots=True)
class PipelineContext:
    """Where this rank sits: its pipeline stage and the ranks of its pipeline group."""

    rank: int
    pp_stage: int
    group_mates: tuple[int, ...]


class _Average:
    __slots__ = ("count", "total")

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0


def _baseline(history: _Average | None) -> float | None:
    """The running mean an op's value is compared with (None before any value)."""
    return history.total / history.count if history is not None and history.count else None


def _turbulent(value: float, history: _Average | None, threshold: float) -> bool:
    if history is None or history.count == 0 or not math.isfinite(value):
        return False
    avg = history.total / history.count
    if avg == 0:
        return False
    deviation = abs(value - avg)
    return deviation > threshold * abs(avg)


def empty_tensor_row(ops: tuple[str, ...], values: list[float]) -> bool | None:
    """Whether a row of statistics is an empty tensor's (see the module docstring).

    Returns:
        False when a value differs from :data:`~trainprobe.engine.stats.ops.EMPTY_TENSOR_VALUES` (the
        tensor has elements), True when the row equals it and holds ``norm`` or ``nans`` (only an
        empty tensor, or for ``mean`` one holding both infinities but no NaN, gives that row),
        None when the ops cannot tell (the row equals an empty tensor's but has neither).
    """
    for op, value in zip(ops, values):
        empty = EMPTY_TENSOR_VALUES[op]
        if math.isnan(empty) != math.isnan(value) or (not math.isnan(value) and value != empty):
            return False
    return True if EMPTY_PROOF_OPS.intersection(ops) else None


def _nan_like(op: str, value: float, threshold: float | None) -> bool:
    if math.isnan(value):
        return True
    if op == "nans":
        return value > 0
    return threshold is not None and abs(value) > threshold


class AlertDetector:
    """Checks every row of every batch against ``rules`` (a sink-shaped record consumer).

    Args:
        rules: the configured rules, in priority order.
        ops: table → op names (value order); rows of other tables (histograms) are not judged.
        table_of: the table of a row.
        context: rank, pipeline stage and group mates for the dump.
        dump_dir: folder of ``anomaly.json`` (None: no dump).
        stream: where the console lines go (default ``sys.stdout``).
        tag_of: the tag of a row (table, key), default ``task_tagger(context.rank, False)``.
        earlier: the detector of the run's previous session, with the same ``rules`` and
            ``dump_dir``: its running state (averages, counts, the dump file, the console's
            streaks) goes on here, so a reconfiguration that keeps the alert settings keeps
            judging against the same baselines and appending to the same ``anomaly.json``.

    Raises:
        ValueError: ``earlier`` has other rules or another dump folder.

    Attributes:
        count: anomalies found so far.
        latest: the anomalies of the latest batch that had any (key → dump entry).
    """

    def __init__(
        self,
        rules: tuple[AlertRule, ...],
        ops: dict[str, tuple[str, ...]],
        table_of: Callable[[str, RowKey], str],
        context: PipelineContext,
        dump_dir: Path | None,
        stream: TextIO | None = None,
        tag_of: Callable[[str, RowKey], str] | None = None,
        *,
        earlier: AlertDetector | None = None,
    ) -> None:
        self.rules = rules
        self.tag_of = tag_of or task_tagger(context.rank, False)
        self.ops = ops
        self.table_of = table_of
        self.context = context
        self.dump_dir = dump_dir
        self.stream = stream
        self.count = 0
        self.latest: dict[str, dict[str, Any]] = {}
        self._file = AnomalyFile(dump_dir / ANOMALY_FILE) if dump_dir is not None else None
        self._history: dict[tuple[str, str, int | None], dict[str, _Average]] = {}
        self._call_id = 0
        self._seen: dict[str, tuple[float, float | None]] = {}
        self._console = ConsoleBudget()
        if earlier is not None:
            self._go_on_from(earlier)

    def _go_on_from(self, earlier: AlertDetector) -> None:
        """Take over ``earlier``'s running state (see ``earlier`` in the class docstring)."""
        if earlier.rules != self.rules or earlier.dump_dir != self.dump_dir:
            raise ValueError("AlertDetector(earlier=...): the earlier detector has other rules or another dump folder")
        self.count, self.latest, self._file = earlier.count, earlier.latest, earlier._file
        self._history, self._call_id, self._seen = earlier._history, earlier._call_id, earlier._seen
        self._console = earlier._console

    def write(self, batch: StepBatch) -> None:
        found: dict[str, dict[str, Any]] = {}
        self._console.begin(batch.step, self._print)
        for key, values in batch.rows():
            self._call_id += 1
            table = self.table_of(batch.monitor, key)
            fired = self._check(table, key, values)
            if fired is not None:
                name, entry = self._report(batch.step, table, key, *fired)
                found[name] = entry
        self._console.end_batch(batch.step, self._print)
        if found:
            self.count += len(found)
            self.latest = found
            if self._file is not None:
                self._file.append(found)

    def _check(self, table: str, key: RowKey, values: list[float]) -> tuple[str, list[str]] | None:
        ops = self.ops.get(table)
        if ops is None:  # not statistics (histograms): nothing to judge
            return None
        history = self._history.get((table, key.name, key.micro_step))
        if history is None:
            history = self._history[(table, key.name, key.micro_step)] = {}
        result: tuple[str, list[str]] | None = None
        for rule in self.rules:
            threshold = rule.threshold
            if rule.rule_name == "AnomalyNan":
                placeholders = self._placeholders(table, ops, values)
                hit = [op for op, v in zip(ops, values) if op not in placeholders and _nan_like(op, v, threshold)]
            else:
                assert threshold is not None
                hit = [
                    op
                    for op, v in zip(ops, values)
                    if op in TURBULENCE_OPS and _turbulent(v, history.get(op), threshold)
                ]
            if hit:
                result = (rule.rule_name, hit)
                self._seen = {op: (v, _baseline(history.get(op))) for op, v in zip(ops, values) if op in hit}
                break
        fired = result[1] if result is not None else ()
        for op, v in zip(ops, values):
            if op in TURBULENCE_OPS and op not in fired and math.isfinite(v):
                avg = history.get(op)
                if avg is None:
                    avg = history[op] = _Average()
                avg.count += 1
                avg.total += v
        return result

    @staticmethod
    def _placeholders(table: str, ops: tuple[str, ...], values: list[float]) -> frozenset[str]:
        """The ops of a row whose NaN is an empty tensor's placeholder, not a value (none unless
        the row has a NaN ``min``/``max``/``mean``); warns once per table when the ops cannot tell."""
        nan_ops = frozenset(op for op, v in zip(ops, values) if op in PLACEHOLDER_OPS and math.isnan(v))
        if not nan_ops:
            return nan_ops
        empty = empty_tensor_row(ops, values)
        if empty is None:
            warn_once(
                f"v1-alert-empty-or-nan-{table}",
                f"trainprobe alert: AnomalyNan cannot tell NaN {'/'.join(sorted(nan_ops))} values of table "
                f"{table!r} from an empty tensor's placeholders (ops {list(ops)} hold neither 'norm' nor "
                "'nans'), so such rows are not reported; add 'norm' or 'nans' to ops",
            )
        return nan_ops if empty is not False else frozenset()

    def _report(self, step: int, table: str, key: RowKey, rule: str, ops: list[str]) -> tuple[str, dict[str, Any]]:
        """Print the console line; return the dump key and entry."""
        ctx = self.context
        micro = 0 if key.micro_step is None else key.micro_step
        tag = self.tag_of(table, key)
        signals = ", ".join(f"({tag!r}, {op!r})" for op in ops)
        message = f"Rule {rule} reports anomaly signal in {signals} at step {step}."
        entry = {
            "rank": ctx.rank,
            "step": step,
            "micro_step": micro,
            "pp_stage": ctx.pp_stage,
            "vpp_stage": key.vpp_stage,
            "call_id": self._call_id,
            "tag_name": tag,
            "message": message,
            "group_mates": list(ctx.group_mates),
        }
        if self._console.admit(step, rule, tag, (table, key.vpp_stage, key.name), self._print):
            self._print(console_line(rule, tag, step, self._seen))
        return f"{tag}_step_{step}_call_{self._call_id}", entry

    def _print(self, text: str) -> None:
        stream = self.stream or sys.stdout
        line = f"trainprobe alert: {text}"
        if getattr(stream, "isatty", lambda: False)():
            line = f"\033[1;33m{line}\033[0m"
        print(line, file=stream, flush=True)

    def close(self, reached: int | None = None) -> None:
        """Print the console lines still due (the last step's, the open streaks' summaries); the
        dump is complete after every write."""
        self._console.end_run(self._print)


MAX_LINES_PER_STEP = 10
"""Console lines per step in a rule's first step of anomalies; further anomalies of that step are
summed up in one line."""


def console_line(rule: str, tag: str, step: int, seen: dict[str, tuple[float, float | None]]) -> str:
    """One anomaly event on the console: rule, step, tag, and each op's value (with the running
    average it was compared with, for ``AnomalyTurbulence`` only: the other rules use none).

    Example: ``Rule AnomalyTurbulence at step 5: 0:fc1.weight/rank0/post_grad norm = 12.3 (baseline 0.104)``.
    """
    parts = []
    for op, (value, baseline) in seen.items():
        base = f" (baseline {baseline:.6g})" if baseline is not None and rule == TURBULENCE else ""
        parts.append(f"{op} = {value:.6g}{base}")
    return f"Rule {rule} at step {step}: {tag} {', '.join(parts)}"


def _plural(count: int) -> str:
    return f"{count} anomal{'y' if count == 1 else 'ies'}"


class _Streak:
    """A rule's run of consecutive collected steps with anomalies."""

    __slots__ = ("events", "first", "last", "steps")

    def __init__(self, step: int) -> None:
        self.first = self.last = step
        self.steps = 0
        self.events = 0


class ConsoleBudget:
    """Which anomaly events reach the console (``anomaly.json`` keeps every event).

    * The first step of a rule's streak (consecutive collected steps where it fires): one line per
      row (the same row of later micro-batches folded into it), at most
      :data:`MAX_LINES_PER_STEP` lines, then one line for the rest of the batch.
    * Each later step of the streak: one line for the rule, when the step is over (the first
      batch of a later step arrives, or the run ends): ``Rule AnomalyNan at step 7: 14 anomalies
      again, e.g. <tag> (anomaly.json has all)``.
    * When the streak ends (a collected step where the rule does not fire, or the end of the run)
      and it lasted more than one step: one summary line, ``Rule AnomalyNan: 84 anomalies over 6
      steps (2-7); anomaly.json has all``.
    """

    def __init__(self) -> None:
        self._step: int | None = None
        self._rows: set[tuple[object, ...]] = set()
        self._printed = 0
        self._held = 0
        self._streaks: dict[str, _Streak] = {}
        self._this_step: dict[str, tuple[int, str]] = {}

    def begin(self, step: int, emit: Callable[[str], None]) -> None:
        """A batch of ``step`` arrives (with or without anomalies): when it starts a new step, the
        previous one is over (``emit`` prints its lines)."""
        if step != self._step:
            self.end_step(emit)
            self._step, self._rows, self._printed, self._held = step, set(), 0, 0

    def admit(self, step: int, rule: str, tag: str, row: tuple[object, ...], emit: Callable[[str], None]) -> bool:
        """Count the event of ``row`` (tagged ``tag``) by ``rule`` at ``step``; whether it gets
        its own line. ``emit`` prints the lines of a step that is over."""
        self.begin(step, emit)
        count, first_tag = self._this_step.get(rule, (0, tag))
        self._this_step[rule] = (count + 1, first_tag)
        streak = self._streaks.get(rule)
        if streak is None:
            streak = self._streaks[rule] = _Streak(step)
        streak.events += 1
        if streak.first != step:  # a later step of the streak: one line at the end of the step
            return False
        if row in self._rows:
            self._held += 1
            return False
        self._rows.add(row)
        if self._printed >= MAX_LINES_PER_STEP:
            self._held += 1
            return False
        self._printed += 1
        return True

    def end_batch(self, step: int, emit: Callable[[str], None]) -> None:
        """Print one line for the events of this batch held back in a streak's first step."""
        if self._held and step == self._step:
            emit(f"step {step}: {self._held} more anomal{'y' if self._held == 1 else 'ies'} (anomaly.json has all)")
            self._held = 0

    def end_step(self, emit: Callable[[str], None]) -> None:
        """The current step is over: its one line per rule in a later step of a streak, and the
        summary of every streak that ended (its rule did not fire this step)."""
        if self._step is None:
            return
        step = self._step
        for rule, streak in list(self._streaks.items()):
            if rule not in self._this_step:
                del self._streaks[rule]
                self._summary(rule, streak, emit)
                continue
            streak.steps += 1
            streak.last = step
            if streak.first != step:
                count, tag = self._this_step[rule]
                emit(f"Rule {rule} at step {step}: {_plural(count)} again, e.g. {tag} (anomaly.json has all)")
        self._this_step = {}

    def end_run(self, emit: Callable[[str], None]) -> None:
        """The run (or the session) ends: close the step, then sum up every open streak."""
        self.end_step(emit)
        for rule, streak in self._streaks.items():
            self._summary(rule, streak, emit)
        self._streaks = {}
        self._step = None

    @staticmethod
    def _summary(rule: str, streak: _Streak, emit: Callable[[str], None]) -> None:
        if streak.steps > 1:
            emit(
                f"Rule {rule}: {_plural(streak.events)} over {streak.steps} steps "
                f"({streak.first}-{streak.last}); anomaly.json has all"
            )
