"""One vocabulary (#33 item 5), tried as a person types it, in a subprocess: every command takes
the run as ``RUN`` (the reference spellings ``-d/--data_path`` kept), writes with ``-o/--output``
(``--out``, ``--out_path``, ``--output_dirpath`` kept), selects with ``--tables`` (``--data-type``
kept), reads with ``--engine``, takes options anywhere on the line, and prints what it wrote;
the exit codes are 0 / 1 (an answer that found something) / 2 (bad input, one line)."""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("duckdb")


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainprobe", *args], capture_output=True, text=True, timeout=300, cwd=cwd
    )


def one_line_error(done: subprocess.CompletedProcess[str], command: str, text: str) -> None:
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"trainprobe {command}: error: ") and done.stderr.count("\n") == 1, done.stderr
    assert text in done.stderr and "Traceback" not in done.stderr


def wrote(stream: str) -> list[str]:
    """The paths a command said it wrote (``wrote PATH`` lines)."""
    return [line.removeprefix("wrote ") for line in stream.splitlines() if line.startswith("wrote ")]


def test_query_takes_options_before_the_sql_and_writes_with_output(monitor_runs: Any, tmp_path: Path) -> None:
    target = tmp_path / "n.csv"
    done = cli("query", str(monitor_runs.v2), "--engine", "duckdb", "--csv", "SELECT count(*) AS n FROM weight_grad",
               "--output", str(target))
    assert done.returncode == 0, done.stderr
    rows = target.read_text().splitlines()
    assert rows[0] == "n" and int(rows[1]) > 0
    assert done.stdout == f"wrote 1 row (csv) to {target}\n"
    same = cli("query", "-o", str(tmp_path / "m.csv"), str(monitor_runs.v2), "SELECT count(*) AS n FROM weight_grad")
    assert same.returncode == 0, same.stderr and (tmp_path / "m.csv").read_text() == target.read_text()


def test_diagnose_writes_with_output_or_out_and_names_the_file(monitor_runs: Any, tmp_path: Path) -> None:
    for flag in ("-o", "--output", "--out"):
        folder = tmp_path / flag.strip("-")
        done = cli("diagnose", flag, str(folder), str(monitor_runs.v2), "--engine", "duckdb")
        assert done.returncode == 1, done.stderr  # the run holds a NaN
        assert wrote(done.stderr) == [str(folder / "diagnosis.json")]
        assert json.loads((folder / "diagnosis.json").read_text())["first"] is not None
        assert "nan" in done.stdout.splitlines()[0].lower()


def test_diff_takes_tables_or_data_type_and_names_what_it_wrote(monitor_runs: Any, tmp_path: Path) -> None:
    for flag, out in (("--tables", "-o"), ("--data-type", "--out")):
        folder = tmp_path / flag.strip("-")
        done = cli("diff", str(monitor_runs.v2), flag, "param", "weight_grad", out, str(folder), str(monitor_runs.v2))
        assert done.returncode == 0, done.stderr
        assert wrote(done.stderr) == [str(folder / "diff.csv"), str(folder / "diff_summary.json")]
        summary = json.loads((folder / "diff_summary.json").read_text())
        assert summary["counts"]["diverged"] == 0 and summary["counts"]["compared"] > 0


def test_report_takes_run_output_and_engine_anywhere(monitor_runs: Any, tmp_path: Path) -> None:
    page = tmp_path / "page.html"
    done = cli("report", "-o", str(page), "--engine", "duckdb", str(monitor_runs.v2))
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{page}\n" and page.read_text().startswith("<!DOCTYPE html>")
    one_line_error(cli("report", str(monitor_runs.v2), "--engine", "spark", "-o", str(tmp_path / "s.html")), "report",
                   "--engine spark reads Parquet files and 20 selected file(s) are CSV")
    assert not (tmp_path / "s.html").exists()
    done = cli("report", str(monitor_runs.v2), "--engine", "sqlite")
    assert done.returncode == 2 and "invalid choice: 'sqlite'" in done.stderr


def test_anomaly_analyse_takes_run_or_data_path(monitor_runs: Any, tmp_path: Path) -> None:
    outputs = []
    for args in (
        [str(monitor_runs.v1), "-o", str(tmp_path / "a")],
        ["-d", str(monitor_runs.v1), "--out_path", str(tmp_path / "b")],
        ["--output", str(tmp_path / "c"), "--data_path", str(monitor_runs.v1), str(monitor_runs.v1)],
    ):
        done = cli("anomaly-analyse", *args)
        assert done.returncode == 0, done.stderr
        written = Path(done.stdout.splitlines()[-1].removeprefix("written to "))
        assert written.parent.parent == tmp_path and written.name == "anomaly_analyse.json"
        outputs.append(written.read_text())
    assert outputs[0] == outputs[1] == outputs[2] and json.loads(outputs[0])
    one_line_error(cli("anomaly-analyse"), "anomaly-analyse", "give the run folder")
    one_line_error(cli("anomaly-analyse", str(monitor_runs.v1), "-d", str(tmp_path)), "anomaly-analyse",
                   "give the run once")


def test_csv2db_takes_run_tables_and_output_anywhere(monitor_runs: Any, tmp_path: Path) -> None:
    for flag, out in (("--tables", "-o"), ("--data-type", "--output_dirpath")):
        folder = tmp_path / flag.strip("-")
        done = cli("csv2db", flag, "weight_grad", out, str(folder), str(monitor_runs.v2))
        assert done.returncode == 0, done.stderr
        database = folder / "monitor_metrics.db"
        assert done.stdout.strip().endswith(f"-> {database}")
        with sqlite3.connect(database) as db:
            types = {row[0] for row in db.execute("SELECT name FROM data_types")}
        assert types == {"weight_grad"}


def test_csv2tensorboard_names_each_event_file_and_leaves_no_staging(monitor_runs: Any, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    out = tmp_path / "tb"
    done = cli("csv2tb", str(monitor_runs.v2), "--tables", "weight_grad", "-o", str(out))
    assert done.returncode == 0, done.stderr
    named = [Path(line.rsplit(" -> ", 1)[1]) for line in done.stdout.splitlines() if " -> " in line]
    assert sorted(p.relative_to(out).parts[:2] for p in named) == [("rank0", "weight_grad"), ("rank1", "weight_grad")]
    assert all(p.is_file() for p in named)
    assert sorted(p.name for p in out.rglob("*") if p.is_dir()) == ["rank0", "rank1", "weight_grad", "weight_grad"]
    again = cli("csv2tb", str(monitor_runs.v2), "--tables", "weight_grad", "-o", str(out))
    assert again.returncode == 0, again.stderr
    assert len(list(out.rglob("events.out.tfevents*"))) == 2  # replaced, not added


def test_convert_names_each_parquet_file(monitor_runs: Any, tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    run = tmp_path / "run"
    shutil.copytree(monitor_runs.v2, run)
    done = cli("convert", str(run))
    assert done.returncode == 0, done.stderr
    parquet = sorted(run.rglob("*.parquet"))
    assert parquet and sorted(Path(p) for p in wrote(done.stdout)) == parquet
    assert done.stdout.splitlines()[-1] == f"converted {len(parquet)} CSV file(s) to Parquet under {run}"


@pytest.mark.parametrize(
    "command", ["query", "diagnose", "diff", "report", "csv2db", "csv2tb", "convert", "anomaly-analyse"]
)
def test_every_command_says_run_output_tables_and_engine_alike(command: str) -> None:
    done = cli(command, "--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    assert (re.search(r"\bRUN\b", text) is None) == (command == "diff")  # diff: BASELINE CANDIDATE, two runs
    assert ("-o" in text and "--output" in text) == (command != "convert")  # convert writes beside each CSV
    assert ("--tables" in text and "--data-type" in text) == (command in ("diff", "csv2db", "csv2tb"))
    assert ("--engine {duckdb,spark}" in text) == (command not in ("convert", "anomaly-analyse"))
