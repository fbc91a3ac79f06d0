"""``trainprobe diff`` of a MindSpore run of the demo GPT against a PyTorch run of the same model
(same weights, same tokens) with the shipped name mapping: every row matches by name, and the
values agree within the default tolerance (MindSpore's CPU kernels round differently from
PyTorch's in the last digits only)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from mindspore_support import ms
from trainprobe import TrainerMonitorV2
from trainprobe.demo import gpt as torch_gpt
from trainprobe.demo import gpt_mindspore as ms_gpt
from trainprobe.demo.gpt_mindspore import load_torch_weights
from trainprobe.tools.rundiff.answer import diff
from trainprobe.tools.rundiff.match import load_mapping

MAPPING = Path(torch_gpt.__file__).resolve().parent / "ms_torch_names.yaml"
MONITORS = {
    "module": {"enabled": True, "targets": ["layers.0", "head"], "ops": ["min", "max", "mean", "norm", "nans"]},
    "weight_grad": {"enabled": True, "ops": ["min", "max", "mean", "norm", "nans"]},
    "param": {"enabled": True, "ops": ["min", "max", "mean", "norm", "nans"]},
}
STEPS = 3


def _config(out: Path, fr: str) -> Path:
    path = out.parent / f"{out.name}.json"
    path.write_text(json.dumps({"framework": fr, "output_dir": str(out), "step_count_per_record": 2, "monitors": MONITORS}))
    return path


def test_mindspore_and_pytorch_runs_match_by_name(tmp_path: Path) -> None:
    cfg_t = torch_gpt.GPTConfig(n_layers=2, d_model=32, n_heads=2, vocab_size=64, seq_len=16)
    cfg_m = ms_gpt.GPTConfig(n_layers=2, d_model=32, n_heads=2, vocab_size=64, seq_len=16)
    torch.manual_seed(0)
    t_model = torch_gpt.TinyGPT(cfg_t)
    m_model = ms_gpt.TinyGPT(cfg_m)
    load_torch_weights(m_model, t_model)
    t_opt = torch.optim.SGD(t_model.parameters(), lr=0.1)
    m_opt = ms.nn.SGD(m_model.trainable_params(), learning_rate=0.1)
    t_mon = TrainerMonitorV2(_config(tmp_path / "pt", "pytorch"), fr="pytorch")
    m_mon = TrainerMonitorV2(_config(tmp_path / "ms", "mindspore"), fr="ms")
    t_mon.start(model=t_model, optimizer=t_opt)
    m_mon.start(model=m_model, optimizer=m_opt)
    grad_fn = ms.value_and_grad(m_model.loss, None, m_opt.parameters)
    batches = ms_gpt.synthetic_batches(cfg_m, batch_size=4, seed=0)
    for _ in range(STEPS):
        tokens = next(batches)
        t_model.loss(torch.from_numpy(np.asarray(tokens.asnumpy(), dtype=np.int64))).backward()
        t_opt.step()
        t_opt.zero_grad(set_to_none=True)
        m_opt(grad_fn(tokens)[1])
    t_mon.stop()
    m_mon.stop()
    assert load_mapping(MAPPING)  # the shipped file parses
    result = diff(tmp_path / "pt", tmp_path / "ms", mapping=MAPPING)
    total = sum(1 for p in (tmp_path / "pt").rglob("*.csv") for _ in p.open()) - len(list((tmp_path / "pt").rglob("*.csv")))
    assert result.counts["only_baseline"] == result.counts["only_candidate"] == 0, result.only_candidate
    assert result.counts["compared"] == total > 100
    assert result.exit_code == 0, result.answer()
