"""Checksums (summary_mode md5 / xor) are those of the tensor's bytes in row-major order, whatever
its layout: expanded, transposed, sliced and channels-last tensors are read through a contiguous
copy that the NumPy view keeps alive (issue #27: the copy used to be freed before it was read)."""

from __future__ import annotations

import gc
import json
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import write_config
from trainprobe.backends.torch.numpy_view import numpy_view
from trainprobe.dump import PrecisionDebugger
from trainprobe.dump.entries import checksum


def contiguous_bytes(t: torch.Tensor) -> bytes:
    """The tensor's elements in row-major order, as bytes (through an independent path)."""
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).tolist())


def xor_reference(data: bytes) -> str:
    padded = data + b"\0" * ((-len(data)) % 8)
    words = [int.from_bytes(padded[i : i + 8], "little") for i in range(0, len(padded), 8)]
    acc = 0
    for w in words:
        acc ^= w
    return f"{acc:016x}"


LAYOUTS: dict[str, Callable[[], torch.Tensor]] = {
    "expanded ones": lambda: torch.ones(()).expand(10, 4),
    "expanded row": lambda: torch.arange(4.0).expand(10, 4),
    "transposed": lambda: torch.arange(40.0).reshape(4, 10).t(),
    "sliced": lambda: torch.arange(120.0).reshape(10, 12)[:, 3:7],
    "stepped": lambda: torch.arange(200.0)[::5],
    "channels last": lambda: (
        torch.arange(2 * 3 * 4 * 5, dtype=torch.float32)
        .reshape(2, 3, 4, 5)
        .contiguous(memory_format=torch.channels_last)
    ),
    "float64 transposed": lambda: torch.randn(
        7, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(1)
    ).t(),
    "half sliced": lambda: torch.arange(64.0).to(torch.float16).reshape(8, 8)[1:, ::2],
    "large transposed": lambda: torch.arange(300_000.0).reshape(600, 500).t(),  # > malloc's mmap threshold
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_checksums_of_strided_tensors_are_those_of_their_contiguous_bytes(layout: str) -> None:
    for _ in range(5):  # the freed copy's memory was reused differently from one call to the next
        t = LAYOUTS[layout]()
        data = contiguous_bytes(t)
        assert checksum(t, "md5") == f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"
        assert checksum(t, "xor") == xor_reference(data)


def test_expanded_ones_checksum_is_the_documented_value() -> None:
    assert checksum(torch.ones(()).expand(10, 4), "md5") == "10e45f38"  # crc32 of 40 float32 ones


def test_numpy_view_keeps_its_tensor_alive() -> None:
    """A view of a temporary stays valid after the temporary's last other reference is gone."""
    source = torch.arange(50_000.0).reshape(250, 200)
    view = numpy_view(source.t().contiguous())  # the copy is referenced by the view only
    gc.collect()
    scratch = [torch.full((250, 200), -1.0) for _ in range(8)]  # reuse any freed memory
    assert np.array_equal(view, source.t().contiguous().reshape(-1).numpy())
    del scratch


class _ReluNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.fc(x))


def test_dumped_md5_of_an_expanded_backward_input_is_stable(tmp_path: Path) -> None:
    """``sum().backward()`` sends an expanded ``ones`` into relu's backward: its recorded md5
    is the CRC-32 of 40 float32 ones, in every step of every run."""
    seen: list[str] = []
    for run in range(2):
        dump = tmp_path / f"run{run}"
        config = {"task": "statistics", "level": "L1", "dump_path": str(dump), "statistics": {"summary_mode": "md5"}}
        debugger = PrecisionDebugger(config_path=write_config(tmp_path, config, f"config{run}.json"))
        torch.manual_seed(0)
        model = _ReluNet()
        for _ in range(3):
            debugger.start()
            model(torch.randn(10, 3)).sum().backward()
            debugger.stop()
            debugger.step()
        for step_dir in sorted(dump.glob("step*")):
            (rank,) = list(step_dir.iterdir())
            data = json.loads((rank / "dump.json").read_text())["data"]
            entry = data["Functional.relu.0.backward"]["input"][0]
            assert entry["shape"] == [10, 4]
            seen.append(entry["md5"])
    expected = f"{zlib.crc32(torch.ones(10, 4).numpy().tobytes()) & 0xFFFFFFFF:08x}"
    assert expected == "10e45f38"
    assert seen == [expected] * 6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_checksums_of_strided_device_tensors_are_those_of_their_contiguous_bytes(layout: str) -> None:
    t = LAYOUTS[layout]().cuda()
    data = contiguous_bytes(t.cpu())
    assert checksum(t, "md5") == f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"
    assert checksum(t, "xor") == xor_reference(data)
