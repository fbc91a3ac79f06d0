"""The ``trainprobe`` command.

Exit codes: 0 success, 2 bad input (one line on stderr naming the file or option, no traceback).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path

from trainprobe.errors import ConfigError
from trainprobe.safe_files import one_line

# Each entry adds one sub-command: (module, function taking the sub-parsers object).
_SUBCOMMANDS: tuple[tuple[str, str], ...] = (
    ("trainprobe.dump.cli", "add_compare_parser"),
    ("trainprobe.tools.anomaly_analyse", "add_parser"),
    ("trainprobe.tools.csv2tb", "add_parser"),
    ("trainprobe.tools.csv2db", "add_parser"),
    ("trainprobe.tools.report", "add_parser"),
)


def _demo(args: argparse.Namespace) -> int:
    from trainprobe.demo.run import print_summary, run_demo

    if args.steps < 1:
        raise ConfigError("--steps: must be >= 1")
    out = Path(args.out)
    files = run_demo(out, steps=args.steps)
    print_summary(out, files)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every sub-command."""
    parser = argparse.ArgumentParser(prog="trainprobe", description="Training monitoring and precision debugging.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small GPT on CPU with Monitor V2 on and summarise the output")
    demo.add_argument("--out", default="./trainprobe_demo", help="output folder (default ./trainprobe_demo)")
    demo.add_argument("--steps", type=int, default=50, help="training steps (default 50)")
    demo.set_defaults(run=_demo)
    for module_name, function_name in _SUBCOMMANDS:
        getattr(importlib.import_module(module_name), function_name)(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``trainprobe`` console script."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ConfigError, OSError) as exc:  # OSError: a file that vanished or cannot be written, named in it
        print(f"trainprobe {args.command}: error: {one_line(str(exc))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
