"""Weight gradients in backward order (issue #34): the monitors write them in parameter (model)
order, backward computes them from the last layer's to the first's. The one execution order
(:mod:`trainprobe.engine.execution_order`) counts them from the last row written, and
``diagnose``, ``diff`` and the query layer's first NaN/inf all follow it (``diff`` no longer
reverses them itself).

Real training of a 3-layer MLP under Monitor V2 (one unreduced row per step, the default) and
Monitor V1 (weight gradients only, unreduced and reduced, written in parameter order): at step :data:`NAN_STEP` the loss is multiplied by NaN, so every parameter's
gradient is NaN in that step; the first anomaly, the first divergence from a clean rerun and the
first NaN/inf must all be the last layer's gradient, then the others in backward order."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("duckdb")

from trainprobe.tools.diagnosis.answer import diagnose  # noqa: E402
from trainprobe.tools.query.layer import connect, first_nonfinite  # noqa: E402
from trainprobe.tools.rundiff.answer import diff  # noqa: E402

STEPS = 4
NAN_STEP = 2
OPS = ["min", "max", "norm", "nans"]
LAST_LAYER = "4."
"""The prefix of the last Linear's parameters in the Sequential (``4.weight``, ``4.bias``)."""


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2)
    )


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, faulty: bool) -> None:
    for step in range(STEPS):
        x = torch.linspace(-1, 1, 12).reshape(3, 4) * (step + 1)
        loss = model(x).square().mean()
        if faulty and step == NAN_STEP:
            loss = loss * float("nan")  # through the last layer: every gradient of the step is NaN
        loss.backward()
        opt.step()
        opt.zero_grad()


def _v2_run(out: Path, faulty: bool) -> Path:
    from trainprobe import TrainerMonitorV2

    out.mkdir(parents=True)
    config = {
        "framework": "pytorch", "output_dir": str(out), "start_step": 0, "step_interval": 1,
        "step_count_per_record": STEPS,
        "monitors": {"weight_grad": {"enabled": True, "ops": OPS}},  # one unreduced row per step
    }
    path = out / "config.json"
    path.write_text(json.dumps(config))
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = TrainerMonitorV2(str(path), fr="pytorch")
    monitor.start(model=model, optimizer=opt, grad_acc_steps=1)
    _train(model, opt, faulty)
    monitor.stop()
    return out


def _v1_run(out: Path, faulty: bool, monkeypatch: pytest.MonkeyPatch) -> Path:
    from trainprobe import TrainerMon

    out.mkdir(parents=True)
    config = {"targets": {}, "wg_distribution": True, "ops": OPS, "step_count_per_record": STEPS}
    (out / "config.json").write_text(json.dumps(config))
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out / "run"))
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = TrainerMon(str(out / "config.json"), params_have_main_grad=False)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    _train(model, opt, faulty)
    monitor.stop()
    monkeypatch.delenv("MONITOR_OUTPUT_DIR")
    return out / "run"


def _written(run: Path, view: str, scope: str) -> list[str]:
    """The names of ``view``'s rows of scope ``scope`` at :data:`NAN_STEP` on rank 0, as written."""
    con = connect(run)
    rows = con.execute(
        f"SELECT name FROM {view} WHERE step = {NAN_STEP} AND scope = '{scope}' AND rank = 0 ORDER BY file_row"
    ).fetchall()
    return [n for (n,) in rows]


def _check(clean: Path, faulty: Path, view: str, unreduced: str) -> None:
    written = _written(faulty, view, unreduced)
    assert len(written) == 6 and written[0].startswith("0.") and written[-1].startswith(LAST_LAYER), written
    backward = written[::-1]  # the last layer's gradient first, as backward computes them

    found = diagnose(faulty)
    assert found.first is not None and found.first.step == NAN_STEP, found.line()
    assert found.first.name.startswith(LAST_LAYER), found.line()
    assert [a.name for a in found.anomalies] == backward, found.lines()

    rows = first_nonfinite(faulty, limit=6)
    assert [r["name"] for r in rows] == backward and {r["step"] for r in rows} == {NAN_STEP}

    compared = diff(clean, faulty)
    assert compared.first is not None and compared.first.step == NAN_STEP, compared.answer()
    assert compared.first.name.startswith(LAST_LAYER), compared.answer()
    assert [d.name for d in compared.divergences[:6]] == backward, [d.describe() for d in compared.divergences]


def test_v2_weight_gradients_are_named_in_backward_order(tmp_path: Path) -> None:
    os.environ.setdefault("TRAINPROBE_FUSED_STATS", "off")
    clean = _v2_run(tmp_path / "clean", faulty=False)
    faulty = _v2_run(tmp_path / "faulty", faulty=True)
    _check(clean, faulty, "weight_grad", "unreduced")


def test_v1_weight_gradients_are_named_in_backward_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clean = _v1_run(tmp_path / "clean", faulty=False, monkeypatch=monkeypatch)
    faulty = _v1_run(tmp_path / "faulty", faulty=True, monkeypatch=monkeypatch)
    _check(clean, faulty, "grad_unreduced", "grad_unreduced")


def test_reduced_gradients_follow_the_same_rule() -> None:
    """Reduced gradients too are computed (and all-reduced, DDP's buckets included) last layer
    first: the key counts both from the last row; other tables keep the order written."""
    from trainprobe.engine.execution_order import execution_key, in_backward_order

    for table in ("grad_unreduced", "grad_reduced", "weight_grad/unreduced", "weight_grad/reduced", "acc_grad"):
        assert in_backward_order(table)
        assert execution_key(3, table, position=5) < execution_key(3, table, position=0)
    for table in ("actv", "actv_grad", "param_origin", "exp_avg", "module/backward"):
        assert not in_backward_order(table)
        assert execution_key(3, table, position=0) < execution_key(3, table, position=5)
