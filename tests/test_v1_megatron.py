"""Monitor V1 with a Megatron-style mixed-precision optimizer: bf16 model parameters whose
gradients accumulate in ``main_grad``, stepped through float32 master copies held by the wrapper
(``float16_groups`` / ``fp32_from_float16_groups``, the layout of Megatron's
``Float16OptimizerWithFloat16Params``). The wrapper is written here in plain PyTorch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from test_v1_support import by_name, forget_warnings, full_name, make_v1, run_dir, table


class Float16OptimizerWithFloat16Params:
    """The parts of Megatron's mixed-precision optimizer that monitoring sees."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.float16_groups = [list(params)]
        self.fp32_from_float16_groups = [[p.detach().float().requires_grad_() for p in params]]
        self.optimizer = torch.optim.Adam(self.fp32_from_float16_groups[0], lr=1e-2)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        return self.optimizer.state

    def zero_grad(self) -> None:
        for p in self.float16_groups[0]:
            p.main_grad.zero_()

    def step(self) -> None:
        for model, master in zip(self.float16_groups[0], self.fp32_from_float16_groups[0]):
            master.grad = model.main_grad.clone()
        self.optimizer.step()
        with torch.no_grad():
            for model, master in zip(self.float16_groups[0], self.fp32_from_float16_groups[0]):
                model.copy_(master)


def _bf16_model_with_main_grad() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).bfloat16()
    for p in model.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32)

        def accumulate(t: torch.Tensor) -> None:
            t.main_grad.add_(t.grad.float())
            t.grad = None

        p.register_post_accumulate_grad_hook(accumulate)
    return model


def test_master_copies_are_named_and_selected_as_the_model_parameters(tmp_path, monkeypatch, caplog):
    forget_warnings(monkeypatch)
    model = _bf16_model_with_main_grad()
    opt = Float16OptimizerWithFloat16Params(list(model.parameters()))
    cfg = {"targets": {"2": {}}, "wg_distribution": True, "mv_distribution": True, "param_distribution": True}
    mon = make_v1(tmp_path, monkeypatch, {**cfg, "ops": ["norm"]})
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    grads, moments, updated = [], [], []
    for _ in range(2):
        model(torch.randn(3, 4).bfloat16()).float().pow(2).mean().backward()
        grads.append(model[2].weight.main_grad.clone())
        opt.step()
        master = opt.fp32_from_float16_groups[0][2]
        moments.append(opt.state[master]["exp_avg"].clone())
        updated.append(master.detach().clone())
        opt.zero_grad()
    mon.stop()
    assert "keeps no" not in caplog.text
    folder = run_dir(tmp_path)
    for name in ("grad_unreduced", "grad_reduced", "exp_avg", "param_origin", "param_updated"):
        names = {full_name(r) for r in table(folder, name)}
        assert names == {"0:2.weight", "0:2.bias"}, (name, names)
    for step, row in enumerate(by_name(table(folder, "grad_reduced"), "0:2.weight")):
        assert float(row["norm"]) == pytest.approx(float(grads[step].double().norm()), abs=1e-6)
    for step, row in enumerate(by_name(table(folder, "exp_avg"), "0:2.weight")):
        assert float(row["norm"]) == pytest.approx(float(moments[step].double().norm()), abs=1e-6)
    for step, row in enumerate(by_name(table(folder, "param_updated"), "0:2.weight")):  # the stepped masters
        assert float(row["norm"]) == pytest.approx(float(updated[step].double().norm()), abs=1e-6)
