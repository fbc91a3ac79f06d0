"""The ``trainprobe`` command.

Exit codes: 0 success, 1 ``diagnose`` found an anomaly, 2 bad input (one line on stderr naming the file or option, no traceback),
141 when the reader of the output went away (``trainprobe anomaly-analyse ... | head``: quietly,
as a Unix tool killed by SIGPIPE).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.safe_files import one_line

# Each entry adds one sub-command: (module, function taking the sub-parsers object).
_SUBCOMMANDS: tuple[tuple[str, str], ...] = (
    ("trainprobe.dump.cli", "add_compare_parser"),
    ("trainprobe.tools.anomalies.analyser", "add_parser"),
    ("trainprobe.tools.exports.tensorboard", "add_parser"),
    ("trainprobe.tools.exports.sqlite", "add_parser"),
    ("trainprobe.tools.reporting.report", "add_parser"),
    ("trainprobe.tools.query.cli", "add_parser"),
    ("trainprobe.tools.diagnosis.cli", "add_parser"),
    ("trainprobe.tools.rundiff.cli", "add_parser"),
)


def _demo(args: argparse.Namespace) -> int:
    from trainprobe.demo.run import check_fault, default_out, print_next, print_summary, run_demo

    if args.steps < 1:
        raise ConfigError("--steps: must be >= 1")
    fault = check_fault(args.fault, args.fault_step, args.steps)
    out = Path(args.out) if args.out is not None else default_out(fault)
    # a demo of seconds does not amortise the statistics pass's compilation (seconds too): eager
    # kernels unless the user asked for the pass (see docs/monitor_v2.md, "Fused single pass")
    os.environ.setdefault("TRAINPROBE_FUSED_STATS", "off")
    files = run_demo(out, steps=args.steps, overwrite=args.overwrite, fault=fault)
    print_summary(out, files)
    print_next(out, fault)
    return 0


BROKEN_PIPE = 141
"""Exit status when stdout's reader closed the pipe (128 + SIGPIPE, as a Unix tool)."""

DEMO_DESCRIPTION = (
    "Train a small GPT (2 layers, d_model 128) on synthetic tokens on the CPU for --steps steps "
    "with Monitor V2 on (module, weight_grad, optimizer and param monitors), write its per-rank CSV "
    "files under --out, and print what was written (files and rows per monitor), whether any NaN "
    "appeared, and the commands to run next on it. --fault spike (that step's batch 1000x too large) or "
    "--fault nan (a NaN in one gradient) at --fault-step puts something there to find with trainprobe "
    "diagnose, report and diff (against a clean demo run: same seed, same batches). An earlier run in "
    "--out is moved aside to <out>.1. Takes about a minute; torch only, no download."
)


def version() -> str:
    """The installed trainprobe version (read from the package metadata: no torch import)."""
    import importlib.metadata  # a third of ``trainprobe --help``'s time: only for --version

    try:
        return importlib.metadata.version("trainprobe")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


class _VersionAction(argparse.Action):
    """``--version``: print ``trainprobe VERSION`` and exit; the version is read only then."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: str | None = None
    ) -> None:
        print(f"trainprobe {version()}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every sub-command."""
    parser = argparse.ArgumentParser(prog="trainprobe", description="Training monitoring and precision debugging.")
    parser.add_argument("--version", action=_VersionAction, help="show the installed version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="train a small GPT on CPU with Monitor V2 on and summarise the output",
        description=DEMO_DESCRIPTION,
    )
    demo.add_argument(
        "-o",
        "--output",
        "--out",
        dest="out",
        default=None,
        help="output folder (default ./trainprobe_demo; with --fault F ./trainprobe_demo_F)",
    )
    demo.add_argument("--steps", type=int, default=50, help="training steps (default 50)")
    demo.add_argument(
        "--fault", choices=("spike", "nan"), default=None,
        help="put a fault into the run: spike (the batch reaches the first block 1000x too large) or nan "
        "(a NaN in the gradient of layers.1.mlp.fc1.weight)",
    )
    demo.add_argument("--fault-step", type=int, default=None, metavar="N", help="the fault's step (default 30)")
    demo.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the CSV files of an earlier run in --out (without it, that run is moved aside to <out>.1)",
    )
    demo.set_defaults(run=_demo)
    for module_name, function_name in _SUBCOMMANDS:
        getattr(importlib.import_module(module_name), function_name)(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``trainprobe`` console script."""
    try:
        args = build_parser().parse_args(argv)
        try:
            handler = getattr(args, "handler", None) or args.run  # args.run: the input run where a command has one
            return handler(args)
        except BrokenPipeError:
            raise
        except (ConfigError, OSError) as exc:  # OSError: a file that vanished or cannot be written, named in it
            print(f"trainprobe {args.command}: error: {one_line(str(exc))}", file=sys.stderr)
            return 2
    except BrokenPipeError:
        _silence_stdout()
        return BROKEN_PIPE


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no usable stdout at all: nothing to silence
        pass


if __name__ == "__main__":
    sys.exit(main())
