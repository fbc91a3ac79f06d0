"""``trainprobe demo``: train the small GPT on synthetic tokens with Monitor V2 on, then summarise
and print the next commands to run on its output.

``--fault spike|nan`` puts something to find in the run, at step ``--fault-step`` (default 30):

* ``spike``: that step's batch reaches the first block 1000x too large (the token embeddings'
  output scaled, as a bad data batch or a broken scaling would do): its activations spike, and
  the loss jumps;
* ``nan``: that step's gradient of ``layers.1.mlp.fc1.weight`` holds a NaN (as a faulty kernel or
  collective leaves one) before ``optimizer.step()``, which spreads it to the weights.

The same seed gives the same batches, so a clean demo and a faulty one are identical up to the
fault's step: ``trainprobe diff`` finds it there, ``trainprobe diagnose`` finds it alone.
"""

from __future__ import annotations

import csv
import json
import math
import shlex
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainprobe.demo.gpt import GPTConfig, TinyGPT, synthetic_batches
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


DEFAULT_OUT = Path("trainprobe_demo")
"""Where the clean demo writes (``--out``'s default); a faulty one: ``trainprobe_demo_<fault>``."""
FAULTS = ("spike", "nan")
DEFAULT_FAULT_STEP = 30
SPIKE_SCALE = 1000.0
NAN_PARAMETER = "layers.1.mlp.fc1.weight"
SPIKE_WARMUP = 10
"""``trainprobe diagnose`` calls a value a spike only after this many earlier values (its warm-up)."""


@dataclass(frozen=True, slots=True)
class Fault:
    """A fault the demo puts into its run: ``kind`` (one of :data:`FAULTS`) at ``step``."""

    kind: str
    step: int

    def describe(self) -> str:
        """One line saying what was done, for the demo's output."""
        if self.kind == "spike":
            return f"fault: step {self.step}'s batch reached the first block {SPIKE_SCALE:g}x too large (a spike)"
        return f"fault: step {self.step}'s gradient of {NAN_PARAMETER} got a NaN before optimizer.step()"


def default_out(fault: Fault | None) -> Path:
    """``--out``'s default: ``trainprobe_demo``, or ``trainprobe_demo_<fault>`` for a faulty run."""
    return DEFAULT_OUT if fault is None else DEFAULT_OUT.with_name(f"{DEFAULT_OUT.name}_{fault.kind}")


def check_fault(kind: str | None, step: int | None, steps: int) -> Fault | None:
    """The fault that ``--fault kind --fault-step step`` asks for (None for a clean run).

    Raises:
        ConfigError: ``--fault-step`` without ``--fault``; a step outside ``1 .. steps - 1``; a
            spike before diagnose's warm-up (it could not be found).
    """
    from trainprobe.engine.errors import ConfigError

    if kind is None:
        if step is not None:
            raise ConfigError("--fault-step: needs --fault spike or --fault nan")
        return None
    at = DEFAULT_FAULT_STEP if step is None else step
    if not 1 <= at < steps:
        raise ConfigError(f"--fault-step: must be between 1 and {steps - 1} (--steps {steps}), got {at}")
    if kind == "spike" and at < SPIKE_WARMUP:
        raise ConfigError(
            f"--fault-step: a spike at step {at} cannot be found: diagnose judges a value against at least "
            f"{SPIKE_WARMUP} earlier ones; use {SPIKE_WARMUP} or more"
        )
    return Fault(kind, at)


@dataclass(frozen=True, slots=True)
class FileSummary:
    """One CSV written by the demo."""

    path: Path
    rows: int
    nan_rows: int
    first_nan: str | None


def run_demo(
    out: Path, steps: int = 50, seed: int = 0, overwrite: bool = False, fault: Fault | None = None
) -> list[FileSummary]:
    """Train for ``steps`` steps with Monitor V2 writing to ``out``, with ``fault`` put in (see
    the module docstring); return what was written. ``overwrite``: replace an earlier run's CSV
    files in ``out``; otherwise an earlier run there is moved aside to ``<out>.1`` (see
    :meth:`TrainerMonitorV2.start`)."""
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
    for step in range(steps):
        faulty = fault if fault is not None and fault.step == step else None
        with _spiked(model, faulty):
            loss = model.loss(next(batches))
        loss.backward()
        if faulty is not None and faulty.kind == "nan":
            _nan_gradient(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    monitor.stop()
    (out / "loss.csv").write_text("step,loss\n" + "".join(f"{s},{v!r}\n" for s, v in enumerate(losses)), encoding="utf-8")
    print(f"trained {steps} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    if fault is not None:
        print(fault.describe())
    return summarise(out)


@contextmanager
def _spiked(model: TinyGPT, fault: Fault | None) -> Iterator[None]:
    """While the block runs, the token embeddings' output is scaled by :data:`SPIKE_SCALE` when
    ``fault`` is a spike (a forward hook, removed after)."""
    if fault is None or fault.kind != "spike":
        yield
        return

    def scale(module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return output * SPIKE_SCALE

    handle = model.tok_emb.register_forward_hook(scale)
    try:
        yield
    finally:
        handle.remove()


def _nan_gradient(model: TinyGPT) -> None:
    """One element of :data:`NAN_PARAMETER`'s gradient set to NaN."""
    grad = model.get_parameter(NAN_PARAMETER).grad
    if grad is not None:
        with torch.no_grad():
            grad.view(-1)[0] = float("nan")


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


def next_commands(out: Path, fault: Fault | None) -> list[str]:
    """The commands to run next on the demo's output ``out`` (paths as given, quoted for a shell):
    diagnose, report and, for a faulty run, diff against a clean demo run (with the command making
    one first when ``trainprobe_demo`` holds none); for a clean run, the demo with a fault."""
    run = shlex.quote(str(out))
    commands = [f"trainprobe diagnose {run}", f"trainprobe report {run} -o {shlex.quote(str(out / 'report.html'))}"]
    if fault is None:
        return [*commands, "trainprobe demo --fault spike          # the same run with a fault to find (or --fault nan)"]
    clean = DEFAULT_OUT if out.resolve() != DEFAULT_OUT.resolve() else DEFAULT_OUT.with_name(f"{DEFAULT_OUT.name}_clean")
    if not list(clean.glob("rank_*/*.csv")):
        commands.append(f"trainprobe demo --out {shlex.quote(str(clean))}          # a clean run to compare with")
    return [*commands, f"trainprobe diff {shlex.quote(str(clean))} {run}"]


def print_next(out: Path, fault: Fault | None) -> None:
    """Print :func:`next_commands` under a heading."""
    print("Find the fault:" if fault is not None else "Next:")
    for command in next_commands(out, fault):
        print(f"  {command}")
