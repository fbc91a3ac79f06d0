"""The Plotly figures of ``trainprobe report``, as plain figure dicts.

Large arrays travel as Plotly typed-array specs (base64 float32/int32/uint8), which keeps a report
of 2,000 steps × 200 targets a few megabytes. Figures whose view can be switched (data type, op,
rank, linear/log colour) carry one trace per view; their drop-down menus are Plotly updatemenus
named ``tp-<dimension>`` with the ``skip`` method, and the page's script (see
:mod:`trainprobe.tools.reporting.html`) shows the traces whose ``meta.tp`` matches the menus.

Downsampling: a heatmap has at most :data:`MAX_HEATMAP_COLUMNS` step columns and a line at most
:data:`MAX_LINE_POINTS` points; longer runs are cut into buckets of consecutive steps and each
bucket shows its value of largest magnitude (a spike is kept), or non-finite if any value in it is.
Pages with many ranks, ops and data types get fewer columns and points (see :func:`heatmap_bucket`,
:func:`line_bucket`), so that the page stays about 15 MB at most (the 32 ranks x 500 steps x 100
parameters x 2 scopes of ``bench/bench_query.py``: 13 MB, of which Plotly's bundle is 4.8 MB).
"""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from trainprobe.tools.anomalies.analyser import AnomalyEvent
from trainprobe.tools.reporting.data import Group, ReportData, default_op
from trainprobe.tools.reporting.downsample import bucket_size, downsample
from trainprobe.tools.reporting.events import event_group, event_target
from trainprobe.tools.reporting.findings import KIND_WORDS, Finding, kinds_in_order
from trainprobe.tools.reporting.run import LOSS_KEYS, LR_KEYS, NORM_KEYS, Offenders, Series

Figure = dict[str, Any]

MAX_HEATMAP_COLUMNS = 500
MIN_HEATMAP_COLUMNS = 20
#: Heatmap cells of the whole page (every data type, op and rank): about 5 MB of page.
PAGE_HEATMAP_CELLS = 1_000_000
MAX_LINE_POINTS = 1000
MIN_LINE_POINTS = 40
#: Line points of the line charts of the whole page: about 2 MB of page.
PAGE_LINE_POINTS = 400_000
TOP_LINES = 10
PICKABLE_LINES = 30
MAX_TIMELINE_EVENTS = 2000
#: Heatmap row height and row label font (px): a label of each row fits its row.
ROW_PIXELS = 14
ROW_FONT = 11
NONFINITE_COLOUR = "#e4002b"
COLOURSCALE = "Viridis"
#: Diagnose's anomalies on the timeline: kind → (marker symbol, colour).
FINDING_MARKERS = {"spike": ("triangle-up-open", "#ff7f0e"), "nonfinite": ("square-open", "#000"),
                   "alert": ("x-thin-open", "#000")}
RANK_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#17becf")
#: The colour-scale menu; log (index 1) is the default: one embedding row no longer washes out
#: the rest. Log colour is log10(|x|) with 0 one decade below the smallest non-zero |x|; the
#: colour bar is labelled in real values and the hover shows the real (signed) value.
SCALE_LABELS = ("colour: linear", "colour: log |x|")
LOG_SCALE = 1
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_DTYPES = {"float32": "f4", "int32": "i4", "uint8": "u1"}


# --------------------------------------------------------------------------- helpers


def plot_text(text: object) -> str:
    """``text`` as Plotly must receive it to draw it literally. Plotly reads every string it
    draws (tick labels, legend names, titles, hover text, menu labels, annotations) as
    pseudo-HTML (``<br>``, ``<b>``, ``<a href>``, ``<span style>``) and ``%{...}`` in a hover
    template as a field, so ``<``, ``>``, ``&`` and ``%`` go as entities, which Plotly turns back
    into the characters: a target named ``<a href="https://x">click</a>`` shows as such and
    makes no link. Every string of the figures that comes from the monitor output (targets,
    data types, ops, alert messages) passes through here."""
    return html.escape(str(text), quote=False).replace("%", "&#37;")


def typed(array: np.ndarray) -> dict[str, str]:
    """A Plotly typed-array spec of a float32, int32 or uint8 array (any number of dimensions)."""
    data = np.ascontiguousarray(array)
    spec = {"dtype": _DTYPES[str(data.dtype)], "bdata": base64.b64encode(data.tobytes()).decode("ascii")}
    if data.ndim > 1:
        spec["shape"] = ", ".join(str(n) for n in data.shape)
    return spec


def as_float32(values: np.ndarray) -> np.ndarray:
    """``values`` as float32, finite values clipped to float32's range (NaN kept)."""
    return np.clip(values, -_FLOAT32_MAX, _FLOAT32_MAX).astype(np.float32)


def tiny_of(values: np.ndarray) -> float:
    """Where the log colour puts 0: a tenth of the smallest non-zero magnitude (1e-30 when
    every value is zero or missing); log colour is ``log10(max(|x|, tiny))``."""
    magnitude = np.abs(values[np.isfinite(values) & (values != 0)])
    return float(magnitude.min()) / 10 if magnitude.size else 1e-30


def real_label(value: float) -> str:
    """A colour-bar tick of the log scale in real values: ``0.01``, ``2``, ``5000``, ``1e-05``, ``2e+06``."""
    if 1e-3 <= abs(value) < 1e5:
        return f"{float(f'{value:.3g}'):.10g}"
    return "0" if value == 0 else f"{value:.3g}"


def log_ticks(values: np.ndarray) -> dict[str, list[Any]]:
    """Colour-bar ticks of the log colour of ``values``: positions log10(|x|) at 1, 2, 5 × 10^d
    (only 10^d, thinned, beyond 3 decades), labelled in real values; a tick "0" at the floor
    (:func:`tiny_of`) when some value is 0. Fewer than two decade ticks in range (a narrow
    range): four evenly spaced ticks instead."""
    finite = values[np.isfinite(values)]
    magnitude = np.abs(finite[finite != 0]).astype(np.float64)
    vals: list[float] = []
    text: list[str] = []
    if magnitude.size:
        lo, hi = float(np.log10(magnitude.min())), float(np.log10(magnitude.max()))
        first, last = math.floor(lo + 1e-6), math.ceil(hi - 1e-6)  # float32 slack
        mantissas = (1, 2, 5) if last - first <= 3 else (1,)
        every = max(1, math.ceil((last - first) / 8))
        for decade in range(first, last + 1):
            for mantissa in mantissas:
                at = decade + math.log10(mantissa)
                if (decade - first) % every == 0 and lo - 1e-6 <= at <= hi + 1e-6:  # float32 slack
                    vals.append(at)
                    text.append(real_label(mantissa * 10.0**decade))
        if len(vals) < 2:
            vals = sorted({lo + (hi - lo) * i / 3 for i in range(4)})
            text = [real_label(float(f"{10**v:.3g}")) for v in vals]
    if (finite == 0).any():
        vals.insert(0, math.log10(tiny_of(values)))
        text.insert(0, "0")
    return {"vals": vals, "text": text}


def menu(
    name: str, labels: Sequence[str], active: int = 0, buttons: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """A drop-down updatemenu; ``name`` ``tp-<dimension>`` is handled by the page's script (its
    buttons do nothing themselves), other menus bring their own ``buttons``."""
    if buttons is None:
        buttons = [{"label": label, "method": "skip", "args": [None]} for label in labels]
    return {"name": name, "type": "dropdown", "direction": "down", "active": active, "buttons": buttons}


def menu_row(menus: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The menus side by side above the plot, left to right, skipping ``tp-`` menus with a single
    choice (nothing to switch)."""
    row, x = [], 0.0
    for item in menus:
        if item["name"].startswith("tp-") and len(item["buttons"]) < 2:
            continue
        row.append({**item, "x": x, "xanchor": "left", "y": 1.02, "yanchor": "bottom", "showactive": True})
        x += (8 * max(len(b["label"]) for b in item["buttons"]) + 70) / 900  # about 900 px of plot width
    return row


def heatmap_bucket(group: Group, n_groups: int) -> int:
    """Steps per heatmap column of ``group``: columns are at most :data:`MAX_HEATMAP_COLUMNS`, and
    fewer (never below :data:`MIN_HEATMAP_COLUMNS`) when the heatmaps of all ``n_groups`` data
    types, with every op and rank, would hold more than :data:`PAGE_HEATMAP_CELLS` cells."""
    views = max(1, n_groups * len(group.targets) * len(group.ops) * len(group.ranks))
    columns = min(MAX_HEATMAP_COLUMNS, max(MIN_HEATMAP_COLUMNS, PAGE_HEATMAP_CELLS // views))
    return bucket_size(len(group.steps), columns)


def line_bucket(group: Group, n_groups: int) -> int:
    """Steps per line point of ``group``: the same rule as :func:`heatmap_bucket` with
    :data:`MAX_LINE_POINTS`, :data:`MIN_LINE_POINTS` and :data:`PAGE_LINE_POINTS`."""
    lines = min(PICKABLE_LINES, len(group.targets))
    views = max(1, n_groups * lines * len(group.ops) * len(group.ranks))
    points = min(MAX_LINE_POINTS, max(MIN_LINE_POINTS, PAGE_LINE_POINTS // views))
    return bucket_size(len(group.steps), points)


def _steps_axis(steps: np.ndarray, size: int) -> dict[str, str]:
    return typed(steps[::size].astype(np.int32))


def _step_title(size: int) -> str:
    return "step" if size == 1 else f"step (each column: {size} steps, largest |value| kept)"


# --------------------------------------------------------------------------- heatmaps


def heatmap_traces(
    x: dict[str, str],
    y: list[str],
    values: np.ndarray,
    nonfinite: np.ndarray,
    label: str,
    tp: dict[str, int],
    visible: bool,
    extra: str,
) -> list[dict[str, Any]]:
    """A heatmap of ``values`` (rows × columns) and, where any cell is non-finite, a red overlay."""
    z = as_float32(values)
    y, label, extra = [plot_text(name) for name in y], plot_text(label), plot_text(extra)
    hover = f"%{{y}}<br>step %{{x}}<br>{label} = %{{z:.4g}}<extra>{extra}</extra>"
    log_hover = f"%{{y}}<br>step %{{x}}<br>{label} = %{{customdata:.4g}}<extra>{extra}</extra>"
    traces: list[dict[str, Any]] = [
        {
            "type": "heatmap",
            "x": x,
            "y": y,
            "z": typed(z),
            "colorscale": COLOURSCALE,
            "colorbar": {"title": {"text": label}},
            "hovertemplate": hover,
            "hoverongaps": False,
            "visible": visible,
            "meta": {
                "tp": tp,
                "role": "z",
                "tiny": tiny_of(z),
                "ticks": log_ticks(z),
                "hover": hover,
                "loghover": log_hover,
                "label": label,
            },
        }
    ]
    if nonfinite.any():
        traces.append(
            {
                "type": "heatmap",
                "x": x,
                "y": y,
                "z": typed(nonfinite.astype(np.uint8)),
                "colorscale": [[0, "rgba(0,0,0,0)"], [1, NONFINITE_COLOUR]],
                "zmin": 0,
                "zmax": 1,
                "showscale": False,
                "hoverinfo": "skip",
                "visible": visible,
                "meta": {"tp": tp, "role": "mask"},
            }
        )
    return traces


def group_heatmap(group: Group, size: int) -> Figure:
    """Targets (rows, model order) × steps of one group, ``size`` steps per column: one view per
    (op, rank), linear or log colour."""
    x = _steps_axis(group.steps, size)
    ranks = sorted(group.ranks)
    first_op = default_op(group.ops)
    traces: list[dict[str, Any]] = []
    for o, op in enumerate(group.ops):
        for r, rank in enumerate(ranks):
            matrix = group.ranks[rank]
            values, nonfinite = downsample(matrix.values[:, :, o], matrix.nonfinite[:, :, o], size)
            tp = {"op": o, "rank": r}
            traces += heatmap_traces(
                x, group.targets, values, nonfinite, op, tp, o == first_op and r == 0, f"rank {rank}"
            )
    menus = menu_row(
        [
            menu("tp-op", [f"op: {plot_text(op)}" for op in group.ops], first_op),
            menu("tp-rank", [f"rank {rank}" for rank in ranks]),
            menu("tp-scale", SCALE_LABELS, LOG_SCALE),
        ]
    )
    layout = {
        "title": {"text": f"{plot_text(group.name)}: {_targets_words(group)} × steps"},
        "height": heatmap_height(len(group.targets)),
        "margin": {"t": 90, "b": 60},
        "updatemenus": menus,
        "xaxis": {"title": {"text": _step_title(size)}},
        "yaxis": row_axis([plot_text(name) for name in group.targets]),
        "plot_bgcolor": "#f4f4f4",
    }
    return {"data": traces, "layout": layout}


def heatmap_height(rows: int) -> int:
    """Pixels of a heatmap of ``rows`` targets: :data:`ROW_PIXELS` per row (every row's label
    fits, none is dropped) plus the menus, title and step axis."""
    return int(max(340, ROW_PIXELS * rows + 170))


def row_axis(labels: list[str]) -> dict[str, Any]:
    """The y axis of a targets heatmap: one tick per row, every label drawn (Plotly's automatic
    ticks skip labels once rows are closer than its font: with 20 rows and more every other one
    was lost), top to bottom in model order; the margin grows to the longest label."""
    return {
        "type": "category",
        "autorange": "reversed",
        "automargin": True,
        "title": {"text": "target"},
        "tickmode": "array",
        "tickvals": labels,
        "ticktext": labels,
        "tickfont": {"size": ROW_FONT},
    }


# --------------------------------------------------------------------------- line charts


def _targets_words(group: Group) -> str:
    """``targets``, or ``200 of 200000 targets (NaN/inf, then largest peak)`` when sampled."""
    if not group.sampled:
        return "targets"
    return f"{len(group.targets)} of {group.all_targets} targets (NaN/inf first, then largest peak)"


def top_targets(group: Group, limit: int) -> list[int]:
    """Indices of the ``limit`` targets with the largest finite |value| of the default op (norm)
    on any rank and step, largest first."""
    op = default_op(group.ops)
    peaks = np.full(len(group.targets), -1.0)
    for matrix in group.ranks.values():
        magnitude = np.abs(matrix.values[:, :, op])
        peaks = np.maximum(peaks, np.where(np.isnan(magnitude), -1.0, magnitude).max(axis=1))
    return [int(i) for i in np.argsort(-peaks, kind="stable")[:limit]]


def group_lines(group: Group, size: int) -> Figure:
    """Lines over steps (``size`` steps per point) of the top :data:`TOP_LINES` targets by max
    norm (the next ones, up to :data:`PICKABLE_LINES`, one click away in the legend); one view
    per (op, rank)."""
    x = _steps_axis(group.steps, size)
    ranks = sorted(group.ranks)
    chosen = top_targets(group, PICKABLE_LINES)
    first_op = default_op(group.ops)
    traces: list[dict[str, Any]] = []
    for o, op in enumerate(group.ops):
        for r, rank in enumerate(ranks):
            matrix = group.ranks[rank]
            values, _ = downsample(matrix.values[chosen, :, o], matrix.nonfinite[chosen, :, o], size)
            for n, target in enumerate(chosen):
                top = n < TOP_LINES
                shown = o == first_op and r == 0
                traces.append(
                    {
                        "type": "scatter",
                        "mode": "lines",
                        "name": plot_text(group.targets[target]),
                        "x": x,
                        "y": typed(as_float32(values[n])),
                        "line": {"width": 1.5},
                        "hovertemplate": f"%{{fullData.name}}<br>step %{{x}}<br>{plot_text(op)} = %{{y:.4g}}<extra>rank {rank}</extra>",
                        "visible": (True if top else "legendonly") if shown else False,
                        "meta": {"tp": {"op": o, "rank": r}, "role": "line", "top": top},
                    }
                )
    menus = menu_row(
        [
            menu("tp-op", [f"op: {plot_text(op)}" for op in group.ops], first_op),
            menu("tp-rank", [f"rank {rank}" for rank in ranks]),
            menu("y-axis", [], buttons=_axis_buttons()),
        ]
    )
    layout = {
        "title": {
            "text": f"{plot_text(group.name)}: top {min(TOP_LINES, len(chosen))} targets by max "
            f"{plot_text(group.ops[first_op])}"
        },
        "height": 420,
        "margin": {"t": 90, "b": 60},
        "updatemenus": menus,
        "xaxis": {"title": {"text": _step_title(size)}},
        "legend": {"font": {"size": 10}},
        "hovermode": "closest",
    }
    return {"data": traces, "layout": layout}


def _axis_buttons() -> list[dict[str, Any]]:
    return [
        {"label": "y: linear", "method": "relayout", "args": [{"yaxis.type": "linear"}]},
        {"label": "y: log", "method": "relayout", "args": [{"yaxis.type": "log"}]},
    ]


# --------------------------------------------------------------------------- ranks


def global_norm(group: Group, rank: int) -> tuple[np.ndarray, np.ndarray, str]:
    """Per step on ``rank``, over every target (drawn or not): sqrt(sum of the targets' norm²)
    (``norm`` op), or the largest |value| of the first op when there is no norm; also where a
    target was non-finite, and the label (see :class:`~trainprobe.tools.reporting.data.RankMatrix`)."""
    matrix = group.ranks[rank]
    return matrix.global_value, matrix.global_nonfinite, matrix.global_label


def rank_comparison(groups: Sequence[Group]) -> Figure:
    """Ranks × steps heatmap of each group's global norm, one view per group, linear or log colour."""
    traces: list[dict[str, Any]] = []
    for g, group in enumerate(groups):
        size = bucket_size(len(group.steps), MAX_HEATMAP_COLUMNS)
        ranks = sorted(group.ranks)
        rows = [global_norm(group, rank) for rank in ranks]
        values, nonfinite = downsample(np.stack([v for v, _, _ in rows]), np.stack([n for _, n, _ in rows]), size)
        y = [f"rank {rank}" for rank in ranks]
        traces += heatmap_traces(
            _steps_axis(group.steps, size), y, values, nonfinite, rows[0][2], {"group": g}, g == 0, group.name
        )
    menus = menu_row([menu("tp-group", [plot_text(g.name) for g in groups]), menu("tp-scale", SCALE_LABELS, LOG_SCALE)])
    labels = [f"rank {rank}" for rank in sorted({r for group in groups for r in group.ranks})]
    layout = {
        "title": {"text": "ranks × steps: global norm of each data type"},
        "height": int(max(min(800, max(300, 30 * len(labels) + 200)), ROW_PIXELS * len(labels) + 200)),
        "margin": {"t": 90, "b": 60},
        "updatemenus": menus,
        "xaxis": {"title": {"text": "step"}},
        "yaxis": {**row_axis(labels), "title": {"text": "rank"}},
        "plot_bgcolor": "#f4f4f4",
    }
    return {"data": traces, "layout": layout}


# --------------------------------------------------------------------------- timeline


def is_csv_event(event: AnomalyEvent) -> bool:
    """True for a NaN/inf onset read from a CSV, False for an alert from ``anomaly.json``."""
    return event.source.suffix == ".csv"


def timeline_categories(
    data: ReportData, events: Sequence[AnomalyEvent], findings: Sequence[Finding] = ()
) -> list[str]:
    """The timeline's rows: the data types in execution order, then any only alerts or
    diagnose's anomalies name."""
    names = [group.name for group in data.groups]
    named = [event_group(e) for e in events] + [f.group for f in findings]
    extra = [g for g in dict.fromkeys(named) if g not in names]
    return [plot_text(name) for name in names + extra]


def _event_trace(events: Sequence[AnomalyEvent], name: str, symbol: str, colour: str, size: int = 10) -> dict[str, Any]:
    return {
        "type": "scatter",
        "mode": "markers",
        "name": name,
        "x": [e.data["step"] for e in events],
        "y": [plot_text(event_group(e)) for e in events],
        "customdata": [
            [plot_text(event_target(e)), e.data["micro_step"], plot_text(e.data["message"])] for e in events
        ],
        "marker": {"symbol": symbol, "size": size, "color": colour, "line": {"width": 1.5, "color": colour}},
        "hovertemplate": "%{customdata[0]}<br>step %{x}, micro-step %{customdata[1]}<br>%{customdata[2]}<extra>"
        + name
        + "</extra>",
    }


def _finding_trace(findings: Sequence[Finding], kind: str) -> dict[str, Any]:
    """Diagnose's anomalies of one ``kind`` as markers (spikes: triangles; NaN/inf: squares;
    alerts: crosses), hover: diagnose's own line."""
    symbol, colour = FINDING_MARKERS.get(kind, ("x-thin-open", "#000"))
    mine = [f for f in findings if f.kind == kind]
    return {
        "type": "scatter",
        "mode": "markers",
        "name": f"Diagnosis: {KIND_WORDS.get(kind, plot_text(kind))}",
        "x": [f.step for f in mine],
        "y": [plot_text(f.group) for f in mine],
        "customdata": [[plot_text(f.line)] for f in mine],
        "marker": {"symbol": symbol, "size": 13, "color": colour, "line": {"width": 2, "color": colour}},
        "hovertemplate": "%{customdata[0]}<extra>Diagnosis</extra>",
        "meta": {"role": "finding", "kind": kind},
    }


def _star(first: AnomalyEvent | Finding) -> tuple[dict[str, Any], str]:
    """The star's trace on ``first`` (diagnose's first anomaly, else the first event) and its label."""
    star: dict[str, Any]
    if isinstance(first, Finding):
        star = {
            "type": "scatter", "mode": "markers", "name": "first anomaly (as the Diagnosis says)",
            "x": [first.step], "y": [plot_text(first.group)], "customdata": [[plot_text(first.line)]],
            "hovertemplate": "%{customdata[0]}<extra>first anomaly</extra>",
        }
        where = f"{first.group} · {first.name} · rank {first.rank} · step {first.step} ({KIND_WORDS.get(first.kind, first.kind)})"
        label = f"first anomaly: {plot_text(where)}"
    else:
        star = _event_trace([first], "first in execution order", "star", NONFINITE_COLOUR, 22)
        where = f"{event_group(first)} · {event_target(first)} · rank {first.data['rank']} · step {first.data['step']}"
        label = f"first: {plot_text(where)}"
    star["marker"] = {"symbol": "star", "size": 22, "color": NONFINITE_COLOUR, "line": {"width": 1.5, "color": "#000"}}
    star["meta"] = {"role": "star", "step": star["x"][0], "group": star["y"][0]}
    return star, label


def anomaly_timeline(
    data: ReportData, events: Sequence[AnomalyEvent], findings: Sequence[Finding] = (), diagnosed: bool = False
) -> Figure:
    """Steps (x) × data types (y) of the NaN/inf onsets (circles) and dumped alerts (diamonds),
    coloured by rank, and of ``trainprobe diagnose``'s anomalies (``findings``: spikes as
    triangles, NaN/inf as squares). The star, with a label, marks diagnose's first anomaly
    (the Diagnosis section's first line); without a diagnosis (``diagnosed`` False) the first
    event in execution order; when diagnose ran and found none (a GradScaler run), no star."""
    traces = []
    for rank in sorted({e.data["rank"] for e in events}):
        colour = RANK_COLOURS[rank % len(RANK_COLOURS)]
        mine = [e for e in events if e.data["rank"] == rank]
        csv = [e for e in mine if is_csv_event(e)]
        alerts = [e for e in mine if not is_csv_event(e)]
        if csv:
            traces.append(_event_trace(csv, f"NaN/inf rows, rank {rank}", "circle-open", colour, 15))
        if alerts:
            traces.append(_event_trace(alerts, f"alerts, rank {rank}", "diamond", colour, 8))
    traces += [_finding_trace(findings, kind) for kind in kinds_in_order(findings)]
    first: AnomalyEvent | Finding | None = findings[0] if findings else (None if diagnosed or not events else events[0])
    categories = timeline_categories(data, events, findings)
    steps = data.steps
    annotations = []
    if first is not None:
        star, label = _star(first)
        traces.append(star)
        step = star["x"][0]
        annotations.append({
            "x": step, "y": star["y"][0], "text": label, "showarrow": True, "arrowhead": 2,
            "ax": -70 if step > (steps[0] + steps[-1]) / 2 else 70, "ay": -40,
            "bgcolor": "#fff", "bordercolor": NONFINITE_COLOUR,
        })
    low = min([float(steps[0]), *(f.step for f in findings)])
    high = max([float(steps[-1]), *(f.step for f in findings)])
    layout = {
        "title": {"text": "anomaly timeline (execution order: step, micro-step, phase, stage, data type, row, rank)"},
        "height": int(max(300, 34 * len(categories) + 190)),
        "margin": {"t": 70, "b": 60},
        "xaxis": {"title": {"text": "step"}, "range": [low - 0.5, high + 0.5], "zeroline": False},
        "yaxis": {
            "type": "category",
            "categoryorder": "array",
            "categoryarray": categories,
            "range": [len(categories) - 0.5, -0.5],
            "automargin": True,
        },
        "annotations": annotations,
        "hovermode": "closest",
        "legend": {"orientation": "h", "y": -0.25},
    }
    return {"data": traces, "layout": layout}


# --------------------------------------------------------------------------- run


#: The training curves' panels: title, the training_state.jsonl keys drawn, y axis type.
RUN_PANELS = (
    ("loss", LOSS_KEYS, "linear"),
    ("learning rate", LR_KEYS, "linear"),
    ("global gradient norm", NORM_KEYS, "log"),
)
#: Ranks drawn per line of the training curves (the lowest ones).
MAX_RUN_RANKS = 8
OTHER_COLOUR = "#9e9e9e"
REST_COLOUR = "#e0e0e0"


def run_series(data: ReportData) -> dict[str, list[Series]]:
    """The lines of each Run panel that has any: the training metrics' keys (``training_state.jsonl``,
    TensorBoard), and for the gradient norm also the global norm (sqrt of the sum of the
    parameters' squared norms) of the first gradient group (reduced gradients where there are,
    else unreduced); at most :data:`MAX_RUN_RANKS` ranks each."""
    panels: dict[str, list[Series]] = {}
    for title, keys, _ in RUN_PANELS:
        lines = [s for key in keys for s in data.training.series if s.key == key]
        if title == "global gradient norm":
            for group in data.gradient_groups[:1]:
                for rank in sorted(group.ranks):
                    value, bad, _ = global_norm(group, rank)
                    lines.append(Series(group.name, "monitor CSVs", rank, group.steps, value, bad))
        ranks = sorted({s.rank for s in lines})[:MAX_RUN_RANKS]
        lines = [s for s in lines if s.rank in ranks]
        if lines:
            panels[title] = lines
    return panels


def downsample_line(steps: np.ndarray, values: np.ndarray, points: int) -> tuple[np.ndarray, np.ndarray]:
    """At most ``points`` points: buckets of consecutive points, each at its first step with
    its value of largest magnitude (NaN/inf count as largest: a non-finite bucket is a gap)."""
    size = bucket_size(len(steps), points)
    if size == 1:
        return steps, values
    flagged = ~np.isfinite(values)
    picked, bad = downsample(np.where(flagged, np.nan, values)[None, :], flagged[None, :], size)
    return steps[::size], np.where(bad[0], np.nan, picked[0])


def nonfinite_markers(line: Series, name: str, axis: str, title: str) -> dict[str, Any]:
    """Red crosses at the steps of ``line`` where some parameter's norm was NaN/inf (at most
    :data:`MAX_LINE_POINTS`, evenly picked): on the line where its value is finite, else at the
    bottom of the line's finite values (at 1 when it has none)."""
    assert line.nonfinite is not None
    where = np.flatnonzero(line.nonfinite)
    where = where[:: bucket_size(len(where), MAX_LINE_POINTS)]
    finite = line.values[np.isfinite(line.values)]
    bottom = float(finite.min()) if finite.size else 1.0
    y = np.where(np.isfinite(line.values[where]), line.values[where], bottom)
    label = f"NaN/inf in a gradient · rank {line.rank}"
    return {
        "type": "scatter",
        "mode": "markers",
        "name": plot_text(label),
        "legendgroup": title,
        "legendgrouptitle": None,
        "x": typed(line.steps[where].astype(np.int32)),
        "y": typed(as_float32(y)),
        "xaxis": f"x{axis}",
        "yaxis": f"y{axis}",
        "marker": {"symbol": "x", "size": 9, "color": NONFINITE_COLOUR},
        "hovertemplate": f"step %{{x}}: a parameter's norm is NaN/inf, left out of {plot_text(name)}<extra></extra>",
        "meta": {"role": "run-nonfinite", "panel": title, "rank": line.rank},
    }


def run_figure(panels: dict[str, list[Series]]) -> Figure:
    """One panel per Run line (loss, learning rate, global gradient norm) stacked over a shared
    step axis; one line per (source key, rank); the gradient norm on a log y axis."""
    traces: list[dict[str, Any]] = []
    layout: dict[str, Any] = {}
    n = len(panels)
    gap = 0.08
    height = (1 - gap * (n - 1)) / n
    for p, (title, lines) in enumerate(panels.items()):
        axis = "" if p == 0 else str(p + 1)
        top = 1 - p * (height + gap)
        axis_type = next(t for name, _, t in RUN_PANELS if name == title)
        layout[f"yaxis{axis}"] = {
            "domain": [top - height, top],
            "type": axis_type,
            "title": {"text": title},
            "exponentformat": "power",
        }
        layout[f"xaxis{axis}"] = {"anchor": f"y{axis}", "matches": "x" if p else None, "showticklabels": p == n - 1}
        for n_line, line in enumerate(lines):
            steps, values = downsample_line(line.steps, line.values, MAX_LINE_POINTS)
            name = f"{line.key} · rank {line.rank}"
            traces.append(
                {
                    "type": "scatter",
                    "mode": "lines+markers" if len(steps) < 50 else "lines",
                    "name": plot_text(name),
                    "legendgroup": title,
                    "legendgrouptitle": {"text": title} if n_line == 0 else None,
                    "x": typed(steps.astype(np.int32)),
                    "y": typed(as_float32(values)),
                    "xaxis": f"x{axis}",
                    "yaxis": f"y{axis}",
                    "line": {"width": 1.5},
                    "marker": {"size": 4},
                    "hovertemplate": f"{plot_text(name)}<br>step %{{x}}<br>{plot_text(title)} = %{{y:.4g}}"
                    f"<extra>{plot_text(line.source)}</extra>",
                    "meta": {"role": "run", "panel": title, "key": plot_text(line.key), "rank": line.rank},
                }
            )
            if line.nonfinite is not None and line.nonfinite.any():
                traces.append(nonfinite_markers(line, name, axis, title))
    layout["xaxis" if n == 1 else f"xaxis{n}"]["title"] = {"text": "step"}
    for key in [k for k in layout if k.startswith("xaxis")]:
        layout[key] = {k: v for k, v in layout[key].items() if v is not None}
    for trace in traces:
        if trace["legendgrouptitle"] is None:
            del trace["legendgrouptitle"]
    layout.update(
        {
            "title": {"text": "training curves: " + ", ".join(plot_text(t) for t in panels) + " over steps"},
            "height": int(200 + 220 * n),
            "margin": {"t": 60, "b": 60},
            "hovermode": "closest",
            "showlegend": True,
            "legend": {"font": {"size": 10}, "groupclick": "toggleitem"},
        }
    )
    return {"data": traces, "layout": layout}


# --------------------------------------------------------------------------- top offenders


def offender_buckets(offenders: Offenders, points: int) -> np.ndarray:
    """Row indices of the steps drawn: all, or per bucket of consecutive steps the one with the
    largest global norm (so a spike and what drove it stay visible)."""
    n = len(offenders.steps)
    size = bucket_size(n, points)
    if size == 1:
        return np.arange(n)
    norm = np.where(np.isfinite(offenders.norm), offenders.norm, -1.0)
    pad = (-n) % size
    padded = np.concatenate([norm, np.full(pad, -np.inf)]).reshape(-1, size)
    return np.minimum(np.arange(0, n + pad, size) + padded.argmax(axis=1), n - 1)


def offender_shares(offenders: Offenders, rows: np.ndarray) -> tuple[list[str], np.ndarray]:
    """Per drawn step (``rows``): the share of global norm² of each parameter of the table
    (0 where it is not among the step's top k), then of the other top-k parameters, then of
    every parameter outside the top k (1 - the top k's shares). Returns the band names and a
    ``(bands, steps)`` array whose columns add up to 1."""
    names = [row.name for row in offenders.rows]
    position = {name: i for i, name in enumerate(names)}
    bands = np.zeros((len(names) + 2, len(rows)))
    for column, row in enumerate(rows.tolist()):
        for target, share in zip(offenders.top_ids[row].tolist(), offenders.top_share[row].tolist()):
            if target < 0 or not math.isfinite(share):
                continue
            band = position.get(offenders.names[target], len(names))
            bands[band, column] += share
    bands[-1] = np.clip(1.0 - bands[:-1].sum(axis=0), 0.0, 1.0)
    k = offenders.top_ids.shape[1]
    return [*names, f"other parameters in a step's top {k}", f"outside the step's top {k}"], bands


def offenders_figure(offenders: Offenders) -> Figure:
    """The global gradient norm over steps (top) and, below, each step's norm² split into the
    shares of the table's parameters, the other top-k ones and the rest (stacked bars)."""
    rows = offender_buckets(offenders, MAX_LINE_POINTS)
    x = typed(offenders.steps[rows].astype(np.int32))
    names, bands = offender_shares(offenders, rows)
    traces: list[dict[str, Any]] = [
        {
            "type": "scatter",
            "mode": "lines+markers" if len(rows) < 50 else "lines",
            "name": "global norm",
            "x": x,
            "y": typed(as_float32(offenders.norm[rows])),
            "yaxis": "y2",
            "line": {"width": 1.5, "color": "#222"},
            "marker": {"size": 4},
            "hovertemplate": "step %{x}<br>global norm = %{y:.4g}<extra></extra>",
            "meta": {"role": "offender-norm"},
        }
    ]
    for band, name in enumerate(names):
        colour = {len(names) - 2: OTHER_COLOUR, len(names) - 1: REST_COLOUR}.get(band)
        traces.append(
            {
                "type": "bar",
                "name": plot_text(name),
                "x": x,
                "y": typed(as_float32(bands[band])),
                "marker": {"color": colour, "line": {"width": 0}} if colour else {"line": {"width": 0}},
                "hovertemplate": f"{plot_text(name)}<br>step %{{x}}<br>share of norm² = %{{y:.1%}}<extra></extra>",
                "meta": {"role": "offender-share"},
            }
        )
    sampled = len(rows) < len(offenders.steps)
    step_title = "step" + (" (each bar: the step of largest global norm in its bucket)" if sampled else "")
    layout = {
        "title": {
            "text": f"top offenders: {plot_text(offenders.source)}, rank {offenders.rank}: global gradient norm "
            "and each step's norm² by parameter"
        },
        "height": 620,
        "margin": {"t": 60, "b": 60},
        "barmode": "stack",
        "bargap": 0.05,
        "xaxis": {"title": {"text": step_title}},
        "yaxis": {"domain": [0, 0.55], "range": [0, 1], "tickformat": ".0%", "title": {"text": "share of norm²"}},
        "yaxis2": {"domain": [0.65, 1], "type": "log", "title": {"text": "global norm"}, "exponentformat": "power"},
        "hovermode": "closest",
        "legend": {"font": {"size": 10}, "traceorder": "normal"},
    }
    return {"data": traces, "layout": layout}
