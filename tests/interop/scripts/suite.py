"""More models and configs for the interop harness, several runs per process (the reference's
import alone costs seconds, so each process trains one model under several configs).

Usage: python suite.py --pkg msprobe|trainprobe --what WHAT --out DIR

Each WHAT trains fresh copies of one tiny fixed-seed model under each of its configs (in the
order given, a run whose monitor ends the run by design first, Monitor V2 last because the
reference's ``stop()`` leaves the optimizer broken) and once without any monitor. It writes
``<run>/...`` for the monitors' outputs, ``losses.json`` (run -> losses) and ``ends.json`` (run
-> how the run ended: ``ok``, or the exception's type and exit code). Only the package name
differs between the two sides.

* ``cnn``: Conv2d + BatchNorm2d + Linear, SGD with momentum; V1 and V2 under a sparse schedule
  (``start_step`` 1, ``step_interval`` 2, ``collect_times`` 2, ``step_count_per_record`` 2),
  V2 with ``monitor_mbs_grad`` false.
* ``gru``: Embedding + GRU + Linear, AdamW, gradient accumulation over 2 micro-batches; V1
  (l2 ``linear_hook``, ``monitor_mbs_grad``) and V2 (``monitor_mbs_grad``).
* ``tied``: an embedding tied to the output head, a frozen parameter, a module called twice;
  V1 ``print_struct``, V1 in dynamic mode (``DYNAMIC_MONITOR``, switched on after step 1 and off
  by ``collect_times``) with a ``targets`` dict and l2 features, and V2.
* ``dump-scope``: the CNN dumped at level mix with a ``scope`` and ``summary_mode`` md5.
* ``dump-list``: the tied model dumped at L1 with a ``list``, ``data_mode`` forward and a
  ``step`` filter.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
WHATS = ("cnn", "gru", "tied", "dump-scope", "dump-list")
STEPS = 6
SPARSE = {"start_step": 1, "step_interval": 2, "collect_times": 2, "step_count_per_record": 2}


class Cnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.act = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(self.act(self.bn(self.conv(x)))).flatten(1))


class Gru(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.gru = nn.GRU(8, 8, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(self.embed(x))
        return self.head(out[:, -1])


class Tied(nn.Module):
    """Embedding tied to the head; ``proj.weight`` frozen; ``block`` called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.proj = nn.Linear(8, 8)
        self.proj.weight.requires_grad_(False)
        self.block = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.embed(x))
        h = self.block(torch.relu(self.block(h)))
        return self.head(h).mean(dim=1)


Batch = tuple[torch.Tensor, torch.Tensor]


def seed(value: int = 1234) -> None:
    random.seed(value)
    torch.manual_seed(value)


def make(what: str) -> tuple[nn.Module, torch.optim.Optimizer, list[list[Batch]]]:
    """Model, optimizer and per step its micro-batches."""
    seed()
    gen = torch.Generator().manual_seed(99)
    if what in ("cnn", "dump-scope"):
        model: nn.Module = Cnn()
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        data = [[(torch.randn(4, 1, 6, 6, generator=gen), torch.randn(4, 3, generator=gen))] for _ in range(STEPS)]
    elif what == "gru":
        model = Gru()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        data = [
            [(torch.randint(0, 20, (2, 5), generator=gen), torch.randn(2, 3, generator=gen)) for _ in range(2)]
            for _ in range(STEPS)
        ]
    else:
        model = Tied()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        data = [
            [(torch.randint(0, 10, (2, 4), generator=gen), torch.randn(2, 10, generator=gen))] for _ in range(STEPS)
        ]
    return model, opt, data


def train_step(model: nn.Module, opt: torch.optim.Optimizer, micro: list[Batch]) -> float:
    total = 0.0
    for x, y in micro:
        loss = (model(x) - y).pow(2).mean() / len(micro)
        loss.backward()
        total += float(loss.detach())
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


def config(out: Path, name: str, base: str, **changes: Any) -> str:
    """The shared config ``base`` with ``changes`` applied, written as ``out/config_<name>.json``."""
    data = json.loads((CONFIGS / base).read_text())
    data.update(changes)
    path = out / f"config_{name}.json"
    path.write_text(json.dumps(data, indent=2))
    return str(path)


def v1_config(out: Path, name: str, **changes: Any) -> str:
    base = {"alert": {"rules": [], "dump": False}, "all_xy": True, "mv_distribution": False}
    return config(out, name, "monitor_v1.json", **{**base, **changes})


def run_v1(
    pkg: str, what: str, out: Path, name: str, path: str, *, acc: int = 1, edit: Callable[[int], None] | None = None
) -> list[float]:
    os.environ["MONITOR_OUTPUT_DIR"] = str(out / name)
    api = importlib.import_module(f"{pkg}.pytorch")
    model, opt, data = make(what)
    mon = api.TrainerMon(config_file_path=path, params_have_main_grad=False)
    mon.set_monitor(model, grad_acc_steps=acc, optimizer=opt, dp_group=None, tp_group=None, start_iteration=0)
    losses = []
    for step, micro in enumerate(data):
        losses.append(train_step(model, opt, micro))
        if edit is not None:
            edit(step)
    return losses


def run_v2(pkg: str, what: str, out: Path, name: str, acc: int = 1, **changes: Any) -> list[float]:
    trainer = importlib.import_module(f"{pkg}.core.monitor_v2.trainer")
    model, opt, data = make(what)
    (out / name).mkdir()
    mon = trainer.TrainerMonitorV2(
        config(out, name, "monitor_v2.json", output_dir=str(out / name), **changes), fr="pytorch"
    )
    mon.start(model=model, optimizer=opt, grad_acc_steps=acc)
    losses = [train_step(model, opt, micro) for micro in data]
    mon.stop()
    return losses


def run_dump(pkg: str, what: str, out: Path, steps: int, **changes: Any) -> list[float]:
    api = importlib.import_module(f"{pkg}.pytorch")
    section = changes.pop("section")
    base = json.loads((CONFIGS / "dump.json").read_text())
    base["statistics"].update(section)
    data_cfg = {**base, **changes, "dump_path": str(out / what)}
    path = out / f"config_{what}.json"
    path.write_text(json.dumps(data_cfg, indent=2))
    debugger = api.PrecisionDebugger(config_path=str(path))
    model, opt, data = make(what)
    losses = []
    for step, micro in enumerate(data):
        if step >= steps:
            losses.append(train_step(model, opt, micro))
            continue
        debugger.start(model=model)
        losses.append(train_step(model, opt, micro))
        debugger.stop()
        debugger.step()
    return losses


def dynamic_edit(path: str) -> Callable[[int], None]:
    """Switches ``dynamic_on`` on after step 1 (a newer time stamp, as an edit gives)."""

    def edit(step: int) -> None:
        if step == 1:
            data = json.loads(Path(path).read_text())
            data["dynamic_on"] = True
            Path(path).write_text(json.dumps(data, indent=2))
            later = time.time() + 2
            os.utime(path, (later, later))

    return edit


def runs(pkg: str, what: str, out: Path) -> dict[str, Callable[[], list[float]]]:
    """Name -> run, in the order they run."""
    if what == "cnn":
        return {
            "v1": lambda: run_v1(pkg, what, out, "v1", v1_config(out, "v1", mv_distribution=True, **SPARSE)),
            "v2": lambda: run_v2(pkg, what, out, "v2", **SPARSE, monitors=v2_monitors(mbs=False)),
        }
    if what == "gru":
        l2 = {"recording_l2_features": True, "l2_targets": {"linear_hook": []}}
        return {
            "v1": lambda: run_v1(pkg, what, out, "v1", v1_config(out, "v1", mv_distribution=True, **l2), acc=2),
            "v2": lambda: run_v2(pkg, what, out, "v2", acc=2),
        }
    if what == "tied":
        dyn = v1_config(
            out,
            "v1-dynamic",
            dynamic_on=False,
            collect_times=2,
            all_xy=False,
            targets={"block": {}, "head": {}, "proj.bias": {}},
            recording_l2_features=True,
            l2_targets={"linear_hook": ["0:block", "0:proj"]},
        )
        return {
            "v1-struct": lambda: run_v1(pkg, what, out, "v1-struct", v1_config(out, "v1-struct", print_struct=True)),
            "v1-dynamic": lambda: dynamic(pkg, what, out, dyn),
            "v2": lambda: run_v2(pkg, what, out, "v2"),
        }
    if what == "dump-scope":
        scope = ["Module.bn.BatchNorm2d.forward.0", "Module.fc.Linear.forward.0"]
        return {what: lambda: run_dump(pkg, what, out, 2, level="mix", section={"scope": scope, "summary_mode": "md5"})}
    return {
        what: lambda: run_dump(
            pkg,
            what,
            out,
            3,
            level="L1",
            step=[1, 2],
            section={"list": ["linear", "embedding"], "data_mode": ["forward"]},
        )
    }


def dynamic(pkg: str, what: str, out: Path, path: str) -> list[float]:
    os.environ["DYNAMIC_MONITOR"] = "True"
    try:
        return run_v1(pkg, what, out, "v1-dynamic", path, edit=dynamic_edit(path))
    finally:
        os.environ.pop("DYNAMIC_MONITOR", None)


def v2_monitors(mbs: bool) -> dict[str, Any]:
    data = json.loads((CONFIGS / "monitor_v2.json").read_text())["monitors"]
    data["weight_grad"]["monitor_mbs_grad"] = mbs
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pkg", choices=("msprobe", "trainprobe"), required=True)
    parser.add_argument("--what", choices=WHATS, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.chdir(out)
    model, opt, data = make(args.what)
    losses: dict[str, list[float]] = {"baseline": [train_step(model, opt, micro) for micro in data]}
    ends: dict[str, str] = {}
    for name, run in runs(args.pkg, args.what, out).items():
        try:
            losses[name] = run()
            ends[name] = "ok"
        except SystemExit as exc:
            ends[name] = f"SystemExit({exc.code})"
        except Exception as exc:  # noqa: BLE001 - how the run ended is what is compared
            ends[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
    (out / "losses.json").write_text(json.dumps(losses))
    (out / "ends.json").write_text(json.dumps(ends, indent=2))


if __name__ == "__main__":
    main()
