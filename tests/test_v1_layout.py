"""Monitor V1 output layout as the spec and the reference write it: the ``name`` column, row names
of activations and their gradients, ``shape,dtype``, ``stack_info.csv``, TensorBoard and alert tags."""

from __future__ import annotations

import csv
import io
import json
import math

import pytest
import torch
from torch import nn

from conftest import read_csv
from models import MLP
from test_v1_support import by_name, make_v1, run_dir, table
from trainprobe.engine.probes.model_view import NamedParam
from trainprobe.engine.records import RowKey
from trainprobe.engine.sinks.csv_sink import TableLayout
from trainprobe.frontdoors.monitor_v1 import output
from trainprobe.frontdoors.monitor_v1.naming import bare
from trainprobe.frontdoors.monitor_v1.shapes import ShapeBook


class Trio(nn.Module):
    """Three inputs, a tuple of two outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, a, b, c):
        y = self.lin(a + b * c)
        return y, 2 * y


class TrioNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trio = Trio()
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        y, z = self.trio(x, x + 1, x - 1)
        return self.head(y + z)


def _run(tmp_path, monkeypatch, model, cfg, steps=2, batch=(4, 6)):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = make_v1(tmp_path, monkeypatch, {"ndigits": 12, **cfg})
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    for _ in range(steps):
        model(torch.randn(*batch)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    mon.stop()
    return run_dir(tmp_path)


def test_layout_keeps_trailing_columns_and_bare_names_on_both_line_paths():
    """The fast (template) and slow (NaN count) lines equal what the csv module writes."""
    described = []

    def describe(key: RowKey) -> tuple[str, str]:
        described.append(key)
        return "[4, 16]", "torch.float%32"

    layout = TableLayout(False, ("norm", "nans"), ("vpp_stage", "name", "step"), 6, bare, ("shape", "dtype"), describe)
    assert layout.header == ["vpp_stage", "name", "step", "norm", "nans", "shape", "dtype"]
    key = RowKey(1, "1:fc1.weight", "reduced")
    text = layout.text([(key, [2.0, 0.0]), (key, [math.nan, math.nan])], 3)
    expected = io.StringIO()
    out = csv.writer(expected, lineterminator="\n")
    out.writerow([1, "fc1.weight", 3, 2.0, 0, "[4, 16]", "torch.float%32"])
    out.writerow([1, "fc1.weight", 3, "nan", "nan", "[4, 16]", "torch.float%32"])
    assert text == expected.getvalue()
    assert layout.cells(key, 3, [2.0, 0.0])[-2:] == ["[4, 16]", "torch.float%32"]
    layout.text([(key, [1.0, 0.0])], 4)
    assert described.count(key) <= 3  # once for the template, once per slow line, once for cells()


def test_names_shapes_and_gradient_rows_as_the_reference_writes_them(tmp_path, monkeypatch):
    cfg = {"xy_distribution": True, "all_xy": True, "wg_distribution": True, "ops": ["norm"]}
    folder = _run(tmp_path, monkeypatch, TrioNet(), cfg)
    header = read_csv(folder / "actv_0-0.csv")[0]
    assert header == ["vpp_stage", "name", "step", "micro_step", "norm", "shape", "dtype"]
    actv = {r["name"] for r in table(folder, "actv")}
    assert actv == {
        ".input",
        ".output",
        "trio.input_0",
        "trio.input_1",
        "trio.input_2",
        "trio.output_0",
        "trio.output_1",
        "trio.lin.input",
        "trio.lin.output",
        "head.input",
        "head.output",
    }
    grads = {r["name"] for r in table(folder, "actv_grad")}
    assert {"trio.output_0", "trio.output_1", "head.input", ".output"} <= grads
    assert not any(n.endswith("_grad") for n in grads)
    row = by_name(table(folder, "actv_grad"), "0:trio.output_1")[0]
    assert (row["vpp_stage"], row["shape"], row["dtype"]) == ("0", "[4, 6]", "torch.float32")
    head = by_name(table(folder, "grad_reduced"), "0:head.weight")[0]
    assert (head["name"], head["shape"], head["dtype"]) == ("head.weight", "[2, 6]", "torch.float32")


def test_main_grad_describes_gradient_rows():
    param = nn.Parameter(torch.ones(3, 2, dtype=torch.bfloat16))
    param.main_grad = torch.zeros(3, 2)
    book = ShapeBook(lambda p: getattr(p, "main_grad", None))
    book.add_params([NamedParam(0, "0:w", param)])
    assert book(RowKey(0, "0:w", "reduced")) == ("[3, 2]", "torch.float32")
    assert book(RowKey(0, "0:w", "param_origin")) == ("[3, 2]", "torch.bfloat16")
    assert book(RowKey(0, "0:w", "mg_direction")) == ("[]", "torch.float64")
    assert book(RowKey(0, "all_reduce.0.out.0@x.py[1]", "comm")) == ("", "")


def test_stack_info_and_mg_direction_names(tmp_path, monkeypatch):
    cfg = {"stack_info": True, "mg_direction": True, "ops": ["norm", "nans"]}
    folder = _run(tmp_path, monkeypatch, MLP(), cfg, steps=3)
    header, rows = read_csv(folder / "stack_info.csv")
    assert header == ["module_name", "stack_info"]
    assert [r["module_name"] for r in rows] == ["0:", "0:fc1", "0:act", "0:fc2"]
    other = table(folder, "other")
    assert {r["name"] for r in other} == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    assert read_csv(folder / "other_1-1.csv")[0] == ["vpp_stage", "name", "step", "norm", "nans", "shape", "dtype"]


@pytest.mark.parametrize("mbs", [False, True])
def test_tags_follow_the_spec_and_the_reference_tasks(mbs):
    tag = output.tag_of(3, mbs)
    assert tag("actv", RowKey(0, "0:fc1.input", "actv", 1), "norm") == "0:fc1.input:1/rank3/actv_norm"
    assert tag("actv_grad", RowKey(1, "1:.output", "actv_grad", 0), "max") == "1:.output:0/rank3/actv_grad_max"
    assert tag("grad_reduced", RowKey(0, "0:w", "reduced", 1), "norm") == "0:w/rank3/post_grad_norm"
    unreduced = tag("grad_unreduced", RowKey(0, "0:w", "unreduced", 1), "norm")
    assert unreduced == ("0:w:1/rank3/acc_grad_norm" if mbs else "0:w/rank3/acc_grad_norm")
    assert tag("other", RowKey(0, "0:w", "mg_direction"), "mean") == "0:w/rank3/mg_direction_mean"
    assert tag("exp_avg", RowKey(0, "0:w", "exp_avg"), "min") == "0:w/rank3/exp_avg_min"
    assert tag("adam_update_histogram", RowKey(0, "0:w", "adam_update_histogram"), "") == (
        "0:w/rank3/adam_update_histogram"
    )


def test_alert_tags_carry_the_micro_step_of_activations(tmp_path, monkeypatch):
    torch.manual_seed(0)
    cfg = {
        "xy_distribution": True,
        "all_xy": True,
        "wg_distribution": True,
        "ops": ["norm"],
        "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.0001}}], "dump": True},
    }
    _run(tmp_path, monkeypatch, MLP(), cfg, steps=3)
    dump = json.loads((tmp_path / "out" / "anomaly_detected" / "rank0" / "anomaly.json").read_text())
    tags = {e["tag_name"] for e in dump.values()}
    assert "0:fc1.output:0/rank0/actv" in tags
    assert "0:fc1.output:0/rank0/actv_grad" in tags
    assert "0:fc1.weight/rank0/post_grad" in tags and "0:fc1.weight/rank0/acc_grad" in tags
    assert all(key.startswith(entry["tag_name"] + "_step_") for key, entry in dump.items())
