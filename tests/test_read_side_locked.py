"""The read side locked to the run folder (issue #33, "Locked to the run"): names from files
never become SQL, paths are never patterns, and the connections the tools open read the run's
files only and write nothing, user SQL included.

Every case runs the real command line in a subprocess (exit code, stderr, files on disk) over
real Monitor V2/V1 output (``monitor_runs``), changed by hand the way an attacker with write
access to a shared run folder would change it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("duckdb")
pytest.importorskip("pyarrow")

from trainprobe.engine.errors import ConfigError  # noqa: E402
from trainprobe.tools.query.layer import connect, first_nonfinite  # noqa: E402
from trainprobe.tools.sql.names import check_columns, file_list, glob_literal, hadoop_glob_literal  # noqa: E402


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-m", "trainprobe", *args], capture_output=True, text=True, timeout=300, env=env, cwd=cwd
    )


def _one_line_refusal(done: subprocess.CompletedProcess[str], *words: str) -> None:
    assert done.returncode == 2, (done.returncode, done.stdout[-500:], done.stderr[-2000:])
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines, "no message"
    for word in words:
        assert word in done.stderr, done.stderr


def _copy(run: Path, target: Path) -> Path:
    shutil.copytree(run, target)
    return target


def _first_csv(run: Path, table: str = "weight_grad") -> Path:
    return sorted(run.glob(f"rank_0/{table}_step*.csv"))[0]


def _replace_header(path: Path, old: str, new: str) -> None:
    head, _, rest = path.read_text(encoding="utf-8").partition("\n")
    assert old in head.split(","), head
    path.write_text(",".join(new if h == old else h for h in head.split(",")) + "\n" + rest, encoding="utf-8")


# --- names from files -----------------------------------------------------------------------

PLANTED = "planted_by_header.csv"


@pytest.mark.parametrize(
    "command",
    [
        ["query", "{run}", "SELECT count(*) FROM weight_grad"],
        ["query", "{run}", "--first-nonfinite"],
        ["diagnose", "{run}"],
        ["report", "{run}", "-o", "{out}/report.html"],
        ["diff", "{run}", "{run}"],
    ],
    ids=["query", "first-nonfinite", "diagnose", "report", "diff"],
)
def test_a_header_holding_sql_is_refused_and_runs_nothing(
    monitor_runs: Any, tmp_path: Path, command: list[str]
) -> None:
    run = _copy(monitor_runs.v2, tmp_path / "run")
    target = tmp_path / PLANTED
    payload = f"norm\") TO '{target}' (HEADER); COPY (SELECT 1 AS x) TO '{target}'; SELECT (\"norm"
    _replace_header(_first_csv(run), "norm", payload)
    done = _cli(*(part.format(run=run, out=tmp_path) for part in command))
    _one_line_refusal(done, "is not a monitor column name")
    assert not target.exists()


@pytest.mark.parametrize("name", ["rank", "file", "file_row", "name", "x_phase", "ordinality"])
def test_an_op_taking_a_view_column_name_is_one_line(monitor_runs: Any, tmp_path: Path, name: str) -> None:
    run = _copy(monitor_runs.v2, tmp_path / "run")
    _replace_header(_first_csv(run), "mean", name)
    done = _cli("query", str(run), "SELECT count(*) FROM weight_grad")
    _one_line_refusal(done, f"column '{name}' takes the name of a column the query layer defines")


def test_a_parquet_schema_holding_sql_is_refused(monitor_runs: Any, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    run = _copy(monitor_runs.v2, tmp_path / "run")
    source = _first_csv(run)
    table = pa.csv.read_csv(source) if hasattr(pa, "csv") else None
    if table is None:
        import pyarrow.csv as pacsv

        table = pacsv.read_csv(source)
    table = table.rename_columns(['norm"; DROP VIEW weight_grad; --' if c == "norm" else c for c in table.column_names])
    pq.write_table(table, source.with_suffix(".parquet"))
    source.unlink()
    done = _cli("diagnose", str(run))
    _one_line_refusal(done, "is not a monitor column name", source.with_suffix(".parquet").name)


def test_v1_keeps_its_name_column_and_plain_ops_pass() -> None:
    check_columns(["vpp_stage", "name", "step", "micro_step", "min", "norm", "shape", "dtype"], "f.csv",
                  allowed=("vpp_stage", "name", "step", "micro_step"))
    with pytest.raises(ConfigError, match=r"f.csv: column 'name' takes the name"):
        check_columns(["vpp_stage", "step", "module_name", "scope", "name"], "f.csv",
                      allowed=("vpp_stage", "step", "module_name", "scope"))
    with pytest.raises(ConfigError, match=r"column '\\x1b\[2Jnorm' is not a monitor column name"):
        check_columns(["\x1b[2Jnorm"], "f.csv")


# --- paths are never patterns ---------------------------------------------------------------

def test_glob_escaping_reads_each_path_as_itself() -> None:
    assert glob_literal("/r/run[1]/a*b?.csv") == "/r/run[[]1]/a[*]b[?].csv"
    assert file_list(["/r/it's[x]"]) == "['/r/it''s[[]x]']"
    assert hadoop_glob_literal("/r/run[1]/{a,b}*?\\") == "/r/run\\[1\\]/\\{a,b\\}\\*\\?\\\\"


@pytest.mark.parametrize("folder", ["run[1]", "run*", "run?", "it's [a] {b}"])
def test_a_run_folder_with_glob_characters_reads_its_own_files(
    monitor_runs: Any, tmp_path: Path, folder: str
) -> None:
    mine = _copy(monitor_runs.v2, tmp_path / folder)
    other = _copy(monitor_runs.v2, tmp_path / "run1")  # what run[1] and run? match as patterns
    for path in other.rglob("*.csv"):  # other's rows differ: a mix would show
        head, _, rest = path.read_text(encoding="utf-8").partition("\n")
        path.write_text(head + "\n" + rest + rest, encoding="utf-8")
    con = connect(mine)
    [(rows, files)] = con.execute("SELECT count(*), count(DISTINCT file) FROM weight_grad").fetchall()
    expected = sum(len(p.read_text(encoding="utf-8").splitlines()) - 1 for p in mine.rglob("weight_grad_*.csv"))
    assert rows == expected
    assert {r[0] for r in con.execute("SELECT DISTINCT file FROM weight_grad").fetchall()} == {
        str(p) for p in mine.rglob("weight_grad_*.csv")
    }
    assert files == len(list(mine.rglob("weight_grad_*.csv")))
    done = _cli("query", str(mine), "SELECT count(*) AS n FROM weight_grad", "--csv")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["n", str(expected)]


# --- user SQL stays inside the run ----------------------------------------------------------

@pytest.mark.parametrize(
    "sql",
    [
        "COPY weight_grad TO '{own}'",
        "COPY (SELECT 1) TO '{out}/leak.csv'",
        "EXPORT DATABASE '{out}/exported'",
        "ATTACH '{out}/x.db' AS x",
        "SELECT * FROM read_csv('/etc/passwd')",
        "SELECT * FROM read_text('/etc/hostname')",
        "SELECT * FROM glob('/etc/*')",
        "INSTALL httpfs",
        "LOAD httpfs",
        "SET enable_external_access = true",
        "SET allowed_directories = ['/']",
        "SET lock_configuration = false",
    ],
)
def test_user_sql_cannot_read_or_write_outside_the_run(monitor_runs: Any, tmp_path: Path, sql: str) -> None:
    run = _copy(monitor_runs.v2, tmp_path / "run")
    own = _first_csv(run)
    before = own.read_bytes()
    listing = sorted(p.name for p in tmp_path.iterdir())
    done = _cli("query", str(run), sql.format(own=own, out=tmp_path))
    _one_line_refusal(done)
    assert own.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == listing
    assert "root:" not in done.stdout + done.stderr


def test_connect_is_locked_by_default_and_open_when_asked(monitor_runs: Any, tmp_path: Path) -> None:
    import duckdb

    con = connect(monitor_runs.v2)
    assert con.execute("SELECT count(*) FROM weight_grad").fetchall()[0][0] > 0
    with pytest.raises(duckdb.Error, match="disabled by configuration"):
        con.execute(f"COPY (SELECT 1) TO '{tmp_path / 'x.csv'}'")
    with pytest.raises(duckdb.Error, match="locked"):
        con.execute("SET enable_external_access = true")
    open_con = connect(monitor_runs.v2, locked=False)
    open_con.execute(f"COPY (SELECT count(*) FROM weight_grad) TO '{tmp_path / 'x.csv'}' (HEADER false)")
    assert (tmp_path / "x.csv").read_text().strip().isdigit()


# --- a torn file on a locked connection -----------------------------------------------------

def test_a_torn_file_is_read_in_memory_on_a_locked_connection(monitor_runs: Any, tmp_path: Path) -> None:
    run = _copy(monitor_runs.v2, tmp_path / "run")
    path = _first_csv(run)
    text = path.read_text(encoding="utf-8")
    whole = len(text.splitlines()) - 1
    path.write_text(text + text.splitlines()[1][:7], encoding="utf-8")  # a torn last record
    before = set(os.listdir(tempfile.gettempdir()))
    con = connect(run)
    [(rows,)] = con.execute(f"SELECT count(*) FROM weight_grad WHERE file = '{path}'").fetchall()
    assert rows == whole
    assert not {n for n in set(os.listdir(tempfile.gettempdir())) - before if n.startswith("trainprobe-torn")}
    first_nonfinite(run)  # its own locked connection, narrowed to one step: reads the torn file again
    done = _cli("diagnose", str(run))
    assert done.returncode in (0, 1) and "Traceback" not in done.stderr, done.stderr


# --- Spark ------------------------------------------------------------------------------------

def test_spark_user_sql_is_one_read_only_query_over_the_views() -> None:
    pytest.importorskip("sqlglot")
    from trainprobe.tools.engines.spark import read_only

    views = ["weight_grad", "module"]
    assert read_only("WITH a AS (SELECT * FROM weight_grad) SELECT * FROM a JOIN module USING (step)", views)
    for sql, why in [
        ("INSERT OVERWRITE DIRECTORY '/tmp/x' SELECT * FROM weight_grad", "one read-only query"),
        ("SELECT 1; SELECT 2", "one read-only query"),
        ("SELECT * FROM parquet.`/etc/secret`", "is not a view of this run"),
        ("SELECT * FROM other_table", "is not a view of this run"),
        ("CREATE TABLE t AS SELECT 1", "one read-only query"),
    ]:
        with pytest.raises(ConfigError, match=why):
            read_only(sql, views)


# --- control characters in printed names ----------------------------------------------------

def _plant_name(path: Path, name: str) -> None:
    """The first data row of ``path`` renamed to ``name`` with a NaN norm (what diagnose names)."""
    import csv

    with path.open(newline="", encoding="utf-8") as handle:
        rows = list(csv.reader(handle))
    header = rows[0]
    rows[1][header.index("module_name")] = name
    rows[1][header.index("norm")] = "nan"
    with path.open("w", newline="", encoding="utf-8") as handle:  # as the monitors quote: "\r" too
        csv.writer(handle, lineterminator="\n").writerow(header)
        csv.writer(handle, lineterminator="\n", quoting=csv.QUOTE_NONNUMERIC).writerow(rows[1])
        csv.writer(handle, lineterminator="\n").writerows(rows[2:])


@pytest.mark.parametrize("command", [["diagnose", "{run}"], ["diff", "{base}", "{run}"],
                                     ["query", "{run}", "--first-nonfinite"]])
def test_a_crafted_name_cannot_rewrite_the_terminal(monitor_runs: Any, tmp_path: Path, command: list[str]) -> None:
    base = _copy(monitor_runs.v2, tmp_path / "base")
    run = _copy(monitor_runs.v2, tmp_path / "run")
    _plant_name(_first_csv(run), "evil\x1b[2K\rno anomaly\x07\u2028")
    done = _cli(*(part.format(run=run, base=base) for part in command))
    assert done.returncode == {"diagnose": 1, "diff": 0, "query": 0}[command[0]], done.stderr  # diff: a row only in one run
    assert "Traceback" not in done.stderr
    for char in "\x1b\r\x07\u2028":
        assert char not in done.stdout + done.stderr
    assert "evil\\x1b[2K\\rno anomaly\\x07\\u2028" in done.stdout


# --- no traceback ---------------------------------------------------------------------------

def test_diff_of_a_truncated_parquet_and_a_huge_offset_are_one_line(monitor_runs: Any, tmp_path: Path) -> None:
    from trainprobe.tools.query.convert import convert_run

    base = _copy(monitor_runs.v2, tmp_path / "base")
    cut = _copy(monitor_runs.v2, tmp_path / "cut")
    convert_run(cut, remove_csv=True)
    victim = sorted(cut.glob("rank_0/weight_grad_*.parquet"))[0]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    done = _cli("diff", str(base), str(cut))
    _one_line_refusal(done, "the data could not be read", victim.name)
    assert "LINE 1" not in done.stderr  # trainprobe's own SQL is not quoted at the user
    for offset in ("9223372036854775807", "-9223372036854775808"):
        _one_line_refusal(_cli("diff", str(base), str(base), "--offset", offset), "--offset: at most")


def test_an_unbalanced_quote_mid_file_is_said_as_such(monitor_runs: Any, tmp_path: Path, caplog: Any) -> None:
    """Not "skipped 1 torn row": the lines an unbalanced quote cut off are counted and named."""
    import logging

    run = _copy(monitor_runs.v2, tmp_path / "run")
    path = _first_csv(run)
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    lines[3] = lines[3].replace(",", ',"', 1)  # line 4 opens a quote that never closes
    path.write_text("".join(lines).rstrip("\n"), encoding="utf-8")  # no final line break: read as torn
    with caplog.at_level(logging.WARNING, logger="trainprobe"):
        [(rows,)] = connect(run).execute(f"SELECT count(*) FROM weight_grad WHERE file = '{path}'").fetchall()
    assert rows == 2  # lines 2 and 3
    assert f"an unbalanced quote on or after line 4 cut the file: {len(lines) - 3} line(s)" in caplog.text


# --- files re-checked when opened (docs/security.md) -----------------------------------------

def _swap_for_outside_link(run: Path, outside: Path) -> Path:
    """Make ``outside`` (beside the run) a copy of rank 0's first weight_grad file whose first row
    has a NaN norm at its first step (rows the run does not have), then replace the run's file by
    a link to it: what an attacker with write access does between discovery and the read."""
    import csv

    victim = _first_csv(run)
    with victim.open(newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    rows[1][rows[0].index("norm")] = "nan"
    outside.parent.mkdir(parents=True, exist_ok=True)
    with outside.open("w", newline="", encoding="utf-8") as f:
        csv.writer(f, lineterminator="\n").writerows(rows)
    victim.unlink()
    victim.symlink_to(outside)
    return victim


def test_a_file_swapped_for_an_outside_link_after_discovery_is_not_read(monitor_runs: Any, tmp_path: Path) -> None:
    from monitor_runs import NAN_STEP
    from trainprobe.tools.diagnosis.answer import diagnose
    from trainprobe.tools.engines.duckdb_engine import DuckEngine
    from trainprobe.tools.runs.files import find_run_files

    run = _copy(monitor_runs.v2, tmp_path / "run")
    files = find_run_files(run)
    engine = DuckEngine(run, files)  # views made before the swap: seal() checks again before any query
    victim = _swap_for_outside_link(run, tmp_path / "outside" / "planted.csv")
    outside = str(tmp_path / "outside")
    with pytest.raises(ConfigError, match=r"now a link to a file outside .*; not read") as caught:
        connect(run, files=files)
    assert str(victim) in str(caught.value) and "\n" not in str(caught.value)
    for call in (lambda: first_nonfinite(run, files=files), lambda: diagnose(run, files=files), engine.seal):
        with pytest.raises(ConfigError, match="now a link to a file outside"):
            call()
    engine.release()
    # found afresh, the link is skipped at discovery: the answer holds none of the outside file's rows
    [first] = first_nonfinite(run)
    assert first["step"] == NAN_STEP and outside not in str(first["file"])
    assert outside not in str(connect(run).execute("SELECT DISTINCT file FROM weight_grad").fetchall())


def test_a_file_replaced_after_discovery_is_refused_by_name(monitor_runs: Any, tmp_path: Path) -> None:
    from trainprobe.tools.runs.files import find_run_files

    run = _copy(monitor_runs.v2, tmp_path / "run")
    files = find_run_files(run)
    victim = _first_csv(run)
    twin = victim.with_name("twin.tmp")
    twin.write_bytes(victim.read_bytes())  # made while the victim exists: another inode
    os.replace(twin, victim)  # same content, another file
    with pytest.raises(ConfigError, match=f"{victim.name}: replaced by another file since the run's files were listed"):
        connect(run, files=files)
    victim.unlink()
    with pytest.raises(ConfigError, match=f"{victim.name}: gone since the run's files were listed"):
        connect(run, files=files)


def test_the_cli_refuses_a_link_swapped_in_after_discovery(
    monitor_runs: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``trainprobe diagnose`` (in this process, so that the swap can happen right after it lists
    the run): exit 2, one line naming the file, no traceback, nothing of the outside file printed."""
    import trainprobe.tools.runs.files as run_files
    from trainprobe.cli import main

    run = _copy(monitor_runs.v2, tmp_path / "run")
    listed = run_files.find_run_files
    swapped: list[Path] = []

    def list_then_swap(*args: Any, **kwargs: Any) -> Any:
        found = listed(*args, **kwargs)
        if not swapped:
            swapped.append(_swap_for_outside_link(run, tmp_path / "outside" / "planted.csv"))
        return found

    monkeypatch.setattr(run_files, "find_run_files", list_then_swap)
    assert main(["diagnose", str(run)]) == 2
    out, err = capsys.readouterr()
    assert swapped and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert str(swapped[0]) in err and "now a link to a file outside" in err
    assert "first anomaly" not in out
