"""csv2db on real 2-rank V1 and V2 output: the database read back with sqlite3 and checked
against the CSVs, partitions, idempotent re-runs, worker processes, filters, a run still being
written, the command line and bad input."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import trainprobe.tools.exports.sqlite_rows as csv2db_rows
from conftest import read_csv
from monitor_runs import NAN_RANK, NAN_STEP, OPS, STEPS
from reference_layouts import V1_OPS, write_reference_repeats, write_reference_v1, write_reference_v2
from trainprobe import TrainerMonitorV2
from trainprobe.cli import main as cli_main
from trainprobe.core.monitor.csv2db import CSV2DBConfig, CSV2DBResult, csv2db
from trainprobe.engine.errors import ConfigError
from trainprobe.tools.exports.sqlite import RowsLostError

Key = tuple[int, str, str, int, "int | None", "str | None", int]
NAN = "nan"  # NaN stand-in: NaN != NaN would fail equal dicts

_V1_FOLDER = re.compile(r"-rank(\d+)-")
_V1_FILE = re.compile(r"^(.+)_(\d+)-(\d+)\.csv$")
_V2_FILE = re.compile(r"^(.+)_step(\d+)-(\d+)\.csv$")


def _cell(text: str) -> float | str:
    value = float(text)
    return NAN if math.isnan(value) else value


def csv_rows(root: Path, calls: bool = False) -> dict[Any, dict[str, Any]]:
    """Every row of every monitor CSV under ``root`` (V1 run folders or V2 rank folders), read
    with the csv module: (rank, data type, name, vpp_stage, micro_step, scope, step) → {op: value};
    with ``calls``, the key ends with the row's call index (how many rows of the file before it
    had the same key)."""
    out: dict[Any, dict[str, Any]] = {}
    for path in sorted(root.glob("*/*.csv")):
        v1 = _V1_FOLDER.search(path.parent.name)
        rank = int(v1.group(1)) if v1 else int(path.parent.name.split("_")[1])
        data_type = (_V1_FILE if v1 else _V2_FILE).match(path.name).group(1)
        header, rows = read_csv(path)
        keys = {"vpp_stage", "name", "module_name", "step", "micro_step", "scope", "shape", "dtype"}
        ops = [column for column in header if column not in keys]
        seen: dict[Key, int] = {}
        for row in rows:
            micro = row.get("micro_step") or None
            key = (
                rank,
                data_type,
                row["name"] if v1 else row["module_name"],
                int(row["vpp_stage"]),
                None if micro is None else int(micro),
                None if v1 else row["scope"],
                int(row["step"]),
            )
            call = seen[key] = seen.get(key, -1) + 1
            full = (*key, call) if calls else key
            assert full not in out, full
            out[full] = {op: _cell(row[op]) for op in ops}
    return out


def db_rows(db: Path, calls: bool = False) -> dict[Any, dict[str, Any]]:
    """The same mapping read from ``monitor_metrics.db`` (NaN from ``nan_mask``)."""
    with sqlite3.connect(db) as conn:
        ops = [name for (name,) in conn.execute("SELECT name FROM metrics ORDER BY metric_id")]
        columns = ", ".join(f'v."{op}"' for op in ops)
        query = (
            f"SELECT v.rank, d.name, t.name, t.vpp_stage, t.micro_step, t.scope, v.step, t.call_index, v.nan_mask, "
            f"{columns} "
            "FROM metric_values v JOIN targets t USING (target_id) JOIN data_types d USING (data_type_id)"
        )
        out: dict[Any, dict[str, Any]] = {}
        for rank, data_type, name, vpp, micro, scope, step, call, mask, *values in conn.execute(query):
            key = (
                (rank, data_type, name, vpp, micro, scope, step, call)
                if calls
                else (rank, data_type, name, vpp, micro, scope, step)
            )
            assert key not in out, key
            out[key] = {
                op: NAN if mask >> bit & 1 else value
                for bit, (op, value) in enumerate(zip(ops, values))
                if value is not None or mask >> bit & 1
            }
    return out


def query(db: Path, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    with sqlite3.connect(db) as conn:
        return conn.execute(sql, params).fetchall()


def convert(monitor: Path, out: Path, **kwargs: Any) -> CSV2DBResult:
    return csv2db(CSV2DBConfig(monitor, output_dirpath=out, **kwargs))


@pytest.fixture(scope="module")
def v1_db(monitor_runs, tmp_path_factory) -> CSV2DBResult:
    return convert(monitor_runs.v1, tmp_path_factory.mktemp("v1db"))


@pytest.fixture(scope="module")
def v2_db(monitor_runs, tmp_path_factory) -> CSV2DBResult:
    return convert(monitor_runs.v2, tmp_path_factory.mktemp("v2db"))


# --------------------------------------------------------------------------- content


def test_v1_every_row_of_every_csv_is_in_the_db(monitor_runs, v1_db):
    expected = csv_rows(monitor_runs.v1)
    assert db_rows(v1_db.db_path) == expected
    assert v1_db.rows == len(expected) and v1_db.torn == 0 and v1_db.unchanged == 0
    assert v1_db.db_path.name == "monitor_metrics.db" and v1_db.tables == ("metrics_0_499",)
    assert {k[0] for k in expected} == {0, 1}
    types = {name for (name,) in query(v1_db.db_path, "SELECT name FROM data_types WHERE layout = 'v1'")}
    assert {"actv", "actv_grad", "grad_reduced", "grad_unreduced", "exp_avg", "exp_avg_sq", "other"} <= types
    collectives = [k for k in expected if k[1] == "other" and k[2].startswith("all_reduce")]
    assert collectives and all(k in db_rows(v1_db.db_path) for k in collectives)
    micro = query(v1_db.db_path, "SELECT DISTINCT micro_step FROM targets WHERE name LIKE '%fc1.input'")
    assert sorted(m for (m,) in micro) == [0, 1]
    assert [op for (op,) in query(v1_db.db_path, "SELECT name FROM metrics ORDER BY metric_id")] == OPS


def test_v2_every_row_with_scope_and_monitor_as_data_type(monitor_runs, v2_db):
    expected = csv_rows(monitor_runs.v2)
    assert db_rows(v2_db.db_path) == expected
    rows = query(v2_db.db_path, "SELECT name, layout FROM data_types ORDER BY name")
    assert rows == [(name, "v2") for name in ("cc", "module", "optimizer", "param", "weight_grad")]
    scopes = {s for (s,) in query(v2_db.db_path, "SELECT DISTINCT scope FROM targets")}
    assert {"forward", "unreduced", "reduced", "exp_avg", "exp_avg_sq", "comm"} <= scopes
    steps = query(v2_db.db_path, "SELECT min(step), max(step) FROM metric_values")
    assert steps == [(0, STEPS - 1)]


def test_nan_is_null_and_flagged_in_nan_mask(v1_db):
    db = v1_db.db_path
    (first,) = query(
        db,
        "SELECT v.step, v.rank, t.name FROM metric_values v JOIN targets t USING (target_id) "
        "JOIN data_types d USING (data_type_id) WHERE d.name = 'grad_reduced' AND v.nan_mask != 0 "
        "ORDER BY v.step, v.rank LIMIT 1",
    )
    assert first == (NAN_STEP, NAN_RANK, "fc2.bias")
    bits = sum(1 << m for (m,) in query(db, "SELECT metric_id FROM metrics WHERE name IN ('min','max','mean','norm')"))
    (row,) = query(
        db,
        'SELECT "min", "max", "mean", "norm", "nans", nan_mask FROM metric_values WHERE step = ? AND rank = ? '
        "AND data_type_id = (SELECT data_type_id FROM data_types WHERE name = 'grad_reduced') "
        "AND target_id = (SELECT target_id FROM targets WHERE name = 'fc2.bias')",
        NAN_STEP,
        NAN_RANK,
    )
    assert row == (None, None, None, None, 1.0, bits)
    # the nans op counts NaN elements: the other way to find them
    assert query(db, "SELECT count(*) FROM metric_values WHERE nans > 0 AND rank = 0 AND step < ?", NAN_STEP) == [(0,)]


def test_small_step_partition_and_indexes(monitor_runs, tmp_path):
    result = convert(monitor_runs.v1, tmp_path, step_partition=2)
    db = result.db_path
    assert result.tables == ("metrics_0_1", "metrics_2_3", "metrics_4_5")
    assert query(db, "SELECT * FROM partitions ORDER BY first_step") == [
        ("metrics_0_1", 0, 1),
        ("metrics_2_3", 2, 3),
        ("metrics_4_5", 4, 5),
    ]
    for table, first, last in query(db, "SELECT * FROM partitions"):
        assert query(db, f'SELECT min(step), max(step) FROM "{table}"') == [(first, last)]
    assert db_rows(db) == csv_rows(monitor_runs.v1)
    indexes = {name for (name,) in query(db, "SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert {f"{t}_by_target" for t in result.tables} <= indexes
    plan = " ".join(r[-1] for r in query(db, "EXPLAIN QUERY PLAN SELECT * FROM metric_values WHERE target_id = 3"))
    assert "_by_target (target_id=?)" in plan and "SCAN" not in plan
    plan = " ".join(
        r[-1]
        for r in query(
            db, "EXPLAIN QUERY PLAN SELECT * FROM metrics_2_3 WHERE rank = 0 AND data_type_id = 1 AND step = 3"
        )
    )
    assert "PRIMARY KEY (rank=? AND data_type_id=? AND step=?)" in plan
    assert query(db, "PRAGMA page_size") == [(32768,)]  # 15% faster to store and index than 8 KiB


# --------------------------------------------------------------------------- re-runs and workers


def test_rerun_is_idempotent(monitor_runs, tmp_path):
    first = convert(monitor_runs.v2, tmp_path, step_partition=3)
    count = query(first.db_path, "SELECT count(*) FROM metric_values")
    again = convert(monitor_runs.v2, tmp_path, step_partition=3)
    assert (again.rows, again.files, again.unchanged) == (0, 0, first.files)
    assert query(first.db_path, "SELECT count(*) FROM metric_values") == count
    copy = tmp_path / "copy"  # a changed mtime: every file read again, rows replaced, none doubled
    shutil.copytree(monitor_runs.v2, copy)
    for path in copy.glob("*/*.csv"):
        os.utime(path, ns=(1, 1))
    replaced = convert(copy, tmp_path, step_partition=3)
    assert replaced.rows == first.rows and replaced.unchanged == 0
    assert db_rows(first.db_path) == csv_rows(monitor_runs.v2)
    with pytest.raises(ConfigError, match="step_partition: .* was made with step_partition 3, not 500"):
        convert(monitor_runs.v2, tmp_path)


def test_v1_and_v2_in_one_database(monitor_runs, tmp_path):
    convert(monitor_runs.v1, tmp_path)
    result = convert(monitor_runs.v2, tmp_path)
    assert db_rows(result.db_path) == {**csv_rows(monitor_runs.v1), **csv_rows(monitor_runs.v2)}


def test_process_num_2_gives_the_same_database(monitor_runs, tmp_path, v1_db):
    result = convert(monitor_runs.v1, tmp_path, process_num=2)
    assert result.rows == v1_db.rows
    assert db_rows(result.db_path) == db_rows(v1_db.db_path)
    ids = "SELECT * FROM targets ORDER BY target_id"
    assert query(result.db_path, ids) == query(v1_db.db_path, ids)


def test_data_type_filter(monitor_runs, tmp_path):
    every = convert(monitor_runs.v2, tmp_path / "every", data_type_list=[])
    assert every.files == len(list(monitor_runs.v2.glob("*/*.csv")))
    result = convert(monitor_runs.v1, tmp_path, data_type_list=["grad_reduced", "other"])
    assert {k[1] for k in db_rows(result.db_path)} == {"grad_reduced", "other"}
    expected = {k: v for k, v in csv_rows(monitor_runs.v1).items() if k[1] in ("grad_reduced", "other")}
    assert db_rows(result.db_path) == expected


def test_a_run_still_being_written(monitor_runs, tmp_path, caplog):
    copy = tmp_path / "v1"
    shutil.copytree(monitor_runs.v1, copy)
    path = sorted(copy.glob("*-rank1-*/grad_reduced_4-5.csv"))[0]
    whole = path.read_text()
    cut = len(whole) - 9  # the last row cut short, as by a writer killed mid-line
    path.write_text(whole[:cut])
    out = tmp_path / "out"
    result = convert(copy, out)
    assert result.torn == 1 and "skipped 1 torn row(s)" in caplog.text
    expected = csv_rows(monitor_runs.v1)
    got = db_rows(result.db_path)
    (missing,) = set(expected) - set(got)
    assert missing[:2] == (1, "grad_reduced") and missing[-1] == 5
    assert {k: v for k, v in expected.items() if k != missing} == got
    path.write_text(whole)  # the writer finished the line: converting again adds it
    later = convert(copy, out)
    assert later.files == 1 and later.torn == 0
    assert db_rows(result.db_path) == expected


def test_a_new_op_in_another_column_order_inf_and_nan(monitor_runs, tmp_path):
    copy = tmp_path / "v2"
    shutil.copytree(monitor_runs.v2, copy)
    path = copy / f"rank_{NAN_RANK}" / "param_step3-5.csv"  # NaN from NAN_STEP on
    header, *rows = path.read_text().splitlines()
    cells = [row.split(",") for row in rows]
    cells[0][4] = "inf"  # min
    cells[1][5] = "-inf"  # max
    lines = [header.replace(",scope,", ",scope,zeros,")] + [",".join([*c[:4], "7", *c[4:]]) for c in cells]
    path.write_text("\n".join(lines) + "\n")
    result = convert(copy, tmp_path / "out", step_partition=3)
    assert [op for (op,) in query(result.db_path, "SELECT name FROM metrics ORDER BY metric_id")] == [*OPS, "zeros"]
    got = db_rows(result.db_path)
    assert got == csv_rows(copy)
    assert any(v["max"] == NAN for k, v in got.items() if k[0] == NAN_RANK and k[1] == "param")
    assert query(result.db_path, 'SELECT count(*) FROM metric_values WHERE "min" = 9e999 OR "max" = -9e999') == [(2,)]


def test_default_output_folder_is_timestamped(monitor_runs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = csv2db(CSV2DBConfig(str(monitor_runs.v2), data_type_list=["cc"]))
    assert re.fullmatch(r"\d{14}_csv2db", result.db_path.parent.name)
    assert result.db_path.parent.parent.resolve() == tmp_path.resolve()


def test_progress_bar_on_request(monitor_runs, tmp_path, capsys):
    csv2db(CSV2DBConfig(monitor_runs.v2, output_dirpath=tmp_path, process_num=2), progress=True)
    assert "csv2db" in capsys.readouterr().err


# --------------------------------------------------------------------------- command line


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "trainprobe", "csv2db", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("tables", [["--tables", "param,cc"], ["--tables", "param", "cc"], ["--data-type", "param", "cc"]])
def test_tables_is_the_option_and_data_type_its_reference_alias(monitor_runs, tmp_path, tables):
    out = tmp_path / "out"
    done = run_cli(str(monitor_runs.v2), "--output", str(out), *tables)
    assert done.returncode == 0, done.stderr
    assert {n for (n,) in query(out / "monitor_metrics.db", "SELECT name FROM data_types")} == {"param", "cc"}


def test_cli_converts_and_prints_one_line(monitor_runs, tmp_path):
    out = tmp_path / "out"
    done = run_cli(str(monitor_runs.v2), "-o", str(out), "--step-partition", "3", "--data-type", "param", "cc")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # no progress bar: stderr is not a terminal
    (line,) = done.stdout.splitlines()
    db = out / "monitor_metrics.db"
    rows = query(db, "SELECT count(*) FROM metric_values")[0][0]
    assert line.startswith(f"csv2db: {rows} rows from 8 file(s) into 2 table(s) in ") and line.endswith(f"-> {db}")
    assert {n for (n,) in query(db, "SELECT name FROM data_types")} == {"param", "cc"}


def test_cli_bad_input_exit_2_one_line(tmp_path):
    done = run_cli(str(tmp_path / "nope"), "-o", str(tmp_path / "out"))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        f"trainprobe csv2db: error: monitor_path: {str(tmp_path / 'nope')!r} does not exist"
    ]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--step-partition", "0"], "step_partition: expected an integer >= 1, got 0"),
        (["--process-num", "0"], "process_num: expected an integer >= 1, got 0"),
        (["--data-type", "grads"], r"data_type_list: unknown data type\(s\) \['grads'\]"),
        (["--time-start", "Jan02_00-00-00", "--time-end", "Jan01_00-00-00"], "time_start: 'Jan02_00-00-00' is after"),
        (["--time-end", "yesterday"], "time_end: 'yesterday' is not a monitor timestamp"),
    ],
)
def test_cli_bad_options(monitor_runs, tmp_path, capsys, args, message):
    assert cli_main(["csv2db", str(monitor_runs.v2), "-o", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert re.match(f"trainprobe csv2db: error: {message}", err) and len(err.splitlines()) == 1


# --------------------------------------------------------------------------- bad input (API)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"step_partition": 0}, "step_partition: expected an integer >= 1, got 0"),
        ({"step_partition": True}, "step_partition: expected an integer >= 1, got True"),
        ({"step_partition": "500"}, "step_partition: expected an integer >= 1, got '500'"),
        ({"process_num": 0}, "process_num: expected an integer >= 1"),
        ({"process_num": 1.5}, "process_num: expected an integer >= 1"),
        ({"data_type_list": ["grads"]}, r"data_type_list: unknown data type\(s\) \['grads'\]"),
        ({"data_type_list": "grad_reduced"}, "data_type_list: expected a list of data types"),
        ({"time_start": "Dec3"}, "time_start: 'Dec3' is not a monitor timestamp"),
        ({"time_end": 5}, "time_end: expected a timestamp"),
        ({"time_start": "Jan02_00-00-00", "time_end": "Jan01_00-00-00"}, "time_start: 'Jan02_00-00-00' is after"),
        ({"monitor_path": None}, "monitor_path: expected a path"),
        ({"monitor_path": ""}, "monitor_path: expected a path"),
        ({"output_dirpath": 3}, "output_dirpath: expected a path"),
    ],
)
def test_config_checks_its_fields(kwargs, message):
    kwargs = {"monitor_path": "monitor_output", **kwargs}
    with pytest.raises(ConfigError, match=message):
        CSV2DBConfig(**kwargs)


def test_bad_paths_and_outputs(monitor_runs, tmp_path):
    with pytest.raises(ConfigError, match="monitor_path: .* does not exist"):
        convert(tmp_path / "nope", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="monitor_path: no monitor CSV found"):
        convert(tmp_path / "empty", tmp_path / "out")
    with pytest.raises(ConfigError, match="no monitor CSV found"):
        convert(monitor_runs.v1, tmp_path / "out", time_start="Jan01_00-00-00", time_end="Jan01_00-00-01")
    assert not (tmp_path / "out").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="output_dirpath: .* exists and is not a folder"):
        convert(monitor_runs.v2, tmp_path / "file")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "monitor_metrics.db").write_text("not a database, just text " * 100)
    with pytest.raises(ConfigError, match="output_dirpath: .* is not a csv2db database"):
        convert(monitor_runs.v2, tmp_path / "other")
    with sqlite3.connect(tmp_path / "foreign.db") as conn:
        conn.execute("CREATE TABLE t (x)")
    (tmp_path / "foreign").mkdir()
    shutil.move(tmp_path / "foreign.db", tmp_path / "foreign" / "monitor_metrics.db")
    with pytest.raises(ConfigError, match="is not a csv2db database .*no meta table"):
        convert(monitor_runs.v2, tmp_path / "foreign")


def test_empty_csv_of_a_starting_run_is_skipped_then_taken(monitor_runs, tmp_path, caplog):
    copy = tmp_path / "v2"
    shutil.copytree(monitor_runs.v2, copy)
    source = copy / "rank_0" / "param_step3-5.csv"
    text = source.read_text()
    path = copy / "rank_0" / "param_step6-8.csv"
    path.write_text("")
    out = tmp_path / "out"
    result = convert(copy, out)
    assert "param_step6-8.csv: empty" in caplog.text
    assert db_rows(result.db_path) == csv_rows(monitor_runs.v2)
    header, *rows = text.splitlines()
    step6 = [row.replace("0,3,", "0,6,", 1) for row in rows if row.startswith("0,3,")]
    path.write_text("\n".join([header, *step6]) + "\n")  # the run wrote its first step
    later = convert(copy, out)
    assert later.files == 1 and later.rows == len(step6) > 0
    assert db_rows(result.db_path) == csv_rows(copy)


def test_a_locked_database_is_a_clear_error(monitor_runs, tmp_path):
    convert(monitor_runs.v2, tmp_path, data_type_list=["cc"])
    with sqlite3.connect(tmp_path / "monitor_metrics.db") as other:
        other.execute("BEGIN EXCLUSIVE")
        with pytest.raises(ConfigError, match="output_dirpath: cannot write .*monitor_metrics.db.*locked"):
            convert(monitor_runs.v2, tmp_path)
        other.rollback()


# --------------------------------------------------------------------------- the reference tool's layouts


def test_reference_v1_and_v2_layouts(tmp_path):
    """Every row of the reference tool's V1 (``shape,dtype`` text columns, names without a chunk
    prefix, an all-``nan`` row) and V2 (``\\r\\n``, vpp_stage -1) output is stored: none is torn."""
    monitor = tmp_path / "monitor"
    write_reference_v1(monitor / "v1")
    write_reference_v2(monitor / "v2")
    v1 = convert(monitor / "v1", tmp_path / "db1")
    assert (v1.rows, v1.files, v1.torn) == (4 * 2 + 2 * 2 + 4 * 2 + 2, 4, 0)
    ops = [op for (op,) in query(v1.db_path, "SELECT name FROM metrics ORDER BY metric_id")]
    assert ops == list(V1_OPS)  # shape and dtype are text, not metrics
    got = db_rows(v1.db_path)
    assert got[(0, "actv", "fc1.input", 0, 0, None, 1)] == dict(zip(V1_OPS, (-0.6, 0.6, 1.2, 0.0, 0.0, 0.06)))
    assert got[(0, "actv_grad", ".input", 0, 0, None, 0)] == dict.fromkeys(V1_OPS, NAN)
    assert got[(0, "grad_reduced", "fc2.bias", 0, None, None, 1)]["norm"] == 1.2
    v2 = convert(monitor / "v2", tmp_path / "db2")
    assert (v2.rows, v2.torn) == (6, 0)
    assert db_rows(v2.db_path)[(0, "weight_grad", "fc1.weight", -1, 1, "reduced", 1)]["norm"] == 1.22


# --------------------------------------------------------------------------- keys that repeat within a step


class _SharedLayer(nn.Module):
    """``fc`` applied twice per forward pass: the module monitor writes two sets of its rows."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.act(self.fc(x)))


def _train_shared_layer(out: Path, steps: int = 3, micro_batches: int = 2) -> None:
    config = out.parent / "v2_config.json"
    config.write_text(
        json.dumps(
            {
                "output_dir": str(out),
                "monitors": {
                    "module": {"enabled": True, "ops": OPS},
                    "weight_grad": {"enabled": True, "ops": OPS},
                },
            }
        )
    )
    torch.manual_seed(0)
    model = _SharedLayer()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2(str(config))
    mon.start(model=model, optimizer=opt)
    for _ in range(steps):
        for _ in range(micro_batches):
            model(torch.randn(3, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    mon.stop()


def test_a_module_called_twice_per_step_keeps_every_row(tmp_path):
    """Real V2 training, ``fc`` called twice per forward and two micro-batches per step: every
    CSV row is in the database, the repeats told apart by ``targets.call_index``."""
    monitor = tmp_path / "v2"
    _train_shared_layer(monitor)
    expected = csv_rows(monitor, calls=True)
    assert max(key[-1] for key in expected) >= 1  # the module CSV does repeat keys within a step
    result = convert(monitor, tmp_path / "db")
    assert result.rows == len(expected) == query(result.db_path, "SELECT count(*) FROM metric_values")[0][0]
    assert result.replaced == 0
    assert db_rows(result.db_path, calls=True) == expected
    again = convert(monitor, tmp_path / "db")  # nothing new: nothing added, nothing lost
    assert (again.rows, again.unchanged) == (0, result.files)


def test_reference_layouts_with_repeated_keys(tmp_path):
    """The reference tool's V1 ``actv`` of gradient accumulation (no ``micro_step`` column) and a
    V2 ``module`` CSV of a module called twice: one row per call, none replaced."""
    write_reference_repeats(tmp_path / "monitor", steps=3, micro_batches=2)
    for layout, rows in (("v1", 3 * 2 * 3), ("v2", 3 * 2 * 2)):
        expected = csv_rows(tmp_path / "monitor" / layout, calls=True)
        result = convert(tmp_path / "monitor" / layout, tmp_path / f"db_{layout}")
        assert result.rows == len(expected) == rows
        assert db_rows(result.db_path, calls=True) == expected
        assert query(result.db_path, "SELECT DISTINCT call_index FROM targets ORDER BY 1") == [(0,), (1,)]


def test_a_restarted_run_replaces_and_says_so(tmp_path):
    """Two run folders of one rank repeating steps (a restart): the later run's rows replace the
    earlier's, counted in ``replaced``, and the invariant holds."""
    write_reference_v1(tmp_path / "monitor")
    first = next((tmp_path / "monitor").iterdir())
    shutil.copytree(first, tmp_path / "monitor" / first.name.replace("06-27-30", "06-27-31"))
    result = convert(tmp_path / "monitor", tmp_path / "db")
    assert (result.rows, result.replaced) == (2 * 22, 22)
    assert query(result.db_path, "SELECT count(*) FROM metric_values")[0][0] == 22


def test_lost_rows_fail_loudly(tmp_path, monkeypatch):
    """The check itself: with the call numbering switched off (the old behaviour, repeats
    collapsing onto one key), the conversion fails instead of storing fewer rows than it read."""
    write_reference_repeats(tmp_path / "monitor")
    monkeypatch.setattr(csv2db_rows, "call_indices", lambda keys: [0] * len(keys))
    db = tmp_path / "db" / "monitor_metrics.db"
    with pytest.raises(RowsLostError, match=r"holds 6 value rows, expected 12 \(0 before \+ 12 read - 0") as caught:
        convert(tmp_path / "monitor" / "v1", tmp_path / "db")
    # the message names the database the user asked for, not the hidden file it was built in (removed)
    assert str(caught.value).startswith(f"csv2db: {str(db)!r} holds"), caught.value
    assert not list((tmp_path / "db").iterdir())


def test_a_schema_1_database_is_upgraded(tmp_path):
    """A database made before ``call_index`` (schema 1) gains the column (0 for its targets)."""
    write_reference_v1(tmp_path / "monitor")
    result = convert(tmp_path / "monitor", tmp_path / "db")
    with sqlite3.connect(result.db_path) as conn:
        conn.executescript(
            """
            CREATE TABLE old AS SELECT target_id, name, vpp_stage, micro_step, scope FROM targets;
            DROP TABLE targets;
            CREATE TABLE targets (
                target_id INTEGER PRIMARY KEY, name TEXT NOT NULL, vpp_stage INTEGER NOT NULL,
                micro_step INTEGER, scope TEXT);
            INSERT INTO targets SELECT * FROM old;
            DROP TABLE old;
            CREATE UNIQUE INDEX targets_key ON targets(name, vpp_stage, ifnull(micro_step, -1), ifnull(scope, ''));
            UPDATE meta SET value = '1' WHERE key = 'schema_version';
            """
        )
    write_reference_repeats(tmp_path / "more")
    shutil.copytree(tmp_path / "more" / "v2", tmp_path / "monitor", dirs_exist_ok=True)
    again = convert(tmp_path / "monitor", tmp_path / "db")
    assert again.rows == 8
    assert query(result.db_path, "SELECT value FROM meta WHERE key = 'schema_version'") == [("2",)]
    assert db_rows(result.db_path, calls=True) == csv_rows(tmp_path / "monitor", calls=True)


@pytest.mark.parametrize("layout", ["v1", "v2"])
def test_parquet_runs_give_the_same_database(monitor_runs, tmp_path, layout):
    """A run converted to Parquet (``trainprobe convert``), wholly or in part (a window with both
    files is read from its Parquet file), gives the same rows, targets and ops as its CSV files."""
    from trainprobe.tools.query.convert import convert_run

    source = monitor_runs.v1 if layout == "v1" else monitor_runs.v2
    expected = db_rows(convert(source, tmp_path / "from_csv").db_path, calls=True)
    whole = tmp_path / "parquet"
    shutil.copytree(source, whole)
    convert_run(whole, remove_csv=True)
    assert not list(whole.rglob("*.csv"))
    result = convert(whole, tmp_path / "from_parquet")
    assert result.rows == len(expected) and db_rows(result.db_path, calls=True) == expected
    assert query(result.db_path, "SELECT count(*) FROM files WHERE path LIKE '%.parquet'")[0][0] == result.files
    mixed = tmp_path / "mixed"
    shutil.copytree(source, mixed)
    convert_run(mixed)  # every window both as CSV and as Parquet
    next(mixed.rglob("*.parquet")).unlink()  # one window as CSV only
    result = convert(mixed, tmp_path / "from_mixed")
    assert result.rows == len(expected) and db_rows(result.db_path, calls=True) == expected
    assert query(result.db_path, "SELECT count(*) FROM files WHERE path LIKE '%.csv'")[0][0] == 1


def test_the_database_is_synced_to_disk_when_the_conversion_ends(tmp_path, monkeypatch):
    """The bulk load runs without fsync (``synchronous=OFF``); the finished file and its folder
    are synced once at the end, so the database is durable when ``csv2db`` returns."""
    write_reference_v1(tmp_path / "monitor")
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    result = convert(tmp_path / "monitor", tmp_path / "db")
    assert str(result.db_path) in synced and str(result.db_path.parent) in synced


def test_targets_differing_in_one_key_column_stay_apart_and_an_empty_scope_is_none(tmp_path):
    """Rows whose targets differ only in vpp_stage, in ``micro_step`` (none against 0) or in
    ``scope`` are different targets; an empty scope is no scope, as the targets' key says (a
    Parquet file can hold both; the empty one failed with "UNIQUE constraint failed")."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "monitor" / "rank_0"
    folder.mkdir(parents=True)
    keys = [(0, None, "reduced"), (1, None, "reduced"), (0, 0, "reduced"), (0, None, None)]
    rows = [(vpp, step, micro, scope) for step in (0, 1) for vpp, micro, scope in keys] + [(0, 2, None, "")]
    table = pa.table(
        {
            "vpp_stage": pa.array([r[0] for r in rows], pa.int64()),
            "step": pa.array([r[1] for r in rows], pa.int64()),
            "module_name": ["fc.weight"] * len(rows),
            "scope": pa.array([r[3] for r in rows], pa.string()),
            "micro_step": pa.array([r[2] for r in rows], pa.int64()),
            "norm": [float(i) for i in range(len(rows))],
        }
    )
    pq.write_table(table, folder / "weight_grad_step0-2.parquet")
    result = convert(tmp_path / "monitor", tmp_path / "db")
    assert (result.rows, result.replaced) == (9, 0)
    targets = query(result.db_path, "SELECT vpp_stage, micro_step, scope, call_index FROM targets ORDER BY target_id")
    assert targets == [(vpp, micro, scope, 0) for vpp, micro, scope in keys]
    stored = query(result.db_path, "SELECT step, target_id, norm FROM metric_values ORDER BY step, target_id")
    assert stored == [(step, target, float(i)) for i, (step, target) in enumerate(
        [(s, t) for s in (0, 1) for t in (1, 2, 3, 4)] + [(2, 4)]
    )]


def test_an_index_build_that_fails_on_temporary_files_is_made_again_in_memory(tmp_path, monkeypatch):
    """The ``_by_target`` indexes are sorted on SQLite's worker threads with temporary files on
    disk; when that fails (a full temporary folder: here the first build, after it made its
    indexes, raises as SQLite would), the indexes are dropped and made again, in memory, and the
    database is whole."""
    from trainprobe.tools.exports.sqlite_schema import MetricsDatabase

    write_reference_v1(tmp_path / "monitor")
    real = MetricsDatabase._index_all
    calls: list[str] = []

    def failing_once(self: MetricsDatabase, tables: Any) -> None:
        calls.append(self.conn.execute("PRAGMA temp_store").fetchone()[0])
        real(self, tables)
        if len(calls) == 1:
            self.conn.execute("BEGIN")
            raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(MetricsDatabase, "_index_all", failing_once)
    result = convert(tmp_path / "monitor", tmp_path / "db", step_partition=1)
    assert calls == [1, 2]  # FILE, then MEMORY
    assert query(result.db_path, "PRAGMA integrity_check") == [("ok",)]
    indexes = query(result.db_path, "SELECT name FROM sqlite_master WHERE type = 'index' AND name LIKE '%_by_target'")
    assert sorted(name for (name,) in indexes) == sorted(f"{table}_by_target" for table in result.tables)
    assert len(result.tables) == 2


def test_the_next_batch_is_read_while_this_one_is_stored(tmp_path, monkeypatch):
    """DuckDB reads the next batch of files in a thread of its own while the caller still holds
    the files of this one (it used to start only when the caller asked for the next file: the
    database then waited for every query). Same files, same order, same rows either way."""
    import threading

    import trainprobe.tools.runs.read as csv2db_read
    from trainprobe.tools.runs.selection import find_monitor_files

    write_reference_v1(tmp_path / "monitor")
    files = find_monitor_files(tmp_path / "monitor")
    assert len(files) >= 3
    queried = threading.Event()
    real = csv2db_read._split_by_file
    calls: list[int] = []

    def recording(table: Any) -> Any:
        calls.append(table.num_rows)
        if len(calls) == 2:
            queried.set()
        return real(table)

    monkeypatch.setattr(csv2db_read, "_split_by_file", recording)
    monkeypatch.setattr(csv2db_read, "FIRST_BATCH_BYTES", 1)  # one file per batch
    monkeypatch.setattr(csv2db_read, "BATCH_BYTES", 1)
    reader = csv2db_read.read_files(files)
    first = next(reader)
    assert queried.wait(10), "the second batch was not read while the first file was held"
    rest = list(reader)
    assert [p.file for p in (first, *rest)] == list(files)
    assert len(calls) == len(files) and sum(len(p.steps) for p in (first, *rest)) == sum(calls)


def test_a_reader_closed_early_ends_its_query_thread_first(tmp_path, monkeypatch):
    """Closing the reader while DuckDB reads the next batch (a failed conversion stops reading)
    waits for that query, then closes DuckDB's connection: the query never runs on a closed
    connection, and no thread is left."""
    import threading
    import time

    import trainprobe.tools.runs.read as csv2db_read
    from trainprobe.tools.runs.selection import find_monitor_files

    write_reference_v1(tmp_path / "monitor")
    real = csv2db_read._query_batch
    calls: list[int] = []
    errors: list[BaseException] = []

    def slow(*args: Any) -> Any:
        if calls:
            time.sleep(0.3)  # the second batch: still being read when the reader is closed
        calls.append(1)
        try:
            return real(*args)
        except BaseException as exc:
            errors.append(exc)
            raise

    monkeypatch.setattr(csv2db_read, "_query_batch", slow)
    monkeypatch.setattr(csv2db_read, "FIRST_BATCH_BYTES", 1)
    monkeypatch.setattr(csv2db_read, "BATCH_BYTES", 1)
    reader = csv2db_read.read_files(find_monitor_files(tmp_path / "monitor"))
    next(reader)
    reader.close()
    assert len(calls) == 2 and errors == []
    assert not [t for t in threading.enumerate() if t.name == "csv2db-reader"]
