"""The ``cc`` monitor's wrappers of ``torch.distributed`` on two real gloo processes: asynchronous
point-to-point calls recorded when the loop's ``wait()`` returns, ``cc_codeline`` matching at a
path component boundary, two monitors sharing one set of wrappers (restored exactly whatever
order they stop in), and the stack ``cc_log_only`` prints.

One pair of spawned processes runs every scenario (a module-scoped fixture, with the launch
helpers of ``test_distributed_v2``); the tests read the CSVs and the facts the workers saved.
"""

from __future__ import annotations

import importlib.util
import inspect
import io
import json
import os
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from conftest import rows_of
from test_distributed_v2 import OPS, WORLD, _assert_no_probe_errors, _assert_stats, _monitor, _session, launch
from trainprobe.engine.probes.collectives import FUNCTIONS, codeline_matches

THIS_FILE = os.path.basename(__file__)
N = 3
SITE_SOURCE = "import torch.distributed as dist\n\ndef sync(t):\n    dist.all_reduce(t)\n"
SITE_LINE = 4  # the all_reduce line of SITE_SOURCE

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)


def _torch_state() -> dict[str, Any]:
    """Every object the cc monitor may replace: each collective in both namespaces and the
    ``wait`` of ``Work``'s own dictionary."""
    state: dict[str, Any] = {f"{ns.__name__}.{op}": getattr(ns, op, None) for op in FUNCTIONS for ns in (dist, c10d)}
    state["Work.wait"] = vars(dist.Work).get("wait")
    return state


def _unchanged(now: dict[str, Any], before: dict[str, Any]) -> bool:
    return now.keys() == before.keys() and all(now[k] is before[k] for k in now)


def _line_of(fn: Any, text: str) -> int:
    """The line number of the first line of ``fn``'s source containing ``text``."""
    source, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(source) if text in line)


def _value(step: int, k: int) -> float:
    return 10.0 * step + k + 0.5


# -- scenarios (every call site of the rows lives in this file) -----------------------------------
def _p2p_step(rank: int, step: int, facts: dict[str, Any]) -> tuple[Any, torch.Tensor] | None:
    """Rank 0 sends three tensors; rank 1 receives them asynchronously and reuses each buffer,
    and returns the third receive, which the loop waits for only after the step boundary."""
    if rank == 0:
        dist.isend(torch.full((N,), _value(step, 1)), 1).wait()
        dist.isend(torch.full((N,), _value(step, 2)), 1).wait()
        dist.send(torch.full((N,), _value(step, 3)), 1)
        return None
    buf = torch.zeros(N)
    work = dist.irecv(buf, 0)
    facts["irecv_type_is_work"] = type(work) is dist.Work
    work.wait()
    buf.fill_(-1.0)  # reused once the receive completed: the row shows what was received
    buf2 = torch.zeros(N)
    works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, buf2, 0)])
    facts["batch_types_are_work"] = [type(w) is dist.Work for w in works]
    for w in works:
        w.wait()
    buf2.fill_(-2.0)
    buf3 = torch.zeros(N)
    return dist.irecv(buf3, 0), buf3


def _load_site(folder: Path, file_name: str) -> Any:
    """A module ``<folder>/<file_name>`` whose ``sync(t)`` all-reduces ``t`` at line SITE_LINE."""
    path = folder / file_name
    spec = importlib.util.spec_from_file_location(f"cc_site_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _logged_call(t: torch.Tensor) -> None:
    dist.all_reduce(t)  # LOGGED: the innermost frame of the printed stack


LOGGED_LINE = _logged_call.__code__.co_firstlineno + 1


def _two_monitors(rank: int, root: Path, order: str, facts: dict[str, Any]) -> None:
    """Monitors ``a`` and ``b`` (both cc) started a then b, stopped in ``order``."""
    originals = _torch_state()
    cc = {"cc": {"enabled": True, "ops": OPS}}
    a = _monitor(root / order / "a", cc)
    b = _monitor(root / order / "b", cc)
    a.start()
    b.start()
    dist.all_reduce(torch.full((N,), 1.0 + rank))  # both record it
    first, second = (a, b) if order == "start_order" else (b, a)
    first.stop()
    facts[f"{order}_after_first"] = _unchanged(_torch_state(), originals)
    dist.all_reduce(torch.full((N,), 10.0 + rank))  # only the monitor still running records it
    second.step()
    second.stop()
    facts[f"{order}_after_second"] = _unchanged(_torch_state(), originals)
    first.stop()  # idempotent, changes nothing
    second.stop()
    facts[f"{order}_after_stop_again"] = _unchanged(_torch_state(), originals)


def _cc_patch_worker(rank: int, root: Path) -> None:
    facts: dict[str, Any] = {}
    originals = _torch_state()

    def p2p(mon: Any) -> None:
        for step in range(2):
            late = _p2p_step(rank, step, facts)
            mon.step()
            if late is not None:  # the monitor must not have waited first: a second wait would hang
                work, buf = late
                work.wait()
                facts.setdefault("late", []).append(buf.tolist())
                buf.fill_(-3.0)

    _session(root / "p2p", rank, {"cc": {"enabled": True, "ops": OPS}}, p2p)
    facts["p2p_restored"] = _unchanged(_torch_state(), originals)

    unwaited: list[tuple[Any, torch.Tensor]] = []

    def stop_mid_step(mon: Any) -> None:  # no mon.step(): stop() comes inside step 0
        if rank == 0:
            dist.send(torch.full((N,), 7.5), 1)
        else:
            buf = torch.zeros(N)
            unwaited.append((dist.irecv(buf, 0), buf))  # not waited for while monitored

    _session(root / "mid_step", rank, {"cc": {"enabled": True, "ops": OPS}}, stop_mid_step)
    for work, buf in unwaited:  # the loop waits after stop(): it gets its message, no hang
        work.wait()
        facts["mid_step_value"] = buf.tolist()

    train, pretrain = (_load_site(root / "sites", name) for name in ("train.py", "pretrain.py"))

    def sites(mon: Any) -> None:
        train.sync(torch.full((N,), 1.0 + rank))
        pretrain.sync(torch.full((N,), 100.0 + rank))
        mon.step()

    _session(
        root / "codeline", rank, {"cc": {"enabled": True, "ops": OPS, "cc_codeline": [f"train.py[{SITE_LINE}]"]}}, sites
    )

    for order in ("start_order", "reverse_order"):
        _two_monitors(rank, root, order, facts)

    def logged(mon: Any) -> None:
        _logged_call(torch.ones(N))
        _logged_call(torch.ones(N))  # the same site: printed once
        mon.step()

    printed = io.StringIO()
    with redirect_stdout(printed):
        _session(root / "log_only", rank, {"cc": {"enabled": True, "cc_log_only": True}}, logged)
    (root / f"log_only_stdout_rank{rank}.txt").write_text(printed.getvalue())
    (root / f"facts_rank{rank}.json").write_text(json.dumps(facts))


@pytest.fixture(scope="module")
def patch_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cc_patch")
    (root / "sites").mkdir()
    for name in ("train.py", "pretrain.py"):
        (root / "sites" / name).write_text(SITE_SOURCE)
    launch(_cc_patch_worker, root)
    return root


def _facts(root: Path, rank: int) -> dict[str, Any]:
    return json.loads((root / f"facts_rank{rank}.json").read_text())


def _tags(rows: list[dict[str, str]], step: int) -> dict[str, dict[str, str]]:
    """``<op>.<call>.<side>.<i>`` -> row, for one step."""
    here = {r["module_name"].split("@")[0]: r for r in rows if r["step"] == str(step)}
    assert len(here) == len([r for r in rows if r["step"] == str(step)]), "duplicate rows"
    return here


# -- asynchronous point-to-point -------------------------------------------------------------------
def test_cc_irecv_is_recorded_when_wait_returns_not_after_the_buffer_is_reused(patch_run: Path) -> None:
    out = patch_run / "p2p"
    _assert_no_probe_errors(out)
    rows = rows_of(out, "cc", 1)
    for step in range(3):
        here = _tags(rows, step)
        mine = ["irecv.0.out.0", "irecv.1.out.0"] if step < 2 else []
        late = ["irecv.2.out.0"] if step > 0 else []  # the previous step's, waited after its end
        assert sorted(here) == mine + late
        for k in range(2 if step < 2 else 0):  # dist.irecv + wait, batch_isend_irecv + wait
            _assert_stats(here[f"irecv.{k}.out.0"], torch.full((N,), _value(step, k + 1), dtype=torch.float64))
        if late:  # recorded when the loop waited, in the step running then
            _assert_stats(here["irecv.2.out.0"], torch.full((N,), _value(step - 1, 3), dtype=torch.float64))
    assert _facts(patch_run, 1)["late"] == [[_value(s, 3)] * N for s in range(2)]
    # the row names the loop's line, though it is written later, when wait() returns
    irecv_line = _line_of(_p2p_step, "work = dist.irecv(buf, 0)")
    sites = {r["module_name"].split("@")[1] for r in rows if r["module_name"].startswith("irecv.0.")}
    assert sites == {f"{THIS_FILE}[{irecv_line}]"}


def test_cc_stop_inside_a_step_never_waits_on_the_loops_behalf(patch_run: Path) -> None:
    """stop() in the middle of a step whose only call is an irecv nobody waited for yet: the
    monitor does not wait for it (a second wait() on a gloo receive would block the loop), so
    there is no row, and the loop's own later wait() gets the message."""
    out = patch_run / "mid_step"
    _assert_no_probe_errors(out)
    assert rows_of(out, "cc", 1) == []
    assert _facts(patch_run, 1)["mid_step_value"] == [7.5] * N


def test_cc_isend_rows_and_the_returned_works_are_torchs_own(patch_run: Path) -> None:
    rows = rows_of(patch_run / "p2p", "cc", 0)
    for step in range(2):
        here = _tags(rows, step)
        assert sorted(here) == ["isend.0.in.0", "isend.1.in.0", "send.0.in.0"]
        _assert_stats(here["isend.0.in.0"], torch.full((N,), _value(step, 1), dtype=torch.float64))
    facts = _facts(patch_run, 1)
    # the loop gets the Work torch made, not a stand-in: type checks and torch's own calls hold
    assert facts["irecv_type_is_work"] is True
    assert facts["batch_types_are_work"] == [True]
    assert all(_facts(patch_run, r)["p2p_restored"] for r in range(WORLD))


# -- cc_codeline -----------------------------------------------------------------------------------
def test_cc_codeline_matches_at_a_path_component_boundary(patch_run: Path) -> None:
    out = patch_run / "codeline"
    _assert_no_probe_errors(out)
    for rank in range(WORLD):
        rows = rows_of(out, "cc", rank)
        assert [r["module_name"] for r in rows] == [f"all_reduce.0.out.0@train.py[{SITE_LINE}]"]
        _assert_stats(rows[0], sum(torch.full((N,), 1.0 + q, dtype=torch.float64) for q in range(WORLD)))


@pytest.mark.parametrize(
    ("site", "line", "selected"),
    [
        ("/src/train.py[3]", "train.py[3]", True),
        ("/src/pretrain.py[3]", "train.py[3]", False),
        ("/src/train.py[33]", "train.py[3]", False),
        ("/src/train.py[3]", "src/train.py[3]", True),
        ("/src/train.py[3]", "/src/train.py[3]", True),
        ("/src/train.py[3]", "rc/train.py[3]", False),
        ("/src/train.py[3]", "/train.py[3]", True),
        ("train.py[3]", "train.py[3]", True),
        ("C:\\work\\train.py[3]", "train.py[3]", True),
        ("C:\\work\\pretrain.py[3]", "train.py[3]", False),
        ("/src/train.py[3]", "", False),
    ],
)
def test_codeline_matches(site: str, line: str, selected: bool) -> None:
    assert codeline_matches(site, line) is selected


# -- two monitors ----------------------------------------------------------------------------------
@pytest.mark.parametrize("order", ["start_order", "reverse_order"])
def test_cc_two_monitors_share_the_wrappers_and_restore_torch_exactly(patch_run: Path, order: str) -> None:
    first, second = ("a", "b") if order == "start_order" else ("b", "a")
    for rank in range(WORLD):
        facts = _facts(patch_run, rank)
        assert facts[f"{order}_after_second"] is True
        assert facts[f"{order}_after_stop_again"] is True
        assert facts[f"{order}_after_first"] is False  # the other monitor still listens
        # both saw the first call; only the one still running saw the second
        reduced = [sum(torch.full((N,), base + q, dtype=torch.float64) for q in range(WORLD)) for base in (1.0, 10.0)]
        rows = rows_of(patch_run / order / first, "cc", rank)
        assert [r["module_name"].split("@")[0] for r in rows] == ["all_reduce.0.out.0"]
        _assert_stats(rows[0], reduced[0])
        rows = rows_of(patch_run / order / second, "cc", rank)
        assert [r["module_name"].split("@")[0] for r in rows] == ["all_reduce.0.out.0", "all_reduce.1.out.0"]
        for row, t in zip(rows, reduced):
            _assert_stats(row, t)


# -- cc_log_only -----------------------------------------------------------------------------------
def test_cc_log_only_prints_the_stack_innermost_frame_last(patch_run: Path) -> None:
    _assert_no_probe_errors(patch_run / "log_only")
    here = os.path.abspath(__file__)
    for rank in range(WORLD):
        printed = (patch_run / f"log_only_stdout_rank{rank}.txt").read_text().splitlines()
        heads = [i for i, line in enumerate(printed) if line.startswith(f"[trainprobe cc rank {rank}] ")]
        assert len(heads) == 1, printed  # one call site, printed once
        head = printed[heads[0]]
        assert head.startswith(f"[trainprobe cc rank {rank}] all_reduce at {here}[{LOGGED_LINE}] ")
        assert "dtypes=['torch.float32']" in head and "shapes=[[3], [3]]" in head and "group=world" in head
        stack = []
        for line in printed[heads[0] + 1 :]:
            if not line.startswith("    "):
                break
            stack.append(line)
        assert 2 <= len(stack) <= 12, printed
        assert stack[-1].startswith(f"    {here}[{LOGGED_LINE}] in _logged_call: dist.all_reduce(t)  # LOGGED")
        assert f"{here}[" in stack[-2] and " in logged: " in stack[-2]
        entries = json.loads((patch_run / "log_only" / f"rank_{rank}" / "cc_log.json").read_text())
        assert len(entries) == 1 and THIS_FILE in entries[0]["stack"][-1]
