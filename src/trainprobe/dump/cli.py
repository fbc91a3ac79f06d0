"""``trainprobe compare -tp TARGET -gp GOLDEN -o OUT [--xlsx]`` (also ``python -m trainprobe.dump.cli``).

Exit codes: 0 success (whatever the verdicts), 2 bad input (one line on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any


def _run(args: argparse.Namespace) -> int:
    from trainprobe.dump.compare import compare_dumps

    results = compare_dumps(args.target_path, args.golden_path, args.output_path, xlsx=args.xlsx)
    for r in results:
        where = f" [{r.label}]" if r.label else ""
        print(f"compare{where}: {r.rows} tensors ({r.mode} mode) -> {r.output}")
        if r.first is None:
            print(f"compare{where}: every tensor passed")
        else:
            print(
                f"compare{where}: first diverging API: {r.first.record} "
                f"({r.first.name}: {r.first.result}: {r.first.reason})"
            )
    return 0


def add_compare_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``compare`` on ``subparsers`` (an ``add_subparsers()`` result)."""
    p = subparsers.add_parser(
        "compare",
        help="compare two precision dumps (candidate vs baseline) and find the first diverging API",
        description="Compare a candidate dump (-tp/--candidate: the reference's target, NPU columns) with a baseline "
        "dump (-gp/--baseline: the reference's golden, Bench columns).",
    )
    p.add_argument(
        "-tp",
        "--target_path",
        "--candidate",
        dest="target_path",
        required=True,
        help="the candidate dump (the reference's 'target', its NPU columns): dump root, step dir or rank dir",
    )
    p.add_argument(
        "-gp",
        "--golden_path",
        "--baseline",
        dest="golden_path",
        required=True,
        help="the baseline dump (the reference's 'golden', its Bench columns), of the same kind as the candidate",
    )
    p.add_argument("-o", "--output_path", default="./output", help="folder for the result tables (default ./output)")
    p.add_argument("--xlsx", action="store_true", help="write .xlsx instead of .csv (needs openpyxl)")
    p.set_defaults(run=_run)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m trainprobe.dump.cli compare ...``: the same as ``trainprobe compare ...``."""
    from trainprobe.cli import main as trainprobe_main

    return trainprobe_main(argv)


if __name__ == "__main__":
    sys.exit(main())
