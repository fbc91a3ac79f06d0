"""The spikes of ``trainprobe diagnose``: the spike rule of :mod:`trainprobe.engine.rules` (the
one the online rules of Monitor V2 run), replayed over every series of the run's files.

A *series* is one tensor's statistic over the steps, cut as
:mod:`trainprobe.engine.rules.series` cuts them: one (table, rank, name, scope, micro_step,
vpp_stage) and one signal (``norm``; ``amax``, the larger finite magnitude of ``min`` and
``max``, reported as whichever it is). Per view the engine numbers the series (a small table of
their keys), returns every row up to the last step scanned as arrays ordered by series, step and
``file_row`` (one sort of integers; no string is fetched), and the rule's
:meth:`~trainprobe.engine.rules.base.Rule.replay_many` judges all series of the view at once
(vectorised for the default rule). The spikes found are kept as a table of the engine with the
columns of :data:`SPIKE_COLUMNS`, which the answer's queries read (:mod:`trainprobe.tools.sql.diagnose`).

Series of the scopes in :data:`~trainprobe.engine.rules.series.SQUARED_SCOPES` are judged as
series of squares.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainprobe.engine.rules import Rule
from trainprobe.engine.rules.base import FloatArray, IntArray
from trainprobe.engine.rules.series import SQUARED_SCOPES
from trainprobe.tools.engines.base import Rows
from trainprobe.tools.sql.names import ident, text
from trainprobe.tools.sql.questions import ops_of

KEYS: tuple[str, ...] = ("rank", "name", "scope", "micro_step", "vpp_stage")
"""The key columns of a series within one view."""
SPIKE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("table", "VARCHAR"), ("rank", "BIGINT"), ("step", "BIGINT"), ("micro_step", "BIGINT"),
    ("vpp_stage", "BIGINT"), ("name", "VARCHAR"), ("scope", "VARCHAR"), ("op", "VARCHAR"),
    ("value", "DOUBLE"), ("median", "DOUBLE"), ("file_row", "BIGINT"),
)
"""The spike table's columns and types (``median``: the rule's reference, whatever it is)."""
_IN_CHUNK = 1000
"""Series keys fetched per query (an ``IN`` list of this many numbers)."""


SpikeSource = Rows
"""What the spike scan asks of an engine: :class:`~trainprobe.tools.engines.base.Rows`."""


def signal_columns(ops: Sequence[str]) -> dict[str, str]:
    """The SQL of a view's signal columns (``v.`` its rows): ``norm``, ``amax`` (the value of the
    larger finite magnitude of ``min`` and ``max``; ``max`` when neither is finite) and
    ``amax_min`` (1 where ``amax`` is ``min``), as the online rules cut a row
    (:func:`trainprobe.engine.anomaly.online`)."""
    out = {}
    if "norm" in ops:
        out["norm"] = 'v."norm"'
    low, high = 'v."min"', 'v."max"'
    if "min" in ops and "max" in ops:
        finite = "COALESCE(abs({}) < CAST('inf' AS DOUBLE), FALSE)"
        pick = f"({finite.format(low)} AND (NOT {finite.format(high)} OR abs({low}) > abs({high})))"
        out["amax"] = f"CASE WHEN {pick} THEN {low} ELSE {high} END"
        out["amax_min"] = f"CASE WHEN {pick} THEN 1 ELSE 0 END"
    elif "min" in ops or "max" in ops:
        out["amax"] = low if "min" in ops else high
        out["amax_min"] = "1" if "min" in ops else "0"
    return out


def _where(last_step: int | None, alias: str = "") -> str:
    return "" if last_step is None else f"WHERE {alias}step <= {int(last_step)}"


def keys_sql(view: str, last_step: int | None) -> str:
    """The series of ``view`` (up to ``last_step``), numbered from 0 as ``sid``."""
    keys = ", ".join(KEYS)
    return (
        f"SELECT row_number() OVER (ORDER BY {keys}) - 1 AS sid, {keys} "
        f"FROM (SELECT DISTINCT {keys} FROM {ident(view)} {_where(last_step)})"
    )


def series_sql(view: str, columns: Sequence[str], keys: str, last_step: int | None) -> str | None:
    """Every row of ``view`` up to ``last_step`` as ``sid, step, file_row`` and its signal
    columns (:func:`signal_columns`), ordered by series (``keys``: the table of
    :func:`keys_sql`), step and ``file_row``; None for a view without a signal."""
    signals = signal_columns(ops_of(columns))
    if not signals:
        return None
    same = " AND ".join(f"v.{k} IS NOT DISTINCT FROM k.{k}" for k in KEYS)
    picked = ", ".join(f"{sql} AS {name}" for name, sql in signals.items())
    return (
        f"SELECT k.sid AS sid, v.step AS step, v.file_row AS file_row, {picked} "
        f"FROM {ident(view)} v JOIN {keys} k ON {same} {_where(last_step, 'v.')} "
        "ORDER BY k.sid, v.step, v.file_row"
    )


@dataclass(frozen=True, slots=True)
class _Found:
    """The spikes of one view, by row: positions into its arrays and what each reports."""

    at: IntArray
    op: list[str]
    value: FloatArray
    reference: FloatArray


def judge_view(rule: Rule[Any], data: Mapping[str, Any], squared_sids: set[int]) -> _Found:
    """The spikes of one view's arrays (:func:`series_sql`'s columns) under ``rule``: both
    signals of each series; ``squared_sids``: the series of squares."""
    sid = np.asarray(data["sid"], dtype=np.int64)
    steps = np.asarray(data["step"], dtype=np.int64)
    parts: list[tuple[IntArray, list[str], FloatArray, FloatArray]] = []
    squared = np.isin(sid, np.fromiter(squared_sids, dtype=np.int64)) if squared_sids else np.zeros(len(sid), bool)
    for signal in ("norm", "amax"):
        if signal not in data:
            continue
        raw = _floats(data[signal])
        magnitude = np.where(np.isfinite(raw), np.abs(raw), np.nan)
        for of_squares in (False, True):
            rows = np.flatnonzero(squared == of_squares)
            if not len(rows):
                continue
            hits = rule.replay_many(_starts(sid[rows]), steps[rows], magnitude[rows], of_squares)
            at = rows[hits.at]
            ops = ["norm"] * len(at) if signal == "norm" else [
                "min" if m else "max" for m in np.asarray(data["amax_min"])[at]
            ]
            parts.append((at, ops, raw[at], hits.reference))
    if not parts:
        return _Found(np.zeros(0, np.int64), [], np.zeros(0), np.zeros(0))
    return _Found(
        np.concatenate([p[0] for p in parts]),
        [op for p in parts for op in p[1]],
        np.concatenate([p[2] for p in parts]),
        np.concatenate([p[3] for p in parts]),
    )


def keep_spikes(
    source: SpikeSource, name: str, views: Mapping[str, Sequence[str]], rule: Rule[Any], last_step: int | None
) -> int:
    """Judge every series of ``views`` (up to ``last_step``) under ``rule``; keep the spikes as
    the table ``name`` (:data:`SPIKE_COLUMNS`). Returns how many were found."""
    rows: list[tuple[Any, ...]] = []
    for i, (view, columns) in enumerate(views.items()):
        if not signal_columns(ops_of(columns)):
            continue
        keys = f"{name}_keys_{i}"
        source.keep(keys, keys_sql(view, last_step))
        sql = series_sql(view, columns, keys, last_step)
        assert sql is not None
        data = source.arrays(sql)
        squared = {int(s) for (s,) in source.fetch(
            f"SELECT sid FROM {keys} WHERE scope IN ({', '.join(text(s) for s in SQUARED_SCOPES)})"
        )}
        found = judge_view(rule, data, squared)
        rows += _rows(source, view, keys, data, found)
    source.keep_rows(name, SPIKE_COLUMNS, rows)
    return len(rows)


def _rows(source: SpikeSource, view: str, keys: str, data: Mapping[str, Any], found: _Found) -> list[tuple[Any, ...]]:
    """The spike table's rows of one view's spikes (their series' keys fetched)."""
    sids = np.asarray(data["sid"], dtype=np.int64)[found.at]
    wanted = sorted({int(s) for s in sids})
    named: dict[int, tuple[Any, ...]] = {}
    for a in range(0, len(wanted), _IN_CHUNK):
        listed = ", ".join(str(s) for s in wanted[a : a + _IN_CHUNK])
        for sid, *key in source.fetch(f"SELECT sid, {', '.join(KEYS)} FROM {keys} WHERE sid IN ({listed})"):
            named[int(sid)] = tuple(key)
    steps = np.asarray(data["step"], dtype=np.int64)[found.at]
    file_rows = np.asarray(data["file_row"], dtype=np.int64)[found.at]
    out = []
    for sid, step, file_row, op, value, reference in zip(
        sids, steps, file_rows, found.op, found.value, found.reference, strict=True
    ):
        rank, name, scope, micro, vpp = named[int(sid)]
        out.append((view, int(rank), int(step), micro, vpp, name, scope, op, float(value), float(reference), int(file_row)))
    return out


def _starts(sid: IntArray) -> IntArray:
    """Where each series begins in ``sid`` (ordered by series)."""
    if not len(sid):
        return np.zeros(0, dtype=np.int64)
    out: IntArray = np.flatnonzero(np.r_[True, sid[1:] != sid[:-1]])
    return out


def _floats(column: Any) -> FloatArray:
    """A column as float64, NULL as NaN (DuckDB gives masked arrays where there are NULLs)."""
    out: FloatArray = np.ma.filled(np.ma.asarray(column).astype(np.float64), np.nan)
    return out
