"""A stopped monitor or dump leaves nothing behind in torch: the process-wide hook registries
(``torch.nn.modules.module._global_*``, ``torch.optim.optimizer._global_*``), the functions the
dump wraps, and the model's and optimizer's own hooks are what they were before it attached,
including while the statistics' one-read pass is still being built aside (default mode, cold
cache: the build used to register a global ``optimizer.step()`` post-hook that outlived ``stop()``)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.modules import module as nn_module
from torch.optim import optimizer as optim_module

from models import MLP, no_hooks_left
from test_distributed_v2 import _world_of_one
from test_v1_support import make_v1
from trainprobe import PrecisionDebugger, TrainerMonitorV2
from trainprobe.backends.torch import native_stats
from trainprobe.backends.torch import stats as torch_stats
from trainprobe.backends.torch.fused_stats import FUSED_ENV
from trainprobe.frontdoors.metrics import TrainingMetricsMonitor


def global_registries() -> dict[str, tuple[int, ...]]:
    """Every process-wide hook registry of torch (each ``_global_*`` dict of the module and
    optimizer modules) as the ids of the hooks it holds, and every attribute of ``torch``,
    ``torch.nn.functional``, ``torch.Tensor`` and ``torch.distributed`` (what the dump wraps) as
    the id of the function it is or, for the dump's API wrapper, wraps: the dump's level L1
    installs those once per process, as the reference does (docs/precision_dump.md), and outside
    ``start()``/``stop()`` they only call the original."""
    out: dict[str, tuple[int, ...]] = {}
    for where in (nn_module, optim_module):
        for name, value in vars(where).items():
            if name.startswith("_global_") and isinstance(value, dict):
                out[f"{where.__name__}.{name}"] = tuple(id(v) for v in value.values())
    for namespace in (torch, F, torch.Tensor, dist):
        for name in dir(namespace):
            value = inspect.getattr_static(namespace, name, None)  # as stored: a wrapper shadows an inherited method
            wrapped = getattr(value, "__dict__", {}).get("trainprobe_api", value) if callable(value) else value
            out[f"{namespace.__name__}.{name}"] = (id(wrapped),)
    return out


@pytest.fixture
def cold_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """The statistics' default mode with nothing cached and a fresh process-wide selector: a
    front door's start begins building the one-read pass aside. Returns a function that waits
    for that build (no child left running after the test)."""
    monkeypatch.delenv(FUSED_ENV, raising=False)
    monkeypatch.setenv(native_stats.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(torch_stats, "_SHARED_FUSED", [])
    builds: list[Any] = []

    def pending() -> None:
        build = torch_stats.shared_fused()._build
        if build is not None:
            builds.append(build)

    yield pending
    for build in builds:
        build.wait(300)


def _train(model: MLP, opt: torch.optim.Optimizer, steps: int, after: Callable[[], None] | None = None) -> None:
    for _ in range(steps):
        model(torch.randn(4, 6)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if after is not None:
            after()


def test_v2_stop_leaves_no_hook(tmp_path: Path, cold_default: Callable[[], None]) -> None:
    before = global_registries()
    model = MLP()
    opt = torch.optim.AdamW(model.parameters())
    monitors = {name: {"enabled": True} for name in ("module", "weight_grad", "param", "optimizer")}
    mon = TrainerMonitorV2({"output_dir": str(tmp_path / "out"), "monitors": monitors})
    mon.start(model=model, optimizer=opt)
    cold_default()
    assert torch_stats.shared_fused()._build is not None, "the test needs the build running aside"
    _train(model, opt, 2)
    mon.stop()
    assert global_registries() == before
    assert no_hooks_left(model, opt)


def test_v1_stop_leaves_no_hook(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cold_default: Callable[[], None]
) -> None:
    before = global_registries()
    model = MLP()
    opt = torch.optim.AdamW(model.parameters())
    config = {
        "targets": {},
        "xy_distribution": True,
        "all_xy": True,
        "wg_distribution": True,
        "mv_distribution": True,
        "param_distribution": True,
        "ops": ["min", "max", "norm"],
    }
    mon = make_v1(tmp_path, monkeypatch, config)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    cold_default()
    assert torch_stats.shared_fused()._build is not None, "the test needs the build running aside"
    _train(model, opt, 2)
    mon.stop()
    assert global_registries() == before
    assert no_hooks_left(model, opt)


def test_dump_stop_leaves_no_hook(tmp_path: Path, cold_default: Callable[[], None]) -> None:
    before = global_registries()
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    debugger = PrecisionDebugger(task="statistics", level="mix", dump_path=str(tmp_path / "dump"))
    cold_default()
    assert torch_stats.shared_fused()._build is not None, "the test needs the build running aside"
    for _ in range(2):
        debugger.start(model)
        _train(model, opt, 1)
        debugger.stop()
        debugger.step()
    assert global_registries() == before
    assert no_hooks_left(model, opt)


def test_training_metrics_close_leaves_no_hook_and_its_step_adopts_the_pass(
    tmp_path: Path, cold_default: Callable[[], None]
) -> None:
    """The training metrics start the build too; their ``step()`` is a step boundary that adopts it."""
    before = global_registries()
    model = MLP()
    opt = torch.optim.AdamW(model.parameters())
    config = {"monitor_config": {"monitor_on": True, "dump_path": str(tmp_path / "m"), "local_loss_format": "log"}}
    mon = TrainingMetricsMonitor(config, model, opt)
    cold_default()
    build = torch_stats.shared_fused()._build
    assert build is not None, "the test needs the build running aside"
    assert global_registries() == before  # nothing registered for the build, even while it runs
    assert build.wait(300) and build.result() is not None
    _train(model, opt, 1, after=lambda: mon.step(loss=1.0))
    assert torch_stats.shared_fused()._passes["cpu", torch.float32].native  # adopted at the end of step()
    mon.close()
    assert global_registries() == before
    assert no_hooks_left(model, opt)


def test_v2_cc_stop_with_a_trailing_step_open_leaves_no_hook(tmp_path: Path) -> None:
    """The cc monitor wraps torch.distributed's functions and, after ``optimizer.step()``, waits
    for the next step's first forward with a global module forward pre-hook: a ``stop()`` right
    then puts the functions back and removes that hook."""
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with _world_of_one():
        before = global_registries()
        mon = TrainerMonitorV2({"output_dir": str(tmp_path / "out"), "monitors": {"cc": {"enabled": True}}})
        mon.start(model=model, optimizer=opt)
        _train(model, opt, 1)
        dist.all_reduce(torch.ones(3))  # after optimizer.step(): the step's trailing call
        assert nn_module._global_forward_pre_hooks, "the test needs the trailing step open"
        mon.stop()
        assert global_registries() == before
    assert no_hooks_left(model, opt)
