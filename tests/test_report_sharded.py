"""``trainprobe report`` on a sharded run (issue #32, "report answers in full tensors"): TP=2 on
two gloo ranks with a NaN (or a 30x spike) injected into rank 1's shard of ``fc1.weight``'s
gradient. The page's Diagnosis names the step, the full tensor, the ranks that held it and whose
shard held the NaN; its summary says the run is sharded; the heatmaps, lines and training curves
hold full tensors (the spike step's cell equals the gathered gradient's float64 norm and max),
each under the least rank holding it; ``--rank-local`` shows and diagnoses each rank's own rows;
a healthy sharded run's Diagnosis is clean."""

from __future__ import annotations

import html
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

pytest.importorskip("duckdb")
pytest.importorskip("plotly")

import numpy as np  # noqa: E402

from test_diagnose_sharded import BAD_RANK, NAN_STEP, SPIKE_STEP, WORLD, train  # noqa: E402
from test_distributed_v2 import launch  # noqa: E402
from test_tool_report import assert_page_ok, needs_chromium, render  # noqa: E402
from trainprobe.tools.reporting.data import Group, load_report_data  # noqa: E402
from trainprobe.tools.reporting.report import write_report  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)


def _entry(rank: int, root: Path) -> None:
    for variant in ("healthy", "nan", "spike"):
        truth = train(root / f"tp_{variant}", "tp", variant, rank, monitors=("module", "weight_grad", "param"))
        if rank == BAD_RANK and truth:
            (root / f"tp_{variant}_truth.json").write_text(json.dumps(truth))
        dist.barrier()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("report_sharded")
    launch(_entry, root, timeout=400, world=WORLD)
    return root


def _diagnosis(page: str) -> tuple[str, str]:
    """The Diagnosis section's first line (its class and text)."""
    found = re.search(r'<p class="(ok|bad)" id="tp-diagnosis">([^<]*)</p>', page)
    assert found is not None
    return found[1], html.unescape(found[2])


def test_the_diagnosis_names_the_full_tensor_and_its_ranks(runs: Path, tmp_path: Path) -> None:
    page = write_report(runs / "tp_nan", tmp_path / "r.html").read_text()
    state, first = _diagnosis(page)
    assert state == "bad"
    assert re.match(rf"first anomaly: step {NAN_STEP}, full tensor, weight_grad/reduced fc1.weight: (min|max|mean|norm) = nan",
                    first), first
    assert first.endswith(f"held by ranks 0,1 (shards), NaN/inf in rank {BAD_RANK}'s shard")
    assert "tensors: full (a sharded run: shards merged, replicas counted once" in html.unescape(page)
    assert '<th>Layout</th><td><span id="tp-tensors" data-tensors="full">sharded (FSDP2 / tensor parallelism)' in page
    star = re.search(r'id="tp-timeline-first" data-step="(\d+)" data-rank="(\d+)" data-data-type="([^"]*)" '
                     r'data-target="([^"]*)" data-kind="([^"]*)"', page)
    assert star is not None and star.groups() == (str(NAN_STEP), str(BAD_RANK), "weight_grad/reduced", "fc1.weight",
                                                  "nonfinite")


def test_rank_local_report_diagnoses_the_ranks_rows(runs: Path, tmp_path: Path) -> None:
    out = tmp_path / "local.html"
    done = subprocess.run(
        [sys.executable, "-m", "trainprobe", "report", str(runs / "tp_nan"), "-o", str(out), "--rank-local"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    _, first = _diagnosis(out.read_text())
    assert first.startswith(f"first anomaly: step {NAN_STEP}, rank {BAD_RANK}, weight_grad/reduced fc1.weight")
    assert "held by" not in first


def test_a_healthy_sharded_run_reports_no_anomaly(runs: Path, tmp_path: Path) -> None:
    page = write_report(runs / "tp_healthy", tmp_path / "h.html").read_text()
    state, line = _diagnosis(page)
    assert state == "ok" and line.startswith("no anomaly: no NaN/inf and no spike") and line.endswith("in 2 rank(s)")
    assert 'id="tp-timeline-first"' not in page and "No star: the Diagnosis found no anomaly" not in page


def _cell(group: Group, rank: int, target: str, step: int, op: str) -> float:
    """The heatmap cell of ``target`` at ``step`` on ``rank`` (NaN where non-finite or missing)."""
    matrix = group.ranks[rank]
    value = float(matrix.values[group.targets.index(target), int(np.searchsorted(group.steps, step)), group.ops.index(op)])
    bad = bool(matrix.nonfinite[group.targets.index(target), int(np.searchsorted(group.steps, step)), group.ops.index(op)])
    return math.nan if bad else value


def test_the_heatmaps_hold_full_tensors_equal_to_the_gathered_gradient(runs: Path) -> None:
    truth = json.loads((runs / "tp_spike_truth.json").read_text())["full"]
    data = load_report_data(runs / "tp_spike")
    assert data.sharded and data.tensors == "full"
    group = next(g for g in data.groups if g.name == "weight_grad/reduced")
    assert _cell(group, 0, "fc1.weight", SPIKE_STEP, "norm") == pytest.approx(truth["norm"], rel=1e-5)
    assert _cell(group, 0, "fc1.weight", SPIKE_STEP, "max") == pytest.approx(truth["max"], rel=1e-5)
    assert "fc1.weight" not in _targets_with_rows(group, 1)  # merged under rank 0, the least rank holding it
    local = load_report_data(runs / "tp_spike", rank_local=True)
    assert local.tensors == "rank-local"
    shard = json.loads((runs / "tp_spike_truth.json").read_text())["local"]
    rank_group = next(g for g in local.groups if g.name == "weight_grad/reduced")
    assert _cell(rank_group, BAD_RANK, "fc1.weight", SPIKE_STEP, "norm") == pytest.approx(shard["norm"], rel=1e-5)
    assert _cell(rank_group, 0, "fc1.weight", SPIKE_STEP, "norm") < truth["norm"]
    full_norm = next(s for s in _norm_lines(data) if s.rank == 0)
    at = int(np.searchsorted(full_norm.steps, SPIKE_STEP))
    local_norm = next(s for s in _norm_lines(local) if s.rank == BAD_RANK)
    assert full_norm.values[at] > local_norm.values[at]  # the global norm of the whole model, not of a shard


def test_a_nan_in_one_shard_is_a_nan_cell_of_the_full_tensor(runs: Path, tmp_path: Path) -> None:
    data = load_report_data(runs / "tp_nan")
    group = next(g for g in data.groups if g.name == "weight_grad/reduced")
    assert math.isnan(_cell(group, 0, "fc1.weight", NAN_STEP, "max"))
    assert data.first_nonfinite is not None and data.first_nonfinite.data["step"] == NAN_STEP
    local = next(g for g in load_report_data(runs / "tp_nan", rank_local=True).groups if g.name == group.name)
    assert math.isfinite(_cell(local, 0, "fc1.weight", NAN_STEP, "max"))
    assert math.isnan(_cell(local, BAD_RANK, "fc1.weight", NAN_STEP, "max"))
    page = write_report(runs / "tp_nan", tmp_path / "local.html", rank_local=True).read_text()
    assert '<span id="tp-tensors" data-tensors="rank-local">' in page


def _targets_with_rows(group: Group, rank: int) -> set[str]:
    if rank not in group.ranks:
        return set()
    present = ~np.all(np.isnan(group.ranks[rank].values) & ~group.ranks[rank].nonfinite, axis=(1, 2))
    return {t for t, p in zip(group.targets, present.tolist()) if p}


def _norm_lines(data):  # type: ignore[no-untyped-def]
    from trainprobe.tools.reporting.figures import run_series

    return run_series(data)["global gradient norm"]


@needs_chromium
def test_the_full_tensor_page_renders_in_chromium(runs: Path, tmp_path: Path) -> None:
    page = write_report(runs / "tp_nan", tmp_path / "full.html")
    assert_page_ok(render(page, tmp_path / "chromium", height=2400))
