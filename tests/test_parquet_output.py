"""``"format": "parquet"`` (an extension): Monitor V2 and V1 write the CSV layout's files as
Parquet, each complete once its window closes; the query layer gives the same answers as from
the same training written as CSV; a run killed with SIGKILL leaves only complete files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("duckdb")
pq = pytest.importorskip("pyarrow.parquet")

from conftest import write_config  # noqa: E402
from models import MLP  # noqa: E402
from trainprobe import TrainerMonitorV2  # noqa: E402
from trainprobe.engine.errors import ConfigError  # noqa: E402
from trainprobe.frontdoors.monitor_v1 import TrainerMon  # noqa: E402
from trainprobe.frontdoors.monitor_v2.config import load_monitor_v2_config  # noqa: E402
from trainprobe.tools.query.layer import connect, describe, first_nonfinite  # noqa: E402
from trainprobe.tools.runs.files import find_run_files  # noqa: E402

OPS = ["min", "max", "mean", "norm", "nans"]
STEPS = 7


def _contents(run: Path) -> dict[str, list[tuple[Any, ...]]]:
    con = connect(run)
    out = {}
    for view, cols in describe(con).items():
        names = ", ".join(f'"{c}"' for c, _ in cols if c not in ("file", "file_row"))
        rows = con.execute(f'SELECT {names} FROM "{view}"').fetchall()
        out[view] = sorted((tuple("nan" if v != v else v for v in row) for row in rows), key=repr)
    return out


def _loop(model: MLP, opt: torch.optim.Optimizer, nan_at: int | None, bad: float = float("inf")) -> None:
    for step in range(STEPS):
        torch.manual_seed(step)
        model(torch.randn(4, 6)).pow(2).mean().backward()
        if step == nan_at:
            model.fc1.weight.grad[0, 0] = bad
        opt.step()
        opt.zero_grad()


def _run_v2(out: Path, fmt: str) -> Path:
    config = {
        "output_dir": str(out),
        "format": fmt,
        "step_count_per_record": 3,
        "monitors": {name: {"enabled": True, "ops": OPS} for name in ("module", "weight_grad", "optimizer", "param")},
    }
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    mon = TrainerMonitorV2(config)
    mon.start(model=model, optimizer=opt)
    _loop(model, opt, nan_at=4, bad=float("nan"))  # pyarrow leaves NaN out of min/max statistics
    mon.stop()
    return out


def test_v2_parquet_reads_back_as_the_csv_run(tmp_path: Path) -> None:
    csv_run, parquet_run = _run_v2(tmp_path / "csv", "csv"), _run_v2(tmp_path / "parquet", "parquet")
    names = sorted(p.name for p in (parquet_run / "rank_0").iterdir())
    assert names == sorted(p.name.replace(".csv", ".parquet") for p in (csv_run / "rank_0").iterdir())
    assert "weight_grad_step6-8.parquet" in names  # the window cut short keeps its whole name, as CSV
    table = pq.read_table(parquet_run / "rank_0" / "weight_grad_step0-2.parquet")
    assert table.column_names == ["vpp_stage", "step", "module_name", "scope", "micro_step", *OPS]
    assert _contents(parquet_run) == _contents(csv_run)
    [first] = first_nonfinite(connect(parquet_run))
    assert (first["step"], first["name"], first["table"]) == (4, "fc1.weight", "weight_grad")
    nan_rows = "SELECT count(*) FROM weight_grad WHERE isnan(max) AND step = 4"  # a filter DuckDB pushes down
    assert connect(parquet_run).execute(nan_rows).fetchall() == connect(csv_run).execute(nan_rows).fetchall() != [(0,)]


def test_v1_parquet_reads_back_as_the_csv_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = {}
    for fmt in ("csv", "parquet"):
        out = tmp_path / fmt
        monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
        config = {"targets": {}, "all_xy": True, "wg_distribution": True, "mv_distribution": True,
                  "param_distribution": True, "ops": OPS, "format": fmt, "step_count_per_record": 3}
        path = tmp_path / f"{fmt}.json"
        path.write_text(json.dumps(config))
        torch.manual_seed(0)
        model = MLP()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        mon = TrainerMon(str(path), params_have_main_grad=False)
        mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
        _loop(model, opt, nan_at=4)
        mon.stop()
        runs[fmt] = out
    parquet_files = sorted(p.name for p in runs["parquet"].glob("*/*.parquet"))
    csv_files = sorted(p.name for p in runs["csv"].glob("*/*.csv"))
    assert parquet_files == [n.replace(".csv", ".parquet") for n in csv_files] and parquet_files
    assert _contents(runs["parquet"]) == _contents(runs["csv"])
    [first] = first_nonfinite(connect(runs["parquet"]))
    assert (first["step"], first["name"]) == (4, "fc1.weight")


def test_parquet_without_pyarrow_is_refused_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pyarrow" else real(name, *a))
    with pytest.raises(ConfigError, match=r"format: 'parquet' needs pyarrow; pip install 'trainprobe\[query\]'"):
        load_monitor_v2_config({"output_dir": "x", "format": "parquet"})
    with pytest.raises(ConfigError, match="format"):
        load_monitor_v2_config({"output_dir": "x", "format": "feather"})


TRAIN_FOREVER = textwrap.dedent(
    """
    import sys, torch
    from torch import nn
    from trainprobe import TrainerMonitorV2
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    opt = torch.optim.AdamW(model.parameters())
    mon = TrainerMonitorV2(sys.argv[1])
    mon.start(model=model, optimizer=opt)
    step = 0
    while True:
        model(torch.randn(8, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        step += 1
        if step == 25:
            print("ready", flush=True)
    """
)


def test_a_killed_parquet_run_leaves_only_complete_files(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cfg = write_config(
        tmp_path,
        {
            "output_dir": str(out),
            "format": "parquet",
            "step_count_per_record": 4,
            "monitors": {"module": {}, "weight_grad": {"enabled": True}, "param": {"enabled": True}},
        },
    )
    script = tmp_path / "train.py"
    script.write_text(TRAIN_FOREVER, encoding="utf-8")
    proc = subprocess.Popen([sys.executable, str(script), str(cfg)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60  # the writer thread may lag behind training on a loaded machine
        while len(list((out / "rank_0").glob("param_*.parquet"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    folder = out / "rank_0"
    complete = sorted(folder.glob("*.parquet"))
    assert {p.name.split("_step")[0] for p in complete} == {"module", "weight_grad", "param"}
    for path in complete:  # every named file is whole: pyarrow reads it, steps inside its window
        first, last = map(int, path.stem.split("_step")[1].split("-"))
        steps = pq.read_table(path).column("step").to_pylist()
        assert steps and first <= min(steps) and max(steps) <= last
    # the open windows are in memory (or, killed while being written, a hidden .partial no reader picks up)
    assert all(p.name.startswith(".") for p in folder.iterdir() if p.suffix != ".parquet")
    con = connect(out)
    windows = con.execute("SELECT count(DISTINCT file), max(step) FROM weight_grad").fetchall()[0]
    # every file read but the step files a merged window holds already (a kill between the window's
    # rename and their removal leaves both): no row is read twice
    listed = [f for f in find_run_files(out) if f.table == "weight_grad"]
    assert windows[0] == len(listed) <= len(list(folder.glob("weight_grad_*.parquet"))) and windows[1] >= 7
    doubled = con.execute(
        "SELECT count(*) FROM (SELECT step, name, scope, micro_step FROM weight_grad GROUP BY ALL HAVING count(*) > 1)"
    ).fetchone()
    assert doubled == (0,)
