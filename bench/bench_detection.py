"""Detection benchmark of the spike rules (issue #34): false anomalies on healthy runs, faults
found and their step error, per rule, on real generated runs (nothing shipped).

Each run trains a small model (a tiny GPT of ``trainprobe.demo.gpt`` or a 3-layer MLP on a
teacher's regression) under Monitor V2 (module, weight_grad, optimizer and param monitors, CSV)
and is labelled before it runs:

* healthy: long (200 steps), LR warm-up then cosine decay, zero-initialised output projections,
  large early gradients that fall, a slowly drifting input scale, bf16 autocast;
* faulty: a NaN in one gradient, a x10 and a x100 input spike early (step 9) and late, a x10 /
  x100 gradient spike on one parameter, an LR bug from step 8 (the LR 30 times too large), a x100
  batch on one rank of a 2-rank gloo DDP run, a x100 spike under bf16.

The runs are read back through the query layer (:func:`trainprobe.tools.query.layer.connect`); every
rule of :data:`trainprobe.engine.rules.RULES` is applied to every per-layer series (both signals,
every table, rank, scope), together with the NaN/inf check that every rule shares. Printed per
rule: the false anomalies on the healthy runs (flagged rows, and runs with any), the faults found
at their step (the first flagged step of the run is the true one and the true tensor is flagged
there; x10 and above and NaN: the ones the default must find), and the step error of the first
flag (flag step minus true step; negative: a false alarm came first).

    PYTHONPATH=src python bench/bench_detection.py [--keep DIR] [--reuse] [--only NAME,...] [--verbose]

``--keep DIR`` writes the runs there (kept); ``--reuse`` reads runs already in DIR instead of
training them again (to try rules on the same runs); ``--verbose`` lists the first false
anomalies of each rule on the healthy runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

OPS = ["min", "max", "mean", "norm", "nans"]
VIEWS = ("module", "weight_grad", "optimizer", "param")


# -- the runs ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    """What goes wrong, where: ``kind`` input (the batch times ``factor``), grad (one
    parameter's gradient times ``factor``), nan (one gradient element NaN), lr (the LR times
    ``factor`` from ``step`` on)."""

    kind: str
    step: int
    factor: float = 1.0
    param: str = ""
    rank: int = 0


@dataclass(frozen=True)
class RunSpec:
    """One generated run and its label (``tensors``: the names a rule must flag at the step)."""

    name: str
    model: str  # "gpt" or "mlp"
    steps: int = 200
    schedule: str = "constant"  # "constant", "warmup" (linear warm-up then cosine)
    lr: float = 3e-3
    zero_init: bool = False
    init_scale: float = 1.0
    drift: float = 0.0  # the input scale grows by (1 + drift) per step
    bf16: bool = False
    world: int = 1
    fault: Fault | None = None
    tensors: tuple[str, ...] = ()
    note: str = ""

    @property
    def healthy(self) -> bool:
        """No fault injected."""
        return self.fault is None

    @property
    def must_find(self) -> bool:
        """A NaN or a fault of x10 and above: the default rule must name it at its step."""
        f = self.fault
        return f is not None and (f.kind == "nan" or (f.kind in ("input", "grad") and f.factor >= 10))


MLP_INPUT = (".input.0", "fc_in.input.0")
GPT_GRAD = "layers.1.mlp.fc1.weight"
RUNS: tuple[RunSpec, ...] = (
    RunSpec("gpt_long", "gpt", note="200 steps, AdamW 3e-3"),
    RunSpec("mlp_long", "mlp", note="200 steps, AdamW 3e-3"),
    RunSpec("gpt_warmup", "gpt", schedule="warmup", lr=1e-2, note="LR warm-up 20 steps, cosine"),
    RunSpec("gpt_zero_init", "gpt", schedule="warmup", zero_init=True, note="proj/fc2 zero-init, warm-up"),
    RunSpec("mlp_large_early", "mlp", init_scale=4.0, lr=1e-2, note="x4 init: large early gradients"),
    RunSpec("mlp_drift", "mlp", drift=0.01, note="input scale x1.01 per step (x7)"),
    RunSpec("gpt_bf16", "gpt", bf16=True, note="bf16 autocast"),
    RunSpec("mlp_zero_init", "mlp", zero_init=True, schedule="warmup", note="zero-init hidden/out, warm-up"),
    RunSpec("gpt_nan", "gpt", steps=80, fault=Fault("nan", 60, param="layers.0.mlp.fc2.weight"),
            tensors=("layers.0.mlp.fc2.weight",)),
    RunSpec("mlp_x100_s9", "mlp", steps=40, fault=Fault("input", 9, 100.0), tensors=MLP_INPUT),
    RunSpec("mlp_x10_s9", "mlp", steps=40, fault=Fault("input", 9, 10.0), tensors=MLP_INPUT),
    RunSpec("mlp_x100_late", "mlp", steps=160, fault=Fault("input", 150, 100.0), tensors=MLP_INPUT),
    RunSpec("mlp_x10_late", "mlp", steps=160, fault=Fault("input", 150, 10.0), tensors=MLP_INPUT),
    RunSpec("gpt_grad_x10_s9", "gpt", steps=40, fault=Fault("grad", 9, 10.0, GPT_GRAD), tensors=(GPT_GRAD,)),
    RunSpec("gpt_grad_x100_late", "gpt", steps=140, fault=Fault("grad", 120, 100.0, GPT_GRAD), tensors=(GPT_GRAD,)),
    RunSpec("gpt_grad_x10_late", "gpt", steps=140, fault=Fault("grad", 120, 10.0, GPT_GRAD), tensors=(GPT_GRAD,)),
    RunSpec("gpt_lr_bug_s8", "gpt", steps=60, fault=Fault("lr", 8, 30.0), note="LR x30 from step 8"),
    RunSpec("mlp_bf16_x100_late", "mlp", steps=160, bf16=True, fault=Fault("input", 150, 100.0), tensors=MLP_INPUT),
    RunSpec("ddp_rank1_x100", "mlp", steps=60, world=2, fault=Fault("input", 30, 100.0, rank=1), tensors=MLP_INPUT),
)


class TeacherMLP:
    """A fixed random teacher's regression task: ``y = teacher(x)``, x ~ N(0, 1) of 32."""

    def __init__(self, seed: int) -> None:
        import torch

        gen = torch.Generator().manual_seed(1000 + seed)
        self.w1 = torch.randn(32, 64, generator=gen) / math.sqrt(32)
        self.w2 = torch.randn(64, 1, generator=gen) / 8
        self.gen = torch.Generator().manual_seed(seed)

    def batches(self, drift: float) -> Iterator[tuple[Any, Any]]:
        """Endless (x, y) batches of 64; the input scale grows by ``1 + drift`` per step."""
        import torch

        step = 0
        while True:
            x = torch.randn(64, 32, generator=self.gen)
            y = torch.tanh(x @ self.w1) @ self.w2
            yield x * (1 + drift) ** step, y * (1 + drift) ** step
            step += 1


def _mlp(spec: RunSpec) -> Any:
    from torch import nn

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc_in = nn.Linear(32, 64)
            self.fc_h = nn.Linear(64, 64)
            self.fc_out = nn.Linear(64, 1)

        def forward(self, x: Any) -> Any:
            return self.fc_out(nn.functional.gelu(self.fc_h(nn.functional.gelu(self.fc_in(x)))))

    model = MLP()
    _scale_and_zero(model, spec, ("fc_h", "fc_out"))
    return model


def _gpt(spec: RunSpec) -> Any:
    from trainprobe.demo.gpt import GPTConfig, TinyGPT

    model = TinyGPT(GPTConfig(vocab_size=128, seq_len=32, d_model=32, n_heads=2, n_layers=2))
    _scale_and_zero(model, spec, ("attn.proj", "mlp.fc2"))
    return model


def _scale_and_zero(model: Any, spec: RunSpec, zeroed: tuple[str, ...]) -> None:
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if spec.init_scale != 1.0 and name.endswith("weight") and p.ndim == 2:
                p.mul_(spec.init_scale)
            if spec.zero_init and any(name.startswith(z) or f".{z}." in name for z in zeroed):
                p.zero_()


def _lr_at(spec: RunSpec, step: int) -> float:
    lr = spec.lr
    if spec.schedule == "warmup":
        lr = lr * (step + 1) / 20 if step < 20 else lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - 20) / spec.steps)))
    if spec.fault is not None and spec.fault.kind == "lr" and step >= spec.fault.step:
        lr *= spec.fault.factor
    return lr


def train(spec: RunSpec, out: Path, rank: int = 0, world: int = 1) -> None:
    """Train ``spec`` on this process (rank ``rank`` of ``world``) with Monitor V2 writing to ``out``."""
    import torch

    from trainprobe import TrainerMonitorV2

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = _mlp(spec) if spec.model == "mlp" else _gpt(spec)
    opt = torch.optim.AdamW(model.parameters(), lr=_lr_at(spec, 0))
    config = {
        "output_dir": str(out),
        "step_count_per_record": 50,
        "monitors": {m: {"enabled": True, "ops": OPS} for m in VIEWS},
    }
    path = out.parent / f"{out.name}_config{rank}.json"
    path.write_text(json.dumps(config))
    monitor = TrainerMonitorV2(str(path))
    monitor.start(model=model, optimizer=opt)
    batches = _batches(spec, model, rank)
    params = dict(model.named_parameters())
    f = spec.fault
    for step in range(spec.steps):
        for group in opt.param_groups:
            group["lr"] = _lr_at(spec, step)
        x, loss_of = next(batches)
        if f is not None and f.kind == "input" and step == f.step and rank == f.rank:
            x = x * f.factor
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=spec.bf16):
            loss = loss_of(model, x)
        loss.float().backward()
        if world > 1:
            for p in model.parameters():
                torch.distributed.all_reduce(p.grad)
                p.grad /= world
        if f is not None and f.kind in ("grad", "nan") and step == f.step and rank == f.rank:
            grad = params[f.param].grad
            if f.kind == "nan":
                grad[0, 0] = math.nan
            else:
                grad *= f.factor
        opt.step()
        opt.zero_grad()
    monitor.stop()


def _batches(spec: RunSpec, model: Any, rank: int) -> Iterator[tuple[Any, Callable[[Any, Any], Any]]]:
    """(input, loss of (model, input)) per step: the input is what an input fault multiplies."""
    import torch

    if spec.model == "mlp":
        for x, y in TeacherMLP(rank).batches(spec.drift):
            yield x, lambda m, xx, y=y: torch.nn.functional.mse_loss(m(xx).float(), y)
    else:
        from trainprobe.demo.gpt import synthetic_batches

        for idx in synthetic_batches(model.cfg, batch_size=8, seed=rank):
            yield idx, lambda m, ii: m.loss(ii)


def _ddp_entry(rank: int, port: int, spec: RunSpec, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=spec.world)
    try:
        train(spec, Path(out), rank, spec.world)
    finally:
        dist.destroy_process_group()


def make_run(spec: RunSpec, out: Path) -> None:
    """Train ``spec`` into ``out`` (spawned gloo processes when ``spec.world > 1``)."""
    if spec.world == 1:
        train(spec, out)
        return
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ddp_entry, args=(port, spec, str(out)), nprocs=spec.world, join=True)


# -- reading the series back ------------------------------------------------------------------


@dataclass
class Series:
    """One series read back: its key, steps and magnitudes, and whether it holds squares."""

    table: str
    rank: int
    name: str
    scope: str
    signal: str
    steps: np.ndarray
    values: np.ndarray
    squared: bool


def read_series(run: Path) -> tuple[list[Series], int | None]:
    """Every series of the run (both signals of every row of every view) and the first step with
    a NaN/inf (the check every rule shares), through the query layer."""
    from trainprobe.engine.rules.series import is_squared, signals
    from trainprobe.tools.query.layer import connect, first_nonfinite

    con = connect(run)
    out: list[Series] = []
    for table in VIEWS:
        rows = con.sql(
            f"SELECT rank, name, scope, coalesce(micro_step, -1) AS micro, vpp_stage, step, min, max, norm FROM {table} "
            "ORDER BY rank, name, scope, micro_step, vpp_stage, step, file_row"
        ).fetchnumpy()
        keys = np.stack([np.asarray(rows[k]).astype(str) for k in ("rank", "name", "scope", "micro", "vpp_stage")], axis=1)
        sig = signals({op: np.ma.filled(np.ma.asarray(rows[op], dtype=np.float64), np.nan) for op in ("min", "max", "norm")})
        cuts = np.flatnonzero((keys[1:] != keys[:-1]).any(axis=1)) + 1
        for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, len(keys)], strict=True):
            rank, name, scope = int(rows["rank"][lo]), str(rows["name"][lo]), str(rows["scope"][lo])
            for signal, (values, _ops) in sig.items():
                out.append(Series(table, rank, name, scope, signal, rows["step"][lo:hi].astype(np.int64),
                                  values[lo:hi], is_squared(scope)))
    found = first_nonfinite(run)
    return out, (int(found[0]["step"]) if found else None)


# -- scoring ----------------------------------------------------------------------------------


@dataclass
class Outcome:
    """One rule on one run."""

    flagged: int = 0  # flagged (series, step) pairs
    first_step: int | None = None  # the first anomalous step (a flag or the NaN/inf)
    first_tensors: set[str] = field(default_factory=set)  # the names flagged at that step
    first_ranks: set[int] = field(default_factory=set)
    examples: list[str] = field(default_factory=list)


def judge(rule: Any, series: list[Series], nonfinite: int | None) -> Outcome:
    """``rule`` on every series of one run, with the NaN/inf check (up to its step only: after
    it everything downstream is NaN, as ``diagnose`` reads)."""
    outcome = Outcome()
    hits: list[tuple[int, str, int, str]] = []
    for s in series:
        for v in rule.replay(s.steps, s.values, s.squared):
            if nonfinite is None or v.step < nonfinite:
                hits.append((v.step, s.name, s.rank, f"{s.table}/{s.scope} {s.name} {s.signal} step {v.step}: "
                             f"{v.value:.3g} vs {v.reference:.3g} (score {v.score:.3g}, bar {v.bar:.3g})"))
    outcome.flagged = len(hits)
    steps = [h[0] for h in hits] + ([nonfinite] if nonfinite is not None else [])
    if steps:
        outcome.first_step = min(steps)
        outcome.first_tensors = {h[1] for h in hits if h[0] == outcome.first_step}
        outcome.first_ranks = {h[2] for h in hits if h[0] == outcome.first_step}
        outcome.examples = [h[3] for h in sorted(hits)[:3]]
    return outcome


def nonfinite_names(run: Path, step: int) -> set[str]:
    """The tensors with a NaN/inf at ``step`` (the first such step)."""
    from trainprobe.tools.query.layer import first_nonfinite

    return {str(r["name"]) for r in first_nonfinite(run, limit=50) if int(r["step"]) == step}


def found_at_step(spec: RunSpec, outcome: Outcome, run: Path) -> bool:
    """The run's first anomaly is at the fault's step, on its rank, and names its tensor."""
    f = spec.fault
    assert f is not None
    if outcome.first_step != f.step:
        return False
    if not spec.tensors:
        return True
    names = outcome.first_tensors | (nonfinite_names(run, f.step) if f.kind == "nan" else set())
    ranks = outcome.first_ranks if outcome.first_ranks else {f.rank}
    return bool(names & set(spec.tensors)) and f.rank in ranks


def table(rules: dict[str, Any], runs: list[tuple[RunSpec, Path, list[Series], int | None]], verbose: bool) -> list[str]:
    """The per-rule lines (markdown table) and, verbose, the healthy false anomalies."""
    lines = [
        "| rule | false anomalies (healthy runs: rows, runs) | faults found at step (>=10x and NaN) | all faults at step | step error of the first flag per fault |",
        "|---|---|---|---|---|",
    ]
    details = []
    for rule_name, rule in rules.items():
        false_rows = false_runs = 0
        must = must_ok = all_ok = faults = 0
        errors = []
        for spec, path, series, nonfinite in runs:
            outcome = judge(rule, series, nonfinite)
            if spec.healthy:
                false_rows += outcome.flagged
                false_runs += outcome.flagged > 0
                if outcome.flagged and verbose:
                    details += [f"  {rule_name} {spec.name}: {e}" for e in outcome.examples]
                continue
            assert spec.fault is not None
            faults += 1
            ok = found_at_step(spec, outcome, path)
            all_ok += ok
            if spec.must_find:
                must += 1
                must_ok += ok
            err = "miss" if outcome.first_step is None else f"{outcome.first_step - spec.fault.step:+d}"
            errors.append(f"{spec.name} {err}")
        healthy = sum(1 for r in runs if r[0].healthy)
        lines.append(
            f"| `{rule_name}` | {false_rows}, {false_runs} of {healthy} | {must_ok} of {must} | {all_ok} of {faults} | "
            + ", ".join(errors) + " |"
        )
    return lines + details


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path)
    parser.add_argument("--reuse", action="store_true")
    parser.add_argument("--only", default="")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    from trainprobe.engine.rules import RULES, rule_named

    base = args.keep or Path(tempfile.mkdtemp(prefix="bench_detection_"))
    base.mkdir(parents=True, exist_ok=True)
    only = set(filter(None, args.only.split(",")))
    specs = [s for s in RUNS if not only or s.name in only]
    runs = []
    t0 = time.perf_counter()
    for spec in specs:
        out = base / spec.name
        if not (args.reuse and out.is_dir()):
            start = time.perf_counter()
            make_run(spec, out)
            print(f"trained {spec.name}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
        series, nonfinite = read_series(out)
        runs.append((spec, out, series, nonfinite))
    t1 = time.perf_counter()
    rules = {name: rule_named(name) for name in RULES}
    for line in table(rules, runs, args.verbose):
        print(line)
    print(f"\n{len(runs)} runs, {sum(len(r[2]) for r in runs)} series; train+read {t1 - t0:.1f} s, "
          f"rules {time.perf_counter() - t1:.1f} s; runs in {base}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
