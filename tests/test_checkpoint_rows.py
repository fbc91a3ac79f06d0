"""Activation checkpointing (``torch.utils.checkpoint``, reentrant and non-reentrant) under the
module monitor (issue #32): the forward the backward pass recomputes writes no row, so a
checkpointed model writes exactly the rows of the same model without checkpointing (names,
scopes, micro steps and values), also with micro-batches whose backward passes run after all
forwards (F0 F1 B0 B1) and with a learned latent used inside the checkpointed blocks; the
reentrant checkpoint's gradient rows (its backward runs through the recomputed tensors) are kept.
Training is bitwise the unmonitored one and no hook is left after ``stop()``.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from conftest import rows_of
from models import no_hooks_left
from trainprobe import TrainerMonitorV2

D = 8
BATCH = 4
STEPS = 3
OPS = ["min", "max", "mean", "norm"]
MODES = ["reentrant", "non_reentrant"]


class Block(nn.Module):
    """A residual block reading a learned latent (the same tensor in every forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.latent = nn.Parameter(torch.randn(D))
        self.fc = nn.Linear(D, D)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.fc(x * self.latent))


class Net(nn.Module):
    """``inp``, two blocks (checkpointed when ``mode`` is set), ``head``."""

    def __init__(self, mode: str | None) -> None:
        super().__init__()
        self.mode = mode
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            if self.mode is None:
                h = block(h)
            else:
                h = checkpoint(block, h, use_reentrant=self.mode == "reentrant")
        return self.head(h)


def build(mode: str | None) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net(mode)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def train(model: Net, opt: torch.optim.Optimizer, micro: int, after_forwards: bool) -> None:
    """``STEPS`` steps of ``micro`` micro-batches; ``after_forwards``: every forward first, then
    the backward passes (F0 F1 B0 B1), else F0 B0 F1 B1."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        xs = [torch.randn(BATCH, D, generator=gen) for _ in range(micro)]
        if after_forwards:
            losses = [model(x).pow(2).mean() for x in xs]
            for loss in losses:
                loss.backward()
        else:
            for x in xs:
                model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def monitored(tmp_path: Path, mode: str | None, micro: int, after_forwards: bool) -> tuple[list[dict[str, str]], Net]:
    """Module rows of a run of ``mode`` (None: no checkpointing) and the trained model."""
    model, opt = build(mode)
    out = tmp_path / (mode or "plain")
    mon = TrainerMonitorV2({"output_dir": str(out), "monitors": {"module": {"ops": OPS}}})
    mon.start(model=model, optimizer=opt, micro_batch_number=micro)
    train(model, opt, micro, after_forwards)
    mon.stop()
    assert no_hooks_left(model, opt)
    return rows_of(out, "module"), model


def keyed(rows: list[dict[str, str]]) -> dict[tuple[str, ...], list[float]]:
    """``(step, name, scope, micro_step)`` → statistics; each key once."""
    counts = Counter((r["step"], r["module_name"], r["scope"], r.get("micro_step", "")) for r in rows)
    assert set(counts.values()) == {1}, [k for k, n in counts.items() if n > 1][:5]
    return {(r["step"], r["module_name"], r["scope"], r.get("micro_step", "")): [float(r[op]) for op in OPS] for r in rows}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("micro", "after_forwards"), [(1, False), (2, False), (2, True)])
def test_checkpointed_rows_equal_the_plain_models(tmp_path: Path, mode: str, micro: int, after_forwards: bool) -> None:
    plain_rows, _ = monitored(tmp_path, None, micro, after_forwards)
    rows, _ = monitored(tmp_path, mode, micro, after_forwards)
    want, got = keyed(plain_rows), keyed(rows)
    assert set(got) == set(want)
    for key, values in want.items():
        assert got[key] == pytest.approx(values, rel=1e-6, abs=1e-9), key
    # the recomputed blocks' rows are there once, forward and backward
    names = {(name, scope) for _, name, scope, _ in got}
    for row in ("blocks.0.fc.input.0", "blocks.1.act.output.0"):
        assert (row, "forward") in names
    for row in ("blocks.0.fc.grad_input.0", "blocks.1.act.grad_output.0", "blocks.1.grad_input.0"):
        assert (row, "backward") in names
    per_step = Counter(step for step, *_ in got)
    assert len(set(per_step.values())) == 1 and len(per_step) == STEPS


@pytest.mark.parametrize("mode", MODES)
def test_checkpointed_training_bitwise_unchanged(tmp_path: Path, mode: str) -> None:
    _, model = monitored(tmp_path, mode, 2, True)
    reference, opt = build(mode)
    train(reference, opt, 2, True)
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)


def test_a_forward_inside_backward_is_a_recomputation() -> None:
    """The mechanism: autograd's graph task id is -1 outside a backward pass and
    set while the checkpoint recomputes, in both modes."""
    from trainprobe.backends.torch.model_view import TorchModelView

    seen: list[tuple[bool, bool]] = []
    for reentrant in (True, False):
        model, _ = build("reentrant" if reentrant else "non_reentrant")
        view = TorchModelView(model)
        handle = model.blocks[0].fc.register_forward_pre_hook(
            lambda m, a, r=reentrant, v=view: seen.append((r, v.recomputing()))
        )
        model(torch.randn(BATCH, D)).sum().backward()
        handle.remove()
    assert seen == [(True, False), (True, True), (False, False), (False, True)]
    assert not TorchModelView(nn.Linear(2, 2)).recomputing()
