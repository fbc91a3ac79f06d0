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
    import json, sys, torch, torch.distributed as dist
    sys.path.insert(0, {tests!r})
    from models import MLP
    from trainprobe.monitor_v1 import TrainerMon
    if {dist!r}:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon({config!r}, params_have_main_grad=False)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    for step in range(3):
        model(torch.randn(4, 6)).sum().backward()
        if {dist!r}:
            for p in model.parameters():
                dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
        print("trained step", step, flush=True)
    print("training finished", flush=True)
    """
)


def _run(tmp_path: Path, config: dict, use_dist: bool) -> subprocess.CompletedProcess:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(config))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = SCRIPT.format(tests=str(Path(__file__).parent), dist=use_dist, port=port, config=str(cfg))
    env = {**os.environ, "MONITOR_OUTPUT_DIR": str(tmp_path / "out")}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)


def test_print_struct_writes_structure_and_exits_0(tmp_path):
    proc = _run(tmp_path, {"print_struct": True}, use_dist=False)
    assert proc.returncode == 0, proc.stderr
    assert "trained step 0" not in proc.stdout and "print_struct is set" in proc.stdout
    struct = json.loads((tmp_path / "out" / "module_struct" / "rank0" / "module_struct.json").read_text())
    assert struct["0:fc1"]["input"] == {"config": "tensor", "0": "size=(4, 6), dtype=torch.float32"}
    assert struct["0:fc1"]["output"] == {"config": "tensor", "0": "size=(4, 16), dtype=torch.float32"}
    assert struct["0:fc2"]["input_grad"] == {"config": "tuple[1]", "0": "size=(4, 16), dtype=torch.float32"}
    assert set(struct) == {"0:root", "0:fc1", "0:act", "0:fc2"}


def test_cc_log_only_prints_call_sites_and_exits_0(tmp_path):
    proc = _run(tmp_path, {"cc_distribution": {"enable": True, "cc_log_only": True}}, use_dist=True)
    assert proc.returncode == 0, proc.stderr
    assert "all_reduce at" in proc.stdout and "cc_log_only is set" in proc.stdout
    assert "trained step 0" not in proc.stdout and "training finished" not in proc.stdout
