"""Overhead of the online anomaly rules (the ``anomaly`` block) of Monitor V2 and Monitor V1 on
the weight_grad row.

Seven twins of ``bench_paired.py``'s ``TinyGPT`` (same weights, same batches, each its own AdamW)
are stepped in turn, the order rotating every round so that a drift of the machine favours none:

* ``plain``: never monitored;
* ``weight_grad``: V2 ``weight_grad`` (the bench's weight_grad row);
* ``+ rules``: the same with ``"anomaly": {"actions": ["log"]}`` (non-finite and spike rules);
* ``+ before_update``: ``"anomaly": {"actions": ["log", "stop"], "before_update": true}`` (the
  pre-step check: one host read of the step's rows before ``optimizer.step()``);
* ``v1 wg``, ``v1 + rules``, ``v1 + before_update``: the same three with Monitor V1
  (``TrainerMon``, ``wg_distribution``, CSV output) and the same ``anomaly`` blocks.

Printed per twin: its step time over ``plain``'s (median over the rounds, measured in one run),
and the points it adds over its front door's weight_grad twin (``weight_grad`` or ``v1 wg``): the
median over rounds of ``(t_twin - t_base) / t_plain``. Targets (issue #36): ≤ 0.5 points for the
rules, ≤ 1 point with ``before_update``.

Usage::

    python bench/bench_anomaly.py                     # 40 rounds
    python bench/bench_anomaly.py --threads 1 --clock cpu --rounds 60
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_paired import Twin  # noqa: E402
from trainprobe import TrainerMon, TrainerMonitorV2  # noqa: E402

RULES: dict[str, Any] = {"actions": ["log"]}
BEFORE_UPDATE: dict[str, Any] = {"actions": ["log", "stop"], "before_update": True}
TWINS: dict[str, dict[str, Any] | None] = {
    "plain": None,
    "weight_grad": {},
    "+ rules": RULES,
    "+ before_update": BEFORE_UPDATE,
    "v1 wg": {},
    "v1 + rules": RULES,
    "v1 + before_update": BEFORE_UPDATE,
}
TARGETS = {"+ rules": 0.5, "+ before_update": 1.0, "v1 + rules": 0.5, "v1 + before_update": 1.0}
BASE = {"+ rules": "weight_grad", "+ before_update": "weight_grad", "v1 + rules": "v1 wg", "v1 + before_update": "v1 wg"}
"""The twin each anomaly twin's points are measured over."""


def _monitor(name: str, anomaly: dict[str, Any] | None, twin: Twin, folder: Path) -> TrainerMonitorV2 | TrainerMon | None:
    if anomaly is None:
        return None
    if name.startswith("v1"):
        return _v1_monitor(name, anomaly, twin, folder)
    config: dict[str, Any] = {"output_dir": str(folder / name.strip("+ ")), "monitors": {"weight_grad": {"enabled": True}}}
    if name != "weight_grad":
        config["anomaly"] = anomaly
    path = folder / f"{name.strip('+ ')}.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    monitor = TrainerMonitorV2(path)
    monitor.start(model=twin.model, optimizer=twin.optimizer)
    return monitor


def _v1_monitor(name: str, anomaly: dict[str, Any], twin: Twin, folder: Path) -> TrainerMon:
    """Monitor V1 with ``wg_distribution`` (and ``anomaly`` unless it is the base twin), its run
    folder under ``folder/v1``."""
    os.environ["MONITOR_OUTPUT_DIR"] = str(folder / "v1")
    config: dict[str, Any] = {"targets": {}, "wg_distribution": True}
    if name != "v1 wg":
        config["anomaly"] = anomaly
    path = folder / f"{name.replace(' ', '_').replace('+', 'and')}.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    monitor = TrainerMon(str(path), params_have_main_grad=False)
    monitor.set_monitor(twin.model, grad_acc_steps=1, optimizer=twin.optimizer)
    return monitor


def run(rounds: int, warmup: int, seed: int) -> dict[str, list[float]]:
    """Step times (seconds on Twin.clock) of every twin, one per round."""
    times: dict[str, list[float]] = {name: [] for name in TWINS}
    with tempfile.TemporaryDirectory() as tmp:
        twins = {name: Twin(seed) for name in TWINS}
        monitors = [_monitor(name, anomaly, twins[name], Path(tmp)) for name, anomaly in TWINS.items()]
        names = list(TWINS)
        try:
            for i in range(warmup + rounds):
                order = names[i % len(names) :] + names[: i % len(names)]
                for name in order:
                    elapsed = twins[name].step()
                    if i >= warmup:
                        times[name].append(elapsed)
        finally:
            for monitor in monitors:
                if monitor is not None:
                    monitor.stop()
        losses = {name: twin.last_loss for name, twin in twins.items()}
    if max(losses.values()) - min(losses.values()) > 1e-4 * max(1.0, abs(losses["plain"])):
        print(f"warning: the twins' losses differ: {losses}")
    return times


def report(times: dict[str, list[float]], clock: str) -> None:
    plain = times["plain"]
    print(f"\n{len(plain)} rounds, {clock} clock, {torch.get_num_threads()} threads\n")
    print("| twin | ratio to plain (median) | points over its weight_grad twin (median) | target | met? |")
    print("|---|---|---|---|---|")
    for name, series in times.items():
        ratio = statistics.median(t / p for t, p in zip(series, plain))
        if name not in BASE:
            print(f"| {name} | {ratio:.3f}x | — | — | — |")
            continue
        base = times[BASE[name]]
        points = statistics.median(100 * (t - b) / p for t, b, p in zip(series, base, plain))
        target = TARGETS[name]
        print(f"| {name} | {ratio:.3f}x | {points:+.2f} | ≤ {target:.1f} | {'yes' if points <= target else '**no**'} |")
    print(f"\nplain step: {1000 * statistics.median(plain):.1f} ms (median)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock: Callable[[], float] = time.process_time if args.clock == "cpu" else time.perf_counter
    Twin.clock = staticmethod(clock)  # type: ignore[assignment]
    report(run(args.rounds, args.warmup, args.seed), args.clock)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
