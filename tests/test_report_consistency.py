"""``trainprobe report`` agrees with ``trainprobe diagnose`` and shows what a newcomer looks for
(issue #35): the timeline's star is the Diagnosis's first anomaly (a spike before the first
NaN), diagnose's anomalies are marked on the timeline, the loss of a ``loss.csv`` beside the run
is drawn (the demo writes one), every heatmap row keeps its label (20 rows and more), and the
training curves' caption is in plain words. Checked on the page's data and in headless chromium.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import numpy as np
import pytest

from report_fault_fixture import NAN_STEP, SPIKE_STEP, STEPS, FaultRun, make_fault_run
from test_tool_report import assert_page_ok, needs_chromium, render
from trainprobe.tools.reporting.data import load_report_data
from trainprobe.tools.reporting.figures import ROW_PIXELS, anomaly_timeline, group_heatmap
from trainprobe.tools.reporting.report import _diagnosis, write_report

pytest.importorskip("duckdb")
pytest.importorskip("plotly")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> FaultRun:
    return make_fault_run(tmp_path_factory.mktemp("report_faults") / "run")


@pytest.fixture(scope="module")
def page(run: FaultRun, tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_report(run.root, tmp_path_factory.mktemp("page") / "r.html").read_text(encoding="utf-8")


def _attrs(page: str, element_id: str) -> dict[str, str]:
    found = re.search(rf'<[a-z]+ [^>]*id="{element_id}"([^>]*)>', page)
    assert found is not None, element_id
    return {k: html.unescape(v) for k, v in re.findall(r'([a-z-]+)="([^"]*)"', found[1])}


# --------------------------------------------------------------------------- page data


def test_the_star_is_the_diagnosis_first_anomaly_a_spike_before_the_nan(run: FaultRun, page: str) -> None:
    first_line = html.unescape(re.search(r'id="tp-diagnosis">([^<]*)<', page)[1])  # type: ignore[index]
    assert first_line.startswith(f"first anomaly: step {SPIKE_STEP}, rank 0, module/forward ")
    assert first_line.endswith(")") and "spike" in first_line
    star = _attrs(page, "tp-timeline-first")
    assert (star["data-step"], star["data-kind"], star["data-data-type"]) == (str(SPIKE_STEP), "spike", "module/forward")
    assert html.unescape(first_line).removeprefix("first anomaly: ") in html.unescape(page.split('id="tp-timeline-first"')[1][:600])
    summary = re.search(r"<th>First anomaly</th><td>(.*?)</td>", page, re.S)
    assert summary is not None and f"step {SPIKE_STEP}, rank 0, module/forward" in html.unescape(summary[1])
    nonfinite = _attrs(page, "tp-first-nonfinite")  # the CSVs' first NaN/inf row: later, and named as such
    assert nonfinite["data-step"] == str(NAN_STEP) and nonfinite["data-data-type"] == "weight_grad/reduced"
    assert "first NaN/inf row in execution order" in page


def test_the_timeline_figure_marks_every_diagnose_anomaly(run: FaultRun) -> None:
    diagnosed = _diagnosis(run.root)
    data = load_report_data(run.root)
    figure = anomaly_timeline(data, data.timeline, diagnosed.findings, diagnosed.ran)
    traces = {t["name"]: t for t in figure["data"]}
    star = traces["first anomaly (as the Diagnosis says)"]
    assert star["x"] == [SPIKE_STEP] and star["y"] == ["module/forward"]
    marked = [(t["meta"]["kind"], x) for t in figure["data"] if t.get("meta", {}).get("role") == "finding" for x in t["x"]]
    assert sorted(marked) == sorted((f.kind, f.step) for f in diagnosed.findings)
    assert ("spike", SPIKE_STEP) in marked
    assert figure["layout"]["annotations"][0]["x"] == SPIKE_STEP
    assert figure["layout"]["annotations"][0]["text"].startswith("first anomaly: module/forward")
    circles = [x for t in figure["data"] if t["name"].startswith("NaN/inf rows") for x in t["x"]]
    assert min(circles) == NAN_STEP  # the NaN onsets are still drawn, after the star


def test_without_a_diagnosis_the_star_is_the_first_event_and_a_clean_diagnosis_draws_none(run: FaultRun) -> None:
    data = load_report_data(run.root)
    plain = anomaly_timeline(data, data.timeline)
    assert [t["x"] for t in plain["data"] if t["name"] == "first in execution order"] == [[NAN_STEP]]
    clean = anomaly_timeline(data, data.timeline, (), diagnosed=True)
    assert not [t for t in clean["data"] if t.get("meta", {}).get("role") == "star"] and not clean["layout"]["annotations"]


def test_the_loss_of_loss_csv_is_drawn_as_written(run: FaultRun, page: str) -> None:
    data = load_report_data(run.root)
    [loss] = [s for s in data.training.series if s.source == "loss.csv"]
    assert (loss.key, loss.rank) == ("loss", 0) and loss.steps.tolist() == list(range(STEPS))
    np.testing.assert_array_equal(loss.values, np.array(run.losses, dtype=np.float64))  # NaN after the NaN step kept
    assert np.isnan(loss.values[-1]) and np.isfinite(loss.values[: NAN_STEP + 1]).all()
    sources = _attrs(page, "tp-run-sources")
    assert sources["data-loss-files"] == "1" and sources["data-panels"].split(",")[0] == "loss"


def test_loss_csv_torn_and_foreign_lines_are_skipped_and_a_foreign_file_left_out(run: FaultRun, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from trainprobe.tools.reporting.loss import find_loss_files, read_loss_files
    from trainprobe.tools.reporting.run import TrainingState

    (tmp_path / "rank_1").mkdir()
    (tmp_path / "loss.csv").write_text("step,loss,lr\n0,2.5,0.1\n1,,0.05\nx,3,3\n2,inf,0.01\n3,1.")
    (tmp_path / "rank_1" / "loss.csv").write_text("epoch,acc\n0,1\n")
    state = TrainingState()
    read_loss_files(find_loss_files(tmp_path), state)
    series = {(s.key, s.rank): s for s in state.series}
    assert set(series) == {("loss", 0), ("lr", 0)} and state.skipped == 2  # "x" and the torn "3,1."
    assert series["loss", 0].steps.tolist() == [0, 2] and series["loss", 0].values.tolist() == [2.5, float("inf")]
    assert series["lr", 0].values.tolist() == [0.1, 0.05, 0.01]
    assert "no 'step' column" in caplog.text and "rank_1" in caplog.text


def test_the_demo_writes_a_loss_the_report_draws(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from trainprobe.demo.run import run_demo

    run_demo(tmp_path / "demo", steps=12)
    printed = re.search(r"trained 12 steps: loss ([0-9.]+) -> ([0-9.]+)", capsys.readouterr().out)
    assert printed is not None
    [loss] = [s for s in load_report_data(tmp_path / "demo").training.series if s.key == "loss"]
    assert loss.steps.tolist() == list(range(12)) and loss.source == "loss.csv"
    assert (f"{loss.values[0]:.3f}", f"{loss.values[-1]:.3f}") == printed.groups()


def test_every_heatmap_row_has_its_label(run: FaultRun) -> None:
    data = load_report_data(run.root)
    for group in data.groups:
        axis = group_heatmap(group, 1)["layout"]["yaxis"]
        assert axis["tickmode"] == "array" and axis["tickvals"] == axis["ticktext"] == group.targets
        assert group_heatmap(group, 1)["layout"]["height"] >= ROW_PIXELS * len(group.targets)
    assert max(len(g.targets) for g in data.groups) >= 20


def test_the_training_curves_caption_is_plain_words(page: str) -> None:
    caption = re.search(r'<p class="note" id="tp-run-sources"[^>]*>(.*?)</p>', page, re.S)
    assert caption is not None and '<h2>Training curves</h2>' in page
    text = html.unescape(caption[1])
    assert text.startswith("How training went, step by step: the loss and the size of the gradients")
    assert not re.search(r"<code>|\w_\w|sqrt|jsonl|CSV", text), text  # no identifiers, file names or formulas
    assert "<details><summary>Where these numbers come from</summary>" in page


# --------------------------------------------------------------------------- in chromium


# After load: the timeline's star and annotation, the markers of diagnose's anomalies, the
# Diagnosis line, the loss line, and per heatmap its row labels as drawn (text and box).
PROBE = """<script>
function tpConsistencyProbe() {
  var status = document.getElementById("tp-status");
  if (status.getAttribute("data-state") !== "rendered") { return setTimeout(tpConsistencyProbe, 50); }
  var plots = Array.prototype.slice.call(document.querySelectorAll(".js-plotly-plot")), out = {heatmaps: []};
  function role(gd, name) { return gd._fullData.filter(function (t) { return t.meta && t.meta.role === name; }); }
  var timeline = plots.filter(function (gd) { return role(gd, "star").length; })[0];
  var star = role(timeline, "star")[0];
  out.star = {x: Number(star.x[0]), y: star.y[0]};
  out.annotation = timeline.querySelector(".annotation-text").textContent;
  out.findings = role(timeline, "finding").map(function (t) {
    return {kind: t.meta.kind, x: Array.prototype.map.call(t.x, Number)};
  });
  out.diagnosis = document.getElementById("tp-diagnosis").textContent;
  var run = plots.filter(function (gd) { return role(gd, "run").length; })[0];
  out.loss = role(run, "run").filter(function (t) { return t.meta.panel === "loss"; }).map(function (t) {
    return {name: t.name, y: Array.prototype.map.call(t.y, function (v) { return v === v ? v : null; })};
  });
  plots.filter(function (gd) { return role(gd, "z").length && gd.layout.yaxis.title.text === "target"; })
    .forEach(function (gd) {
      var boxes = Array.prototype.map.call(gd.querySelectorAll(".yaxislayer-above .ytick text"), function (t) {
        var b = t.getBoundingClientRect();
        return {text: t.textContent, top: b.top, bottom: b.bottom, shown: b.height > 0};
      });
      out.heatmaps.push({rows: role(gd, "z")[0].y.length, labels: boxes});
    });
  status.setAttribute("data-probe", JSON.stringify(out));
}
window.addEventListener("load", tpConsistencyProbe);
</script></body>"""


@needs_chromium
def test_in_chromium_the_star_the_diagnosis_the_loss_and_every_row_label(run: FaultRun, page: str, tmp_path: Path) -> None:
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", PROBE, 1), encoding="utf-8")
    shown = render(probe, tmp_path / "chromium", height=3000)
    assert_page_ok(shown)
    out = json.loads(shown.status["data-probe"])
    assert out["diagnosis"].startswith(f"first anomaly: step {SPIKE_STEP}, rank 0, module/forward ")
    assert out["star"] == {"x": SPIKE_STEP, "y": "module/forward"}
    assert out["annotation"].startswith("first anomaly: module/forward") and f"step {SPIKE_STEP} (spike)" in out["annotation"]
    assert {"kind": "spike", "x": [SPIKE_STEP]} in out["findings"]
    [loss] = out["loss"]
    assert loss["name"] == "loss · rank 0"
    expected = [v if np.isfinite(v) else None for v in run.losses]
    assert [v is None for v in loss["y"]] == [v is None for v in expected]
    np.testing.assert_allclose([v for v in loss["y"] if v is not None], [v for v in expected if v is not None], rtol=1e-6)
    assert out["heatmaps"] and max(h["rows"] for h in out["heatmaps"]) >= 20
    for heatmap in out["heatmaps"]:
        labels = heatmap["labels"]
        assert len(labels) == heatmap["rows"] and all(label["shown"] for label in labels)
        tops = sorted(labels, key=lambda label: label["top"])
        assert all(b["top"] >= a["bottom"] - 1 for a, b in zip(tops, tops[1:])), "row labels overlap"
