"""csv2db killed midway (SIGKILL) leaves no database that looks complete, and never damages the
conversions a database already holds (docs/csv2db.md, "A killed conversion")."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainprobe.core.monitor.csv2db import CSV2DBConfig, csv2db

HEADER = "vpp_stage,step,module_name,scope,micro_step,min,max,mean,norm,nans"
PARAMS = 100


def write_v2_run(root: Path, ranks: range, steps: int, window: int = 50) -> int:
    """The rank folders ``ranks`` of a V2 ``weight_grad`` run (the layout trainprobe writes),
    ``steps`` × :data:`PARAMS` parameters × 2 scopes each; returns their row count."""
    names = [f"layers.{i // 4}.w{i % 4}.weight" for i in range(PARAMS)]
    for rank in ranks:
        folder = root / f"rank_{rank}"
        folder.mkdir(parents=True)
        for first in range(0, steps, window):
            last = min(first + window, steps) - 1
            lines = [HEADER]
            for step in range(first, last + 1):
                base = 0.001 * (1 + step % 89) * (1 + rank)
                for scope, micro in (("unreduced", "0"), ("reduced", "")):
                    lines += [f"0,{step},{n},{scope},{micro},{-base!r},{base!r},{base / 9!r},{base * (1 + i % 7)!r},0" for i, n in enumerate(names)]
            (folder / f"weight_grad_step{first}-{last}.csv").write_text("\n".join(lines) + "\n")
    return len(ranks) * steps * PARAMS * 2


def value_rows(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        return int(conn.execute("SELECT count(*) FROM metric_values").fetchone()[0])


def kill_when(cmd: list[str], seen: Path, timeout: float = 120.0) -> None:
    """Start ``cmd`` and SIGKILL it as soon as ``seen`` exists (the conversion is storing rows).

    Fails when the process ends first: the test would then prove nothing."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    try:
        while not seen.exists():
            assert proc.poll() is None, f"csv2db ended before it could be killed: {proc.stderr.read()!r}"  # type: ignore[union-attr]
            assert time.monotonic() < deadline, f"{seen} never appeared"
            time.sleep(0.005)
        time.sleep(0.05)  # well inside the load
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()  # type: ignore[union-attr]


def csv2db_cmd(run: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "trainprobe", "csv2db", str(run), "-o", str(out)]


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_a_new_database_killed_midway_does_not_appear_and_the_next_conversion_is_whole(tmp_path: Path) -> None:
    rows = write_v2_run(tmp_path / "run", range(8), steps=300)
    out = tmp_path / "db"
    kill_when(csv2db_cmd(tmp_path / "run", out), out / ".monitor_metrics.db.partial")
    assert not (out / "monitor_metrics.db").exists()  # nothing that looks like a finished database
    result = csv2db(CSV2DBConfig(tmp_path / "run", output_dirpath=out))
    assert result.rows == rows and value_rows(result.db_path) == rows
    assert sorted(p.name for p in out.iterdir()) == ["monitor_metrics.db"]  # the partial file is gone


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_a_database_extended_and_killed_midway_keeps_what_it_held(tmp_path: Path) -> None:
    run, out = tmp_path / "run", tmp_path / "db"
    first = write_v2_run(run, range(1), steps=100)
    db = csv2db(CSV2DBConfig(run, output_dirpath=out)).db_path
    assert value_rows(db) == first
    more = write_v2_run(run, range(1, 9), steps=300)  # the run goes on: more ranks' files
    # The rollback journal exists while a transaction is writing: kill inside one.
    kill_when(csv2db_cmd(run, out), out / "monitor_metrics.db-journal")
    held = value_rows(db)  # opening rolls back the unfinished transaction; integrity checked
    assert first <= held < first + more
    result = csv2db(CSV2DBConfig(run, output_dirpath=out))
    assert value_rows(result.db_path) == first + more
