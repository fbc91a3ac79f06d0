"""One small fixed-seed training run under either package, used by the interop harness.

Usage: python train.py --pkg msprobe|trainprobe --what WHAT --out DIR

The script calls the chosen package's public API exactly as the specifications document it
(only the package name differs), with the config files under ``tests/interop/configs``. It is
run by the reference tool's Python for ``--pkg msprobe`` and never imported by trainprobe.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
from pathlib import Path
from typing import Any

import torch
from torch import nn

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
STEPS = 5
MONITORED = 4
WHATS = ("baseline", "v2", "v1", "v1-tb", "dump-L0", "dump-L1", "dump-mix", "dump-tensor")


class Net(nn.Module):
    """A TransformerEncoderLayer followed by an MLP head, and a layer never used (no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(4, 4)
        self.encoder = nn.TransformerEncoderLayer(
            d_model=16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True
        )
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.encoder(x)).mean(dim=1)


def seed(value: int = 1234) -> None:
    random.seed(value)
    torch.manual_seed(value)


def make() -> tuple[nn.Module, torch.optim.Optimizer, list[tuple[torch.Tensor, torch.Tensor]]]:
    seed()
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(99)
    data = [(torch.randn(2, 5, 16, generator=gen), torch.randn(2, 4, generator=gen)) for _ in range(STEPS)]
    return model, opt, data


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    loss = (model(x) - y).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def config(name: str, **changes: Any) -> str:
    """Write the shared config ``name`` with ``changes`` applied; return its path."""
    data = json.loads((CONFIGS / name).read_text())
    data.update(changes)
    path = Path(os.environ["INTEROP_OUT"]) / f"config_{name}"
    path.write_text(json.dumps(data, indent=2))
    return str(path)


def run_v2(pkg: str, out: Path) -> list[float]:
    trainer = importlib.import_module(f"{pkg}.core.monitor_v2.trainer")
    model, opt, data = make()
    (out / "v2").mkdir()
    mon = trainer.TrainerMonitorV2(config("monitor_v2.json", output_dir=str(out / "v2")), fr="pytorch")
    mon.start(model=model, optimizer=opt, grad_acc_steps=1)
    losses = [train_step(model, opt, x, y) for x, y in data[:MONITORED]]
    mon.stop()
    return losses + [train_step(model, opt, x, y) for x, y in data[MONITORED:]]  # training goes on


def run_v1(pkg: str, out: Path, fmt: str) -> list[float]:
    os.environ["MONITOR_OUTPUT_DIR"] = str(out / ("v1" if fmt == "csv" else "v1-tb"))
    api = importlib.import_module(f"{pkg}.pytorch")
    model, opt, data = make()
    mon = api.TrainerMon(config_file_path=config("monitor_v1.json", format=fmt), params_have_main_grad=False)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt, dp_group=None, tp_group=None, start_iteration=0)
    return [train_step(model, opt, x, y) for x, y in data]


def run_dump(pkg: str, out: Path, what: str) -> list[float]:
    level = {"dump-L0": "L0", "dump-L1": "L1", "dump-mix": "mix", "dump-tensor": "L1"}[what]
    task = "tensor" if what == "dump-tensor" else "statistics"
    api = importlib.import_module(f"{pkg}.pytorch")
    path = config("dump.json", task=task, level=level, dump_path=str(out / what))
    debugger = api.PrecisionDebugger(config_path=path)
    model, opt, data = make()
    losses = []
    for x, y in data[:2]:
        debugger.start(model=model)
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        debugger.stop()
        opt.step()
        opt.zero_grad(set_to_none=True)
        debugger.step()
        losses.append(float(loss.detach()))
    return losses + [train_step(model, opt, x, y) for x, y in data[2:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pkg", choices=("msprobe", "trainprobe"), required=True)
    parser.add_argument("--what", choices=WHATS, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ["INTEROP_OUT"] = str(out)
    os.chdir(out)
    if args.what == "baseline":
        model, opt, data = make()
        losses = [train_step(model, opt, x, y) for x, y in data]
    elif args.what == "v2":
        losses = run_v2(args.pkg, out)
    elif args.what.startswith("v1"):
        losses = run_v1(args.pkg, out, "csv" if args.what == "v1" else "tensorboard")
    else:
        losses = run_dump(args.pkg, out, args.what)
    (out / f"losses_{args.what}.json").write_text(json.dumps(losses))


if __name__ == "__main__":
    main()
