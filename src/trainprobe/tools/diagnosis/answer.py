"""``trainprobe diagnose``: the first anomaly of a run, in execution order, across all ranks.

One run folder in (Monitor V2 ``output_dir`` or Monitor V1 ``MONITOR_OUTPUT_DIR``, trainprobe's or
the reference msProbe's files, CSV or Parquet: whatever :func:`trainprobe.tools.query.layer.connect`
reads); out, a :class:`Diagnosis`: the first anomalies in execution order and each rank's first
anomalous step. An anomaly is

* a NaN/inf (the query layer's :func:`~trainprobe.tools.query.layer.first_nonfinite`), or
* a spike: a value that the spike rule ``rule`` of :mod:`trainprobe.engine.rules` (default
  :data:`~trainprobe.engine.rules.DEFAULT_RULE`, ``recent_max``) flags in its series, replayed
  over every series of the files (:mod:`trainprobe.tools.diagnosis.spikes`): the same rule, the
  same definition as the online rules of Monitor V2;
* a Monitor V1 alert of ``anomaly_detected/rank<r>/anomaly.json``, read as ``anomaly-analyse``
  reads them, where the run has them.

All of them are ordered by :func:`trainprobe.engine.execution_order.execution_key`, the order every
offline tool uses. The events the online rules wrote during the run
(``rank_<r>/anomaly_events.jsonl``) are shown beside the answer.

Example::

    from trainprobe.tools.diagnosis.answer import diagnose
    result = diagnose("monitor_output")
    print(result.line())              # the one line: step, rank, table, tensor, op, value
    result.first                      # Anomaly or None; result.anomalies: the first few
    diagnose("monitor_output", rule="median", spike_factor=5)   # another rule, its factor
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from trainprobe.engine.anomaly.finding import Anomaly, ranks_text, skipped_text, step_spans
from trainprobe.engine.errors import ConfigError
from trainprobe.engine.execution_order import table_of
from trainprobe.engine.rules import DEFAULT_RULE, RULES, Rule, rule_named
from trainprobe.engine.skip_log import run_skips
from trainprobe.tools.diagnosis.online import OnlineEvents, online_events
from trainprobe.tools.diagnosis.spikes import keep_spikes
from trainprobe.tools.engines.base import ENGINES, MAIN, Engine
from trainprobe.tools.engines.duckdb_engine import DuckEngine, Staging
from trainprobe.tools.engines.spark_engine import on_spark
from trainprobe.tools.runs.files import RunFile
from trainprobe.tools.sql.diagnose import (
    SPIKE_OPS,
    exempt_sql,
    first_spikes_sql,
    nonfinite_by_rank_sql,
    spiking_pieces_sql,
    step_starts_sql,
)
from trainprobe.tools.sql.full import is_sharded

DEFAULT_LIMIT = 6
"""How many anomalies a diagnosis lists: the first and the next five."""
MEMORY_LIMIT = "1GB"
"""DuckDB's memory limit for a diagnosis (it spills to a temporary folder beyond it)."""
_SPIKES = "__diagnose_spikes"
_LOCAL_SPIKES = "__diagnose_local_spikes"
"""Full-tensor reading: the spikes of the rank-local rows (which rank's piece spiked)."""
_CANDIDATES = 500


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """What :func:`diagnose` found.

    Attributes:
        run: the run folder.
        anomalies: the first anomalies in execution order (at most ``limit``), up to the first
            NaN/inf's step.
        first_nonfinite: the first NaN/inf (the query layer's answer), also when a spike came first.
        first_step_by_rank: each rank with an anomaly → its first anomalous step.
        ranks: every rank of the run.
        rule: the spike rule's name (:data:`trainprobe.engine.rules.RULES`).
        rule_params: its parameters (its defaults, with the options given).
        rule_text: the rule in one line (:meth:`~trainprobe.engine.rules.base.Rule.describe`).
        alerts: Monitor V1 alert events read (0 without ``anomaly_detected``).
        baseline: the ``diff`` answer's first line with ``baseline``, else None.
        sharded: whether the run's ``tensor_layout.json`` files mark shards or replicas.
        tensors: ``"full"`` (a sharded run's parameter tables read as full tensors: shards
            merged, replicas counted once) or ``"rank-local"`` (each rank's rows as written).
        skipped: rank → the steps GradScaler skipped there (``amp_skips.jsonl``); their
            backward rows (scaled gradients) are not anomalies.
        online: the events the online rules wrote during the run (``anomaly_events.jsonl``).
    """

    run: str
    anomalies: list[Anomaly]
    first_nonfinite: Anomaly | None
    first_step_by_rank: dict[int, int]
    ranks: list[int]
    rule: str = DEFAULT_RULE
    rule_params: dict[str, Any] = field(default_factory=dict)
    rule_text: str = DEFAULT_RULE
    alerts: int = 0
    baseline: str | None = None
    sharded: bool = False
    tensors: str = "rank-local"
    skipped: dict[int, list[int]] = field(default_factory=dict)
    online: OnlineEvents = field(default_factory=OnlineEvents)

    @property
    def first(self) -> Anomaly | None:
        """The first anomaly, or None for a clean run."""
        return self.anomalies[0] if self.anomalies else None

    @property
    def first_ranks(self) -> list[int]:
        """The ranks that saw an anomaly first, in execution order: those of the first anomalous
        step whose first anomaly ran as early within it as any (same phase, table and place;
        under DDP a rank whose batch broke in forward comes before the ranks its gradients
        reach in the all-reduce)."""
        at_start = self._ranks_at_start()
        keys: dict[int, tuple[int, ...]] = {}
        for anomaly in self.anomalies:  # in execution order, across ranks
            if anomaly.rank in at_start and anomaly.step == min(self.first_step_by_rank.values()):
                keys.setdefault(anomaly.rank, anomaly.order_key()[:-1])  # without the rank
        if not keys:
            return at_start
        best = min(keys.values())
        return sorted(r for r, k in keys.items() if k == best)

    def _ranks_at_start(self) -> list[int]:
        """The ranks whose first anomaly is at the first anomalous step."""
        if not self.first_step_by_rank:
            return []
        start = min(self.first_step_by_rank.values())
        return sorted(r for r, s in self.first_step_by_rank.items() if s == start)

    def ranks_line(self) -> str:
        """One rank alone first, or all ranks at once: the on-call's first question."""
        if not self.first_step_by_rank:
            return "ranks: none saw an anomaly"
        first = self.first_ranks
        start = min(self.first_step_by_rank.values())
        later = sorted((s, r) for r, s in self.first_step_by_rank.items() if r not in first)
        if len(self.ranks) == 1:
            head = f"ranks: the only rank (step {start})"
        elif len(first) == len(self.ranks):
            head = f"ranks: all {len(first)} ranks at once (step {start})"
        elif len(first) == 1:
            head = f"ranks: rank {first[0]} alone first (step {start})"
        else:
            head = f"ranks: {len(first)} of {len(self.ranks)} ranks first (step {start}): {ranks_text(first)}"
        tail = "; then " + ", ".join(
            f"rank {r} at step {s}" + (" (later in the step)" if s == start else "") for s, r in later[:8]
        ) if later else ""
        more = f" and {len(later) - 8} more" if len(later) > 8 else ""
        clean = len(self.ranks) - len(self.first_step_by_rank)
        none = f"; {clean} rank(s) clean" if clean else ""
        return head + tail + more + none

    def line(self) -> str:
        """The one line: the first anomaly, or that none was found (and, where GradScaler skipped
        steps, how many: their inf is the scaler's, not an anomaly); a first anomaly in a step
        GradScaler skipped says so."""
        if self.first is None:
            text = f"no anomaly: no NaN/inf and {self._no_spike()} in {len(self.ranks)} rank(s)"
            steps = sorted({s for skipped in self.skipped.values() for s in skipped})
            return text + (f"; {len(steps)} step(s) skipped by GradScaler ({step_spans(steps)})" if steps else "")
        first = self.first
        also = " (a step GradScaler skipped)" if first.step in self.skipped.get(first.rank, ()) else ""
        return "first anomaly: " + first.describe() + also

    def _no_spike(self) -> str:
        """``no spike above 10x`` (the median rule's words) or ``no spike by the rule recent_max``."""
        if self.rule == "median":
            return f"no spike above {self.rule_params.get('factor', 10.0):g}x"
        return f"no spike by the rule {self.rule}"

    def skipped_line(self) -> str | None:
        """Which steps GradScaler skipped, on which ranks; None where it skipped none."""
        return skipped_text(self.skipped, self.ranks)

    def tensors_line(self) -> str | None:
        """How a sharded run was read; None for an unsharded one."""
        if not self.sharded:
            return None
        if self.tensors == "full":
            return "tensors: full (a sharded run: shards merged, replicas counted once; --rank-local for each rank's rows)"
        return "tensors: rank-local (each rank's pieces as written)"

    def lines(self) -> list[str]:
        """What ``trainprobe diagnose`` prints."""
        out = [self.line()]
        if self.baseline is not None:
            out.append(f"against the baseline: {self.baseline}")
        notes = [n for n in (self.online.line(), self.skipped_line(), self.tensors_line()) if n is not None]
        if self.first is None:
            return out + notes
        out += [f"  then: {a.describe()}" for a in self.anomalies[1:]]
        if self.first_nonfinite is not None and self.first_nonfinite not in self.anomalies:
            out.append(f"first NaN/inf: {self.first_nonfinite.describe()}")
        out.append(self.ranks_line())
        return out + notes

    def to_json(self) -> dict[str, Any]:
        """The ``diagnosis.json`` document (schema in docs/diagnose.md); NaN/inf as strings."""
        return {
            "run": self.run,
            "found": self.first is not None,
            "line": self.line(),
            "first": _anomaly_json(self.first),
            "anomalies": [_anomaly_json(a) for a in self.anomalies],
            "first_nonfinite": _anomaly_json(self.first_nonfinite),
            "ranks": {
                "all": self.ranks,
                "first": self.first_ranks,
                "first_step_by_rank": {str(r): s for r, s in sorted(self.first_step_by_rank.items())},
                "summary": self.ranks_line(),
            },
            "spike_rule": {"name": self.rule, **self.rule_params, "ops": list(SPIKE_OPS), "text": self.rule_text},
            "alerts": self.alerts,
            "baseline": self.baseline,
            "sharded": self.sharded,
            "tensors": self.tensors,
            "skipped_by_gradscaler": {str(r): s for r, s in sorted(self.skipped.items())},
            "online": {"line": self.online.line(), "events": self.online.events},
        }


def diagnose(
    run: str | Path,
    *,
    rule: str = DEFAULT_RULE,
    spike_factor: float | None = None,
    window: int | None = None,
    warmup: int | None = None,
    limit: int = DEFAULT_LIMIT,
    baseline: str | Path | None = None,
    files: Sequence[RunFile] | None = None,
    memory_limit: str = MEMORY_LIMIT,
    engine: str = "duckdb",
    spark: Any = None,
    rank_local: bool = False,
) -> Diagnosis:
    """Diagnose ``run`` (see the module docstring); ``files``: its data files when the caller
    found them already (:func:`~trainprobe.tools.runs.files.find_run_files`); ``memory_limit``:
    DuckDB's (it spills to a temporary folder beyond it; ``trainprobe report`` gives less).

    ``rule``: the spike rule, one of :data:`trainprobe.engine.rules.RULES` (default
    ``recent_max``, the online rules' default too); ``spike_factor``, ``window``, ``warmup``
    set its ``factor``, ``window`` and ``warmup`` parameters (None: the rule's own), for the
    rules that have them (``--warmup`` with ``recent_max``: a ConfigError naming it).

    ``engine="spark"`` runs the same queries on Apache Spark over the run's Parquet files
    (``trainprobe convert RUN --to parquet`` first for a CSV run): ``spark`` is your
    ``SparkSession`` (a cluster's), or None for one in local mode
    (:func:`~trainprobe.tools.engines.spark.spark_session`). The answer is the same as DuckDB's,
    except on a sharded run or one with GradScaler skips: Spark reads the rank-local rows as
    written and does not label skipped steps (a line of the answer says so).

    A **sharded run** (its ``tensor_layout.json`` files mark shards or replicas: FSDP2, tensor
    parallelism, their 2-D mixes) is read in full tensors: the ``weight_grad``, ``param`` and
    ``optimizer`` rows of each tensor's pieces merged
    (:func:`~trainprobe.tools.sql.full.full_view_sql`: min/max exact, norm √Σ norm², nans
    summed, replicas counted once, a NaN/inf copy of a replicated piece preferred), so that
    spikes and NaN/inf are of the tensor the model holds; a full-tensor anomaly names the ranks
    holding the tensor and, for a NaN/inf, whose piece holds it. Other tables (``module``,
    ``cc``) and rank-local rows (``unreduced`` gradients under FSDP) stay one row per rank.
    ``rank_local=True`` reads every rank's rows as written. Each rank's first anomalous step
    (the "ranks" line) is always of the rank-local rows.

    **GradScaler's skipped steps** (``rank_<r>/amp_skips.jsonl``,
    :mod:`trainprobe.engine.skip_log`): the backward rows of a step the scaler skipped on that
    rank (``module`` backward, ``weight_grad``, ``cc``) hold the scaler's overflow, not an
    anomaly: they are left out of the NaN/inf check and of the spike series, and the answer
    lists the skipped steps. Forward and parameter rows of such a step are still checked (a NaN
    in the batch makes the scaler skip too, and is found at its step).

    Three reads of the files: each rank's first non-finite step (the run's first is the least),
    that step's rows (:func:`~trainprobe.tools.sql.questions.first_nonfinite_sql`, over the files of
    its window), and the spike scan up to that step (over the files of those steps).

    Raises:
        ConfigError: bad input, one line: not a folder, no monitor data (an empty folder, unrelated
            CSV files), a precision dump folder (use ``trainprobe compare``), a bad option, a
            malformed ``anomaly.json``; with ``engine="spark"``, a run without Parquet files or
            without the ``[spark]`` extra.
    """
    spike = spike_rule(rule, spike_factor, window, warmup)
    if limit < 1:
        raise ConfigError(f"limit: {limit}; need at least 1")
    if engine not in ENGINES:
        raise ConfigError(f"--engine: one of {', '.join(ENGINES)}, not {engine!r}")
    root = Path(run).expanduser()
    _refuse_dump(root)
    found = _run_files(root, files)
    skipped = run_skips(root)
    sharded = is_sharded(root)
    read = _Read(full=sharded and not rank_local and engine == "duckdb", skipped=skipped if engine == "duckdb" else {})
    if engine == "spark":
        nonfinite, spikes, by_rank = _scan_on_spark(root, found, spark, spike, limit)
    else:
        nonfinite, spikes, by_rank = _scan_on_duckdb(root, found, memory_limit, spike, limit, read)
    alerts = _alerts(root)
    found_anomalies = _merge(nonfinite + spikes, alerts[:_CANDIDATES])
    for event in alerts:
        by_rank[event.rank] = min(by_rank.get(event.rank, event.step), event.step)
    return Diagnosis(
        run=str(root),
        anomalies=sorted(found_anomalies, key=Anomaly.order_key)[:limit],
        first_nonfinite=min(nonfinite, key=Anomaly.order_key) if nonfinite else None,
        first_step_by_rank={int(r): int(s) for r, s in by_rank.items()},
        ranks=sorted({f.rank for f in found}),
        rule=spike.name,
        rule_params=spike.params(),
        rule_text=spike.describe(),
        alerts=len(alerts),
        baseline=baseline_line(root, Path(baseline)) if baseline is not None else None,
        sharded=sharded,
        tensors="full" if read.full else "rank-local",
        skipped=read.skipped,
        online=online_events(root),
    )


def spike_rule(name: str, factor: float | None, window: int | None, warmup: int | None) -> Rule[Any]:
    """The rule ``name`` with the options given (None: the rule's own).

    Raises:
        ConfigError: an unknown rule (the message lists them), an option the rule has no
            parameter for (``--warmup: the spike rule 'recent_max' has no warmup ...``), a bad value.
    """
    if name not in RULES:
        raise ConfigError(f"--rule: {name!r} is not a spike rule; one of {', '.join(RULES)}")
    if factor is not None and not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 1):
        raise ConfigError(f"--spike-factor: {factor!r}; give a number above 1")
    own = RULES[name]().params()
    given = {"factor": factor, "window": window, "warmup": warmup}
    params = {k: v for k, v in given.items() if v is not None}
    for key in params:
        if key not in own:
            flag = "--spike-factor" if key == "factor" else f"--{key}"
            raise ConfigError(
                f"{flag}: the spike rule {name!r} has no {key} parameter (its parameters: {', '.join(own)}); leave {flag} out"
            )
    try:
        return rule_named(name, **params)
    except ValueError as exc:
        raise ConfigError(f"--rule {name}: {exc}") from None


@dataclass(frozen=True, slots=True)
class _Read:
    """How the DuckDB scan reads the run: ``full`` tensors; the ``skipped`` steps by rank."""

    full: bool = False
    skipped: dict[int, list[int]] = field(default_factory=dict)


def _scan_on_duckdb(
    root: Path, found: Sequence[RunFile], memory_limit: str, rule: Rule[Any], limit: int, read: _Read
) -> tuple[list[Anomaly], list[Anomaly], dict[int, int]]:
    from trainprobe.tools.query.layer import require, short_error

    duck = require("duckdb")
    staging = None
    if read.full or read.skipped:
        staging = Staging(full=read.full, exempt=lambda view: exempt_sql(view, read.skipped))
    engine: DuckEngine | None = None
    try:
        engine = DuckEngine(root, found, staging=staging, memory_limit=memory_limit)
        engine.seal()
        nonfinite, spikes, by_rank = _scan(engine, found, rule, limit, root)
        if engine.full:  # the first ``limit`` of each: all the answer can show (a query or two each)
            nonfinite = _held(engine, sorted(nonfinite, key=Anomaly.order_key)[:limit])
            spikes = _held(engine, sorted(spikes, key=Anomaly.order_key)[:limit])
        return nonfinite, spikes, by_rank
    except duck.Error as exc:
        raise ConfigError(f"run: {str(root)!r}: the data could not be read: {short_error(str(exc))}") from None
    finally:
        if engine is not None:
            engine.release()


def _scan_on_spark(
    root: Path, found: Sequence[RunFile], session: Any, rule: Rule[Any], limit: int
) -> tuple[list[Anomaly], list[Anomaly], dict[int, int]]:
    failure = f"run: {str(root)!r}: Spark could not read the data"
    with on_spark(session, failure) as engine:
        engine.attach(MAIN, root)
        return _scan(engine, [f for f in found if f.format == "parquet"], rule, limit, root)


def _scan(
    engine: Engine, files: Sequence[RunFile], rule: Rule[Any], limit: int, root: Path
) -> tuple[list[Anomaly], list[Anomaly], dict[int, int]]:
    """The non-finite candidates, the spike candidates and each rank's first anomalous step
    (non-finite or spike) of the run, on ``engine`` (see :func:`diagnose`)."""
    from trainprobe.tools.sql.questions import first_nonfinite_sql

    views = engine.views()
    if not views:
        raise ConfigError(f"run: {str(root)!r}: its data files hold no complete row yet")
    by_rank: dict[int, int] = dict(engine.fetch_local(  # which rank, as written
        nonfinite_by_rank_sql(views, _nonfinite_conditions(views))))
    last = min(by_rank.values()) if by_rank else None
    nonfinite: list[Anomaly] = []
    if last is not None:
        engine.narrow(last, last)  # CSV: only that step's files
        nonfinite = [_from_nonfinite(row) for row in engine.records(first_nonfinite_sql(engine.views(), last, _CANDIDATES))]
        engine.narrow(min(f.first_step for f in files), last)  # the spike scan reads up to ``last``
        views = engine.views()
    keep_spikes(engine, _SPIKES, views, rule, last)
    spikes = _first_spikes(engine, limit, rule.name)
    firsts = f"SELECT rank, min(step) FROM {_SPIKES} GROUP BY rank"
    if engine.full:
        keep_spikes(engine.local(), _LOCAL_SPIKES, views, rule, last)
        firsts = spiking_pieces_sql(_SPIKES, _LOCAL_SPIKES)
    for rank, step in engine.fetch(firsts):
        by_rank[rank] = min(by_rank.get(rank, step), step)
    return nonfinite, spikes, dict(sorted(by_rank.items()))


def diagnosis_summary(run: str | Path, **options: Any) -> dict[str, Any]:
    """What ``trainprobe report``'s "Diagnosis" section shows: :meth:`Diagnosis.to_json` of
    :func:`diagnose` (``options`` as its keywords) plus ``lines``, the command's text."""
    result = diagnose(run, **options)
    return {**result.to_json(), "lines": result.lines()}


def baseline_line(run: Path, baseline: Path) -> str:
    """``trainprobe diff``'s answer for ``baseline`` (good) against ``run``, in one line
    (:func:`trainprobe.tools.rundiff.answer.diagnose_line`)."""
    from trainprobe.tools.rundiff.answer import diagnose_line

    return diagnose_line(baseline, run)


def _run_files(root: Path, files: Sequence[RunFile] | None = None) -> list[RunFile]:
    """The run's data files (``files`` when the caller found them already), found once for the
    whole diagnosis (the views and the first-NaN/inf query are given them).

    Raises:
        ConfigError: no monitor data file under ``root`` (see
            :func:`~trainprobe.tools.runs.files.find_run_files`), or none with a complete header
            line yet.
    """
    from trainprobe.tools.runs.files import csv_header, find_run_files

    files = list(files) if files is not None else find_run_files(root)
    if all(f.format == "csv" and csv_header(f.path) is None for f in files):
        raise ConfigError(
            f"run: {str(root)!r}: no data file has a complete header line yet (torn: a run killed as it started?)"
        )
    return files


def _refuse_dump(root: Path) -> None:
    """A precision dump folder is not a monitor run: say which command reads it."""
    from trainprobe.tools.runs.files import is_precision_dump

    if is_precision_dump(root):  # a missing path or a file: find_run_files names the problem
        raise ConfigError(
            f"run: {str(root)!r} is a precision dump (dump.json), not monitor output; "
            "compare two dumps with `trainprobe compare`"
        )


def _from_nonfinite(row: dict[str, Any]) -> Anomaly:
    return Anomaly(
        kind="nonfinite",
        step=int(row["step"]),
        rank=int(row["rank"]),
        table=str(row["table"]),
        scope=str(row["scope"]),
        name=str(row["name"]),
        micro_step=row["micro_step"],
        vpp_stage=row["vpp_stage"],
        op=row["op"],
        value=row["value"],
        file=row["file"],
        position=int(row["position"] or 0),
    )


def _first_spikes(engine: Engine, limit: int, rule: str) -> list[Anomaly]:
    """The spike candidates (first of each group in the first ``limit`` spike steps), placed."""
    rows = engine.fetch(first_spikes_sql(_SPIKES, steps=limit, limit=_CANDIDATES))
    if not rows:
        return []
    starts: dict[tuple[str, int, int], tuple[int, str]] = {}
    # file_row is the view's numbering (CSV: a count over the view's files, assigned before any
    # filter); both queries read the same views of one connection, so they share it
    for table in sorted({r[0] for r in rows}):
        steps = sorted({r[2] for r in rows if r[0] == table})
        for rank, step, first_row, file in engine.fetch(step_starts_sql(table, steps)):
            starts[(table, rank, step)] = (first_row, file)
    found = []
    for table, rank, step, micro, vpp, scope, name, op, value, median, file_row in rows:
        first_row, file = starts.get((table, rank, step), (file_row, None))
        found.append(
            Anomaly(
                "spike", step, rank, table, scope, name, micro, vpp, op, value, median, file, file_row - first_row,
                spike_rule=rule,
            )
        )
    return found


def _nonfinite_conditions(views: dict[str, list[str]]) -> dict[str, str]:
    """Per view, SQL true for its non-finite rows: the query layer's test (NaN/inf op, ``nans``
    above 0), the reference's "no tensor" rows (``dtype`` ``nan``) aside, as the layer counts."""
    from trainprobe.tools.sql.questions import nonfinite_sql, ops_of

    out = {}
    for table, columns in views.items():
        skip = " AND dtype IS DISTINCT FROM 'nan'" if "dtype" in columns else ""
        out[table] = f"COALESCE(({nonfinite_sql(ops_of(columns))}){skip}, FALSE)"
    return out


_OP_IN_MESSAGE = re.compile(r"\(\s*'[^']*'\s*,\s*'([A-Za-z_]+)'\s*\)")
_VALUE_IN_MESSAGE = re.compile(r"\b([A-Za-z_]+) = (-?(?:[0-9][0-9.eE+-]*|nan|inf))(?:,|\s|$)")


def _alerts(root: Path) -> list[Anomaly]:
    """Monitor V1's alert events under ``root/anomaly_detected`` (none without it), as anomalies,
    in execution order (``anomaly-analyse``'s)."""
    if not (root / "anomaly_detected").is_dir():
        return []
    from trainprobe.tools.anomalies.order import order_events
    from trainprobe.tools.anomalies.read import load_anomalies

    _, _, events = load_anomalies(root)
    out = []
    for event in order_events(events):
        tag = str(event["tag_name"])
        name, _, table = tag.rpartition("/")
        name = name.rsplit("/rank", 1)[0] if "/rank" in name else name
        name = re.sub(r"^[0-9]+:", "", name)
        message = str(event["message"])
        op, value = _op_and_value(message)
        out.append(
            Anomaly(
                kind="alert",
                step=int(event["step"]),
                rank=int(event["rank"]),
                table=table,
                scope=table,
                name=name,
                micro_step=int(event["micro_step"]),
                vpp_stage=int(event["vpp_stage"]),
                op=op,
                value=value,
                position=int(event["call_id"]),
                source="alert",
                rule=event.rule or None,
            )
        )
    return out


def _op_and_value(message: str) -> tuple[str | None, float | None]:
    """The op and value an alert's message names (``... norm = nan, ...`` as trainprobe writes;
    ``('<tag>', 'min')`` as the reference writes, without a value), else None."""
    found = _VALUE_IN_MESSAGE.search(message)
    if found:
        return found.group(1), float(found.group(2))
    named = _OP_IN_MESSAGE.search(message)
    return (named.group(1) if named else None), None


def _merge(found: list[Anomaly], alerts: list[Anomaly]) -> list[Anomaly]:
    """``found`` with the alerts: an alert on a row found in the files marks that row
    (``files+alert``, its rule); the other alerts are anomalies of their own (kind ``alert``,
    ordered by their call_id)."""
    from trainprobe.engine.execution_order import table_rank

    def key(a: Anomaly, scope: str | None) -> tuple[int, int, str, int]:
        return a.step, a.rank, a.name, table_rank(table_of(a.table, scope), a.name)

    index = {key(a, a.scope): i for i, a in enumerate(found)}
    out = list(found)
    for alert in alerts:
        i = index.get(key(alert, None))
        if i is None:
            out.append(alert)
        elif out[i].source == "files":
            out[i] = Anomaly(**{**asdict(out[i]), "source": "files+alert", "rule": alert.rule})
    return out


def _held(engine: Engine, found: list[Anomaly]) -> list[Anomaly]:
    """``found`` with each full-tensor row of a sharded tensor marked: the ranks holding its
    pieces, how, and for a NaN/inf whose pieces hold it (:attr:`Anomaly.ranks`)."""
    from trainprobe.tools.sql.questions import bad_rows_sql

    layout: dict[tuple[str, str, str | None], dict[int, tuple[str, str | None]]] = {}
    for rank, monitor, name, scope, kind, _, piece, _ in engine.layout():
        layout.setdefault((monitor, name, scope), {})[rank] = (kind, piece)
    views = engine.views()
    out = []
    for anomaly in found:
        holders = {**layout.get((anomaly.table, anomaly.name, None), {}),
                   **layout.get((anomaly.table, anomaly.name, anomaly.scope), {})}
        if not holders or any(kind not in ("shard", "replica") for kind, _ in holders.values()):
            out.append(anomaly)
            continue
        bad: tuple[int, ...] | None = None
        if anomaly.kind == "nonfinite" and anomaly.table in views:
            bad = tuple(r for (r,) in engine.fetch_local(_piece_rows_sql(anomaly, bad_rows_sql(views[anomaly.table]))))
        elif anomaly.kind == "spike":
            bad = tuple(r for (r,) in engine.fetch(_piece_rows_sql(anomaly, "TRUE", _LOCAL_SPIKES)))
        pieces = {piece if piece is not None else f"rank:{r}" for r, (_, piece) in holders.items()}
        held = "shards" if len(pieces) == len(holders) else "replicas, counted once" if len(pieces) == 1 else (
            f"{len(pieces)} shards, replicated")
        rank = min(bad) if bad else anomaly.rank
        out.append(replace(anomaly, rank=rank, ranks=tuple(sorted(holders)), held=held, bad_ranks=bad or None))
    return out


def _piece_rows_sql(anomaly: Anomaly, condition: str, table: str | None = None) -> str:
    """The ranks whose rank-local row of ``anomaly``'s tensor, step and micro-step meets
    ``condition`` (in ``table``, default its view; :data:`_LOCAL_SPIKES`: the rank-local spikes)."""
    from trainprobe.tools.sql.names import ident, text

    def same(column: str, value: Any) -> str:
        return f"{column} IS NULL" if value is None else f"{column} = {int(value)}"

    of_table = f'AND "table" = {text(anomaly.table)} ' if table else ""
    return (
        f"SELECT DISTINCT rank FROM {table or ident(anomaly.table)} WHERE step = {int(anomaly.step)} {of_table}"
        f"AND name = {text(anomaly.name)} AND scope = {text(anomaly.scope)} AND {same('micro_step', anomaly.micro_step)} "
        f"AND {same('vpp_stage', anomaly.vpp_stage)} AND {condition} ORDER BY rank"
    )


def _anomaly_json(anomaly: Anomaly | None) -> dict[str, Any] | None:
    if anomaly is None:
        return None
    out = asdict(anomaly)
    for key in ("ranks", "bad_ranks"):
        out[key] = list(out[key]) if out[key] is not None else None
    for key in ("value", "median"):
        value = out[key]
        if isinstance(value, float) and not math.isfinite(value):
            out[key] = repr(value)
    ratio = abs(anomaly.value) / anomaly.median if anomaly.kind == "spike" and anomaly.value and anomaly.median else None
    out["ratio"] = ratio
    out["line"] = anomaly.describe()
    return out
