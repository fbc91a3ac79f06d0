"""``trainprobe demo``: train the small GPT on synthetic tokens with Monitor V2 on, then summarise."""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from trainprobe.demo.gpt import GPTConfig, TinyGPT, synthetic_batches
from trainprobe.engine.layout import V2_MONITORS
from trainprobe.engine.sinks.earlier_runs import window_files
from trainprobe.frontdoors.monitor_v2.trainer import TrainerMonitorV2

DEMO_CONFIG = {
    "framework": "pytorch",
    "start_step": 0,
    "step_interval": 1,
    "step_count_per_record": 10,
    "format": "csv",
    "monitors": {
        "module": {"enabled": True, "targets": ["layers.0", "head"], "ops": ["min", "max", "mean", "norm", "nans"]},
        "weight_grad": {"enabled": True, "ops": ["min", "max", "mean", "norm", "nans"], "monitor_mbs_grad": False},
        "optimizer": {"enabled": True, "mv_distribution": True},
        "param": {"enabled": True, "param_distribution": True},
    },
}


@dataclass(frozen=True, slots=True)
class FileSummary:
    """One CSV written by the demo."""

    path: Path
    rows: int
    nan_rows: int
    first_nan: str | None


def earlier_demo_files(out: Path) -> bool:
    """Whether ``out`` already holds Monitor V2 CSV files of an earlier run."""
    return any(window_files(rank_dir, V2_MONITORS) for rank_dir in sorted(out.glob("rank_*")))


def run_demo(out: Path, steps: int = 50, seed: int = 0, overwrite: bool = False) -> list[FileSummary]:
    """Train for ``steps`` steps with Monitor V2 writing to ``out``; return what was written.
    ``overwrite``: replace an earlier run's CSV files in ``out`` (otherwise they are a
    :class:`~trainprobe.engine.errors.ConfigError`, see :meth:`TrainerMonitorV2.start`)."""
    out.mkdir(parents=True, exist_ok=True)
    config = dict(DEMO_CONFIG, output_dir=str(out))
    config_path = out / "monitor_v2_config.json"
    config_path.write_text(json.dumps(config, indent=2), encoding="utf-8")
    torch.manual_seed(seed)
    cfg = GPTConfig(n_layers=2, d_model=128, vocab_size=500, seq_len=64)
    model = TinyGPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = synthetic_batches(cfg, batch_size=8, seed=seed)
    monitor = TrainerMonitorV2(config_path, fr="pytorch")
    monitor.start(model=model, optimizer=optimizer, grad_acc_steps=1, overwrite=overwrite)
    losses = []
    for _ in range(steps):
        loss = model.loss(next(batches))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    monitor.stop()
    print(f"trained {steps} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return summarise(out)


def summarise(out: Path) -> list[FileSummary]:
    """Rows and NaN findings of every CSV under ``out``."""
    found = []
    for path in sorted(out.glob("rank_*/*.csv")):
        rows = nan_rows = 0
        first_nan = None
        with path.open(newline="", encoding="utf-8") as fh:
            for row in csv.DictReader(fh):
                rows += 1
                if _has_nan(row):
                    nan_rows += 1
                    first_nan = first_nan or f"step {row['step']} {row['module_name']}"
        found.append(FileSummary(path, rows, nan_rows, first_nan))
    return found


def _has_nan(row: dict[str, str]) -> bool:
    if row.get("nans") not in (None, "", "0"):
        return True
    return any(row.get(k) not in (None, "") and math.isnan(float(row[k])) for k in ("min", "max", "mean", "norm"))


def print_summary(out: Path, files: list[FileSummary]) -> None:
    """A short human-readable account of the demo's output: per monitor, files and rows."""
    total = sum(f.rows for f in files)
    print(f"Monitor V2 wrote {len(files)} CSV files, {total} rows, under {out}/")
    by_monitor: dict[str, list[FileSummary]] = {}
    for f in files:
        by_monitor.setdefault(f.path.name.split("_step")[0], []).append(f)
    for monitor, group in by_monitor.items():
        first, last = group[0].path, group[-1].path
        span = first.name if len(group) == 1 else f"{first.name} ... {last.name}"
        print(f"  {monitor:<12} {len(group):>3} files {sum(f.rows for f in group):>7} rows  {first.parent.name}/{span}")
    nan_files = [f for f in files if f.nan_rows]
    if nan_files:
        print(f"NaN found in {len(nan_files)} files; first: {nan_files[0].first_nan} ({nan_files[0].path.name})")
    else:
        print("No NaN found.")
