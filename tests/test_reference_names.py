"""Names and headers users switching from the reference rely on (docs/compatibility.md):

* Monitor V2's ``module`` table has a ``micro_step`` column only when micro-batches are
  configured (spec: "available only when micro-batch is enabled"); without, its header is the
  reference's ``vpp_stage,step,module_name,scope,<ops>``, in CSV and in Parquet.
* The root module's V2 rows use its empty name: ``.input.0`` (``0:.input.0`` in a chunk list).
* Monitor V1 names a tuple output of several entries by position even when one entry is a
  tensor: ``nn.MultiheadAttention``'s ``(out, None)`` gives ``output_0`` (no row for the None).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from conftest import read_csv, rows_of, write_config
from models import MLP
from test_v1_support import make_v1, run_dir, table
from trainprobe import TrainerMonitorV2

OPS = ["min", "max", "mean", "norm", "nans"]
REFERENCE_MODULE_HEADER = ["vpp_stage", "step", "module_name", "scope", *OPS]


def _run_v2(tmp_path: Path, acc: int, *, config: dict[str, Any] | None = None, **start: Any) -> Path:
    """Two steps of an MLP with ``acc`` micro-batches each under the module monitor."""
    out = tmp_path / "out"
    cfg = {"output_dir": str(out), "monitors": {"module": {"enabled": True, "ops": OPS}}, **(config or {})}
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2(write_config(tmp_path, cfg))
    mon.start(model=model, optimizer=opt, **start)
    for _ in range(2):
        for _ in range(acc):
            model(torch.randn(4, 6)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    mon.stop()
    return out


def test_v2_module_header_is_the_references_without_micro_batches(tmp_path: Path) -> None:
    out = _run_v2(tmp_path, 1)
    [first, *_] = sorted((out / "rank_0").glob("module_*.csv"))
    header, rows = read_csv(first)
    assert header == REFERENCE_MODULE_HEADER
    assert rows and all(len(r) == len(header) for r in rows)


@pytest.mark.parametrize(
    ("config", "start"),
    [
        ({}, {"grad_acc_steps": 2}),
        ({}, {"micro_batch_number": 2}),
        ({"monitors": {"module": {"enabled": True, "ops": OPS}, "weight_grad": {"grad_acc_steps": 2}}}, {}),
    ],
    ids=["start-grad_acc_steps", "start-micro_batch_number", "config-grad_acc_steps"],
)
def test_v2_module_micro_step_column_with_micro_batches(
    tmp_path: Path, config: dict[str, Any], start: dict[str, Any]
) -> None:
    out = _run_v2(tmp_path, 2, config=config, **start)
    [first, *_] = sorted((out / "rank_0").glob("module_*.csv"))
    assert read_csv(first)[0] == ["vpp_stage", "step", "module_name", "scope", "micro_step", *OPS]
    rows = rows_of(out, "module")
    assert {r["micro_step"] for r in rows if r["module_name"] == "fc1.input.0"} == {"0", "1"}


def test_v2_module_parquet_follows_the_csv_layout(tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    plain = _run_v2(tmp_path / "plain", 1, config={"format": "parquet"})
    [first, *_] = sorted((plain / "rank_0").glob("module_*.parquet"))
    assert pq.read_table(first).column_names == REFERENCE_MODULE_HEADER
    micro = _run_v2(tmp_path / "micro", 2, config={"format": "parquet"}, grad_acc_steps=2)
    [first, *_] = sorted((micro / "rank_0").glob("module_*.parquet"))
    assert "micro_step" in pq.read_table(first).column_names


def test_v2_root_rows_use_the_empty_name(tmp_path: Path) -> None:
    out = _run_v2(tmp_path, 1)
    names = {r["module_name"] for r in rows_of(out, "module")}
    assert {".input.0", ".output.0", ".grad_output.0"} <= names
    assert not any(n.startswith("root") for n in names)


def test_v2_root_rows_of_a_chunk_list_carry_only_the_prefix(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cfg = {"output_dir": str(out), "monitors": {"module": {"enabled": True, "ops": OPS}}}
    chunks = [nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 2))]
    opt = torch.optim.SGD([p for c in chunks for p in c.parameters()], lr=0.1)
    mon = TrainerMonitorV2(write_config(tmp_path, cfg))
    mon.start(model=chunks, optimizer=opt)
    chunks[1](chunks[0](torch.randn(3, 4))).sum().backward()
    opt.step()
    mon.stop()
    rows = {(r["vpp_stage"], r["module_name"]) for r in rows_of(out, "module")}
    # as the reference writes them: "<i>:" + "" + ".input.0"
    assert {("0", "0:.input.0"), ("0", "0:.output.0"), ("1", "1:.input.0"), ("1", "1:.grad_output.0")} <= rows
    assert ("0", "0:0.input.0") in rows


class _Attention(nn.Module):
    """An attention layer (its output is ``(out, None)`` with ``need_weights=False``) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.attn(x, x, x, need_weights=False)
        return self.head(out)


def test_v1_one_tensor_tuple_output_is_named_by_position(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = _Attention()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"targets": {}, "xy_distribution": True, "all_xy": True, "ops": ["min", "max", "norm"]}
    mon = make_v1(tmp_path, monkeypatch, cfg)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    for _ in range(2):
        model(torch.randn(2, 3, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    mon.stop()
    folder = run_dir(tmp_path)
    for kind in ("actv", "actv_grad"):
        names = {r["name"] for r in table(folder, kind)}
        assert "attn.output_0" in names, (kind, sorted(names))
        assert "attn.output" not in names
        assert "attn.output_1" not in names  # the None: no (NaN) row
        assert "head.output" in names  # a plain tensor output keeps its name
    actv = {r["name"] for r in table(folder, "actv")}
    assert {"attn.input_0", "attn.input_1", "attn.input_2", ".input", ".output"} <= actv
