"""``trainprobe report`` on a sharded run: full tensors (the default) against ``--rank-local``.

A synthetic TP run: ``--ranks`` rank folders, each with ``weight_grad`` CSVs of ``--params``
parameters sharded over the ranks (``tensor_layout.json``: one shard per rank) and ``--steps``
steps, both scopes. Prints the wall time of ``write_report`` each way (best of ``--repeat``) and
their ratio, measured in one run.

    python bench/bench_report_sharded.py --steps 300 --params 100 --ranks 4
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

HEADER = "vpp_stage,step,module_name,scope,micro_step,min,max,mean,norm,nans"


def write_run(root: Path, ranks: int, steps: int, params: int, window: int = 50) -> Path:
    """The synthetic sharded run under ``root``."""
    for rank in range(ranks):
        folder = root / f"rank_{rank}"
        folder.mkdir(parents=True)
        tensors = [
            {"monitor": "weight_grad", "name": f"layers.{p}.weight", "scope": None, "kind": "shard", "numel": 64,
             "local_shape": [8, 8], "global_shape": [8 * ranks, 8], "offsets": [8 * rank, 0]}
            for p in range(params)
        ]
        layout = {"schema": "trainprobe.tensor_layout/1", "rank": rank, "world_size": ranks, "step": 0,
                  "tensors": tensors}
        (folder / "tensor_layout.json").write_text(json.dumps(layout))
        for first in range(0, steps, window):
            lines = [HEADER]
            for step in range(first, min(steps, first + window)):
                for scope, micro in (("unreduced", "0"), ("reduced", "")):
                    for p in range(params):
                        norm = (1 + p % 7) * (1 + (step + rank) % 5) / 10
                        lines.append(f"0,{step},layers.{p}.weight,{scope},{micro},-{norm},{norm},0.01,{norm},0")
            last = min(steps, first + window) - 1
            (folder / f"weight_grad_step{first}-{last}.csv").write_text("\n".join(lines) + "\n")
    return root


def timed(run: Path, out: Path, rank_local: bool, repeat: int) -> float:
    from trainprobe.tools.reporting.report import write_report

    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        write_report(run, out, rank_local=rank_local)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--params", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = write_run(Path(tmp) / "run", args.ranks, args.steps, args.params)
        rows = args.ranks * args.steps * args.params * 2
        timed(run, Path(tmp) / "warm.html", False, 1)  # imports and caches warm
        local = timed(run, Path(tmp) / "local.html", True, args.repeat)
        full = timed(run, Path(tmp) / "full.html", False, args.repeat)
        print(f"{rows} rows ({args.ranks} ranks x {args.steps} steps x {args.params} params x 2 scopes)")
        print(f"report --rank-local: {local:.2f} s   full tensors: {full:.2f} s   full / rank-local: {full / local:.2f}")


if __name__ == "__main__":
    main()
