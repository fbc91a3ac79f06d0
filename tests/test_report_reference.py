"""``trainprobe report`` on trees in the reference tool's layout (issue 14.3, 15.6): ``shape,dtype``
columns, a byte-order mark, root rows named ``.input``, the all-``nan`` row of a gradient never
computed, and ``anomaly.json`` tags with the ``acc_grad``/``post_grad`` tasks. Fixtures are written
by ``tests/reference_layouts.py`` and here; nothing of the reference is copied."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from reference_layouts import V1_HEADER, v1_text, v1_weight_rows, write_reference_v1
from trainprobe.engine.errors import ConfigError
from trainprobe.tools.reporting.data import event_group, event_target, load_report_data
from trainprobe.tools.reporting.report import write_report

NAN_STEP = 2


def _alert(tag: str, step: int, call: int) -> tuple[str, dict[str, object]]:
    entry = {
        "rank": 0,
        "step": step,
        "micro_step": 0,
        "pp_stage": 0,
        "vpp_stage": 0,
        "call_id": call,
        "tag_name": tag,
        "message": f"Rule AnomalyNan reports anomaly signal in ('{tag}', 'norm') at step {step}, current value nan.",
        "group_mates": [0],
    }
    return f"{tag}_step_{step}_call_{call}", entry


def write_tree(root: Path) -> Path:
    """A reference V1 tree of 3 steps: fc2.bias's reduced gradient NaN at step 2, a BOM in one
    file, alerts tagged with the gradient tasks."""
    run = write_reference_v1(root, steps=3)
    rows = [r for s in range(3) for r in v1_weight_rows(s)]
    for row in rows:
        if row[1] == "fc2.bias" and row[2] == NAN_STEP:
            row[3:8] = ["nan", "nan", "nan", 0, 4]
    (run / "grad_reduced_0-2.csv").write_text("\ufeff" + v1_text(V1_HEADER, rows), encoding="utf-8")
    alerts = dict(
        [
            _alert("0:fc2.bias/rank0/acc_grad", NAN_STEP, 7),
            _alert("0:fc2.bias/rank0/post_grad", NAN_STEP, 9),
            _alert("0:fc1.input:0/rank0/actv", NAN_STEP + 1, 1),
        ]
    )
    folder = root / "anomaly_detected" / "rank0"
    folder.mkdir(parents=True)
    (folder / "anomaly.json").write_text(json.dumps(alerts, indent=1), encoding="utf-8")
    return root


def test_reference_v1_rows_are_read_not_dropped(tmp_path):
    data = load_report_data(write_tree(tmp_path / "out"))
    assert data.torn == 0 and data.layouts == ("v1",)
    groups = {g.name: g for g in data.groups}
    assert set(groups) == {"actv", "actv_grad", "grad_reduced", "other"}
    assert groups["grad_reduced"].ops == ("min", "max", "norm", "zeros", "nans", "mean")  # no shape/dtype
    assert groups["grad_reduced"].rows == 12 and groups["actv"].rows == 12  # BOM file read whole
    assert groups["actv"].targets[0] == "fc1.input"
    assert groups["grad_reduced"].ranks[0].values[0, 0, 2] == pytest.approx(0.2)  # fc1.weight norm, step 0
    # the all-nan row of the never computed input gradient is no value and no anomaly
    assert groups["actv_grad"].targets == [".output"] and groups["actv_grad"].rows == 3
    first = data.first_nonfinite
    assert first is not None
    assert (event_group(first), event_target(first), first.data["step"]) == ("grad_reduced", "fc2.bias", NAN_STEP)
    assert [e.data["step"] for e in data.onsets] == [NAN_STEP]
    assert sorted(event_group(e) for e in data.alerts) == ["actv", "grad_reduced", "grad_unreduced"]
    assert {event_target(e) for e in data.alerts} == {"fc2.bias", "fc1.input"}


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainprobe", "report", *args], capture_output=True, text=True)


def test_cli_on_the_reference_tree_exits_0(tmp_path):
    done = _cli(str(write_tree(tmp_path / "out")), "-o", str(tmp_path / "r.html"))
    assert done.returncode == 0, done.stderr
    text = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert 'data-target="fc2.bias"' in text and "torn rows skipped: 0" in text


def test_a_tree_with_no_readable_row_exits_2(tmp_path):
    run = write_reference_v1(tmp_path / "out", steps=1)
    for file in run.glob("*.csv"):
        file.unlink()
    nothing = [[0, ".input", 0, 0, *(["nan"] * 8)]]  # only rows of tensors that never existed
    header = [
        "vpp_stage",
        "name",
        "step",
        "micro_step",
        "min",
        "max",
        "norm",
        "zeros",
        "nans",
        "mean",
        "shape",
        "dtype",
    ]
    (run / "actv_grad_0-0.csv").write_text(v1_text(header, nothing), encoding="utf-8")
    with pytest.raises(ConfigError, match="hold no complete row"):
        write_report(tmp_path / "out", tmp_path / "r.html")
    done = _cli(str(tmp_path / "out"), "-o", str(tmp_path / "r.html"))
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "hold no complete row" in done.stderr
    assert not (tmp_path / "r.html").exists()


def test_non_utf8_csv_is_one_line_naming_the_file(tmp_path):
    run = write_reference_v1(tmp_path / "out", steps=1)
    bad = run / "grad_reduced_0-0.csv"
    bad.write_bytes(v1_text(V1_HEADER, v1_weight_rows(0)).encode("utf-8").replace(b"fc1.bias", b"fc1.\xff\xfeias"))
    done = _cli(str(tmp_path / "out"), "-o", str(tmp_path / "r.html"))
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert str(bad) in done.stderr and "not UTF-8" in done.stderr
