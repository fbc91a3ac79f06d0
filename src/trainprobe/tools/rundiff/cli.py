"""``trainprobe diff BASELINE CANDIDATE [CANDIDATE ...] [--noise RERUN]``: the command line of
:func:`trainprobe.tools.rundiff.answer.diff`.

Prints the answer first (one line; under it a ``note:`` line for rows left out, e.g. the
rank-local rows of runs whose ranks differ), then the earliest divergences in execution order, the
tensors that changed most (one row each, ``×N``), and the counts (with examples of rows present
in one run only); with several candidates, that report for each in turn, under a ``== CANDIDATE``
line. ``--noise RERUN``: a rerun of the baseline that differs only by noise; each op's tolerance
becomes at least 10× the difference it shows. Exit status: 0 every matched row within
tolerance (of every candidate), 1 a candidate diverges, 2 bad input (one line on stderr, from
:func:`trainprobe.cli.main`). ``--engine spark`` runs the same queries on Apache Spark over the
runs' Parquet files (local mode, or the process's active session), the same output.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.printable import printable
from trainprobe.tools.runs.options import add_engine_argument, add_output_argument, add_tables_argument


def add_parser(sub: Any) -> None:
    """Add the ``diff`` sub-command to ``sub`` (nothing heavy imported)."""
    p = sub.add_parser(
        "diff",
        help="compare two runs' monitor outputs row by row: the first divergence in execution order",
        description="Match the rows of two Monitor V2 (or two V1) outputs on table, rank, step, micro-step, "
        "name and scope, compare every op, and print the first divergence in execution order, the earliest "
        "ones, and the counts. Exit 0: within tolerance; 1: diverged; 2: bad input. See docs/diff.md. "
        "Needs: pip install 'trainprobe[query]'.",
    )
    p.add_argument("baseline", metavar="BASELINE", help="the reference run (V2 output_dir, V1 MONITOR_OUTPUT_DIR, or one rank's folder)")
    p.add_argument("candidate", metavar="CANDIDATE", nargs="+", help="the run(s) compared with it (same kind)")
    p.add_argument("--rtol", type=float, default=None,
                   help="tolerance on each op's normalised difference (default: by dtype, float32 1e-3)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16", "float64"), default=None,
                   help="the runs' precision, for the default rtol (default: a V1 row's own dtype, else float32)")
    p.add_argument("--noise", metavar="RERUN", default=None,
                   help="a rerun of BASELINE that differs only by noise (threads, kernels, op order): each op's "
                   "tolerance becomes at least 10x the difference it shows")
    p.add_argument("--exact", action="store_true", help="demand bit-equal values (deterministic reruns, CI)")
    p.add_argument("--ops", help="compare only these ops, comma-separated (default: every op both runs have)")
    p.add_argument("--map", dest="mapping", metavar="FILE", help="YAML/JSON regex -> replacement pairs for the candidate's names")
    p.add_argument("--steps", help="only baseline steps A:B (inclusive; A: or :B open)")
    p.add_argument("--offset", type=int, default=0, help="candidate step s is baseline step s+K (a resumed or shifted run)")
    p.add_argument("--limit", type=int, default=20, help="divergences listed (default 20)")
    add_tables_argument(p, "compare only these tables/monitors")
    add_output_argument(p, "write diff.csv and diff_summary.json there (the paths are printed)", "--out", metavar="DIR")
    p.add_argument("--html", metavar="FILE", help="write a self-contained page with the heatmap of differences")
    add_engine_argument(
        p,
        "duckdb (default) or spark: the same comparison on Apache Spark (Parquet runs; pip install 'trainprobe[spark]')",
    )
    p.add_argument(
        "--rank-local", action="store_true",
        help="compare each rank's rows as written; by default a sharded run (FSDP2, TP) is compared in full "
        "tensors, its shards merged (docs/parallelism.md)",
    )
    p.set_defaults(handler=_command)


def parse_steps(text: str | None) -> tuple[int, int] | None:
    """``"A:B"`` (inclusive), ``"A:"``, ``":B"`` or ``"A"`` as ``(first, last)``."""
    if text is None:
        return None
    try:
        if ":" not in text:
            return int(text), int(text)
        first, last = text.split(":", 1)
        return (int(first) if first.strip() else 0, int(last) if last.strip() else 2**62)
    except ValueError:
        raise ConfigError(f"--steps: {text!r} is not A:B (two step numbers, inclusive)") from None


def _command(args: argparse.Namespace) -> int:
    from trainprobe.tools.rundiff.answer import diff

    if args.exact and args.rtol is not None:
        raise ConfigError("--exact and --rtol: give one (--exact demands bit-equal values)")
    if args.exact and args.noise is not None:
        raise ConfigError("--exact and --noise: give one (--exact demands bit-equal values)")
    if args.limit < 0:
        raise ConfigError("--limit: must be >= 0")
    if len(args.candidate) > 1 and (args.output or args.html):
        raise ConfigError("--output and --html: one candidate at a time (they would overwrite each other)")
    ops = [o.strip() for o in args.ops.split(",") if o.strip()] if args.ops else None
    tables = args.tables or None
    status = 0
    for candidate in args.candidate:
        result = diff(
            args.baseline, candidate, rtol=args.rtol, exact=args.exact, ops=ops, mapping=args.mapping,
            steps=parse_steps(args.steps), offset=args.offset, limit=args.limit, out=args.output, html=args.html,
            tables=tables, engine=args.engine, rank_local=args.rank_local, dtype=args.dtype, noise=args.noise,
        )
        if len(args.candidate) > 1:
            sys.stdout.write(("" if candidate == args.candidate[0] else "\n") + f"== {candidate}\n")
        print_result(result, sys.stdout)
        for path in result.written:
            print(f"wrote {printable(path)}", file=sys.stderr)
        status = max(status, result.exit_code)
    return status


def print_result(result: Any, out: TextIO) -> None:
    """The report of a :class:`~trainprobe.tools.rundiff.answer.DiffResult` (see the module docstring);
    names with control characters escaped (:func:`~trainprobe.engine.printable.printable`)."""
    from trainprobe.tools.rundiff.answer import fmt

    out.write(printable(result.answer()) + "\n")
    for note in getattr(result, "notes", []):
        out.write(printable(note) + "\n")
    c = result.counts
    if result.noise is not None:
        out.write(f"tolerance: {result.rule()}: {_noise_line(result)}\n")
    if result.divergences:
        out.write(f"\nearliest divergences ({len(result.divergences)} of {c['diverged']:,}, execution order):\n")
        _table(out, result.divergences, fmt, result.exact)
    if result.largest and c["diverged"] > 1:
        out.write("\nlargest changes (one row per tensor, by its norm where it has one):\n")
        _table(out, result.largest, fmt, result.exact)
    out.write(
        f"\nrows compared {c['compared']:,}: equal {c['equal']:,}, within tolerance {c['within_tolerance']:,}, "
        f"diverged {c['diverged']:,}; only in baseline {c['only_baseline']:,}, only in candidate {c['only_candidate']:,}\n"
    )
    for side, rows in (("baseline", result.only_baseline), ("candidate", result.only_candidate)):
        if rows:
            out.write(f"only in {side}, e.g.: " + "; ".join(r.where() for r in rows[:3]) + "\n")
        if result.tables_only.get(side):
            out.write(f"tables only in {side}: {', '.join(result.tables_only[side])}\n")


def _noise_line(result: Any) -> str:
    """The rerun's largest noise level per table (``module 3.1e-05, param 2.0e-06``)."""

    parts = []
    for table, scopes in result.noise_levels.items():
        levels = [v for ops in scopes.values() for v in ops.values()]
        if levels and max(levels) > 0:
            parts.append(f"{table} {max(levels):.1e}")
    if not parts:
        return f"the rerun {printable(result.noise)} equals the baseline (the rtol alone decides)"
    return f"the rerun {printable(result.noise)} differs by at most " + ", ".join(parts)


def _table(out: TextIO, rows: Sequence[Any], fmt: Any, exact: bool) -> None:
    """The rows as an aligned table (:func:`~trainprobe.tools.console.format_table`, names
    escaped; ``tol``, the tolerance, but with ``--exact``)."""
    from trainprobe.tools.console import format_table
    from trainprobe.tools.sql.diff import fmt_factor

    head: tuple[str, ...] = ("step", "rank", "table", "tensor", "op", "baseline", "candidate", "change", "rel_diff", "tol")
    cells: list[tuple[str, ...]] = [
        (str(r.step), str(r.rank), r.table if r.scope == r.table else f"{r.table} {r.scope}", r.name,
         r.op or "", fmt(r.baseline), fmt(r.candidate), fmt_factor(r.factor),
         f"{r.rel_diff:.2e}" if r.rel_diff is not None else "", f"{r.tolerance:.1e}" if r.tolerance is not None else "")
        for r in rows
    ]
    if exact:
        head, cells = head[:-1], [row[:-1] for row in cells]
    out.write(format_table(head, cells, rule=False) + "\n")
