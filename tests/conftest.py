"""Shared helpers for the tests: writing configs and reading monitor CSVs back."""

from __future__ import annotations

import atexit
import csv
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

# The differential tests against the reference tool need its side virtualenv: `make interop` runs
# them (with TRAINPROBE_REF_PYTHON set); a plain `pytest` run leaves them out instead of failing.
collect_ignore = [] if os.environ.get("TRAINPROBE_REF_PYTHON") else ["interop"]

# The statistics' fused single pass is on by default on the CPU and compiled on a background
# thread (a few seconds per process): the suite runs without it, so that every process (the
# subprocess and multi-process tests included) computes its values with the same kernels from
# its first step and pays no compilation. tests/test_fused_stats.py covers the pass and the
# default (it removes this variable where it tests the default).
os.environ.setdefault("TRAINPROBE_FUSED_STATS", "off")
# Where the pass's C kernel is built and cached (trainprobe.backends.torch.native_stats): a folder
# of this test session, never the user's ~/.cache; tests of the cold start use one of their own.
_CACHE = tempfile.mkdtemp(prefix="trainprobe-test-cache-")
os.environ.setdefault("TRAINPROBE_CACHE_DIR", _CACHE)
atexit.register(shutil.rmtree, _CACHE, True)


def write_config(tmp_path: Path, config: dict[str, Any], name: str = "config.json") -> Path:
    """Write ``config`` as JSON under ``tmp_path`` and return its path."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / name
    path.write_text(json.dumps(config), encoding="utf-8")
    return path


def read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    """Header and rows of a CSV file."""
    with path.open(newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        rows = list(reader)
        return list(reader.fieldnames or []), rows


def rows_of(out: Path, monitor: str, rank: int = 0) -> list[dict[str, str]]:
    """Every row every ``<monitor>_step*.csv`` of ``rank`` holds, files in step order."""
    files = sorted(
        (out / f"rank_{rank}").glob(f"{monitor}_step*.csv"), key=lambda p: int(p.stem.split("step")[1].split("-")[0])
    )
    rows: list[dict[str, str]] = []
    for f in files:
        rows.extend(read_csv(f)[1])
    return rows


def stats64(t: torch.Tensor) -> dict[str, float]:
    """Float64 reference statistics of ``t``."""
    x = t.detach().to(torch.float64).flatten()
    return {
        "min": x.min().item(),
        "max": x.max().item(),
        "mean": x.mean().item(),
        "norm": x.norm().item(),
        "nans": float(torch.isnan(x).sum().item()),
    }


def assert_row_matches(row: dict[str, str], t: torch.Tensor, rel: float = 1e-6) -> None:
    """The row's statistics equal ``t``'s float64 reference to ``rel`` relative."""
    ref = stats64(t)
    for op, value in ref.items():
        if op not in row:
            continue
        got = float(row[op])
        assert got == pytest.approx(value, rel=rel, abs=1e-12), f"{row['module_name']} {op}: {got} vs {value}"


NO_CUDA = "no CUDA device (torch.cuda.is_available() is False): the cuda params run on a GPU machine (make test-gpu)"
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA))]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    """Each device the end-to-end tests run on: the CPU always, ``cuda`` when one is present
    (skipped with one line saying why otherwise). ``pytest -k cuda`` selects the GPU params."""
    return torch.device(request.param)


def sync_point(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU): before reading a timing or comparing."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def monitor_runs(tmp_path_factory: pytest.TempPathFactory):
    """Real 2-rank Monitor V1 and V2 output (see ``monitor_runs.py``), made once per session.
    Tools must only read it: copy it to ``tmp_path`` first to change it."""
    from monitor_runs import make_monitor_runs

    return make_monitor_runs(tmp_path_factory.mktemp("monitor_runs"))
