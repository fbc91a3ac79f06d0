"""The page of ``trainprobe report``: summary tables, the figures of
:mod:`trainprobe.tools.reporting.figures` and the small script that switches their views.

The page is one self-contained file: Plotly's JavaScript is inlined once (with the first figure),
nothing is fetched from a network. When every figure has been drawn, the element
``#tp-status`` gets ``data-state="rendered"``; a script error sets ``data-state="error"`` and
lists the messages in ``data-errors`` (the browser test reads both).
"""

from __future__ import annotations

import html
import re
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import plotly.io as pio

from trainprobe.engine.anomaly.finding import skipped_text
from trainprobe.tools.anomalies.analyser import DEFAULT_TOPK, AnomalyEvent
from trainprobe.tools.reporting.data import MAX_TARGETS, ReportData
from trainprobe.tools.reporting.events import event_group, event_target
from trainprobe.tools.reporting.figures import (
    MAX_HEATMAP_COLUMNS,
    MAX_LINE_POINTS,
    MAX_TIMELINE_EVENTS,
    PICKABLE_LINES,
    TOP_LINES,
    Figure,
    anomaly_timeline,
    group_heatmap,
    group_lines,
    heatmap_bucket,
    is_csv_event,
    line_bucket,
    offenders_figure,
    rank_comparison,
    run_figure,
    run_series,
)
from trainprobe.tools.reporting.findings import KIND_WORDS, Diagnosed, Finding
from trainprobe.tools.reporting.run import TOP_K, TRAINING_STATE, Offenders

PLOT_CONFIG: dict[str, Any] = {"displaylogo": False, "responsive": True}
TIMELINE_TABLE_ROWS = DEFAULT_TOPK
TIMELINE_MORE_ROWS = 100

#: Switches the views of figures with ``tp-<dimension>`` menus and reports when all are drawn.
SCRIPT = """
(function () {
  "use strict";
  var rendered = 0, errors = [];
  function status() { return document.getElementById("tp-status"); }
  function note(message) {
    errors.push(String(message));
    var el = status();
    if (el) { el.setAttribute("data-errors", errors.join(" | ")); el.setAttribute("data-state", "error"); }
  }
  window.addEventListener("error", function (e) { note(e.message || e); });
  window.addEventListener("unhandledrejection", function (e) { note(e.reason); });

  var ARRAYS = {f4: Float32Array, f8: Float64Array, i4: Int32Array, u1: Uint8Array};
  function decode(value) {
    if (!value || typeof value.bdata !== "string") return value;
    var text = atob(value.bdata), bytes = new Uint8Array(text.length);
    for (var i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
    var flat = new ARRAYS[value.dtype](bytes.buffer);
    if (!value.shape) return flat;
    var dims = String(value.shape).split(",").map(Number), rows = [];
    for (var r = 0; r < dims[0]; r++) rows.push(flat.subarray(r * dims[1], (r + 1) * dims[1]));
    return rows;
  }
  // Log colour: log10(|v|), 0 at log10(tiny) (a decade below the smallest non-zero |v|), NaN kept.
  function logOf(z, tiny) {
    var out = new Array(z.length), floor = Math.log10(tiny);
    for (var i = 0; i < z.length; i++) {
      var row = z[i], result = new Float32Array(row.length);
      for (var j = 0; j < row.length; j++) {
        var v = row[j];
        result[j] = (v === null || v !== v) ? NaN : (v === 0 ? floor : Math.log10(Math.abs(v)));
      }
      out[i] = result;
    }
    return out;
  }
  function setScale(gd, log) {
    var idx = [], zs = [], custom = [], hovers = [], titles = [], vals = [], texts = [], modes = [];
    gd._tpLinear = gd._tpLinear || {};
    gd._tpLog = gd._tpLog || {};
    gd.data.forEach(function (trace, i) {
      var m = trace.meta;
      if (!m || m.role !== "z") return;
      if (!(i in gd._tpLinear)) gd._tpLinear[i] = decode(trace.z);
      if (log && !(i in gd._tpLog)) gd._tpLog[i] = logOf(gd._tpLinear[i], m.tiny);
      idx.push(i);
      zs.push(log ? gd._tpLog[i] : gd._tpLinear[i]);
      custom.push(log ? gd._tpLinear[i] : null);
      hovers.push(log ? m.loghover : m.hover);
      titles.push(log ? "|" + m.label + "|" : m.label);
      vals.push(log ? m.ticks.vals : null);
      texts.push(log ? m.ticks.text : null);
      modes.push(log ? "array" : "auto");
    });
    if (!idx.length) return null;
    return Plotly.restyle(gd, {
      z: zs, customdata: custom, hovertemplate: hovers, "colorbar.title.text": titles,
      "colorbar.tickmode": modes, "colorbar.tickvals": vals, "colorbar.ticktext": texts
    }, idx);
  }
  function showView(gd) {
    var state = gd._tp, idx = [], visible = [];
    gd.data.forEach(function (trace, i) {
      var m = trace.meta;
      if (!m || !m.tp) return;
      var on = Object.keys(m.tp).every(function (k) { return (state[k] || 0) === m.tp[k]; });
      idx.push(i);
      visible.push(on ? (m.role === "line" && !m.top ? "legendonly" : true) : false);
    });
    if (idx.length) Plotly.restyle(gd, {visible: visible}, idx);
  }
  function attach(gd) {
    var state = {};
    (gd.layout.updatemenus || []).forEach(function (menu) {
      if (menu.name && menu.name.indexOf("tp-") === 0) state[menu.name.slice(3)] = menu.active || 0;
    });
    gd._tp = state;
    gd.on("plotly_buttonclicked", function (event) {
      var name = event.menu && event.menu.name;
      if (!name || name.indexOf("tp-") !== 0) return;
      var key = name.slice(3);
      if (state[key] === event.active) return;
      state[key] = event.active;
      if (key === "scale") setScale(gd, event.active === 1); else showView(gd);
    });
    return state.scale === 1 ? setScale(gd, true) : null;  // the log colour is the default
  }
  window.tpReport = {
    rendered: function (id) {
      return Promise.resolve(attach(document.getElementById(id))).then(done, note);
    }
  };
  function done() {
    rendered += 1;
    var el = status();
    el.setAttribute("data-rendered", String(rendered));
    el.setAttribute("data-ms", String(Math.round(performance.now())));
    if (rendered === Number(el.getAttribute("data-expected")) && !errors.length) {
      el.setAttribute("data-state", "rendered");
    }
  }
})();
"""

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 0 24px 48px; color: #222; }
h1 { font-size: 1.5em; margin: 16px 0 4px; } h2 { margin-top: 36px; border-bottom: 2px solid #ddd; }
h3 { margin: 24px 0 4px; font-size: 1.1em; }
.note { color: #555; max-width: 80em; } nav a { margin-right: 14px; }
table { border-collapse: collapse; margin: 8px 0; font-size: 0.92em; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.bad { color: #c00; font-weight: 600; } .ok { color: #070; font-weight: 600; }
.figure { margin: 6px 0 18px; }
"""


def _e(value: object) -> str:
    return html.escape(str(value))


def _event_words(event: AnomalyEvent) -> str:
    """``grad_reduced · 0:fc2.bias · rank 1 · step 4``."""
    micro = f" · micro-step {event.data['micro_step']}" if not event.once_per_step else ""
    return (
        f"{event_group(event)} · {event_target(event)} · rank {event.data['rank']} · step {event.data['step']}{micro}"
    )


def _first_block(element_id: str, event: AnomalyEvent | None, none_text: str) -> str:
    """A ``<span>`` naming ``event`` with its fields as data attributes (for tests and scripts)."""
    if event is None:
        return f'<span id="{element_id}" class="ok">{_e(none_text)}</span>'
    attrs = {
        "data-data-type": event_group(event),
        "data-target": event_target(event),
        "data-rank": event.data["rank"],
        "data-step": event.data["step"],
        "data-micro-step": event.data["micro_step"],
    }
    attr_text = " ".join(f'{k}="{_e(v)}"' for k, v in attrs.items())
    return f'<span id="{element_id}" class="bad" {attr_text}>{_e(_event_words(event))}</span> ({_e(event_what(event))})'


def event_what(event: AnomalyEvent) -> str:
    """What happened, briefly: the CSV row's non-finite ops, or the alert's rule and ops
    (``AnomalyNan on min, max, mean``)."""
    if is_csv_event(event):
        return event.data["message"]
    ops = list(dict.fromkeys(re.findall(r", '([^']+)'\)", event.data["message"])))
    return f"{event.rule or 'alert'} on {', '.join(ops)}" if ops else event.data["message"][:160]


def _range(values: Sequence[int]) -> str:
    return f"{len(values)} ({values[0]}–{values[-1]})" if values else "0"


def summary_html(data: ReportData, diagnosed: Diagnosed | None = None) -> str:
    """The summary section: the first anomaly (the Diagnosis's, when ``diagnosed`` ran), steps,
    ranks, data types, targets, rows, NaN/inf and alerts."""
    steps = [int(s) for s in data.steps]
    layouts = ", ".join({"v1": "Monitor V1", "v2": "Monitor V2"}[layout] for layout in data.layouts)
    nonfinite_rows = sum(g.nonfinite_rows for g in data.groups)
    bad_groups = sum(1 for g in data.groups if g.nonfinite_rows)
    first = _first_block("tp-first-nonfinite", data.first_nonfinite, "none found")
    alert_text = "no anomaly_detected/rank*/anomaly.json"
    if data.anomaly_files:
        first_alert = data.alerts[0] if data.alerts else None
        alert_text = f"{len(data.alerts)} event(s) in {len(data.anomaly_files)} file(s); first: " + _first_block(
            "tp-first-alert", first_alert, "none"
        )
    rows = [
        *_first_anomaly_row(diagnosed),
        ("Monitor output", f"{_e(data.root)} ({layouts})"),
        ("Steps", _range(steps)),
        ("Ranks", f"{len(data.ranks)} ({', '.join(map(str, data.ranks))})"),
        ("Data types", f"{len(data.groups)}: {_e(', '.join(g.name for g in data.groups))}"),
        ("Targets", _targets_summary(data)),
        ("CSV rows", f"{sum(g.rows for g in data.groups)} in {data.files} file(s); torn rows skipped: {data.torn}"),
        ("NaN/inf", f"{nonfinite_rows} row(s) in {bad_groups} data type(s); first NaN/inf row in execution order: {first}"
         + _skipped_note(data, data.first_nonfinite)),
        ("Alerts", alert_text),
        *_run_notes(data),
    ]
    table = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows)
    return f'<section id="summary"><h2>Summary</h2><table>{table}</table>{_groups_table(data)}</section>'


def _first_anomaly_row(diagnosed: Diagnosed | None) -> list[tuple[str, str]]:
    """The summary's "First anomaly" row: the Diagnosis's first line (none when it did not run)."""
    if diagnosed is None or not diagnosed.ran or not diagnosed.lines:
        return []
    state = "bad" if diagnosed.first is not None else "ok"
    text = diagnosed.lines[0].removeprefix("first anomaly: ")
    return [("First anomaly", f'<a href="#diagnosis" class="{state}">{_e(text)}</a> (starred on the timeline)'
             if diagnosed.first is not None else f'<span class="ok">{_e(text)}</span>')]


def _skipped_note(data: ReportData, event: AnomalyEvent | None) -> str:
    """`` — a backward row of a step GradScaler skipped`` when ``event`` is one (its inf is the
    scaler's overflow), else ``""``."""
    if event is None or event.phase != "backward":
        return ""
    if int(event.data["step"]) not in data.skipped.get(int(event.data["rank"]), ()):
        return ""
    return " — a backward row of a step GradScaler skipped (the scaler's overflow, not an anomaly)"


def _run_notes(data: ReportData) -> list[tuple[str, str]]:
    """Summary rows for a sharded run and for GradScaler's skipped steps (none otherwise)."""
    notes = []
    if data.sharded and data.tensors == "full":
        notes.append(("Layout", '<span id="tp-tensors" data-tensors="full">sharded (FSDP2 / tensor parallelism): '
                      "the page shows full tensors (shards merged, replicas counted once), each parameter under the "
                      "least rank holding it; <code>--rank-local</code> shows each rank's pieces as written</span>"))
    elif data.sharded:
        notes.append(("Layout", '<span id="tp-tensors" data-tensors="rank-local">sharded (FSDP2 / tensor '
                      "parallelism), read rank-local (<code>--rank-local</code>): each rank's pieces as written"
                      "</span>"))
    if data.skipped:
        line = skipped_text(data.skipped, data.ranks) or ""
        notes.append(("GradScaler", _e(line.removeprefix("skipped by GradScaler: "))
                      + f" — {len({s for v in data.skipped.values() for s in v})} step(s) skipped"))
    return notes


def _targets_summary(data: ReportData) -> str:
    """``200000 (per data type below)``, and the sampling note when some are not drawn."""
    total = sum(g.all_targets for g in data.groups)
    sampled = [g for g in data.groups if g.sampled]
    if not sampled:
        return f"{total} (per data type below)"
    drawn = sum(len(g.targets) for g in data.groups)
    return (
        f'{total} (per data type below); <span id="tp-sampled" class="bad" data-drawn="{drawn}" '
        f'data-total="{total}">sampled: the heatmaps draw {drawn} of them</span>, at most {MAX_TARGETS} per data '
        "type: every target with a NaN/inf row first, then the largest peaks of |norm| (or the first op)"
    )


def _groups_table(data: ReportData) -> str:
    head = "".join(
        f"<th>{h}</th>"
        for h in (
            "data type",
            "phase",
            "ranks",
            "targets",
            "steps",
            "ops",
            "rows",
            "NaN/inf rows",
            "first NaN/inf step",
        )
    )
    body = []
    for g in data.groups:
        first = "–" if g.first_onset_step is None else str(g.first_onset_step)
        cells = [
            _e(g.name),
            g.phase,
            ", ".join(map(str, sorted(g.ranks))),
            f"{g.all_targets} ({len(g.targets)} drawn)" if g.sampled else str(g.all_targets),
            _range([int(s) for s in g.steps]),
            _e(", ".join(g.ops)),
            str(g.rows),
            f'<span class="{"bad" if g.nonfinite_rows else "ok"}">{g.nonfinite_rows}</span>',
            first,
        ]
        body.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def timeline_table(events: Sequence[AnomalyEvent], first: int = 1) -> str:
    """``events`` (numbered from ``first``) as a table: step, micro-step, phase, rank, data type,
    target, source (alert or CSV file) and what was found."""
    head = "".join(
        f"<th>{h}</th>"
        for h in ("order", "step", "micro-step", "phase", "rank", "data type", "target", "source", "what")
    )
    body = []
    for n, e in enumerate(events, start=first):
        micro = "after all" if e.once_per_step else e.data["micro_step"]
        source = f"CSV {e.source.name}" if is_csv_event(e) else f"alert ({e.rule or 'anomaly.json'})"
        cells = [n, e.data["step"], micro, e.phase, e.data["rank"], event_group(e), event_target(e), source]
        cells.append(event_what(e))
        body.append("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def timeline_tables(events: Sequence[AnomalyEvent], total: int) -> str:
    """The first :data:`TIMELINE_TABLE_ROWS` events (as many as the anomaly analyser keeps by
    default), then up to :data:`TIMELINE_MORE_ROWS` more in a folded ``<details>``."""
    top = events[:TIMELINE_TABLE_ROWS]
    text = f"<h3>The first {len(top)} of {total} events in execution order</h3>{timeline_table(top)}"
    more = events[TIMELINE_TABLE_ROWS:TIMELINE_MORE_ROWS]
    if more:
        end = TIMELINE_TABLE_ROWS + len(more)
        text += (
            f"<details><summary>events {TIMELINE_TABLE_ROWS + 1}–{end}</summary>"
            f"{timeline_table(more, TIMELINE_TABLE_ROWS + 1)}</details>"
        )
    return text


class PageBuilder:
    """Collects sections and figures; Plotly's JS goes with the first figure only."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.figures = 0

    def add(self, text: str) -> None:
        """Append raw HTML."""
        self.parts.append(text)

    def add_figure(self, figure: Figure) -> None:
        """Append a figure; its div reports to ``tpReport`` once drawn."""
        height = figure["layout"].get("height", 450)
        self.parts.append(
            '<div class="figure">'
            + pio.to_html(
                figure,
                config=PLOT_CONFIG,
                include_plotlyjs=self.figures == 0,
                full_html=False,
                validate=False,
                default_height=f"{height}px",
                post_script="tpReport.rendered('{plot_id}');",
            )
            + "</div>"
        )
        self.figures += 1


def _timeline_section(page: PageBuilder, data: ReportData, diagnosed: Diagnosed) -> None:
    events, findings = data.timeline, diagnosed.findings
    total = data.onset_count + len(data.alerts)
    page.add('<section id="timeline"><h2>Anomaly timeline</h2>')
    if not events and not findings:
        page.add('<p class="ok">No NaN/inf rows in the CSVs, no anomaly.json events and no anomaly found by '
                 "the Diagnosis.</p></section>")
        return
    shown = events[:MAX_TIMELINE_EVENTS]
    cut = f" Only the first {len(shown)} of {total} events are drawn." if len(shown) < total else ""
    page.add(
        '<p class="note">Circles: the first NaN/inf row of each target, data type and rank in the CSVs; diamonds: '
        "the events Monitor V1 dumped to anomaly_detected/rank*/anomaly.json; triangles (spikes) and squares "
        "(NaN/inf): the anomalies of the Diagnosis section. "
        + _star_words(diagnosed, bool(events))
        + " Execution order: step, then "
        "micro-step (reduced gradients and the optimizer after every micro-step), then phase (forward &lt; "
        "backward &lt; optimizer), pipeline stage, data type (activations, activation gradients, unreduced "
        "gradients, reduced gradients, collectives, parameters, optimizer state, updated parameters), the "
        "row's place in its step (an alert takes the place of its CSV row), rank: the order anomaly-analyse "
        "and diagnose use." + cut + "</p>"
    )
    page.add_figure(anomaly_timeline(data, shown, findings, diagnosed.ran))
    page.add(_first_anomaly_line(diagnosed))
    if findings:
        page.add(f"<h3>The Diagnosis's {len(findings)} anomal{'y' if len(findings) == 1 else 'ies'}</h3>"
                 + findings_table(findings))
    if events:
        page.add(timeline_tables(events, total))
    page.add("</section>")


def _star_words(diagnosed: Diagnosed, events: bool) -> str:
    """What the star marks."""
    if diagnosed.first is not None:
        return "The star marks the first anomaly, the one the Diagnosis names first (spikes included)."
    if diagnosed.ran:
        return "No star: the Diagnosis found no anomaly (see its lines)."
    return "The star marks the first event." if events else ""


def _first_anomaly_line(diagnosed: Diagnosed) -> str:
    """``<p id="tp-timeline-first" data-step=... data-kind=...>``: the star's event, for tests and scripts."""
    first = diagnosed.first
    if first is None:
        return ""
    attrs = {"data-step": first.step, "data-rank": first.rank, "data-data-type": first.group,
             "data-target": first.name, "data-kind": first.kind}
    attr_text = " ".join(f'{k}="{_e(v)}"' for k, v in attrs.items())
    return f'<p class="note" id="tp-timeline-first" {attr_text}>Star: {_e(first.line)}</p>'


def findings_table(findings: Sequence[Finding]) -> str:
    """Diagnose's anomalies as a table: order, kind, step, rank, data type, target, diagnose's line."""
    head = "".join(f"<th>{h}</th>" for h in ("order", "kind", "step", "rank", "data type", "target", "what"))
    body = "".join(
        "<tr>" + "".join(f"<td>{_e(c)}</td>" for c in (n, KIND_WORDS.get(f.kind, f.kind), f.step, f.rank,
                                                         f.group, f.name, f.line)) + "</tr>"
        for n, f in enumerate(findings, start=1)
    )
    return f'<table id="tp-findings"><tr>{head}</tr>{body}</table>'


def _heatmap_section(page: PageBuilder, data: ReportData) -> None:
    page.add('<section id="heatmaps"><h2>Heatmaps: targets × steps</h2>')
    page.add(
        f'<p class="note">One heatmap per data type; the menus pick the op, the rank and the colour scale. '
        f"The colour is logarithmic by default (log10 of |x|, so that a few large rows such as an embedding "
        f"do not wash the rest out): the colour bar is labelled in real values, 0 sits one decade below the "
        f"smallest non-zero |x| (the tick \u201c0\u201d), the hover shows the real, signed value; "
        f"\u201ccolour: linear\u201d switches to a linear scale. Rows are targets in "
        f"model order (first appearance in the CSVs). Red cells: NaN or inf. Grey: no value. Runs longer than "
        f"{MAX_HEATMAP_COLUMNS} steps (fewer on pages with many ranks, ops and data types) are downsampled: "
        f"consecutive steps share a column, which shows the value of largest magnitude in its bucket (or red if "
        f"any value in it is NaN/inf), so spikes are never lost. Micro-steps of one step are merged the same "
        f"way. A data type with more than {MAX_TARGETS} targets draws {MAX_TARGETS} rows: every target with a "
        f"NaN/inf row first, then those with the largest peak of |norm| (or the first op), in model order; the "
        f"heading says so. Counts, the timeline and the rank comparison still cover every target.</p>"
    )
    for group in data.groups:
        size = heatmap_bucket(group, len(data.groups))
        note = f" — downsampled: {size} steps per column" if size > 1 else ""
        if group.sampled:
            note += f" — sampled: {len(group.targets)} of {group.all_targets} targets drawn"
        page.add(f'<h3 id="heatmap-{_e(group.name)}">{_e(group.name)}{note}</h3>')
        page.add_figure(group_heatmap(group, size))
    page.add("</section>")


def _lines_section(page: PageBuilder, data: ReportData) -> None:
    page.add('<section id="lines"><h2>Line charts</h2>')
    page.add(
        f'<p class="note">Per data type, the {TOP_LINES} targets with the largest |norm| (or first op) over '
        f"all steps and ranks are drawn; the next ones (up to {PICKABLE_LINES}) are in the legend: click a name "
        f"to add or remove its line, double-click to isolate it. The menus pick the op, the rank and a log y "
        f"axis. Runs longer than {MAX_LINE_POINTS} steps show the largest |value| of each bucket of steps. "
        f"NaN/inf values are gaps.</p>"
    )
    for group in data.groups:
        size = line_bucket(group, len(data.groups))
        note = f" — downsampled: {size} steps per point" if size > 1 else ""
        page.add(f"<h3>{_e(group.name)}{note}</h3>")
        page.add_figure(group_lines(group, size))
    page.add("</section>")


def _ranks_section(page: PageBuilder, data: ReportData) -> None:
    groups = [g for g in data.groups if len(g.ranks) > 1]
    if not groups:
        return
    page.add('<section id="ranks"><h2>Rank comparison</h2>')
    page.add(
        '<p class="note">For each data type, the global norm per rank and step (sqrt of the sum of the '
        "targets' squared norms; red where a target was NaN/inf). A rank that differs from the others stands "
        "out as a row of another colour.</p>"
    )
    page.add_figure(rank_comparison(groups))
    page.add("</section>")


def chosen_offenders(data: ReportData) -> Offenders | None:
    """The top offenders drawn: the lowest rank's of the first gradient group (V2
    ``weight_grad/reduced``, then ``unreduced``; V1 ``grad_reduced``, then ``grad_unreduced``),
    else of ``training_state.jsonl``'s ``local_norm/<param>``; None without either."""
    for group in data.gradient_groups:
        return group.offenders[min(group.offenders)]
    offenders = data.training.offenders
    return offenders[min(offenders)] if offenders else None


def _run_section(page: PageBuilder, data: ReportData) -> None:
    panels = run_series(data)
    if not panels:
        return
    files, events, losses = data.training.files, data.training.event_files, data.training.loss_files
    skipped = f" {data.training.skipped} line(s) were left out (torn or not a step)." if data.training.skipped else ""
    page.add('<section id="run"><h2>Training curves</h2>')
    page.add(
        f'<p class="note" id="tp-run-sources" data-files="{len(files)}" data-event-files="{len(events)}" '
        f'data-loss-files="{len(losses)}" data-panels="{_e(",".join(panels))}">'
        f"How training went, step by step: {_e(_panel_words(list(panels)))}. Each line is one source on one "
        "rank (the 8 lowest ranks); click a name in the legend to hide or show its line. A red cross on the "
        f"gradient norm marks a step where some parameter's gradient was NaN or infinite.{_e(skipped)}</p>"
        + _run_sources(data)
    )
    page.add_figure(run_figure(panels))
    page.add("</section>")


def _panel_words(panels: list[str]) -> str:
    """``the loss, the learning rate and the size of the gradients (global gradient norm)``."""
    words = {"loss": "the loss", "learning rate": "the learning rate",
             "global gradient norm": "the size of the gradients (global gradient norm)"}
    named = [words.get(p, p) for p in panels]
    return named[0] if len(named) == 1 else ", ".join(named[:-1]) + " and " + named[-1]


def _run_sources(data: ReportData) -> str:
    """A folded list of where each curve's numbers come from."""
    training = data.training
    items = [
        f"<li><b>loss.csv</b> beside the run ({len(training.loss_files)} file(s)): the loss your training "
        "loop wrote (<code>trainprobe demo</code> writes one; see the report's documentation for the format).</li>",
        f"<li><b>training metrics</b>: {len(training.files)} {_e(TRAINING_STATE)} file(s) "
        "(<code>local_loss</code>: the mean loss of the rank's micro-batches, <code>device_accum_local_loss</code>: "
        "their sum, <code>device_local_norm</code>: the gradient norm the optimizer applies, after clipping) and "
        f"{len(training.event_files)} TensorBoard event file(s) (<code>loss</code>, <code>learning-rate</code>, "
        "<code>grad-norm</code>; only these hold the learning rate: pass <code>--tensorboard</code>).</li>",
        "<li><b>the monitor's gradient files</b>: per step, the square root of the sum of every parameter's "
        "squared gradient norm (a NaN/inf norm is left out and marked with a red cross).</li>",
        f"<li>Runs longer than {MAX_LINE_POINTS} steps show, per bucket of steps, its value of largest "
        "magnitude. The training metrics count steps from 1, the monitors from 0.</li>",
    ]
    return f"<details><summary>Where these numbers come from</summary><ul>{''.join(items)}</ul></details>"


def _offenders_section(page: PageBuilder, data: ReportData) -> None:
    offenders = chosen_offenders(data)
    if offenders is None:
        return
    page.add('<section id="offenders"><h2>Top offenders</h2>')
    page.add(
        f'<p class="note">Which parameters dominate the global gradient norm of {_e(offenders.source)} on rank '
        f"{offenders.rank}. Top: the global norm (sqrt of the sum of every parameter's squared norm). Bottom: "
        f"each step's squared global norm split by parameter: a parameter's share is its squared norm over the "
        f"sum; the {TOP_K} largest shares of each step are kept, coloured for the parameters of the table, grey "
        f"for other parameters in that step's top {TOP_K}, light grey for all parameters outside it. Runs longer "
        f"than {MAX_LINE_POINTS} steps draw, per bucket of steps, the step of largest global norm.</p>"
    )
    page.add_figure(offenders_figure(offenders))
    page.add(offenders_table(offenders))
    page.add("</section>")


def offenders_table(offenders: Offenders) -> str:
    """The parameters most often among a step's top k: steps in the top k, their mean share
    there, and their share of the squared norms summed over the run."""
    head = "".join(
        f"<th>{h}</th>"
        for h in (
            "parameter",
            f"steps in the top {TOP_K} (of {len(offenders.steps)})",
            f"mean share of norm² when in the top {TOP_K}",
            "share of the run's summed norm²",
        )
    )
    body = "".join(
        f"<tr><td>{_e(row.name)}</td><td class=num>{row.steps_in_top}</td>"
        f"<td class=num>{row.mean_share:.1%}</td><td class=num>{row.run_share:.1%}</td></tr>"
        for row in offenders.rows
    )
    return f'<table id="tp-offenders"><tr>{head}</tr>{body}</table>'


def _nav(data: ReportData, diagnosis: bool = False, baseline: bool = False) -> str:
    links = [("summary", "Summary")]
    if diagnosis:
        links.append(("diagnosis", "Diagnosis"))
    if baseline:
        links.append(("baseline", "Baseline"))
    if run_series(data):
        links.append(("run", "Training curves"))
    if chosen_offenders(data) is not None:
        links.append(("offenders", "Top offenders"))
    links += [("timeline", "Anomaly timeline"), ("heatmaps", "Heatmaps"), ("lines", "Lines")]
    if any(len(g.ranks) > 1 for g in data.groups):
        links.append(("ranks", "Rank comparison"))
    return "<nav>" + "".join(f'<a href="#{key}">{label}</a>' for key, label in links) + "</nav>"


def _diagnosis_section(page: PageBuilder, lines: Sequence[str], baseline: Any) -> None:
    """``trainprobe diagnose``'s answer (its lines as the command prints them), then, with a
    baseline, ``trainprobe diff``'s section (``baseline(page)`` adds it)."""
    first = lines[0] if lines else ""
    state = "ok" if first.startswith("no anomaly") else "bad"
    rest = "\n".join(lines[1:])
    page.add(
        f'<section id="diagnosis"><h2>Diagnosis</h2><p class="{state}" id="tp-diagnosis">{_e(first)}</p>'
        + (f"<pre>{_e(rest)}</pre>" if rest else "")
        + "</section>"
    )
    if baseline is not None:
        baseline(page)


def render_page(data: ReportData, diagnosis: Sequence[str] | Diagnosed = (), baseline: Any = None) -> str:
    """The whole HTML document of the report: the Diagnosis section (``diagnosis``: the answer of
    ``trainprobe diagnose``, or only its lines; ``baseline``: a callable adding ``trainprobe
    diff``'s section) first when given, then the report's own sections. The timeline marks
    diagnose's anomalies and stars its first one."""
    diagnosed = diagnosis if isinstance(diagnosis, Diagnosed) else Diagnosed(list(diagnosis))
    page = PageBuilder()
    if diagnosed.lines or baseline is not None:
        _diagnosis_section(page, diagnosed.lines, baseline)
    _run_section(page, data)
    _offenders_section(page, data)
    _timeline_section(page, data, diagnosed)
    _heatmap_section(page, data)
    _lines_section(page, data)
    _ranks_section(page, data)
    stamp = datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    title = f"trainprobe report: {data.root.name or data.root}"
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{_e(title)}</title><style>{STYLE}</style><script>{SCRIPT}</script></head><body>"
        f'<div id="tp-status" data-state="loading" data-rendered="0" data-expected="{page.figures}" '
        'data-errors="" hidden></div>'
        f'<h1>{_e(title)}</h1><p class="note">Generated {_e(stamp)} by trainprobe report from '
        f"{_e(data.root)}. Self-contained: works offline.</p>{_nav(data, bool(diagnosed.lines), baseline is not None)}"
        f"{summary_html(data, diagnosed)}"
        + "".join(page.parts)
        + "</body></html>\n"
    )
