"""``trainprobe report`` on hostile names (issue 15.8): Plotly draws names as pseudo-HTML, so a
target named ``<a href=...>`` could put a link or styled text on the page. Checked in headless
chromium: the names show literally and no ``<a>`` element comes out of the figures' SVG."""

from __future__ import annotations

import csv
import json
from html.parser import HTMLParser
from pathlib import Path

from test_tool_report import assert_page_ok, needs_chromium, render
from trainprobe.tools.reporting.data import load_report_data
from trainprobe.tools.reporting.figures import (
    anomaly_timeline,
    group_heatmap,
    group_lines,
    offenders_figure,
    plot_text,
    rank_comparison,
    run_figure,
    run_series,
)
from trainprobe.tools.reporting.report import write_report

LINK = '<a href="https://x.example/">click</a>'
BOLD = "<b>x</b>"
STYLED = '<span style="font-size:60px;color:red">big</span>'
FIELD = "%{x} & 50% &amp;"
BREAK = "two<br>lines"
SCOPE = "<i>scope</i>"
NAMES = (LINK, BOLD, STYLED, FIELD, BREAK)


def write_hostile_v2(root: Path) -> Path:
    """A two-rank V2 tree whose module names and one scope are markup; ``LINK`` turns NaN at step 2."""
    for rank in (0, 1):
        folder = root / f"rank_{rank}"
        folder.mkdir(parents=True)
        with open(folder / "module_step0-3.csv", "w", newline="", encoding="utf-8") as handle:
            writer = csv.writer(handle)
            writer.writerow(["vpp_stage", "step", "module_name", "scope", "min", "max", "norm"])
            for step in range(4):
                for n, name in enumerate(NAMES):
                    for scope in ("forward", SCOPE):
                        value = "nan" if (name == LINK and step >= 2 and rank == 1) else f"{n + step + 1.5:g}"
                        writer.writerow([0, step, name, scope, value, value, value])
    return root


class SvgFacts(HTMLParser):
    """Elements and text inside the pages' ``<svg>`` elements."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.depth = 0
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "svg":
            self.depth += 1
        if self.depth:
            self.tags.append((tag, {k: v or "" for k, v in attrs}))

    def handle_endtag(self, tag: str) -> None:
        if tag == "svg" and self.depth:
            self.depth -= 1

    def handle_data(self, data: str) -> None:
        if self.depth:
            self.text.append(data)


@needs_chromium
def test_markup_in_names_is_drawn_literally_and_makes_no_link(tmp_path):
    path = write_report(write_hostile_v2(tmp_path / "hostile"), tmp_path / "hostile.html")
    page = render(path, tmp_path / "chromium", height=2000)
    assert_page_ok(page)
    dom = (tmp_path / "chromium" / "dom.html").read_text(encoding="utf-8")
    svg = SvgFacts()
    svg.feed(dom)
    assert svg.tags, "no SVG drawn"
    assert [t for t, _ in svg.tags if t == "a"] == []  # no link from a name
    assert not [a for t, a in svg.tags if "font-size:60px" in a.get("style", "").replace(" ", "")]
    text = "".join(svg.text)
    for name in (LINK, BOLD, STYLED, FIELD, SCOPE):  # tick labels, legend, titles, menus, annotation
        assert name in text, name
    assert BREAK in text  # not split into two lines
    assert f"module/{SCOPE}: targets × steps" in text  # a data type (V2 scope) in a title


def _strings(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return []


def test_figures_hand_plotly_no_markup_from_names(tmp_path):
    data = load_report_data(write_hostile_v2(tmp_path / "hostile"))
    figures = [group_heatmap(g, 1) for g in data.groups] + [group_lines(g, 1) for g in data.groups]
    figures += [rank_comparison(data.groups), anomaly_timeline(data, data.timeline)]
    texts = [text for figure in figures for text in _strings(figure)]
    for raw in ("<a ", "<b>x", "<span", "<i>", "two<br>", "%{x} &"):
        assert not [t for t in texts if raw in t], raw
    assert plot_text(LINK) in texts and plot_text(f"module/{SCOPE}: targets × steps") in texts
    assert plot_text(FIELD) == "&#37;{x} &amp; 50&#37; &amp;amp;"


def write_hostile_gradients(root: Path) -> Path:
    """A V2 weight_grad file and a training_state.jsonl whose parameter names are markup."""
    folder = root / "rank_0"
    folder.mkdir(parents=True)
    with open(folder / "weight_grad_step0-3.csv", "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["vpp_stage", "step", "module_name", "scope", "norm"])
        for step in range(4):
            for n, name in enumerate(NAMES):
                writer.writerow([0, step, name, "reduced", n + step + 1.5])
    lines = [
        json.dumps({"step": step, "local_loss": 1.0, **{f"local_norm/{name}": n + 1.0 for n, name in enumerate(NAMES)}})
        for step in range(1, 5)
    ]
    (folder / "training_state.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


def test_run_and_offender_figures_hand_plotly_no_markup_from_names(tmp_path):
    data = load_report_data(write_hostile_gradients(tmp_path / "hostile"))
    offenders = [data.gradient_groups[0].offenders[0], data.training.offenders[0]]
    assert {row.name for o in offenders for row in o.rows} == set(NAMES)
    figures = [run_figure(run_series(data))] + [offenders_figure(o) for o in offenders]
    texts = [text for figure in figures for text in _strings(figure)]
    for raw in ("<a ", "<b>x", "<span", "two<br>", "%{x} &"):
        assert not [t for t in texts if raw in t], raw
    assert plot_text(LINK) in texts and plot_text(FIELD) in texts
    page = write_report(tmp_path / "hostile", tmp_path / "hostile.html").read_text(encoding="utf-8")
    table = page[page.index('<table id="tp-offenders">') :]
    assert "<a href" not in table[: table.index("</table>")] and "&lt;a href=" in table


@needs_chromium
def test_markup_in_parameter_names_is_drawn_literally_in_run_and_offenders(tmp_path):
    path = write_report(write_hostile_gradients(tmp_path / "hostile"), tmp_path / "hostile.html")
    page = render(path, tmp_path / "chromium", height=2000)
    assert_page_ok(page)
    svg = SvgFacts()
    svg.feed((tmp_path / "chromium" / "dom.html").read_text(encoding="utf-8"))
    assert [t for t, _ in svg.tags if t == "a"] == []
    assert not [a for t, a in svg.tags if "font-size:60px" in a.get("style", "").replace(" ", "")]
    text = "".join(svg.text)
    assert LINK in text and STYLED in text  # offender legend entries
    assert "top offenders: weight_grad/reduced, rank 0" in text
