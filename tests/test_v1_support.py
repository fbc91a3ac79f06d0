"""Helpers of the Monitor V1 tests (no tests here): configs, run folders, tables."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import trainprobe.engine.log
from conftest import read_csv
from trainprobe.frontdoors.monitor_v1 import TrainerMon


def forget_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make once-per-process warnings fire again in this test (another test may have fired them)."""
    monkeypatch.setattr(trainprobe.engine.log, "_seen", set())


def make_v1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: dict[str, Any], **kwargs: Any) -> TrainerMon:
    """A TrainerMon over ``config`` with its output under ``tmp_path/out``."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "monitor_config.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    return TrainerMon(str(path), **kwargs)


def run_dir(tmp_path: Path) -> Path:
    """The one run folder of rank 0."""
    folders = [p for p in (tmp_path / "out").iterdir() if "-rank0-" in p.name]
    assert len(folders) == 1, folders
    return folders[0]


def table(folder: Path, name: str) -> list[dict[str, str]]:
    """Every row of ``<name>_<a>-<b>.csv`` files, in step order."""
    files = sorted(folder.glob(f"{name}_[0-9]*-[0-9]*.csv"), key=lambda p: int(p.stem.rsplit("_", 1)[1].split("-")[0]))
    rows: list[dict[str, str]] = []
    for f in files:
        rows.extend(read_csv(f)[1])
    return rows


def full_name(row: dict[str, str]) -> str:
    """``<vpp_stage>:<name>`` of a CSV row (the ``name`` column has no chunk prefix)."""
    return f"{row['vpp_stage']}:{row['name']}"


def by_name(rows: list[dict[str, str]], name: str) -> list[dict[str, str]]:
    """Rows of ``name``, given as ``<vpp_stage>:<name>`` (``"0:fc1.weight"``)."""
    return [r for r in rows if full_name(r) == name]
