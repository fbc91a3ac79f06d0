"""The same model trained in PyTorch and in MindSpore, identical weights and data: Monitor V2
writes the same files, the same rows with the same names, and values equal to 1e-5."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from conftest import read_csv
from mindspore_support import OPS, MsMLP, Tensor, ms, nn
from models import MLP
from trainprobe import TrainerMonitorV2
from trainprobe.demo import gpt as torch_gpt
from trainprobe.demo import gpt_mindspore as ms_gpt
from trainprobe.demo.gpt_mindspore import load_torch_weights

KEY = ("vpp_stage", "step", "module_name", "scope", "micro_step")


def monitor(out: Path, fr: str, monitors: list[str]) -> TrainerMonitorV2:
    return TrainerMonitorV2(
        {"output_dir": str(out), "monitors": {m: {"enabled": True, "ops": OPS} for m in monitors}}, fr=fr
    )


def train_both(
    torch_model: torch.nn.Module, ms_model: Any, inputs: list[np.ndarray], tmp_path: Path, monitors, adam=False
):
    load_torch_weights(ms_model, torch_model)
    if adam:
        t_opt = torch.optim.Adam(torch_model.parameters(), lr=1e-2)
        m_opt = nn.Adam(ms_model.trainable_params(), learning_rate=1e-2)
    else:
        t_opt = torch.optim.SGD(torch_model.parameters(), lr=0.1)
        m_opt = nn.SGD(ms_model.trainable_params(), learning_rate=0.1)
    t_mon = monitor(tmp_path / "pt", "pytorch", monitors)
    m_mon = monitor(tmp_path / "ms", "ms", monitors)
    t_mon.start(model=torch_model, optimizer=t_opt)
    m_mon.start(model=ms_model, optimizer=m_opt)
    grad_fn = ms.value_and_grad(lambda x: (ms_model(x) ** 2).mean(), None, m_opt.parameters)
    for x in inputs:
        (torch_model(torch.from_numpy(x)) ** 2).mean().backward()
        t_opt.step()
        t_opt.zero_grad(set_to_none=True)
        m_opt(grad_fn(Tensor(x))[1])
    t_mon.stop()
    m_mon.stop()


def tables(out: Path) -> dict[str, tuple[list[str], list[dict[str, str]]]]:
    return {p.name: read_csv(p) for p in sorted((out / "rank_0").glob("*.csv"))}


def assert_same_outputs(tmp_path: Path, rel: float = 1e-5) -> int:
    pt, mso = tables(tmp_path / "pt"), tables(tmp_path / "ms")
    assert list(pt) == list(mso)
    compared = 0
    for name, (header, rows) in pt.items():
        ms_header, ms_rows = mso[name]
        assert header == ms_header, name
        keyed = {tuple(r.get(k) for k in KEY): r for r in rows}
        ms_keyed = {tuple(r.get(k) for k in KEY): r for r in ms_rows}
        assert len(keyed) == len(rows) and len(ms_keyed) == len(ms_rows), f"{name}: repeated rows"
        assert set(keyed) == set(ms_keyed), f"{name}: {set(keyed) ^ set(ms_keyed)}"
        if "module" not in name:  # parameters and gradients come in model order in both
            assert [tuple(r.get(k) for k in KEY) for r in rows] == [tuple(r.get(k) for k in KEY) for r in ms_rows]
        for key, row in keyed.items():
            for op in OPS:
                assert float(ms_keyed[key][op]) == pytest.approx(float(row[op]), rel=rel, abs=1e-7), (name, key, op)
        compared += len(rows)
    return compared


def test_mlp_sgd(tmp_path):
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((4, 6)).astype(np.float32) for _ in range(3)]
    train_both(MLP(), MsMLP(), inputs, tmp_path, ["module", "weight_grad", "param"])
    assert assert_same_outputs(tmp_path) == 3 * (14 + 8 + 8)


def test_transformer_block_sgd(tmp_path):
    cfg = torch_gpt.GPTConfig(vocab_size=40, seq_len=8, d_model=16, n_heads=2, n_layers=1)
    torch.manual_seed(0)
    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal((2, 8, 16)).astype(np.float32) for _ in range(2)]
    train_both(torch_gpt.Block(cfg), ms_gpt.Block(cfg), inputs, tmp_path, ["module", "weight_grad", "param"])
    assert assert_same_outputs(tmp_path) > 100


def test_adam_moments_are_named_as_in_pytorch(tmp_path):
    """Same files and row names. MindSpore's Adam computes 1 - beta2 in float32 (1 - 0.999f =
    0.000999987), so the first step's exp_avg_sq differs from PyTorch's by 1.3e-5 relative;
    after that the parameters, hence the gradients, drift apart (measured: up to 4e-4 by step 3)."""
    torch.manual_seed(0)
    rng = np.random.default_rng(2)
    inputs = [rng.standard_normal((4, 6)).astype(np.float32) for _ in range(3)]
    train_both(MLP(), MsMLP(), inputs, tmp_path, ["optimizer"], adam=True)
    assert assert_same_outputs(tmp_path, rel=1e-2) == 3 * 8
    pt = read_csv(tmp_path / "pt" / "rank_0" / "optimizer_step0-0.csv")[1]
    mso = read_csv(tmp_path / "ms" / "rank_0" / "optimizer_step0-0.csv")[1]
    for a, b in zip(pt, mso):
        for op in ("min", "max", "mean", "norm"):
            assert float(b[op]) == pytest.approx(float(a[op]), rel=2e-5, abs=1e-12), (a["module_name"], op)
