"""What sharded-training support costs a step: layout metadata and live full-tensor statistics.

What is trained, on ``--world`` gloo ranks of this machine (CPU): an MLP of ``--layers`` pairs of
``ColwiseParallel`` / ``RowwiseParallel`` linear layers (``--hidden`` wide) under tensor
parallelism over every rank (2 ranks), or FSDP2 over ``dp`` and tensor parallelism over ``tp`` on
a 2×2 mesh (4 ranks); Adam, batches from a fixed seed.

Method: five twins of the model with the same weights, each with its own optimizer, trained
side by side in every process, one step of each in turn (the order rotates every step, the same
on every rank, so that no twin is favoured by a drift of the machine):

* ``control``: no monitor;
* ``wg``: Monitor V2 ``weight_grad`` without layout metadata (``tensor_layout.json`` not written:
  the trainer's ``_describe_layouts`` replaced by a no-op in this bench only);
* ``wg+layout``: ``weight_grad`` as shipped (layouts written at start);
* ``wg+layout+global``: the same with ``"global_stats": true``;
* ``wg-again``: ``wg`` once more, the A/A pair that shows the machine's noise floor (a layout
  figure within it is no measurable cost).

A step (forward, backward, ``optimizer.step()``, ``zero_grad``) is timed by the wall clock on
every rank; the figure of a twin is the median over the steps of its step time over the control's
in the same step (rank 0's; the ranks wait for each other in the collectives). Reported: the
ratios, the layout metadata's overhead in points (``wg+layout`` − ``wg``, target ≤ 0.5), the calls
into the layout code per timed step (``LayoutCalls``: expected 0, the layouts are read at start,
so no host sync or file write per step can come from them), and the live statistics' added
points (``wg+layout+global`` − ``wg+layout``).

Collectives: the live statistics issue theirs on the process group itself
(``ProcessGroup.allgather``, out of ``cc``'s sight), counted by the probe
(``GlobalStatsProbe.collectives``) over the timed steps: target ≤ 1 per step. A wrapper around
``torch.distributed``'s functions (this bench only) also counts, per twin and step, the calls
made from trainprobe's code through them (expected: none).

Usage::

    python bench/bench_sharded.py                  # 2 and 4 ranks
    python bench/bench_sharded.py --world 2 --steps 40 --hidden 256
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

os.environ.setdefault("TRAINPROBE_FUSED_STATS", "off")  # the same kernels from the first step on

TWINS = ("control", "wg", "wg+layout", "wg+layout+global", "wg-again")
COUNTED = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
           "all_gather_object", "all_to_all", "reduce_scatter", "barrier")


class Mlp(nn.Module):
    """``layers`` pairs of linear layers (column- then row-parallel under tensor parallelism)."""

    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"up": nn.Linear(hidden, 2 * hidden), "down": nn.Linear(2 * hidden, hidden)})
            for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block["down"](torch.relu(block["up"](x)))
        return x


class CollectiveCounter:
    """Counts ``torch.distributed`` calls by twin, function and whether trainprobe made them."""

    def __init__(self) -> None:
        self.twin = "start"
        self.counts: Counter[tuple[str, str, bool]] = Counter()
        for name in COUNTED:
            setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name: str, fn: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            self.counts[(self.twin, name, caller.startswith("trainprobe"))] += 1
            return fn(*args, **kwargs)

        return counted


class LayoutCalls:
    """Counts, per twin, the calls into the layout code (``placement``'s functions that read a
    tensor's placement, ``LayoutFile.add`` / ``write``) while it steps: layout metadata is read
    once, at start (and, for module rows, at the first step a module runs), so none is expected
    in a timed step; a call there would be where a host sync or a file write per step could hide."""

    def __init__(self) -> None:
        from trainprobe.backends.torch import placement
        from trainprobe.engine.tensor_layout import LayoutFile

        self.twin = "start"
        self.counts: Counter[str] = Counter()
        for owner, name in ((placement, "layout_of"), (placement, "param_layouts"), (placement, "fsdp1_layouts"),
                            (LayoutFile, "add"), (LayoutFile, "write")):
            setattr(owner, name, self._wrap(getattr(owner, name)))

    def _wrap(self, fn: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.counts[self.twin] += 1
            return fn(*args, **kwargs)

        return counted


def _parallelize(model: Mlp, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if world == 2:
        tp = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        tp = mesh["tp"]
    for i in range(len(model.blocks)):
        parallelize_module(model.blocks[i], tp, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if world == 4:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh["dp"])


def _monitor(twin: str, out: Path, model: nn.Module, opt: torch.optim.Optimizer) -> Any:
    from trainprobe import TrainerMonitorV2

    if twin == "control":
        return None
    cfg: dict[str, Any] = {"output_dir": str(out / twin), "monitors": {"weight_grad": {"enabled": True}}}
    if twin.endswith("global"):
        cfg["global_stats"] = True
    mon = TrainerMonitorV2(cfg)
    if twin in ("wg", "wg-again"):
        mon._describe_layouts = lambda *args, **kwargs: None  # type: ignore[method-assign]  # no layout metadata
    mon.start(model=model, optimizer=opt, overwrite=True)
    return mon


def _worker(rank: int, port: int, world: int, args: dict[str, Any], out: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    try:
        _train(rank, world, args, Path(out))
    finally:
        dist.destroy_process_group()


def _train(rank: int, world: int, args: dict[str, Any], out: Path) -> None:
    counter, layout_calls = CollectiveCounter(), LayoutCalls()
    torch.manual_seed(0)
    base = Mlp(args["hidden"], args["layers"])
    twins: dict[str, tuple[nn.Module, torch.optim.Optimizer, Any]] = {}
    for twin in TWINS:
        model = copy.deepcopy(base)
        _parallelize(model, world)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        counter.twin = f"start:{twin}"
        twins[twin] = (model, opt, _monitor(twin, out / f"w{world}", model, opt))
    dp_rank = rank // 2 if world == 4 else 0
    live = twins["wg+layout+global"][2]
    issued_before = 0
    times: dict[str, list[float]] = {t: [] for t in TWINS}
    for step in range(args["warmup"] + args["steps"]):
        x = torch.randn(args["batch"], args["hidden"], generator=torch.Generator().manual_seed(1000 * step + dp_rank))
        if step == args["warmup"]:
            issued_before = live._live.collectives
        order = TWINS[step % len(TWINS):] + TWINS[:step % len(TWINS)]
        for twin in order:
            model, opt, _ = twins[twin]
            counter.twin = layout_calls.twin = twin if step >= args["warmup"] else "warmup"
            dist.barrier()
            started = time.perf_counter()
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if step >= args["warmup"]:
                times[twin].append(time.perf_counter() - started)
    checked = len(live.global_stats())
    issued = live._live.collectives - issued_before
    for _, _, mon in twins.values():
        if mon is not None:
            mon.stop()
    if rank == 0:
        counts = [[t, n, by_us, c] for (t, n, by_us), c in counter.counts.items()]
        (out / f"result_w{world}.json").write_text(json.dumps(
            {"times": times, "counts": counts, "live_keys": checked, "live_collectives": issued,
             "layout_calls": dict(layout_calls.counts)}
        ))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _report(world: int, args: dict[str, Any], result: dict[str, Any]) -> None:
    times = result["times"]
    control = times["control"]
    ratio = {t: statistics.median(a / c for a, c in zip(times[t], control)) for t in TWINS}
    steps = args["steps"]
    ours = {(t, n): c for t, n, by_us, c in result["counts"] if by_us}
    per_step = {t: {n: c / steps for (tt, n), c in ours.items() if tt == t} for t in TWINS}
    at_start = {n: c for (t, n), c in ours.items() if t.startswith("start:")}
    layout = "TP=2" if world == 2 else "2-D FSDP2 x TP (2x2)"
    print(f"\n== {world} gloo ranks, {layout}, hidden {args['hidden']}, {args['layers']} layer pairs, "
          f"{steps} steps (load {os.getloadavg()[0]:.1f})")
    print(f"control step (median): {statistics.median(control) * 1e3:.2f} ms")
    for twin in TWINS[1:]:
        print(f"{twin:18s} monitored/unmonitored {ratio[twin]:.4f}   trainprobe collectives/step {per_step[twin] or 0}")
    print(f"layout metadata: {(ratio['wg+layout'] - ratio['wg']) * 100:+.2f} points on the weight_grad row (target <= 0.5); "
          f"noise floor (wg-again - wg, the same monitor twice): {(ratio['wg-again'] - ratio['wg']) * 100:+.2f} points")
    calls = result["layout_calls"]
    print(f"layout code calls at start: {calls.get('start', 0)}; per timed step: "
          + ", ".join(f"{t} {calls.get(t, 0) / steps:g}" for t in TWINS) + " (expected 0: no per-step host sync or write)")
    print(f"live global statistics: {(ratio['wg+layout+global'] - ratio['wg+layout']) * 100:+.2f} points; "
          f"collectives/step {result['live_collectives'] / steps:g} (ProcessGroup.allgather, target <= 1); "
          f"through torch.distributed: per step {per_step['wg+layout+global'] or 0}, at start {at_start or 0}; "
          f"full-tensor values per step on rank 0: {result['live_keys']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4], choices=[2, 4])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    ns = parser.parse_args()
    args = {k: getattr(ns, k) for k in ("steps", "warmup", "hidden", "layers", "batch")}
    with tempfile.TemporaryDirectory(prefix="bench_sharded_") as tmp:
        for world in ns.world:
            mp.spawn(_worker, args=(_free_port(), world, args, tmp), nprocs=world, join=True)
            _report(world, args, json.loads((Path(tmp) / f"result_w{world}.json").read_text()))


if __name__ == "__main__":
    main()
