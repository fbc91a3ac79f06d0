"""The Hugging Face Trainer callback: a tiny GPT-2 built locally, trained by the real Trainer,
outputs read back."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from test_metrics_helpers import read_events, scalars, texts  # noqa: E402
from trainprobe.errors import ConfigError  # noqa: E402
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


class GradRecorder(transformers.TrainerCallback):
    """The test's own view of the gradients the optimizer applies (after the Trainer's clip)."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        grads = [p.grad for p in kwargs["model"].parameters() if p.grad is not None]
        self.norms.append(float(torch.nn.utils.get_total_norm(grads)))


def run(tmp_path: Path, callback: TrainProbeCallback, recorder: GradRecorder | None = None, accumulation: int = 1) -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=SEQ, n_embd=32, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        per_device_train_batch_size=BATCH,
        max_steps=STEPS,
        learning_rate=1e-3,
        logging_steps=1,
        gradient_accumulation_steps=accumulation,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    callbacks = [callback] + ([recorder] if recorder else [])
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(32), callbacks=callbacks)
    trainer.train()
    return trainer


def test_trainer_callback_writes_metrics_and_monitor_v2(tmp_path: Path) -> None:
    metrics = {
        "monitor_config": {"monitor_on": True, "local_norm_format": "tensorboard", "target": ["h\\.0\\.attn"]},
        "tensorboard": {"tensorboard_dir": str(tmp_path / "tb"), "log_timers_to_tensorboard": True},
    }
    v2 = {"output_dir": str(tmp_path / "v2"), "monitors": {"weight_grad": {"enabled": True}}}
    recorder = GradRecorder()
    trainer = run(tmp_path, TrainProbeCallback(metrics_config=metrics, monitor_v2_config=v2), recorder)
    acc = read_events(tmp_path / "tb" / "rank_0")
    s = scalars(acc)
    steps = set(range(1, STEPS + 1))
    for tag in ("loss", "learning-rate", "grad-norm", "batch-size", "iteration-time", "throughput"):
        assert set(s[tag]) == steps, tag
    assert set(s["loss-vs-samples"]) == {BATCH * k for k in steps}
    assert all(v == BATCH for v in s["batch-size"].values())
    for step, norm in enumerate(recorder.norms, start=1):
        assert s["grad-norm"][step] == pytest.approx(norm, rel=1e-5)
    logged = {e["step"]: e for e in trainer.state.log_history if "loss" in e}
    for step in steps:
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


def test_misconfiguration_fails_at_construction() -> None:
    with pytest.raises(ConfigError, match="pass metrics_config=, monitor_v2_config=, or both"):
        TrainProbeCallback()
    with pytest.raises(ConfigError, match=r"monitor_config\.step_interval"):
        TrainProbeCallback(metrics_config={"monitor_config": {"step_interval": -1}})
