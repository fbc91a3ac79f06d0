"""``trainprobe diff --html``: one self-contained page in the style of ``trainprobe report``.

Per table, a heatmap of ``log10`` of the relative difference (the largest over ranks,
micro-steps and ops): steps across, tensors (``scope name``) down in execution order (stage, then
the tensor's place among its file's rows), equal rows at the bottom of the scale, the rtol as a
line on the colour bar's range; cells whose row one run lacks are grey, the first divergence is
marked with a ring. Above: the answer, the counts, the earliest divergences and the rows present
in one run only. Plotly's JavaScript is inlined (no network); ``#tp-status`` gets
``data-state="rendered"`` once every figure is drawn, as in the report.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainprobe.engine.sinks.files import write_atomically
from trainprobe.tools.reporting.html import SCRIPT, STYLE, PageBuilder
from trainprobe.tools.sql.diff import ONLY_BASELINE, ONLY_CANDIDATE, fmt, joined_sql

MAX_COLUMNS = 400
"""Steps shown per heatmap: more are grouped into bins (the largest difference of each bin)."""
MAX_TENSORS = 400
"""Tensors shown per heatmap: the earliest in execution order."""
LOG_FLOOR = -9.0
"""``log10`` shown for an equal row (and for differences below ``1e-9``)."""
LOG_CEIL = 1.0
"""``log10`` shown for a NaN/inf divergence (the relative difference is at most 2 otherwise)."""


def write_html(engine: Any, result: Any, path: Path, tables: Sequence[str], mapping: Sequence[tuple[str, str]]) -> Path:
    """Write the page for ``result`` (a :class:`~trainprobe.tools.rundiff.answer.DiffResult`) to ``path``; ``engine``
    holds both runs' views (:class:`~trainprobe.tools.engines.base.Engine`)."""
    page = PageBuilder()
    add_heatmaps(page, engine, result, tables, mapping)
    title = f"trainprobe diff: {Path(result.baseline).name} vs {Path(result.candidate).name}"
    write_atomically(
        path,
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{_e(title)}</title><style>{STYLE}</style><script>{SCRIPT}</script></head><body>"
        f'<div id="tp-status" data-state="loading" data-rendered="0" data-expected="{page.figures}" '
        'data-errors="" hidden></div>'
        f"<h1>{_e(title)}</h1>{summary_html(result)}" + "".join(page.parts) + "</body></html>\n",
        field="--html",
    )
    return path


def add_heatmaps(
    page: PageBuilder, engine: Any, result: Any, tables: Sequence[str], mapping: Sequence[tuple[str, str]], level: int = 2
) -> None:
    """Add one heatmap per table (with a heading of ``level``) to ``page``."""
    for table in tables:
        cells = _cells(engine, table, result, mapping)
        if cells:
            page.add(f"<h{level}>{_e(table)}</h{level}>")
            page.add_figure(heatmap(table, cells, result))


def add_sections(page: PageBuilder, engine: Any, result: Any, tables: Sequence[str], mapping: Sequence[tuple[str, str]]) -> None:
    """The diff as a section of another page (``trainprobe report --baseline``): its summary and
    heatmaps under ``<section id="baseline">``."""
    page.add('<section id="baseline"><h2>Against the baseline (trainprobe diff)</h2>' + summary_html(result))
    add_heatmaps(page, engine, result, tables, mapping, level=3)
    page.add("</section>")


def _cells(engine: Any, table: str, result: Any, mapping: Sequence[tuple[str, str]]) -> list[tuple[Any, ...]]:
    """``(scope, name, step, rel, only, order)`` per tensor and step: the largest relative
    difference, whether a row is in one run only, the tensor's place in execution order."""
    joined = joined_sql(table, result.ops.get(table, []), **result.joins[table])
    from trainprobe.tools.sql.questions import place_sql, stage_sql

    first_row = "min(COALESCE(b_row, c_row)) FILTER (WHERE COALESCE(b_file, c_file) = (SELECT file FROM first))"

    sql = f"""WITH j AS ({joined}), first AS (SELECT arg_min(COALESCE(b_file, c_file), k_step) AS file FROM j)
SELECT k_scope, COALESCE(max(b_name), max(c_name)) AS name, k_step, max(rel) AS rel,
  bool_or(status IN ({ONLY_BASELINE}, {ONLY_CANDIDATE})) AS only,
  {stage_sql(table, scope="k_scope", name="k_name")} AS stage,
  {place_sql(table, first_row, "k_scope", "k_name")} AS pos
FROM j GROUP BY k_scope, k_name, k_step"""
    return [tuple(r) for r in engine.fetch(sql)]


def heatmap(table: str, cells: Sequence[tuple[Any, ...]], result: Any) -> dict[str, Any]:
    """The Plotly figure of one table (module docstring)."""
    order: dict[tuple[str, str], tuple[float, float]] = {}
    for scope, name, _, _, _, stage, pos in cells:
        key = (scope, name)
        place = float(pos) if pos is not None else math.inf
        mark = (float(stage), place)  # place_sql: weight gradients from the last parameter, as backward runs
        order[key] = min(order.get(key, mark), mark)
    tensors = sorted(order, key=lambda k: (*order[k], k))[:MAX_TENSORS]
    row_of = {k: i for i, k in enumerate(tensors)}
    steps = sorted({c[2] for c in cells})
    width = max(1, math.ceil(len(steps) / MAX_COLUMNS))
    columns = sorted({s // width * width for s in steps})
    col_of = {s: i for i, s in enumerate(columns)}
    z: list[list[float | None]] = [[None] * len(columns) for _ in tensors]
    raw: list[list[str]] = [[""] * len(columns) for _ in tensors]
    only: list[list[float | None]] = [[None] * len(columns) for _ in tensors]
    for scope, name, step, rel, one, _, _ in cells:
        r = row_of.get((scope, name))
        if r is None:
            continue
        c = col_of[step // width * width]
        if one:
            only[r][c] = 1.0
        if rel is None:
            continue
        value = LOG_CEIL if not math.isfinite(rel) else max(LOG_FLOOR, math.log10(rel)) if rel > 0 else LOG_FLOOR
        if z[r][c] is None or value > (z[r][c] or LOG_FLOOR):
            z[r][c] = min(value, LOG_CEIL)
            raw[r][c] = f"{rel:.3g}"
    labels = [f"{scope} {name}" if scope != table else name for scope, name in tensors]
    x = [str(c) if width == 1 else f"{c}-{c + width - 1}" for c in columns]
    traces: list[dict[str, Any]] = [
        {
            "type": "heatmap", "x": x, "y": labels, "z": z, "customdata": raw, "zmin": LOG_FLOOR, "zmax": LOG_CEIL,
            "colorscale": "Viridis", "hoverongaps": False,
            "colorbar": {"title": {"text": "log10 rel. diff"}},
            "hovertemplate": "step %{x}<br>%{y}<br>relative difference %{customdata}<extra></extra>",
        },
        {
            "type": "heatmap", "x": x, "y": labels, "z": only, "zmin": 0, "zmax": 1, "showscale": False,
            "colorscale": [[0, "#bbbbbb"], [1, "#bbbbbb"]], "hoverongaps": False, "name": "in one run only",
            "hovertemplate": "step %{x}<br>%{y}<br>in one run only<extra></extra>",
        },
    ]
    first = result.first
    if first is not None and first.table == table:
        key = (first.scope, first.name)
        if key in row_of:
            traces.append({
                "type": "scatter", "mode": "markers", "name": "first divergence",
                "x": [x[col_of[first.step // width * width]]], "y": [labels[row_of[key]]],
                "marker": {"symbol": "circle-open", "size": 16, "color": "red", "line": {"width": 3}},
                "hovertemplate": "first divergence<extra></extra>",
            })
    height = min(4000, 160 + 14 * len(labels))
    return {
        "data": traces,
        "layout": {
            "title": {"text": f"{table}: log10 of the relative difference per step ({result.rule()})"},
            "height": height, "showlegend": False,
            "xaxis": {"title": {"text": "step"}, "type": "category"},
            "yaxis": {"autorange": "reversed", "type": "category", "automargin": True},
            "margin": {"l": 40, "r": 20, "t": 50, "b": 50},
        },
    }


def _e(value: object) -> str:
    return html.escape(str(value))


def summary_html(result: Any) -> str:
    """The answer, the counts, the earliest divergences and the rows in one run only."""
    c = result.counts
    state = "bad" if result.diverged else "ok"
    parts = [
        f'<p class="{state}" id="tp-answer">{_e(result.answer())}</p>',
        f'<p class="note">baseline {_e(result.baseline)}; candidate {_e(result.candidate)}; '
        f"{'exact' if result.exact else _e(result.rule())}; offset {result.offset}</p>",
        "<table><tr>" + "".join(f"<th>{_e(k)}</th>" for k in c) + "</tr><tr>"
        + "".join(f'<td class="num">{v:,}</td>' for v in c.values()) + "</tr></table>",
    ]
    for title, rows in (("Earliest divergences", result.divergences), ("Only in the baseline", result.only_baseline),
                        ("Only in the candidate", result.only_candidate)):
        if not rows:
            continue
        parts.append(f"<h3>{title}</h3><table><tr><th>step</th><th>rank</th><th>table</th><th>tensor</th><th>op</th>"
                     "<th>baseline</th><th>candidate</th><th>rel. diff</th></tr>")
        for r in rows:
            rel = "" if r.rel_diff is None else f"{r.rel_diff:.2e}"
            parts.append(
                f'<tr><td class="num">{r.step}</td><td class="num">{r.rank}</td><td>{_e(r.table)} {_e(r.scope)}</td>'
                f"<td>{_e(r.name)}</td><td>{_e(r.op or '')}</td><td class=\"num\">{_e(fmt(r.baseline) if r.op else '')}"
                f"</td><td class=\"num\">{_e(fmt(r.candidate) if r.op else '')}</td><td class=\"num\">{rel}</td></tr>"
            )
        parts.append("</table>")
    return "".join(parts)
