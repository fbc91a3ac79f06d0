"""``trainprobe report``: the data behind the page, the command line, bad input, and the page itself
rendered by a real headless browser (Debian's chromium; ``apt-get install -y chromium``).

The browser is driven with chromium's own command-line switches (no Python package): one run
dumps the DOM after the page's scripts ran (``--dump-dom`` after ``--virtual-time-budget``) and
takes a screenshot; ``--enable-logging=stderr`` puts every console message on stderr as a
``:CONSOLE`` line. The page marks ``#tp-status`` with ``data-state="rendered"`` once every Plotly
figure is drawn and records script errors in ``data-errors``.
"""

from __future__ import annotations

import json
import logging
import shutil
import struct
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from monitor_runs import NAN_RANK, NAN_STEP
from trainprobe.engine.errors import ConfigError
from trainprobe.tools.reporting.data import downsample, event_group, event_target, load_report_data
from trainprobe.tools.reporting.report import write_report

CHROMIUM = Path("/usr/bin/chromium")
needs_chromium = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium (apt-get install -y chromium)"
)


# --------------------------------------------------------------------------- browser helpers


class DomFacts(HTMLParser):
    """What the tests read from a dumped DOM: element attributes by id, Plotly divs and svgs."""

    def __init__(self) -> None:
        super().__init__()
        self.by_id: dict[str, dict[str, str]] = {}
        self.graph_divs = 0
        self.rendered_divs = 0
        self.main_svgs = 0
        self.external: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = {k: v or "" for k, v in attrs}
        classes = attributes.get("class", "").split()
        if "id" in attributes:
            self.by_id[attributes["id"]] = attributes
        if tag == "div" and "plotly-graph-div" in classes:
            self.graph_divs += 1
            self.rendered_divs += "js-plotly-plot" in classes
        if tag == "svg" and "main-svg" in classes:
            self.main_svgs += 1
        if (tag == "script" and attributes.get("src")) or (tag == "link" and attributes.get("href")):
            self.external.append(attributes.get("src") or attributes["href"])


@dataclass
class Page:
    """One chromium run over a page."""

    dom: DomFacts
    console: list[str]
    png: bytes
    seconds: float
    status: dict[str, str] = field(default_factory=dict)


def render(html: Path, work: Path, height: int = 3000) -> Page:
    """Load ``html`` in headless chromium: dumped DOM (also kept as ``work/dom.html``), console
    lines, screenshot, wall time."""
    work.mkdir(parents=True, exist_ok=True)
    png = work / "screenshot.png"
    command = [
        str(CHROMIUM),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--hide-scrollbars",
        f"--user-data-dir={work / 'profile'}",
        "--enable-logging=stderr",
        "--v=0",
        "--virtual-time-budget=30000",
        f"--window-size=1400,{height}",
        f"--screenshot={png}",
        "--dump-dom",
        html.resolve().as_uri(),
    ]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    seconds = time.perf_counter() - start
    assert done.returncode == 0, done.stderr[-2000:]
    (work / "dom.html").write_text(done.stdout, encoding="utf-8")
    facts = DomFacts()
    facts.feed(done.stdout)
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
    return Page(facts, console, png.read_bytes(), seconds, facts.by_id.get("tp-status", {}))


def assert_page_ok(page: Page) -> None:
    """Every figure drawn, no script error, no console message."""
    assert page.console == []
    assert page.status.get("data-errors") == ""
    assert page.status.get("data-state") == "rendered", page.status
    expected = int(page.status["data-expected"])
    assert expected > 0 and page.status["data-rendered"] == str(expected)
    assert page.dom.graph_divs == expected and page.dom.rendered_divs == expected
    assert page.dom.main_svgs >= expected


def png_busyness(png: bytes) -> tuple[int, int, float]:
    """Width, height and the share of non-zero bytes in the PNG's filtered scanlines (how much
    of the image differs from its neighbours: about 0.2 % for a blank page with a line of text,
    several % for a page of plots)."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", b""
    while pos < len(png):
        length, kind = struct.unpack(">I4s", png[pos : pos + 8])
        body = png[pos + 8 : pos + 8 + length]
        header = body if kind == b"IHDR" else header
        idat += body if kind == b"IDAT" else b""
        pos += 12 + length
    width, height, depth, colour = struct.unpack(">IIBB", header[:10])
    raw = np.frombuffer(zlib.decompress(idat), dtype=np.uint8)
    channels = {2: 3, 6: 4}[colour]
    assert depth == 8 and raw.size == height * (1 + width * channels)
    pixels = raw.reshape(height, -1)[:, 1:]
    return width, height, float(np.count_nonzero(pixels)) / pixels.size


# Clicks the menus of the first heatmap (colour → linear, then rank → 1) and records what is shown.
PROBE = """<script>
function tpProbe() {
  var status = document.getElementById("tp-status");
  if (status.getAttribute("data-state") !== "rendered") { return setTimeout(tpProbe, 50); }
  var gd = Array.prototype.filter.call(document.querySelectorAll(".js-plotly-plot"), function (g) {
    return g.data.some(function (t) { return t.meta && t.meta.role === "z"; });
  })[0], out = {};
  function shown() {
    return gd._fullData.filter(function (t) { return t.visible === true && t.meta.role === "z"; })
      .map(function (t) { return {index: t.index, z: Number(t.z[0][0]), title: t.colorbar.title.text,
                                  ticktext: t.colorbar.ticktext || null}; });
  }
  function click(menu, button) {
    gd.querySelectorAll(".updatemenu-header")[menu].dispatchEvent(new MouseEvent("click", {bubbles: true}));
    gd.querySelectorAll(".updatemenu-dropdown-button")[button].dispatchEvent(new MouseEvent("click", {bubbles: true}));
  }
  out.log = shown();
  click(2, 0);
  setTimeout(function () {
    out.linear = shown();
    click(1, 1);
    setTimeout(function () {
      out.rank1 = shown();
      status.setAttribute("data-probe", JSON.stringify(out));
    }, 200);
  }, 200);
}
window.addEventListener("load", tpProbe);
</script></body>"""


# --------------------------------------------------------------------------- data


def test_v1_data_summary_and_first_nan(monitor_runs):
    data = load_report_data(monitor_runs.v1)
    assert data.layouts == ("v1",) and data.ranks == [0, 1] and data.torn == 0
    assert [int(s) for s in data.steps] == list(range(6))
    names = [g.name for g in data.groups]
    assert names.index("actv") < names.index("actv_grad") < names.index("grad_reduced") < names.index("exp_avg")
    first = data.first_nonfinite
    assert first is not None
    assert (event_group(first), event_target(first)) == ("grad_reduced", "fc2.bias")
    assert (first.data["rank"], first.data["step"]) == (NAN_RANK, NAN_STEP)
    assert "NaN in min, max, mean, norm" in first.data["message"]
    assert all(e.data["step"] >= NAN_STEP for e in data.onsets)
    assert data.alerts and len(data.anomaly_files) == 2
    timeline_first = data.timeline[0]
    assert (event_group(timeline_first), timeline_first.data["rank"], timeline_first.data["step"]) == (
        "grad_reduced",
        NAN_RANK,
        NAN_STEP,
    )
    run = next(monitor_runs.v1.glob(f"*-rank{NAN_RANK}-*"))  # one run folder: its rank's alerts
    one = load_report_data(run)
    assert one.ranks == [NAN_RANK] and one.alerts and {e.data["rank"] for e in one.alerts} == {NAN_RANK}
    actv = data.groups[names.index("actv")]
    assert actv.targets[0] == ".input"  # model order: first appearance
    assert actv.ranks[0].values.shape == (len(actv.targets), 6, len(actv.ops))


def test_v2_data_groups_by_monitor_and_scope(monitor_runs):
    data = load_report_data(monitor_runs.v2)
    names = [g.name for g in data.groups]
    assert names[:2] == ["module/forward", "module/backward"]
    assert {"weight_grad/unreduced", "weight_grad/reduced", "optimizer/exp_avg", "cc/comm"} <= set(names)
    first = data.first_nonfinite
    assert first is not None
    assert (event_group(first), event_target(first)) == ("weight_grad/reduced", "fc2.bias")
    assert (first.data["rank"], first.data["step"]) == (NAN_RANK, NAN_STEP)
    assert data.alerts == []


def test_downsampling_keeps_spikes_and_nans():
    values = np.ones((2, 10))
    values[0, 3] = -50.0
    flags = np.zeros(values.shape, dtype=bool)
    values[1, 8], flags[1, 8] = np.nan, True
    values[1, 0] = np.nan  # missing, not flagged
    picked, bad = downsample(values, flags, 4)
    assert picked.shape == (2, 3)
    assert picked[0].tolist() == [-50.0, 1.0, 1.0]
    assert bad.tolist() == [[False, False, False], [False, False, True]]
    assert picked[1, 0] == 1.0


# --------------------------------------------------------------------------- the page in a browser


@needs_chromium
def test_v1_page_renders_in_chromium_and_its_menus_work(monitor_runs, tmp_path):
    path = write_report(monitor_runs.v1, tmp_path / "v1.html")
    text = path.read_text(encoding="utf-8")
    assert text.count("plotly.js v") == 1  # the bundle inlined once
    own = DomFacts()
    own.feed(text)
    assert own.external == []  # nothing to fetch: works offline
    probe = tmp_path / "probe.html"  # the page plus a script clicking the first heatmap's menus
    probe.write_text(text.replace("</body>", PROBE, 1), encoding="utf-8")
    page = render(probe, tmp_path / "chromium")
    assert_page_ok(page)
    first = page.dom.by_id["tp-first-nonfinite"]
    assert (first["data-rank"], first["data-step"]) == (str(NAN_RANK), str(NAN_STEP))
    assert (first["data-data-type"], first["data-target"]) == ("grad_reduced", "fc2.bias")
    assert page.dom.by_id["tp-first-alert"]["data-step"] == str(NAN_STEP)
    assert {"summary", "timeline", "heatmaps", "lines", "ranks"} <= set(page.dom.by_id)
    width, height, busy = png_busyness(page.png)
    assert (width, height) == (1400, 3000) and busy > 0.01
    result = json.loads(page.status["data-probe"])
    (linear,), (log,) = result["linear"], result["log"]  # log colour by default, linear one click away
    assert linear["index"] == log["index"] and linear["title"] == "norm" and log["title"] == "|norm|"
    assert linear["z"] > 0 and log["z"] == pytest.approx(np.log10(linear["z"]), abs=1e-6)
    assert log["ticktext"] and linear["ticktext"] is None
    (rank1,) = result["rank1"]
    assert rank1["index"] != log["index"] and rank1["title"] == "norm"


@needs_chromium
def test_v2_page_renders_in_chromium(monitor_runs, tmp_path):
    page = render(write_report(monitor_runs.v2, tmp_path / "v2.html"), tmp_path / "chromium", height=1200)
    assert_page_ok(page)
    first = page.dom.by_id["tp-first-nonfinite"]
    assert (first["data-data-type"], first["data-rank"], first["data-step"]) == ("weight_grad/reduced", "1", "4")
    assert "tp-first-alert" not in page.dom.by_id


def write_large_v1(root: Path, steps: int = 2000, targets: int = 200, per_file: int = 100) -> Path:
    """A synthetic one-rank V1 run: grad_reduced of ``targets`` parameters over ``steps`` steps,
    a spike of 1e6 at step 1234 and NaN from step 1900 on in one target."""
    run = root / "Jan01_00-00-00-rank0-0a1b2c3d"
    run.mkdir(parents=True)
    base = np.random.default_rng(0).lognormal(size=targets)
    names = [f"layers.{i}.weight" for i in range(targets)]
    for first in range(0, steps, per_file):
        lines = ["vpp_stage,name,step,min,max,mean,norm,nans"]
        for step in range(first, first + per_file):
            norms = base * (1 + 0.2 * np.sin(step / 60))
            for i, name in enumerate(names):
                n = 1e6 if (step, i) == (1234, 77) else norms[i]
                if step >= 1900 and i == 150:
                    lines.append(f"0,{name},{step},nan,nan,nan,nan,3")
                else:
                    lines.append(f"0,{name},{step},{-n / 10:.6g},{n / 10:.6g},{n / 1000:.6g},{n:.6g},0")
        (run / f"grad_reduced_{first}-{first + per_file - 1}.csv").write_text("\n".join(lines) + "\n")
    return root


@needs_chromium
def test_large_output_builds_and_renders_quickly(tmp_path):
    monitor = write_large_v1(tmp_path / "large")
    start = time.perf_counter()
    path = write_report(monitor, tmp_path / "large.html")
    build = time.perf_counter() - start
    assert build < 10.0, f"building the report of 2,000 steps × 200 targets took {build:.1f}s"
    page = render(path, tmp_path / "chromium")
    assert_page_ok(page)
    first = page.dom.by_id["tp-first-nonfinite"]
    assert (first["data-target"], first["data-step"]) == ("layers.150.weight", "1900")
    assert page.png and png_busyness(page.png)[2] > 0.01
    print(f"large report: build {build:.2f}s, chromium {page.seconds:.2f}s, drawn at {page.status['data-ms']} ms")


# --------------------------------------------------------------------------- command line and bad input


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainprobe", "report", *args], capture_output=True, text=True, cwd=cwd, timeout=120
    )


def test_cli_writes_the_page_and_prints_its_path(monitor_runs, tmp_path):
    done = _cli(str(monitor_runs.v2), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == tmp_path / "report.html" and (tmp_path / "report.html").is_file()


def test_cli_bad_paths_exit_2_with_one_line(tmp_path):
    for target, message in ((tmp_path / "nope", "does not exist"), (tmp_path, "no monitor data file")):
        done = _cli(str(target), cwd=tmp_path)
        assert done.returncode == 2
        assert message in done.stderr and "Traceback" not in done.stderr
        assert done.stderr.startswith("trainprobe report: error:") and done.stderr.count("\n") == 1


def test_bad_input_raises_config_error(tmp_path, monitor_runs):
    with pytest.raises(ConfigError, match="does not exist"):
        write_report(tmp_path / "nope", tmp_path / "r.html")
    with pytest.raises(ConfigError, match="no monitor data file"):
        write_report(tmp_path, tmp_path / "r.html")
    copy = tmp_path / "v1"
    shutil.copytree(monitor_runs.v1, copy)
    (copy / "anomaly_detected" / "rank0" / "anomaly.json").write_text('{"x": ')
    with pytest.raises(ConfigError, match=r"rank0/anomaly.json: not valid JSON"):
        write_report(copy, tmp_path / "r.html")
    header_only = tmp_path / "header_only" / "rank_0"
    header_only.mkdir(parents=True)
    (header_only / "param_step0-2.csv").write_text("vpp_stage,step,module_name,scope,min,max\n")
    with pytest.raises(ConfigError, match="hold no complete row"):
        write_report(header_only.parent, tmp_path / "r.html")
    (header_only / "param_step0-2.csv").write_text("vpp_stage,st")  # killed while writing the header
    with pytest.raises(ConfigError, match="hold no complete row"):
        write_report(header_only.parent, tmp_path / "r.html")


def test_torn_last_line_is_skipped_and_counted(tmp_path, monitor_runs, caplog):
    copy = tmp_path / "v2"
    shutil.copytree(monitor_runs.v2, copy)
    file = copy / "rank_0" / "param_step3-5.csv"
    file.write_text(file.read_text() + "0,5,fc2.bias,param_updated,0.1,0.")  # cut short by a kill
    with caplog.at_level(logging.WARNING, logger="trainprobe"):
        path = write_report(copy, tmp_path / "torn.html")
    assert caplog.text.count("skipped 1 torn row(s)") == 1
    assert load_report_data(copy).torn == 1
    assert "torn rows skipped: 1" in path.read_text(encoding="utf-8")


def test_output_defaults_and_folders(tmp_path, monitor_runs, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert write_report(monitor_runs.v2) == tmp_path / "report.html"
    assert write_report(monitor_runs.v2, tmp_path) == tmp_path / "report.html"  # a folder: report.html inside
    assert write_report(monitor_runs.v2, tmp_path / "new" / "r.html").is_file()  # parents created
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="output: cannot create the folder"):
        write_report(monitor_runs.v2, tmp_path / "file" / "r.html")
