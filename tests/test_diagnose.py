"""``trainprobe diagnose``: real 2-rank gloo runs of a tiny GPT (``diagnose_runs.py``) with a 50x
gradient spike at step 20 and a NaN at step 30 on rank 1, under Monitor V2 and Monitor V1
(alerts on); a clean run and the demo's run give nothing; bad input is one line, exit 2."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from diagnose_runs import BAD_RANK, NAN_PARAM, NAN_STEP, SPIKE_PARAM, SPIKE_STEP, DiagnoseRuns, make_diagnose_runs
from trainprobe.engine.errors import ConfigError
from trainprobe.tools.diagnosis.answer import diagnose, diagnosis_summary
from trainprobe.tools.query.layer import first_nonfinite

pytest.importorskip("duckdb")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> DiagnoseRuns:
    return make_diagnose_runs(tmp_path_factory.mktemp("diagnose"))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainprobe", "diagnose", *args], capture_output=True, text=True, timeout=300
    )


def test_v2_spike_is_found_first_and_the_nan_named(runs: DiagnoseRuns) -> None:
    result = diagnose(runs.v2)
    first = result.first
    assert first is not None
    assert (first.kind, first.step, first.rank, first.name) == ("spike", SPIKE_STEP, BAD_RANK, SPIKE_PARAM)
    assert (first.table, first.scope) == ("weight_grad", "reduced")
    assert first.value is not None and first.median is not None and abs(first.value) > 10 * first.median
    nan = result.first_nonfinite
    assert nan is not None
    assert (nan.step, nan.rank, nan.name, nan.table, nan.scope) == (NAN_STEP, BAD_RANK, NAN_PARAM, "weight_grad", "reduced")
    # the query layer's own answer, the same row
    [layer] = first_nonfinite(runs.v2)
    assert (layer["step"], layer["rank"], layer["name"]) == (nan.step, nan.rank, nan.name)
    # rank 1 alone first; rank 0 only once the NaN crosses the all-reduce
    assert result.first_ranks == [BAD_RANK]
    assert result.first_step_by_rank[0] > SPIKE_STEP
    assert "rank 1 alone first (step 20)" in result.ranks_line()
    assert [a.order_key() for a in result.anomalies] == sorted(a.order_key() for a in result.anomalies)


def test_without_spikes_the_nan_is_named_first(runs: DiagnoseRuns) -> None:
    result = diagnose(runs.v2, spike_factor=1e6)
    first = result.first
    assert first is not None
    assert (first.kind, first.step, first.rank, first.name, first.op) == (
        "nonfinite", NAN_STEP, BAD_RANK, NAN_PARAM, "min"
    )
    assert result.line().startswith(f"first anomaly: step {NAN_STEP}, rank {BAD_RANK}, weight_grad/reduced {NAN_PARAM}")


def test_v1_with_alerts_gives_the_same_first_anomaly(runs: DiagnoseRuns) -> None:
    assert (runs.v1 / "anomaly_detected").is_dir()
    v1, v2 = diagnose(runs.v1), diagnose(runs.v2)
    assert v1.alerts > 0
    assert v1.first is not None and v2.first is not None
    assert (v1.first.step, v1.first.rank, v1.first.name) == (v2.first.step, v2.first.rank, v2.first.name)
    assert v1.first.table == "grad_reduced"
    nan = v1.first_nonfinite
    assert nan is not None and (nan.step, nan.rank, nan.name) == (NAN_STEP, BAD_RANK, NAN_PARAM)
    only_nans = diagnose(runs.v1, spike_factor=1e6)
    assert only_nans.first is not None
    assert (only_nans.first.step, only_nans.first.rank, only_nans.first.name) == (NAN_STEP, BAD_RANK, NAN_PARAM)
    assert only_nans.first.source == "files+alert" and only_nans.first.rule == "AnomalyNan"


def test_cli_prints_the_line_and_writes_diagnosis_json(runs: DiagnoseRuns, tmp_path: Path) -> None:
    done = _cli(str(runs.v2), "--out", str(tmp_path / "out"), "--rule", "median")
    assert done.returncode == 1, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"first anomaly: step {SPIKE_STEP}, rank {BAD_RANK}, weight_grad/reduced {SPIKE_PARAM}: ")
    assert lines[0].endswith(" (spike)") and "its running median" in lines[0]
    assert any(line.startswith(f"first NaN/inf: step {NAN_STEP}, rank {BAD_RANK}") for line in lines)
    doc = json.loads((tmp_path / "out" / "diagnosis.json").read_text())
    assert doc["found"] is True and doc["line"] == lines[0]
    assert doc["first"]["step"] == SPIKE_STEP and doc["first"]["kind"] == "spike" and doc["first"]["ratio"] > 10
    assert doc["first_nonfinite"]["value"] == "nan"
    assert doc["ranks"]["first"] == [BAD_RANK] and doc["ranks"]["all"] == [0, 1]
    rule = {k: v for k, v in doc["spike_rule"].items() if k != "text"}
    assert rule == {"name": "median", "factor": 10.0, "window": 20, "warmup": 10, "ops": ["norm", "max", "min"]}
    assert doc["spike_rule"]["text"].startswith("median: v > 10 x median of the previous 20 rows")
    # the default rule: the same row, worded with its reference
    done = _cli(str(runs.v2), "--out", str(tmp_path / "default"))
    assert done.returncode == 1, done.stderr
    line = done.stdout.splitlines()[0]
    assert line.startswith(f"first anomaly: step {SPIKE_STEP}, rank {BAD_RANK}, weight_grad/reduced {SPIKE_PARAM}: norm = ")
    assert re.search(r", [0-9.]+x its recent max [0-9.e-]+ \(spike, recent_max\)$", line), line
    doc = json.loads((tmp_path / "default" / "diagnosis.json").read_text())
    assert doc["spike_rule"]["name"] == "recent_max" and doc["first"]["spike_rule"] == "recent_max"
    assert doc["spike_rule"]["factor"] == 4.0 and doc["spike_rule"]["window"] == 10


def test_clean_tiny_gpt_run_exits_0(runs: DiagnoseRuns, tmp_path: Path) -> None:
    done = _cli(str(runs.clean), "-o", str(tmp_path))  # -o/--output, --out kept
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("no anomaly: no NaN/inf and no spike by the rule recent_max in 2 rank(s)")
    assert json.loads((tmp_path / "diagnosis.json").read_text())["first"] is None
    done = _cli(str(runs.clean), "--rule", "median")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("no anomaly: no NaN/inf and no spike above 10x in 2 rank(s)")
    # the median rule's warm-up is what keeps the early steps quiet: without it they cry wolf
    assert diagnose(runs.clean, rule="median", warmup=1, window=20, spike_factor=3).first is not None


def test_report_summary(runs: DiagnoseRuns) -> None:
    summary = diagnosis_summary(runs.v2)
    assert summary["found"] and summary["lines"][0] == summary["line"]
    assert summary["first"]["name"] == SPIKE_PARAM


def test_baseline_adds_the_diff_answer(runs: DiagnoseRuns, tmp_path: Path) -> None:
    """``--baseline GOOD_RUN`` adds ``trainprobe diff``'s answer: the clean run (same seed) against
    the run whose rank 1 got a 50x gradient at step 20 parts at step 20 on rank 1."""
    result = diagnose(runs.v2, baseline=runs.clean)
    assert result.baseline is not None and result.baseline.startswith("first divergence: step 20, "), result.baseline
    assert "rank 1" in result.baseline
    assert result.lines()[1] == f"against the baseline: {result.baseline}"
    assert result.to_json()["baseline"] == result.baseline
    done = _cli(str(runs.v2), "--baseline", str(runs.clean))
    assert done.returncode == 1 and f"against the baseline: {result.baseline}" in done.stdout


def test_baseline_diff_cannot_compare_is_said_in_the_line(runs: DiagnoseRuns, tmp_path: Path) -> None:
    result = diagnose(runs.v2, baseline=tmp_path / "missing")
    assert result.baseline is not None and result.baseline.startswith("diff: "), result.baseline


def _one_line_exit_2(folder: Path, match: str) -> None:
    done = _cli(str(folder))
    assert done.returncode == 2, done.stdout + done.stderr
    err = done.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("trainprobe diagnose: error: ") and match in err, err


def test_bad_input_is_one_line_exit_2(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    _one_line_exit_2(empty, "no monitor data file")
    _one_line_exit_2(tmp_path / "missing", "does not exist")
    dump = tmp_path / "dump" / "step0" / "rank0"
    dump.mkdir(parents=True)
    (dump / "dump.json").write_text("{}")
    _one_line_exit_2(tmp_path / "dump", "trainprobe compare")
    unrelated = tmp_path / "unrelated"
    unrelated.mkdir()
    (unrelated / "sales.csv").write_text("region,total\nnorth,3\n")
    (unrelated / "rank_0").mkdir()
    (unrelated / "rank_0" / "prices_2024.csv").write_text("a,b\n1,2\n")
    _one_line_exit_2(unrelated, "no monitor data file")
    torn = tmp_path / "torn" / "rank_0"
    torn.mkdir(parents=True)
    (torn / "weight_grad_step0-9.csv").write_text("vpp_stage,step,modu")  # a header cut short
    _one_line_exit_2(tmp_path / "torn", "no data file has a complete header line")
    wrong = tmp_path / "wrong" / "rank_0"
    wrong.mkdir(parents=True)
    (wrong / "weight_grad_step0-9.csv").write_text("vpp_stage,step,x,y\n0,1,2,3\n")
    _one_line_exit_2(tmp_path / "wrong", "is this a monitor file?")
    done = _cli(str(tmp_path / "wrong"), "--spike-factor", "0.5")
    assert done.returncode == 2 and "--spike-factor" in done.stderr


def test_a_torn_last_row_is_left_out_and_the_run_diagnosed(runs: DiagnoseRuns, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(runs.clean, run)
    last = max(run.glob("rank_1/weight_grad_step*.csv"))
    with last.open("a") as handle:
        handle.write("0,35,layers.0.attn.qkv.weight,reduced,,-1e9")  # killed mid-row: a torn record
    done = _cli(str(run))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "torn" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_demo_run_is_clean(tmp_path: Path) -> None:
    """The documented demo (``trainprobe demo``, a tiny GPT with a normal loss curve): no wolf."""
    demo = subprocess.run(
        [sys.executable, "-m", "trainprobe", "demo", "--out", str(tmp_path), "--steps", "25"],
        capture_output=True, text=True, timeout=600,
    )
    assert demo.returncode == 0, demo.stderr
    done = _cli(str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("no anomaly")


def test_help_does_not_import_duckdb() -> None:
    code = (
        "import sys; from trainprobe.cli import build_parser; build_parser(); "
        "print([m for m in ('duckdb', 'pyarrow', 'trainprobe.tools.diagnosis.answer') if m in sys.modules])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


def test_python_api_trainprobe_tools_diagnose(runs: DiagnoseRuns) -> None:
    import trainprobe.tools

    result = trainprobe.tools.diagnose(runs.v2, spike_factor=1e6)
    assert result.first is not None and result.first.step == NAN_STEP
    assert result.to_json()["spike_rule"]["factor"] == 1e6
    with pytest.raises(ConfigError, match="--spike-factor"):
        diagnose(runs.v2, spike_factor=1.0)


def test_rule_options_are_checked_in_one_line(runs: DiagnoseRuns) -> None:
    with pytest.raises(ConfigError, match=r"--warmup: the spike rule 'recent_max' has no warmup parameter \(its parameters: factor, window, grow, reference\); leave --warmup out"):
        diagnose(runs.v2, warmup=5)
    with pytest.raises(ConfigError, match=r"--spike-factor: the spike rule 'ema_z' has no factor parameter"):
        diagnose(runs.v2, rule="ema_z", spike_factor=3)
    with pytest.raises(ConfigError, match=r"--window: the spike rule 'early_max' has no window parameter"):
        diagnose(runs.v2, rule="early_max", window=3)
    with pytest.raises(ConfigError, match=r"--rule: 'zclip' is not a spike rule; one of median, early_max, mean_patience, ema_z, recent_max"):
        diagnose(runs.v2, rule="zclip")
    with pytest.raises(ConfigError, match=r"--rule median: need 1 <= warmup \(30\) <= window \(20\)"):
        diagnose(runs.v2, rule="median", warmup=30)
    for args, match in ((["--warmup", "5"], "--warmup: the spike rule 'recent_max' has no warmup"),
                        (["--rule", "zclip"], "--rule: 'zclip' is not a spike rule")):
        done = _cli(str(runs.v2), *args)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and match in done.stderr, done.stderr


@pytest.mark.parametrize("rule", ["median", "early_max", "mean_patience", "ema_z", "recent_max"])
def test_every_rule_runs_on_the_run_and_is_named(runs: DiagnoseRuns, rule: str) -> None:
    """Each rule of engine/rules replayed over the run's series: the spikes are its verdicts
    (the same as replaying one series by hand), named in the line; the NaN is found by all."""
    result = diagnose(runs.v2, rule=rule)
    assert result.rule == rule and result.to_json()["spike_rule"]["name"] == rule
    assert result.first_nonfinite is not None and result.first_nonfinite.step == NAN_STEP
    for anomaly in result.anomalies:
        if anomaly.kind == "spike":
            assert anomaly.spike_rule == rule
            assert ("(spike)" if rule == "median" else f"(spike, {rule})") in anomaly.describe()
            verdict = _by_hand(runs.v2, anomaly)
            assert verdict.reference == anomaly.median and verdict.value == abs(anomaly.value or 0)


def _by_hand(run: Path, anomaly: Any) -> Any:
    """The rule's verdict at the anomaly's step, replaying its one series read by hand."""
    import numpy as np

    from trainprobe.engine.rules import rule_named
    from trainprobe.engine.rules.series import is_squared, signals
    from trainprobe.tools.query.layer import connect

    micro = "IS NULL" if anomaly.micro_step is None else f"= {anomaly.micro_step}"
    rows = connect(run).execute(
        f"SELECT step, min, max, norm FROM {anomaly.table} WHERE rank = ? AND name = ? AND scope = ? "
        f"AND micro_step {micro} AND step <= {NAN_STEP} ORDER BY step, file_row",
        [anomaly.rank, anomaly.name, anomaly.scope],
    ).fetchall()
    steps = np.array([r[0] for r in rows])
    ops = {op: np.array([np.nan if r[i] is None else r[i] for r in rows], dtype=float) for i, op in ((1, "min"), (2, "max"), (3, "norm"))}
    magnitudes = signals(ops)["norm" if anomaly.op == "norm" else "amax"][0]
    found = rule_named(anomaly.spike_rule).replay(steps, magnitudes, is_squared(anomaly.scope))
    [verdict] = [v for v in found if v.step == anomaly.step]
    return verdict


def test_reference_layouts_no_tensor_rows_are_not_anomalies(tmp_path: Path) -> None:
    """The reference msProbe's V1 files hold rows of ``nan`` where no tensor was computed
    (``dtype`` ``nan``): not NaN/inf; its V2 files (``\\r\\n``, ``vpp_stage`` -1) are read too."""
    from reference_layouts import write_reference_v1, write_reference_v2

    for name, write in (("v1", write_reference_v1), ("v2", write_reference_v2)):
        run = write(tmp_path / name, steps=3)
        result = diagnose(run)
        assert result.first is None, result.lines()
        assert result.ranks == [0]


def test_report_has_the_diagnosis_and_the_baseline_diff(runs: DiagnoseRuns, tmp_path: Path) -> None:
    """``trainprobe report`` shows diagnose's answer first; ``--baseline`` adds diff's answer and
    heatmaps (the page renders in headless Chromium where it is installed)."""
    pytest.importorskip("plotly")
    from trainprobe.tools.reporting.report import write_report
    from trainprobe.tools.rundiff.answer import diff

    page = write_report(runs.v2, tmp_path / "report.html", baseline=runs.clean)
    text = page.read_text(encoding="utf-8")
    first = diagnose(runs.v2).line()
    assert f'<p class="bad" id="tp-diagnosis">{html.escape(first)}</p>' in text
    assert '<section id="baseline">' in text and html.escape(diff(runs.clean, runs.v2).answer()) in text
    assert text.index('id="diagnosis"') < text.index('id="baseline"') < text.index('id="timeline"')
    clean = write_report(runs.clean, tmp_path / "clean.html").read_text(encoding="utf-8")
    assert '<p class="ok" id="tp-diagnosis">no anomaly' in clean and 'id="baseline"' not in clean
    done = _cli_report(str(runs.v2), "-o", str(tmp_path / "cli.html"), "--baseline", str(runs.clean))
    assert done.returncode == 0 and '<section id="baseline">' in (tmp_path / "cli.html").read_text(encoding="utf-8")
    if Path("/usr/bin/chromium").exists():
        from test_tool_report import assert_page_ok, render

        assert_page_ok(render(page, tmp_path / "chromium", height=2000))


def _cli_report(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainprobe", "report", *args], capture_output=True, text=True, timeout=300)


def test_the_run_files_are_found_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One diagnosis lists the run's folders once: the views and the first-NaN/inf query (also its
    second query over the NaN step's CSV window) are given the files found at the start."""
    import trainprobe.tools.query.layer as query
    import trainprobe.tools.runs.files as query_files

    header = "vpp_stage,step,module_name,scope,micro_step,min,norm,nans\n"
    rows = {0: "1.0,2.0,0", 1: "1.0,2.0,0", 2: "nan,nan,3", 3: "1.0,2.0,0"}
    for first in (0, 2):
        folder = tmp_path / "run" / "rank_0"
        folder.mkdir(parents=True, exist_ok=True)
        lines = "".join(f"0,{s},fc1.weight,reduced,,{rows[s]}\n" for s in (first, first + 1))
        (folder / f"weight_grad_step{first}-{first + 1}.csv").write_text(header + lines, encoding="utf-8")
    calls: list[Path] = []
    real = query_files.find_run_files

    def counted(run: str | Path, warn_links: bool = True) -> list[query_files.RunFile]:
        calls.append(Path(run))
        return real(run, warn_links)

    monkeypatch.setattr(query_files, "find_run_files", counted)
    monkeypatch.setattr(query, "find_run_files", counted)
    result = diagnose(tmp_path / "run")
    assert result.first is not None and (result.first.kind, result.first.step) == ("nonfinite", 2)
    assert calls == [tmp_path / "run"]
