"""``trainprobe diff``: where two runs' monitor outputs part, first in execution order (public API).

Example::

    from trainprobe.tools.rundiff.answer import diff
    result = diff("run_fp32", "run_bf16", rtol=1e-3)
    print(result.answer())            # first divergence: step 0, rank 0, module forward head ...
    result.first                      # Divergence(table='module', step=0, ...) or None
    result.counts                     # {'compared': ..., 'equal': ..., 'diverged': ..., ...}
    result.exit_code                  # 0 within tolerance, 1 diverged

Both inputs are monitor outputs of the same kind, as the query layer reads them
(:func:`trainprobe.tools.query.layer.connect`): a Monitor V2 ``output_dir``, a Monitor V1
``MONITOR_OUTPUT_DIR``, or one rank's folder, written by trainprobe or by the reference tool,
CSV or Parquet. Rows are matched as :mod:`trainprobe.tools.rundiff.match` says and compared as
:mod:`trainprobe.tools.sql.diff` says; everything is joined in DuckDB, or with
``engine="spark"`` in Apache Spark over the runs' Parquet files (the same queries:
:class:`~trainprobe.tools.engines.base.Engine`). See docs/diff.md.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.printable import printable
from trainprobe.engine.sinks.files import write_atomically
from trainprobe.tools.engines.base import ENGINES, Engine
from trainprobe.tools.engines.duckdb_engine import DuckEngine
from trainprobe.tools.engines.spark_engine import on_spark
from trainprobe.tools.query.layer import require, short_error
from trainprobe.tools.rundiff.match import Mapping, check_mapping, load_mapping, parse_mapping
from trainprobe.tools.runs.files import find_run_files, is_precision_dump
from trainprobe.tools.sql.diff import (
    DEFAULT_DTYPE,
    DIVERGED,
    DTYPE_RTOL,
    EQUAL,
    NOISE_MARGIN,
    ONLY_BASELINE,
    ONLY_CANDIDATE,
    ORDER,
    STATUS_NAMES,
    V1_QUANTUM,
    WITHIN,
    Tolerance,
    dtype_of,
    fmt,
    fmt_factor,
    joined_sql,
    noise_sql,
    ordered_sql,
    rows_sql,
)
from trainprobe.tools.sql.names import ident as quote
from trainprobe.tools.sql.questions import COUNT_OPS, ops_of

MEMORY_LIMIT = "1GB"
"""DuckDB's memory for the join (it spills to a private temporary folder beyond): the process
stays under 2 GB with runs of any size."""
DEFAULT_RTOL = DTYPE_RTOL[DEFAULT_DTYPE]
"""Default tolerance of a float32 run (1e-3; other precisions: :data:`~trainprobe.tools.sql.diff.DTYPE_RTOL`):
above the noise of rounding-level reruns (thread count, op order, fused kernels, a few steps
of chaotic growth), as measured against the tensor's scale (docs/diff.md, "Tolerance")."""
DEFAULT_LIMIT = 20
"""Divergences listed in the answer (``--limit``)."""
EXAMPLES = 5
"""Rows present in one run only kept as examples, per side."""
SUMMARY_SCHEMA = 2
"""Version of ``diff_summary.json``'s layout (docs/diff.md)."""


@dataclass(frozen=True)
class Divergence:
    """One diverged row (its worst op), or a row present in one run only (``op`` None).

    ``step`` is in the baseline's numbering (candidate step + offset); ``name`` the baseline's
    name (the candidate's for a row only it has), ``candidate_name`` the candidate's raw name.
    ``rel_diff`` is the op's normalised difference, ``tolerance`` the one it exceeded, ``factor``
    how many times the larger value is the smaller (``×N``, :func:`~trainprobe.tools.sql.diff.factor_sql`)."""

    table: str
    step: int
    micro_step: int | None
    rank: int
    vpp_stage: int
    name: str
    scope: str
    op: str | None = None
    baseline: float | None = None
    candidate: float | None = None
    rel_diff: float | None = None
    candidate_name: str | None = None
    tolerance: float | None = None
    factor: float | None = None

    def where(self) -> str:
        """``step 5, rank 0, weight_grad reduced layers.0.fc.weight`` (micro-step when there is one)."""
        micro = f", micro-step {self.micro_step}" if self.micro_step is not None else ""
        scope = "" if self.scope == self.table else f" {self.scope}"
        return f"step {self.step}{micro}, rank {self.rank}, {self.table}{printable(scope)} {printable(self.name)}"

    def describe(self) -> str:
        """:meth:`where` and the op: ``... norm 1.23e-02 vs nan``, ``... norm 1.2e-01 vs 6.1e+00 (×51)``."""
        if self.op is None:
            return self.where()
        change = f" ({fmt_factor(self.factor)})" if self.factor is not None and math.isfinite(self.factor) else ""
        return f"{self.where()} {self.op} {fmt(self.baseline)} vs {fmt(self.candidate)}{change}"


@dataclass
class DiffResult:
    """What :func:`diff` found.

    Attributes:
        baseline, candidate: the two runs.
        rtol: the tolerance (given, or of ``dtype``: :data:`~trainprobe.tools.sql.diff.DTYPE_RTOL`).
        exact, offset, steps: the comparison's settings.
        dtype: the baseline's precision the default rtol is of; ``dtype_source`` where it comes
            from: ``"--dtype"``, ``"files"`` (the coarsest dtype of the baseline's Monitor V1
            rows: bf16 autocast makes a run bf16) or ``"assumed"`` (files without dtypes: V2).
        noise: the rerun whose noise raised the tolerance (``--noise``), or None; ``margin`` its factor.
        noise_levels: per table, scope and op, the rerun's noise level (its largest difference).
        ops: per table, the ops compared.
        micro: per table, whether ``micro_step`` was part of the key (not when one run lacks it).
        counts: ``compared`` (rows matched), ``equal`` (every op bit-equal), ``within_tolerance``,
            ``diverged``, ``only_baseline``, ``only_candidate``.
        tables: the same counts per table.
        first: the first divergence in execution order, or None.
        divergences: the earliest ones, in execution order (at most ``limit``).
        largest: the tensors that differ most (at most ``limit``), one row each, by the factor
            of ``norm`` where the table has it (else of the worst op), ties in execution order.
            A tensor is a parameter's gradient (unreduced or reduced), a parameter (before or
            after the step: ``param_updated`` of step s is ``param_origin`` of s+1), or any
            other tensor by table, scope and name.
        only_baseline, only_candidate: the earliest rows present in one run only.
        tables_only: tables one run has and the other has not (``{"baseline": [...], ...}``).
        notes: lines on what was not compared and why (one line each; printed under the answer),
            e.g. the rank-local rows of two runs whose ranks differ.
    """

    baseline: str
    candidate: str
    rtol: float
    exact: bool
    offset: int
    steps: tuple[int, int] | None
    dtype: str = DEFAULT_DTYPE
    dtype_source: str = "assumed"
    noise: str | None = None
    margin: float = NOISE_MARGIN
    noise_levels: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    ops: dict[str, list[str]] = field(default_factory=dict)
    micro: dict[str, bool] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    tables: dict[str, dict[str, int]] = field(default_factory=dict)
    first: Divergence | None = None
    divergences: list[Divergence] = field(default_factory=list)
    largest: list[Divergence] = field(default_factory=list)
    only_baseline: list[Divergence] = field(default_factory=list)
    only_candidate: list[Divergence] = field(default_factory=list)
    written: list[Path] = field(default_factory=list)
    """The files :func:`diff` wrote (``diff.csv``, ``diff_summary.json``, the page)."""
    tables_only: dict[str, list[str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    joins: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False)
    """Per table, the :func:`~trainprobe.tools.sql.diff.joined_sql` options its rows were compared
    with (the page's heatmaps recompute their cells with them)."""

    @property
    def diverged(self) -> bool:
        """Whether any matched row is out of tolerance."""
        return self.counts.get("diverged", 0) > 0

    @property
    def exit_code(self) -> int:
        """The command's exit status: 1 when the runs diverge, else 0."""
        return 1 if self.diverged else 0

    def rule(self) -> str:
        """The tolerance in words: ``rtol 0.001``, ``rtol 0.3 (bfloat16)`` (a precision other
        than float32), ``rtol 0.001 or 10× the rerun noise``; ``bit-equal`` with ``exact``."""
        if self.exact:
            return "bit-equal"
        text = f"rtol {self.rtol:g}"
        if self.dtype != DEFAULT_DTYPE and self.rtol == DTYPE_RTOL[self.dtype]:
            text += f" ({self.dtype})"
        return f"{text} or {self.margin:g}× the rerun noise" if self.noise is not None else text

    def answer(self) -> str:
        """The answer in one line."""
        if self.first is not None:
            return f"first divergence: {self.first.describe()}"
        rule = "bit-equal" if self.exact else f"within {self.rule()}"
        return f"no divergence: {self.counts['compared']:,} matched rows, all {rule}"

    def summary(self) -> dict[str, Any]:
        """``diff_summary.json``'s content (schema in docs/diff.md)."""
        return {
            "schema": SUMMARY_SCHEMA,
            "answer": self.answer(),
            "diverged": self.diverged,
            "exit_code": self.exit_code,
            "baseline": self.baseline,
            "candidate": self.candidate,
            "settings": {"rtol": self.rtol, "exact": self.exact, "offset": self.offset,
                         "steps": list(self.steps) if self.steps else None, "dtype": self.dtype,
                         "dtype_source": self.dtype_source, "tolerance": self.rule(),
                         "noise": None if self.noise is None else {"rerun": self.noise, "margin": self.margin,
                                                                   "levels": self.noise_levels}},
            "first": _json_row(self.first),
            "counts": self.counts,
            "tables": self.tables,
            "ops": self.ops,
            "micro_step_matched": self.micro,
            "divergences": [_json_row(d) for d in self.divergences],
            "largest": [_json_row(d) for d in self.largest],
            "only_baseline": [_json_row(d) for d in self.only_baseline],
            "only_candidate": [_json_row(d) for d in self.only_candidate],
            "tables_only": self.tables_only,
            "notes": self.notes,
        }


def _json_row(row: Divergence | None) -> dict[str, Any] | None:
    if row is None:
        return None
    return {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(row).items()}


def diagnose_line(baseline: str | Path, candidate: str | Path) -> str:
    """The one line ``trainprobe diagnose --baseline`` prints: :meth:`DiffResult.answer` of
    ``diff(baseline, candidate)`` with the default tolerance, e.g. ``first divergence: step 20,
    rank 1, weight_grad reduced layers.0.fc.weight norm 1.2e-01 vs 6.1e+00 (×51)``; a pair of runs
    diff cannot compare gives ``diff: <why>`` instead of failing the diagnosis."""
    try:
        return diff(baseline, candidate).answer()
    except ConfigError as exc:
        return f"diff: {exc}"


def diff(
    baseline: str | Path,
    candidate: str | Path,
    *,
    rtol: float | None = None,
    exact: bool = False,
    ops: Sequence[str] | None = None,
    mapping: str | Path | Mapping | dict[str, str] | None = None,
    steps: tuple[int, int] | None = None,
    offset: int = 0,
    limit: int = DEFAULT_LIMIT,
    out: str | Path | None = None,
    html: str | Path | None = None,
    tables: Sequence[str] | None = None,
    page: Any = None,
    engine: str = "duckdb",
    spark: Any = None,
    rank_local: bool = False,
    dtype: str | None = None,
    noise: str | Path | None = None,
) -> DiffResult:
    """Compare two runs' monitor outputs row by row; the first divergence in execution order.

    Args:
        baseline, candidate: the runs (folders; see the module docstring).
        rtol: tolerance on each op's normalised difference (docs/diff.md, "Tolerance"); None:
            the rtol of the rows' precision (``dtype``).
        exact: demand bit-equal values (``rtol`` ignored).
        ops: compare only these ops (default: every op both runs have, per table).
        mapping: the candidate's renames: a ``--map`` file, or its pairs (``[(pattern, repl)]``).
        steps: only baseline steps ``first..last`` (inclusive).
        offset: candidate step ``s`` is baseline step ``s + offset``.
        limit: divergences kept in :attr:`DiffResult.divergences` (``first`` is found whatever
            the limit, 0 included).
        out: write ``diff.csv`` and ``diff_summary.json`` there.
        html: write the page there (:mod:`trainprobe.tools.rundiff.html`).
        tables: compare only these tables (views); a name in neither run is a ConfigError.
        engine: ``"duckdb"`` (default) or ``"spark"``: the same queries on Apache Spark over
            the runs' Parquet files (``trainprobe convert RUN --to parquet`` first for a CSV
            run), the same result.
        spark: with ``engine="spark"``, your ``SparkSession`` (a cluster's), or None for the
            active one or else one in local mode (:func:`~trainprobe.tools.engines.spark.local_session`).
        rank_local: compare each rank's rows as written even in a sharded run (by default a
            run with ``tensor_layout.json`` files is compared in full tensors: its shards merged,
            :mod:`~trainprobe.tools.sql.full`; DuckDB only), and compare the rows the layout
            files mark ``rank_local`` (each rank's own batch piece: unreduced gradients under
            DDP/FSDP, activations of several ranks) even when the runs' ranks, or their
            rank-local rows, differ (by default those rows are then left out, with one line in
            :attr:`DiffResult.notes`).
        dtype: the baseline's precision (``float32``, ``bfloat16``, ``float16``, ``float64``),
            whose rtol is the default (:data:`~trainprobe.tools.sql.diff.DTYPE_RTOL`); None: the
            coarsest ``dtype`` of the baseline's Monitor V1 rows (bf16 autocast: ``bfloat16``),
            float32 for files without one (Monitor V2).
        noise: a rerun of the baseline that differs from it only by what counts as noise
            (thread count, kernels, op order): each op's tolerance becomes at least
            :data:`~trainprobe.tools.sql.diff.NOISE_MARGIN` times the largest difference the
            rerun shows in that table and scope (in ``steps``; ``min``, ``max`` and ``mean``
            together, :func:`~trainprobe.tools.sql.diff.noise_sql`).

    Raises:
        ConfigError: an input is missing, empty, not monitor output (a precision dump: use
            ``trainprobe compare``), the runs are of different kinds (V1 and V2), they have no
            row in common, or an option is invalid; with ``engine="spark"``, a run without
            Parquet files or without the ``[spark]`` extra. The message is one line.
    """
    if rtol is not None and not exact and not (rtol >= 0 and math.isfinite(rtol)):
        raise ConfigError(f"--rtol: must be a finite number >= 0, got {rtol!r}")
    if dtype is not None and dtype not in DTYPE_RTOL:
        raise ConfigError(f"--dtype: one of {', '.join(DTYPE_RTOL)}, not {dtype!r}")
    if steps is not None and steps[0] > steps[1]:
        raise ConfigError(f"--steps: the first step {steps[0]} is after the last {steps[1]}")
    pairs: Mapping = []
    if isinstance(mapping, (str, Path)):
        pairs = load_mapping(mapping)
    elif mapping is not None:
        pairs = parse_mapping(mapping)
    kind = _same_kind({"baseline": baseline, "candidate": candidate, **({"--noise": noise} if noise is not None else {})})
    if engine not in ENGINES:
        raise ConfigError(f"--engine: one of {', '.join(ENGINES)}, not {engine!r}")
    quantum = V1_QUANTUM if kind == "Monitor V1" else 0.0
    settings = _Settings(rtol, dtype, quantum, exact, ops, pairs, steps, offset, limit, out, html, tables, page,
                         None if noise is None else str(noise), rank_local)
    if engine == "spark":
        return _diff_on_spark(baseline, candidate, settings, spark)
    if abs(int(offset)) > MAX_OFFSET:
        raise ConfigError(f"--offset: at most {MAX_OFFSET} steps either way, got {offset}")
    duck = DuckEngine(memory_limit=MEMORY_LIMIT, spill=True, merge_shards=not rank_local, insertion_order=False)
    try:
        return _compare(duck, baseline, candidate, settings)
    except require("duckdb").Error as exc:
        raise ConfigError(f"diff of {baseline} with {candidate}: the data could not be read: {short_error(str(exc))}") from None
    finally:
        duck.release()


def _same_kind(runs: dict[str, str | Path]) -> str:
    """The runs' kind (``"Monitor V2"``); a ConfigError when one differs from the baseline's."""
    kinds = {side: _kind(run, side) for side, run in runs.items()}
    for side, kind in kinds.items():
        if kind != kinds["baseline"]:
            raise ConfigError(
                f"the runs are of different kinds: baseline {runs['baseline']} is {kinds['baseline']} output, {side} "
                f"{runs[side]} is {kind} output; diff compares V1 with V1 or V2 with V2"
            )
    return kinds["baseline"]


MAX_OFFSET = 2**53
"""The largest ``--offset`` (either way): step numbers stay exact in every engine and in JSON."""


@dataclass(frozen=True)
class _Settings:
    """:func:`diff`'s options, checked."""

    rtol: float | None
    dtype: str | None
    quantum: float
    exact: bool
    ops: Sequence[str] | None
    pairs: Mapping
    steps: tuple[int, int] | None
    offset: int
    limit: int
    out: str | Path | None
    html: str | Path | None
    tables: Sequence[str] | None
    page: Any
    noise: str | None
    rank_local: bool = False


def _diff_on_spark(baseline: str | Path, candidate: str | Path, settings: _Settings, session: Any) -> DiffResult:
    """:func:`_compare` on Spark; a session this call started is stopped at the end."""
    failure = f"Spark could not compare {baseline} with {candidate}"
    with on_spark(session, failure) as engine:
        return _compare(engine, baseline, candidate, settings)


def _compare(con: Engine, baseline: str | Path, candidate: str | Path, settings: _Settings) -> DiffResult:
    """:func:`diff` on ``con`` (its options checked)."""
    steps, offset = settings.steps, settings.offset
    check_mapping(con, settings.pairs)
    runs = [("b", baseline, steps), ("c", candidate, _shift(steps, -offset))]
    if settings.noise is not None:
        runs.append(("n", settings.noise, steps))
    views = {side: con.attach(side, run, window) for side, run, window in runs}
    con.seal()
    common = _common_tables(views, settings.tables)
    dtype, source = _precision(con, views["b"], settings.dtype)
    rtol = DTYPE_RTOL[dtype] if settings.rtol is None else settings.rtol
    tolerance = Tolerance(rtol=rtol, quantum=settings.quantum, exact=settings.exact)
    result = DiffResult(str(baseline), str(candidate), rtol, settings.exact, offset, steps, dtype=dtype,
                        dtype_source=source, noise=settings.noise, margin=tolerance.margin)
    result.tables_only = {
        "baseline": sorted(set(views["b"]) - set(views["c"])),
        "candidate": sorted(set(views["c"]) - set(views["b"])),
    }
    wanted = _wanted_ops(views["b"], settings.ops)
    left_out = None if settings.rank_local else _leave_out_rank_local(con, result, common, settings.pairs)
    by_name = not settings.rank_local and _pipeline_splits_differ(con, result)
    sources = [_compare_table(con, result, views, table, wanted, settings, tolerance, i, left_out, by_name)
               for i, table in enumerate(common)]
    if sources:
        con.view("diverged_rows", _union_by_name(con, sources))
    totals = {name: sum(t[name] for t in result.tables.values()) for name in STATUS_NAMES.values()}
    compared = totals["equal"] + totals["within_tolerance"] + totals["diverged"]
    result.counts = {"compared": compared, **totals}
    if compared == 0:
        raise ConfigError(
            f"the runs have no row in common: baseline {baseline} has tables {sorted(views['b'])}, candidate "
            f"{candidate} has {sorted(views['c'])}; {totals['only_baseline']} rows only in the baseline, "
            f"{totals['only_candidate']} only in the candidate (different models? a --map or --offset needed?)"
        )
    if sources:
        _collect_rows(con, result, settings.limit)
    _write(con, result, settings, common, bool(sources))
    return result


def _precision(con: Engine, baseline: dict[str, list[str]], given: str | None) -> tuple[str, str]:
    """The baseline's precision and where it comes from (:attr:`DiffResult.dtype`): ``given``,
    else the coarsest dtype of its rows (Monitor V1 files have a ``dtype`` column), else float32."""
    if given is not None:
        return given, "--dtype"
    names: set[str] = set()
    for table, columns in baseline.items():
        if "dtype" in columns:
            names |= {r[0] for r in con.fetch(f"SELECT DISTINCT dtype FROM {con.ref('b', table)}")}
    found = {d for d in map(dtype_of, names) if d is not None}
    if not found:
        return DEFAULT_DTYPE, "assumed"
    return max(found, key=DTYPE_RTOL.__getitem__), "files"


def _common_tables(views: dict[str, dict[str, list[str]]], tables: Sequence[str] | None) -> list[str]:
    """The tables both runs have (of ``tables`` when given; a name in neither is a ConfigError)."""
    if tables is not None:
        unknown = sorted(set(tables) - set(views["b"]) - set(views["c"]))
        if unknown:
            raise ConfigError(
                f"--tables: {unknown} in neither run (baseline tables: {sorted(views['b'])}, "
                f"candidate tables: {sorted(views['c'])})"
            )
    return [t for t in views["b"] if t in views["c"] and (tables is None or t in tables)]


def _wanted_ops(baseline: dict[str, list[str]], ops: Sequence[str] | None) -> set[str] | None:
    """``--ops`` as a set (None: every op); an op in no table of the baseline is a ConfigError."""
    if not ops:
        return None
    known = {o for cols in baseline.values() for o in ops_of(cols)}
    unknown = sorted(set(ops) - known)
    if unknown:
        raise ConfigError(f"--ops: {unknown} in no table of the baseline (its ops: {sorted(known)})")
    return set(ops)


def _compare_table(con: Engine, result: DiffResult, views: dict[str, dict[str, list[str]]], table: str,
                   wanted: set[str] | None, settings: _Settings, tolerance: Tolerance, index: int,
                   left_out: str | None = None, by_name: bool = False) -> str:
    """Join ``table`` of both runs (with the rerun's noise levels when there is a rerun), keep
    its diverged rows and rows in one run only, count its statuses into ``result``; the name of
    its ordered rows' view."""
    table_ops = [o for o in ops_of(views["b"][table]) if o in views["c"][table]]
    if wanted is not None:
        table_ops = [o for o in table_ops if o in wanted]
    result.ops[table] = table_ops
    micro = all(_has_micro(con, side, table, shift, settings.steps) for side, shift in (("b", 0), ("c", settings.offset)))
    result.micro[table] = micro
    noise = None
    if "n" in views and table in views["n"] and not tolerance.exact:
        noise = f"noise_{index}"
        _measure_noise(con, result, table, table_ops, tolerance, settings.steps, noise, left_out)
    join = {"tolerance": tolerance, "offset": settings.offset, "mapping": settings.pairs,
            "steps": settings.steps, "micro": micro, "ref": con.ref, "noise": noise, "left_out": left_out,
            "by_name": by_name}
    joined, counts = _join(con, table, table_ops, join, ("c", settings.offset))
    result.joins[table] = join
    con.keep(f"kept_{index}", f"SELECT * FROM ({joined}) WHERE status >= {DIVERGED}")
    result.tables[table] = {name: int(counts.get(code, 0)) for code, name in STATUS_NAMES.items()}
    con.view(f"ord_{index}", ordered_sql(table, f"kept_{index}", ref=con.ref))
    return f"ord_{index}"


def _join(con: Engine, table: str, ops: list[str], join: dict[str, Any], other: tuple[str, int]) -> tuple[str, dict[int, int]]:
    """The :func:`~trainprobe.tools.sql.diff.joined_sql` of ``table`` between the baseline and
    side ``other`` (name, step offset), with occurrences numbered when a key repeats; its counts."""
    joined = joined_sql(table, ops, other=other[0], **join)
    counts = _counts(con, joined)
    if _repeats(con, table, counts, other, join):
        joined = joined_sql(table, ops, other=other[0], occurrence=True, **join)
        counts = _counts(con, joined)
    return joined, counts


def _measure_noise(con: Engine, result: DiffResult, table: str, ops: list[str], tolerance: Tolerance,
                   steps: tuple[int, int] | None, name: str, left_out: str | None = None) -> None:
    """Keep the rerun's noise levels of ``table`` (:func:`~trainprobe.tools.sql.diff.noise_sql`)
    as ``name``; their largest per scope and op into ``result.noise_levels``."""
    micro = all(_has_micro(con, side, table, 0, steps) for side in ("b", "n"))
    join = {"tolerance": tolerance, "steps": steps, "micro": micro, "ref": con.ref, "left_out": left_out}
    joined, _ = _join(con, table, ops, join, ("n", 0))
    con.keep(name, noise_sql(joined, ops))
    levels: dict[str, dict[str, float]] = {}
    measured = [o for o in ops if o not in COUNT_OPS]  # a count's tolerance is 0 whatever the rerun
    columns = ", ".join(f"max({quote('n_' + o)})" for o in measured)
    if columns:
        for scope, *values in con.fetch(f"SELECT k_scope, {columns} FROM {name} GROUP BY k_scope ORDER BY k_scope"):
            levels[scope] = {o: float(v) for o, v in zip(measured, values) if v is not None}
    result.noise_levels[table] = levels


def _collect_rows(con: Engine, result: DiffResult, limit: int) -> None:
    """The first divergence, the earliest ones, the largest, the rows in one run only."""
    earliest = _rows(con, DIVERGED, max(limit, 1))  # the first divergence even with limit 0
    result.first = earliest[0] if earliest else None
    result.divergences = earliest[:limit]
    result.largest = _largest(con, limit, any("norm" in o for o in result.ops.values()))
    result.only_baseline = _rows(con, ONLY_BASELINE, EXAMPLES)
    result.only_candidate = _rows(con, ONLY_CANDIDATE, EXAMPLES)


def _write(con: Engine, result: DiffResult, settings: _Settings, common: list[str], any_rows: bool) -> None:
    """The files asked for (``out``, ``html``) and the sections of another page (``page``)."""
    if settings.out is not None:
        result.written += write_outputs(con, result, Path(settings.out), any_rows)
    if settings.html is not None:
        from trainprobe.tools.rundiff.html import write_html

        result.written.append(write_html(con, result, Path(settings.html), common, settings.pairs))
    if settings.page is not None:
        from trainprobe.tools.rundiff.html import add_sections

        add_sections(settings.page, con, result, common, settings.pairs)


def _union_by_name(con: Engine, sources: Sequence[str]) -> str:
    """Every row of ``sources`` (whose columns differ: a table without an op lacks its
    columns), NULL where a source lacks a column: DuckDB's ``UNION ALL BY NAME`` in SQL that
    Spark reads too."""
    columns = {s: con.columns(f"SELECT * FROM {s}") for s in sources}
    every = list(dict.fromkeys(c for cols in columns.values() for c in cols))
    return " UNION ALL ".join(
        "SELECT " + ", ".join(quote(c) if c in columns[s] else f"NULL AS {quote(c)}" for c in every) + f" FROM {s}"
        for s in sources
    )


def _counts(con: Engine, joined: str) -> dict[int, int]:
    """Rows per status of a join."""
    return {int(k): int(v) for k, v in con.fetch(f"SELECT status, count(*) FROM ({joined}) GROUP BY status")}


def _repeats(con: Engine, table: str, counts: dict[int, int], other: tuple[str, int], join: dict[str, Any]) -> bool:
    """Whether a key repeats in the baseline or in side ``other`` (name, step offset): the join
    (its options ``join``: the steps, the rows left out) then counts some of its rows twice."""
    matched = sum(counts.get(s, 0) for s in (EQUAL, WITHIN, DIVERGED))
    for schema, only, shift in (("b", ONLY_BASELINE, 0), (other[0], ONLY_CANDIDATE, other[1])):
        mapping = join.get("mapping", ()) if schema == "c" else ()
        [(rows,)] = con.fetch(rows_sql(schema, table, shift, join["steps"], ref=con.ref, left_out=join.get("left_out"),
                                       mapping=mapping, by_name=join.get("by_name", False)))
        if matched + counts.get(only, 0) != rows:
            return True
    return False


LEFT_OUT_TABLE = "rank_local_left_out"
"""The rows a diff leaves out (:data:`~trainprobe.tools.sql.diff.LEFT_OUT_COLUMNS`), kept on the engine."""


def _leave_out_rank_local(con: Engine, result: DiffResult, tables: Sequence[str], pairs: Mapping) -> str | None:
    """The rows marked ``rank_local`` in either run's layout files, to leave out of the comparison
    on several ranks of a run (each rank's own batch piece; one on a single rank, a pipeline
    stage's activations, is the whole micro-batch's), when the runs' ranks differ or their
    rank-local rows do (DP=1 vs DP=2: rank 0's half batch is no statistic of the whole batch's); the name of their relation, and one line in
    ``result.notes``; None (every row compared) when the two runs have the same ranks and the
    same rank-local rows, or on an engine without layouts (Spark)."""
    if not isinstance(con, DuckEngine):
        return None
    entries = [(side, *e) for side in ("b", "c") for e in con.rank_local_entries(side) if e[1] in tables]
    if not entries:
        return None
    from trainprobe.tools.rundiff.match import normalised_name_sql

    con.keep_rows(f"{LEFT_OUT_TABLE}_raw", [("side", "VARCHAR"), ("rank", "BIGINT"), ("monitor", "VARCHAR"),
                                            ("name", "VARCHAR"), ("scope", "VARCHAR")], entries)
    named = (f"SELECT side, rank, monitor, name, CASE WHEN side = 'c' THEN {normalised_name_sql('name', pairs)} "
             f"ELSE {normalised_name_sql('name')} END AS lo_name, scope FROM {LEFT_OUT_TABLE}_raw")
    rows = con.fetch(f"SELECT DISTINCT side, rank, monitor, lo_name, scope FROM ({named})")
    per_side = {side: {r[1:] for r in rows if r[0] == side} for side in ("b", "c")}
    ranks = {side: con.ranks(side) for side in ("b", "c")}
    if ranks["b"] == ranks["c"] and per_side["b"] == per_side["c"]:
        return None
    # a rank-local row on one rank only (a pipeline stage's activations) is the whole micro-batch's
    shared = (f"SELECT side, monitor, name, lo_name, scope FROM ({named}) GROUP BY ALL "
              "HAVING count(DISTINCT rank) > 1")
    if not con.fetch(f"SELECT 1 FROM ({shared}) LIMIT 1"):
        return None
    con.keep(LEFT_OUT_TABLE, f"SELECT DISTINCT monitor AS lo_tbl, lo_name, scope AS lo_scope FROM ({shared})")
    rows = con.fetch(f"SELECT DISTINCT side, 0, monitor, lo_name, scope FROM ({shared})")
    why = (f"the runs' ranks differ ({_ranks_text(ranks['b'])} vs {_ranks_text(ranks['c'])})"
           if ranks["b"] != ranks["c"] else "the runs' rank-local rows differ (another data-parallel layout)")
    what = sorted({(r[2], r[4]) for r in rows}, key=lambda t: (t[0], t[1] or ""))
    listed = ", ".join(f"{table} {scope}" if scope else f"{table} (every scope)" for table, scope in what)
    result.notes.append(
        f"note: left out {listed}: rank-local rows (each rank's own batch piece) do not compare when {why}; "
        "--rank-local compares them as written"
    )
    return LEFT_OUT_TABLE


def _pipeline_splits_differ(con: Engine, result: DiffResult) -> bool:
    """Whether the two runs hold their pipeline stages differently (which rank holds which
    global stage, read from the ``<stage>:`` prefixes of their layout entries): then tensors
    are matched by their global name, not by rank and stage, with one line in ``result.notes``."""
    if not isinstance(con, DuckEngine):
        return False
    import re

    stages = {side: sorted({(int(e[0]), int(m[1])) for e in con.layout(side) if (m := re.match(r"(\d+):", str(e[2])))})
              for side in ("b", "c")}
    if stages["b"] == stages["c"] or not (stages["b"] or stages["c"]):
        return False

    def held(pairs: list[tuple[int, int]]) -> str:
        return ", ".join(f"stage {s} on rank {r}" for r, s in pairs) or "no layout files: one process"

    result.notes.append(
        f"note: the pipeline splits differ ({held(stages['b'])} vs {held(stages['c'])}): tensors matched by their "
        "global name, not by rank and stage; the chunks' own input/output rows (<stage>:.input.0) left out"
    )
    return True


def _ranks_text(ranks: Sequence[int]) -> str:
    """``1 rank`` / ``2 ranks`` (``ranks 0,2`` when they are not 0..n-1)."""
    if list(ranks) == list(range(len(ranks))):
        return f"{len(ranks)} rank{'s' if len(ranks) != 1 else ''}"
    return "ranks " + ",".join(map(str, ranks))


def _has_micro(con: Engine, side: str, table: str, offset: int, steps: tuple[int, int] | None) -> bool:
    """Whether a row of side ``side``'s ``table`` in ``steps`` (baseline numbering) has a
    ``micro_step`` (the scan stops at the first): the rows compared, whatever the files an
    engine's views hold beyond them."""
    within = f" AND step + {int(offset)} BETWEEN {int(steps[0])} AND {int(steps[1])}" if steps else ""
    return bool(con.fetch(f"SELECT 1 FROM {con.ref(side, table)} WHERE micro_step IS NOT NULL{within} LIMIT 1"))


def _kind(run: str | Path, side: str) -> str:
    """``"Monitor V1"`` or ``"Monitor V2"``; a ConfigError for a dump, an empty or unrelated folder."""
    path = Path(run)
    if not path.is_dir():
        raise ConfigError(f"{side} {run}: not a folder (give a monitor output folder)")
    try:
        files = find_run_files(path)
    except ConfigError as exc:
        if is_precision_dump(path):
            raise ConfigError(
                f"{side} {run} is a precision dump folder, not monitor output: compare dumps with "
                "`trainprobe compare`"
            ) from None
        raise ConfigError(f"{side} {exc}") from None
    layouts = sorted({f.layout for f in files})
    if len(layouts) > 1:
        raise ConfigError(f"{side} {run} holds both Monitor V1 and Monitor V2 files; give one of them")
    return "Monitor " + layouts[0].upper()


def _shift(steps: tuple[int, int] | None, by: int) -> tuple[int, int] | None:
    return None if steps is None else (steps[0] + by, steps[1] + by)


def _rows(
    con: Engine, status: int, limit: int, order: str = ORDER, source: str = "diverged_rows", norm: bool = False
) -> list[Divergence]:
    """The first ``limit`` kept rows of ``status`` in ``order`` (execution order), each shown
    with its worst op (with ``norm``, its ``norm`` where the row has one)."""
    out = []
    for r in con.records(f"SELECT * FROM {source} WHERE status = {status} ORDER BY {order} LIMIT {int(limit)}"):
        op = "norm" if norm and r.get("f_norm") is not None else r["worst_op"]
        out.append(Divergence(
            table=r["tbl"], step=int(r["k_step"]), micro_step=None if r["k_micro"] < 0 else int(r["k_micro"]),
            rank=int(r["k_rank"]), vpp_stage=int(r["k_vpp"]),
            name=r["b_name"] if r["b_name"] is not None else r["c_name"], scope=r["k_scope"], op=op,
            baseline=r.get(f"b_{op}") if op else None, candidate=r.get(f"c_{op}") if op else None,
            rel_diff=r.get(f"r_{op}") if op else None, candidate_name=r["c_name"],
            tolerance=r.get(f"t_{op}") if op else None, factor=r.get(f"f_{op}") if op else None,
        ))
    return out


TENSOR_SQL = (
    "CASE WHEN tbl IN ('param', 'param_origin', 'param_updated') THEN 'param' "
    "WHEN tbl IN ('weight_grad', 'grad_unreduced', 'grad_reduced') THEN 'grad' "
    "ELSE concat(tbl, '/', k_scope) END"
)
"""The kind of tensor a row summarises, for the "largest" table: a parameter (before or after
the step), a parameter's gradient (unreduced or reduced), else its table and scope."""


def _largest(con: Engine, limit: int, has_norm: bool) -> list[Divergence]:
    """One diverged row per tensor (:data:`TENSOR_SQL` and name), the tensors that changed most
    first: by the factor of ``norm`` where the table has it (the most robust summary of a
    tensor: a ``mean`` near 0 swings widely), else of the row's worst op; ties in execution
    order (an unreduced gradient before the reduced one, ``param_updated`` before the next
    step's ``param_origin``)."""
    key = "COALESCE(f_norm, factor)" if has_norm else "factor"
    per_tensor = (
        f"(SELECT * FROM (SELECT *, row_number() OVER (PARTITION BY {TENSOR_SQL}, k_name ORDER BY {key} DESC, "
        f"{ORDER}) AS tensor_rank FROM diverged_rows WHERE status = {DIVERGED}) WHERE tensor_rank = 1)"
    )
    return _rows(con, DIVERGED, limit, order=f"{key} DESC, {ORDER}", source=per_tensor, norm=has_norm)


def write_outputs(con: Engine, result: DiffResult, out: Path, any_rows: bool) -> list[Path]:
    """``diff.csv`` (every diverged row, execution order) and ``diff_summary.json`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    csv_path, summary_path = out / "diff.csv", out / "diff_summary.json"
    op_names = list(dict.fromkeys(o for ops in result.ops.values() for o in ops))
    items = _csv_columns(op_names)
    if any_rows:
        # a table without an op lacks its columns: _union_by_name gave NULLs
        select = ", ".join(f"{expr} AS {quote(alias)}" for expr, alias in items)
        con.write_csv(f"SELECT {select} FROM diverged_rows WHERE status = {DIVERGED} ORDER BY {ORDER}", csv_path)
    else:
        write_atomically(csv_path, ",".join(alias for _, alias in items) + "\n", field="-o/--output")
    write_atomically(summary_path, json.dumps(result.summary(), indent=2) + "\n", field="-o/--output")
    return [csv_path, summary_path]


def _csv_columns(ops: Sequence[str]) -> list[tuple[str, str]]:
    """``diff.csv``'s columns as ``(SQL over diverged_rows, header name)``: the row's place, its
    worst op, then per op its two values and relative difference."""
    items = [
        ("tbl", "table"), ("k_step", "step"), ("CASE WHEN k_micro < 0 THEN NULL ELSE k_micro END", "micro_step"),
        ("k_rank", "rank"), ("k_vpp", "vpp_stage"), ("b_name", "name"), ("c_name", "candidate_name"),
        ("k_scope", "scope"), ("worst_op", "worst_op"), ("rel", "rel_diff"), ("tol", "tolerance"), ("factor", "factor"),
    ]
    for o in ops:
        items += [(quote("b_" + o), f"{o}_baseline"), (quote("c_" + o), f"{o}_candidate"), (quote("r_" + o), f"{o}_rel_diff")]
    return items
