"""The last file of a run that ends inside a window is named by its whole window, as the
reference names it (V1 ``<table>_<a>-<b>``: ``a = step // n * n``, ``b = a + n - 1``; V2
``<monitor>_step<a>-<b>`` aligned at ``start_step``), for CSV and Parquet alike: five steps (0-4)
with two steps a window end in ``*_4-5``, not ``*_4-4``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import read_csv, write_config
from models import MLP
from test_v1_support import make_v1, run_dir
from trainprobe import TrainerMonitorV2
from trainprobe.engine.records import RowBuffer, RowKey
from trainprobe.engine.schedule import Schedule
from trainprobe.engine.sinks.csv_sink import CsvSink, TableLayout


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(4, 6)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


def _pq_steps(path: Path) -> list[int]:
    import pyarrow.parquet as pq

    return sorted({int(s) for s in pq.read_table(path).column("step").to_pylist()})


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_v1_last_window_keeps_its_whole_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    if fmt == "parquet":
        pytest.importorskip("pyarrow")
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = make_v1(tmp_path, monkeypatch, {"wg_distribution": True, "step_count_per_record": 2, "format": fmt})
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    _train(model, opt, 5)
    mon.stop()
    folder = run_dir(tmp_path)
    names = sorted(p.name for p in folder.glob(f"grad_reduced_*.{fmt}"))
    assert names == [f"grad_reduced_0-1.{fmt}", f"grad_reduced_2-3.{fmt}", f"grad_reduced_4-5.{fmt}"]
    last = folder / f"grad_reduced_4-5.{fmt}"
    steps = _pq_steps(last) if fmt == "parquet" else sorted({int(r["step"]) for r in read_csv(last)[1]})
    assert steps == [4]


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_v2_last_window_keeps_its_whole_name(tmp_path: Path, fmt: str) -> None:
    if fmt == "parquet":
        pytest.importorskip("pyarrow")
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = tmp_path / "out"
    cfg = {
        "output_dir": str(out),
        "format": fmt,
        "start_step": 1,
        "step_count_per_record": 2,
        "monitors": {"weight_grad": {"enabled": True}},
    }
    mon = TrainerMonitorV2(write_config(tmp_path, cfg))
    mon.start(model=model, optimizer=opt)
    _train(model, opt, 6)  # steps 0-5, collected from 1: windows 1-2, 3-4, 5-6
    mon.stop()
    names = sorted(p.name for p in (out / "rank_0").glob(f"weight_grad_step*.{fmt}"))
    assert names == [f"weight_grad_step1-2.{fmt}", f"weight_grad_step3-4.{fmt}", f"weight_grad_step5-6.{fmt}"]
    last = out / "rank_0" / f"weight_grad_step5-6.{fmt}"
    steps = _pq_steps(last) if fmt == "parquet" else sorted({int(r["step"]) for r in read_csv(last)[1]})
    assert steps == [5]


def test_csv_sink_close_at_a_step_renames_nothing(tmp_path: Path) -> None:
    """``close(reached=...)`` inside a window leaves the window's name as it was opened."""
    sink = CsvSink(tmp_path, Schedule(step_count_per_record=10), {"m": TableLayout(False, ("max",))})
    for step in range(3):
        buf = RowBuffer()
        buf.add(RowKey(0, "w", "s"), [float(step)])
        sink.write(buf.drain("m", step))
    sink.close(reached=2)
    assert [p.name for p in tmp_path.iterdir()] == ["m_step0-9.csv"]
    assert [r["max"] for r in read_csv(tmp_path / "m_step0-9.csv")[1]] == ["0.0", "1.0", "2.0"]
