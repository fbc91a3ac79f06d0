"""Never lose or mix (issue #33): ``trainprobe convert`` on live runs, concurrent converts and
faults; Monitor V1 and V2 refusing a second live run and a used folder for Parquet as for CSV;
a Parquet run killed mid-window keeping every finished step; a full disk under the Parquet
writer. Real torch training (in subprocesses where a run must be live or killed), real files,
real locks; faults from a real small tmpfs where the test runs as root."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("duckdb")
pq = pytest.importorskip("pyarrow.parquet")
pc = pytest.importorskip("pyarrow.compute")

import trainprobe.engine.log  # noqa: E402
from conftest import write_config  # noqa: E402
from trainprobe import TrainerMonitorV2  # noqa: E402
from trainprobe.cli import main  # noqa: E402
from trainprobe.engine.errors import ConfigError  # noqa: E402
from trainprobe.engine.folder_lock import FolderLock, live_writer  # noqa: E402
from trainprobe.engine.sinks.parquet_sink import merged_step_files  # noqa: E402
from trainprobe.frontdoors.monitor_v1 import TrainerMon  # noqa: E402
from trainprobe.tools.query.convert import convert_run  # noqa: E402
from trainprobe.tools.query.layer import connect, describe  # noqa: E402
from trainprobe.tools.runs.files import find_run_files  # noqa: E402

OPS = ["min", "max", "norm", "nans"]
V2_TABLES = ("module", "weight_grad", "param")

TRAIN = textwrap.dedent(
    """
    import sys, torch
    from torch import nn
    tool, cfg, pause_at, total = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if tool == "v2":
        from trainprobe import TrainerMonitorV2
        mon = TrainerMonitorV2(cfg)
        mon.start(model=model, optimizer=opt)
    else:
        from trainprobe.frontdoors.monitor_v1 import TrainerMon
        mon = TrainerMon(cfg, params_have_main_grad=False)
        mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    print("folder", mon.output_dir, flush=True)
    for step in range(total):
        torch.manual_seed(step)
        model(torch.randn(4, 6)).pow(2).mean().backward()
        if step == pause_at:  # in the middle of this step: the parent looks, then says go (or kills)
            print("paused", flush=True)
            sys.stdin.readline()
        opt.step()
        opt.zero_grad()
    mon.stop()
    print("done", flush=True)
    """
)


@pytest.fixture(autouse=True)
def _fresh_once_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trainprobe.engine.log, "_seen", set())


# -- helpers -------------------------------------------------------------------------------
def _v2_config(out: Path, fmt: str, per_record: int) -> dict[str, Any]:
    return {
        "output_dir": str(out),
        "format": fmt,
        "step_count_per_record": per_record,
        "monitors": {name: {"enabled": True, "ops": OPS} for name in V2_TABLES},
    }


def _v1_config(fmt: str, per_record: int, **more: Any) -> dict[str, Any]:
    return {"targets": {}, "wg_distribution": True, "param_distribution": True, "ops": OPS, "format": fmt,
            "step_count_per_record": per_record, **more}  # fmt: skip


class Live:
    """A training process (``TRAIN``) paused in the middle of step ``pause_at``."""

    def __init__(self, tmp: Path, tool: str, config: dict[str, Any], pause_at: int, total: int, env: dict[str, str] | None = None) -> None:
        script = tmp / "train.py"
        script.write_text(TRAIN, encoding="utf-8")
        cfg = write_config(tmp, config, f"{tool}-{time.monotonic_ns()}.json")
        self.proc = subprocess.Popen(
            [sys.executable, str(script), tool, str(cfg), str(pause_at), str(total)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, **(env or {})},
        )  # fmt: skip
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline().split()
        assert first[:1] == ["folder"], self._failure()
        self.folder = Path(first[1])
        assert self.proc.stdout.readline().strip() == "paused", self._failure()

    def _failure(self) -> str:
        self.proc.kill()
        return self.proc.communicate(timeout=30)[1]

    def go(self) -> str:
        """Let it finish; its stderr."""
        out, err = self.proc.communicate("go\n", timeout=300)
        assert self.proc.returncode == 0 and out.strip().endswith("done"), err
        return err

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.communicate(timeout=30)


def _steps_on_disk(folder: Path) -> dict[str, set[int]]:
    """table → the steps of its whole rows in ``folder`` (CSV complete lines, Parquet files)."""
    import csv

    found: dict[str, set[int]] = {}
    for f in find_run_files(folder.parent if folder.name.startswith("rank_") else folder, warn_links=False):
        if f.path.parent != folder:
            continue
        if f.format == "parquet":
            steps = pq.read_table(f.path, columns=["step"]).column("step").to_pylist()
        else:
            text = f.path.read_text(encoding="utf-8")
            whole = text[: text.rfind("\n") + 1]
            steps = [int(r["step"]) for r in csv.DictReader(whole.splitlines())]
        found.setdefault(f.table, set()).update(steps)
    return found


def _wait_for(what: Callable[[], bool], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout  # the writer thread may lag behind training on a loaded machine
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _written_up_to(folder: Path, step: int, tables: int) -> Callable[[], bool]:
    def check() -> bool:
        try:
            found = _steps_on_disk(folder)
        except Exception:  # noqa: BLE001 - a file appearing while listed: look again
            return False
        return len(found) >= tables and all(max(s) >= step for s in found.values())

    return check


def _rows_per_key(run: Path) -> dict[str, Counter[tuple[Any, ...]]]:
    """view → how often each (rank, step, name, scope, micro_step) occurs."""
    con = connect(run)
    out = {}
    for view, cols in describe(con).items():
        present = {c for c, _ in cols}
        keys = [c for c in ("rank", "step", "vpp_stage", "name", "scope", "micro_step") if c in present]
        rows = con.execute(f'SELECT {", ".join(keys)} FROM "{view}"').fetchall()
        out[view] = Counter(rows)
    return out


def _assert_each_step_once(run: Path, steps: range) -> None:
    for view, counts in _rows_per_key(run).items():
        assert set(counts.values()) == {1}, (view, [k for k, n in counts.items() if n > 1][:3])
        seen = {k[1] for k in counts}
        assert seen == set(steps), (view, sorted(seen))


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainprobe", *args], capture_output=True, text=True, timeout=timeout)


def _hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob(".*"))


@contextmanager
def _tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A small tmpfs at ``path`` (root only; skipped, saying why, elsewhere)."""
    if os.geteuid() != 0:
        pytest.skip(f"a small tmpfs needs root to mount it (running as uid {os.geteuid()})")
    path.mkdir(parents=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _fill(folder: Path) -> Path:
    """Fill the file system of ``folder`` to the last byte; the filler file."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for size in (1 << 16, 4096, 512, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError:
                continue
    finally:
        os.close(fd)
    return filler


def _train_v2(out: Path, fmt: str, per_record: int, steps: int, **start: Any) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = TrainerMonitorV2(_v2_config(out, fmt, per_record))
    mon.start(model=model, optimizer=opt, **start)
    first = mon.current_step
    for step in range(first, first + steps):
        torch.manual_seed(step)
        model(torch.randn(4, 6)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    mon.stop()
    return out


def _csv_run(tmp: Path, windows: int = 3) -> Path:
    """A finished V2 CSV run of ``windows`` windows of 4 steps."""
    return _train_v2(tmp / "run", "csv", 4, 4 * windows)


# -- 1. convert on a live run --------------------------------------------------------------
@pytest.mark.parametrize("tool", ["v2", "v1"])
def test_convert_of_a_live_run_converts_its_closed_windows_only_and_no_step_is_lost_or_doubled(
    tmp_path: Path, tool: str
) -> None:
    """A live CSV run paused at step 10 (windows 0-3 and 4-7 closed, 8-11 open): ``convert
    --remove-csv`` converts and removes the closed windows, leaves the open one with one warning
    naming it; the run then finishes (its open window keeps growing, then is cut to 8-13); a
    second convert takes the rest. Every step is read once, none lost."""
    out = tmp_path / "out"
    if tool == "v2":
        live = Live(tmp_path, "v2", _v2_config(out, "csv", 4), pause_at=10, total=14)
        tables = 3
    else:
        live = Live(tmp_path, "v1", _v1_config("csv", 4), 10, 14, env={"MONITOR_OUTPUT_DIR": str(out)})
        tables = 2
    folder = live.folder
    try:
        _wait_for(_written_up_to(folder, 9, tables))
        assert live_writer(folder) is True
        done = _cli("convert", str(out), "--to", "parquet", "--remove-csv")
    except BaseException:
        live.kill()
        raise
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and "still being written by a run that is going" in warnings[0], done.stderr
    assert "Traceback" not in done.stderr
    open_name = "_step8-11.csv" if tool == "v2" else "_8-11.csv"
    assert open_name in warnings[0]
    names = sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))
    assert all(n.endswith(".parquet") for n in names if "8-11" not in n), names
    assert all(n.endswith(".csv") for n in names if "8-11" in n), names
    assert not _hidden(folder)
    live.go()
    assert live_writer(folder) is False
    again = _cli("convert", str(out), "--to", "parquet", "--remove-csv")
    assert again.returncode == 0 and "WARNING" not in again.stderr, again.stderr
    assert all(p.suffix == ".parquet" for p in folder.iterdir() if p.name.endswith((".csv", ".parquet")))
    _assert_each_step_once(out, range(14))


def test_a_window_whose_next_window_is_still_empty_counts_as_open(tmp_path: Path) -> None:
    """A writer opens the next window's file (its header) before it has written the last rows
    of the window before: while the newest file of a table holds no row, the window before it
    is open too. Real files of a finished run, held by a real lock as a live run holds them."""
    run = _csv_run(tmp_path)
    rank = run / "rank_0"
    newest = rank / "param_step8-11.csv"
    header = newest.read_text().splitlines()[0]
    newest.write_text(header + "\n")
    lock = FolderLock(rank, "output_dir")
    try:
        convert_run(run, remove_csv=True)
    finally:
        lock.release()
    assert (rank / "param_step0-3.parquet").exists() and not (rank / "param_step0-3.csv").exists()
    assert (rank / "param_step4-7.csv").exists() and not (rank / "param_step4-7.parquet").exists()
    assert newest.exists() and not newest.with_suffix(".parquet").exists()
    assert (rank / "weight_grad_step4-7.parquet").exists() and (rank / "weight_grad_step8-11.csv").exists()


def test_convert_again_after_one_without_remove_csv_refreshes_and_removes(tmp_path: Path) -> None:
    """A CSV file with a Parquet file beside it (an earlier convert) is converted again (its
    Parquet file, which the readers prefer, never older) and ``--remove-csv`` removes it."""
    run = _csv_run(tmp_path)
    before = _rows_per_key(run)
    assert len(convert_run(run)) == 9
    assert len(list(run.glob("rank_0/*.csv"))) == 9
    assert len(convert_run(run, remove_csv=True)) == 9
    assert not list(run.glob("rank_0/*.csv")) and len(list(run.glob("rank_0/*.parquet"))) == 9
    assert _rows_per_key(run) == before


# -- 1. two converts at once, faults ---------------------------------------------------------
@pytest.mark.parametrize("remove", [True, False])
def test_two_converts_at_once_neither_fails_nor_corrupts(tmp_path: Path, remove: bool) -> None:
    run = _train_v2(tmp_path / "run", "csv", 1, 40)  # 120 files
    before = _rows_per_key(run)
    args = [sys.executable, "-m", "trainprobe", "convert", str(run), "--to", "parquet", *(["--remove-csv"] if remove else [])]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    for code, _out, err in results:
        assert "Traceback" not in err, err
        assert code == 0 or (remove and code == 2 and err.count("\n") == 1 and "no CSV data file" in err), err
    assert any(code == 0 for code, _, _ in results)
    rank = run / "rank_0"
    assert not _hidden(rank)
    assert len(list(rank.glob("*.parquet"))) == 120
    assert len(list(rank.glob("*.csv"))) == (0 if remove else 120)
    assert _rows_per_key(run) == before


def test_convert_of_a_bad_cell_is_one_line_naming_the_file_and_keeps_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _csv_run(tmp_path)
    bad = run / "rank_0" / "param_step4-7.csv"
    lines = bad.read_text().splitlines(keepends=True)
    cells = lines[2].split(",")
    cells[-1] = "abc\n"
    lines[2] = ",".join(cells)
    bad.write_text("".join(lines))
    kept = bad.read_bytes()
    assert main(["convert", str(run), "--to", "parquet", "--remove-csv"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(bad) in err and "not converted, the CSV file is kept" in err, err
    assert "Traceback" not in err
    assert bad.read_bytes() == kept and not bad.with_suffix(".parquet").exists()
    assert not _hidden(run)


def test_convert_into_a_read_only_folder_is_one_line_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _csv_run(tmp_path)
    if os.geteuid() == 0:  # root writes anywhere: a file system mounted read-only
        with _tmpfs(tmp_path / "fs", "8m") as fs:
            run = Path(shutil.copytree(source, fs / "run"))
            before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
            subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True)
            assert main(["convert", str(run), "--to", "parquet", "--remove-csv"]) == 2
            err = capsys.readouterr().err
            assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    else:
        run = Path(shutil.copytree(source, tmp_path / "ro"))
        before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
        (run / "rank_0").chmod(0o555)
        try:
            assert main(["convert", str(run), "--to", "parquet", "--remove-csv"]) == 2
            err = capsys.readouterr().err
        finally:
            (run / "rank_0").chmod(0o755)
        assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    assert err.count("\n") == 1 and "rank_0" in err and ".parquet" in err and "Traceback" not in err, err
    assert "Read-only file system" in err or "Permission denied" in err, err


def test_convert_on_a_full_disk_is_one_line_and_keeps_every_csv_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _csv_run(tmp_path)
    with _tmpfs(tmp_path / "fs", "4m") as fs:
        run = Path(shutil.copytree(source, fs / "run"))
        before = {p: p.read_bytes() for p in run.rglob("*.csv")}
        _fill(fs)
        assert main(["convert", str(run), "--to", "parquet", "--remove-csv"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "No space left on device" in err and "Traceback" not in err, err
        assert str(run / "rank_0") in err
        assert {p: p.read_bytes() for p in run.rglob("*.csv")} == before
        assert not _hidden(run) and not list(run.rglob("*.parquet"))


# -- 2. a second live run, a used folder: V2 and V1, CSV and Parquet -----------------------------
@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_a_second_live_v2_run_is_refused_and_the_first_is_left_alone(tmp_path: Path, fmt: str) -> None:
    """Another process writes ``out`` (paused inside its first window): a run started there is
    refused, even with ``overwrite=True``; once the first ended, the folder is an earlier
    run's (moved aside to ``out.1``, for Parquet as for CSV)."""
    out = tmp_path / "out"
    live = Live(tmp_path, "v2", _v2_config(out, fmt, 20), pause_at=5, total=8)
    try:
        _wait_for(_written_up_to(live.folder, 4, 3))
        before = {p.name: p.read_bytes() for p in live.folder.iterdir()}
        for how in ({}, {"overwrite": True}, {"initial_step": 3}):
            with pytest.raises(ConfigError, match=r"output_dir: .*rank_0' is being written by another run that is still going"):
                _train_v2(out, fmt, 20, 2, **how)
        assert {p.name: p.read_bytes() for p in live.folder.iterdir()} == before
    except BaseException:
        live.kill()
        raise
    live.go()
    _train_v2(out, fmt, 20, 2)
    _assert_each_step_once(tmp_path / "out.1", range(8))
    _assert_each_step_once(out, range(2))


def test_two_v2_monitors_of_one_process_on_one_folder(tmp_path: Path) -> None:
    """In one process too: the second is refused while the first runs, and may start once it stopped."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = TrainerMonitorV2(_v2_config(tmp_path, "parquet", 4))
    first.start(model=model, optimizer=opt)
    with pytest.raises(ConfigError, match="is being written by another run that is still going"):
        TrainerMonitorV2(_v2_config(tmp_path, "parquet", 4)).start(model=model, optimizer=opt, overwrite=True)
    first.stop()
    second = TrainerMonitorV2(_v2_config(tmp_path, "parquet", 4))
    second.start(model=model, optimizer=opt, overwrite=True)
    second.stop()


def test_a_folder_a_killed_parquet_run_left_is_used(tmp_path: Path) -> None:
    """Killed inside its first window (its step files, or only the hidden ``.partial`` it was
    writing): the folder is an earlier run's, moved aside as for CSV; ``overwrite`` clears it."""
    out = tmp_path / "out"
    live = Live(tmp_path, "v2", _v2_config(out, "parquet", 20), pause_at=5, total=8)
    _wait_for(_written_up_to(live.folder, 4, 3))
    live.kill()
    rank = live.folder
    assert sorted(p.name for p in rank.glob("weight_grad_*")) == [f"weight_grad_step{s}-{s}.parquet" for s in range(5)]
    killed = {p.name: p.read_bytes() for p in rank.iterdir()}
    _train_v2(out, "parquet", 20, 2)
    assert {p.name: p.read_bytes() for p in (tmp_path / "out.1" / "rank_0").iterdir()} == killed
    head = killed["weight_grad_step0-0.parquet"][:64]  # as kill -9 leaves a file being written
    for path in list(rank.iterdir()):
        if path.suffix == ".parquet":
            path.unlink()
    (rank / ".weight_grad_step0-0.parquet.partial").write_bytes(head)
    _train_v2(out, "parquet", 20, 2)
    assert (tmp_path / "out.2" / "rank_0" / ".weight_grad_step0-0.parquet.partial").read_bytes() == head
    (rank / ".weight_grad_step0-0.parquet.partial").write_bytes(head)
    _train_v2(out, "parquet", 20, 2, overwrite=True)
    assert sorted(p.name for p in rank.glob("*weight_grad*")) == ["weight_grad_step0-19.parquet"]  # its whole window


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_a_second_live_v1_run_continuing_its_folder_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    out = tmp_path / "out"
    live = Live(tmp_path, "v1", _v1_config(fmt, 20), 5, 8, env={"MONITOR_OUTPUT_DIR": str(out)})
    try:
        _wait_for(_written_up_to(live.folder, 4, 2))
        before = {p.name: p.read_bytes() for p in live.folder.iterdir()}
        stamp = live.folder.name.split("-rank")[0]
        monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        path = write_config(tmp_path, _v1_config(fmt, 20, append_output=[stamp, stamp]), "again.json")
        mon = TrainerMon(str(path), params_have_main_grad=False)
        with pytest.raises(ConfigError, match=r"MONITOR_OUTPUT_DIR: .* is being written by another run that is still going"):
            mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
        assert {p.name: p.read_bytes() for p in live.folder.iterdir()} == before
    except BaseException:
        live.kill()
        raise
    live.go()
    _assert_each_step_once(out, range(8))


def _v1_run(tmp: Path, monkeypatch: pytest.MonkeyPatch, fmt: str, cfg: dict[str, Any], steps: int, name: str) -> TrainerMon:
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp / fmt))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = TrainerMon(str(write_config(tmp, cfg, name)), params_have_main_grad=False)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    for step in range(steps):
        torch.manual_seed(step)
        model(torch.randn(4, 6)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    mon.stop()
    return mon


def test_v1_parquet_continues_an_append_output_folder_as_csv_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first run collects steps 0-1 of window 0-3; a second run continues the folder
    (``append_output``) collecting steps 2-3 of the same window: its file ``0-3`` holds
    steps 0-3, the first run's rows kept, as the CSV file does."""
    rows = {}
    for fmt in ("csv", "parquet"):
        first = _v1_run(tmp_path, monkeypatch, fmt, _v1_config(fmt, 4, collect_times=2), 2, f"{fmt}1.json")
        assert first.output_dir is not None
        stamp = first.output_dir.name.split("-rank")[0]
        cfg = _v1_config(fmt, 4, start_step=2, append_output=[stamp, stamp])
        second = _v1_run(tmp_path, monkeypatch, fmt, cfg, 4, f"{fmt}2.json")
        assert second.output_dir == first.output_dir
        assert sorted(p.name for p in first.output_dir.glob(f"grad_reduced_*.{fmt}")) == [f"grad_reduced_0-3.{fmt}"]
        rows[fmt] = _rows_per_key(tmp_path / fmt)
        assert {k[1] for k in rows[fmt]["grad_reduced"]} == {0, 1, 2, 3}
        assert not _hidden(tmp_path / fmt)
    assert rows["parquet"] == rows["csv"]


# -- 3. killed mid-window ------------------------------------------------------------------------
def test_a_parquet_run_killed_at_step_15_of_a_20_step_window_keeps_steps_0_to_14(tmp_path: Path) -> None:
    out = tmp_path / "out"
    live = Live(tmp_path, "v2", _v2_config(out, "parquet", 20), pause_at=15, total=20)
    _wait_for(_written_up_to(live.folder, 14, 3))
    live.kill()
    assert not [p for p in live.folder.iterdir() if p.name.endswith(".partial")]
    _assert_each_step_once(out, range(15))
    answer = _cli("query", str(out), "SELECT count(DISTINCT step) AS steps, min(step) AS a, max(step) AS b FROM weight_grad", "--json")
    assert answer.returncode == 0, answer.stderr
    assert json.loads(answer.stdout.splitlines()[0]) == {"steps": 15, "a": 0, "b": 14}
    # the resumed run continues at step 15; the killed window's steps stay as they are
    _train_v2(out, "parquet", 20, 5, initial_step=15)
    _assert_each_step_once(out, range(20))


def _window_of(path: Path) -> tuple[str, int, int]:
    """(table, first, last) of a V2 data file's name (``param_step3-7.parquet``)."""
    table, _, window = path.stem.rpartition("_step")
    first, last = window.split("-")
    return table, int(first), int(last)


def test_step_files_a_kill_left_beside_a_merged_window_are_dropped_not_read_twice(tmp_path: Path) -> None:
    """A run killed between a window's merge and the removal of its step files leaves both:
    the step files whose rows the merged file holds are named by ``merged_step_files`` and
    removed by a resumed start (and by convert); a step file the window's file does not hold
    is never taken for one."""
    whole = _train_v2(tmp_path / "whole", "parquet", 20, 20)
    killed = tmp_path / "killed"
    live = Live(tmp_path, "v2", _v2_config(killed, "parquet", 20), pause_at=15, total=20)
    _wait_for(_written_up_to(live.folder, 14, 3))
    live.kill()
    rank = whole / "rank_0"
    for step_file in live.folder.glob("*.parquet"):  # the same training: the same rows
        shutil.copy(step_file, rank)
    listing = [(path, *_window_of(path)) for path in rank.glob("*.parquet")]
    assert len(merged_step_files(listing)) == 3 * 15
    # every reader sees each step once while the doubled step files are still there
    assert all(f.first_step < f.last_step for f in find_run_files(whole))
    _assert_each_step_once(whole, range(20))
    # a window file that does not hold the step: its step file is kept
    cut = tmp_path / "cut" / "rank_0"
    cut.mkdir(parents=True)
    table = pq.read_table(rank / "param_step0-19.parquet")
    pq.write_table(table.filter(pc.less(table.column("step"), 10)), cut / "param_step0-19.parquet")
    for s in (3, 12):
        shutil.copy(live.folder / f"param_step{s}-{s}.parquet", cut)
    cut_files = [(path, *_window_of(path)) for path in cut.glob("*.parquet")]
    assert merged_step_files(cut_files) == [
        cut / "param_step3-3.parquet"
    ]
    assert {f.path.name for f in find_run_files(cut)} == {"param_step0-19.parquet", "param_step12-12.parquet"}
    _train_v2(whole, "parquet", 20, 3, initial_step=20)
    assert not list(rank.glob("*_step1-1.parquet"))
    _assert_each_step_once(whole, range(23))


def test_merged_windows_keep_row_groups_and_read_as_the_csv_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A window merged from its step files reads as the CSV run of the same training; with a
    small ROW_GROUP_ROWS its row groups are full ones (the last excepted)."""
    from trainprobe.engine.sinks import parquet_sink

    monkeypatch.setattr(parquet_sink, "ROW_GROUP_ROWS", 7)
    csv_run = _train_v2(tmp_path / "csv", "csv", 5, 12)
    parquet_run = _train_v2(tmp_path / "parquet", "parquet", 5, 12)
    names = sorted(p.name for p in (parquet_run / "rank_0").iterdir())
    assert names == sorted(p.name.replace(".csv", ".parquet") for p in (csv_run / "rank_0").iterdir())
    meta = pq.read_metadata(parquet_run / "rank_0" / "param_step0-4.parquet")
    sizes = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
    assert sizes[:-1] and set(sizes[:-1]) == {7} and 0 < sizes[-1] <= 7
    assert _rows_per_key(parquet_run) == _rows_per_key(csv_run)
    con_csv, con_pq = connect(csv_run), connect(parquet_run)
    query = 'SELECT step, name, scope, "min", "max", norm, nans FROM param ORDER BY ALL'
    assert con_pq.execute(query).fetchall() == con_csv.execute(query).fetchall()


# -- 4. a full disk under the Parquet writer --------------------------------------------------------
@pytest.mark.parametrize("row_group", [None, 5])
def test_a_full_disk_under_a_parquet_run_is_one_line_per_monitor_and_training_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, row_group: int | None
) -> None:
    """The disk fills at step 6 of windows of 4: one error line per monitor naming it and the
    file, no traceback; training goes on; no ``.partial`` is left (``row_group`` 5: the window's
    file was being written when the disk filled); the steps written before stay readable."""
    from trainprobe.engine.sinks import parquet_sink

    if row_group is not None:
        monkeypatch.setattr(parquet_sink, "ROW_GROUP_ROWS", row_group)
    with _tmpfs(tmp_path / "fs", "1m") as fs:
        out = fs / "out"
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        mon = TrainerMonitorV2(_v2_config(out, "parquet", 4))
        trained = 0
        with caplog.at_level(logging.ERROR, logger="trainprobe"):
            mon.start(model=model, optimizer=opt)
            for step in range(12):
                if step == 6:
                    mon._session.flush()  # steps 0-5 on disk, then the disk is full
                    _fill(fs)
                torch.manual_seed(step)
                model(torch.randn(4, 6)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                trained += 1
            mon.stop()
        assert trained == 12 and mon.current_step == 12
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        named: Counter[str] = Counter()
        for record in errors:
            text = record.getMessage()
            assert "\n" not in text and not record.exc_info, text
            assert "No space left on device" in text and str(out / "rank_0") in text and ".parquet" in text, text
            monitor = next(m for m in V2_TABLES if f"the {m} monitor is disabled" in text)
            named[monitor] += 1
        assert named and set(named.values()) == {1}, errors
        rank = out / "rank_0"
        assert not [p for p in rank.iterdir() if p.name.startswith(".")]
        for path in rank.glob("*.parquet"):
            assert pq.read_table(path).num_rows > 0
        found = _steps_on_disk(rank)
        assert all(set(range(6)) <= steps for steps in found.values()), found
