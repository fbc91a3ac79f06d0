"""Gradient accumulation with and without ``grad_acc_steps``: the ``unreduced`` row of a step is
the whole accumulated local gradient the optimizer sees, labelled with the number of backward
passes that really ran, and a count that disagrees with the configured one is warned once."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import rows_of
from models import MLP
from trainprobe import TrainerMonitorV2

PASSES, STEPS = 4, 2


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr("trainprobe.engine.log._seen", set())
    caplog.set_level(logging.WARNING, logger="trainprobe")


def _trainprobe_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Every warning or error trainprobe logged: a count that matches says nothing at all,
    whatever the wording of the mismatch warning."""
    return [r.getMessage() for r in caplog.records if r.name.startswith("trainprobe") and r.levelno >= logging.WARNING]


def _loop(
    out: Path, weight_grad: dict[str, Any] | None = None, passes: int = PASSES, **start: Any
) -> list[dict[str, float]]:
    """Train an MLP with ``passes`` backward passes per optimizer step; returns, per step, the
    float64 norm of each parameter's accumulated ``.grad`` just before ``optimizer.step()``."""
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = {"enabled": True, **(weight_grad or {})}
    mon = TrainerMonitorV2({"output_dir": str(out), "start_step": 0, "monitors": {"weight_grad": config}})
    mon.start(model=model, optimizer=opt, **start)
    truth = []
    for _ in range(STEPS):
        for _ in range(passes):
            (model(torch.randn(8, 6)).square().mean() / passes).backward()
        truth.append({n: p.grad.double().norm().item() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    mon.stop()
    return truth


def _unreduced(out: Path) -> list[dict[str, str]]:
    return [r for r in rows_of(out, "weight_grad") if r["scope"] == "unreduced"]


def _check_rows(
    rows: list[dict[str, str]], truth: list[dict[str, float]], micro_step: int, first_step: int = 0
) -> None:
    """``truth[i]`` is step ``first_step + i`` (the trainer callbacks number the first step 1)."""
    assert len(rows) == sum(len(t) for t in truth)
    for row in rows:
        assert int(row["micro_step"]) == micro_step
        want = truth[int(row["step"]) - first_step][row["module_name"]]
        assert float(row["norm"]) == pytest.approx(want, rel=1e-6)


def test_accumulation_without_a_count_records_the_whole_accumulated_gradient(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    truth = _loop(tmp_path)
    _check_rows(_unreduced(tmp_path), truth, PASSES)
    reduced = [r for r in rows_of(tmp_path, "weight_grad") if r["scope"] == "reduced"]
    assert {int(r["micro_step"]) for r in reduced} == {PASSES}
    assert caplog.text.count("ran 4 backward pass(es)") == 1
    assert "grad_acc_steps (micro-batches per optimizer step) is 1" in caplog.text
    assert "accumulated over all 4 passes" in caplog.text


def test_the_configured_count_matching_the_loop_is_silent(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    truth = _loop(tmp_path, grad_acc_steps=PASSES)
    _check_rows(_unreduced(tmp_path), truth, PASSES)
    assert _trainprobe_warnings(caplog) == []


def test_too_small_a_configured_count_still_records_everything(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    truth = _loop(tmp_path, {"grad_acc_steps": 2})
    _check_rows(_unreduced(tmp_path), truth, PASSES)
    assert "ran 4 backward pass(es)" in caplog.text and "is 2;" in caplog.text


def test_too_large_a_configured_count_writes_no_unreduced_row_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _loop(tmp_path, passes=2, grad_acc_steps=PASSES)
    assert _unreduced(tmp_path) == []
    assert caplog.text.count("ran 2 backward pass(es)") == 1
    assert "is 4; no unreduced row was written for it" in caplog.text
    assert "reached none of the parameters" not in caplog.text


def test_per_micro_batch_rows_count_the_real_passes(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _loop(tmp_path, {"monitor_mbs_grad": True})
    rows = _unreduced(tmp_path)
    assert sorted({int(r["micro_step"]) for r in rows}) == list(range(PASSES))
    assert "its unreduced rows are one per pass" in caplog.text


def test_per_parameter_hooks_record_the_whole_accumulated_gradient(tmp_path: Path) -> None:
    """The per-parameter hook path (distributed runs, or after a backward that missed the
    sentinels, as step 0 here: only fc2.weight gets a gradient) follows the same rule."""
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2(
        {"output_dir": str(tmp_path), "start_step": 0, "monitors": {"weight_grad": {"enabled": True}}}
    )
    mon.start(model=model, optimizer=opt)
    model.fc2.weight.pow(2).sum().backward()
    opt.step()
    opt.zero_grad()
    truth: list[dict[str, float]] = [{}]
    for _ in range(STEPS):
        for _ in range(PASSES):
            model(torch.randn(8, 6)).square().mean().backward()
        truth.append({n: p.grad.double().norm().item() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    mon.stop()
    _check_rows(_unreduced(tmp_path), truth, PASSES)


# -- trainers -------------------------------------------------------------------------------


def test_hf_trainer_passes_its_accumulation_count(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    from test_integrations_transformers import Tokens
    from trainprobe.integrations.transformers import TrainProbeCallback

    class Truth(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.norms: list[dict[str, float]] = []

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            named = kwargs["model"].named_parameters()
            self.norms.append({n: p.grad.double().norm().item() for n, p in named if p.grad is not None})

    config = transformers.GPT2Config(vocab_size=64, n_positions=12, n_embd=16, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=PASSES,
        max_steps=STEPS,
        max_grad_norm=0.0,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    truth = Truth()
    v2 = {"output_dir": str(tmp_path / "v2"), "monitors": {"weight_grad": {"enabled": True}}}
    callbacks = [TrainProbeCallback(monitor_v2_config=v2), truth]
    transformers.Trainer(model=model, args=args, train_dataset=Tokens(64), callbacks=callbacks).train()
    _check_rows(_unreduced(tmp_path / "v2"), truth.norms, PASSES, first_step=1)
    assert _trainprobe_warnings(caplog) == []


def test_lightning_passes_its_accumulation_count(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from test_integrations_lightning import Regressor, loader
    from trainprobe.integrations.lightning import TrainProbeCallback

    module = Regressor()
    v2 = {"output_dir": str(tmp_path / "v2"), "monitors": {"weight_grad": {"enabled": True}}}
    trainer = pl.Trainer(
        max_steps=STEPS,
        accumulate_grad_batches=PASSES,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[TrainProbeCallback(monitor_v2_config=v2)],
        default_root_dir=str(tmp_path),
    )
    trainer.fit(module, loader())
    truth = [{f"net.{n}": v for n, v in module.param_grad_norms[k].items()} for k in sorted(module.param_grad_norms)]
    _check_rows(_unreduced(tmp_path / "v2"), truth, PASSES, first_step=1)
    assert _trainprobe_warnings(caplog) == []


def test_monitor_v1_follows_the_same_rule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Monitor V1 shares the probe: ``set_monitor(grad_acc_steps=1)`` with 4 passes per step."""
    from test_v1_support import by_name, make_v1, run_dir, table

    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = make_v1(tmp_path, monkeypatch, {"wg_distribution": True, "ndigits": 12})
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    for _ in range(PASSES):
        model(torch.randn(8, 6)).square().mean().backward()
    truth = model.fc2.weight.grad.double().norm().item()
    opt.step()
    mon.stop()
    (row,) = by_name(table(run_dir(tmp_path), "grad_unreduced"), "0:fc2.weight")
    assert float(row["norm"]) == pytest.approx(truth, rel=1e-6)
    assert "ran 4 backward pass(es)" in caplog.text and "is 1;" in caplog.text
