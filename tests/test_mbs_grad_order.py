"""Per-micro-batch weight gradients in parameter order (issue #34, ``monitor_mbs_grad``).

Backward hands the gradients to the per-parameter hooks last layer first; every writer of weight
gradients writes them in parameter (model) order, which the one execution order
(:mod:`trainprobe.engine.execution_order`) reads backwards. Monitor V2's per-micro-batch writer
must follow the same rule: within each ``(step, micro_step)`` its unreduced rows are in the
model's parameter order, with the statistics of each micro-batch's own gradient, and a NaN
through the loss makes ``diagnose`` name the last layer's unreduced gradient first.

Real training of a 3-layer MLP, :data:`PASSES` micro-batches per step."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("duckdb")

from trainprobe.tools.diagnosis.answer import diagnose  # noqa: E402
from trainprobe.tools.query.layer import connect  # noqa: E402

STEPS = 3
PASSES = 3
NAN_STEP = 1
NAN_PASS = 1
OPS = ["min", "max", "norm", "nans"]
PARAMS = ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
"""The model's parameter order."""


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2)
    )


def _run(out: Path, faulty: bool) -> tuple[Path, dict[tuple[int, int, str], float], list[str]]:
    """Train under Monitor V2 with ``monitor_mbs_grad``; returns the output directory, each
    micro-batch's own gradient norm by ``(step, micro_step, name)``, and the order in which
    backward handed the gradients over in the first pass."""
    from trainprobe import TrainerMonitorV2

    out.mkdir(parents=True)
    config = {
        "framework": "pytorch",
        "output_dir": str(out),
        "start_step": 0,
        "step_interval": 1,
        "step_count_per_record": STEPS,
        "monitors": {"weight_grad": {"enabled": True, "ops": OPS, "monitor_mbs_grad": True}},
    }
    path = out / "config.json"
    path.write_text(json.dumps(config))
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    arrival: list[str] = []
    handles = [p.register_hook(lambda g, n=n: arrival.append(n)) for n, p in model.named_parameters()]
    monitor = TrainerMonitorV2(str(path), fr="pytorch")
    monitor.start(model=model, optimizer=opt, grad_acc_steps=PASSES)
    norms: dict[tuple[int, int, str], float] = {}
    for step in range(STEPS):
        for micro in range(PASSES):
            before = {
                n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()
            }
            x = torch.linspace(-1, 1, 12).reshape(3, 4) * (step + 1) + micro
            loss = model(x).square().mean() / PASSES
            if faulty and (step, micro) == (NAN_STEP, NAN_PASS):
                loss = loss * float("nan")  # through the last layer: every gradient of the pass is NaN
            loss.backward()
            for n, p in model.named_parameters():
                assert p.grad is not None
                norms[(step, micro, n)] = float((p.grad - before[n]).double().norm())
        opt.step()
        opt.zero_grad()
    monitor.stop()
    for handle in handles:
        handle.remove()
    return out, norms, arrival[: len(PARAMS)]


def _unreduced(run: Path) -> list[tuple[int, int, str, float]]:
    """``(step, micro_step, name, norm)`` of the unreduced rows of rank 0, in file order."""
    rows = (
        connect(run)
        .execute(
            "SELECT step, micro_step, name, norm FROM weight_grad WHERE scope = 'unreduced' AND rank = 0 ORDER BY file_row"
        )
        .fetchall()
    )
    return [(int(s), int(m), str(n), float(v)) for s, m, n, v in rows]


def test_per_micro_batch_rows_are_written_in_parameter_order(tmp_path: Path) -> None:
    os.environ.setdefault("TRAINPROBE_FUSED_STATS", "off")
    run, norms, arrival = _run(tmp_path / "run", faulty=False)
    assert arrival == PARAMS[::-1], arrival  # backward hands them over last layer first
    rows = _unreduced(run)
    assert len(rows) == STEPS * PASSES * len(PARAMS)
    for step in range(STEPS):
        for micro in range(PASSES):
            names = [name for s, m, name, _ in rows if (s, m) == (step, micro)]
            assert names == PARAMS, (step, micro, names)
    for step, micro, name, norm in rows:  # each row is its micro-batch's own gradient, unchanged
        assert norm == pytest.approx(norms[(step, micro, name)], rel=1e-5, abs=1e-12), (step, micro, name)


def test_nan_through_the_loss_names_the_last_layers_unreduced_gradient_first(tmp_path: Path) -> None:
    os.environ.setdefault("TRAINPROBE_FUSED_STATS", "off")
    run, _, _ = _run(tmp_path / "faulty", faulty=True)
    found = diagnose(run)
    first = found.first
    assert first is not None, found.line()
    assert (first.step, first.micro_step, first.scope) == (NAN_STEP, NAN_PASS, "unreduced"), found.line()
    assert first.name == PARAMS[-1], found.line()
    unreduced = [a for a in found.anomalies if a.scope == "unreduced" and a.step == NAN_STEP]
    assert [a.name for a in unreduced[: len(PARAMS)]] == PARAMS[::-1], found.lines()
