"""Monitor V2 on two real processes (gloo backend, CPU): weight_grad under DDP and FSDP, every
collective gloo supports under the cc monitor, and the cc options.

Each group of scenarios runs in ONE pair of spawned processes (a module-scoped fixture), since
starting two interpreters with torch costs seconds on a small machine; the workers only train
and save float64 references, the tests read the CSVs back in this process and compare.

The worker functions live in this file on purpose: the cc rows name their call site
(``@test_distributed_v2.py[<line>]``) and ``cc_codeline`` filters on it.
"""

from __future__ import annotations

import copy
import inspect
import io
import json
import logging
import math
import os
import socket
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext, redirect_stdout
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from conftest import read_csv, rows_of, stats64, write_config
from models import MLP
from trainprobe import TrainerMonitorV2
from trainprobe.engine.probes.collectives import FUNCTIONS

WORLD = 2
OPS = ["min", "max", "mean", "norm", "nans"]
THIS_FILE = os.path.basename(__file__)
STEPS = 2
PARAMS = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)


# -- launching ---------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, port: int, fn: Any, args: tuple[Any, ...], world: int = WORLD) -> None:
    """Runs in each spawned process: gloo process group around ``fn(rank, *args)``."""
    warnings.filterwarnings("ignore", category=FutureWarning)  # deprecated torch.distributed names
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        fn(rank, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def launch(fn: Any, *args: Any, timeout: float = 180.0, world: int = WORLD) -> None:
    """Run ``fn(rank, *args)`` on ``world`` (two) spawned processes; an exception in any fails the caller."""
    ctx = mp.spawn(_entry, args=(_free_port(), fn, args, world), nprocs=world, join=False)
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):  # raises ProcessRaisedException / ProcessExitedException
        if time.monotonic() > deadline:
            for process in ctx.processes:
                if process.is_alive():
                    process.kill()
            pytest.fail(f"distributed workers did not finish within {timeout:.0f}s")


class _ErrorLog(logging.Handler):
    """Collects the trainprobe logger's errors (a failing probe logs and disables itself)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _monitor(out: Path, monitors: dict[str, Any]) -> TrainerMonitorV2:
    """A monitor from a JSON config file written next to ``out`` (one file per rank)."""
    cfg = {"output_dir": str(out), "monitors": monitors}
    return TrainerMonitorV2(write_config(out.parent, cfg, name=f"{out.name}_rank{dist.get_rank()}.json"))


def _session(out: Path, rank: int, monitors: dict[str, Any], body: Any, **start: Any) -> None:
    """Run ``body(mon)`` between start() and stop(); save the trainprobe errors logged meanwhile."""
    errors = _ErrorLog()
    logging.getLogger("trainprobe").addHandler(errors)
    try:
        mon = _monitor(out, monitors)
        mon.start(**start)
        body(mon)
        mon.stop()
    finally:
        logging.getLogger("trainprobe").removeHandler(errors)
    (out / f"errors_rank{rank}.json").parent.mkdir(parents=True, exist_ok=True)
    (out / f"errors_rank{rank}.json").write_text(json.dumps(errors.messages))


def _assert_no_probe_errors(out: Path) -> None:
    for rank in range(WORLD):
        messages = json.loads((out / f"errors_rank{rank}.json").read_text())
        assert messages == [], f"rank {rank}: {messages}"


# -- comparisons -------------------------------------------------------------------------------
def _assert_stats(row: dict[str, str], t: torch.Tensor, rel: float = 1e-5, abs_: float = 1e-7) -> None:
    """The row's statistics equal the float64 reference ones of ``t``."""
    ref = stats64(t)
    for op in OPS:
        got = float(row[op])
        assert got == pytest.approx(ref[op], rel=rel, abs=abs_), f"{row['module_name']} {op}: {got} != {ref[op]}"


def _batch(rank: int, step: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randn(4, 6, generator=g)


def _loss(model: torch.nn.Module, x: torch.Tensor, scale: float) -> torch.Tensor:
    return model(x).pow(2).mean() * scale


# ==============================================================================================
# weight_grad under DistributedDataParallel
# ==============================================================================================
# case -> (monitor_mbs_grad, gradient_as_bucket_view, grad_acc_steps)
DDP_CASES: dict[str, tuple[bool, bool, int]] = {
    "mbs_grad": (True, False, 2),
    "accumulated": (False, False, 2),
    "mbs_grad_bucket_view": (True, True, 2),
    "accumulated_bucket_view": (False, True, 2),
    "one_micro_batch": (False, False, 1),
}


def _ddp_case(rank: int, out: Path, mbs: bool, bucket_view: bool, acc: int) -> None:
    torch.manual_seed(0)  # same initial weights on both ranks (DDP broadcasts rank 0's anyway)
    model = MLP()
    ref = copy.deepcopy(model).double()
    ddp = DDP(model, gradient_as_bucket_view=bucket_view)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    local: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    def train(mon: TrainerMonitorV2) -> None:
        for step in range(STEPS):
            ref.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
            for micro in range(acc):
                x = _batch(rank, step, micro)
                # this rank's own gradient of this micro-batch, in float64, without DDP
                grads = torch.autograd.grad(_loss(ref, x.double(), 1 / acc), list(ref.parameters()))
                local[(step, micro)] = {f"module.{n}": g for (n, _), g in zip(ref.named_parameters(), grads)}
                with ddp.no_sync() if micro < acc - 1 else nullcontext():
                    _loss(ddp, x, 1 / acc).backward()
            opt.step()  # ends the monitored step (patch_optimizer_step)
            opt.zero_grad(set_to_none=True)
        assert mon.current_step == STEPS

    monitors = {"weight_grad": {"enabled": True, "ops": OPS, "monitor_mbs_grad": mbs}}
    _session(out, rank, monitors, train, model=ddp, optimizer=opt, grad_acc_steps=acc)
    torch.save(local, out / f"local_rank{rank}.pt")


def _ddp_worker(rank: int, root: Path) -> None:
    for case, (mbs, bucket_view, acc) in DDP_CASES.items():
        _ddp_case(rank, root / case, mbs, bucket_view, acc)


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ddp")
    launch(_ddp_worker, root)
    return root


@pytest.mark.parametrize("case", list(DDP_CASES))
def test_ddp_weight_grad_unreduced_is_local_and_reduced_is_the_average(ddp_run: Path, case: str) -> None:
    mbs, _, acc = DDP_CASES[case]
    out = ddp_run / case
    _assert_no_probe_errors(out)
    local = [torch.load(out / f"local_rank{r}.pt") for r in range(WORLD)]
    names = [f"module.{n}" for n in PARAMS]
    by_rank = []
    for rank in range(WORLD):
        header, _ = read_csv(out / f"rank_{rank}" / "weight_grad_step0-0.csv")
        assert header == ["vpp_stage", "step", "module_name", "scope", "micro_step", *OPS]
        rows = rows_of(out, "weight_grad", rank)
        got = {(int(r["step"]), r["module_name"], r["scope"], int(r["micro_step"])): r for r in rows}
        assert len(got) == len(rows), "duplicate rows"
        assert {r["vpp_stage"] for r in rows} == {"0"}

        expected: dict[tuple[int, str, str, int], torch.Tensor] = {}
        for step in range(STEPS):
            for name in names:
                mine = [local[rank][(step, m)][name] for m in range(acc)]
                if mbs:
                    for m in range(acc):
                        expected[(step, name, "unreduced", m)] = mine[m]
                else:
                    expected[(step, name, "unreduced", acc)] = sum(mine)
                every_rank = [local[q][(step, m)][name] for q in range(WORLD) for m in range(acc)]
                expected[(step, name, "reduced", acc)] = sum(every_rank) / WORLD
        assert sorted(got) == sorted(expected)
        for key, t in expected.items():
            _assert_stats(got[key], t)
        by_rank.append(got)

    # reduced = after DDP's all-reduce: the same gradient, so the same statistics, on both ranks;
    # unreduced = each rank's own data, so different
    for key, row in by_rank[0].items():
        other = by_rank[1][key]
        if key[2] == "reduced":
            assert [row[op] for op in OPS] == [other[op] for op in OPS], key
        else:
            assert row["norm"] != other["norm"], key


# ==============================================================================================
# cc: every collective gloo supports
# ==============================================================================================
N = 3  # elements per rank-chunk
OPTIONAL_OPS = (
    "all_to_all",
    "all_to_all_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_gather_single",
    "reduce_scatter_single",
)


def _x(rank: int, step: int, k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Input of call ``k`` of ``step`` on ``rank``; small halves, exact in float32."""
    return torch.arange(N, dtype=dtype) * (rank + 1) + 10 * step + k + 0.5


def _gloo_support() -> set[str]:
    """The optional collectives this torch exposes and its gloo backend runs (probed on both
    ranks, before any monitor starts)."""
    trials = {
        "all_to_all": lambda: dist.all_to_all([torch.zeros(1)] * WORLD, [torch.ones(1)] * WORLD),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.zeros(WORLD), torch.ones(WORLD)),
        "reduce_scatter": lambda: dist.reduce_scatter(torch.zeros(1), [torch.ones(1)] * WORLD),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.zeros(1), torch.ones(WORLD)),
        "all_gather_single": lambda: dist.all_gather_single(torch.zeros(WORLD), torch.ones(1)),
        "reduce_scatter_single": lambda: dist.reduce_scatter_single(torch.zeros(1), torch.ones(WORLD)),
    }
    supported = set()
    for op, trial in trials.items():
        if not hasattr(dist, op):
            continue
        try:
            trial()
        except RuntimeError as exc:
            if "support" not in str(exc):
                raise
            continue
        supported.add(op)
    return supported


def _cc_loop(rank: int, step: int, supported: set[str]) -> None:
    """One step's collectives; every call site is in this function. Expected rows: _cc_expected."""
    t = _x(rank, step, 0)
    dist.all_reduce(t)
    t = _x(rank, step, 1)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    t = _x(rank, step, 2)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    t.mul_(100)  # after completion: the recorded row must still show the reduced values
    dist.all_gather([torch.zeros(N) for _ in range(WORLD)], _x(rank, step, 3))
    dist.all_gather_into_tensor(torch.zeros(WORLD * N), _x(rank, step, 4))
    dist.broadcast(_x(rank, step, 5), src=0)
    dist.reduce(_x(rank, step, 6), dst=0)
    if "all_to_all" in supported:
        dist.all_to_all([torch.zeros(N) for _ in range(WORLD)], [_x(rank, step, 7) + 100 * j for j in range(WORLD)])
    if "all_to_all_single" in supported:
        dist.all_to_all_single(torch.zeros(WORLD * N), torch.cat([_x(rank, step, 8) + 100 * j for j in range(WORLD)]))
    if rank == 0:
        dist.send(_x(0, step, 9), dst=1)
        work = dist.irecv(torch.zeros(N), src=1)
    else:
        dist.recv(torch.zeros(N), src=0)
        work = dist.isend(_x(1, step, 10), dst=0)
    work.wait()
    scatter_list = [_x(0, step, 11) + 100 * j for j in range(WORLD)] if rank == 0 else None
    dist.scatter(torch.zeros(N), scatter_list, src=0)
    gather_list = [torch.zeros(N) for _ in range(WORLD)] if rank == 0 else None
    dist.gather(_x(rank, step, 12), gather_list, dst=0)
    if "reduce_scatter" in supported:
        dist.reduce_scatter(torch.zeros(N), [_x(rank, step, 13) + 100 * j for j in range(WORLD)])
    if "reduce_scatter_tensor" in supported:
        dist.reduce_scatter_tensor(torch.zeros(N), torch.cat([_x(rank, step, 14) + 100 * j for j in range(WORLD)]))
    if "all_gather_single" in supported:
        dist.all_gather_single(torch.zeros(WORLD * N), _x(rank, step, 15))
    if "reduce_scatter_single" in supported:
        dist.reduce_scatter_single(torch.zeros(N), torch.cat([_x(rank, step, 16) + 100 * j for j in range(WORLD)]))


def _cc_expected(rank: int, step: int, pre_hook: bool, supported: set[str]) -> dict[str, torch.Tensor | None]:
    """``"<op>.<call>.<side>.<i>" -> float64 tensor`` (None: the row exists, its value is unspecified)."""

    def x(r: int, k: int) -> torch.Tensor:
        return _x(r, step, k, torch.float64)

    def total(k: int, plus: float = 0.0) -> torch.Tensor:
        return sum(x(q, k) + plus for q in range(WORLD))

    e: dict[str, torch.Tensor | None] = {}

    def op(name: str, ins: list[torch.Tensor], outs: list[torch.Tensor | None]) -> None:
        if pre_hook:
            e.update({f"{name}.in.{i}": t for i, t in enumerate(ins)})
        e.update({f"{name}.out.{i}": t for i, t in enumerate(outs)})

    for i in range(3):
        op(f"all_reduce.{i}", [x(rank, i)], [total(i)])
    op("all_gather.0", [x(rank, 3)], [x(q, 3) for q in range(WORLD)])
    op("all_gather_into_tensor.0", [x(rank, 4)], [torch.cat([x(q, 4) for q in range(WORLD)])])
    op("broadcast.0", [x(rank, 5)], [x(0, 5)])
    op("reduce.0", [x(rank, 6)], [total(6) if rank == 0 else None])
    if "all_to_all" in supported:
        op("all_to_all.0", [x(rank, 7) + 100 * j for j in range(WORLD)], [x(q, 7) + 100 * rank for q in range(WORLD)])
    if "all_to_all_single" in supported:
        op(
            "all_to_all_single.0",
            [torch.cat([x(rank, 8) + 100 * j for j in range(WORLD)])],
            [torch.cat([x(q, 8) + 100 * rank for q in range(WORLD)])],
        )
    if rank == 0:
        e["send.0.in.0"] = x(0, 9)  # no output: always an "in" row
        op("irecv.0", [], [x(1, 10)])
        op("scatter.0", [x(0, 11) + 100 * j for j in range(WORLD)], [x(0, 11)])
        op("gather.0", [x(0, 12)], [x(q, 12) for q in range(WORLD)])
    else:
        op("recv.0", [], [x(0, 9)])
        e["isend.0.in.0"] = x(1, 10)
        op("scatter.0", [], [x(0, 11) + 100])  # scatter_list is None off the source rank
        op("gather.0", [x(1, 12)], [])  # gather_list is None off the destination rank
    if "reduce_scatter" in supported:
        op("reduce_scatter.0", [x(rank, 13) + 100 * j for j in range(WORLD)], [total(13, 100 * rank)])
    if "reduce_scatter_tensor" in supported:
        ins = [torch.cat([x(rank, 14) + 100 * j for j in range(WORLD)])]
        op("reduce_scatter_tensor.0", ins, [total(14, 100 * rank)])
    if "all_gather_single" in supported:
        op("all_gather_single.0", [x(rank, 15)], [torch.cat([x(q, 15) for q in range(WORLD)])])
    if "reduce_scatter_single" in supported:
        ins = [torch.cat([x(rank, 16) + 100 * j for j in range(WORLD)])]
        op("reduce_scatter_single.0", ins, [total(16, 100 * rank)])
    return e


def _filtered_site(t: torch.Tensor) -> None:
    dist.all_reduce(t)


def _other_site(t: torch.Tensor) -> None:
    dist.all_reduce(t)


FILTERED_LINE = _filtered_site.__code__.co_firstlineno + 1


def _patched_state() -> dict[str, list[Any]]:
    """The objects torch.distributed and distributed_c10d hold under each collective's name, and
    the ``wait`` in ``Work``'s own dictionary (replaced while cc runs, for gloo's irecv)."""
    state = {op: [getattr(dist, op, None), getattr(c10d, op, None)] for op in FUNCTIONS}
    state["Work.wait"] = [vars(dist.Work).get("wait")]
    return state


def _same_objects(a: dict[str, list[Any]], b: dict[str, list[Any]]) -> bool:
    return a.keys() == b.keys() and all(x is y for op in a for x, y in zip(a[op], b[op]))


def _manual_steps(body: Any) -> Any:
    """A session body calling ``body(step)`` then ``mon.step()`` for each step (no optimizer)."""

    def run(mon: TrainerMonitorV2) -> None:
        for step in range(STEPS):
            body(step)
            mon.step()

    return run


def _cc_worker(rank: int, root: Path) -> None:
    supported = _gloo_support()
    (root / f"supported_rank{rank}.json").write_text(json.dumps(sorted(supported)))
    originals = _patched_state()
    restored: dict[str, bool] = {}
    patched_during: dict[str, bool] = {}

    def session(name: str, monitors: dict[str, Any], body: Any, **start: Any) -> None:
        _session(root / name, rank, monitors, body, **start)
        restored[name] = _same_objects(_patched_state(), originals)

    def loop(step: int) -> None:
        _cc_loop(rank, step, supported)

    def check_patched(mon: TrainerMonitorV2) -> None:
        now = _patched_state()
        patched_during["all_reduce"] = all(a is not b for a, b in zip(now["all_reduce"], originals["all_reduce"]))
        # every collective this torch has is replaced in both namespaces, by the same wrapper
        patched_during["every_op"] = all(
            (a is not b) == (b is not None) and now[op][0] is now[op][1]
            for op in FUNCTIONS
            for a, b in zip(now[op], originals[op])
        )
        _manual_steps(loop)(mon)

    cc = {"enabled": True, "ops": OPS}
    session("plain", {"cc": cc}, check_patched)
    session("pre_hook", {"cc": {**cc, "cc_pre_hook": True}}, _manual_steps(loop))

    def two_sites(step: int) -> None:
        for k in range(2):
            _other_site(_x(rank, step, 20 + k))
            _filtered_site(_x(rank, step, 30 + k))
        dist.broadcast(_x(rank, step, 40), src=0)

    session("codeline", {"cc": {**cc, "cc_codeline": [f"{THIS_FILE}[{FILTERED_LINE}]"]}}, _manual_steps(two_sites))

    def small(step: int) -> None:
        dist.all_reduce(_x(rank, step, 0))
        dist.broadcast(_x(rank, step, 5), src=0)

    session("module_ranks", {"cc": {**cc, "module_ranks": [1]}}, _manual_steps(small))
    session("legacy", {"cc": {"cc_distribution": {"enable": True, "cc_pre_hook": True}}}, _manual_steps(small))

    # cc_log_only: a real DDP training with the collectives loop inside; prints go to a file
    torch.manual_seed(0)
    model = MLP()
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]

    def train(mon: TrainerMonitorV2) -> None:
        for step in range(STEPS):
            _loss(ddp, _batch(rank, step, 0), 1.0).backward()
            loop(step)
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert mon.current_step == STEPS

    printed = io.StringIO()
    with redirect_stdout(printed):
        session("log_only", {"cc": {"enabled": True, "cc_log_only": True}}, train, optimizer=opt)
    (root / "log_only" / f"stdout_rank{rank}.txt").write_text(printed.getvalue())
    trained = all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    facts = {"patched_during": patched_during, "restored": restored, "trained": trained}
    (root / f"facts_rank{rank}.json").write_text(json.dumps(facts))


@pytest.fixture(scope="module")
def cc_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cc")
    launch(_cc_worker, root)
    return root


def _supported(root: Path) -> set[str]:
    sets = [set(json.loads((root / f"supported_rank{r}.json").read_text())) for r in range(WORLD)]
    assert sets[0] == sets[1]
    return sets[0]


def _split(name: str) -> tuple[str, str, int]:
    """``all_reduce.0.out.0@file.py[12]`` -> ``("all_reduce.0.out.0", "file.py", 12)``."""
    tag, site = name.split("@")
    file, line = site[:-1].split("[")
    return tag, file, int(line)


def _cc_rows(out: Path, rank: int) -> dict[tuple[int, str], dict[str, str]]:
    rows = rows_of(out, "cc", rank)
    got = {(int(r["step"]), r["module_name"]): r for r in rows}
    assert len(got) == len(rows), "duplicate cc rows"
    return got


def _check_cc_values(out: Path, rank: int, pre_hook: bool, supported: set[str]) -> None:
    header, _ = read_csv(out / f"rank_{rank}" / "cc_step0-0.csv")
    assert header == ["vpp_stage", "step", "module_name", "scope", *OPS]
    rows = _cc_rows(out, rank)
    source, first = inspect.getsourcelines(_cc_loop)
    loop_lines = range(first, first + len(source))
    for step in range(STEPS):
        expected = _cc_expected(rank, step, pre_hook, supported)
        here = {_split(name)[0]: row for (s, name), row in rows.items() if s == step}
        assert len(here) == len([s for s, _ in rows if s == step]), "one row per call, side and tensor"
        assert sorted(here) == sorted(expected), f"rank {rank} step {step}"
        sites: dict[str, str] = {}
        for (s, name), row in rows.items():
            if s != step:
                continue
            tag, file, line = _split(name)
            assert (file, row["scope"], row["vpp_stage"]) == (THIS_FILE, "comm", "0"), name
            assert line in loop_lines, name
            call = tag.rsplit(".", 2)[0]  # all_reduce.0
            assert sites.setdefault(call, f"{file}[{line}]") == f"{file}[{line}]", "one call, one site"
        # each call of the loop is its own source line
        assert len(set(sites.values())) == len(sites)
        for tag, t in expected.items():
            if t is not None:
                _assert_stats(here[tag], t, rel=1e-6)


@pytest.mark.parametrize("rank", range(WORLD))
def test_cc_every_gloo_collective_names_sides_indices_values(cc_run: Path, rank: int) -> None:
    _assert_no_probe_errors(cc_run / "plain")
    _check_cc_values(cc_run / "plain", rank, pre_hook=False, supported=_supported(cc_run))


@pytest.mark.parametrize("rank", range(WORLD))
def test_cc_pre_hook_adds_in_rows_with_the_values_before_the_op(cc_run: Path, rank: int) -> None:
    _assert_no_probe_errors(cc_run / "pre_hook")
    _check_cc_values(cc_run / "pre_hook", rank, pre_hook=True, supported=_supported(cc_run))


@pytest.mark.parametrize("op", OPTIONAL_OPS)
def test_cc_optional_collective_is_recorded(cc_run: Path, op: str) -> None:
    if op not in _supported(cc_run):
        pytest.skip(f"torch {torch.__version__}: gloo does not support {op} (or torch has no {op})")
    for rank in range(WORLD):
        names = [name for _, name in _cc_rows(cc_run / "plain", rank)]
        assert any(name.startswith(f"{op}.0.out.0@{THIS_FILE}[") for name in names), (op, rank)


def test_cc_async_all_reduce_is_recorded_at_completion(cc_run: Path) -> None:
    for rank in range(WORLD):
        rows = _cc_rows(cc_run / "plain", rank)
        for step in range(STEPS):
            (row,) = [r for (s, n), r in rows.items() if s == step and n.startswith("all_reduce.2.out.0@")]
            reduced = sum(_x(q, step, 2, torch.float64) for q in range(WORLD))
            _assert_stats(row, reduced, rel=1e-6)  # neither the inputs nor the later * 100


def test_cc_a_collective_calling_another_is_one_call(cc_run: Path) -> None:
    """torch 2.13's all_gather_into_tensor / reduce_scatter_tensor call all_gather_single /
    reduce_scatter_single: only the user's call is recorded, at the user's line."""
    for rank in range(WORLD):
        names = [n for _, n in _cc_rows(cc_run / "plain", rank)]
        assert {_split(n)[1] for n in names} == {THIS_FILE}
        for step in range(STEPS):
            tags = [_split(n)[0] for (s, n) in _cc_rows(cc_run / "plain", rank) if s == step]
            assert tags.count("all_gather_into_tensor.0.out.0") == 1
            assert not [t for t in tags if t.startswith(("all_gather_single.1.", "reduce_scatter_single.1."))]


def test_cc_codeline_keeps_only_that_call_site(cc_run: Path) -> None:
    out = cc_run / "codeline"
    _assert_no_probe_errors(out)
    for rank in range(WORLD):
        rows = _cc_rows(out, rank)
        assert {s for s, _ in rows} == set(range(STEPS))
        for step in range(STEPS):
            here = {n: r for (s, n), r in rows.items() if s == step}
            site = f"@{THIS_FILE}[{FILTERED_LINE}]"
            assert sorted(here) == [f"all_reduce.0.out.0{site}", f"all_reduce.1.out.0{site}"]
            for k in range(2):
                reduced = sum(_x(q, step, 30 + k, torch.float64) for q in range(WORLD))
                _assert_stats(here[f"all_reduce.{k}.out.0{site}"], reduced, rel=1e-6)


def test_cc_module_ranks_only_rank_1_writes(cc_run: Path) -> None:
    out = cc_run / "module_ranks"
    _assert_no_probe_errors(out)
    assert list((out / "rank_0").glob("cc_*.csv")) == []
    rows = _cc_rows(out, 1)
    assert sorted(_split(n)[0] for s, n in rows if s == 0) == ["all_reduce.0.out.0", "broadcast.0.out.0"]


def test_cc_legacy_cc_distribution_form(cc_run: Path) -> None:
    out = cc_run / "legacy"
    _assert_no_probe_errors(out)
    for rank in range(WORLD):
        rows = _cc_rows(out, rank)
        for step in range(STEPS):
            here = {_split(n)[0]: r for (s, n), r in rows.items() if s == step}
            assert sorted(here) == ["all_reduce.0.in.0", "all_reduce.0.out.0", "broadcast.0.in.0", "broadcast.0.out.0"]
            _assert_stats(here["all_reduce.0.in.0"], _x(rank, step, 0, torch.float64), rel=1e-6)
            _assert_stats(here["all_reduce.0.out.0"], sum(_x(q, step, 0, torch.float64) for q in range(WORLD)))
            _assert_stats(here["broadcast.0.in.0"], _x(rank, step, 5, torch.float64), rel=1e-6)
            _assert_stats(here["broadcast.0.out.0"], _x(0, step, 5, torch.float64), rel=1e-6)


def test_cc_log_only_logs_distinct_sites_and_training_completes(cc_run: Path) -> None:
    out = cc_run / "log_only"
    _assert_no_probe_errors(out)
    supported = _supported(cc_run)
    for rank in range(WORLD):
        facts = json.loads((cc_run / f"facts_rank{rank}.json").read_text())
        assert facts["trained"]
        rank_dir = out / f"rank_{rank}"
        assert list(rank_dir.glob("cc_*.csv")) == []
        entries = json.loads((rank_dir / "cc_log.json").read_text())
        sites = [(e["op"], e["codeline"]) for e in entries]
        assert len(sites) == len(set(sites)), "each call site once"
        # the sites are those of one step of _cc_loop (the second step adds none)
        calls = {tag.rsplit(".", 2)[0] for tag in _cc_expected(rank, 0, True, supported)}
        assert sorted(e["op"] for e in entries) == sorted(c.rsplit(".", 1)[0] for c in calls)
        for e in entries:
            assert e["codeline"].startswith(os.path.abspath(__file__) + "["), e["codeline"]
            assert e["dtypes"] == ["torch.float32"]
            assert e["group"] == "world"
            assert all(isinstance(shape, list) for shape in e["shapes"])
            assert THIS_FILE in e["stack"][-1]
        all_reduce = [e for e in entries if e["op"] == "all_reduce"]
        assert len(all_reduce) == 3 and all(e["shapes"] == [[N], [N]] for e in all_reduce)
        printed = (out / f"stdout_rank{rank}.txt").read_text().splitlines()
        assert len([line for line in printed if line.startswith(f"[trainprobe cc rank {rank}] ")]) == len(entries)


def test_cc_stop_restores_the_original_functions(cc_run: Path) -> None:
    for rank in range(WORLD):
        facts = json.loads((cc_run / f"facts_rank{rank}.json").read_text())
        assert facts["patched_during"] == {"all_reduce": True, "every_op": True}
        assert facts["restored"] == dict.fromkeys(
            ["plain", "pre_hook", "codeline", "module_ranks", "legacy", "log_only"], True
        )


@contextmanager
def _world_of_one() -> Iterator[None]:
    """A single-process gloo group (world size 1) for the duration of the block."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1, timeout=timedelta(seconds=30)
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def _cc_monitor(tmp_path: Path) -> TrainerMonitorV2:
    """A started V2 monitor with cc on, writing under ``tmp_path/out``."""
    mon = TrainerMonitorV2(
        write_config(tmp_path, {"output_dir": str(tmp_path / "out"), "monitors": {"cc": {"enabled": True}}})
    )
    mon.start()
    return mon


def test_stop_restores_all_reduce_in_this_process(tmp_path: Path) -> None:
    """Single-process gloo group (world size 1): the exact objects come back after stop()."""
    original = (dist.all_reduce, c10d.all_reduce)
    original_wait = vars(dist.Work)["wait"]
    with _world_of_one():
        mon = _cc_monitor(tmp_path)
        assert dist.all_reduce is not original[0] and c10d.all_reduce is not original[1]
        assert dist.all_reduce is c10d.all_reduce
        t = torch.ones(2)
        dist.all_reduce(t)
        assert vars(dist.Work)["wait"] is not original_wait
        mon.step()
        mon.stop()
        assert dist.all_reduce is original[0] and c10d.all_reduce is original[1]
        assert vars(dist.Work)["wait"] is original_wait
        mon.stop()  # idempotent
        assert dist.all_reduce is original[0] and c10d.all_reduce is original[1]
        assert vars(dist.Work)["wait"] is original_wait
    (row,) = rows_of(tmp_path / "out", "cc", 0)
    assert row["module_name"].startswith("all_reduce.0.out.0@")


def test_a_collective_called_with_wrong_arguments_keeps_the_monitor_on(tmp_path: Path, caplog) -> None:
    """The loop's own TypeError (a bad argument it catches) reaches the loop and leaves the cc
    monitor recording the next calls: it is not a fault of the monitor."""
    with _world_of_one():
        mon = _cc_monitor(tmp_path)
        with pytest.raises(TypeError, match="bogus"):
            dist.all_reduce(torch.ones(2), bogus=1)
        dist.all_reduce(torch.full((2,), 3.0))
        mon.step()
        mon.stop()
    assert "disabled" not in caplog.text
    (row,) = rows_of(tmp_path / "out", "cc", 0)
    assert row["module_name"].startswith("all_reduce.0.out.0@") and float(row["max"]) == 3.0


# ==============================================================================================
# FSDP on CPU / gloo
# ==============================================================================================
def _fsdp_worker(rank: int, root: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    monitors = {"weight_grad": {"enabled": True, "ops": OPS}, "cc": {"enabled": True, "ops": OPS}}

    # FSDP2: fully_shard on a CPU device mesh
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model).double()
    mesh = init_device_mesh("cpu", (WORLD,))
    fully_shard(model.fc1, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train(mon: TrainerMonitorV2) -> None:
        for step in range(STEPS):
            x = _batch(rank, step, 0)
            if step == 0:  # the parameters are still the initial ones: the float64 reference holds
                grads = torch.autograd.grad(_loss(ref, x.double(), 1.0), list(ref.parameters()))
                local = {n: g for (n, _), g in zip(ref.named_parameters(), grads)}
                torch.save(local, root / f"fsdp2_local_rank{rank}.pt")
            _loss(model, x, 1.0).backward()
            opt.step()
            opt.zero_grad()

    _session(root / "fsdp2", rank, monitors, train, model=model, optimizer=opt)

    # FSDP1: FullyShardedDataParallel needs device_id=cpu to run without an accelerator
    torch.manual_seed(0)
    model1 = FullyShardedDataParallel(MLP(), use_orig_params=True, device_id=torch.device("cpu"))
    opt1 = torch.optim.SGD(model1.parameters(), lr=0.1)

    def train1(mon: TrainerMonitorV2) -> None:
        for step in range(STEPS):
            _loss(model1, _batch(rank, step, 0), 1.0).backward()
            opt1.step()
            opt1.zero_grad()

    _session(root / "fsdp1", rank, monitors, train1, model=model1, optimizer=opt1)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fsdp")
    launch(_fsdp_worker, root)
    return root


def _finite(row: dict[str, str]) -> bool:
    return all(math.isfinite(float(row[op])) for op in OPS) and row["nans"] == "0"


def test_fsdp2_reduced_rows_are_this_ranks_shard_of_the_average(fsdp_run: Path) -> None:
    out = fsdp_run / "fsdp2"
    _assert_no_probe_errors(out)
    local = [torch.load(fsdp_run / f"fsdp2_local_rank{r}.pt") for r in range(WORLD)]
    for rank in range(WORLD):
        rows = [r for r in rows_of(out, "weight_grad", rank) if r["scope"] == "reduced"]
        assert sorted((int(r["step"]), r["module_name"]) for r in rows) == sorted(
            (s, n) for s in range(STEPS) for n in PARAMS
        )
        assert all(_finite(r) and r["micro_step"] == "1" for r in rows)
        for row in rows:
            if row["step"] == "0":  # .grad is a DTensor: its statistics are of the local shard
                average = sum(local[q][row["module_name"]] for q in range(WORLD)) / WORLD
                _assert_stats(row, torch.chunk(average, WORLD, dim=0)[rank])


def test_fsdp2_unreduced_rows_are_this_ranks_full_local_gradient(fsdp_run: Path) -> None:
    """Under FSDP2, unreduced = the gradient of the unsharded parameter before reduce-scatter."""
    local = [torch.load(fsdp_run / f"fsdp2_local_rank{r}.pt") for r in range(WORLD)]
    for rank in range(WORLD):
        rows = [r for r in rows_of(fsdp_run / "fsdp2", "weight_grad", rank) if r["scope"] == "unreduced"]
        assert sorted((int(r["step"]), r["module_name"]) for r in rows) == sorted(
            (s, n) for s in range(STEPS) for n in PARAMS
        )
        for row in rows:
            assert row["micro_step"] == "1"
            if row["step"] == "0":
                _assert_stats(row, local[rank][row["module_name"]])


def test_fsdp2_collectives_are_recorded(fsdp_run: Path) -> None:
    for rank in range(WORLD):
        rows = rows_of(fsdp_run / "fsdp2", "cc", rank)
        ops = {r["module_name"].split(".")[0] for r in rows}
        # torch >= 2.13 names; older FSDP2 called all_gather_into_tensor / reduce_scatter_tensor
        assert ops & {"all_gather_single", "all_gather_into_tensor"}, ops
        assert ops & {"reduce_scatter_single", "reduce_scatter_tensor"}, ops
        assert all(_finite(r) for r in rows)


def test_fsdp1_reduced_rows_exist_and_are_finite(fsdp_run: Path) -> None:
    out = fsdp_run / "fsdp1"
    _assert_no_probe_errors(out)
    seen = set()
    for rank in range(WORLD):
        rows = [r for r in rows_of(out, "weight_grad", rank) if r["scope"] == "reduced"]
        assert rows and all(_finite(r) for r in rows)
        assert {r["step"] for r in rows} == {str(s) for s in range(STEPS)}
        seen |= {r["module_name"] for r in rows}
        cc_ops = {r["module_name"].split(".")[0] for r in rows_of(out, "cc", rank)}
        # on CPU FSDP1 all-gathers with all_gather; reduce_scatter_single is torch >= 2.13's name
        assert "all_gather" in cc_ops and cc_ops & {"reduce_scatter_single", "reduce_scatter_tensor"}, cc_ops
    # use_orig_params: a rank only has .grad for the parameters its flat shard overlaps
    assert seen == {f"_fsdp_wrapped_module.{n}" for n in PARAMS}
