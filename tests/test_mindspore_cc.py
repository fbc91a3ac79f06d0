"""MindSpore ``cc``: two real processes started by ``msrun`` (MindSpore's launcher) on the CPU,
monitored by Monitor V2 and Monitor V1 (``tests/ms_cc_worker.py`` is one rank)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import mindspore_support  # noqa: F401 - skips without a usable MindSpore
from conftest import read_csv

WORKER = Path(__file__).with_name("ms_cc_worker.py")


def _line(marker: str) -> int:
    return next(i for i, line in enumerate(WORKER.read_text().splitlines(), 1) if marker in line)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cc_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ms_cc")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    env["GLOG_v"] = "3"  # MindSpore's own log: errors only
    command = [
        sys.executable, "-m", "mindspore.parallel.cluster.run",
        "--worker_num=2", "--local_worker_num=2", f"--master_port={_free_port()}",
        f"--log_dir={out / 'msrun_log'}", "--join=True", str(WORKER), str(out),
    ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        logs = "\n".join(
            p.read_text(errors="replace")[-3000:] for p in sorted((out / "msrun_log").glob("worker_*.log"))
        )
        pytest.fail(f"msrun failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}\n{logs}")
    return out


def _rows(folder: Path) -> list[dict[str, str]]:
    files = sorted(folder.glob("cc_step*.csv"))
    assert files, list(folder.iterdir())
    return [row for f in files for row in read_csv(f)[1]]


def _at(rows: list[dict[str, str]], prefix: str, site: str, step: str) -> dict[str, str]:
    found = [
        r for r in rows if r["module_name"].startswith(prefix) and r["module_name"].endswith(site) and r["step"] == step
    ]
    assert len(found) == 1, (prefix, site, step, [r["module_name"] for r in rows if r["step"] == step])
    return found[0]


@pytest.mark.parametrize("rank", [0, 1])
def test_v2_cc_rows_of_mint_functions_and_the_grad_reducer(cc_run: Path, rank: int) -> None:
    rows = _rows(cc_run / "v2" / f"rank_{rank}")
    assert {r["scope"] for r in rows} == {"comm"} and {r["step"] for r in rows} == {"0", "1"}
    sync, asyn, gather = (f"ms_cc_worker.py[{_line(m)}]" for m in ("# SYNC", "# ASYNC", "# GATHER"))
    for step in ("0", "1"):
        # synchronous all_reduce: in = this rank's tensor (cc_pre_hook), out = the sum [3, 4]
        into = _at(rows, "all_reduce.", f".in.0@{sync}", step)
        assert (float(into["min"]), float(into["max"])) == (1.0 + rank, 2.0)
        out = _at(rows, "all_reduce.", f".out.0@{sync}", step)
        assert (float(out["min"]), float(out["max"]), float(out["mean"]), float(out["norm"])) == (3.0, 4.0, 3.5, 5.0)
        # asynchronous all_reduce: recorded after wait() (step 0) or at the end of the step (step 1)
        assert float(_at(rows, "all_reduce.", f".out.0@{asyn}", step)["max"]) == 30.0
        # all_gather: one output row per gathered tensor
        assert float(_at(rows, "all_gather.0.", f".out.0@{gather}", step)["max"]) == 0.0
        assert float(_at(rows, "all_gather.0.", f".out.1@{gather}", step)["min"]) == 1.0
    # the ops.AllReduce primitive, named like torch's all_reduce: one call per gradient, whose
    # output is the sum over the ranks = 2 x the averaged gradient the optimizer got
    site = f"@ms_cc_worker.py[{_line('# REDUCE')}]"
    reducer = [r for r in rows if r["module_name"].startswith("all_reduce.") and r["module_name"].endswith(site)]
    outs = sorted(float(r["norm"]) for r in reducer if ".out." in r["module_name"] and r["step"] == "0")
    grads = read_csv(next((cc_run / "v2" / f"rank_{rank}").glob("weight_grad_step*.csv")))[1]
    reduced = sorted(2 * float(r["norm"]) for r in grads if r["scope"] == "reduced" and r["step"] == "0")
    assert len(outs) == 4 and outs == pytest.approx(reduced, rel=1e-5)


def test_v1_cc_distribution_keeps_the_cc_codeline_call(cc_run: Path) -> None:
    sync = f"ms_cc_worker.py[{_line('# SYNC')}]"
    for rank in (0, 1):
        runs = list((cc_run / "v1").glob(f"*-rank{rank}-*"))
        assert len(runs) == 1, list((cc_run / "v1").iterdir())
        files = sorted(runs[0].glob("other_*.csv"))
        rows = [row for f in files for row in read_csv(f)[1]]
        assert {r["name"].split("@", 1)[1] for r in rows} == {sync}
        assert {r["step"] for r in rows} == {"0", "1"}
        assert all((float(r["min"]), float(r["max"]), float(r["norm"])) == (3.0, 4.0, 5.0) for r in rows)


def test_v2_cc_log_only_lists_each_call_site_once(cc_run: Path) -> None:
    sync = f"ms_cc_worker.py[{_line('# SYNC')}]"
    for rank in (0, 1):
        folder = cc_run / "v2_log" / f"rank_{rank}"
        assert not list(folder.glob("cc_step*.csv"))  # a log, no statistics
        entries = json.loads((folder / "cc_log.json").read_text())
        sync_entries = [e for e in entries if e["codeline"].endswith(sync)]
        assert len(sync_entries) == 1, entries
        entry = sync_entries[0]
        assert entry["op"] == "all_reduce" and entry["group"] == "world"
        assert entry["shapes"] == [[2], [2]] and entry["dtypes"] == ["Float32"]
        assert any("ms_cc_worker.py" in line for line in entry["stack"])
        assert {e["op"] for e in entries} == {"all_reduce", "all_gather"}
