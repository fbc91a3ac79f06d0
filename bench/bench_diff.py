"""``trainprobe diff`` at scale: two synthetic Monitor V2 runs as Parquet (default 32 ranks ×
1,000 steps × 156 parameters × 2 scopes: 9.98 M rows each), one NaN in the candidate where the
baseline has a number; prints the time from after the imports to the answer and the peak RSS of
a fresh process (target, issue #23: ≤ 60 s, ≤ 2 GB on the 2-core machine).

Usage: python bench/bench_diff.py [--ranks 32 --steps 1000 --params 156] [--root DIR]
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synthetic_runs import Shape, write_parquet_run  # noqa: E402

CHILD = r"""
import json, sys, time
from trainprobe.tools.rundiff.answer import diff
start = time.perf_counter()
result = diff(sys.argv[1], sys.argv[2], out=sys.argv[3])
print(json.dumps({"seconds": time.perf_counter() - start, "answer": result.answer(), "counts": result.counts}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=32)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--params", type=int, default=156)
    parser.add_argument("--root", type=Path, default=None, help="where to write the runs (default: a temp folder)")
    args = parser.parse_args()
    root = args.root or Path(tempfile.mkdtemp(prefix="bench-diff-"))
    base_shape = Shape(args.ranks, args.steps, args.params, 100, args.ranks - 1, args.steps - 1, 0)
    cand_shape = Shape(args.ranks, args.steps, args.params, 100, min(17, args.ranks - 1), min(612, args.steps - 2), 3)
    start = time.perf_counter()
    for name, shape in (("baseline", base_shape), ("candidate", cand_shape)):
        if not (root / name).exists():
            write_parquet_run(root / name, shape)
    print(f"runs: {base_shape.rows:,} rows each under {root} (written in {time.perf_counter() - start:.1f} s)")
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(root / "baseline"), str(root / "candidate"), str(root / "out")],
        stdout=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit("diff failed")
    result = json.loads(out.strip().splitlines()[-1])
    cpu = usage.ru_utime + usage.ru_stime
    print(f"diff: {result['seconds']:.1f} s wall, {cpu:.1f} s CPU (the process, imports included), "
          f"peak RSS {usage.ru_maxrss / 1024:.0f} MB; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(result["answer"])
    print(json.dumps(result["counts"]))


if __name__ == "__main__":
    main()
