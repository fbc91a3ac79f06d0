"""A meta tensor (``device="meta"``) holds no data: its entry keeps dtype, shape and
requires_grad with null statistics, no checksum and no ``.pt`` file, and the rest of the run is
dumped as usual (issue #27.7: one meta tensor used to switch the dump off for the run)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import write_config
from trainprobe.dump import PrecisionDebugger


class Template(nn.Module):
    """Takes and returns a meta tensor (a shape template, as lazy-init code passes around) next to
    a real one, scaled by ``scale`` (inf: the record overflows)."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, t: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return t.new_empty(t.shape) * 2, y * self.scale


class WithMeta(nn.Module):
    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.template = Template(scale)
        self.fc2 = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.fc1(x)
        shape, y = self.template(torch.empty(y.shape, device="meta"), y)
        return self.fc2(F.relu(y)), shape


def tensor_entries(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, dict):
        if value.get("type") == "torch.Tensor":
            return [value]
        return [e for v in value.values() for e in tensor_entries(v)]
    if isinstance(value, list):
        return [e for v in value for e in tensor_entries(v)]
    return []


CASES = [("tensor", "statistics", "mix"), ("statistics", "md5", "mix"), ("statistics", "xor", "L1"),
         ("tensor", "statistics", "L0"), ("overflow_check", "statistics", "mix")]  # fmt: skip


@pytest.mark.parametrize(("task", "summary", "level"), CASES)
def test_a_meta_tensor_is_described_and_the_dump_goes_on(tmp_path: Path, task: str, summary: str, level: str) -> None:
    dump = tmp_path / "dump"
    section: dict[str, Any] = {"summary_mode": summary} if task == "statistics" else {}
    if task == "overflow_check":
        section = {"overflow_nums": -1}
    config = write_config(tmp_path, {"task": task, "level": level, "dump_path": str(dump), task: section})
    debugger = PrecisionDebugger(config_path=config)
    torch.manual_seed(0)
    model = WithMeta(float("inf") if task == "overflow_check" else 1.0)
    for _ in range(3):
        debugger.start(model)
        out, shape = model(torch.randn(2, 4))
        assert shape.is_meta
        out.sum().backward()
        debugger.stop()
        debugger.step()
    assert not debugger.collector.disabled
    for step in range(3):
        (rank,) = list((dump / f"step{step}").iterdir())
        assert not (rank / "dump_error_info.log").exists()
        data = json.loads((rank / "dump.json").read_text())["data"]
        entries = tensor_entries(data)
        meta = [e for e in entries if e["Max"] is None and e["shape"] == [2, 4] and e["dtype"] == "torch.float32"]
        if task != "overflow_check":  # overflow_check keeps only the overflowing records
            assert meta, "the meta tensors are described"
            names = list(data)
            assert any("fc2" in n or "linear.1" in n for n in names), names  # dumped after the meta tensor
            assert any(".backward" in n for n in names), names
        for e in meta:
            assert set(e) == {"type", "dtype", "shape", "Max", "Min", "Mean", "Norm", "requires_grad"}
        for e in entries:
            if "data_name" in e:
                assert torch.load(rank / "dump_tensor_data" / e["data_name"], weights_only=True).device.type == "cpu"
        if task == "tensor":
            assert sum("data_name" in e for e in entries) == len(entries) - len(meta) > 0
        if summary != "statistics":
            assert all(("md5" in e) != (e in meta) for e in entries)
        if task == "overflow_check":  # the template's record overflows: kept, its real tensors saved
            record = data["Module.template.Template.forward.0"]
            assert "data_name" not in record["input_args"][0] and "data_name" in record["input_args"][1]
