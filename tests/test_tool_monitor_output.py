"""The shared reader of monitor output, on real 2-rank V1 and V2 runs and on damaged copies."""

from __future__ import annotations

import shutil

import pytest

from conftest import read_csv
from monitor_runs import NAN_RANK, NAN_STEP, OPS, STEPS
from trainprobe.errors import ConfigError
from trainprobe.tools.monitor_output import find_csv_files, read_table


def test_v1_run_folders_are_found_per_rank_and_type(monitor_runs):
    files = find_csv_files(monitor_runs.v1)
    assert {f.rank for f in files} == {0, 1}
    assert {f.layout for f in files} == {"v1"}
    types = {f.data_type for f in files}
    assert {"actv", "actv_grad", "grad_reduced", "grad_unreduced", "exp_avg", "exp_avg_sq", "other"} <= types
    assert {(f.first_step, f.last_step) for f in files if f.data_type == "actv"} == {(0, 1), (2, 3), (4, 5)}


def test_v2_output_is_found_and_read_like_the_csv(monitor_runs):
    files = find_csv_files(monitor_runs.v2, data_types=["weight_grad"])
    assert [(f.rank, f.first_step) for f in files] == [(0, 0), (0, 3), (1, 0), (1, 3)]
    table = read_table(files[0])
    assert table.ops == tuple(OPS) and table.torn == 0
    header, rows = read_csv(files[0].path)
    records = list(table.records())
    assert len(records) == len(rows)
    for record, row in zip(records, rows):
        assert record.target == row["module_name"] and record.scope == row["scope"]
        assert record.step == int(row["step"])
        assert record.values == tuple(float(row[op]) for op in OPS)


def test_nan_is_read_as_nan(monitor_runs):
    (file,) = [
        f
        for f in find_csv_files(monitor_runs.v1, data_types=["grad_reduced"])
        if f.rank == NAN_RANK and f.first_step <= NAN_STEP <= f.last_step
    ]
    nans = [r for r in read_table(file).records() if r.step == NAN_STEP and r.values[OPS.index("nans")] > 0]
    assert [r.target for r in nans] == ["0:fc2.bias"]


def test_micro_steps_of_activations(monitor_runs):
    file = find_csv_files(monitor_runs.v1, data_types=["actv"])[0]
    table = read_table(file)
    assert {r.micro_step for r in table.records()} == {0, 1}
    assert table.scope_col == -1


def test_time_range_selects_v1_runs(monitor_runs):
    stamp = next(p.name for p in monitor_runs.v1.iterdir() if "-rank" in p.name).split("-rank")[0]
    assert find_csv_files(monitor_runs.v1, time_start=stamp, time_end=stamp)
    with pytest.raises(ConfigError, match="no monitor CSV"):
        find_csv_files(monitor_runs.v1, time_start="Jan01_00-00-00", time_end="Jan01_00-00-01")
    with pytest.raises(ConfigError, match="time_start: 'Jan02_00-00-00' is after time_end"):
        find_csv_files(monitor_runs.v1, time_start="Jan02_00-00-00", time_end="Jan01_00-00-00")
    with pytest.raises(ConfigError, match="time_end: 'yesterday' is not a monitor timestamp"):
        find_csv_files(monitor_runs.v1, time_end="yesterday")


def test_bad_paths_and_types(tmp_path, monitor_runs):
    with pytest.raises(ConfigError, match="does not exist"):
        find_csv_files(tmp_path / "nope")
    with pytest.raises(ConfigError, match="no monitor CSV found"):
        find_csv_files(tmp_path)
    with pytest.raises(ConfigError, match=r"unknown data type\(s\) \['grads'\]"):
        find_csv_files(monitor_runs.v2, data_types=["grads"])


def test_torn_rows_are_skipped_and_counted(tmp_path, monitor_runs, caplog):
    copy = tmp_path / "v2"
    shutil.copytree(monitor_runs.v2, copy)
    file = find_csv_files(copy, data_types=["param"])[0]
    whole = len(read_table(file).rows)
    text = file.path.read_text()
    lines = text.splitlines(keepends=True)
    lines.insert(2, "0,1,fc1.weight\n")  # too few cells
    file.path.write_text("".join(lines) + "0,2,fc2.bias,param_updated,0.1,0.")  # cut short
    table = read_table(file)
    assert len(table.rows) == whole and table.torn == 2
    assert "skipped 2 torn row(s)" in caplog.text
    assert STEPS == 6


def test_tools_export_every_public_function():
    import trainprobe.tools as tools
    from trainprobe.pytorch.monitor.csv2tb import csv2tensorboard_by_step
    from trainprobe.tools.anomaly_analyse import analyse
    from trainprobe.tools.report import write_report

    assert tools.csv2tensorboard_by_step is csv2tensorboard_by_step
    assert tools.analyse is analyse and tools.write_report is write_report
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        tools.nope  # noqa: B018
