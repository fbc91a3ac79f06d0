"""trainprobe.rerun_check: a deterministic step reproduces, one whose second call differs does not,
and the training state afterwards is exactly that of one call (real modules, real backward)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

import trainprobe
from test_distributed_v2 import launch
from trainprobe import ConfigError, RerunVerdict, rerun_check


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Dropout(0.3), nn.ReLU(), nn.Linear(8, 3))


def _step(model: nn.Module) -> Any:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        x.mul_(2.0)  # a step that changes its input in place: the second call must get the original
        return loss

    return step


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {f"grad {n}": p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    out.update({f"buffer {n}": b.clone() for n, b in model.named_buffers()})
    out["rng"] = torch.rand(4)
    out["py"] = torch.tensor(random.random())
    out["np"] = torch.tensor(np.random.rand())
    return out


def test_a_deterministic_step_with_dropout_and_batchnorm_reproduces_and_leaves_one_calls_state() -> None:
    plain, checked = _model(), _model()
    x, y = _batch()
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    _step(plain)(x.clone(), y)
    expected = _state(plain)

    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    verdict = rerun_check(_step(checked), x.clone(), y, model=checked)
    assert verdict.reproducible and verdict.differed == () and verdict.ranks == ()
    assert verdict.losses[0] == verdict.losses[1] and verdict.losses[0] is not None
    assert verdict.compared == 1 + 6 + 3  # the loss, 6 gradients, BatchNorm's 3 buffers
    got = _state(checked)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    assert verdict.line().startswith("rerun_check: reproducible (10 values, bit for bit): a numerical fault")


def test_gradients_accumulated_before_the_check_are_the_start_of_both_calls() -> None:
    model = _model()
    x, y = _batch()
    _step(model)(x.clone(), y)  # an earlier micro-batch's gradients
    verdict = rerun_check(_step(model), x.clone(), y, model=model)
    assert verdict.reproducible


def test_a_step_whose_second_call_differs_is_named_not_reproducible_with_what_differed() -> None:
    model = _model()
    calls = []

    def flaky(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        out = model[0](x)
        if len(calls) == 2:  # a bit flip in the first layer's output, as a faulty device would
            out = out + 1e-3 * (out.abs() > 0.5)
        loss = nn.functional.cross_entropy(model[4](torch.relu(model[1](out))), y)
        loss.backward()
        return loss

    x, y = _batch()
    verdict = rerun_check(flaky, x, y, model=model)
    assert not verdict.reproducible and verdict.ranks == (0,)
    assert verdict.differed[0] == "loss" and "grad 0.weight" in verdict.differed
    assert "buffer 1.running_mean" in verdict.differed
    assert verdict.losses[0] != verdict.losses[1]
    assert "NOT reproducible" in verdict.line() and "suspect the device" in verdict.line()
    assert isinstance(verdict, trainprobe.RerunVerdict)
    assert verdict.to_json()["reproducible"] is False


def test_a_nan_that_reproduces_is_numerics() -> None:
    model = _model()
    x, y = _batch()
    x[3, 2] = float("nan")
    verdict = rerun_check(_step(model), x, y, model=model)
    assert verdict.reproducible  # NaN equals NaN of the same bits


def test_model_must_be_a_module() -> None:
    with pytest.raises(ConfigError, match="rerun_check: model must be a torch.nn.Module, got list"):
        rerun_check(lambda: None, model=[])  # type: ignore[arg-type]


def _two_ranks(rank: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    calls = []

    def step(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        noise = 1e-4 if (rank == 1 and len(calls) == 2) else 0.0
        loss = ddp(x).pow(2).mean() + noise
        loss.backward()
        return loss

    x = torch.full((2, 4), float(rank + 1))
    verdict: RerunVerdict = rerun_check(step, x, model=ddp)
    assert not verdict.reproducible and verdict.ranks == (1,)
    assert verdict.differed == (("loss",) if rank == 1 else ())
    assert "on ranks 1" in verdict.line()
    healthy = rerun_check(lambda x: ddp(x).sum().backward(), x, model=ddp)
    assert healthy.reproducible and healthy.ranks == ()
    dist.barrier()


def test_on_two_ranks_the_verdict_names_the_rank_that_differed() -> None:
    launch(_two_ranks, timeout=240)


def test_leave_before_with_zero_grad_observes_without_a_trace() -> None:
    model = _model()
    x, y = _batch()
    _step(model)(x.clone(), y)  # the gradients of an earlier micro-batch
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    expected = _state(model)
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    verdict = rerun_check(_step(model), x.clone(), y, model=model, leave="before", zero_grad=True)
    assert verdict.reproducible
    got = _state(model)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    with pytest.raises(ConfigError, match="rerun_check: leave must be 'first' or 'before', got 'after'"):
        rerun_check(_step(model), x, y, model=model, leave="after")
