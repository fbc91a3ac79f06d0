"""The ``cc`` monitor at step boundaries, on two real gloo processes: a collective issued after
``optimizer.step()`` (a logging ``all_reduce`` of the loss) belongs to the step that trained, no
``cc`` file appears for a step that never trained, and DDP's bucket all-reduce is recorded
through a comm hook (``ddp_comm_hook``) without changing a bit of training.

One pair of spawned processes runs every scenario (a module-scoped fixture, with the launch
helpers of ``test_distributed_v2``); the tests read the CSVs and the tensors the workers saved.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from conftest import read_csv, rows_of, write_config
from models import MLP
from test_distributed_v2 import (
    OPS,
    WORLD,
    _assert_no_probe_errors,
    _assert_stats,
    _batch,
    _ErrorLog,
    _free_port,
    _loss,
    _world_of_one,
    launch,
)
from trainprobe import ConfigError, TrainerMonitorV2

THIS_FILE = os.path.basename(__file__)
STEPS = 3

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)


@contextmanager
def _errors(out: Path, rank: int) -> Iterator[None]:
    """Save the trainprobe errors logged in the block to ``out/errors_rank<r>.json``."""
    errors = _ErrorLog()
    logging.getLogger("trainprobe").addHandler(errors)
    try:
        yield
    finally:
        logging.getLogger("trainprobe").removeHandler(errors)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"errors_rank{rank}.json").write_text(json.dumps(errors.messages))


def _config(out: Path, cc: dict[str, Any], **top: Any) -> Path:
    cfg = {"output_dir": str(out), "monitors": {"cc": {"enabled": True, "ops": OPS, **cc}}, **top}
    return write_config(out.parent, cfg, name=f"{out.name}_rank{dist.get_rank()}.json")


def _train_with_logging(rank: int, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> list[float]:
    """``steps`` optimizer steps, each followed by the usual logging all-reduce of the loss;
    returns the logged (summed) losses."""
    logged = []
    for step in range(steps):
        loss = _loss(model, _batch(rank, step, 0), 1.0)
        loss.backward()
        dist.all_reduce(torch.full((2,), float(step)))  # inside the step, before optimizer.step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        reported = loss.detach().clone()
        dist.all_reduce(reported)  # after optimizer.step(): belongs to the step that just trained
        logged.append(reported.item())
    return logged


def _line_of(fn: Any, text: str) -> int:
    """The file line of the one line of ``fn``'s source holding ``text``."""
    lines, first = inspect.getsourcelines(fn)
    (index,) = [i for i, line in enumerate(lines) if text in line]
    return first + index


INNER_LINE = _line_of(_train_with_logging, "# inside the step")
LOGGING_LINE = _line_of(_train_with_logging, "# after optimizer.step()")


def _trailing_case(rank: int, root: Path, name: str, **top: Any) -> None:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = root / name
    original = dist.all_reduce
    with _errors(out, rank):
        mon = TrainerMonitorV2(_config(out, {}, **top))
        mon.start(model=model, optimizer=opt)
        logged = _train_with_logging(rank, model, opt, STEPS)
        restored_before_stop = dist.all_reduce is original
        mon.stop()
    (out / f"logged_rank{rank}.json").write_text(json.dumps({"logged": logged, "restored": restored_before_stop}))


def _ddp_train(rank: int, ddp: DDP, opt: torch.optim.Optimizer, steps: range) -> list[list[torch.Tensor]]:
    """Train ``steps``; returns each step's gradients (after DDP's all-reduce)."""
    grads = []
    for step in steps:
        _loss(ddp, _batch(rank, step, 0), 1.0).backward()
        grads.append([p.grad.detach().clone() for p in ddp.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return grads


def _ddp_case(rank: int, root: Path) -> None:
    """The same DDP training without a monitor, and with cc + ddp_comm_hook (3 steps monitored,
    1 more after stop(): the hook stays registered and must still be exact, then 1 under a second
    monitor, which reuses it); then a DDP that has its own comm hook."""
    runs = {}
    for monitored in (False, True):
        torch.manual_seed(0)
        model = MLP()
        ddp = DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        local = copy.deepcopy(model).double()
        if monitored:
            out = root / "ddp"
            with _errors(out, rank):
                mon = TrainerMonitorV2(_config(out, {"ddp_comm_hook": True, "cc_pre_hook": True}))
                mon.start(model=ddp, optimizer=opt)
                # this rank's own gradient at the initial weights, for the "in" row of step 0
                x = _batch(rank, 0, 0)
                g = torch.autograd.grad(_loss(local, x.double(), 1.0), list(local.parameters()))
                torch.save(torch.cat([t.flatten() for t in g]), out / f"local_rank{rank}.pt")
                grads = _ddp_train(rank, ddp, opt, range(STEPS))
                mon.stop()
            grads += _ddp_train(rank, ddp, opt, range(STEPS, STEPS + 1))
            again = root / "ddp_again"
            with _errors(again, rank):
                mon = TrainerMonitorV2(_config(again, {"ddp_comm_hook": True}))
                mon.start(model=ddp, optimizer=opt)
                grads += _ddp_train(rank, ddp, opt, range(STEPS + 1, STEPS + 2))
                mon.stop()
            torch.save([torch.cat([t.flatten() for t in step]) for step in grads], out / f"grads_rank{rank}.pt")
        else:
            grads = _ddp_train(rank, ddp, opt, range(STEPS + 2))
        runs[monitored] = (grads, [p.detach().clone() for p in model.parameters()])
    same = all(
        torch.equal(a, b) for step_a, step_b in zip(runs[False][0], runs[True][0]) for a, b in zip(step_a, step_b)
    ) and all(torch.equal(a, b) for a, b in zip(runs[False][1], runs[True][1]))
    (root / "ddp" / f"bitwise_rank{rank}.json").write_text(json.dumps(same))

    own = DDP(MLP())
    own.register_comm_hook(None, allreduce_hook)
    mon = TrainerMonitorV2(_config(root / "ddp_own_hook", {"ddp_comm_hook": True}))
    try:
        mon.start(model=own, optimizer=torch.optim.SGD(own.parameters(), lr=0.1))
        refused = ""
    except ConfigError as exc:
        refused = str(exc)
    (root / f"own_hook_rank{rank}.txt").write_text(refused)


def _worker(rank: int, root: Path) -> None:
    _trailing_case(rank, root, "trailing")
    # the schedule's last collected step is step 1 (stop_step 2): its trailing call still counts
    _trailing_case(rank, root, "finished", stop_step=2)
    _ddp_case(rank, root)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cc_steps")
    launch(_worker, root)
    return root


def _by_step(out: Path, rank: int) -> dict[int, dict[str, dict[str, str]]]:
    steps: dict[int, dict[str, dict[str, str]]] = {}
    for row in rows_of(out, "cc", rank):
        steps.setdefault(int(row["step"]), {})[row["module_name"]] = row
    return steps


@pytest.mark.parametrize("case,trained", [("trailing", STEPS), ("finished", 2)])
def test_an_all_reduce_after_optimizer_step_belongs_to_the_step_that_trained(
    run: Path, case: str, trained: int
) -> None:
    out = run / case
    _assert_no_probe_errors(out)
    inner, logging_ = f"@{THIS_FILE}[{INNER_LINE}]", f"@{THIS_FILE}[{LOGGING_LINE}]"
    for rank in range(WORLD):
        facts = json.loads((out / f"logged_rank{rank}.json").read_text())
        steps = _by_step(out, rank)
        assert sorted(steps) == list(range(trained)), f"rank {rank}: a cc row for a step that never trained"
        for step in range(trained):
            assert sorted(steps[step]) == [f"all_reduce.0.out.0{inner}", f"all_reduce.1.out.0{logging_}"], step
            _assert_stats(steps[step][f"all_reduce.0.out.0{inner}"], torch.full((2,), 2.0 * step))
            _assert_stats(steps[step][f"all_reduce.1.out.0{logging_}"], torch.tensor(facts["logged"][step]))
        files = sorted(p.name for p in (out / f"rank_{rank}").glob("cc_*.csv"))
        assert files == [f"cc_step{s}-{s}.csv" for s in range(trained)]


def test_a_finished_schedule_still_detaches(run: Path) -> None:
    """stop_step 2: the monitor lets go of torch.distributed once step 1's tail is written (at
    step 2's first forward), before stop()."""
    for rank in range(WORLD):
        assert json.loads((run / "finished" / f"logged_rank{rank}.json").read_text())["restored"]
        assert not json.loads((run / "trailing" / f"logged_rank{rank}.json").read_text())["restored"]


def test_ddp_comm_hook_records_each_bucket_per_step(run: Path) -> None:
    out = run / "ddp"
    _assert_no_probe_errors(out)
    for rank in range(WORLD):
        header, _ = read_csv(out / f"rank_{rank}" / "cc_step0-0.csv")
        assert header == ["vpp_stage", "step", "module_name", "scope", *OPS]
        steps = _by_step(out, rank)
        assert sorted(steps) == list(range(STEPS))  # not the step trained after stop()
        grads = torch.load(out / f"grads_rank{rank}.pt")
        local = torch.load(out / f"local_rank{rank}.pt")
        for step in range(STEPS):
            # the MLP's gradients fit one bucket: one all_reduce per step, in and out
            assert sorted(steps[step]) == ["all_reduce.0.in.0@ddp.bucket_0", "all_reduce.0.out.0@ddp.bucket_0"]
            row = steps[step]["all_reduce.0.out.0@ddp.bucket_0"]
            assert row["scope"] == "comm" and row["vpp_stage"] == "0"
            _assert_stats(row, grads[step])  # the averaged gradients (order-free statistics)
        _assert_stats(steps[0]["all_reduce.0.in.0@ddp.bucket_0"], local)  # this rank's own, before averaging


def test_ddp_comm_hook_leaves_gradients_and_parameters_bitwise_unchanged(run: Path) -> None:
    for rank in range(WORLD):
        assert json.loads((run / "ddp" / f"bitwise_rank{rank}.json").read_text()) is True


def test_ddp_comm_hook_is_reused_by_a_later_monitor(run: Path) -> None:
    out = run / "ddp_again"
    _assert_no_probe_errors(out)
    for rank in range(WORLD):
        assert sorted(_by_step(out, rank)[0]) == ["all_reduce.0.out.0@ddp.bucket_0"]


def test_ddp_comm_hook_refuses_a_model_with_its_own_hook(run: Path) -> None:
    for rank in range(WORLD):
        message = (run / f"own_hook_rank{rank}.txt").read_text()
        assert message.startswith("monitors.cc.ddp_comm_hook: this DistributedDataParallel already has a comm hook")


def test_ddp_comm_hook_must_be_a_boolean(tmp_path: Path) -> None:
    cfg = {"output_dir": str(tmp_path / "out"), "monitors": {"cc": {"enabled": True, "ddp_comm_hook": "yes"}}}
    with pytest.raises(ConfigError, match=r"monitors\.cc\.ddp_comm_hook"):
        TrainerMonitorV2(write_config(tmp_path, cfg))


def test_ddp_comm_hook_without_a_ddp_model_fails_at_start(tmp_path: Path) -> None:
    cfg = {"output_dir": str(tmp_path / "out"), "monitors": {"cc": {"enabled": True, "ddp_comm_hook": True}}}
    model = MLP()
    original = dist.all_reduce
    with _world_of_one():
        mon = TrainerMonitorV2(write_config(tmp_path, cfg))
        with pytest.raises(ConfigError, match=r"monitors\.cc\.ddp_comm_hook: needs the DistributedDataParallel"):
            mon.start(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        assert dist.all_reduce is original  # nothing left patched


def _one_rank_monitor(tmp_path: Path, **top: Any) -> TrainerMonitorV2:
    cfg = {"output_dir": str(tmp_path / "out"), "async_write": False, "monitors": {"cc": {"enabled": True}}, **top}
    return TrainerMonitorV2(write_config(tmp_path, cfg))


def test_a_steps_trailing_rows_are_in_its_file_once_the_next_forward_ran(tmp_path: Path) -> None:
    """Before stop(): step 0's file holds its trailing all-reduce as soon as step 1's forward
    started (what a process killed later leaves), and step 1 has no file yet."""
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rank_dir = tmp_path / "out" / "rank_0"
    with _world_of_one():
        mon = _one_rank_monitor(tmp_path)
        mon.start(model=model, optimizer=opt)
        model(torch.ones(2, 6)).sum().backward()
        opt.step()
        dist.all_reduce(torch.full((2,), 7.0))  # trailing: step 0
        assert sorted(p.name for p in rank_dir.glob("cc_*.csv")) == []  # the tail is still open
        loss = model(torch.ones(2, 6)).sum()  # step 1 starts: step 0's rows are written
        (row,) = rows_of(tmp_path / "out", "cc", 0)
        assert (row["step"], row["module_name"].split("@")[0], float(row["max"])) == ("0", "all_reduce.0.out.0", 7.0)
        loss.backward()
        opt.step()
        mon.stop()
    assert sorted(p.name for p in rank_dir.glob("cc_*.csv")) == ["cc_step0-0.csv"]


def test_a_loop_without_module_forward_falls_back_to_the_running_step(tmp_path: Path, caplog) -> None:
    """No nn.Module runs: step 0's tail ends at step 1's optimizer.step() (holding step 1's
    call too), then a collective counts in the step running when it is issued."""
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    with _world_of_one(), caplog.at_level(logging.DEBUG, logger="trainprobe"):
        mon = _one_rank_monitor(tmp_path)
        mon.start(optimizer=opt)
        for step in range(3):
            (w * 2).sum().backward()
            dist.all_reduce(torch.full((1,), float(step)))
            opt.step()
            opt.zero_grad()
        mon.stop()
    rows = [(int(r["step"]), float(r["max"])) for r in rows_of(tmp_path / "out", "cc", 0)]
    assert rows == [(0, 0.0), (0, 1.0), (2, 2.0)]
    assert "saw no nn.Module forward between two optimizer steps" in caplog.text


# -- bitwise on three ranks: 1/3 is where multiplying by the reciprocal and dividing differ --------
BITWISE_CASES = [  # (dtype, gradient_as_bucket_view, zero_grad(set_to_none))
    ("float32", False, True),
    ("float32", True, True),
    ("float32", True, False),
    ("bfloat16", True, False),
]


def _three_rank_entry(rank: int, port: int, root: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    try:
        same = [_bitwise_case(rank, root, *case) for case in BITWISE_CASES]
        (root / f"bitwise3_rank{rank}.json").write_text(json.dumps(same))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _bitwise_case(rank: int, root: Path, dtype: str, bucket_view: bool, set_to_none: bool) -> bool:
    """Gradient accumulation (no_sync) over several small buckets, with and without the hook."""
    grads: dict[bool, list[torch.Tensor]] = {}
    for monitored in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
        model = model.to(getattr(torch, dtype))
        ddp = DDP(model, gradient_as_bucket_view=bucket_view, bucket_cap_mb=0.002)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        mon = TrainerMonitorV2(_config(root / f"b3_{dtype}_{bucket_view}_{set_to_none}", {"ddp_comm_hook": True}))
        if monitored:
            mon.start(model=ddp, optimizer=opt)
        seen = grads.setdefault(monitored, [])
        for step in range(3):
            for micro in range(2):
                x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * rank + 10 * step + micro))
                with ddp.no_sync() if micro == 0 else contextlib.nullcontext():
                    ddp(x.to(model[0].weight.dtype)).float().pow(2).mean().backward()
            seen += [p.grad.clone() for p in ddp.parameters()]
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
        mon.stop()
        seen += [p.detach().clone() for p in ddp.parameters()]
    return all(torch.equal(a, b) for a, b in zip(grads[False], grads[True]))


def test_ddp_comm_hook_is_bitwise_on_three_ranks(tmp_path: Path) -> None:
    """DDP's reducer multiplies a copied gradient by 1/3 and divides one already in a bucket view
    by 3; the hook does the same per gradient (torch's own allreduce_hook, dividing all, differs
    in the last bit of float32 gradients here)."""
    ctx = mp.spawn(_three_rank_entry, args=(_free_port(), tmp_path), nprocs=3, join=False)
    deadline = time.monotonic() + 180
    while not ctx.join(timeout=1.0):  # raises when a rank failed
        if time.monotonic() > deadline:
            for process in ctx.processes:
                if process.is_alive():
                    process.kill()
            pytest.fail("the three ranks did not finish within 180s")
    for rank in range(3):
        assert json.loads((tmp_path / f"bitwise3_rank{rank}.json").read_text()) == [True] * len(BITWISE_CASES)


def test_a_window_file_ends_at_the_last_trained_step(tmp_path: Path) -> None:
    """step_count_per_record 10, three steps each followed by a logging all-reduce: one file,
    named by its whole window (0-9, as the reference), holding steps 0-2 only (no row for step 3,
    which never trained)."""
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with _world_of_one():
        mon = _one_rank_monitor(tmp_path, step_count_per_record=10)
        mon.start(model=model, optimizer=opt)
        for step in range(3):
            model(torch.ones(2, 6)).sum().backward()
            opt.step()
            opt.zero_grad()
            dist.all_reduce(torch.full((1,), float(step)))
        mon.stop()
    rank_dir = tmp_path / "out" / "rank_0"
    assert sorted(p.name for p in rank_dir.glob("cc_*.csv")) == ["cc_step0-9.csv"]
    rows = [(int(r["step"]), float(r["max"])) for r in rows_of(tmp_path / "out", "cc", 0)]
    assert rows == [(0, 0.0), (1, 1.0), (2, 2.0)]
