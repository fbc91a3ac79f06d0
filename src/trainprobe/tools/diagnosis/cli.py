"""``trainprobe diagnose RUN [--baseline BASELINE] [--rule NAME] [--spike-factor F] [--window W] [--warmup N] [-o DIR] [--engine duckdb|spark] [--rank-local]``
(options anywhere on the line).

Prints the first anomaly of the run in execution order on one line, then the next few and which
ranks saw something first (:mod:`trainprobe.tools.diagnosis.answer`); ``-o/--output DIR``
(``--out`` kept) writes ``DIR/diagnosis.json`` and names it on stderr; ``--engine spark`` runs the same queries on Apache Spark (local mode)
over the run's Parquet files, with the same answer; ``--rule NAME`` picks the spike rule
(:data:`trainprobe.engine.rules.RULES`, default ``recent_max``) and ``--spike-factor``,
``--window``, ``--warmup`` its parameters; a sharded run (FSDP2, tensor parallelism) is
answered in full tensors unless ``--rank-local``. Exit status: 0 nothing found, 1 an anomaly found, 2 bad input (one line
on stderr, no traceback). Nothing heavy is imported until the command runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from trainprobe.engine.printable import printable
from trainprobe.tools.runs.options import add_engine_argument, add_output_argument, add_run_argument

FOUND = 1
"""Exit status when an anomaly was found."""


def add_parser(sub: Any) -> None:
    """Add the ``diagnose`` sub-command to ``sub``."""
    parser = sub.add_parser(
        "diagnose",
        help="the first NaN/inf or spike of a run, in execution order across all ranks",
        description="Find the first anomaly of a monitor run (V1 or V2, CSV or Parquet): a NaN/inf, or a spike "
        "(a value the spike rule --rule flags in its series; the default recent_max: a value above 4x the max of "
        "its last 10 values, a higher bar while the series is young), and Monitor V1's alerts where the run has "
        "them; the online rules' events of the run where it wrote them; print it on one line, then the next few and which ranks saw "
        "something first. Exit 0: nothing found; 1: an anomaly found; 2: bad input. See docs/diagnose.md. "
        "Needs: pip install 'trainprobe[query]'.",
    )
    add_run_argument(parser)
    parser.add_argument("--baseline", metavar="BASELINE", help="a healthy run to compare with (the baseline of trainprobe diff; this run is the candidate)")
    parser.add_argument(
        "--rule", default=None, metavar="NAME",
        help="the spike rule: recent_max (default), median (the running median ratio, factor 10 / window 20 / "
        "warm-up 10), early_max (Megatron's), mean_patience (llm-foundry's), ema_z (ZClip-style); "
        "see docs/diagnose.md, 'Spike rules'",
    )
    parser.add_argument(
        "--spike-factor", type=float, default=None, metavar="F",
        help="the rule's factor: a spike is a value above F times its reference (default: the rule's own; "
        "recent_max 4, median and early_max 10, mean_patience 2; ema_z has none)",
    )
    parser.add_argument("--window", type=int, default=None, metavar="W", help="the rule's window (recent_max, median, mean_patience)")
    parser.add_argument("--warmup", type=int, default=None, metavar="N", help="the rule's warm-up (median, early_max, ema_z)")
    add_output_argument(parser, "write DIR/diagnosis.json (the path is printed)", "--out", metavar="DIR")
    add_engine_argument(
        parser,
        "duckdb (default) or spark: the same queries on Apache Spark over the run's Parquet files "
        "(trainprobe convert RUN --to parquet first; needs pip install 'trainprobe[spark]')",
    )
    parser.add_argument(
        "--rank-local", action="store_true",
        help="read each rank's rows as written; by default a sharded run (FSDP2, TP) is read in full tensors "
        "(shards merged, replicas counted once) and an anomaly names the ranks holding the tensor",
    )
    parser.set_defaults(handler=_diagnose_command)


def _diagnose_command(args: argparse.Namespace) -> int:
    from trainprobe.engine.errors import ConfigError
    from trainprobe.engine.rules import DEFAULT_RULE
    from trainprobe.engine.sinks.files import write_json_atomically
    from trainprobe.tools.diagnosis.answer import diagnose

    result = diagnose(
        args.run, rule=args.rule or DEFAULT_RULE, spike_factor=args.spike_factor, window=args.window,
        warmup=args.warmup, baseline=args.baseline, engine=args.engine, rank_local=args.rank_local,
    )
    written = None
    if args.output:
        written = Path(args.output).expanduser() / "diagnosis.json"
        try:
            written.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomically(written, result.to_json(), indent=2, field="--output")
        except OSError as exc:
            raise ConfigError(f"--output: cannot write {str(written)!r}: {exc.strerror or exc}") from None
    print("\n".join(result.lines()), flush=True)
    if written is not None:
        print(f"wrote {printable(written)}", file=sys.stderr)
    return FOUND if result.first is not None else 0
