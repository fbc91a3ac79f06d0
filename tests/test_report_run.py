"""``trainprobe report``'s Run section, top offenders and log-colour heatmaps (issue #16).

A tiny real model trains under Monitor V2 (weight_grad) and the training metrics
(``training_state.jsonl`` and TensorBoard events); every number the report draws is checked
against the float64 values the training loop computed itself (see ``report_run_fixture.py``),
then the page is built by ``trainprobe report`` in a subprocess and rendered by headless chromium.
"""

from __future__ import annotations

import csv
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from report_run_fixture import STEPS, RunReference, make_run
from test_tool_report import assert_page_ok, needs_chromium, render
from trainprobe.engine.errors import ConfigError
from trainprobe.tools.reporting.data import load_report_data
from trainprobe.tools.reporting.figures import (
    downsample_line,
    log_ticks,
    offender_buckets,
    offender_shares,
    real_label,
    run_figure,
    run_series,
)
from trainprobe.tools.reporting.report import write_report
from trainprobe.tools.reporting.run import TOP_K, TopShares, offenders_of

RTOL = 1e-5  # norms of float32 gradients (float32 sums) against the float64 reference


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> RunReference:
    return make_run(tmp_path_factory.mktemp("report_run"))


def reference_top(norms: dict[str, float], k: int = TOP_K) -> list[tuple[str, float]]:
    """The k parameters of largest squared norm and their share of the sum, in float64."""
    total = math.fsum(v * v for v in norms.values())
    ranked = sorted(norms.items(), key=lambda item: -item[1])[:k]
    return [(name, value * value / total) for name, value in ranked]


# --------------------------------------------------------------------------- data against float64


def test_gradient_group_global_norm_and_offenders_match_float64(run):
    data = load_report_data(run.v2)
    assert [g.name for g in data.gradient_groups] == ["weight_grad/reduced", "weight_grad/unreduced"]
    group = data.gradient_groups[0]  # reduced first: the gradients the optimizer applies
    offenders = group.offenders[0]
    assert offenders.steps.tolist() == list(range(STEPS))
    expected = [run.global_norm(s) for s in range(STEPS)]
    np.testing.assert_allclose(offenders.norm, expected, rtol=RTOL)
    np.testing.assert_allclose(group.ranks[0].global_value, expected, rtol=RTOL)
    for step in range(STEPS):
        top = reference_top(run.grad_norms[step])
        assert [offenders.names[i] for i in offenders.top_ids[step]] == [name for name, _ in top]
        np.testing.assert_allclose(offenders.top_share[step], [share for _, share in top], rtol=RTOL)
    run_total = math.fsum(run.global_norm(s) ** 2 for s in range(STEPS))
    by_name = {row.name: row for row in offenders.rows}
    assert set(by_name) == set(run.names)  # five parameters: each is in every step's top 5
    for name in run.names:
        shares = [dict(reference_top(run.grad_norms[s]))[name] for s in range(STEPS)]
        assert by_name[name].steps_in_top == STEPS
        assert by_name[name].mean_share == pytest.approx(math.fsum(shares) / STEPS, rel=RTOL)
        energy = math.fsum(run.grad_norms[s][name] ** 2 for s in range(STEPS))
        assert by_name[name].run_share == pytest.approx(energy / run_total, rel=RTOL)
    assert offenders.rows[0].name == "fc2.weight"  # largest gradient of the model


def test_training_state_and_tensorboard_series_match_float64(run):
    data = load_report_data(run.v2, training_state=run.dump, tensorboard=run.tensorboard)
    series = {(s.key, s.source): s for s in data.training.series}
    metric_steps = list(range(1, STEPS + 1))  # the training metrics count steps from 1
    for key, source, expected in (
        ("local_loss", "training_state.jsonl", run.losses),
        ("device_accum_local_loss", "training_state.jsonl", run.losses),
        ("device_local_norm", "training_state.jsonl", [run.global_norm(s) for s in range(STEPS)]),
        ("loss", "TensorBoard", run.losses),
        ("learning-rate", "TensorBoard", run.lrs),
        ("grad-norm", "TensorBoard", [run.global_norm(s) for s in range(STEPS)]),
    ):
        line = series[key, source]
        assert line.steps.tolist() == metric_steps and line.rank == 0
        np.testing.assert_allclose(line.values, expected, rtol=RTOL)  # TensorBoard keeps float32
    offenders = data.training.offenders[0]  # from local_norm/<param>
    for row, step in enumerate(metric_steps):
        top = reference_top(run.grad_norms[step - 1])
        assert [offenders.names[i] for i in offenders.top_ids[row]] == [name for name, _ in top]
        np.testing.assert_allclose(offenders.top_share[row], [share for _, share in top], rtol=1e-5)
    panels = run_series(data)
    assert list(panels) == ["loss", "learning rate", "global gradient norm"]
    assert {(s.key, s.source) for s in panels["global gradient norm"]} == {
        ("grad-norm", "TensorBoard"),
        ("device_local_norm", "training_state.jsonl"),
        ("weight_grad/reduced", "monitor CSVs"),
    }


def test_training_state_is_found_in_the_monitor_output_and_torn_lines_are_skipped(run, tmp_path):
    monitor = tmp_path / "v2"
    shutil.copytree(run.v2, monitor)
    shutil.copytree(run.dump, monitor / "metrics")  # dump_path inside the monitor output
    state = monitor / "metrics" / "rank_0" / "training_state.jsonl"
    state.write_text(state.read_text() + '{"step": 9, "local_loss": 1.')  # killed while writing
    data = load_report_data(monitor)
    assert data.training.files == [state] and data.training.skipped == 1
    loss = next(s for s in data.training.series if s.key == "local_loss")
    assert loss.steps.tolist() == list(range(1, STEPS + 1))
    assert load_report_data(run.v2).training.files == []  # nothing found: no Run lines from it


def test_bad_training_state_and_tensorboard_paths(run, tmp_path):
    with pytest.raises(ConfigError, match=r"training_state: .*nope.* does not exist"):
        load_report_data(run.v2, training_state=tmp_path / "nope")
    with pytest.raises(ConfigError, match="training_state: no training_state.jsonl in"):
        load_report_data(run.v2, training_state=tmp_path)
    with pytest.raises(ConfigError, match="tensorboard: no events.out.tfevents"):
        load_report_data(run.v2, tensorboard=tmp_path)
    broken = tmp_path / "tb" / "rank_0"
    broken.mkdir(parents=True)
    (broken / "events.out.tfevents.1.x").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage")
    data = load_report_data(run.v2, tensorboard=tmp_path / "tb")  # a torn record: nothing read, no error
    assert len(data.training.event_files) == 1 and data.training.series == []


# --------------------------------------------------------------------------- pure functions


def test_top_shares_over_split_blocks_match_a_float64_reference():
    rng = np.random.default_rng(3)
    steps, targets = 40, 30
    norms = rng.lognormal(sigma=2.0, size=(targets, steps))
    norms[4, 7] = 0.0
    shares = TopShares()
    cells = [(t, s) for t in range(targets) for s in range(steps)]
    order = rng.permutation(len(cells))
    for chunk in np.array_split(order, 7):  # blocks with several steps, a step over several blocks
        t = np.array([cells[i][0] for i in chunk])
        s = np.array([cells[i][1] for i in chunk])
        shares.add(s, t, norms[t, s] ** 2)
    names = [f"p{i}" for i in range(targets)]
    result = offenders_of(shares, names, "test", 0)
    assert result is not None
    squares = norms**2
    np.testing.assert_allclose(result.norm, np.sqrt(squares.sum(axis=0)), rtol=1e-12)
    expected_ids = np.argsort(-squares, axis=0, kind="stable")[:TOP_K].T
    assert (result.top_ids == expected_ids).all()
    expected_share = np.take_along_axis(squares, expected_ids.T, axis=0).T / squares.sum(axis=0)[:, None]
    np.testing.assert_allclose(result.top_share, expected_share, rtol=1e-12)
    in_top = np.zeros(targets, dtype=int)
    share_sum = np.zeros(targets)
    for s in range(steps):
        in_top[expected_ids[s]] += 1
        share_sum[expected_ids[s]] += expected_share[s]
    run_share = squares.sum(axis=1) / squares.sum()
    order = sorted(np.flatnonzero(in_top), key=lambda i: (-in_top[i], -run_share[i], i))[:10]
    assert [row.name for row in result.rows] == [names[i] for i in order]
    for row, i in zip(result.rows, order):
        assert row.steps_in_top == in_top[i]
        assert row.mean_share == pytest.approx(share_sum[i] / in_top[i], rel=1e-12)
        assert row.run_share == pytest.approx(run_share[i], rel=1e-12)
    bands_names, bands = offender_shares(result, np.arange(steps))
    assert len(bands_names) == len(result.rows) + 2
    np.testing.assert_allclose(bands.sum(axis=0), 1.0, rtol=1e-12)
    np.testing.assert_allclose(bands[-1], 1 - expected_share.sum(axis=1), rtol=1e-9)


def test_top_shares_of_blocks_in_file_order_equal_those_of_any_order():
    """A file's block (steps ascending, each with the same parameters in model order: the common
    case, folded one small sort per step) gives exactly what the same cells in any order give."""
    rng = np.random.default_rng(5)
    steps, targets = 60, 40
    norms = rng.lognormal(sigma=3.0, size=(steps, targets))
    norms[3, :7] = 0.0  # ties: the smaller id first
    norms[9, 10:20] = 1.5
    step_col = np.repeat(np.arange(steps), targets)
    target_col = np.tile(np.arange(targets), steps)
    squares = norms.reshape(-1) ** 2
    in_order, shuffled, by_target = TopShares(), TopShares(), TopShares()
    for part in np.array_split(np.arange(len(step_col)), 3):  # blocks of whole steps
        in_order.add(step_col[part], target_col[part], squares[part])
    mixed = rng.permutation(len(step_col))
    shuffled.add(step_col[mixed], target_col[mixed], squares[mixed])
    column = np.lexsort((step_col, target_col))  # parameter after parameter, steps ascending
    by_target.add(step_col[column], target_col[column], squares[column])
    for other in (shuffled, by_target):
        assert in_order.total == other.total and in_order.top == other.top
        np.testing.assert_allclose(in_order.energy, other.energy, rtol=1e-12)
    assert in_order.top[9] == sorted(in_order.top[9], key=lambda p: (-p[0], p[1]))
    assert in_order.total[5] == float(np.sort(squares[5 * targets : 6 * targets])[::-1].sum())


def test_log_ticks_are_real_values_with_zero_at_the_floor():
    ticks = log_ticks(np.array([[0.0, 1e-3, -5e2, np.nan]], dtype=np.float32))
    assert ticks["text"] == ["0", "0.001", "0.01", "0.1", "1", "10", "100"]
    assert ticks["vals"][0] == pytest.approx(math.log10(1e-4), abs=1e-6)  # a decade below 1e-3
    np.testing.assert_allclose(ticks["vals"][1:], [-3, -2, -1, 0, 1, 2], atol=1e-6)
    narrow = log_ticks(np.array([1.2, 1.8], dtype=np.float32))
    assert narrow["text"] == ["1.2", "1.37", "1.57", "1.8"]
    wide = log_ticks(np.array([1e-12, 1e12], dtype=np.float32))
    assert wide["text"][0] == "1e-12" and wide["text"][-1] == "1e+12" and len(wide["text"]) <= 10
    assert [real_label(v) for v in (2e-5, 5000.0, 1e5)] == ["2e-05", "5000", "1e+05"]


def test_downsampled_run_lines_and_offender_steps_keep_spikes():
    steps = np.arange(3000)
    values = np.ones(3000)
    values[1234] = 1e6
    values[2500], values[2800] = np.inf, np.nan
    x, y = downsample_line(steps, values, 1000)
    assert len(x) == 1000 and np.nanmax(y) == 1e6 and x[np.nanargmax(y)] == 1233  # the bucket's first step
    assert np.isnan(y[[2500 // 3, 2800 // 3]]).all() and np.isfinite(np.delete(y, [833, 933])).all()
    shares = TopShares()
    norms = np.ones(3000)
    norms[1234] = 1e3
    shares.add(steps, np.zeros(3000, dtype=np.int64), norms**2)
    offenders = offenders_of(shares, ["w"], "t", 0)
    assert offenders is not None
    rows = offender_buckets(offenders, 1000)
    assert len(rows) == 1000 and 1234 in rows.tolist()


# --------------------------------------------------------------------------- the command and the page


def _report(run: RunReference, out: Path) -> str:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainprobe",
            "report",
            str(run.v2),
            "--training-state",
            str(run.dump),
            "--tensorboard",
            str(run.tensorboard),
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    return out.read_text(encoding="utf-8")


def test_cli_page_has_run_offenders_and_log_heatmaps(run, tmp_path):
    text = _report(run, tmp_path / "run.html")
    assert '<section id="run">' in text and '<section id="offenders">' in text
    sources = re.search(
        r'id="tp-run-sources" data-files="(\d+)" data-event-files="(\d+)" data-loss-files="(\d+)" data-panels="([^"]*)"',
        text,
    )
    assert sources is not None and sources.groups() == ("1", "1", "0", "loss,learning rate,global gradient norm")
    table = re.search(r'<table id="tp-offenders">(.*?)</table>', text, re.S)
    assert table is not None
    first = re.findall(r"<tr><td>([^<]*)</td><td class=num>(\d+)</td>", table.group(1))[0]
    assert first == ("fc2.weight", str(STEPS))
    assert '"name":"tp-scale"' in text and '"ticks":{"vals":' in text
    assert re.search(r'"name":"tp-scale","type":"dropdown","direction":"down","active":1', text)


# The page's figures after load: Run lines, offender bars, and the first heatmap's shown trace
# with its colour bar and the hover text over its top-left cell.
PROBE = """<script>
function tpRunProbe() {
  var status = document.getElementById("tp-status");
  if (status.getAttribute("data-state") !== "rendered") { return setTimeout(tpRunProbe, 50); }
  var plots = Array.prototype.slice.call(document.querySelectorAll(".js-plotly-plot")), out = {};
  function role(gd, name) { return gd._fullData.filter(function (t) { return t.meta && t.meta.role === name; }); }
  var runPlot = plots.filter(function (gd) { return role(gd, "run").length; })[0];
  out.run = role(runPlot, "run").map(function (t) {
    return {panel: t.meta.panel, name: t.name, y: Array.prototype.slice.call(t.y).map(Number)};
  });
  var offenders = plots.filter(function (gd) { return role(gd, "offender-share").length; })[0];
  out.bars = role(offenders, "offender-share").map(function (t) { return t.name; });
  out.barPaths = offenders.querySelectorAll(".bars path").length;
  var heat = plots.filter(function (gd) { return role(gd, "z").length; })[0];
  var shown = role(heat, "z").filter(function (t) { return t.visible === true; })[0];
  out.heat = {title: shown.colorbar.title.text, ticktext: shown.colorbar.ticktext, z: Number(shown.z[0][0]),
              real: Number(shown.customdata[0][0]), y0: shown.y[0]};
  var drag = heat.querySelector(".nsewdrag"), box = drag.getBoundingClientRect();
  drag.dispatchEvent(new MouseEvent("mousemove", {bubbles: true, clientX: box.left + 2, clientY: box.top + 2}));
  setTimeout(function () {
    out.hover = heat.querySelector(".hoverlayer").textContent;
    status.setAttribute("data-probe", JSON.stringify(out));
  }, 300);
}
window.addEventListener("load", tpRunProbe);
</script></body>"""


@needs_chromium
def test_page_draws_run_offenders_and_log_heatmap_in_chromium(run, tmp_path):
    text = _report(run, tmp_path / "run.html")
    probe = tmp_path / "probe.html"
    probe.write_text(text.replace("</body>", PROBE, 1), encoding="utf-8")
    page = render(probe, tmp_path / "chromium", height=2400)
    assert_page_ok(page)
    assert {"run", "offenders", "tp-offenders", "heatmaps"} <= set(page.dom.by_id)
    out = json.loads(page.status["data-probe"])
    lines = {(line["panel"], line["name"]): line["y"] for line in out["run"]}
    np.testing.assert_allclose(lines["learning rate", "learning-rate · rank 0"], run.lrs, rtol=RTOL)
    np.testing.assert_allclose(lines["loss", "local_loss · rank 0"], run.losses, rtol=1e-6)
    expected_norm = [run.global_norm(s) for s in range(STEPS)]
    np.testing.assert_allclose(lines["global gradient norm", "weight_grad/reduced · rank 0"], expected_norm, rtol=1e-6)
    assert out["bars"][0] == "fc2.weight" and out["bars"][-1] == f"outside the step's top {TOP_K}"
    assert out["barPaths"] >= STEPS
    heat = out["heat"]  # the log colour is the default: z = log10|value|, the real value in the hover
    assert heat["title"] == "|norm|" and heat["y0"] == "embed.weight"
    assert heat["real"] == pytest.approx(run.grad_norms[0]["embed.weight"], rel=1e-6)
    assert heat["z"] == pytest.approx(math.log10(heat["real"]), abs=1e-6)
    assert heat["ticktext"] and all(re.fullmatch(r"0|[0-9.e+-]+", t) for t in heat["ticktext"])
    assert f"norm = {heat['real']:.4g}" in out["hover"] and "embed.weight" in out["hover"]


def test_write_report_passes_the_sources_on(run, tmp_path):
    path = write_report(run.v2, tmp_path / "r.html", training_state=run.dump / "rank_0" / "training_state.jsonl")
    text = path.read_text(encoding="utf-8")
    assert 'data-files="1" data-event-files="0" data-loss-files="0" data-panels="loss,global gradient norm"' in text


def test_v1_and_v2_gradient_csvs_of_two_ranks_feed_run_and_offenders(monitor_runs):
    """Two real gloo ranks (``monitor_runs.py``; NaN in rank 1's fc2.bias from step 4): the
    global norm and shares of each rank, against float64 sums of the CSVs' norms read here."""
    for root, name, target_col in (
        (monitor_runs.v1, "grad_reduced", "name"),
        (monitor_runs.v2, "weight_grad/reduced", "module_name"),
    ):
        data = load_report_data(root)
        group = data.gradient_groups[0]
        assert group.name == name and sorted(group.offenders) == [0, 1]
        for rank in (0, 1):
            norms: dict[int, dict[str, float]] = {}
            pattern = (
                f"*-rank{rank}-*/grad_reduced_*.csv" if name == "grad_reduced" else f"rank_{rank}/weight_grad_*.csv"
            )
            for path in root.glob(pattern):
                with open(path, newline="", encoding="utf-8") as handle:
                    for row in csv.DictReader(handle):
                        if row.get("scope", "reduced") == "reduced" and math.isfinite(float(row["norm"])):
                            norms.setdefault(int(row["step"]), {})[row[target_col]] = float(row["norm"])
            offenders = group.offenders[rank]
            steps = sorted(norms)
            assert offenders.steps.tolist() == steps
            expected = [math.sqrt(math.fsum(v * v for v in norms[s].values())) for s in steps]
            np.testing.assert_allclose(offenders.norm, expected, rtol=1e-12)
            for row, step in enumerate(steps):
                top = reference_top(norms[step])
                assert [offenders.names[i] for i in offenders.top_ids[row][: len(top)]] == [n for n, _ in top]
                np.testing.assert_allclose(offenders.top_share[row][: len(top)], [s for _, s in top], rtol=1e-12)
        if name == "grad_reduced":  # rank 1 lost fc2.bias (NaN) from step 4: 3 of 4 parameters then
            assert "fc2.bias" not in [group.offenders[1].names[i] for i in group.offenders[1].top_ids[-1] if i >= 0]
        lines = {line.rank: line for line in run_series(data)["global gradient norm"]}
        assert lines[1].nonfinite is not None and lines[1].steps[lines[1].nonfinite].tolist() == [4, 5]
        assert lines[0].nonfinite is not None  # the NaN reaches rank 0 through the all-reduce a step later
        assert lines[0].steps[lines[0].nonfinite].tolist() == [5]
        figure = run_figure(run_series(data))
        crosses = [t for t in figure["data"] if t["meta"]["role"] == "run-nonfinite"]
        assert [t["name"] for t in crosses] == [f"NaN/inf in a gradient · rank {r}" for r in (0, 1)]
