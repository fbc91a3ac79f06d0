"""The Plotly figures of ``trainprobe report``, as plain figure dicts.

Large arrays travel as Plotly typed-array specs (base64 float32/int32/uint8), which keeps a report
of 2,000 steps × 200 targets a few megabytes. Figures whose view can be switched (data type, op,
rank, linear/log colour) carry one trace per view; their drop-down menus are Plotly updatemenus
named ``tp-<dimension>`` with the ``skip`` method, and the page's script (see
:mod:`trainprobe.tools.report_html`) shows the traces whose ``meta.tp`` matches the menus.

Downsampling: a heatmap has at most :data:`MAX_HEATMAP_COLUMNS` step columns and a line at most
:data:`MAX_LINE_POINTS` points; longer runs are cut into buckets of consecutive steps and each
bucket shows its value of largest magnitude (a spike is kept), or non-finite if any value in it is.
Pages with many ranks, ops and data types get fewer columns (see :func:`heatmap_bucket`), so that
the page stays a few tens of megabytes at most.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from typing import Any

import numpy as np

from trainprobe.tools.anomaly_analyse import AnomalyEvent
from trainprobe.tools.report_data import (
    Group,
    ReportData,
    bucket_size,
    default_op,
    downsample,
    event_group,
    event_target,
)

Figure = dict[str, Any]

MAX_HEATMAP_COLUMNS = 500
MIN_HEATMAP_COLUMNS = 100
PAGE_HEATMAP_CELLS = 6_000_000
MAX_LINE_POINTS = 1000
MIN_LINE_POINTS = 200
PAGE_LINE_POINTS = 2_000_000
TOP_LINES = 10
PICKABLE_LINES = 30
MAX_TIMELINE_EVENTS = 2000
NONFINITE_COLOUR = "#e4002b"
COLOURSCALE = "Viridis"
RANK_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#17becf")
SCALE_LABELS = ("colour: linear", "colour: log10(|x|+tiny)")
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
    """The ``tiny`` of the log colour ``log10(|x| + tiny)``: a tenth of the smallest non-zero
    magnitude (1e-30 when every value is zero or missing)."""
    magnitude = np.abs(values[np.isfinite(values) & (values != 0)])
    return float(magnitude.min()) / 10 if magnitude.size else 1e-30


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
    log_hover = f"%{{y}}<br>step %{{x}}<br>log10(|{label}|+tiny) = %{{z:.3f}}<extra>{extra}</extra>"
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
            "meta": {"tp": tp, "role": "z", "tiny": tiny_of(z), "hover": hover, "loghover": log_hover, "label": label},
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
            menu("tp-scale", SCALE_LABELS),
        ]
    )
    height = int(min(1000, max(340, 12 * len(group.targets) + 170)))
    layout = {
        "title": {"text": f"{plot_text(group.name)}: {_targets_words(group)} × steps"},
        "height": height,
        "margin": {"t": 90, "b": 60},
        "updatemenus": menus,
        "xaxis": {"title": {"text": _step_title(size)}},
        "yaxis": {"type": "category", "autorange": "reversed", "automargin": True, "title": {"text": "target"}},
        "plot_bgcolor": "#f4f4f4",
    }
    return {"data": traces, "layout": layout}


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
    target was non-finite, and the label (see :class:`~trainprobe.tools.report_data.RankMatrix`)."""
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
    menus = menu_row([menu("tp-group", [plot_text(g.name) for g in groups]), menu("tp-scale", SCALE_LABELS)])
    n_ranks = max(len(group.ranks) for group in groups)
    layout = {
        "title": {"text": "ranks × steps: global norm of each data type"},
        "height": int(min(800, max(300, 30 * n_ranks + 200))),
        "margin": {"t": 90, "b": 60},
        "updatemenus": menus,
        "xaxis": {"title": {"text": "step"}},
        "yaxis": {"type": "category", "autorange": "reversed", "automargin": True},
        "plot_bgcolor": "#f4f4f4",
    }
    return {"data": traces, "layout": layout}


# --------------------------------------------------------------------------- timeline


def is_csv_event(event: AnomalyEvent) -> bool:
    """True for a NaN/inf onset read from a CSV, False for an alert from ``anomaly.json``."""
    return event.source.suffix == ".csv"


def timeline_categories(data: ReportData, events: Sequence[AnomalyEvent]) -> list[str]:
    """The timeline's rows: the data types in execution order, then any only alerts name."""
    names = [group.name for group in data.groups]
    extra = [g for g in dict.fromkeys(event_group(e) for e in events) if g not in names]
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


def anomaly_timeline(data: ReportData, events: Sequence[AnomalyEvent]) -> Figure:
    """Steps (x) × data types (y) of the NaN/inf onsets (circles) and dumped alerts (diamonds),
    coloured by rank; the first event in execution order is a star with a label."""
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
    first = events[0]
    star = _event_trace([first], "first in execution order", "star", NONFINITE_COLOUR, 22)
    star["marker"]["line"] = {"width": 1.5, "color": "#000"}
    traces.append(star)
    categories = timeline_categories(data, events)
    steps = data.steps
    where = f"{event_group(first)} · {event_target(first)} · rank {first.data['rank']} · step {first.data['step']}"
    label = f"first: {plot_text(where)}"
    layout = {
        "title": {"text": "anomaly timeline (execution order: step, micro-step, phase, stage, call, rank)"},
        "height": int(max(300, 34 * len(categories) + 190)),
        "margin": {"t": 70, "b": 60},
        "xaxis": {
            "title": {"text": "step"},
            "range": [float(steps[0]) - 0.5, float(steps[-1]) + 0.5],
            "zeroline": False,
        },
        "yaxis": {
            "type": "category",
            "categoryorder": "array",
            "categoryarray": categories,
            "range": [len(categories) - 0.5, -0.5],
            "automargin": True,
        },
        "annotations": [
            {
                "x": first.data["step"],
                "y": plot_text(event_group(first)),
                "text": label,
                "showarrow": True,
                "arrowhead": 2,
                "ax": -70 if first.data["step"] > (steps[0] + steps[-1]) / 2 else 70,
                "ay": -40,
                "bgcolor": "#fff",
                "bordercolor": NONFINITE_COLOUR,
            }
        ],
        "hovermode": "closest",
        "legend": {"orientation": "h", "y": -0.25},
    }
    return {"data": traces, "layout": layout}
