"""Gradient hooks on module inputs that live across steps do not pile up (issue #32).

A learned latent ``nn.Parameter`` passed as the input of a submodule (``self.sub(self.latent)``)
and a receive buffer refilled in place every step (a pipeline stage's shape) are the same tensor
in every forward. The module monitor (Monitor V2 ``module``, Monitor V1 ``xy_distribution``)
hooks each such tensor once per step and removes the hook at the step's end, by ``stop()`` and
when the monitor is disabled after a fault; the precision dump's backward hooks go at every
``step()``. Rows per step stay constant and equal what a freshly started monitor writes for the
step, and the training is bitwise the one without a monitor.
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from torch import nn

from conftest import assert_row_matches, rows_of
from models import no_hooks_left
from test_v1_support import make_v1, run_dir, table
from trainprobe import PrecisionDebugger, TrainerMonitorV2
from trainprobe.engine.probes.module import ModuleProbe

STEPS = 60
D = 8
BATCH = 4
OPS = ["min", "max", "mean", "norm"]
M = TypeVar("M", bound=nn.Module)


class LatentModel(nn.Module):
    """A learned latent (an ``nn.Parameter``) is the input of ``sub`` in every forward, as learned
    queries are; the batch enters through ``enc``; ``head`` reads both."""

    def __init__(self) -> None:
        super().__init__()
        self.latent = nn.Parameter(torch.randn(BATCH, D))
        self.sub = nn.Sequential(nn.Linear(D, D), nn.Tanh())
        self.enc = nn.Linear(D, D)
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(x) + self.sub(self.latent))


class RecvBufferStage(nn.Module):
    """A pipeline stage's shape: the activation arrives in a receive buffer allocated once (a
    leaf that requires gradients), refilled in place every step, and read by the stage's layers
    (``stage`` and its first layer both take the buffer as their input)."""

    recv: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("recv", torch.zeros(BATCH, D, requires_grad=True))
        self.stage = nn.Sequential(nn.Linear(D, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.recv.copy_(x)
        return self.stage(self.recv)


def persistent_of(model: nn.Module) -> torch.Tensor:
    """The module input of ``model`` that is the same tensor in every step."""
    if isinstance(model, LatentModel):
        return model.latent
    assert isinstance(model, RecvBufferStage)
    return model.recv


def hooks_on(t: torch.Tensor) -> int:
    """How many tensor hooks (``Tensor.register_hook``) ``t`` holds now."""
    return len(t._backward_hooks or {})


def batches(steps: int, seed: int = 1) -> list[torch.Tensor]:
    """The same inputs for every run."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(BATCH, D, generator=g) for _ in range(steps)]


def build(kind: type[M], seed: int = 0) -> tuple[M, torch.optim.Optimizer]:
    """A model of ``kind`` and its optimizer, initialised from ``seed``."""
    torch.manual_seed(seed)
    model = kind()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    data: list[torch.Tensor],
    *,
    after_backward: Callable[[int], None] | None = None,
) -> None:
    """One forward, backward and optimizer step per batch of ``data``; ``after_backward(step)``
    runs between the backward and the optimizer step."""
    for step, x in enumerate(data):
        model(x).pow(2).mean().backward()
        if after_backward is not None:
            after_backward(step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if isinstance(model, RecvBufferStage):
            model.recv.grad = None  # what a pipeline does once it sent the gradient back


def reference_params(kind: type[nn.Module], data: list[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters after training on ``data`` without any monitor."""
    model, opt = build(kind)
    train(model, opt, data)
    return [p.detach().clone() for p in model.parameters()]


def assert_bitwise(model: nn.Module, reference: list[torch.Tensor]) -> None:
    """``model``'s parameters equal ``reference`` bit for bit."""
    params = list(model.parameters())
    assert len(params) == len(reference)
    for p, ref in zip(params, reference):
        assert torch.equal(p.detach(), ref)


def per_step(rows: list[dict[str, str]], name_field: str) -> dict[str, Counter[tuple[str, ...]]]:
    """Per step, how many rows each (name, scope/kind, micro step) has."""
    out: dict[str, Counter[tuple[str, ...]]] = {}
    for r in rows:
        key = (r[name_field], r.get("scope", ""), r.get("micro_step", ""))
        out.setdefault(r["step"], Counter())[key] += 1
    return out


def assert_flat(counts: dict[str, Counter[tuple[str, ...]]], steps: int) -> Counter[tuple[str, ...]]:
    """Every step has the same rows, each once; returns step 0's."""
    assert sorted(counts, key=int) == [str(s) for s in range(steps)]
    first = counts["0"]
    assert first and set(first.values()) == {1}, first
    for step, found in counts.items():
        assert found == first, f"step {step}: {found} != {first}"
    return first


def v2_monitor(tmp_path: Path, name: str) -> tuple[TrainerMonitorV2, Path]:
    """A Monitor V2 recording every module's inputs, outputs and their gradients."""
    out = tmp_path / name
    config = {"output_dir": str(out), "monitors": {"module": {"enabled": True, "ops": OPS}}}
    return TrainerMonitorV2(config), out


def module_probe(mon: TrainerMonitorV2) -> ModuleProbe:
    """The monitor's module probe."""
    (probe,) = [p for p in mon._session.probes if isinstance(p, ModuleProbe)]
    return probe


def without_step(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    """``rows`` without their step column."""
    return [{k: v for k, v in r.items() if k != "step"} for r in rows]


@pytest.mark.parametrize("kind", [LatentModel, RecvBufferStage])
def test_v2_persistent_input_one_hook_flat_rows_bitwise(tmp_path: Path, kind: type[nn.Module]) -> None:
    data = batches(STEPS)
    model, opt = build(kind)
    kept = persistent_of(model)
    mon, out = v2_monitor(tmp_path, "out")
    mon.start(model=model, optimizer=opt)
    probe = module_probe(mon)
    hooks: list[int] = []
    grads: list[torch.Tensor] = []

    def after_backward(step: int) -> None:
        hooks.append(hooks_on(kept))
        assert kept.grad is not None
        grads.append(kept.grad.detach().clone())

    train(model, opt, data, after_backward=after_backward)
    assert hooks_on(kept) == 0  # removed at each step's end
    mon.stop()
    assert hooks == [1] * STEPS
    assert hooks_on(kept) == 0 and probe.hooked_tensors() == 0
    assert no_hooks_left(model, opt)
    if isinstance(model, RecvBufferStage):
        assert not model.recv._backward_hooks
    assert_bitwise(model, reference_params(kind, data))

    rows = rows_of(out, "module")
    first = assert_flat(per_step(rows, "module_name"), STEPS)
    grad_names = {"sub.grad_input.0"} if kind is LatentModel else {"stage.grad_input.0", "stage.0.grad_input.0"}
    assert grad_names <= {name for name, _, _ in first}
    for r in rows:  # each name's row holds the gradient of the persistent tensor at its step
        if r["module_name"] in grad_names:
            assert_row_matches(r, grads[int(r["step"])], rel=1e-5)


def test_v2_later_step_writes_what_a_fresh_monitor_writes(tmp_path: Path) -> None:
    """Step ``STEPS - 1`` of a long-running monitor writes exactly the rows (names, order,
    values) that a monitor started just before that step writes."""
    data = batches(STEPS)
    model, opt = build(LatentModel)
    mon, out = v2_monitor(tmp_path, "long")
    mon.start(model=model, optimizer=opt)
    train(model, opt, data)
    mon.stop()
    last = [r for r in rows_of(out, "module") if r["step"] == str(STEPS - 1)]

    fresh_model, fresh_opt = build(LatentModel)
    train(fresh_model, fresh_opt, data[:-1])
    fresh, fresh_out = v2_monitor(tmp_path, "fresh")
    fresh.start(model=fresh_model, optimizer=fresh_opt)
    train(fresh_model, fresh_opt, data[-1:])
    fresh.stop()
    assert without_step(rows_of(fresh_out, "module")) == without_step(last)
    assert_bitwise(fresh_model, [p.detach().clone() for p in model.parameters()])


def test_v2_micro_batches_one_row_per_backward(tmp_path: Path) -> None:
    """With gradient accumulation the latent's gradient row comes once per backward pass, with
    that pass's micro step and gradient, also when both forwards run before the backwards."""
    steps, acc = 6, 2
    g = torch.Generator().manual_seed(3)
    data = [[torch.randn(BATCH, D, generator=g) for _ in range(acc)] for _ in range(steps)]
    model, opt = build(LatentModel)
    out = tmp_path / "out"
    mon = TrainerMonitorV2({"output_dir": str(out), "monitors": {"module": {"targets": ["sub"], "ops": OPS}}})
    mon.start(model=model, optimizer=opt, grad_acc_steps=acc)
    deltas: list[list[torch.Tensor]] = []
    hooks: list[int] = []
    for step, xs in enumerate(data):
        losses = [model(x).pow(2).mean() for x in xs] if step % 2 else []
        step_deltas = []
        for i, x in enumerate(xs):
            before = torch.zeros_like(model.latent) if model.latent.grad is None else model.latent.grad.clone()
            loss = losses[i] if losses else model(x).pow(2).mean()  # odd steps: F0 F1 B0 B1
            hooks.append(hooks_on(model.latent))
            loss.backward()
            grad = model.latent.grad
            assert grad is not None
            step_deltas.append(grad - before)
        deltas.append(step_deltas)
        opt.step()
        opt.zero_grad(set_to_none=True)
    mon.stop()
    assert hooks == [1] * (steps * acc) and hooks_on(model.latent) == 0
    rows = rows_of(out, "module")
    assert_flat(per_step(rows, "module_name"), steps)
    latent_rows = [r for r in rows if r["module_name"] == "sub.grad_input.0"]
    assert [(r["step"], r["micro_step"]) for r in latent_rows] == [
        (str(s), str(m)) for s in range(steps) for m in range(acc)
    ]
    for r in latent_rows:
        assert_row_matches(r, deltas[int(r["step"])][int(r["micro_step"])], rel=1e-5)


def test_v2_retained_graph_second_backward_repeats_every_gradient_row(tmp_path: Path) -> None:
    """A second backward through a retained graph gives the latent's gradient row again, as it
    gives every other gradient row again: the same count per name."""
    model, opt = build(LatentModel)
    mon, out = v2_monitor(tmp_path, "out")
    mon.start(model=model, optimizer=opt)
    for x in batches(3):
        loss = model(x).pow(2).mean()
        loss.backward(retain_graph=True)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    mon.stop()
    counts = Counter(r["module_name"] for r in rows_of(out, "module") if r["scope"] == "backward")
    assert counts["sub.grad_input.0"] == 6
    assert set(counts.values()) == {6}, counts


def test_v2_shared_tensor_one_hook_rows_for_every_call(tmp_path: Path) -> None:
    """A tensor two recorded calls see (the latent as the input of two modules, one module's
    output as the next one's input) holds one hook and gets one row per call name."""

    class TwoReaders(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.latent = nn.Parameter(torch.randn(BATCH, D))
            self.a = nn.Linear(D, D)
            self.b = nn.Linear(D, D)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (self.a(self.latent) + self.b(self.latent)) * x

    torch.manual_seed(0)
    model = TwoReaders()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon, out = v2_monitor(tmp_path, "out")
    mon.start(model=model, optimizer=opt)
    hooks = []
    for x in batches(5):
        loss = model(x).pow(2).mean()
        hooks.append(hooks_on(model.latent))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    mon.stop()
    assert hooks == [1] * 5 and hooks_on(model.latent) == 0
    rows = rows_of(out, "module")
    assert_flat(per_step(rows, "module_name"), 5)
    for step in map(str, range(5)):
        a, b = (
            next(r for r in rows if r["step"] == step and r["module_name"] == name)
            for name in ("a.grad_input.0", "b.grad_input.0")
        )
        assert {k: v for k, v in a.items() if k != "module_name"} == {k: v for k, v in b.items() if k != "module_name"}


def test_v2_fault_removes_the_hooks_and_training_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A module monitor disabled by a fault in a gradient hook holds no hook after that step."""
    data = batches(6)
    model, opt = build(LatentModel)
    mon, _ = v2_monitor(tmp_path, "out")
    mon.start(model=model, optimizer=opt)
    probe = module_probe(mon)
    seen: list[int] = []

    def broken(t: torch.Tensor) -> Any:
        raise RuntimeError("statistics broke")

    def after_backward(step: int) -> None:
        seen.append(hooks_on(model.latent))
        if step == 1:
            monkeypatch.setattr(probe.stats, "row", broken)  # a fault in the next step's hooks

    train(model, opt, data, after_backward=after_backward)
    assert probe.disabled
    assert seen == [1, 1, 1, 0, 0, 0]  # step 2's hook faulted; the session detached the probe
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    mon.stop()
    assert no_hooks_left(model, opt)
    assert_bitwise(model, reference_params(LatentModel, data))


@pytest.mark.parametrize("kind", [LatentModel, RecvBufferStage])
def test_v1_xy_distribution_persistent_input_flat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: type[nn.Module]
) -> None:
    data = batches(STEPS)
    model, opt = build(kind)
    kept = persistent_of(model)
    config = {"targets": {}, "xy_distribution": True, "all_xy": True, "ops": OPS}
    mon = make_v1(tmp_path, monkeypatch, config)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    hooks: list[int] = []
    train(model, opt, data, after_backward=lambda step: hooks.append(hooks_on(kept)))
    mon.stop()
    assert hooks == [1] * STEPS
    assert hooks_on(kept) == 0
    assert no_hooks_left(model, opt)
    assert_bitwise(model, reference_params(kind, data))
    folder = run_dir(tmp_path)
    grad_rows = table(folder, "actv_grad")
    first = assert_flat(per_step(grad_rows, "name"), STEPS)
    wanted = "sub.input" if kind is LatentModel else "stage.input"
    assert wanted in {name for name, _, _ in first}
    assert_flat(per_step(table(folder, "actv"), "name"), STEPS)


@pytest.mark.parametrize("level", ["L0", "mix"])
def test_dump_persistent_input_hooks_go_at_every_step(tmp_path: Path, level: str) -> None:
    """The precision dump's backward capture on a latent passed through ``nn.Identity`` (whose
    output is its input: the gradient is read by a tensor hook on the latent) and a linear
    layer: the same hooks and records every step, none left after ``step()``, bitwise training."""

    class IdentityLatent(LatentModel):
        def __init__(self) -> None:
            super().__init__()
            self.same = nn.Identity()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.enc(x) + self.sub(self.same(self.latent)))

    steps = 12
    data = batches(steps)
    model, opt = build(IdentityLatent)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    debugger = PrecisionDebugger(task="statistics", level=level, dump_path=str(tmp_path / "dump"))
    during: list[int] = []
    after: list[int] = []
    for x in data:
        debugger.start(model)
        model(x).pow(2).mean().backward()
        during.append(hooks_on(model.latent))
        debugger.stop()
        debugger.step()
        after.append(hooks_on(model.latent))
        opt.step()
        opt.zero_grad(set_to_none=True)
    train(reference, ref_opt, data)
    assert len(set(during)) == 1 and during[0] > 0
    assert after == [0] * steps
    assert no_hooks_left(model, opt)
    assert_bitwise(model, [p.detach().clone() for p in reference.parameters()])
    records = []
    for step in range(steps):
        (dump,) = (tmp_path / "dump" / f"step{step}").rglob("dump.json")
        records.append(sorted(json.loads(dump.read_text())["data"]))
    assert all(r == records[0] for r in records)
    assert any(name.startswith("Module.same.Identity.backward") for name in records[0])
