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
* ``--device cuda``: the same rows with both twins on the GPU; a step is timed on the wall clock
  between two ``torch.cuda.synchronize()`` calls (so the device's queued work is inside its
  step), and each step's peak device memory above what was allocated when it began is recorded
  (``torch.cuda.max_memory_allocated``). The GPU table adds the milliseconds per step, the
  device memory monitoring adds at the peak of a step (monitored minus unmonitored twin, median
  over the pairs) and the memory it keeps between steps (what stays allocated after the row's
  warm-up, minus the same for the control row), against the GPU targets. ``--model gpu`` trains
  a larger GPT (d_model 1024, 8 layers, sequence 512, vocabulary 8192, batch 8; about 110M
  parameters), where a step is long enough for launch overheads not to dominate.
  ``--fused-stats auto|on|off`` sets ``TRAINPROBE_FUSED_STATS`` for the run: on CUDA the
  statistics use the eager reductions unless it is ``on``/``auto`` (torch.compile to Triton;
  docs/performance.md, "GPU").

Usage::

    python bench/bench_paired.py                          # every row, 30 pairs
    python bench/bench_paired.py --quick                  # smoke run
    python bench/bench_paired.py --threads 1 --clock cpu --pairs 15
    python bench/bench_paired.py --configs control,dump-L0
    python bench/bench_paired.py --device cuda --model gpu --pairs 20   # the GPU table
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
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
from trainprobe.demo.gpt import GPTConfig, benchmark_setup  # noqa: E402
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
    one_read: tuple[str, float] | None = None  # (one-read row, points): the bar against that row
    points: str = "wg+opt+param"  # one-read rows: which reads (OneReadHooks' points)
    kernels_only: bool = False  # the floor row
    dump_stats: str = "real"  # dump rows: "real", "one-read" (one sum per tensor) or "none" (constants)
    gpu_target: float | None = None  # the target with --device cuda (docs/performance.md, "GPU")


def _v2(*names: str) -> dict[str, Any]:
    return {"monitors": {name: {"enabled": True} for name in names}}


ROWS: tuple[Row, ...] = (
    Row("control", "control (nothing attached)", "none"),
    Row("v2-weight_grad", "V2 weight_grad", "v2", _v2("weight_grad"), 1.02, one_read=("one-read-wg", 0.02)),
    Row(
        "v2-wg+opt+param",
        "V2 weight_grad + optimizer + param",
        "v2",
        _v2(*WG_OPT_PARAM),
        1.05,
        floor_slack=0.01,
        one_read=("one-read", 0.03),
        gpu_target=1.01,
    ),
    Row("floor", "floor: the same, reductions only", "v2", _v2(*WG_OPT_PARAM), kernels_only=True),
    Row("floor-wg", "floor of V2 weight_grad: reductions only", "v2", _v2("weight_grad"), kernels_only=True),
    Row("one-read", "one-read: one sum per tensor and point", "one-read"),
    Row("one-read-wg", "one-read of V2 weight_grad", "one-read", points="weight_grad"),
    Row(
        "v2-module",
        "V2 module, all modules",
        "v2",
        _v2("module"),
        1.35,
        one_read=("one-read-module", 0.05),
        gpu_target=1.10,
    ),
    Row("floor-module", "floor of V2 module: reductions only", "v2", _v2("module"), kernels_only=True),
    Row("one-read-module", "one-read of V2 module (and V1 xy)", "one-read", points="module"),
    Row(
        "v1-wg+mv+param",
        "V1 wg + mv + param",
        "v1",
        {"wg_distribution": True, "mv_distribution": True, "param_distribution": True, "ops": V1_OPS},
        1.05,
        one_read=("one-read", 0.03),
    ),
    Row(
        "floor-v1",
        "floor of V1 wg + mv + param: reductions only",
        "v1",
        {"wg_distribution": True, "mv_distribution": True, "param_distribution": True, "ops": V1_OPS},
        kernels_only=True,
    ),
    Row(
        "v1-xy",
        "V1 xy, all modules",
        "v1",
        {"xy_distribution": True, "all_xy": True, "ops": V1_OPS},
        1.35,
        one_read=("one-read-module", 0.05),
    ),
    Row("dump-L0", "dump statistics L0", "dump", {"task": "statistics", "level": "L0"}, 1.15, gpu_target=1.20),
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
GPU_MEMORY_TARGET = 0.02
"""With ``--device cuda``: the device memory monitoring adds, at most this fraction of the model's
parameter bytes."""
GPU_MODEL = GPTConfig(vocab_size=8192, seq_len=512, d_model=1024, n_heads=16, n_layers=8)


# -- the twins ----------------------------------------------------------------------------------
class Twin(Trainer):
    """One model with its own optimizer and batch stream (the same weights and batches as its twin),
    stepped as ``bench_dump.py`` steps it."""

    clock: Callable[[], float] = staticmethod(time.perf_counter)
    """What a step's time is: wall clock, or the process's CPU time with ``--clock cpu``; with
    ``--device cuda`` the wall clock after a synchronisation."""
    device = torch.device("cpu")
    model_cfg: GPTConfig | None = None  # None: the benchmark's default GPT

    def __init__(self, seed: int) -> None:
        if self.model_cfg is None:
            super().__init__(seed)
        else:
            run = benchmark_setup(seed, BATCH_SIZE, self.model_cfg)
            self.cfg, self.model, self.optimizer, self.batches = run.cfg, run.model, run.optimizer, run.batches
        if self.device.type != "cpu":  # parameters moved in place: the optimizer (no state yet) keeps them
            self.model.to(self.device)
            cpu_batches, device = self.batches, self.device
            self.batches = (b.to(device) for b in cpu_batches)
        self.debugger: PrecisionDebugger | None = None  # set on the dumped twin: its steps are dumped
        self.last_peak = 0  # bytes: the last step's peak device memory above its start (CUDA)

    def step(self) -> float:  # type: ignore[override]
        """One training step (the dump's documented calls around it on a dumped twin); its seconds
        on :attr:`clock` (its wall seconds go to :attr:`last_wall`, its loss to :attr:`last_loss`,
        on CUDA its peak device memory above the step's start to :attr:`last_peak`)."""
        if self.device.type != "cuda":
            return super().step(self.debugger)
        torch.cuda.synchronize(self.device)
        start = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        elapsed = super().step(self.debugger)
        self.last_peak = torch.cuda.max_memory_allocated(self.device) - start
        return elapsed


def _synchronised_wall_clock() -> float:
    """``perf_counter`` after the device's queued work is done (a CUDA step's time)."""
    torch.cuda.synchronize()
    return time.perf_counter()


@contextlib.contextmanager
def attached(row: Row, twin: Twin, folder: Path) -> Iterator[None]:
    """The row's tool attached to ``twin`` once, from a config file in ``folder``, until the end."""
    folder.mkdir(parents=True, exist_ok=True)
    if row.tool == "none":
        yield
    elif row.tool == "one-read":
        hooks = OneReadHooks(row.points)
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

    def one_read(t: torch.Tensor) -> Any:
        total = t.detach().sum()
        if total.device.type != "cpu":  # stays on the device, read back once per step as the real rows
            return total.to(torch.float64).expand(4)
        value = total.item()
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
    peak_added: list[int] = field(default_factory=list)  # CUDA: monitored minus plain step peak, bytes
    held: int = 0  # CUDA: bytes allocated after the warm-up above what was before the twins

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    @property
    def iqr(self) -> tuple[float, float]:
        return quartiles(self.ratios)


def measure(row: Row, folder: Path, args: argparse.Namespace) -> Result:
    """Fresh twins, the tool attached to B once, ``args.warmup`` untimed then ``args.pairs`` timed pairs."""
    t_begin = time.perf_counter()
    cuda = Twin.device.type == "cuda"
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(Twin.device)
    plain, monitored = Twin(args.seed), Twin(args.seed)
    res = Result(row)
    with attached(row, monitored, folder):
        for _ in range(args.warmup):
            plain.step()
            monitored.step()
        if cuda:
            torch.cuda.synchronize(Twin.device)
            res.held = torch.cuda.memory_allocated(Twin.device) - base
        for i in range(args.pairs):
            a, b = in_turn(i, plain.step, monitored.step)
            res.ratios.append(b / a)
            res.wall_ratios.append(monitored.last_wall / plain.last_wall)
            res.plain_s.append(a)
            res.monitored_s.append(b)
            res.peak_added.append(monitored.last_peak - plain.last_peak)
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


def one_read_text(res: Result, medians: dict[str, float]) -> str:
    """The bar that matters on the CPU: within ``points`` of the row's one-read row (one sum per
    tensor read, the same points, one host copy per step), measured in the same run."""
    if res.row.one_read is None:
        return "—"
    key, points = res.row.one_read
    if key not in medians:
        return f"(no {key} row)"
    over = 100 * (res.median - medians[key])
    verdict = "yes" if over <= 100 * points else "**no**"
    return f"{over:+.1f} points of {key} (≤ {100 * points:.0f}): {verdict}"


def print_gpu_report(results: list[Result], args: argparse.Namespace) -> None:
    """The GPU table: ratio, ms per step, device memory added, against the GPU targets."""
    param_bytes = args.param_bytes
    control = next((r.held for r in results if r.row.key == "control"), None)
    print(f"\nGPU: {torch.cuda.get_device_name(Twin.device)}, {args.pairs} pairs per row, synchronised wall clock")
    print(f"targets: ratio as listed; device memory added ≤ {GPU_MEMORY_TARGET:.0%} of the parameters' "
          f"{param_bytes / 2**20:.1f} MiB; no synchronisation inside a step beyond one copy per monitor "
          "(checked by tests/test_device_e2e.py, not here)\n")  # fmt: skip
    print(
        "| config | ratio (median) | IQR | monitored ms/step | unmonitored ms/step | peak added | kept | target | met? |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        q1, q3 = r.iqr
        peak = statistics.median(r.peak_added)
        kept = r.held - control if control is not None else None
        added = max(peak, 0) + max(kept or 0, 0)
        target = "noise floor" if r.row.tool == "none" else (f"≤ {r.row.gpu_target:.2f}x" if r.row.gpu_target else "—")
        met = "—"
        if r.row.gpu_target is not None:
            ok = r.median <= r.row.gpu_target and added <= GPU_MEMORY_TARGET * param_bytes
            met = "yes" if ok else "**no**"
        kept_text = f"{kept / 2**20:.2f} MiB" if kept is not None else "(no control row)"
        print(
            f"| {r.row.label} | {r.median:.3f}x | {q1:.3f}–{q3:.3f} | {1000 * statistics.median(r.monitored_s):.2f} "
            f"| {1000 * statistics.median(r.plain_s):.2f} | {peak / 2**20:.2f} MiB ({peak / param_bytes:.2%}) "
            f"| {kept_text} | {target} | {met} |"
        )


def print_report(results: list[Result], args: argparse.Namespace) -> None:
    if Twin.device.type == "cuda":
        print_gpu_report(results, args)
        return
    floor = next((r.median for r in results if r.row.key == "floor"), None)
    print(f"\n{args.pairs} pairs per row, {args.clock} clock, {torch.get_num_threads()} threads\n")
    medians = {r.row.key: r.median for r in results}
    print("| config | ratio (median) | IQR | target | met? | against its one-read row |")
    print("|---|---|---|---|---|---|")
    for r in results:
        q1, q3 = r.iqr
        print(
            f"| {r.row.label} | {r.median:.3f}x | {q1:.3f}–{q3:.3f} | {target_text(r.row)} | {met_text(r, floor)} "
            f"| {one_read_text(r, medians)} |"
        )
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
    p.add_argument("--device", default="cpu", help="where the twins train: cpu (default) or cuda[:N]")
    p.add_argument(
        "--model", choices=("default", "gpu"), default="default", help="the GPT's size (gpu: ~110M parameters)"
    )
    p.add_argument(
        "--fused-stats",
        choices=("auto", "on", "off"),
        default=None,
        help="set TRAINPROBE_FUSED_STATS for the run (default: leave it; the statistics' own default)",
    )
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
    Twin.device = torch.device(args.device)
    if Twin.device.type == "cuda":
        if not torch.cuda.is_available():
            p.error("--device cuda: torch.cuda.is_available() is False (a CPU build of torch, or no GPU)")
        if args.clock == "cpu":
            p.error("--device cuda times steps on the synchronised wall clock; leave --clock out")
        torch.cuda.set_device(Twin.device)
        Twin.clock = staticmethod(_synchronised_wall_clock)
    elif Twin.device.type != "cpu":
        p.error(f"--device {args.device}: cpu or cuda")
    if args.model == "gpu":
        Twin.model_cfg = GPU_MODEL
    if args.fused_stats is not None:
        os.environ["TRAINPROBE_FUSED_STATS"] = args.fused_stats
    if args.clock == "cpu":
        Twin.clock = staticmethod(time.process_time)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="trainprobe-bench-paired-"))
    try:
        probe = Twin(args.seed)
        n_params = sum(p.numel() for p in probe.model.parameters())
        args.param_bytes = sum(p.numel() * p.element_size() for p in probe.model.parameters())
        print(
            f"TinyGPT twins, {n_params / 1e6:.2f}M params each, batch {BATCH_SIZE}, seq {probe.cfg.seq_len}, "
            f"AdamW, on {Twin.device}; fused stats {os.environ.get('TRAINPROBE_FUSED_STATS', 'default')}; "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.clock} clock; "
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
