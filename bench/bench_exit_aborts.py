"""How often a 2-rank gloo run ends in ``terminate called without an active exception`` (issue #34:
"0 aborts in 20 monitored 2-rank runs").

Each run is a real ``torchrun --nproc-per-node 2`` launch of a small DDP training that, like many
scripts, never calls ``destroy_process_group()`` and issues its last collectives right before it
exits. Three kinds, interleaved so that machine load falls on each alike:

* ``plain``: no monitor (the exposure torch has on its own);
* ``v2``: Monitor V2 with every monitor on (module, weight_grad, optimizer, param, cc);
* ``v1``: Monitor V1 (``TrainerMon``) with xy, wg, mv, param and cc distribution on.

Prints, per kind, the runs, how many exited 0, how many aborted (SIGABRT: exit -6 / 134) and any
other status, then the verdict line. Usage::

    python bench/bench_exit_aborts.py [--runs 20] [--kinds plain,v2,v1] [--tail sync|async]

Exit status 1 when a monitored run aborted or failed (so the bench can gate), 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
from collections import Counter
from pathlib import Path

TORCHRUN = Path(sys.executable).with_name("torchrun")
SRC = Path(__file__).resolve().parents[1] / "src"

TRAINING = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    kind, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if kind == "v2":
        from trainprobe import TrainerMonitorV2
        monitors = {m: {"enabled": True} for m in ("module", "weight_grad", "optimizer", "param", "cc")}
        mon = TrainerMonitorV2({"output_dir": out, "monitors": monitors})
        mon.start(model=model, optimizer=opt)
    elif kind == "v1":
        from trainprobe import TrainerMon
        os.environ["MONITOR_OUTPUT_DIR"] = out
        config = os.path.join(out, f"config{dist.get_rank()}.json")
        os.makedirs(out, exist_ok=True)
        with open(config, "w") as fh:
            json.dump({"targets": {}, "xy_distribution": True, "wg_distribution": True, "mv_distribution": True,
                       "param_distribution": True, "cc_distribution": {"enable": True},
                       "ops": ["min", "max", "norm"], "format": "csv"}, fh)
        mon = TrainerMon(config, process_group=None, params_have_main_grad=False)
        mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    for step in range(6):
        loss = model(torch.randn(8, 16)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        logged = loss.detach().clone()
        dist.all_reduce(logged, async_op=True).wait()
    tail = sys.argv[3] == "async"
    for _ in range(200):                      # the last collectives right before exit
        t = torch.ones(1000)
        dist.all_reduce(t, async_op=tail)     # --tail async: works left unwaited, as some loops do
        del t
    print("trained", dist.get_rank(), flush=True)
    # no destroy_process_group(), as many scripts end
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_run(kind: str, script: Path, work: Path, index: int, tail: str = "sync") -> int:
    """The exit status of one 2-rank launch (torchrun's: non-zero when a rank failed)."""
    out = work / f"{kind}_{index}"
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    cmd = [str(TORCHRUN), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
           str(_free_port()), str(script), kind, str(out), tail]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    aborted = "terminate called" in proc.stderr or "SIGABRT" in proc.stderr or "Signal 6" in proc.stderr
    if aborted and proc.returncode != 0:
        return -6
    if proc.returncode == 0 and kind != "plain" and not any(out.rglob("*.csv")):
        return 2  # exited 0 but monitored nothing: not a valid monitored run
    return proc.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="launches per kind (default 20)")
    parser.add_argument("--kinds", default="plain,v2,v1", help="comma-separated: plain, v2, v1")
    parser.add_argument("--tail", choices=("sync", "async"), default="sync",
                        help="the last 200 all_reduces waited for (sync, default) or left unwaited (async: "
                        "the harshest exposure; without a guard such runs abort)")
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    results: dict[str, Counter[int]] = {k: Counter() for k in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        script = work / "train.py"
        script.write_text(TRAINING)
        for index in range(args.runs):
            for kind in kinds:  # interleaved: load falls on every kind alike
                results[kind][one_run(kind, script, work, index, args.tail)] += 1
    print(f"{'kind':<6} {'runs':>5} {'exit 0':>7} {'aborts':>7} {'other':>6}")
    bad = 0
    for kind in kinds:
        counts = results[kind]
        aborts = counts[-6]
        other = sum(n for status, n in counts.items() if status not in (0, -6))
        print(f"{kind:<6} {args.runs:>5} {counts[0]:>7} {aborts:>7} {other:>6}")
        if kind != "plain":
            bad += aborts + other
    monitored = [k for k in kinds if k != "plain"]
    print(f"monitored runs aborted or failed: {bad} of {args.runs * len(monitored)}")
    print(json.dumps({k: dict(v) for k, v in results.items()}))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
