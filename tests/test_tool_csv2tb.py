"""csv2tensorboard on real 2-rank V1 and V2 monitor output: event files read back with
TensorBoard's own reader and checked against the CSVs, parallel conversion, selection, the
command line and bad input."""

from __future__ import annotations

import inspect
import logging
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

from conftest import read_csv
from monitor_runs import NAN_RANK, NAN_STEP
from reference_layouts import write_reference_v1
from trainprobe.engine.errors import ConfigError
from trainprobe.tools.exports.tensorboard import csv2tensorboard_by_step

Scalars = dict[str, list[tuple[int, float | str]]]
V1_KEYS = ("vpp_stage", "name", "step", "micro_step")
V2_KEYS = ("vpp_stage", "step", "module_name", "scope", "micro_step")


# --------------------------------------------------------------------------- helpers


def _value(x: float) -> float | str:
    """As TensorBoard keeps it: float32; NaN as a string so that lists compare."""
    x = float(np.float32(x))
    return "nan" if math.isnan(x) else x


def read_events(folder: Path) -> Scalars:
    """Every scalar of the event file(s) in ``folder``, by tag, in file order."""
    acc = EventAccumulator(str(folder), size_guidance={SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, _value(e.value)) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def read_output(out: Path) -> dict[str, Scalars]:
    """``rank<r>/<data_type>`` → its scalars, for every folder holding an event file."""
    folders = sorted({p.parent for p in out.glob("rank*/*/events.out.tfevents.*")})
    return {f"{f.parent.name}/{f.name}": read_events(f) for f in folders}


def _v1_tag(row: dict[str, str]) -> str:
    vpp, name = row["vpp_stage"], row["name"]
    name = name.removeprefix(f"{vpp}:")
    micro = f":micro{row['micro_step']}" if row.get("micro_step") else ""
    return f"vp{vpp}:{name}{micro}"


def _v2_tag(row: dict[str, str]) -> str:
    micro = f":micro{row['micro_step']}" if row.get("micro_step") else ""
    return f"vp{row['vpp_stage']}:{row['module_name']}:{row['scope']}{micro}"


def expected_output(monitor: Path, layout: str, types: set[str] | None = None) -> dict[str, Scalars]:
    """What the event files must hold, computed from the CSVs with the csv module."""
    if layout == "v1":
        files = [(re.search(r"-rank(\d+)-", p.parent.name), p) for p in monitor.glob("*-rank*-*/*.csv")]
        pattern, keys, tag = r"^(.+?)_\d+-\d+\.csv$", V1_KEYS, _v1_tag
    else:
        files = [(re.search(r"rank_(\d+)", p.parent.name), p) for p in monitor.glob("rank_*/*.csv")]
        pattern, keys, tag = r"^(.+?)_step\d+-\d+\.csv$", V2_KEYS, _v2_tag
    out: dict[str, Scalars] = {}
    for rank, path in files:
        data_type = re.match(pattern, path.name)[1]
        if types is not None and data_type not in types:
            continue
        header, rows = read_csv(path)
        ops = [c for c in header if c not in keys and c not in ("shape", "dtype")]  # text, not scalars
        scalars = out.setdefault(f"rank{rank[1]}/{data_type}", {})
        for row in rows:
            for op in ops:
                scalars.setdefault(f"{tag(row)}/{op}", []).append((int(row["step"]), _value(float(row[op]))))
    return {folder: {t: sorted(v, key=lambda e: e[0]) for t, v in s.items()} for folder, s in out.items()}


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "trainprobe", "csv2tb", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=cwd)


@pytest.fixture(scope="module")
def v2_events(monitor_runs, tmp_path_factory) -> dict[str, Scalars]:
    """The V2 output converted once with process_num=1."""
    out = tmp_path_factory.mktemp("v2_events")
    csv2tensorboard_by_step(monitor_runs.v2, None, None, output_dirpath=out)
    return read_output(out)


# --------------------------------------------------------------------------- conversion


def test_v1_events_match_the_csvs(monitor_runs, tmp_path):
    out = tmp_path / "tb"
    assert csv2tensorboard_by_step(monitor_runs.v1, None, None, output_dirpath=out) == out
    for folder in out.glob("rank*/*"):
        assert len(list(folder.glob("events.out.tfevents.*"))) == 1, folder
    got = read_output(out)
    assert got == expected_output(monitor_runs.v1, "v1")
    assert {"rank0/grad_reduced", "rank1/actv", "rank0/other", "rank1/exp_avg_sq"} <= set(got)
    assert [s for s, _ in got["rank0/grad_reduced"]["vp0:fc1.weight/min"]] == list(range(6))
    assert [s for s, _ in got["rank0/actv"]["vp0:fc1.input:micro1/max"]] == list(range(6))
    assert "vp0:fc1.input:micro0/min" in got["rank1/actv"]
    nans = dict(got[f"rank{NAN_RANK}/grad_reduced"]["vp0:fc2.bias/nans"])
    assert nans[NAN_STEP] > 0 and all(nans[s] == 0 for s in range(NAN_STEP))
    assert dict(got[f"rank{NAN_RANK}/param_updated"]["vp0:fc2.bias/min"])[NAN_STEP] == "nan"


def test_v2_events_match_the_csvs(monitor_runs, v2_events):
    assert v2_events == expected_output(monitor_runs.v2, "v2")
    assert set(v2_events) == {
        f"rank{r}/{t}" for r in (0, 1) for t in ("module", "weight_grad", "optimizer", "param", "cc")
    }
    grads = v2_events["rank0/weight_grad"]
    assert {"vp0:fc1.weight:unreduced:micro1/norm", "vp0:fc1.weight:reduced:micro1/min"} <= set(grads)
    assert "vp0:fc1.input.0:forward/max" in v2_events["rank1/module"]  # no micro-batches: no micro_step
    assert "vp0:fc1.weight.exp_avg:exp_avg/mean" in v2_events["rank0/optimizer"]


def test_process_num_2_converts_in_worker_processes_with_the_same_result(monitor_runs, v2_events, tmp_path, caplog):
    copy = tmp_path / "v2"
    shutil.copytree(monitor_runs.v2, copy)
    torn = next((copy / "rank_1").glob("module_step3-*.csv"))
    with torn.open("a", encoding="utf-8") as fh:
        fh.write("0,6,fc1.input.0,forw")  # killed mid-row: no newline
    out = tmp_path / "parallel"
    with caplog.at_level(logging.WARNING, logger="trainprobe"):
        csv2tensorboard_by_step(copy, None, None, process_num=2, output_dirpath=out)
    assert read_output(out) == v2_events
    pids = {p.name.split(".")[4] for p in out.glob("rank*/*/events.out.tfevents.*")}
    assert str(os.getpid()) not in pids
    said = [r.getMessage() for r in caplog.records if "torn" in r.getMessage()]
    assert len(said) == 1 and str(torn) in said[0]  # a worker's warning, said by the caller


def test_data_type_list_selects_folders(monitor_runs, tmp_path):
    csv2tensorboard_by_step(
        monitor_runs.v1, None, None, data_type_list=["grad_reduced", "actv"], output_dirpath=tmp_path
    )
    got = read_output(tmp_path)
    assert set(got) == {"rank0/grad_reduced", "rank1/grad_reduced", "rank0/actv", "rank1/actv"}
    assert got == expected_output(monitor_runs.v1, "v1", {"grad_reduced", "actv"})


def test_time_range_selects_v1_run_folders(monitor_runs, tmp_path):
    copy = tmp_path / "v1"
    shutil.copytree(monitor_runs.v1, copy)
    rank1 = next(copy.glob("*-rank1-*"))
    rank1.rename(copy / re.sub(r"^[A-Z][a-z]{2}\d{2}_\d{2}-\d{2}-\d{2}", "Jan01_00-00-00", rank1.name))
    stamp0 = next(copy.glob("*-rank0-*")).name.split("-rank")[0]

    def ranks(start: str | None, end: str | None) -> set[str]:
        out = tmp_path / f"out_{start}_{end}"
        csv2tensorboard_by_step(copy, start, end, data_type_list=["param_origin"], output_dirpath=out)
        return {p.name for p in out.iterdir()}

    assert ranks(None, None) == {"rank0", "rank1"}
    assert ranks(stamp0, stamp0) == {"rank0"}
    assert ranks(None, "Jan01_00-00-00") == {"rank1"}
    assert ranks("Jan01_00-00-00", "Dec31_23-59-59") == {"rank0", "rank1"}
    with pytest.raises(ConfigError, match="no monitor CSV"):
        csv2tensorboard_by_step(copy, "Jan02_00-00-00", "Jan03_00-00-00", output_dirpath=tmp_path / "none")
    assert not (tmp_path / "none").exists()


def test_default_output_folder_is_timestamped_in_the_current_folder(monitor_runs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = csv2tensorboard_by_step(monitor_runs.v2, None, None, data_type_list=["cc"])
    assert re.fullmatch(r"\d{14}_csv2tensorboard_by_step", str(out))
    assert [p.name for p in tmp_path.iterdir()] == [str(out)]
    assert set(read_output(tmp_path / out)) == {"rank0/cc", "rank1/cc"}


def test_rerun_into_the_same_folder_replaces_the_event_files(monitor_runs, tmp_path):
    for _ in range(2):
        csv2tensorboard_by_step(monitor_runs.v2, None, None, data_type_list=["param"], output_dirpath=tmp_path)
    assert len(list(tmp_path.glob("rank0/param/events.out.tfevents.*"))) == 1
    assert read_output(tmp_path) == expected_output(monitor_runs.v2, "v2", {"param"})


def test_compat_import_path_and_signature():
    from trainprobe.pytorch.monitor.csv2tb import csv2tensorboard_by_step as compat

    assert compat is csv2tensorboard_by_step
    params = inspect.signature(compat).parameters
    assert list(params) == ["monitor_path", "time_start", "time_end", "process_num", "data_type_list", "output_dirpath"]
    assert params["process_num"].default == 1 and params["data_type_list"].default is None


# --------------------------------------------------------------------------- torn rows


def test_torn_last_line_is_skipped_and_said_once(monitor_runs, tmp_path, caplog):
    copy = tmp_path / "v2"
    shutil.copytree(monitor_runs.v2, copy)
    torn = next((copy / "rank_0").glob("weight_grad_step3-*.csv"))
    with torn.open("a", encoding="utf-8") as fh:
        fh.write("0,6,fc1.weight,reduced,1,-0.05,0.0")  # killed mid-row: no newline
    with caplog.at_level(logging.WARNING, logger="trainprobe"):
        csv2tensorboard_by_step(copy, None, None, 1, ["weight_grad"], tmp_path / "out")
    said = [r.getMessage() for r in caplog.records if "torn" in r.getMessage()]
    assert len(said) == 1 and str(torn) in said[0] and "skipped 1 torn row" in said[0]
    assert read_output(tmp_path / "out") == expected_output(monitor_runs.v2, "v2", {"weight_grad"})


# --------------------------------------------------------------------------- bad input


def test_bad_input_raises_config_error_and_writes_nothing(monitor_runs, tmp_path):
    out = tmp_path / "out"
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        ((tmp_path / "nope", None, None), {}, "does not exist"),
        ((empty, None, None), {}, "no monitor CSV found"),
        ((monitor_runs.v1, None, None), {"data_type_list": ["grads"]}, r"unknown data type\(s\) \['grads'\]"),
        ((monitor_runs.v1, None, None), {"data_type_list": "actv"}, "expected a list of data types"),
        ((monitor_runs.v1, "Jan02_00-00-00", "Jan01_00-00-00"), {}, "time_start: 'Jan02_00-00-00' is after time_end"),
        ((monitor_runs.v1, "yesterday", None), {}, "time_start: 'yesterday' is not a monitor timestamp"),
        ((monitor_runs.v1, None, None), {"process_num": 0}, "process_num: expected an integer >= 1"),
        ((monitor_runs.v1, None, None), {"process_num": True}, "process_num"),
    ]
    for args, kwargs, message in cases:
        with pytest.raises(ConfigError, match=message):
            csv2tensorboard_by_step(*args, **kwargs, output_dirpath=out)
        assert not out.exists()
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ConfigError, match="exists and is not a folder"):
        csv2tensorboard_by_step(monitor_runs.v2, None, None, output_dirpath=a_file)


def test_empty_csv_file_of_a_starting_run_is_skipped(monitor_runs, tmp_path, caplog):
    copy = tmp_path / "v2"
    shutil.copytree(monitor_runs.v2, copy)
    (copy / "rank_0" / "cc_step6-8.csv").write_text("")
    out = csv2tensorboard_by_step(copy, None, None, data_type_list=["cc"], output_dirpath=tmp_path / "out")
    assert "cc_step6-8.csv: empty" in caplog.text
    assert list((out / "rank0" / "cc").glob("events.out.tfevents.*"))


# --------------------------------------------------------------------------- command line


def test_cli_converts_and_summarises(monitor_runs, tmp_path):
    out = tmp_path / "cli"
    args = ["--data-type", "grad_reduced", "exp_avg", "--process-num", "1", "-o", str(out)]
    result = run_cli(str(monitor_runs.v1), *args)
    assert result.returncode == 0, result.stderr
    assert "wrote 4 event file(s) for 2 rank(s)" in result.stdout
    assert f"tensorboard --logdir {out}" in result.stdout
    assert read_output(out) == expected_output(monitor_runs.v1, "v1", {"grad_reduced", "exp_avg"})


BAD_CLI_CASES = [
    (["{tmp}/nope"], "monitor_path: '{tmp}/nope' does not exist"),
    (["{tmp}"], "no monitor CSV found"),
    (["{v1}", "--data-type", "grads"], "unknown data type(s) ['grads']"),
    (["{v1}", "--time-start", "Jan02_00-00-00", "--time-end", "Jan01_00-00-00"], "is after time_end"),
    (["{v1}", "--time-end", "yesterday"], "time_end: 'yesterday' is not a monitor timestamp"),
    (["{v1}", "--process-num", "0"], "process_num: expected an integer >= 1"),
]


def _fill(monitor_runs, tmp_path: Path, args: list[str], message: str) -> tuple[list[str], str]:
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    fill = {"tmp": str(work), "v1": str(monitor_runs.v1)}
    return [a.format(**fill) for a in args] + ["-o", str(tmp_path / "out")], message.format(**fill)


@pytest.mark.parametrize(("args", "message"), BAD_CLI_CASES)
def test_cli_main_bad_input_returns_2_with_one_line(monitor_runs, tmp_path, capsys, args, message):
    from trainprobe.cli import main

    argv, message = _fill(monitor_runs, tmp_path, args, message)
    assert main(["csv2tb", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trainprobe csv2tb: error: ") and message in err[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("args", "message"), [BAD_CLI_CASES[0], BAD_CLI_CASES[3]])
def test_cli_bad_input_exits_2_with_one_line(monitor_runs, tmp_path, args, message):
    argv, message = _fill(monitor_runs, tmp_path, args, message)
    result = run_cli(*argv, cwd=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainprobe csv2tb: error: "), result.stderr
    assert message in lines[0]
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- the reference tool's layouts


def test_reference_v1_layout_gives_the_reference_tags(tmp_path):
    """The reference V1 layout (``shape,dtype`` columns, names without a chunk prefix): tags as
    the reference's csv2tb writes them, ``vp<vpp>:<name>[:micro<m>]/<op>``, no shape or dtype tag."""
    write_reference_v1(tmp_path / "monitor")
    got = read_output(csv2tensorboard_by_step(tmp_path / "monitor", None, None, output_dirpath=tmp_path / "tb"))
    assert set(got) == {"rank0/actv", "rank0/actv_grad", "rank0/grad_reduced", "rank0/other"}
    assert got["rank0/actv"]["vp0:fc1.input:micro0/max"] == [(0, _value(0.5)), (1, _value(0.6))]
    assert got["rank0/grad_reduced"]["vp0:fc2.bias/norm"] == [(0, _value(0.2)), (1, _value(1.2))]
    assert got["rank0/actv_grad"]["vp0:.input:micro0/min"] == [(0, "nan"), (1, "nan")]
    assert not [tag for tags in got.values() for tag in tags if tag.endswith(("/shape", "/dtype"))]
    assert len(got["rank0/actv"]) == 4 * 6


def test_a_parquet_run_gives_the_same_events(monitor_runs, v2_events, tmp_path):
    """The V2 run converted to Parquet (``trainprobe convert``) gives the same tags, steps and
    values as its CSV files."""
    from trainprobe.tools.query.convert import convert_run

    copy = tmp_path / "v2"
    shutil.copytree(monitor_runs.v2, copy)
    convert_run(copy, remove_csv=True)
    assert not list(copy.rglob("*.csv"))
    out = tmp_path / "from_parquet"
    csv2tensorboard_by_step(copy, None, None, output_dirpath=out)
    assert read_output(out) == v2_events
