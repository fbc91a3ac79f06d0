"""Monitor V1's ``shape`` column states the shape of the call each row summarises: an expert whose
batch changes from step to step (1 token, then 2, then 1) and from micro-batch to micro-batch,
for activations and their gradients, in CSV and Parquet, and in a multi-step window."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import read_csv
from test_v1_support import make_v1, run_dir


class Moe(nn.Module):
    """The first ``tokens`` rows of the batch go to ``expert`` (an MoE router's choice)."""

    def __init__(self) -> None:
        super().__init__()
        self.expert = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)
        self.tokens = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.expert(x[: self.tokens])
        return self.head(routed).sum(0, keepdim=True) + x.sum() * 0


def _rows(folder: Path, table: str, fmt: str) -> list[dict[str, str]]:
    rows: list[dict[str, str]] = []
    for path in sorted(folder.glob(f"{table}_[0-9]*-[0-9]*.{fmt}")):
        if fmt == "csv":
            rows += read_csv(path)[1]
        else:
            import pyarrow.parquet as pq

            rows += [{k: str(v) for k, v in r.items()} for r in pq.read_table(path).to_pylist()]
    return rows


def _shapes(rows: list[dict[str, str]], name: str) -> list[tuple[int, int, str]]:
    return sorted((int(r["step"]), int(r["micro_step"]), r["shape"]) for r in rows if r["name"] == name)


def _calls(tokens: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(step, micro_step, tokens)`` of every call."""
    return [(s, m, n) for s, step_tokens in enumerate(tokens) for m, n in enumerate(step_tokens)]


@pytest.mark.parametrize(("fmt", "per_record"), [("csv", 1), ("csv", 3), ("parquet", 3)])
def test_each_row_has_the_shape_of_its_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str, per_record: int
) -> None:
    if fmt == "parquet":
        pytest.importorskip("pyarrow")
    torch.manual_seed(0)
    model = Moe()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cfg = {"xy_distribution": True, "all_xy": True, "format": fmt, "step_count_per_record": per_record}
    mon = make_v1(tmp_path, monkeypatch, cfg)
    mon.set_monitor(model, grad_acc_steps=2, optimizer=opt)
    tokens = [(1, 2), (2, 2), (1, 3)]  # per step, per micro-batch
    for step_tokens in tokens:
        for n in step_tokens:
            model.tokens = n
            model(torch.randn(3, 4, requires_grad=True)).sum().backward()
        opt.step()
        opt.zero_grad()
    mon.stop()
    folder = run_dir(tmp_path)
    expected = [(s, m, f"[{n}, 4]") for s, m, n in _calls(tokens)]
    actv, grads = _rows(folder, "actv", fmt), _rows(folder, "actv_grad", fmt)
    assert _shapes(actv, "expert.output") == expected
    assert _shapes(grads, "expert.output") == expected
    assert _shapes(grads, "expert.input") == expected
    assert _shapes(actv, "head.output") == [(s, m, f"[{n}, 2]") for s, m, n in _calls(tokens)]
    assert _shapes(actv, ".output") == [(s, m, "[1, 2]") for s, m, _ in _calls(tokens)]
    assert {r["dtype"] for r in actv + grads} == {"torch.float32"}
