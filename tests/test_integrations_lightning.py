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


class Regressor(pl.LightningModule):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(width, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.param_grad_norms: list[dict[str, float]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.grad_norms.append(float(torch.nn.utils.get_total_norm(grads)))
        self.param_grad_norms.append(
            {n: p.grad.double().norm().item() for n, p in self.net.named_parameters() if p.grad is not None}
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=BATCH)


def fit(tmp_path: Path, callback: TrainProbeCallback) -> tuple[Any, Regressor]:
    torch.manual_seed(0)
    module = Regressor()
    trainer = pl.Trainer(
        max_steps=STEPS,
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
    trainer.fit(module, loader())
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
        assert s["grad-norm"][step] == pytest.approx(module.grad_norms[step - 1], rel=1e-5)
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


def test_monitor_v2_reads_gradients_inside_the_optimizer_closure(tmp_path: Path) -> None:
    """Lightning runs forward/backward inside ``optimizer.step(closure)``: weight_grad
    ``reduced`` rows must hold the step's accumulated gradients (before clipping), not the
    previous step's or none."""
    ops = ["norm", "nans"]
    v2 = {
        "output_dir": str(tmp_path / "v2"),
        "monitors": {"weight_grad": {"enabled": True, "ops": ops}, "optimizer": {"enabled": True, "ops": ops}},
    }
    trainer, module = fit(tmp_path, TrainProbeCallback(monitor_v2_config=v2))
    assert trainer.global_step == STEPS
    reduced = [r for r in rows_of(tmp_path / "v2", "weight_grad") if r["scope"] == "reduced"]
    assert {int(r["step"]) for r in reduced} == set(range(STEPS))
    for row in reduced:
        name = row["module_name"].removeprefix("net.")
        want = module.param_grad_norms[int(row["step"])][name]
        assert float(row["norm"]) == pytest.approx(want, rel=1e-5), row
    exp_avg = [r for r in rows_of(tmp_path / "v2", "optimizer") if "exp_avg" in r["module_name"]]
    assert {int(r["step"]) for r in exp_avg} == set(range(STEPS))
