"""Speed and size of ``csv2db`` on a synthetic Monitor V1 output.

What is converted: one V1 run folder (``Dec03_21-34-40-rank0-bench000``) holding ``--steps``
steps (default 1,000) × ``--params`` parameters (default 500) × 3 data types (``grad_reduced``,
``exp_avg``, ``exp_avg_sq``) = 1.5 M rows with the ops ``min, max, mean, norm, nans``, written in
the real V1 CSV format (the V1 header from ``trainprobe.frontdoors.monitor_v1.output.layouts``, every value
formatted by ``trainprobe.engine.stats.ops.format_value`` rounded to 6 digits, the V1 default
``ndigits``; the trailing ``shape,dtype`` cells as the V1 writer has them, e.g.
``"[4096, 4096]",torch.bfloat16``), ``--steps-per-file`` steps per file (default 1, the V1 default
``step_count_per_record``: 3,000 files of 500 rows). Parameter names look like Megatron's
(``model.layers.7.self_attn.q_proj.weight``, no chunk prefix, as the V1 writer has them); values are seeded Gaussian noise.

Method: the output is generated in a temporary folder, then converted ``--repeats`` times (each
into a fresh output folder) with ``process_num=--process-num`` (default 1) by calling
``csv2db`` in this process. Reported: the best and median wall time of the conversions (the
whole call: finding the files, parsing, loading, indexing), rows per second from the best, the
process CPU time of that conversion (steadier when other processes load the machine, and the
machine's load average), and the size of ``monitor_metrics.db`` over the size of the CSVs.

Targets: ≥ 300,000 rows/s with process_num 1; database ≤ 1.5 × the CSVs.

Usage::

    python bench/bench_csv2db.py                  # 1,000 steps × 500 parameters × 3 types
    python bench/bench_csv2db.py --quick          # 100 steps: a smoke run
    python bench/bench_csv2db.py --process-num 2 --steps-per-file 100
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from trainprobe.core.monitor.csv2db import CSV2DBConfig, csv2db
from trainprobe.engine.stats.ops import format_value
from trainprobe.frontdoors.monitor_v1.output import file_name, layouts

DATA_TYPES = ("grad_reduced", "exp_avg", "exp_avg_sq")
OPS = ("min", "max", "mean", "norm", "nans")
NDIGITS = 6
RUN_FOLDER = "Dec03_21-34-40-rank0-bench000"
SUBMODULES = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    "input_layernorm",
    "post_attention_layernorm",
    "mlp.router",
)
TARGET_ROWS_PER_S = 300_000
TARGET_SIZE_RATIO = 1.5


def parameter_names(count: int) -> list[str]:
    """``count`` Megatron-like V1 parameter names."""
    return [f"model.layers.{i // len(SUBMODULES)}.{SUBMODULES[i % len(SUBMODULES)]}.weight" for i in range(count)]


def write_output(root: Path, steps: int, params: int, steps_per_file: int, seed: int = 0) -> int:
    """Write the synthetic V1 run folder under ``root``; returns the CSV bytes written."""
    run = root / RUN_FOLDER
    run.mkdir(parents=True, exist_ok=True)
    names = parameter_names(params)
    rng = random.Random(seed)
    header = ",".join(layouts(OPS, NDIGITS, False)["grad_reduced"].header)
    total = 0
    for data_type in DATA_TYPES:
        for first in range(0, steps, steps_per_file):
            last = min(first + steps_per_file, steps) - 1
            lines = [header]
            for step in range(first, last + 1):
                for name in names:
                    low, high = sorted((rng.gauss(0, 1), rng.gauss(0, 1)))
                    values = (low, high, (low + high) / 2, abs(rng.gauss(0, 10)), 0.0)
                    cells = ",".join(format_value(op, v, NDIGITS) for op, v in zip(OPS, values))
                    lines.append(f'0,{name},{step},{cells},"[4096, 4096]",torch.bfloat16')
            text = "\n".join(lines) + "\n"
            (run / file_name(data_type, first, last)).write_text(text, encoding="utf-8")
            total += len(text.encode())
    return total


def convert_once(monitor: Path, out: Path, process_num: int) -> tuple[float, float, int, int]:
    """One conversion into a fresh ``out``: (wall s, process CPU s, rows, db bytes)."""
    shutil.rmtree(out, ignore_errors=True)
    cpu = time.process_time()
    result = csv2db(CSV2DBConfig(monitor, process_num=process_num, output_dirpath=out))
    cpu = time.process_time() - cpu
    return result.seconds, cpu, result.rows, result.db_path.stat().st_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--params", type=int, default=500)
    parser.add_argument("--steps-per-file", type=int, default=1)
    parser.add_argument("--process-num", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="100 steps, 1 repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 100, 1
    with tempfile.TemporaryDirectory(prefix="bench_csv2db_") as tmp:
        monitor = Path(tmp) / "monitor_output"
        started = time.perf_counter()
        csv_bytes = write_output(monitor, args.steps, args.params, args.steps_per_file)
        files = len(DATA_TYPES) * -(-args.steps // args.steps_per_file)
        print(
            f"generated {args.steps} steps x {args.params} parameters x {len(DATA_TYPES)} data types in {files} "
            f"files, {csv_bytes / 1e6:.1f} MB of CSV ({time.perf_counter() - started:.1f} s)"
        )
        runs = [convert_once(monitor, Path(tmp) / f"out{i}", args.process_num) for i in range(args.repeats)]
    wall, cpu, rows, db_bytes = min(runs)
    rate = rows / wall
    ratio = db_bytes / csv_bytes
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"process_num {args.process_num}: {rows} rows, best {wall:.2f} s (median "
        f"{statistics.median(r[0] for r in runs):.2f} s, CPU {cpu:.2f} s; load average {load})"
    )
    print(f"rows/s: {rate:,.0f} (target >= {TARGET_ROWS_PER_S:,}: {'ok' if rate >= TARGET_ROWS_PER_S else 'MISSED'})")
    print(
        f"db / csv: {db_bytes / 1e6:.1f} MB / {csv_bytes / 1e6:.1f} MB = {ratio:.2f} "
        f"(target <= {TARGET_SIZE_RATIO}: {'ok' if ratio <= TARGET_SIZE_RATIO else 'MISSED'})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
