"""The Lightning callback: a tiny module trained by the real Lightning Trainer (gradient
accumulation included), outputs read back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from conftest import rows_of  # noqa: E402
from test_metrics_helpers import read_events, scalars, texts  # noqa: E402
from trainprobe.integrations.lightning import TrainProbeCallback  # noqa: E402

BATCH, ACCUM, STEPS = 4, 2, 3


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The metrics' default dump_path (./dump) lands in the test's folder, not the checkout."""
    monkeypatch.chdir(tmp_path)


class Regressor(pl.LightningModule):
    """Records, per optimizer step (numbered like the trainer's global step once the step is
    done: 1, 2, ...), the gradients before Lightning clips them and, with SGD at lr=1 (no
    momentum), the gradients the optimizer applied (the parameters' change, in float64)."""

    def __init__(self, width: int = 8, optimizer: str = "adam") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(width, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.losses: list[float] = []
        self.grad_norms: dict[int, float] = {}
        self.param_grad_norms: dict[int, dict[str, float]] = {}
        self.applied_norms: dict[int, dict[str, float]] = {}
        self._before: dict[str, torch.Tensor] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        step = self.trainer.global_step + 1
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.grad_norms[step] = float(torch.nn.utils.get_total_norm(grads))
        self.param_grad_norms[step] = {
            n: p.grad.double().norm().item() for n, p in self.net.named_parameters() if p.grad is not None
        }
        self._before = {n: p.detach().double().clone() for n, p in self.net.named_parameters()}

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        step = self.trainer.global_step + 1
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        if self.hparams.optimizer == "sgd":  # lr=1: the update is minus the applied gradient
            self.applied_norms[step] = {
                n: (self._before[n] - p.detach().double()).norm().item() for n, p in self.net.named_parameters()
            }

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.hparams.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=1.0)
        return torch.optim.Adam(self.parameters(), lr=0.01)


def loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=BATCH)


def fit(
    tmp_path: Path,
    callback: TrainProbeCallback,
    *,
    optimizer: str = "adam",
    max_steps: int = STEPS,
    ckpt_path: Path | None = None,
) -> tuple[Any, Regressor]:
    torch.manual_seed(0)
    module = Regressor(optimizer=optimizer)
    trainer = pl.Trainer(
        max_steps=max_steps,
        accumulate_grad_batches=ACCUM,
        gradient_clip_val=0.01,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
        default_root_dir=str(tmp_path),
    )
    trainer.fit(module, loader(), ckpt_path=str(ckpt_path) if ckpt_path else None)
    return trainer, module


def test_lightning_callback_writes_metrics_and_monitor_v2(tmp_path: Path) -> None:
    metrics = {
        "monitor_config": {
            "monitor_on": True,
            "local_loss_format": "tensorboard",
            "device_local_loss_format": "tensorboard",
            "optimizer_state_format": "tensorboard",
        },
        "tensorboard": {"tensorboard_dir": str(tmp_path / "tb")},
    }
    v2 = {"output_dir": str(tmp_path / "v2"), "monitors": {"param": {"enabled": True}}}
    trainer, module = fit(tmp_path, TrainProbeCallback(metrics_config=metrics, monitor_v2_config=v2))
    assert trainer.global_step == STEPS
    acc = read_events(tmp_path / "tb" / "rank_0")
    s = scalars(acc)
    steps = set(range(1, STEPS + 1))
    for tag in ("loss", "learning-rate", "grad-norm", "batch-size", "local_loss", "device_accum_local_loss"):
        assert set(s[tag]) == steps, tag
    assert set(s["batch-size-vs-samples"]) == {BATCH * ACCUM * k for k in steps}
    for step in steps:
        micro = module.losses[(step - 1) * ACCUM : step * ACCUM]
        assert s["loss"][step] == pytest.approx(sum(micro) / ACCUM, rel=1e-6)
        assert s["local_loss"][step] == pytest.approx(sum(micro) / ACCUM, rel=1e-6)
        assert s["device_accum_local_loss"][step] == pytest.approx(sum(micro), rel=1e-6)
        # read before Lightning clips (clip value 0.01 is far below these norms)
        assert s["grad-norm"][step] == pytest.approx(module.grad_norms[step], rel=1e-5)
        assert s["grad-norm"][step] > 0.1
        assert s["batch-size"][step] == BATCH * ACCUM
        assert s["learning-rate"][step] == pytest.approx(0.01)
    assert {t for t in s if t.startswith("adam_m_norm/")} == {f"adam_m_norm/{n}" for n, _ in module.named_parameters()}
    assert '"width": 8' in texts(acc)["hparams"]
    assert list((tmp_path / "v2" / "rank_0").glob("param_step*.csv"))


def test_print_struct_stops_lightning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trainer, module = fit(
        tmp_path, TrainProbeCallback(metrics_config={"monitor_config": {"monitor_on": True, "print_struct": True}})
    )
    assert trainer.global_step == 1
    assert [n for n, _ in module.named_parameters()] == [
        line for line in capsys.readouterr().out.split() if line.startswith("net.")
    ]


V2_GRADS = {"weight_grad": {"enabled": True, "ops": ["norm", "nans"]}, "optimizer": {"enabled": True, "ops": ["norm"]}}
METRICS = {"monitor_config": {"monitor_on": True, "local_norm_format": "tensorboard"}}


def norms_by_step(rows: list[dict[str, str]], scope: str) -> dict[int, dict[str, float]]:
    """``{step: {parameter name without "net.": norm}}`` of the weight_grad rows of ``scope``."""
    out: dict[int, dict[str, float]] = {}
    for row in rows:
        if row["scope"] == scope:
            out.setdefault(int(row["step"]), {})[row["module_name"].removeprefix("net.")] = float(row["norm"])
    return out


def test_monitor_v2_reduced_rows_are_the_clipped_gradients_the_optimizer_applies(tmp_path: Path) -> None:
    """Lightning runs forward/backward inside ``optimizer.step(closure)`` and clips after
    ``on_before_optimizer_step``: weight_grad ``reduced`` rows hold the step's accumulated
    gradients after clipping (what SGD at lr=1 subtracted from the weights), ``unreduced`` the
    unclipped ones, and Monitor V2's step column is the metrics' step (the trainer's global step
    once the optimizer step is done: 1, 2, 3)."""
    v2 = {"output_dir": str(tmp_path / "v2"), "monitors": V2_GRADS}
    metrics = {**METRICS, "tensorboard": {"tensorboard_dir": str(tmp_path / "tb")}}
    trainer, module = fit(tmp_path, TrainProbeCallback(metrics_config=metrics, monitor_v2_config=v2), optimizer="sgd")
    assert trainer.global_step == STEPS
    steps = set(range(1, STEPS + 1))
    rows = rows_of(tmp_path / "v2", "weight_grad")
    reduced, unreduced = norms_by_step(rows, "reduced"), norms_by_step(rows, "unreduced")
    assert set(reduced) == set(unreduced) == set(module.applied_norms) == steps
    for step in steps:
        for name, applied in module.applied_norms[step].items():
            unclipped = module.param_grad_norms[step][name]
            assert applied < unclipped / 10  # clip value 0.01: every step is clipped
            assert reduced[step][name] == pytest.approx(applied, rel=1e-4), (step, name)
            assert unreduced[step][name] == pytest.approx(unclipped, rel=1e-5), (step, name)
    sgd_rows = {int(r["step"]) for r in rows_of(tmp_path / "v2", "optimizer")}
    assert sgd_rows <= steps
    s = scalars(read_events(tmp_path / "tb" / "rank_0"))
    assert set(s["grad-norm"]) == steps  # the same clock as Monitor V2
    for step in steps:  # the metrics keep the trainer's convention: the norm before clipping
        assert s["grad-norm"][step] == pytest.approx(module.grad_norms[step], rel=1e-5)
    for name in module.applied_norms[1]:
        assert s[f"local_norm/net.{name}"][1] == pytest.approx(module.param_grad_norms[1][name], rel=1e-5)


def test_clipping_patch_is_undone_at_train_end(tmp_path: Path) -> None:
    """The precision plugin's method is wrapped on that instance only, and put back at train end."""
    v2 = {"output_dir": str(tmp_path / "v2"), "monitors": V2_GRADS}
    trainer, _ = fit(tmp_path, TrainProbeCallback(monitor_v2_config=v2), max_steps=1)
    plugin = trainer.strategy.precision_plugin
    assert "_after_closure" not in vars(plugin)
    assert plugin._after_closure.__func__ is type(plugin)._after_closure


def test_resumed_run_keeps_one_clock(tmp_path: Path) -> None:
    """``fit(ckpt_path=...)`` at global step 2, into the same output folders: the metrics and
    Monitor V2 both number the resumed steps 3 and 4, V2's files continue the first run's rows
    of steps 1 and 2, and the reduced rows are still the clipped gradients."""
    v2 = {"output_dir": str(tmp_path / "v2"), "monitors": V2_GRADS}
    metrics = {**METRICS, "tensorboard": {"tensorboard_dir": str(tmp_path / "tb")}}
    first = TrainProbeCallback(metrics_config=metrics, monitor_v2_config=v2)
    trainer, before = fit(tmp_path / "first", first, optimizer="sgd", max_steps=2)
    ckpt = tmp_path / "step2.ckpt"
    trainer.save_checkpoint(ckpt)
    callback = TrainProbeCallback(metrics_config=metrics, monitor_v2_config=v2)
    trainer, module = fit(tmp_path / "second", callback, optimizer="sgd", max_steps=4, ckpt_path=ckpt)
    assert trainer.global_step == 4
    s = scalars(read_events(tmp_path / "tb" / "rank_0"))
    assert set(s["grad-norm"]) == {1, 2, 3, 4}
    rows = rows_of(tmp_path / "v2", "weight_grad")
    assert len(rows) == len({(r["step"], r["scope"], r["module_name"]) for r in rows})  # no step twice
    reduced = norms_by_step(rows, "reduced")
    assert set(reduced) == {1, 2, 3, 4} and set(module.applied_norms) == {3, 4}
    for step, applied in {**before.applied_norms, **module.applied_norms}.items():
        for name, value in applied.items():
            assert reduced[step][name] == pytest.approx(value, rel=1e-4), (step, name)


def test_a_new_run_into_a_used_folder_keeps_the_earlier_one(tmp_path: Path) -> None:
    """A fresh ``fit`` (global step 0) is not a resumed run: Monitor V2 moves the earlier run's
    folder aside (``v2.1/rank_0``) instead of mixing with it."""
    v2 = {"output_dir": str(tmp_path / "v2"), "monitors": V2_GRADS}
    fit(tmp_path / "first", TrainProbeCallback(monitor_v2_config=v2), max_steps=1)
    first = rows_of(tmp_path / "v2", "weight_grad")
    fit(tmp_path / "second", TrainProbeCallback(monitor_v2_config=v2), max_steps=2)
    assert rows_of(tmp_path / "v2.1", "weight_grad") == first
    assert sorted({r["step"] for r in rows_of(tmp_path / "v2", "weight_grad")}) == ["1", "2"]


def test_one_clock_when_the_optimizer_does_not_end_monitor_v2s_steps(tmp_path: Path) -> None:
    """``"patch_optimizer_step": false``: the callback's step end ticks Monitor V2 with the
    metrics, so its rows hold the trainer's global steps 1..STEPS (before, every row stayed at
    step 1)."""
    v2 = {"output_dir": str(tmp_path / "v2"), "monitors": V2_GRADS, "patch_optimizer_step": False}
    metrics = {**METRICS, "tensorboard": {"tensorboard_dir": str(tmp_path / "tb")}}
    fit(tmp_path, TrainProbeCallback(metrics_config=metrics, monitor_v2_config=v2), optimizer="sgd")
    rows = rows_of(tmp_path / "v2", "weight_grad")
    assert {int(r["step"]) for r in rows} == set(range(1, STEPS + 1))
    assert len(rows) == len({(r["step"], r["scope"], r["module_name"]) for r in rows})  # no step twice
    assert set(scalars(read_events(tmp_path / "tb" / "rank_0"))["grad-norm"]) == set(range(1, STEPS + 1))


class Recorder(pl.loggers.Logger):
    """A Lightning logger that keeps every ``log_metrics`` call: ``{step: {name: value}}``."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: dict[int, dict[str, float]] = {}

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """Not recorded."""

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        assert step is not None
        self.steps.setdefault(step, {}).update(metrics)


class TwoGroups(Regressor):
    """AdamW with two parameter groups (the second named ``head``, twice the learning rate),
    halved every optimizer step by a scheduler; logs its own loss with ``self.log``."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("user_loss", loss, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(
            [{"params": self.net[0].parameters()}, {"params": self.net[2].parameters(), "lr": 0.02, "name": "head"}],
            lr=0.01,
        )
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def fit_logged(tmp_path: Path, callbacks: list[Any], *, every: int = 2, steps: int = 4) -> tuple[Recorder, TwoGroups]:
    """``TwoGroups`` trained ``steps`` optimizer steps (2 micro-batches each) by a Trainer whose
    one logger is a :class:`Recorder`, logging every ``every`` steps."""
    torch.manual_seed(0)
    module, recorder = TwoGroups(), Recorder()
    trainer = pl.Trainer(
        max_steps=steps,
        accumulate_grad_batches=ACCUM,
        log_every_n_steps=every,
        accelerator="cpu",
        devices=1,
        logger=recorder,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(module, loader())
    return recorder, module


def ours(recorder: Recorder) -> dict[int, dict[str, float]]:
    """What the callback forwarded, by logger step."""
    out = {
        step: {k: v for k, v in m.items() if k.startswith(("trainprobe/", "lr-"))} for step, m in recorder.steps.items()
    }
    return {step: m for step, m in out.items() if m}


def test_metrics_go_to_the_trainers_loggers_at_its_cadence(tmp_path: Path) -> None:
    """No ``tensorboard_dir``: the metrics go to ``trainer.loggers`` every ``log_every_n_steps``
    (2) optimizer steps, at the logger step of the batch (where the module's own ``self.log``
    values of that batch land: step k - 1 for the metrics' step k), named ``trainprobe/<tag>``;
    every parameter group's learning rate as ``LearningRateMonitor`` names it."""
    metrics = {"monitor_config": {"monitor_on": True, "local_norm_format": "tensorboard"}}
    recorder, module = fit_logged(tmp_path, [TrainProbeCallback(metrics_config=metrics)])
    forwarded = ours(recorder)
    assert set(forwarded) == {1, 3}  # the metrics' steps 2 and 4
    assert {s for s, m in recorder.steps.items() if "user_loss" in m} == {1, 3}
    for logged, m in forwarded.items():
        step = logged + 1
        micro = module.losses[(step - 1) * ACCUM : step * ACCUM]
        assert m["trainprobe/loss"] == pytest.approx(sum(micro) / ACCUM, rel=1e-6)
        assert m["trainprobe/grad-norm"] == pytest.approx(module.grad_norms[step], rel=1e-5)
        assert m["trainprobe/batch-size"] == BATCH * ACCUM
        assert m["trainprobe/learning-rate"] == pytest.approx(0.01 * 0.5 ** (step - 1))
        assert m["lr-AdamW/pg1"] == pytest.approx(0.01 * 0.5 ** (step - 1))
        assert m["lr-AdamW/head"] == pytest.approx(0.02 * 0.5 ** (step - 1))
        assert m["trainprobe/local_norm/net.0.weight"] == pytest.approx(module.param_grad_norms[step]["0.weight"], rel=1e-5)
        assert not any(k.endswith("-vs-samples") for k in m)
    assert not (tmp_path / "lightning_logs").exists() or not list((tmp_path / "lightning_logs").rglob("events.*"))


def test_learning_rates_are_those_learningratemonitor_logs(tmp_path: Path) -> None:
    """Lightning's own ``LearningRateMonitor`` (logging every step) is the oracle: the same
    names, logger steps and values as the callback's per-group learning rates."""
    theirs, _ = fit_logged(tmp_path / "a", [pl.callbacks.LearningRateMonitor(logging_interval="step")], every=1)
    metrics = {"monitor_config": {"monitor_on": True}}
    mine, _ = fit_logged(tmp_path / "b", [TrainProbeCallback(metrics_config=metrics)], every=1)
    expected = {s: {k: v for k, v in m.items() if k.startswith("lr-")} for s, m in theirs.steps.items()}
    got = {s: {k: v for k, v in m.items() if k.startswith("lr-")} for s, m in mine.steps.items()}
    assert set(expected) == {0, 1, 2, 3}
    assert got == expected


def test_a_trainer_without_a_logger_is_told_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``logger=False`` and no ``tensorboard_dir``: one log line says where the metrics go."""
    with caplog.at_level("WARNING", logger="trainprobe"):
        trainer, _ = fit(tmp_path, TrainProbeCallback(metrics_config={"monitor_config": {"monitor_on": True}}))
    assert trainer.global_step == STEPS
    said = [r.getMessage() for r in caplog.records if "has no logger" in r.getMessage()]
    assert len(said) == 1
    assert "tensorboard.tensorboard_dir" in said[0]


def test_an_explicit_tensorboard_dir_writes_event_files_and_forwards_nothing(tmp_path: Path) -> None:
    """``tensorboard.tensorboard_dir``: trainprobe's own event files, as before (now with the
    per-group learning rates); the trainer's loggers get nothing from the callback."""
    metrics = {"monitor_config": {"monitor_on": True}, "tensorboard": {"tensorboard_dir": str(tmp_path / "tb")}}
    recorder, module = fit_logged(tmp_path, [TrainProbeCallback(metrics_config=metrics)])
    assert ours(recorder) == {}
    assert {s for s, m in recorder.steps.items() if "user_loss" in m} == {1, 3}
    s = scalars(read_events(tmp_path / "tb" / "rank_0"))
    steps = {1, 2, 3, 4}
    for tag in ("loss", "learning-rate", "lr-AdamW/pg1", "lr-AdamW/head", "grad-norm"):
        assert set(s[tag]) == steps, tag
    for step in steps:
        assert s["lr-AdamW/head"][step] == pytest.approx(0.02 * 0.5 ** (step - 1))
        assert s["grad-norm"][step] == pytest.approx(module.grad_norms[step], rel=1e-5)


def test_a_tensorboard_section_without_a_folder_keeps_its_options(tmp_path: Path) -> None:
    """A ``tensorboard`` section without ``tensorboard_dir``: its options apply to what is
    forwarded (``log_timers_to_tensorboard``: ``iteration-time``), ``*_format: tensorboard``
    goes to the loggers; no event file is written anywhere."""
    metrics = {
        "monitor_config": {"monitor_on": True, "device_local_norm_format": ["log", "tensorboard"]},
        "tensorboard": {"log_timers_to_tensorboard": True},
    }
    recorder, module = fit_logged(tmp_path, [TrainProbeCallback(metrics_config=metrics)])
    forwarded = ours(recorder)
    assert set(forwarded) == {1, 3}
    for logged, m in forwarded.items():
        assert m["trainprobe/iteration-time"] > 0
        assert m["trainprobe/device_local_norm"] == pytest.approx(module.grad_norms[logged + 1], rel=1e-5)
    assert not list(tmp_path.rglob("events.out.tfevents.*"))
