"""Fixed cost of monitoring per row and per hook call, on small models where it dominates.

What is trained (CPU, one intra-op thread, ``torch.manual_seed`` fixed):

* ``gpt``: ``TinyGPT`` of :mod:`trainprobe.demo.gpt` shrunk to about 100k parameters (4 layers,
  d_model 32, 2 heads, sequence 32, vocabulary 512; 54 parameter tensors, most of them small),
  batch 4, AdamW.
* ``mlp``: 200 ``Linear(16, 16)`` layers with ReLU between them (400 parameter tensors of 16 or
  256 values, 54k parameters), batch 32, AdamW.
* ``gpt_bench`` (not in the default run): the GPT of ``bench_monitor_v2.py`` (4 layers, d_model
  256, 4.2M parameters, batch 8), to see the same costs where the reductions dominate.

Configurations: Monitor V2 ``weight_grad``, ``weight_grad + optimizer + param``, ``module`` (all
modules), Monitor V1 ``wg + mv + param`` and ``xy`` (``all_xy``), each with the default ops of
its dialect (V1 with min, max, norm, mean, nans as in ``bench_monitor_v1.py``).

Method: blocks of ``--steps`` steps alternate between monitored (``start()`` before the block,
``stop()`` after it, neither timed) and unmonitored, the order inside a pair alternating. A
step's time is the process's CPU time (``time.process_time``: every thread, the writer thread's
formatting and writing included) around forward, backward, ``optimizer.step()`` and
``zero_grad``. Each block starts with one untimed step, so that each timed step carries one
step's worth of background writing. Per pair, the monitoring cost of a step is the monitored
block's mean step time minus the unmonitored block's; the figure is the median over the pairs.
A census block (an extra monitored block, untimed) counts the rows written per step and the
calls per step of the hooks the monitor registers (tensor gradient hooks, module forward hooks,
optimizer step hooks); ``µs/row`` and ``µs/call`` divide the cost by them.

Usage::

    python bench/bench_row_cost.py                        # both models, every config
    python bench/bench_row_cost.py --models gpt --configs v2_wg,v1_wg_mv_param --pairs 20
    python bench/bench_row_cost.py --profile v2_all_params --models mlp   # cProfile, writer inline
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench_monitor_v2 import in_turn, print_profile, profiled_steps
from trainprobe import TrainerMonitorV2
from trainprobe.demo.gpt import GPTConfig, TinyGPT, synthetic_batches
from trainprobe.engine.sinks import background

V1_OPS = ["min", "max", "norm", "mean", "nans"]


@dataclass(frozen=True)
class RowConfig:
    """One monitored configuration."""

    key: str
    dialect: str  # "v2" or "v1"
    monitors: dict[str, Any]


def _on(*names: str) -> dict[str, Any]:
    return {name: {"enabled": True} for name in names}


CONFIGS: tuple[RowConfig, ...] = (
    RowConfig("v2_wg", "v2", _on("weight_grad")),
    RowConfig("v2_all_params", "v2", _on("weight_grad", "optimizer", "param")),
    RowConfig("v2_module", "v2", _on("module")),
    RowConfig(
        "v1_wg_mv_param",
        "v1",
        {"wg_distribution": True, "mv_distribution": True, "param_distribution": True, "ops": V1_OPS},
    ),
    RowConfig("v1_xy", "v1", {"xy_distribution": True, "all_xy": True, "ops": V1_OPS}),
)


# -- models -----------------------------------------------------------------------------------
class DeepMLP(nn.Module):
    """``depth`` small ``Linear`` layers with ReLU between them, and a mean-square loss."""

    def __init__(self, depth: int = 200, width: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        return self(x).square().mean()


class Trainer:
    """A model, AdamW and a stream of batches; :meth:`step` returns the step's CPU seconds."""

    def __init__(self, model_name: str, seed: int) -> None:
        torch.manual_seed(seed)
        if model_name in ("gpt", "gpt_bench"):
            small = GPTConfig(vocab_size=512, seq_len=32, d_model=32, n_heads=2, n_layers=4)
            cfg = small if model_name == "gpt" else GPTConfig()
            self.model: nn.Module = TinyGPT(cfg)
            self.batches: Iterator[torch.Tensor] = synthetic_batches(cfg, 4 if model_name == "gpt" else 8, seed=seed)
        else:
            self.model = DeepMLP()
            gen = torch.Generator().manual_seed(seed)
            self.batches = iter(lambda: torch.randn(32, 16, generator=gen), None)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    def step(self) -> float:
        batch = next(self.batches)
        t0 = time.process_time()
        loss = self.model.loss(batch)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return time.process_time() - t0


# -- monitors ---------------------------------------------------------------------------------
class Monitor:
    """``start()``/``stop()`` of either dialect over one configuration."""

    def __init__(self, cfg: RowConfig, out: Path) -> None:
        self.cfg = cfg
        self.out = out
        self._mon: Any = None

    def start(self, trainer: Trainer) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        if self.cfg.dialect == "v2":
            spec = {"output_dir": str(self.out), "monitors": self.cfg.monitors}
            self._mon = TrainerMonitorV2(spec)
            self._mon.start(model=trainer.model, optimizer=trainer.optimizer, overwrite=True)
            return
        from trainprobe.frontdoors.monitor_v1 import TrainerMon

        os.environ["MONITOR_OUTPUT_DIR"] = str(self.out)
        path = self.out / "monitor_config.json"
        path.write_text(json.dumps(self.cfg.monitors), encoding="utf-8")
        self._mon = TrainerMon(str(path), params_have_main_grad=False)
        self._mon.set_monitor(trainer.model, grad_acc_steps=1, optimizer=trainer.optimizer)

    def stop(self) -> None:
        if self._mon is not None:
            self._mon.stop()
            self._mon = None


def run_block(trainer: Trainer, steps: int, monitor: Monitor | None) -> float:
    """Mean CPU seconds of ``steps`` timed steps after one untimed one."""
    if monitor is not None:
        monitor.start(trainer)
    trainer.step()
    times = [trainer.step() for _ in range(steps)]
    if monitor is not None:
        monitor.stop()
    return statistics.fmean(times)


_HOOK_REGISTRARS = (
    (torch.Tensor, "register_hook"),
    (nn.Module, "register_forward_pre_hook"),
    (nn.Module, "register_forward_hook"),
    (torch.optim.Optimizer, "register_step_pre_hook"),
    (torch.optim.Optimizer, "register_step_post_hook"),
)


@contextlib.contextmanager
def census() -> Iterator[dict[str, int]]:
    """Counts rows submitted to writers, and calls of every hook registered while active (tensor
    gradient hooks, module forward hooks, optimizer step hooks: what torch calls, however the
    monitor wraps its functions inside)."""
    counts = {"rows": 0, "calls": 0}
    real_submit = background.Writer.submit
    saved = [(owner, name, getattr(owner, name)) for owner, name in _HOOK_REGISTRARS]

    def counting(register: Callable[..., Any]) -> Callable[..., Any]:
        def register_counted(self: Any, hook: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            def counted(*hook_args: Any, **hook_kwargs: Any) -> Any:
                counts["calls"] += 1
                return hook(*hook_args, **hook_kwargs)

            return register(self, counted, *args, **kwargs)

        return register_counted

    def submit(self: Any, batch: Any) -> None:
        counts["rows"] += len(batch)
        real_submit(self, batch)

    background.Writer.submit = submit  # type: ignore[method-assign]
    for owner, name, register in saved:
        setattr(owner, name, counting(register))
    try:
        yield counts
    finally:
        background.Writer.submit = real_submit  # type: ignore[method-assign]
        for owner, name, register in saved:
            setattr(owner, name, register)


@contextlib.contextmanager
def writer_inline() -> Iterator[None]:
    """Writers write on the calling thread (so that cProfile sees the formatting)."""
    real = background.Writer.__init__

    def init(self: Any, sink: Any, *, background: bool, on_error: Any, max_pending: int = 256) -> None:
        real(self, sink, background=False, on_error=on_error, max_pending=max_pending)

    background.Writer.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        background.Writer.__init__ = real  # type: ignore[method-assign]


@dataclass
class Cost:
    """What was measured for one model and configuration."""

    model: str
    config: str
    rows: float
    calls: float
    base_us: float
    deltas_us: list[float]

    @property
    def delta_us(self) -> float:
        return statistics.median(self.deltas_us)


def measure(trainer: Trainer, model_name: str, cfg: RowConfig, out: Path, pairs: int, steps: int) -> Cost:
    monitor = Monitor(cfg, out / f"{model_name}_{cfg.key}")
    with census() as counts:
        run_block(trainer, steps, monitor)
    census_steps = steps + 1
    run_block(trainer, steps, None)
    deltas, bases = [], []
    for i in range(pairs):
        a, b = in_turn(i, lambda: run_block(trainer, steps, monitor), lambda: run_block(trainer, steps, None))
        deltas.append(1e6 * (a - b))
        bases.append(1e6 * b)
    return Cost(
        model_name,
        cfg.key,
        counts["rows"] / census_steps,
        counts["calls"] / census_steps,
        statistics.median(bases),
        deltas,
    )


def profile(trainer: Trainer, model_name: str, cfg: RowConfig, out: Path, steps: int, top: int) -> None:
    """cProfile of ``steps`` monitored steps, writer on the training thread."""
    with writer_inline():
        monitor = Monitor(cfg, out / f"profile_{model_name}_{cfg.key}")
        monitor.start(trainer)
        trainer.step()
        prof = profiled_steps(trainer.step, steps)
        monitor.stop()
    print_profile(prof, f"{model_name} {cfg.key}, {steps} steps, writer inline", top)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gpt,mlp", help="comma-separated: gpt, mlp, gpt_bench")
    p.add_argument("--configs", default=",".join(c.key for c in CONFIGS))
    p.add_argument("--pairs", type=int, default=12, help="monitored/unmonitored block pairs per config")
    p.add_argument("--steps", type=int, default=10, help="timed steps per block")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", default="", help="a config to profile instead of timing")
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    by_key = {c.key: c for c in CONFIGS}
    chosen = [by_key[k.strip()] for k in (args.profile or args.configs).split(",") if k.strip()]
    tmp = Path(tempfile.mkdtemp(prefix="trainprobe-rowcost-"))
    try:
        results = []
        for model_name in [m.strip() for m in args.models.split(",") if m.strip()]:
            trainer = Trainer(model_name, args.seed)
            n = sum(p.numel() for p in trainer.model.parameters())
            tensors = len(list(trainer.model.parameters()))
            print(f"{model_name}: {n} parameters in {tensors} tensors", flush=True)
            for _ in range(5):
                trainer.step()
            for cfg in chosen:
                if args.profile:
                    profile(trainer, model_name, cfg, tmp, args.steps, args.top)
                    continue
                cost = measure(trainer, model_name, cfg, tmp, args.pairs, args.steps)
                results.append(cost)
                print(f"  {cfg.key}: +{cost.delta_us:.0f} µs/step over {cost.base_us:.0f} µs", flush=True)
        if results:
            print(
                "\n| model | config | step (unmonitored) | + monitoring | IQR | rows/step | hook calls/step "
                "| µs/row | µs/call |"
            )
            print("|---|---|---|---|---|---|---|---|---|")
            for c in results:
                q = statistics.quantiles(c.deltas_us, n=4, method="inclusive") if len(c.deltas_us) > 1 else [0, 0, 0]
                print(
                    f"| {c.model} | {c.config} | {c.base_us / 1000:.2f} ms | {c.delta_us / 1000:.2f} ms "
                    f"| {q[0] / 1000:.2f}–{q[2] / 1000:.2f} | {c.rows:.0f} | {c.calls:.0f} "
                    f"| {c.delta_us / max(c.rows, 1):.1f} | {c.delta_us / max(c.calls, 1):.1f} |"
                )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
