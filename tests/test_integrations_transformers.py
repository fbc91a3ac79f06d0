"""The Hugging Face Trainer callback: a tiny GPT-2 built locally, trained by the real Trainer,
outputs read back."""

from __future__ import annotations

import math
import os
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from conftest import rows_of  # noqa: E402
from test_metrics_helpers import read_events, scalars, texts  # noqa: E402
from trainprobe.engine.errors import ConfigError  # noqa: E402
from trainprobe.integrations.transformers import TrainProbeCallback  # noqa: E402

SEQ, BATCH, STEPS = 12, 4, 3


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class AppliedRecorder(transformers.TrainerCallback):
    """With SGD at lr=1 (no momentum) the update is minus the gradient the optimizer applied:
    per step (the global step once it is done), each parameter's applied gradient norm, float64."""

    def __init__(self) -> None:
        self.norms: dict[int, dict[str, float]] = {}
        self.tolerance: dict[str, float] = {}  # float32 rounding of the updated weights
        self._before: dict[str, torch.Tensor] = {}

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._before = {n: p.detach().double().clone() for n, p in kwargs["model"].named_parameters()}
        eps = torch.finfo(torch.float32).eps
        self.tolerance = {n: 2 * eps * p.numel() ** 0.5 * p.abs().max().item() for n, p in self._before.items()}

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.norms[state.global_step + 1] = {
            n: (self._before[n] - p.detach().double()).norm().item() for n, p in kwargs["model"].named_parameters()
        }


def run(
    tmp_path: Path,
    callback: TrainProbeCallback,
    recorder: transformers.TrainerCallback | None = None,
    accumulation: int = 1,
    *,
    sgd: bool = False,
    max_grad_norm: float = 1.0,
    max_steps: int = STEPS,
    save_steps: int | None = None,
    resume: bool = False,
) -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=SEQ, n_embd=32, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        per_device_train_batch_size=BATCH,
        max_steps=max_steps,
        learning_rate=1.0 if sgd else 1e-3,
        lr_scheduler_type="constant" if sgd else "linear",
        max_grad_norm=max_grad_norm,
        logging_steps=1,
        gradient_accumulation_steps=accumulation,
        report_to=[],
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    callbacks = [callback] + ([recorder] if recorder else [])
    optimizers = (torch.optim.SGD(model.parameters(), lr=1.0), None) if sgd else (None, None)
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Tokens(32), callbacks=callbacks, optimizers=optimizers
    )
    trainer.train(resume_from_checkpoint=resume or None)
    return trainer


def test_trainer_callback_writes_metrics_and_monitor_v2(tmp_path: Path) -> None:
    metrics = {
        "monitor_config": {"monitor_on": True, "local_norm_format": "tensorboard", "target": ["h\\.0\\.attn"]},
        "tensorboard": {"tensorboard_dir": str(tmp_path / "tb"), "log_timers_to_tensorboard": True},
    }
    v2 = {"output_dir": str(tmp_path / "v2"), "monitors": {"weight_grad": {"enabled": True}}}
    trainer = run(tmp_path, TrainProbeCallback(metrics_config=metrics, monitor_v2_config=v2))
    acc = read_events(tmp_path / "tb" / "rank_0")
    s = scalars(acc)
    steps = set(range(1, STEPS + 1))
    for tag in ("loss", "learning-rate", "grad-norm", "batch-size", "iteration-time", "throughput"):
        assert set(s[tag]) == steps, tag
    assert set(s["loss-vs-samples"]) == {BATCH * k for k in steps}
    assert all(v == BATCH for v in s["batch-size"].values())
    logged = {e["step"]: e for e in trainer.state.log_history if "loss" in e}
    for step in steps:
        assert s["grad-norm"][step] == pytest.approx(logged[step]["grad_norm"], rel=1e-5)
        assert s["loss"][step] == pytest.approx(logged[step]["loss"], abs=1e-4)
        assert s["learning-rate"][step] == pytest.approx(logged[step]["learning_rate"], rel=1e-6)
    # FLOPs estimate: Conv1D weights of the block + the (tied) LM head, attention term from the config
    d = 32
    n_matmul = (3 * d * d + d * d + 4 * d * d + 4 * d * d) + d * 64
    flops = BATCH * SEQ * (6 * n_matmul + 12 * 1 * d * SEQ)
    for step in steps:
        seconds = s["iteration-time"][step] / 1000
        assert s["model-flops-throughput-per-device"][step] == pytest.approx(flops / seconds / 1e12, rel=1e-5)
    assert any(t.startswith("local_norm/transformer.h.0.attn") for t in s)
    assert not any(t.startswith("local_norm/transformer.h.0.mlp") for t in s)
    assert "training_args" in texts(acc) and "monitor_config" in texts(acc)
    assert list((tmp_path / "v2" / "rank_0").glob("weight_grad_step*.csv"))


@pytest.mark.parametrize("accumulation", [1, 4])
def test_losses_equal_what_the_trainer_logs(tmp_path: Path, accumulation: int) -> None:
    """transformers hands each micro-batch ``num_items_in_batch`` and the model returns that
    micro-batch's share of the step's loss: loss, local_loss and device_accum_local_loss are the
    step's loss as the Trainer logs it, not the mean of the shares (1/4 of it at accumulation 4)."""
    metrics = {
        "monitor_config": {"monitor_on": True, "local_loss_format": "tensorboard",
                           "device_local_loss_format": "tensorboard"},
        "tensorboard": {"tensorboard_dir": str(tmp_path / "tb")},
    }  # fmt: skip
    trainer = run(tmp_path, TrainProbeCallback(metrics_config=metrics), accumulation=accumulation)
    s = scalars(read_events(tmp_path / "tb" / "rank_0"))
    logged = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    assert set(logged) == set(range(1, STEPS + 1))
    for tag in ("loss", "local_loss", "device_accum_local_loss"):
        for step, value in logged.items():
            assert s[tag][step] == pytest.approx(value, rel=1e-4, abs=1e-4), (tag, step)


def test_print_struct_stops_the_trainer(tmp_path: Path) -> None:
    metrics = {"monitor_config": {"monitor_on": True, "print_struct": True}}
    trainer = run(tmp_path, TrainProbeCallback(metrics_config=metrics))
    assert trainer.state.global_step == 1


def test_monitor_v2_config_may_be_any_mapping(tmp_path: Path) -> None:
    """A read-only mapping (not a dict) is a configuration like a dict."""
    v2 = MappingProxyType({"output_dir": str(tmp_path / "out"), "monitors": {"param": {"enabled": True}}})
    callback = TrainProbeCallback(monitor_v2_config=v2)
    assert callback._pair.v2 is not None and callback._pair.v2.config.param.enabled


def test_misconfiguration_fails_at_construction() -> None:
    with pytest.raises(ConfigError, match="pass metrics_config=, monitor_v2_config=, or both"):
        TrainProbeCallback()
    with pytest.raises(ConfigError, match=r"monitor_config\.step_interval"):
        TrainProbeCallback(metrics_config={"monitor_config": {"step_interval": -1}})


V2_GRADS = {"weight_grad": {"enabled": True, "ops": ["norm"]}, "optimizer": {"enabled": True, "ops": ["norm"]}}


def norms_by_step(rows: list[dict[str, str]], scope: str) -> dict[int, dict[str, float]]:
    """``{step: {parameter name: norm}}`` of the weight_grad rows of ``scope``."""
    out: dict[int, dict[str, float]] = {}
    for row in rows:
        if row["scope"] == scope:
            out.setdefault(int(row["step"]), {})[row["module_name"]] = float(row["norm"])
    return out


def test_reduced_rows_are_clipped_and_grad_norm_is_the_trainers(tmp_path: Path) -> None:
    """``max_grad_norm`` small enough to clip every step: Monitor V2's ``reduced`` rows are the
    gradients SGD at lr=1 applied (clipped), ``unreduced`` the unclipped ones; the metrics'
    ``grad-norm`` and ``local_norm`` are before clipping (grad-norm = the Trainer's logged
    ``grad_norm``); V2's step column, the metrics' steps and the Trainer's steps are 1, 2, 3."""
    metrics = {
        "monitor_config": {"monitor_on": True, "local_norm_format": "tensorboard",
                           "device_local_norm_format": "tensorboard"},
        "tensorboard": {"tensorboard_dir": str(tmp_path / "tb")},
    }  # fmt: skip
    v2 = {"output_dir": str(tmp_path / "v2"), "monitors": V2_GRADS}
    recorder = AppliedRecorder()
    callback = TrainProbeCallback(metrics_config=metrics, monitor_v2_config=v2)
    trainer = run(tmp_path, callback, recorder, sgd=True, max_grad_norm=0.01)
    steps = set(range(1, STEPS + 1))
    logged = {e["step"]: e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e}
    assert set(logged) == steps
    rows = rows_of(tmp_path / "v2", "weight_grad")
    reduced, unreduced = norms_by_step(rows, "reduced"), norms_by_step(rows, "unreduced")
    assert set(reduced) == set(unreduced) == set(recorder.norms) == steps
    s = scalars(read_events(tmp_path / "tb" / "rank_0"))
    assert set(s["grad-norm"]) == steps
    for step in steps:
        assert logged[step] > 10 * 0.01  # every step is clipped
        applied = recorder.norms[step]
        assert math.sqrt(sum(v * v for v in applied.values())) == pytest.approx(0.01, rel=1e-4)
        for name, value in reduced[step].items():
            assert value == pytest.approx(applied[name], rel=1e-4, abs=recorder.tolerance[name]), (step, name)
            assert value < unreduced[step][name] / 10
        assert math.sqrt(sum(v * v for v in unreduced[step].values())) == pytest.approx(logged[step], rel=1e-4)
        assert s["grad-norm"][step] == pytest.approx(logged[step], rel=1e-5)
        assert s["device_local_norm"][step] == pytest.approx(logged[step], rel=1e-4)
        for name, value in unreduced[step].items():
            assert s[f"local_norm/{name}"][step] == pytest.approx(value, rel=1e-4, abs=1e-9), (step, name)


def test_resumed_training_keeps_one_clock(tmp_path: Path) -> None:
    """``train(resume_from_checkpoint=True)`` from the checkpoint of global step 2, into the same
    output folders: the metrics and Monitor V2 both number the resumed steps 3 and 4, as the
    Trainer logs them, after the first run's 1 and 2."""
    metrics = {"monitor_config": {"monitor_on": True}, "tensorboard": {"tensorboard_dir": str(tmp_path / "tb")}}
    v2 = {"output_dir": str(tmp_path / "v2"), "monitors": V2_GRADS}
    run(tmp_path, TrainProbeCallback(metrics_config=metrics, monitor_v2_config=v2), max_steps=2, save_steps=2)
    trainer = run(tmp_path, TrainProbeCallback(metrics_config=metrics, monitor_v2_config=v2), max_steps=4, resume=True)
    assert trainer.state.global_step == 4
    logged = {e["step"]: e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e and e["step"] > 2}
    assert set(logged) == {3, 4}
    s = scalars(read_events(tmp_path / "tb" / "rank_0"))
    assert set(s["grad-norm"]) == {1, 2, 3, 4}
    for step, value in logged.items():
        assert s["grad-norm"][step] == pytest.approx(value, rel=1e-5)
    rows = rows_of(tmp_path / "v2", "weight_grad")
    assert {int(r["step"]) for r in rows} == {1, 2, 3, 4}
    assert len(rows) == len({(r["step"], r["scope"], r["module_name"]) for r in rows})  # no step twice


def test_clip_grad_norm_is_put_back_after_training(tmp_path: Path) -> None:
    accelerate = pytest.importorskip("accelerate")
    before = vars(accelerate.Accelerator)["clip_grad_norm_"]
    run(tmp_path, TrainProbeCallback(metrics_config={"monitor_config": {"monitor_on": True}}), max_steps=1)
    assert vars(accelerate.Accelerator)["clip_grad_norm_"] is before


def test_grad_norm_without_clipping_is_the_trainers(tmp_path: Path) -> None:
    """``max_grad_norm=0``: the Trainer still measures the norm (an unbounded clip) and logs it;
    ``grad-norm`` is that value."""
    metrics = {"monitor_config": {"monitor_on": True}, "tensorboard": {"tensorboard_dir": str(tmp_path / "tb")}}
    trainer = run(tmp_path, TrainProbeCallback(metrics_config=metrics), max_grad_norm=0.0)
    logged = {e["step"]: e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e}
    s = scalars(read_events(tmp_path / "tb" / "rank_0"))
    assert set(s["grad-norm"]) == set(logged) == set(range(1, STEPS + 1))
    for step, value in logged.items():
        assert s["grad-norm"][step] == pytest.approx(value, rel=1e-5)


@pytest.mark.parametrize("with_metrics", [True, False])
def test_one_clock_when_the_optimizer_does_not_end_monitor_v2s_steps(tmp_path: Path, with_metrics: bool) -> None:
    """``"patch_optimizer_step": false``: the callback's step end ticks Monitor V2 with the
    metrics, so its rows hold the Trainer's global steps 1..3, as the metrics do (before, every
    row stayed at step 1)."""
    metrics = {"monitor_config": {"monitor_on": True}, "tensorboard": {"tensorboard_dir": str(tmp_path / "tb")}}
    v2 = {"output_dir": str(tmp_path / "v2"), "monitors": V2_GRADS, "patch_optimizer_step": False}
    callback = TrainProbeCallback(metrics_config=metrics if with_metrics else None, monitor_v2_config=v2)
    run(tmp_path, callback)
    rows = rows_of(tmp_path / "v2", "weight_grad")
    assert {int(r["step"]) for r in rows} == {1, 2, 3}
    assert len(rows) == len({(r["step"], r["scope"], r["module_name"]) for r in rows})  # no step twice
    if with_metrics:
        assert set(scalars(read_events(tmp_path / "tb" / "rank_0"))["grad-norm"]) == {1, 2, 3}


class LogRecorder(transformers.TrainerCallback):
    """An in-process logger: every ``on_log`` the Trainer dispatches, as ``(global step, logs)``."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, dict[str, Any]]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        self.calls.append((state.global_step, dict(logs or {})))


def run_logged(
    tmp_path: Path, metrics: dict[str, Any], *, bind: bool = True, report_to: tuple[str, ...] = ("tensorboard",)
) -> tuple[Any, LogRecorder]:
    """A tiny GPT-2 trained 4 steps, logging every 2, by AdamW with two parameter groups (the
    block's parameters named ``blocks``, at twice the learning rate; the Trainer's linear
    schedule); the callback added with ``trainer=`` when ``bind``."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=SEQ, n_embd=32, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config)
    blocks = [p for n, p in model.named_parameters() if n.startswith("transformer.h.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("transformer.h.")]
    optimizer = torch.optim.AdamW([{"params": rest}, {"params": blocks, "lr": 2e-3, "name": "blocks"}], lr=1e-3)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        per_device_train_batch_size=BATCH,
        max_steps=4,
        logging_steps=2,
        report_to=list(report_to),
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    recorder = LogRecorder()
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Tokens(32), callbacks=[recorder], optimizers=(optimizer, None)
    )
    trainer.add_callback(TrainProbeCallback(metrics_config=metrics, trainer=trainer if bind else None))
    trainer.train()
    return trainer, recorder


def forwarded(trainer: Any) -> dict[int, dict[str, float]]:
    """The ``log_history`` entries the callback logged, by step."""
    return {
        e["step"]: {k: v for k, v in e.items() if k.startswith(("trainprobe/", "lr-"))}
        for e in trainer.state.log_history
        if any(k.startswith("trainprobe/") for k in e)
    }


def test_metrics_are_logged_through_the_trainer(tmp_path: Path) -> None:
    """No ``tensorboard_dir``, ``trainer=`` given: at the Trainer's logging steps (2, 4) the
    metrics of that step go through ``trainer.log``: into ``log_history``, to every callback's
    ``on_log`` and to the ``report_to`` TensorBoard integration (``train/trainprobe/...``), with
    every parameter group's learning rate (``lr-AdamW/pg1``, ``lr-AdamW/blocks``)."""
    metrics = {"monitor_config": {"monitor_on": True, "device_local_norm_format": "tensorboard"}}
    trainer, recorder = run_logged(tmp_path, metrics)
    ours = forwarded(trainer)
    assert set(ours) == {2, 4}
    logged = {e["step"]: e for e in trainer.state.log_history if "loss" in e}
    assert set(logged) == {2, 4}
    for step, m in ours.items():
        assert m["trainprobe/grad-norm"] == pytest.approx(logged[step]["grad_norm"], rel=1e-5)
        assert m["trainprobe/learning-rate"] == pytest.approx(logged[step]["learning_rate"], rel=1e-6)
        assert m["lr-AdamW/pg1"] == pytest.approx(logged[step]["learning_rate"], rel=1e-6)
        assert m["lr-AdamW/blocks"] == pytest.approx(2 * logged[step]["learning_rate"], rel=1e-6)
        assert m["trainprobe/batch-size"] == BATCH
        assert m["trainprobe/device_local_norm"] == pytest.approx(logged[step]["grad_norm"], rel=1e-4)
        assert math.isfinite(m["trainprobe/loss"])
        assert not any(k.endswith("-vs-samples") for k in m)
    seen = {step: logs for step, logs in recorder.calls if "trainprobe/loss" in logs}
    assert set(seen) == {2, 4} and seen[4]["lr-AdamW/blocks"] == ours[4]["lr-AdamW/blocks"]
    events = list((tmp_path / "hf").rglob("events.out.tfevents.*"))
    assert len(events) == 1
    s = scalars(read_events(events[0].parent))
    assert set(s["train/trainprobe/grad-norm"]) == set(s["train/lr-AdamW/pg1"]) == {2, 4}
    for step in (2, 4):
        assert s["train/trainprobe/grad-norm"][step] == pytest.approx(ours[step]["trainprobe/grad-norm"], rel=1e-6)
        assert s["train/loss"][step] == pytest.approx(logged[step]["loss"], rel=1e-6)  # the Trainer's own, apart


@pytest.mark.parametrize(
    ("bind", "report_to", "said"),
    [(False, ("tensorboard",), "was not given the Trainer"), (True, (), "reports to no integration")],
)
def test_where_the_metrics_cannot_go_is_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, bind: bool, report_to: tuple[str, ...], said: str
) -> None:
    """Without ``trainer=`` nothing reaches the Trainer; with it but no ``report_to``
    integration, only ``log_history`` does. Either way one log line says so."""
    with caplog.at_level("WARNING", logger="trainprobe"):
        trainer, _ = run_logged(tmp_path, {"monitor_config": {"monitor_on": True}}, bind=bind, report_to=report_to)
    assert len([r for r in caplog.records if said in r.getMessage()]) == 1
    assert set(forwarded(trainer)) == ({2, 4} if bind else set())


def test_an_explicit_tensorboard_dir_writes_event_files_and_logs_nothing_through_the_trainer(tmp_path: Path) -> None:
    """``tensorboard.tensorboard_dir``: trainprobe's own event files as before, now with every
    group's learning rate; nothing goes through the Trainer, even with ``trainer=``."""
    metrics = {"monitor_config": {"monitor_on": True}, "tensorboard": {"tensorboard_dir": str(tmp_path / "tb")}}
    trainer, _ = run_logged(tmp_path, metrics, report_to=())
    assert forwarded(trainer) == {}
    s = scalars(read_events(tmp_path / "tb" / "rank_0"))
    logged = {e["step"]: e for e in trainer.state.log_history if "loss" in e}
    for tag in ("loss", "learning-rate", "lr-AdamW/pg1", "lr-AdamW/blocks", "grad-norm"):
        assert set(s[tag]) == {1, 2, 3, 4}, tag
    for step in (2, 4):
        assert s["lr-AdamW/blocks"][step] == pytest.approx(2 * logged[step]["learning_rate"], rel=1e-6)
        assert s["grad-norm"][step] == pytest.approx(logged[step]["grad_norm"], rel=1e-5)
