"""Start-up cost of every trainprobe front door: attaching a tool, and the first step after it.

What is measured, per front door (``v2``: ``TrainerMonitorV2(path).start(model, optimizer)`` with
``weight_grad + optimizer + param``; ``v1``: ``TrainerMon(path).set_monitor(...)`` with ``wg + mv +
param``; ``metrics``: ``TrainingMetricsMonitor(config, model, optimizer)`` with every metric on;
``dump``: ``PrecisionDebugger(path)`` at L0, each step inside ``start``/``stop``/``step``), on the
4.2M-parameter ``TinyGPT`` of the other benches (batch 8, CPU):

* ``attach``: seconds from the tool's construction to the first step's start (everything the
  tool does before training: config, hooks, the statistics' one-read pass);
* ``first``: the first monitored step; ``next``: the second one; ``plain``: an unmonitored step of
  the same model just before (torch's own first-call costs are paid by two unmonitored steps
  first, so ``first - plain`` is what the tool adds to its first step);
* ``pass``: whether the one-read pass was in use after the second step (cold, a build still
  running then is waited for after the measurement, as if training went on, so that the warm
  run finds it).

Each measurement is a fresh Python process (imports not counted). **cold**: empty caches (a new
``TORCHINDUCTOR_CACHE_DIR`` and ``TRAINPROBE_CACHE_DIR``); **warm**: the same process again with
the caches the cold run left. ``--src`` runs another copy of the library (e.g. an older commit
unpacked with ``git archive``) for a before/after comparison; ``--fused off`` measures without the
pass (``TRAINPROBE_FUSED_STATS=off``).

Usage::

    python bench/bench_startup.py                       # every front door, cold and warm
    python bench/bench_startup.py --doors v2,dump --src /tmp/old/src
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DOORS = ("v2", "v1", "metrics", "dump")


def child(door: str, folder: Path) -> dict[str, Any]:
    """Runs in the measured process: two plain steps, attach, two monitored steps."""
    sys.path.insert(0, str(HERE))
    import torch

    from bench_dump import BATCH_SIZE
    from trainprobe.demo.gpt import benchmark_setup

    run = benchmark_setup(0, BATCH_SIZE)
    model, optimizer, batches = run.model, run.optimizer, run.batches
    debugger: Any = None
    metrics: Any = None

    def step() -> float:
        t0 = time.perf_counter()
        if debugger is not None:
            debugger.start(model)
        loss = model.loss(next(batches))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if debugger is not None:
            debugger.stop()
            debugger.step()
        if metrics is not None:
            metrics.step(loss=loss)
        return time.perf_counter() - t0

    step()
    plain = step()
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if door == "v2":
        from trainprobe import TrainerMonitorV2

        config = {
            "output_dir": str(folder / "out"),
            "monitors": {m: {"enabled": True} for m in ("weight_grad", "optimizer", "param")},
        }
        path = folder / "monitor_v2_config.json"
        path.write_text(json.dumps(config), encoding="utf-8")
        TrainerMonitorV2(str(path)).start(model=model, optimizer=optimizer)
    elif door == "v1":
        from trainprobe import TrainerMon

        os.environ["MONITOR_OUTPUT_DIR"] = str(folder / "out")
        path = folder / "monitor_config.json"
        v1 = {
            "wg_distribution": True,
            "mv_distribution": True,
            "param_distribution": True,
            "ops": ["min", "max", "norm"],
        }
        path.write_text(json.dumps(v1), encoding="utf-8")
        TrainerMon(str(path), params_have_main_grad=False).set_monitor(model, grad_acc_steps=1, optimizer=optimizer)
    elif door == "metrics":
        from bench_metrics import metrics_config
        from trainprobe.frontdoors.metrics import TrainingMetricsMonitor

        metrics = TrainingMetricsMonitor(metrics_config(folder), model, optimizer)
    else:
        from trainprobe.dump import PrecisionDebugger

        path = folder / "config.json"
        path.write_text(
            json.dumps({"task": "statistics", "level": "L0", "dump_path": str(folder / "dump")}), encoding="utf-8"
        )
        debugger = PrecisionDebugger(str(path))
    attach = time.perf_counter() - t0
    first = step()
    second = step()
    from trainprobe.backends.torch.stats import shared_fused

    fused = shared_fused()
    in_use = any(p is not None for p in getattr(fused, "_passes", {}).values())
    build = getattr(fused, "_build", None)
    if build is not None:  # a cold run trains on while the kernel builds: let it finish for the warm run
        build.wait(600)
    del torch
    return {"attach": attach, "first": first, "next": second, "plain": plain, "pass": in_use}


def measure(door: str, src: Path, caches: Path, fused: str, threads: int | None) -> dict[str, Any]:
    """One fresh process measuring ``door`` with the caches under ``caches``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(src), str(HERE)])
    env["TORCHINDUCTOR_CACHE_DIR"] = str(caches / "inductor")
    env["TRAINPROBE_CACHE_DIR"] = str(caches / "trainprobe")
    if fused == "default":
        env.pop("TRAINPROBE_FUSED_STATS", None)
    else:
        env["TRAINPROBE_FUSED_STATS"] = fused
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", door, "--out", out]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{door}: child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--doors", default=",".join(DOORS), help=f"subset of {', '.join(DOORS)}")
    parser.add_argument("--src", type=Path, default=HERE.parent / "src", help="the library to measure")
    parser.add_argument("--fused", default="default", choices=("default", "on", "auto", "off"))
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the measured processes")
    parser.add_argument("--label", default="", help="a name for this run in the table")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.out)))
        return 0
    doors = [d.strip() for d in args.doors.split(",") if d.strip()]
    print(f"start-up cost ({args.label or args.src}, TRAINPROBE_FUSED_STATS={args.fused}), seconds")
    print("| door | cache | attach | first step | next step | plain step | pass in use |")
    print("|---|---|---|---|---|---|---|")
    for door in doors:
        with tempfile.TemporaryDirectory(prefix="startup-caches-") as caches:
            for state in ("cold", "warm"):
                r = measure(door, args.src, Path(caches), args.fused, args.threads)
                print(
                    f"| {door} | {state} | {r['attach']:.2f} | {r['first']:.2f} | {r['next']:.2f} | "
                    f"{r['plain']:.2f} | {'yes' if r['pass'] else 'no'} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
