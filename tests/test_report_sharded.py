"""``trainprobe report`` on a sharded run (issue #32, "report answers in full tensors"): TP=2 on
two gloo ranks with a NaN injected into rank 1's shard of ``fc1.weight``'s gradient. The page's
Diagnosis names the step, the full tensor, the ranks that held it and whose shard held the NaN;
its summary says the run is sharded; ``--rank-local`` diagnoses rank 1's own row; a healthy
sharded run's Diagnosis is clean."""

from __future__ import annotations

import html
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

pytest.importorskip("duckdb")
pytest.importorskip("plotly")

from test_diagnose_sharded import BAD_RANK, NAN_STEP, WORLD, train  # noqa: E402
from test_distributed_v2 import launch  # noqa: E402
from trainprobe.tools.report import write_report  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)


def _entry(rank: int, root: Path) -> None:
    for variant in ("healthy", "nan"):
        train(root / f"tp_{variant}", "tp", variant, rank, monitors=("module", "weight_grad", "param"))
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
    assert first.startswith(f"first anomaly: step {NAN_STEP}, full tensor, weight_grad/reduced fc1.weight: max = nan")
    assert first.endswith(f"held by ranks 0,1 (shards), NaN/inf in rank {BAD_RANK}'s shard")
    assert "tensors: full (a sharded run: shards merged, replicas counted once" in html.unescape(page)
    assert "<th>Layout</th><td>sharded (FSDP2 / tensor parallelism)" in page


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
    assert _diagnosis(page) == ("ok", "no anomaly: no NaN/inf and no spike above 10x in 2 rank(s)")
