"""Overhead of every trainprobe tool measured the way users run them: twin models, paired steps.

What is trained: two copies of ``TinyGPT`` (``trainprobe.demo.gpt``, default size: 4 layers,
d_model 256, 4 heads, sequence 128, vocabulary 2000, about 4.2M parameters) with the same
weights, each with its own AdamW (lr 3e-4) and its own stream of the same synthetic batches
(batch 8), on the CPU.

Method (issue #18's side-by-side method, one process):

* For each row a fresh pair of twins is built: a **never-monitored** model A and a **monitored**
  copy B. The row's tool is attached to B **once** and left on for the whole row, through a
  config JSON file written to a temporary folder, as a user would:

  - Monitor V2: ``TrainerMonitorV2(path).start(model=B, optimizer=B_opt)``;
  - Monitor V1: ``TrainerMon(path, params_have_main_grad=False).set_monitor(B, grad_acc_steps=1,
    optimizer=B_opt)``;
  - precision dump: ``PrecisionDebugger(path)``, and each of B's steps is the documented loop
    ``start(B)``, forward, backward, ``optimizer.step()``, ``zero_grad``, ``stop()``, ``step()``.

  The tool is stopped (and the dump's API wrappers removed) only after the row.
* A and B steps alternate; the order inside a pair alternates too (A B, B A, ...), so a drift of
  the machine favours neither side. Each step is timed alone (forward, backward, step,
  ``zero_grad``; the dump's calls included). A pair's ratio is B's step time over A's; the figure
  is the median over ``--pairs`` pairs (default 30), with the interquartile range. A few
  untimed pairs come first (``--warmup``).
* ``control``: both twins unmonitored, the noise floor of the method.
* ``floor``: V2 ``weight_grad + optimizer + param`` with its statistics replaced by the three
  reductions any exact min/max, mean and norm needs (``kernel_floor`` of
  ``bench_monitor_v2.py``). ``one-read``: no trainprobe at all, a minimal hook set reading each
  tensor that configuration reads, at the same points, with one ``torch.sum``
  (``OneReadHooks`` of ``bench_monitor_v2.py``): the lower bound of any single-pass design.
* The dump's two reference rows run the real dump at L0 with its statistics replaced
  (``dump_statistics``): ``dump-L0-one-read``, one ``torch.sum`` per recorded tensor (the dump's
  code plus one read of every tensor: the bound of a single pass as fast as a sum), and
  ``dump-L0-no-stats``, constants (the dump's own code: hooks, names, entries, JSON files).
* The statistics' fused single pass (``TRAINPROBE_FUSED_STATS`` unset: on, on the CPU, for
  float32) is compiled when the tool is attached, before the untimed pairs.
  ``TRAINPROBE_FUSED_STATS=off python bench/bench_paired.py`` measures without it.
* ``--clock wall`` (default) times a step with ``perf_counter``; ``--clock cpu`` with
  ``process_time`` (the process's CPU time, every thread: a background writer's work counts in
  whichever step it runs during). With ``--threads 1 --clock cpu`` a step's time hardly moves
  with other jobs on a shared machine.

Usage::

    python bench/bench_paired.py                          # every row, 30 pairs
    python bench/bench_paired.py --quick                  # smoke run
    python bench/bench_paired.py --threads 1 --clock cpu --pairs 15
    python bench/bench_paired.py --configs control,dump-L0
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402

from bench_dump import BATCH_SIZE, Trainer  # noqa: E402
from bench_monitor_v1 import OPS as V1_OPS  # noqa: E402
from bench_monitor_v1 import V1Monitor  # noqa: E402
from bench_monitor_v2 import OneReadHooks, in_turn, kernel_floor, load_text, quartiles  # noqa: E402
from trainprobe import TrainerMonitorV2  # noqa: E402
from trainprobe.dump import PrecisionDebugger  # noqa: E402
from trainprobe.dump.api_hooks import uninstall_api_wrappers  # noqa: E402

WG_OPT_PARAM = ("weight_grad", "optimizer", "param")


@dataclass(frozen=True)
class Row:
    """One row of the table: which tool, with which config, and what it must achieve."""

    key: str
    label: str
    tool: str  # "none", "v2", "v1", "dump", "one-read"
    config: dict[str, Any] | None = None  # the JSON a user would write (paths added per run)
    target: float | None = None
    floor_slack: float | None = None  # also met within this many points of the floor row
    kernels_only: bool = False  # the floor row
    dump_stats: str = "real"  # dump rows: "real", "one-read" (one sum per tensor) or "none" (constants)


def _v2(*names: str) -> dict[str, Any]:
    return {"monitors": {name: {"enabled": True} for name in names}}


ROWS: tuple[Row, ...] = (
    Row("control", "control (nothing attached)", "none"),
    Row("v2-weight_grad", "V2 weight_grad", "v2", _v2("weight_grad"), 1.02),
    Row(
        "v2-wg+opt+param",
        "V2 weight_grad + optimizer + param",
        "v2",
        _v2(*WG_OPT_PARAM),
        1.05,
        floor_slack=0.01,
    ),
    Row("floor", "floor: the same, reductions only", "v2", _v2(*WG_OPT_PARAM), kernels_only=True),
    Row("floor-wg", "floor of V2 weight_grad: reductions only", "v2", _v2("weight_grad"), kernels_only=True),
    Row("one-read", "one-read: one sum per tensor and point", "one-read"),
    Row("v2-module", "V2 module, all modules", "v2", _v2("module"), 1.35),
    Row(
        "v1-wg+mv+param",
        "V1 wg + mv + param",
        "v1",
        {"wg_distribution": True, "mv_distribution": True, "param_distribution": True, "ops": V1_OPS},
        1.05,
    ),
    Row(
        "floor-v1",
        "floor of V1 wg + mv + param: reductions only",
        "v1",
        {"wg_distribution": True, "mv_distribution": True, "param_distribution": True, "ops": V1_OPS},
        kernels_only=True,
    ),
    Row("v1-xy", "V1 xy, all modules", "v1", {"xy_distribution": True, "all_xy": True, "ops": V1_OPS}, 1.35),
    Row("dump-L0", "dump statistics L0", "dump", {"task": "statistics", "level": "L0"}, 1.15),
    Row(
        "dump-L0-one-read",
        "dump L0, statistics = one sum per tensor",
        "dump",
        {"task": "statistics", "level": "L0"},
        dump_stats="one-read",
    ),
    Row(
        "dump-L0-no-stats",
        "dump L0, statistics = constants (the dump's own code)",
        "dump",
        {"task": "statistics", "level": "L0"},
        dump_stats="none",
    ),
    Row("dump-L1", "dump statistics L1", "dump", {"task": "statistics", "level": "L1"}, 1.60),
    Row("dump-mix", "dump statistics mix", "dump", {"task": "statistics", "level": "mix"}, 1.80),
)
BY_KEY = {r.key: r for r in ROWS}


# -- the twins ----------------------------------------------------------------------------------
class Twin(Trainer):
    """One model with its own optimizer and batch stream (the same weights and batches as its twin),
    stepped as ``bench_dump.py`` steps it."""

    clock: Callable[[], float] = staticmethod(time.perf_counter)
    """What a step's time is: wall clock, or the process's CPU time with ``--clock cpu``."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.debugger: PrecisionDebugger | None = None  # set on the dumped twin: its steps are dumped

    def step(self) -> float:  # type: ignore[override]
        """One training step (the dump's documented calls around it on a dumped twin); its seconds
        on :attr:`clock` (its wall seconds go to :attr:`last_wall`, its loss to :attr:`last_loss`)."""
        return super().step(self.debugger)


@contextlib.contextmanager
def attached(row: Row, twin: Twin, folder: Path) -> Iterator[None]:
    """The row's tool attached to ``twin`` once, from a config file in ``folder``, until the end."""
    folder.mkdir(parents=True, exist_ok=True)
    if row.tool == "none":
        yield
    elif row.tool == "one-read":
        hooks = OneReadHooks()
        hooks.start(twin.model, twin.optimizer)
        try:
            yield
        finally:
            hooks.stop()
    elif row.tool in ("v2", "v1"):
        if row.tool == "v2":
            path = _write_config(folder / "monitor_v2_config.json", row.config, output_dir=str(folder / "out"))
            monitor: Any = TrainerMonitorV2(path)
        else:  # V1Monitor writes the config file
            monitor = V1Monitor({"output_dir": str(folder / "out"), "monitors": row.config})
        with kernel_floor(row.kernels_only):
            monitor.start(model=twin.model, optimizer=twin.optimizer)
            try:
                yield
            finally:
                monitor.stop()
    elif row.tool == "dump":
        path = _write_config(folder / "config.json", row.config, dump_path=str(folder / "dump"))
        twin.debugger = PrecisionDebugger(path)
        try:
            with dump_statistics(row.dump_stats):
                yield
        finally:
            twin.debugger = None
            uninstall_api_wrappers()  # L1/mix wrap torch's APIs process-wide: leave later rows clean
    else:
        raise ValueError(f"unknown tool {row.tool!r}")


@contextlib.contextmanager
def dump_statistics(kind: str) -> Iterator[None]:
    """The dump's statistics as they are (``real``), or replaced for the two reference rows:
    ``one-read``, one ``torch.sum`` per recorded tensor (what a single pass costs if it ran at the
    speed of a sum: the lower bound of any exact statistics), or ``none``, constant values (what
    the dump costs without reading any tensor: hooks, naming, entries, JSON files)."""
    if kind == "real":
        yield
        return
    from trainprobe.dump import entries

    def one_read(t: torch.Tensor) -> list[float]:
        value = t.detach().sum().item()
        return [value, value, value, value]

    def constants(t: torch.Tensor) -> list[float]:
        return [1.0, -1.0, 0.0, 1.0]

    real = entries.statistics_row
    entries.statistics_row = one_read if kind == "one-read" else constants  # type: ignore[assignment]
    try:
        yield
    finally:
        entries.statistics_row = real  # type: ignore[assignment]


def _write_config(path: Path, config: dict[str, Any] | None, **paths: str) -> Path:
    path.write_text(json.dumps({**(config or {}), **paths}, indent=2), encoding="utf-8")
    return path


# -- measuring --------------------------------------------------------------------------------
@dataclass
class Result:
    """One row's pair ratios and step times."""

    row: Row
    ratios: list[float] = field(default_factory=list)
    plain_s: list[float] = field(default_factory=list)
    monitored_s: list[float] = field(default_factory=list)
    wall_ratios: list[float] = field(default_factory=list)  # the same pairs on the wall clock
    seconds: float = 0.0

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    @property
    def iqr(self) -> tuple[float, float]:
        return quartiles(self.ratios)


def measure(row: Row, folder: Path, args: argparse.Namespace) -> Result:
    """Fresh twins, the tool attached to B once, ``args.warmup`` untimed then ``args.pairs`` timed pairs."""
    t_begin = time.perf_counter()
    plain, monitored = Twin(args.seed), Twin(args.seed)
    res = Result(row)
    with attached(row, monitored, folder):
        for _ in range(args.warmup):
            plain.step()
            monitored.step()
        for i in range(args.pairs):
            a, b = in_turn(i, plain.step, monitored.step)
            res.ratios.append(b / a)
            res.wall_ratios.append(monitored.last_wall / plain.last_wall)
            res.plain_s.append(a)
            res.monitored_s.append(b)
    if abs(plain.last_loss - monitored.last_loss) > 1e-4 * max(1.0, abs(plain.last_loss)):
        print(f"  warning: {row.key}: the twins' losses differ ({plain.last_loss} vs {monitored.last_loss})")
    shutil.rmtree(folder, ignore_errors=True)
    res.seconds = time.perf_counter() - t_begin
    return res


# -- report -----------------------------------------------------------------------------------
def target_text(row: Row) -> str:
    if row.target is None:
        return "noise floor" if row.tool == "none" else "—"
    text = f"≤ {row.target:.2f}x"
    if row.floor_slack is not None:
        text += f" (or ≤ floor + {row.floor_slack:.2f})"
    return text


def met_text(res: Result, floor: float | None) -> str:
    row = res.row
    if row.target is None:
        return "—"
    if res.median <= row.target:
        return "yes"
    if row.floor_slack is not None and floor is not None and res.median <= floor + row.floor_slack:
        return "yes (floor)"
    return "**no**"


def print_report(results: list[Result], args: argparse.Namespace) -> None:
    floor = next((r.median for r in results if r.row.key == "floor"), None)
    print(f"\n{args.pairs} pairs per row, {args.clock} clock, {torch.get_num_threads()} threads\n")
    print("| config | ratio (median) | IQR | target | met? |")
    print("|---|---|---|---|---|")
    for r in results:
        q1, q3 = r.iqr
        print(f"| {r.row.label} | {r.median:.3f}x | {q1:.3f}–{q3:.3f} | {target_text(r.row)} | {met_text(r, floor)} |")
    print(
        "\nDetails: step times are medians over the pairs; min–max of the pair ratios; wall ratio: the"
        "\nmedian over the same pairs of the steps' wall-clock ratio (waits such as fsync count there only).\n"
    )
    print("| config | monitored step | unmonitored step | min–max | wall ratio | row time |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r.row.label} | {1000 * statistics.median(r.monitored_s):.1f} ms "
            f"| {1000 * statistics.median(r.plain_s):.1f} ms | {min(r.ratios):.3f}–{max(r.ratios):.3f} "
            f"| {statistics.median(r.wall_ratios):.3f}x | {r.seconds:.0f} s |"
        )


# -- command line -----------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=None, help="timed A/B pairs per row (default 30)")
    p.add_argument("--warmup", type=int, default=None, help="untimed pairs per row first (default 3)")
    p.add_argument("--configs", default=",".join(r.key for r in ROWS), help=f"subset of: {', '.join(BY_KEY)}")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="a step's time: wall clock, or the process's CPU time (every thread; stable with --threads 1)",
    )
    p.add_argument("--quick", action="store_true", help="3 pairs, 1 warm-up pair: a smoke run")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.pairs is None:
        args.pairs = 3 if args.quick else 30
    if args.warmup is None:
        args.warmup = 1 if args.quick else 3
    if args.pairs < 1 or args.warmup < 0:
        p.error("--pairs must be >= 1 and --warmup >= 0")
    keys = [k.strip() for k in args.configs.split(",") if k.strip()]
    unknown = [k for k in keys if k not in BY_KEY]
    if unknown:
        p.error(f"unknown config(s) {unknown}; choose from {', '.join(BY_KEY)}")
    args.rows = [r for r in ROWS if r.key in keys]
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        Twin.clock = staticmethod(time.process_time)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="trainprobe-bench-paired-"))
    try:
        probe = Twin(args.seed)
        n_params = sum(p.numel() for p in probe.model.parameters())
        print(
            f"TinyGPT twins, {n_params / 1e6:.2f}M params each, batch {BATCH_SIZE}, seq {probe.cfg.seq_len}, "
            f"AdamW; torch {torch.__version__}, {torch.get_num_threads()} threads, {args.clock} clock; "
            f"{args.pairs} pairs per row after {args.warmup} untimed",
            flush=True,
        )
        del probe
        print(f"load average at start: {load_text()}", flush=True)
        results = []
        for row in args.rows:
            res = measure(row, tmp / row.key.replace("+", "_"), args)
            results.append(res)
            print(f"  {row.label}: median {res.median:.3f}x ({res.seconds:.0f} s)", flush=True)
        print(f"load average at end: {load_text()}")
        print_report(results, args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
