"""Benchmark of ``trainprobe diagnose`` (issue #23's target: one run of 10 million rows diagnosed
in <= 60 s and <= 2 GB RSS on the 2-core machine).

Generates a synthetic Monitor V2 ``weight_grad`` run as Parquet (64 ranks x 800 steps x 100
parameters x 2 scopes = 10.24 M rows; values with 10 % noise), with one spike (a ``norm`` 50
times its usual size on rank 5 at step 400) and one NaN (rank 9, step 600), then runs
``diagnose`` in a fresh process and prints the time (after the imports), the peak RSS and the
answer. ``--quick``: a small run (smoke test); ``--csv``: the same run as CSV.

    PYTHONPATH=src python bench/bench_diagnose.py [--quick] [--csv] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

CHILD = r"""
import json, sys, time
from trainprobe.tools.diagnosis.answer import diagnose
import duckdb
start = time.perf_counter()
result = diagnose(sys.argv[1])
first, nan = result.first, result.first_nonfinite
print(json.dumps({"seconds": time.perf_counter() - start, "first": [first.kind, first.step, first.rank, first.name,
                  first.op], "nonfinite": [nan.step, nan.rank, nan.name], "ranks": result.ranks_line()}))
"""


@dataclass(frozen=True)
class Shape:
    """Size of the synthetic run and where its spike and NaN are."""

    ranks: int
    steps: int
    params: int
    window: int
    spike: tuple[int, int, int]  # rank, step, parameter
    nan: tuple[int, int, int]

    @property
    def rows(self) -> int:
        return self.ranks * self.steps * self.params * 2


def write_run(root: Path, shape: Shape, csv: bool = False) -> None:
    """The run under ``root``: ``rank_<r>/weight_grad_step<a>-<b>.parquet`` (or ``.csv``)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    names = [f"layers.{i // 4}.{('q', 'k', 'v', 'o')[i % 4]}_proj.weight" for i in range(shape.params)] * 2
    scopes = ["unreduced"] * shape.params + ["reduced"] * shape.params
    per_step = 2 * shape.params
    rng = np.random.default_rng(0)
    for rank in range(shape.ranks):
        folder = root / f"rank_{rank}"
        folder.mkdir(parents=True, exist_ok=True)
        for first in range(0, shape.steps, shape.window):
            last = min(first + shape.window, shape.steps) - 1
            n = last - first + 1
            steps = np.repeat(np.arange(first, last + 1), per_step)
            scale = np.tile(np.tile(1.0 + np.arange(shape.params) % 7, 2), n)
            norm = scale * (1 + 0.1 * rng.standard_normal(n * per_step))
            for (r, s, p), value in ((shape.spike, 50.0), (shape.nan, np.nan)):
                if r == rank and first <= s <= last:
                    i = (s - first) * per_step + shape.params + p
                    norm[i] = norm[i] * value
            micro = np.tile(np.array([0] * shape.params + [-1] * shape.params), n)
            table = pa.table(
                {
                    "vpp_stage": pa.array(np.zeros(n * per_step, dtype=np.int64)),
                    "step": pa.array(steps.astype(np.int64)),
                    "module_name": pa.array(names * n),
                    "scope": pa.array(scopes * n),
                    "micro_step": pa.array(micro, mask=micro < 0, type=pa.int64()),
                    "min": pa.array(-norm / 10),
                    "max": pa.array(norm / 10),
                    "mean": pa.array(norm / 100),
                    "norm": pa.array(norm),
                    "nans": pa.array(np.isnan(norm).astype(np.float64)),
                }
            )
            name = folder / f"weight_grad_step{first}-{last}"
            if csv:
                pacsv.write_csv(table, f"{name}.csv")
            else:
                pq.write_table(table, f"{name}.parquet")


def measure(run: Path, repeats: int = 2) -> dict[str, object]:
    """The faster of ``repeats`` fresh child processes diagnosing ``run``, with its peak RSS (MB)."""
    best: dict[str, object] | None = None
    for _ in range(repeats):
        proc = subprocess.Popen([sys.executable, "-c", CHILD, str(run)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"diagnose failed on {run}")
        result = json.loads(out.strip().splitlines()[-1])
        result["rss_mb"] = usage.ru_maxrss / 1024
        result["cpu_s"] = usage.ru_utime + usage.ru_stime  # the whole child, imports included
        if best is None or float(result["seconds"]) < float(best["seconds"]):  # type: ignore[arg-type]
            best = result
    assert best is not None
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small run (smoke test)")
    parser.add_argument("--csv", action="store_true", help="write the run as CSV instead of Parquet")
    parser.add_argument("--keep", help="keep the generated run in this folder")
    parser.add_argument("--repeats", type=int, default=2, help="fresh processes to time (the fastest counts)")
    args = parser.parse_args()
    if args.quick:
        shape = Shape(ranks=4, steps=100, params=20, window=50, spike=(1, 40, 3), nan=(2, 61, 7))
    else:
        shape = Shape(ranks=64, steps=800, params=100, window=100, spike=(5, 400, 42), nan=(9, 600, 13))
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="trainprobe-bench-diagnose-"))
    try:
        run = base / ("csv" if args.csv else "parquet")
        t = time.perf_counter()
        if not run.exists():
            write_run(run, shape, csv=args.csv)
        size = sum(p.stat().st_size for p in run.rglob("*.*")) / 1e6
        print(f"run: {shape.rows:,} rows, {size:.0f} MB {'CSV' if args.csv else 'Parquet'} "
              f"({time.perf_counter() - t:.1f} s to generate)")
        result = measure(run, args.repeats)
        seconds = float(result["seconds"])  # type: ignore[arg-type]
        print(
            f"diagnose: {seconds:.2f} s ({shape.rows / seconds / 1e6:.2f} M rows/s), {result['rss_mb']:.0f} MB RSS "
            f"(targets <= 60 s, <= 2048 MB); CPU time of the process {result['cpu_s']:.1f} s, load average "
            f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
        )
        print(f"  first: {result['first']} (expected spike at step {shape.spike[1]}, rank {shape.spike[0]})")
        print(f"  first NaN/inf: {result['nonfinite']} (expected step {shape.nan[1]}, rank {shape.nan[0]})")
        print(f"  {result['ranks']}")
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
