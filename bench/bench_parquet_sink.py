"""What the Parquet sink costs the writer thread per step (a benchmark, not a timed test).

Three tables of ``--rows`` rows each (``weight_grad``-like: vpp_stage, step, name, scope, 5
ops), ``--steps`` steps, windows of 1, 20 and 100 steps (``step_count_per_record``), written
straight to :class:`~trainprobe.engine.sinks.parquet_sink.ParquetSink` on this thread (no
training): per step, the median and the worst time of writing the step's three batches (each a
whole step file; a window's first row of the next window also completes the window before),
and the whole run's time, close included. Best of ``--rounds``.

Usage::

    python bench/bench_parquet_sink.py [--rows 300] [--steps 200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from trainprobe.engine.records import RowKey, StepBatch
from trainprobe.engine.schedule import Schedule
from trainprobe.engine.sinks.csv_sink import TableLayout
from trainprobe.engine.sinks.parquet_sink import ParquetSink

OPS = ("min", "max", "mean", "norm", "nans")
TABLES = ("weight_grad", "param", "module")


def run(rows: int, steps: int, window: int) -> tuple[float, float, float]:
    """(total s, median step s, worst step s) of one run."""
    layout = TableLayout(False, OPS)
    keys = [RowKey(0, f"layers.{i}.weight", "reduced") for i in range(rows)]
    values = [[random.random() for _ in OPS[:-1]] + [0.0] for _ in keys]
    with tempfile.TemporaryDirectory() as folder:
        sink = ParquetSink(Path(folder), Schedule(step_count_per_record=window), {t: layout for t in TABLES})
        per_step = []
        start = time.perf_counter()
        for step in range(steps):
            began = time.perf_counter()
            for table in TABLES:
                sink.write(StepBatch(table, step, keys, _all_host=values))
            per_step.append(time.perf_counter() - began)
        sink.close()
        return time.perf_counter() - start, statistics.median(per_step), max(per_step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=300)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for window in (1, 20, 100):
        total, median, worst = min(run(args.rows, args.steps, window) for _ in range(args.rounds))
        print(
            f"rows/table/step {args.rows}  window {window:4d}: total {total:.2f} s, "
            f"median step {median * 1e3:.2f} ms, worst step {worst * 1e3:.1f} ms"
        )


if __name__ == "__main__":
    main()
