"""The shared reader of monitor output, on real 2-rank V1 and V2 runs and on damaged copies."""

from __future__ import annotations

import math
import os
import re
import shutil

import pytest

from conftest import read_csv
from monitor_runs import NAN_RANK, NAN_STEP, OPS, STEPS
from reference_layouts import V1_HEADER, V1_OPS, V1_RUN, V2_OPS, write_reference_v1, write_reference_v2
from trainprobe.engine.errors import ConfigError
from trainprobe.tools.runs.rows import find_csv_files, read_table


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
    assert [r.target for r in nans] == ["fc2.bias"]


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


def test_only_the_last_line_is_torn(tmp_path, monitor_runs, caplog):
    copy = tmp_path / "v2"
    shutil.copytree(monitor_runs.v2, copy)
    file = find_csv_files(copy, data_types=["param"])[0]
    whole = len(read_table(file).rows)
    text = file.path.read_text()
    file.path.write_text(text + "0,2,fc2.bias,param_updated,0.1,0.")  # cut short
    table = read_table(file)
    assert len(table.rows) == whole and table.torn == 1
    assert "skipped 1 torn row(s)" in caplog.text
    lines = text.splitlines(keepends=True)
    lines.insert(2, "0,1,fc1.weight\n")  # too few cells, not at the end: not a torn row
    file.path.write_text("".join(lines))
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(file.path))}: row 2 has 3 cells, the header 9"):
        read_table(file)
    assert STEPS == 6


def test_tools_export_every_public_function():
    import trainprobe.tools as tools
    from trainprobe.pytorch.monitor.csv2tb import csv2tensorboard_by_step
    from trainprobe.tools.anomalies.analyser import analyse
    from trainprobe.tools.reporting.report import write_report

    assert tools.csv2tensorboard_by_step is csv2tensorboard_by_step
    assert tools.analyse is analyse and tools.write_report is write_report
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        tools.nope  # noqa: B018


# --------------------------------------------------------------------------- the reference tool's layouts


def test_reference_v1_layout_shape_and_dtype_are_text(tmp_path):
    run = write_reference_v1(tmp_path / "monitor_output")
    files = find_csv_files(tmp_path / "monitor_output")
    assert {f.data_type for f in files} == {"actv", "actv_grad", "grad_reduced", "other"}
    assert {(f.rank, f.run, f.first_step, f.last_step) for f in files} == {(0, run.name, 0, 1)}
    tables = {f.data_type: read_table(f) for f in files}
    for table in tables.values():
        assert table.ops == V1_OPS and table.torn == 0
        assert table.header[-2:] == ("shape", "dtype")
    actv = tables["actv"]
    assert [r.target for r in actv.records()][:2] == ["fc1.input", "fc1.output"]
    assert actv.text_column("shape")[:2] == ["[4, 8]", "[4, 16]"]  # the text cells, as written
    assert set(actv.text_column("dtype")) == {"torch.float32"} and actv.text_column("nope") is None
    assert tables["actv_grad"].text_column("shape")[0] == "nan"
    first = next(actv.records())
    assert (first.vpp_stage, first.step, first.micro_step, first.scope) == (0, 0, 0, None)
    assert first.values == (-0.5, 0.5, 1.0, 0.0, 0.0, 0.05)
    never = next(tables["actv_grad"].records())  # a row of "nan", shape and dtype included
    assert never.target == ".input" and all(math.isnan(v) for v in never.values)
    assert len(tables["grad_reduced"].rows) == 8 and tables["grad_reduced"].micro_col == -1


def test_reference_v2_layout_with_crlf_and_vpp_minus_one(tmp_path):
    write_reference_v2(tmp_path)
    (module, weight) = find_csv_files(tmp_path)
    table = read_table(weight)
    assert table.ops == V2_OPS
    records = list(table.records())
    assert [(r.target, r.vpp_stage, r.step, r.micro_step, r.scope) for r in records] == [
        ("fc1.weight", -1, 0, 1, "reduced"),
        ("fc1.weight", -1, 1, 1, "reduced"),
    ]
    assert [r.scope for r in read_table(module).records()] == ["forward", "backward"] * 2


def test_a_byte_order_mark_is_accepted(tmp_path):
    run = write_reference_v1(tmp_path)
    path = run / "grad_reduced_0-1.csv"
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    (file,) = find_csv_files(tmp_path, data_types=["grad_reduced"])
    assert read_table(file).header[0] == "vpp_stage" and len(read_table(file).rows) == 8


@pytest.mark.parametrize("name", ["a\u2028b", "a\x85b", "a\x0cb", "a\nb", "a\rb", "a\r\nb", 'q"t,c', "\u2029", "\x1c"])
def test_names_with_line_breaks_read_back_exactly(tmp_path, name):
    """Names quoted by the csv module's rules read back exactly; unquoted U+2028, U+0085 and form
    feeds are not line breaks to the csv module, so they read back exactly too."""
    run = tmp_path / V1_RUN
    run.mkdir()
    cell = '"' + name.replace('"', '""') + '"' if any(c in name for c in '\r\n",') else name
    text = f"{','.join(V1_HEADER)}\n0,{cell},0,1,2,3,0,0,1,[2],torch.float32\n0,fc1.bias,0,1,2,3,0,0,1,[2],x\n"
    (run / "grad_reduced_0-0.csv").write_text(text, encoding="utf-8", newline="")
    (file,) = find_csv_files(tmp_path)
    assert [r.target for r in read_table(file).records()] == [name, "fc1.bias"]


def test_a_torn_last_record_inside_quotes(tmp_path, caplog):
    run = write_reference_v1(tmp_path)
    path = run / "grad_reduced_0-1.csv"
    path.write_text(path.read_text() + '0,fc2.bias,2,0.1,0.2,0.3,0.0,0,0.1,"[4,\n')  # ends inside a quoted cell
    (file,) = find_csv_files(tmp_path, data_types=["grad_reduced"])
    table = read_table(file)
    assert table.torn == 1 and len(table.rows) == 8 and "skipped 1 torn row(s)" in caplog.text


def test_a_column_named_twice_is_an_error_naming_it(tmp_path):
    run = tmp_path / V1_RUN
    run.mkdir()
    (run / "grad_reduced_0-0.csv").write_text("vpp_stage,name,step,min,max,min\n0,w,0,1,2,3\n")
    (file,) = find_csv_files(tmp_path)
    with pytest.raises(ConfigError, match=r"grad_reduced_0-0.csv: the header names column 'min' twice"):
        read_table(file)


def test_empty_cells_micro_none_and_value_nan(tmp_path):
    folder = tmp_path / "rank_0"
    folder.mkdir()
    (folder / "weight_grad_step0-0.csv").write_text(
        "vpp_stage,step,module_name,scope,micro_step,min,max\n0,0,w,reduced,,1.5,\n0,0,w,unreduced,2,,3\n"
    )
    (file,) = find_csv_files(tmp_path)
    records = list(read_table(file).records())
    assert [r.micro_step for r in records] == [None, 2]
    assert records[0].values[0] == 1.5 and math.isnan(records[0].values[1]) and math.isnan(records[1].values[0])


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("0,w,9223372036854775808,1,2", r"row 1, column 'step': value '9223372036854775808' is outside the 64-bit"),
        ("0,w,-9223372036854775809,1,2", r"row 1, column 'step': value '-9223372036854775809' is outside"),
        ("0,w," + "9" * 5000 + ",1,2", r"row 1, column 'step': value '9999.*\.\.\.' is outside the 64-bit"),
        ("x,w,0,1,2", r"row 1, column 'vpp_stage': value 'x' is not an integer"),
        ("0,w,0,1,abc", r"row 1, column 'max': 'abc' is not a number"),
    ],
)
def test_bad_cells_name_file_row_and_column(tmp_path, row, message):
    run = tmp_path / V1_RUN
    run.mkdir()
    path = run / "grad_reduced_0-0.csv"
    path.write_text(f"vpp_stage,name,step,min,max\n{row}\n")
    (file,) = find_csv_files(tmp_path)
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: {message}"):
        read_table(file)
    good = "0,w,9223372036854775807,1,2"  # the largest step is fine
    path.write_text(f"vpp_stage,name,step,min,max\n{good}\n")
    assert read_table(file).int_column(2) == [2**63 - 1]


def test_ranks_and_steps_in_names_above_2_63(tmp_path):
    big = "9" * 30
    (tmp_path / f"rank_{big}").mkdir()
    (tmp_path / f"rank_{big}" / "param_step0-0.csv").write_text("vpp_stage,step,module_name,scope,min\n")
    with pytest.raises(ConfigError, match=rf"rank folder .*rank_{big}'?: rank '{big}' is outside the 64-bit range"):
        find_csv_files(tmp_path)
    other = tmp_path / "v2"
    (other / "rank_0").mkdir(parents=True)
    (other / "rank_0" / f"param_step0-{big}.csv").write_text("vpp_stage,step,module_name,scope,min\n")
    with pytest.raises(ConfigError, match=rf"param_step0-{big}.csv: last step '{big}' is outside the 64-bit range"):
        find_csv_files(other)


def test_a_feb29_run_folder_and_time_range(tmp_path):
    run = tmp_path / "Feb29_23-59-59-rank0-0c5cd257"
    run.mkdir()
    (run / "grad_reduced_0-0.csv").write_text("vpp_stage,name,step,min\n0,w,0,1\n")
    assert len(find_csv_files(tmp_path, time_start="Feb29_00-00-00", time_end="Mar01_00-00-00")) == 1
    assert find_csv_files(tmp_path, time_end="Feb29_23-59-59")


def test_entries_that_are_not_regular_files_are_skipped(tmp_path, caplog):
    run = write_reference_v1(tmp_path)
    (run / "exp_avg_0-1.csv").mkdir()
    os.mkfifo(run / "exp_avg_sq_0-1.csv")
    (run / "param_origin_0-1.csv").symlink_to("/dev/zero")
    files = find_csv_files(tmp_path)
    assert {f.data_type for f in files} == {"actv", "actv_grad", "grad_reduced", "other"}
    assert "exp_avg_0-1.csv: not a regular file (a folder, FIFO or device?), skipped, and 2 more" in caplog.text
    with pytest.raises(ConfigError, match=r"no monitor CSV of data types \['exp_avg'\] .*skipped 3 entries"):
        find_csv_files(tmp_path, data_types=["exp_avg"])


def test_a_torn_header_is_a_starting_run(tmp_path, caplog):
    folder = tmp_path / "rank_0"
    folder.mkdir()
    (folder / "param_step0-0.csv").write_text("vpp_stage,st")  # killed while writing the header
    (file,) = find_csv_files(tmp_path)
    table = read_table(file)
    assert (table.rows, table.ops, table.torn) == ([], (), 1)
    assert list(table.records()) == [] and "skipped 1 torn row(s)" in caplog.text


def test_the_reference_moe_router_tables_are_found(tmp_path):
    run = tmp_path / V1_RUN
    run.mkdir()
    (run / "moe_router_weight_hook_0-0.csv").write_text(
        "vpp_stage,name,step,router_weight_similarity\n0,0:layers.0.mlp.router,0,0.25\n"
    )
    (run / "moe_router_logit_hook_0-0.csv").write_text(
        "vpp_stage,name,step,micro_step,per_token_expert_entropy\n0,0:layers.0.mlp.router,0,0,1.5\n"
    )
    files = find_csv_files(tmp_path)
    assert [f.data_type for f in files] == ["moe_router_logit_hook", "moe_router_weight_hook"]
    assert [read_table(f).ops for f in files] == [("per_token_expert_entropy",), ("router_weight_similarity",)]
