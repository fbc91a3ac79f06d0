"""The harness's own pieces on small hand-written inputs (fast; run by ``make interop``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from compat_doc import intermittent_ids, known_details, listed_ids, mismatch, table
from differ import Diff, diff_anomalies, diff_csv_trees, diff_dumps, diff_module_struct, diff_run_folder_clock
from runs import ref_python

HEADER = "vpp_stage,name,step,micro_step,min,max,norm,mean\n"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def ids(diffs: list[Diff]) -> set[str]:
    return {d.id for d in diffs}


def test_csv_trees_normalise_run_folders_and_windows_and_compare_to_1e5(tmp_path: Path) -> None:
    write(tmp_path / "a/Dec03_21-34-40-rank0-1a2b/actv_0-0.csv", HEADER + "0,0:fc.input,0,0,-1.0,2.0,3.0,0.5\n")
    write(tmp_path / "b/Nov24_10-00-00-rank0-ffff/actv_0-0.csv", HEADER + "0,0:fc.input,0,0,-1.0,2.0,3.00001,0.5\n")
    assert diff_csv_trees("v1", tmp_path / "a", tmp_path / "b") == []
    write(tmp_path / "b/Nov24_10-00-00-rank0-ffff/actv_0-0.csv", HEADER + "0,0:fc.input,0,0,-1.0,2.0,3.1,0.5\n")
    assert ids(diff_csv_trees("v1", tmp_path / "a", tmp_path / "b")) == {"v1/rank0/actv: values of norm"}


def test_csv_trees_report_headers_keys_and_files(tmp_path: Path) -> None:
    write(tmp_path / "a/rank_0/module_step0-1.csv", "vpp_stage,step,module_name,scope,min\n-1,0,fc.input.0,forward,1\n")
    write(
        tmp_path / "b/rank_0/module_step0-1.csv",
        "vpp_stage,step,module_name,scope,micro_step,min\n0,0,fc.input.0,forward,0,2\n",
    )
    write(
        tmp_path / "b/rank_0/param_step0-1.csv", "vpp_stage,step,module_name,scope,min\n0,0,fc.weight,param_origin,1\n"
    )
    found = diff_csv_trees("v2", tmp_path / "a", tmp_path / "b")
    assert ids(found) == {
        "v2: files only in trainprobe",
        "v2/rank_0/module: header",
        "v2/rank_0/module: rows only in reference",
        "v2/rank_0/module: rows only in trainprobe",
        "v2/rank_0/module: values of min",  # compared on rows matched without vpp_stage
    }
    values = next(d for d in found if d.id.endswith("values of min"))
    assert "1 vs 2" in values.detail


def test_anomalies_compare_events_and_wording_not_numbers(tmp_path: Path) -> None:
    def event(tag: str, step: int, call: int, msg: str) -> dict[str, object]:
        return {"rank": 0, "step": step, "call_id": call, "tag_name": tag, "message": msg}

    a = {"t_step_1_call_0": event("t", 1, 0, "signal in ('t', 'min') at step 1, value 0.5.")}
    b = {
        "t_step_1_call_3": event("t", 1, 3, "signal in ('t', 'min') at step 1, value 0.25."),
        "u_step_1_call_4": event("u", 1, 4, "x"),
    }
    found = diff_anomalies(
        "v1/anomaly.json", write(tmp_path / "a.json", json.dumps(a)), write(tmp_path / "b.json", json.dumps(b))
    )
    assert ids(found) == {"v1/anomaly.json: events only in trainprobe"}


def test_dumps_normalise_proc_folders_and_compare_statistics(tmp_path: Path) -> None:
    entry = {"input_args": [{"type": "torch.Tensor", "shape": [2], "Max": 1.0, "Min": -1.0, "Mean": 1e-9, "Norm": 1.4}]}
    for side, pid, mean in (("a", 11, 1e-9), ("b", 22, 3e-9)):
        data = {"Functional.relu.0.forward": {**entry, "input_args": [{**entry["input_args"][0], "Mean": mean}]}}
        rank = tmp_path / side / "step0" / f"proc{pid}"
        write(
            rank / "dump.json",
            json.dumps({"task": "statistics", "level": "L1", "dump_data_dir": str(rank), "data": data}),
        )
        write(rank / "construct.json", "{}")
        stack = {"0": [["Functional.relu.0.forward"], [f"File /x/{side}/train.py, line {pid}, in main, \n y = f(x)"]]}
        write(rank / "stack.json", json.dumps(stack))
    # a mean near zero is compared against 1e-5 of the tensor's magnitude; paths and lines normalised
    assert diff_dumps("dump-L1", tmp_path / "a", tmp_path / "b") == []
    (tmp_path / "b/step0/proc22/stack.json").write_text(
        json.dumps({"Functional.relu.0.forward": ["File t/train.py, line 1, in main, \n y = f(x)"]})
    )
    assert ids(diff_dumps("dump-L1", tmp_path / "a", tmp_path / "b")) == {"dump-L1/stack.json: layout"}


def test_doc_table_round_trip_and_mismatch_message(tmp_path: Path) -> None:
    diffs = [Diff("v1/x: header", "a | b"), Diff("dump-L0/y: layout", "c")]
    doc = write(tmp_path / "compatibility.md", "# t\n\n| a | b |\n|---|---|\n| `v9` | z |\n\n" + table(diffs) + "\n")
    assert listed_ids(doc) == {"v1/x: header", "dump-L0/y: layout"}
    message = mismatch([*diffs[:1], Diff("v2/new: header", "d")], listed_ids(doc))
    assert "NEW  v2/new: header: d" in message
    assert "GONE dump-L0/y: layout" in message
    assert mismatch(diffs, listed_ids(doc)) == ""


def test_an_intermittent_row_may_be_absent_but_never_hides_a_new_difference(tmp_path: Path) -> None:
    diffs = [Diff("v1/x: header", "a"), Diff("dump-scope/dump.json: values of md5", "b")]
    text = table(diffs, {"dump-scope/dump.json: values of md5": ["**Intermittent:** a race in the reference", "d"]})
    doc = write(tmp_path / "compatibility.md", text + "\n")
    assert intermittent_ids(doc) == {"dump-scope/dump.json: values of md5"}
    assert known_details(doc)["dump-scope/dump.json: values of md5"] == "b"
    assert mismatch(diffs[:1], listed_ids(doc), intermittent_ids(doc)) == ""
    assert mismatch(diffs, listed_ids(doc), intermittent_ids(doc)) == ""
    assert "GONE v1/x: header" in mismatch(diffs[1:], listed_ids(doc), intermittent_ids(doc))
    assert "NEW  v2/y: header" in mismatch([*diffs, Diff("v2/y: header", "c")], listed_ids(doc), intermittent_ids(doc))


def test_without_the_reference_the_harness_says_to_run_make_interop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRAINPROBE_REF_PYTHON", raising=False)
    with pytest.raises(RuntimeError, match=r"TRAINPROBE_REF_PYTHON .* run `make interop`"):
        ref_python()


def test_shared_row_keys_are_a_difference_only_when_the_sides_disagree(tmp_path: Path) -> None:
    row = "0,0:block.input,0,0,-1.0,2.0,3.0,0.5\n"
    write(tmp_path / "a/Dec03_21-34-40-rank0-1a2b/actv_0-0.csv", HEADER + row + row)
    write(tmp_path / "b/Nov24_10-00-00-rank0-ffff/actv_0-0.csv", HEADER + row + row)
    assert diff_csv_trees("v1", tmp_path / "a", tmp_path / "b") == []
    write(tmp_path / "b/Nov24_10-00-00-rank0-ffff/actv_0-0.csv", HEADER + row)
    assert ids(diff_csv_trees("v1", tmp_path / "a", tmp_path / "b")) == {"v1/rank0/actv: duplicate row keys"}


def test_module_struct_parts_and_names(tmp_path: Path) -> None:
    entry = {"input": {"config": "list[1]", "0": "size=(2, 3), dtype=torch.float32"}}
    a = write(tmp_path / "a.json", json.dumps({"0:": entry, "0:fc": entry}))
    b = write(tmp_path / "b.json", json.dumps({"0:root": entry, "0:fc": {"input": {"config": "tensor"}}}))
    assert ids(diff_module_struct("s", a, b)) == {
        "s: names only in reference",
        "s: names only in trainprobe",
        "s: input",
    }
    assert diff_module_struct("s", a, a) == []


def test_run_folder_clock(tmp_path: Path) -> None:
    import calendar
    import os
    import time

    for side, stamp in (("a", "Jan02_08-00-00"), ("b", "Jan02_00-00-00")):
        f = write(tmp_path / side / f"{stamp}-rank0-1a2b" / "actv_0-0.csv", HEADER)
        when = calendar.timegm(time.strptime("2026-01-02 00:00:05", "%Y-%m-%d %H:%M:%S"))  # written at 00:00:05 UTC
        os.utime(f, (when, when))
    assert [d.detail for d in diff_run_folder_clock("v1", tmp_path / "a", tmp_path / "b")] == [
        "reference UTC+8h, trainprobe UTC+0h (TZ=UTC)"
    ]
