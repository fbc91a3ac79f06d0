"""print_struct and cc_log_only end the run cleanly: exit code 0 and a clear message."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, torch, torch.distributed as dist
    sys.path.insert(0, {tests!r})
    from models import MLP
    from trainprobe.frontdoors.monitor_v1 import TrainerMon
    if {dist!r}:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon({config!r}, params_have_main_grad=False)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    {after_start}
    for step in range({steps!r}):
        model(torch.randn(4, 6)).sum().backward()
        if {dist!r}:
            for p in model.parameters():
                dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
        print("trained step", step, flush=True)
        if step == 1 and {edit!r} is not None:  # edit the config between steps 1 and 2
            with open({config!r}, "w") as fh:
                json.dump({edit!r}, fh)
            t = os.stat({config!r}).st_mtime_ns + 5_000_000_000
            os.utime({config!r}, ns=(t, t))
    print("training finished", flush=True)
    """
)


def _run(
    tmp_path: Path,
    config: dict,
    use_dist: bool,
    dynamic: bool = False,
    edit: dict | None = None,
    steps: int = 3,
    after_start: str = "",
) -> subprocess.CompletedProcess:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(config))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = SCRIPT.format(
        tests=str(Path(__file__).parent), dist=use_dist, port=port, config=str(cfg), edit=edit, steps=steps,
        after_start=after_start,
    )
    env = {**os.environ, "MONITOR_OUTPUT_DIR": str(tmp_path / "out")}
    env["DYNAMIC_MONITOR"] = "True" if dynamic else "False"
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)


def test_print_struct_writes_structure_and_exits_0(tmp_path):
    proc = _run(tmp_path, {"print_struct": True}, use_dist=False)
    assert proc.returncode == 0, proc.stderr
    assert "trained step 0" not in proc.stdout and "print_struct is set" in proc.stdout
    struct = json.loads((tmp_path / "out" / "module_struct" / "rank0" / "module_struct.json").read_text())
    # the reference's layout: users copy these names and shapes into targets
    assert struct["0:fc1"] == {
        "input": {"config": "list[1]", "0": "size=(4, 6), dtype=torch.float32"},
        "output": {"config": "tensor", "tensor": "size=(4, 16), dtype=torch.float32"},
        "input_grad": {"config": "tuple[1]", "0": "<class 'NoneType'>"},
        "output_grad": {"config": "tuple[1]", "0": "size=(4, 16), dtype=torch.float32"},
    }
    assert struct["0:fc2"]["input_grad"] == {"config": "tuple[1]", "0": "size=(4, 16), dtype=torch.float32"}
    assert set(struct) == {"0:", "0:fc1", "0:act", "0:fc2"}


def test_cc_log_only_prints_call_sites_and_exits_0(tmp_path):
    proc = _run(tmp_path, {"cc_distribution": {"enable": True, "cc_log_only": True}}, use_dist=True)
    assert proc.returncode == 0, proc.stderr
    assert "all_reduce at" in proc.stdout and "cc_log_only is set" in proc.stdout
    assert "trained step 0" not in proc.stdout and "training finished" not in proc.stdout


def test_cc_log_only_that_cannot_write_its_file_says_so_and_exits_1(tmp_path):
    """A cc_log.json that cannot be written (here a folder stands where the file goes; a full
    disk alike) must not end the run as if the log were kept: the fault is logged once and the
    monitor disabled (as any monitor fault), the site already printed stays, the final message
    names the file and the error, and the exit code is 1."""
    block = "import pathlib; [(d / 'cc_log.json').mkdir() for d in pathlib.Path(os.environ['MONITOR_OUTPUT_DIR']).glob('*rank0*')]"
    proc = _run(tmp_path, {"cc_distribution": {"enable": True, "cc_log_only": True}}, use_dist=True, after_start=block)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "all_reduce at" in proc.stdout and "trained step 0" not in proc.stdout
    assert "cc_log.json could not be written" in proc.stdout and "(exit code 1)" in proc.stdout
    assert "the cc monitor failed and is disabled for the rest of the run" in proc.stderr  # logged once
    assert "cc_log_only is set: the collective call sites were printed (and kept" not in proc.stdout


def test_print_struct_waits_for_dynamic_on(tmp_path):
    """Dynamic mode with dynamic_on false monitors nothing: print_struct does not end the run."""
    proc = _run(tmp_path, {"print_struct": True, "wg_distribution": True}, use_dist=False, dynamic=True)
    assert proc.returncode == 0, proc.stderr
    assert "training finished" in proc.stdout and "print_struct is set" not in proc.stdout
    assert not (tmp_path / "out" / "module_struct").exists()


def test_print_struct_switched_on_by_a_dynamic_edit(tmp_path):
    """An edit (read at the end of step 2) switching print_struct on records step 3's structure,
    then ends the run."""
    edit = {"dynamic_on": True, "print_struct": True, "wg_distribution": True}
    proc = _run(tmp_path, {"wg_distribution": True}, use_dist=False, dynamic=True, edit=edit, steps=6)
    assert proc.returncode == 0, proc.stderr
    assert "trained step 2" in proc.stdout and "trained step 3" not in proc.stdout
    assert "print_struct is set" in proc.stdout
    struct = json.loads((tmp_path / "out" / "module_struct" / "rank0" / "module_struct.json").read_text())
    assert set(struct) == {"0:", "0:fc1", "0:act", "0:fc2"}
