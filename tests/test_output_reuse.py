"""Re-using a Monitor V2 output folder: the earlier run moved aside unless asked; overwrite; resume at a step."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainprobe import TrainerMonitorV2
from trainprobe.engine.errors import ConfigError


def _config(out: Path, per_record: int = 1) -> dict:
    return {
        "output_dir": str(out),
        "step_count_per_record": per_record,
        "monitors": {"weight_grad": {"enabled": True}, "param": {"enabled": True}},
    }


def _train(mon: TrainerMonitorV2, steps: int, seed: int = 0, **start: object) -> None:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon.start(model=model, optimizer=opt, **start)
    for _ in range(steps):
        model(torch.randn(3, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    mon.stop()


def _rows(rank_dir: Path, table: str) -> list[dict[str, str]]:
    rows = []
    for path in sorted(rank_dir.glob(f"{table}_step*.csv")):
        with path.open(newline="", encoding="utf-8") as handle:
            rows.extend(csv.DictReader(handle))
    return rows


def _names(rank_dir: Path, table: str) -> list[str]:
    return sorted(
        (p.name for p in rank_dir.glob(f"{table}_step*.csv")), key=lambda n: int(n.split("step")[1].split("-")[0])
    )


def test_second_run_into_the_same_folder_moves_the_first_aside_untouched(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _train(TrainerMonitorV2(_config(out, 4)), 10)
    before = {p.name: p.read_bytes() for p in (out / "rank_0").iterdir()}
    _train(TrainerMonitorV2(_config(out, 4)), 3)
    assert {p.name: p.read_bytes() for p in (tmp_path / "out.1" / "rank_0").iterdir()} == before
    assert {r["step"] for r in _rows(out / "rank_0", "weight_grad")} == {"0", "1", "2"}


def test_overwrite_replaces_only_the_earlier_runs_csv_files(tmp_path: Path) -> None:
    _train(TrainerMonitorV2(_config(tmp_path, 4)), 10)
    keep = tmp_path / "rank_0" / "notes.txt"
    keep.write_text("mine")
    _train(TrainerMonitorV2(_config(tmp_path, 4)), 3, overwrite=True)
    rank_dir = tmp_path / "rank_0"
    assert _names(rank_dir, "weight_grad") == ["weight_grad_step0-3.csv"]
    assert {r["step"] for r in _rows(rank_dir, "param")} == {"0", "1", "2"}
    assert keep.read_text() == "mine"


def test_overwrite_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _train(TrainerMonitorV2(_config(tmp_path)), 5)
    monkeypatch.setenv("TRAINPROBE_OVERWRITE", "1")
    _train(TrainerMonitorV2(_config(tmp_path)), 2)
    assert _names(tmp_path / "rank_0", "weight_grad") == ["weight_grad_step0-0.csv", "weight_grad_step1-1.csv"]


def test_resume_keeps_earlier_steps_and_continues_the_files(tmp_path: Path) -> None:
    """A run stopped after step 6 (rows up to 6 in a 0-9 window) resumes from a step-4 checkpoint:
    rows 0-3 of the first run stay (its file rewritten as ``step0-3``), steps 4-8 come from the
    resumed run (its window ``step4-9``), each step once."""
    first = tmp_path / "run"
    _train(TrainerMonitorV2(_config(first, 10)), 7, seed=0)
    assert _names(first / "rank_0", "weight_grad") == ["weight_grad_step0-9.csv"]
    _train(TrainerMonitorV2(_config(first, 10)), 5, seed=1, initial_step=4)
    twin = tmp_path / "twin"
    _train(TrainerMonitorV2(_config(twin, 10)), 5, seed=1, initial_step=4)

    rank_dir = first / "rank_0"
    assert _names(rank_dir, "weight_grad") == ["weight_grad_step0-3.csv", "weight_grad_step4-9.csv"]
    steps = [
        int(r["step"])
        for r in _rows(rank_dir, "weight_grad")
        if r["module_name"] == "0.weight" and r["scope"] == "unreduced"
    ]
    assert steps == list(range(9))
    resumed = [r for r in _rows(rank_dir, "param") if int(r["step"]) >= 4]
    assert resumed == _rows(twin / "rank_0", "param")


def test_resume_at_a_step_after_everything_written_keeps_it_all(tmp_path: Path) -> None:
    _train(TrainerMonitorV2(_config(tmp_path, 4)), 6)
    before = _rows(tmp_path / "rank_0", "weight_grad")
    _train(TrainerMonitorV2(_config(tmp_path, 4)), 2, initial_step=6)
    after = _rows(tmp_path / "rank_0", "weight_grad")
    assert after[: len(before)] == before
    assert sorted({int(r["step"]) for r in after}) == list(range(8))


def test_the_same_monitor_started_again_continues_without_asking(tmp_path: Path) -> None:
    mon = TrainerMonitorV2(_config(tmp_path))
    _train(mon, 2)
    _train(mon, 2)
    assert sorted(
        int(r["step"])
        for r in _rows(tmp_path / "rank_0", "weight_grad")
        if r["module_name"] == "0.bias" and r["scope"] == "unreduced"
    ) == [
        0,
        1,
        2,
        3,
    ]


def test_start_arguments_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"start\(overwrite=\.\.\.\): must be True or False"):
        _train(TrainerMonitorV2(_config(tmp_path)), 1, overwrite="yes")
    with pytest.raises(ConfigError, match=r"start\(initial_step=\.\.\.\): must be an integer >= 0"):
        _train(TrainerMonitorV2(_config(tmp_path)), 1, initial_step=-1)


def _demo(out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "trainprobe", "demo", "--out", str(out), "--steps", "2", *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def test_demo_twice_keeps_the_first_and_overwrite_replaces(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    assert _demo(out).returncode == 0
    again = _demo(out)
    assert again.returncode == 0, again.stderr
    assert f"{out}/rank_0 holds an earlier run; it was moved to {out}.1/rank_0" in again.stderr
    assert "Traceback" not in again.stderr
    assert list((tmp_path / "demo.1" / "rank_0").glob("weight_grad_step0-*.csv"))
    replaced = _demo(out, "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    assert "weight_grad_step0-" in replaced.stdout
    assert not (tmp_path / "demo.2").exists()


def test_resumed_false_is_a_new_run_even_when_counting_from_one(tmp_path: Path) -> None:
    """The trainer callbacks number steps from 1: a fresh trainer run (resumed=False) into a
    used folder is a new run (the earlier one moved aside), not taken as a resume at step 1."""
    out = tmp_path / "out"
    _train(TrainerMonitorV2(_config(out)), 3, initial_step=1, resumed=False)
    _train(TrainerMonitorV2(_config(out)), 2, initial_step=1, resumed=False)
    assert sorted({int(r["step"]) for r in _rows(tmp_path / "out.1" / "rank_0", "weight_grad")}) == [1, 2, 3]
    _train(TrainerMonitorV2(_config(out)), 1, initial_step=3, resumed=True)
    steps = sorted({int(r["step"]) for r in _rows(out / "rank_0", "weight_grad")})
    assert steps == [1, 2, 3]


# --------------------------------------------------------------------------- Parquet output


def _parquet_config(out: Path, per_record: int = 1) -> dict:
    return {**_config(out, per_record), "format": "parquet"}


def _parquet_names(rank_dir: Path, table: str) -> list[str]:
    return sorted(
        (p.name for p in rank_dir.glob(f"{table}_step*.parquet")),
        key=lambda n: int(n.split("step")[1].split("-")[0]),
    )


def _parquet_rows(rank_dir: Path, table: str) -> list[dict[str, object]]:
    pq = pytest.importorskip("pyarrow.parquet")
    rows: list[dict[str, object]] = []
    for name in _parquet_names(rank_dir, table):
        rows.extend(pq.read_table(str(rank_dir / name)).to_pylist())
    return rows


def test_a_second_parquet_run_into_the_same_folder_moves_the_first_aside(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    out = tmp_path / "out"
    _train(TrainerMonitorV2(_parquet_config(out, 4)), 10)
    before = {p.name: p.read_bytes() for p in (out / "rank_0").iterdir()}
    assert any(name.endswith(".parquet") for name in before)
    _train(TrainerMonitorV2(_parquet_config(out, 4)), 3)
    assert {p.name: p.read_bytes() for p in (tmp_path / "out.1" / "rank_0").iterdir()} == before
    assert {r["step"] for r in _parquet_rows(out / "rank_0", "weight_grad")} == {0, 1, 2}


def test_overwrite_replaces_an_earlier_parquet_run(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    _train(TrainerMonitorV2(_parquet_config(tmp_path, 4)), 10)
    _train(TrainerMonitorV2(_parquet_config(tmp_path, 4)), 3, overwrite=True)
    rank_dir = tmp_path / "rank_0"
    assert _parquet_names(rank_dir, "weight_grad") == ["weight_grad_step0-3.parquet"]
    assert {r["step"] for r in _parquet_rows(rank_dir, "param")} == {0, 1, 2}


def test_overwrite_and_resume_remove_the_open_windows_a_killed_parquet_run_left(tmp_path: Path) -> None:
    """A run killed mid-window leaves ``.<window>.partial`` (never whole, no reader picks it up):
    overwriting or resuming removes those of the monitor tables, and only those."""
    pytest.importorskip("pyarrow")
    rank_dir = tmp_path / "rank_0"
    for how in ({"overwrite": True}, {"initial_step": 8}):
        _train(TrainerMonitorV2(_parquet_config(tmp_path, 4)), 8, overwrite=True)
        whole = rank_dir / "weight_grad_step4-7.parquet"
        left = [rank_dir / ".weight_grad_step8-11.parquet.partial", rank_dir / ".param_step8-11.parquet.partial"]
        for path in left:  # as kill -9 leaves it: the head of a Parquet file, no footer
            path.write_bytes(whole.read_bytes()[:64])
        other = rank_dir / ".notes.partial"
        other.write_text("not ours")
        _train(TrainerMonitorV2(_parquet_config(tmp_path, 4)), 3, **how)
        assert not any(p.exists() for p in left), how
        assert other.read_text() == "not ours"


def test_resume_continues_a_parquet_run_and_its_summaries_stay_true(tmp_path: Path) -> None:
    """As for CSV: a Parquet run killed after step 6 resumes at step 4; rows 0-3 stay (the file
    rewritten as ``step0-3``, its footer summary true of what is left), each step once, and the
    query layer reads the folder as one run."""
    pytest.importorskip("pyarrow")
    from trainprobe.engine.sinks.parquet_summary import read_summary

    first = tmp_path / "run"
    _train(TrainerMonitorV2(_parquet_config(first, 10)), 7, seed=0)
    rank_dir = first / "rank_0"
    assert _parquet_names(rank_dir, "weight_grad") == ["weight_grad_step0-9.parquet"]
    _train(TrainerMonitorV2(_parquet_config(first, 10)), 5, seed=1, initial_step=4)
    twin = tmp_path / "twin"
    _train(TrainerMonitorV2(_parquet_config(twin, 10)), 5, seed=1, initial_step=4)

    assert _parquet_names(rank_dir, "weight_grad") == ["weight_grad_step0-3.parquet", "weight_grad_step4-9.parquet"]
    steps = [
        r["step"]
        for r in _parquet_rows(rank_dir, "weight_grad")
        if r["module_name"] == "0.weight" and r["scope"] == "unreduced"
    ]
    assert steps == list(range(9))
    resumed = [r for r in _parquet_rows(rank_dir, "param") if int(r["step"]) >= 4]  # type: ignore[call-overload]
    assert resumed == _parquet_rows(twin / "rank_0", "param")
    cut = read_summary(rank_dir / "weight_grad_step0-3.parquet")
    assert cut is not None and cut.rows == len([r for r in _parquet_rows(rank_dir, "weight_grad") if r["step"] < 4])
    assert not list(rank_dir.glob(".*partial"))
