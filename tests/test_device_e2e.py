"""Every tool end to end on each device of the ``device`` fixture (tests/conftest.py): the CPU
always, ``cuda`` when one is present (``make test-gpu`` / ``pytest -k cuda``; skipped otherwise
with the reason).

What is checked on each device: the values written equal a float64 reference computed on the CPU
from the tensors the step used; training is bitwise unchanged against an unmonitored twin on the
same device (float32, bf16 autocast, fp16 autocast with ``GradScaler``); on CUDA, no host
synchronisation happens inside a monitored step (``torch.cuda.set_sync_debug_mode("error")``) and
the statistics reach the host in at most one device-to-host copy per monitor per step.

The twins' model has no embedding and no attention: their CUDA backward kernels accumulate with
atomics, so two unmonitored CUDA runs would already differ bitwise.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from conftest import assert_row_matches, rows_of, stats64, sync_point, write_config
from dump_models import TwoLinear
from models import MLP, no_hooks_left
from test_v1_support import by_name, make_v1, run_dir, table
from trainprobe import TrainerMonitorV2
from trainprobe.dump import PrecisionDebugger

V2_OPS = ["min", "max", "mean", "norm", "nans", "zeros"]
V2_ALL = {m: {"enabled": True, "ops": V2_OPS} for m in ("module", "weight_grad", "optimizer", "param")}
V1_OPS = ["min", "max", "norm", "mean", "zeros", "nans"]
V1_FULL = {
    "targets": {},
    "xy_distribution": True,
    "all_xy": True,
    "wg_distribution": True,
    "mv_distribution": True,
    "param_distribution": True,
    "ops": V1_OPS,
    "ndigits": 12,
}
PRECISIONS = ["fp32", "bf16", "fp16-scaler"]
NEEDS_CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device (torch.cuda.is_available() is False): CUDA-only check"
)


def cpu(t: torch.Tensor) -> torch.Tensor:
    """A detached CPU copy of ``t`` (the float64 reference is computed from it on the CPU)."""
    return t.detach().to("cpu", copy=True)


# -- the twins -------------------------------------------------------------------------------
class Block(nn.Module):
    """Linear → LayerNorm → GELU → Dropout → Linear: deterministic kernels on CPU and CUDA."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.act = nn.GELU()
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(self.act(self.norm(self.fc1(x)))))


def _autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager[Any]:
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


def train_twin(
    device: torch.device,
    precision: str,
    steps: int,
    attach: Callable[[nn.Module, torch.optim.Optimizer], Callable[[], None]] | None = None,
    *,
    around_step: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> tuple[list[torch.Tensor], nn.Module]:
    """Train :class:`Block` on ``device`` (the same seed, data and dropout masks every call);
    ``attach(model, opt)`` attaches a tool and returns its stop. Losses and the model come back."""
    torch.manual_seed(3)
    model = Block().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler(device.type, init_scale=1024.0) if precision == "fp16-scaler" else None
    stop = attach(model, opt) if attach is not None else None
    data = torch.Generator().manual_seed(4)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 16, generator=data).to(device)
        y = torch.randn(8, 8, generator=data).to(device)
        with around_step():
            with _autocast(device, precision):
                loss = nn.functional.mse_loss(model(x).float(), y)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())
    if stop is not None:
        stop()
    sync_point(device)
    return losses, model


def assert_same_training(a: tuple[list[torch.Tensor], nn.Module], b: tuple[list[torch.Tensor], nn.Module]) -> None:
    """Losses and final parameters bitwise equal."""
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True))
    for (name, p), (_, q) in zip(a[1].named_parameters(), b[1].named_parameters(), strict=True):
        assert torch.equal(p, q), name


def _skip_unsupported(device: torch.device, precision: str) -> None:
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        pytest.skip("this CUDA device has no bfloat16")


def v2_attach(
    tmp_path: Path, monitors: dict[str, Any]
) -> Callable[[nn.Module, torch.optim.Optimizer], Callable[[], None]]:
    def attach(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[], None]:
        cfg = {"output_dir": str(tmp_path / "out"), "monitors": monitors}
        mon = TrainerMonitorV2(write_config(tmp_path, cfg))
        mon.start(model=model, optimizer=opt)
        return mon.stop

    return attach


# -- Monitor V2 -------------------------------------------------------------------------------
def test_v2_every_monitor_matches_float64(tmp_path: Path, device: torch.device) -> None:
    model = MLP().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seen: dict[str, torch.Tensor] = {}
    hook = model.fc1.register_forward_hook(lambda m, a, o: seen.update(x=cpu(a[0]), h=cpu(o)))
    mon = TrainerMonitorV2(write_config(tmp_path, {"output_dir": str(tmp_path / "out"), "monitors": V2_ALL}))
    mon.start(model=model, optimizer=opt)
    snaps = []
    for _ in range(2):
        model(torch.randn(4, 6, device=device)).pow(2).mean().backward()
        snap = {"grad": {n: cpu(p.grad) for n, p in model.named_parameters()}}
        snap["origin"] = {n: cpu(p) for n, p in model.named_parameters()}
        opt.step()
        snap["updated"] = {n: cpu(p) for n, p in model.named_parameters()}
        snap["state"] = {n: {k: cpu(v) for k, v in opt.state[p].items()} for n, p in model.named_parameters()}
        snap.update(x=seen["x"], h=seen["h"])
        snaps.append(snap)
        opt.zero_grad(set_to_none=True)
    mon.stop()
    out = tmp_path / "out"
    for step, snap in enumerate(snaps):
        wg = [r for r in rows_of(out, "weight_grad") if int(r["step"]) == step]
        assert {r["module_name"] for r in wg} == set(snap["grad"])
        for row in wg:
            assert_row_matches(row, snap["grad"][row["module_name"]])
        params = [r for r in rows_of(out, "param") if int(r["step"]) == step]
        assert len(params) == 2 * len(snap["grad"])
        for row in params:
            source = snap["origin"] if row["scope"] == "param_origin" else snap["updated"]
            assert_row_matches(row, source[row["module_name"]])
        moments = [r for r in rows_of(out, "optimizer") if int(r["step"]) == step]
        assert len(moments) == 2 * len(snap["grad"])
        for row in moments:
            name, moment = row["module_name"].rsplit(".", 1)
            assert_row_matches(row, snap["state"][name][moment])
        module = {(r["module_name"], r["scope"]): r for r in rows_of(out, "module") if int(r["step"]) == step}
        assert_row_matches(module[("fc1.input.0", "forward")], snap["x"])
        assert_row_matches(module[("fc1.output.0", "forward")], snap["h"])
        relu = module[("act.output.0", "forward")]
        assert float(relu["zeros"]) == pytest.approx((torch.relu(snap["h"]).abs() < 1e-8).double().mean().item())
    hook.remove()
    assert no_hooks_left(model, opt)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_v2_training_bitwise_unchanged(tmp_path: Path, device: torch.device, precision: str) -> None:
    _skip_unsupported(device, precision)
    plain = train_twin(device, precision, 3)
    monitored = train_twin(device, precision, 3, v2_attach(tmp_path, V2_ALL))
    assert_same_training(plain, monitored)
    for name in ("module", "weight_grad", "optimizer", "param"):
        assert {int(r["step"]) for r in rows_of(tmp_path / "out", name)} == {0, 1, 2}, name
    # the values of half-precision activations are those of the tensors themselves (no overflow)
    assert all(math.isfinite(float(r["norm"])) for r in rows_of(tmp_path / "out", "module"))


# -- Monitor V1 -------------------------------------------------------------------------------
def close(row: dict[str, str], ref: torch.Tensor, rel: float = 1e-6) -> None:
    values = stats64(ref)
    for op in ("min", "max", "norm", "mean"):
        assert float(row[op]) == pytest.approx(values[op], rel=rel, abs=1e-11), (row["name"], op)


def test_v1_matches_float64_and_alerts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], device: torch.device
) -> None:
    model = MLP().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    cfg = {**V1_FULL, "alert": {"rules": [{"rule_name": "AnomalyNan"}], "dump": True}}
    mon = make_v1(tmp_path, monkeypatch, cfg)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    seen: dict[str, torch.Tensor] = {}
    model.fc1.register_forward_hook(lambda m, a, o: seen.update(x=cpu(a[0]), h=cpu(o)))
    ref: dict[str, torch.Tensor] = {}
    for step in range(3):
        model(torch.randn(4, 6, device=device)).pow(2).mean().backward()
        if step == 1:
            ref = {"grad": cpu(model.fc2.weight.grad), "before": cpu(model.fc2.weight), **seen}
        if step == 2:
            model.fc1.weight.grad[0, 0] = math.nan
        opt.step()
        if step == 1:
            state = opt.state[model.fc2.weight]
            ref.update(after=cpu(model.fc2.weight), m=cpu(state["exp_avg"]), v=cpu(state["exp_avg_sq"]))
        opt.zero_grad()
    mon.stop()
    folder = run_dir(tmp_path)

    def at1(kind: str, name: str) -> dict[str, str]:
        (row,) = by_name([r for r in table(folder, kind) if r["step"] == "1"], name)
        return row

    close(at1("grad_reduced", "0:fc2.weight"), ref["grad"])
    close(at1("grad_unreduced", "0:fc2.weight"), ref["grad"])
    close(at1("param_origin", "0:fc2.weight"), ref["before"])
    close(at1("param_updated", "0:fc2.weight"), ref["after"])
    close(at1("exp_avg", "0:fc2.weight"), ref["m"])
    close(at1("exp_avg_sq", "0:fc2.weight"), ref["v"])
    close(at1("actv", "0:fc1.input"), ref["x"])
    close(at1("actv", "0:fc1.output"), ref["h"])
    zeros = at1("actv", "0:act.output")
    assert float(zeros["zeros"]) == pytest.approx((torch.relu(ref["h"]).abs() < 1e-8).double().mean().item())
    alerts = capsys.readouterr().out
    assert "Rule AnomalyNan at step 2: 0:fc1.weight/rank0/post_grad" in alerts
    assert "step 0" not in alerts and "step 1" not in alerts
    dump = json.loads((tmp_path / "out" / "anomaly_detected" / "rank0" / "anomaly.json").read_text())
    assert any(k.startswith("0:fc1.weight/rank0/post_grad_step_2_") for k in dump)
    assert {entry["step"] for entry in dump.values()} == {2}


@pytest.mark.parametrize("precision", PRECISIONS)
def test_v1_training_bitwise_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device: torch.device, precision: str
) -> None:
    _skip_unsupported(device, precision)

    def attach(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[], None]:
        mon = make_v1(tmp_path, monkeypatch, V1_FULL)
        mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
        return mon.stop

    plain = train_twin(device, precision, 3)
    monitored = train_twin(device, precision, 3, attach)
    assert_same_training(plain, monitored)
    folder = run_dir(tmp_path)
    for kind in ("actv", "actv_grad", "grad_reduced", "exp_avg", "param_updated"):
        assert {r["step"] for r in table(folder, kind)} == {"0", "1", "2"}, kind


# -- the precision dump -------------------------------------------------------------------------
def _dump_json(root: Path, step: int = 0) -> dict[str, Any]:
    (rank,) = sorted((root / f"step{step}").iterdir())
    return json.loads((rank / "dump.json").read_text())["data"]


def _assert_stats(entry: dict[str, Any], t: torch.Tensor, rel: float = 1e-6) -> None:
    x = t.to(torch.float64)
    assert entry["shape"] == list(t.shape)
    for key, value in (("Max", x.max()), ("Min", x.min()), ("Mean", x.mean()), ("Norm", x.norm())):
        assert entry[key] == pytest.approx(value.item(), rel=rel, abs=1e-9), key


def _dumped_run(tmp_path: Path, device: torch.device, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """One dumped step of :class:`TwoLinear` on ``device``; the tensors it saw, on the CPU."""
    debugger = PrecisionDebugger(config_path=write_config(tmp_path, {"dump_path": str(tmp_path / "d"), **config}))
    model = TwoLinear().to(device)
    seen: dict[str, torch.Tensor] = {}
    model.linear_1.register_forward_hook(lambda m, a, o: seen.update(x=cpu(a[0]), h=cpu(o)))
    x = torch.randn(10, 8, device=device)
    debugger.start(model=model)
    model(x).sum().backward()
    debugger.stop()
    debugger.step()
    seen.update(w=cpu(model.linear_1.weight), gw=cpu(model.linear_1.weight.grad))
    return seen


@pytest.mark.parametrize("level", ["L0", "L1", "mix"])
def test_dump_statistics_match_float64(tmp_path: Path, device: torch.device, level: str) -> None:
    seen = _dumped_run(tmp_path, device, {"task": "statistics", "level": level})
    data = _dump_json(tmp_path / "d")
    if level in ("L0", "mix"):
        fwd = data["Module.linear_1.Linear.forward.0"]
        _assert_stats(fwd["input_args"][0], seen["x"])
        _assert_stats(fwd["output"][0], seen["h"])
        (grad,) = data["Module.linear_1.Linear.parameters_grad.0"]["weight"]
        _assert_stats(grad, seen["gw"])
    if level in ("L1", "mix"):
        linear = data["Functional.linear.0.forward"]
        _assert_stats(linear["input_args"][0], seen["x"])
        _assert_stats(linear["input_args"][1], seen["w"])
        _assert_stats(linear["output"][0], seen["h"])
    for entry in _tensor_entries(data):
        assert entry["Norm"] is not None and "device" not in json.dumps(entry)


def _tensor_entries(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, dict):
        if value.get("type") == "torch.Tensor":
            return [value]
        return [e for v in value.values() for e in _tensor_entries(v)]
    if isinstance(value, list):
        return [e for v in value for e in _tensor_entries(v)]
    return []


def test_dump_md5_of_device_tensors_is_the_crc_of_their_bytes(tmp_path: Path, device: torch.device) -> None:
    seen = _dumped_run(tmp_path, device, {"task": "statistics", "level": "L0", "statistics": {"summary_mode": "md5"}})
    fwd = _dump_json(tmp_path / "d")["Module.linear_1.Linear.forward.0"]
    for entry, t in ((fwd["input_args"][0], seen["x"]), (fwd["output"][0], seen["h"])):
        assert entry["md5"] == f"{zlib.crc32(t.numpy().tobytes()) & 0xFFFFFFFF:08x}"


def test_dump_tensor_task_saves_the_device_tensors(tmp_path: Path, device: torch.device) -> None:
    seen = _dumped_run(tmp_path, device, {"task": "tensor", "level": "L0"})
    (rank,) = sorted((tmp_path / "d" / "step0").iterdir())
    fwd = _dump_json(tmp_path / "d")["Module.linear_1.Linear.forward.0"]
    for entry, t in ((fwd["input_args"][0], seen["x"]), (fwd["output"][0], seen["h"])):
        saved = torch.load(rank / "dump_tensor_data" / entry["data_name"], weights_only=True)
        assert torch.equal(saved.cpu(), t)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_dump_training_bitwise_unchanged(tmp_path: Path, device: torch.device, precision: str) -> None:
    _skip_unsupported(device, precision)
    debugger = PrecisionDebugger(
        config_path=write_config(tmp_path, {"task": "statistics", "level": "mix", "dump_path": str(tmp_path / "d")})
    )

    models: list[nn.Module] = []

    @contextlib.contextmanager
    def dumped() -> Iterator[None]:
        debugger.start(model=models[0])
        try:
            yield
        finally:
            debugger.stop()
            debugger.step()

    def attach(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[], None]:
        models.append(model)
        return lambda: None

    plain = train_twin(device, precision, 2)
    dumped_run = train_twin(device, precision, 2, attach, around_step=dumped)
    assert_same_training(plain, dumped_run)
    assert (tmp_path / "d" / "step1").is_dir()


# -- training metrics and the callbacks ---------------------------------------------------------
def _f64_norm(tensors: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(cpu(t).double().pow(2).sum()) for t in tensors))


def test_metrics_match_float64(tmp_path: Path, device: torch.device) -> None:
    pytest.importorskip("tensorboard")
    from test_metrics_helpers import TINY, read_events, scalars, tiny_gpt
    from trainprobe.demo.gpt import synthetic_batches
    from trainprobe.frontdoors.metrics import TrainingMetricsMonitor

    model, opt = tiny_gpt()
    model.to(device)
    names = [n for n, _ in model.named_parameters()]
    config = {
        "monitor_config": {
            "monitor_on": True,
            "dump_path": str(tmp_path / "dump"),
            "target": ["layers\\.0\\."],
            "local_norm_format": "tensorboard",
            "device_local_norm_format": "tensorboard",
            "optimizer_state_format": "tensorboard",
            "weight_state_format": "tensorboard",
            "local_loss_format": "tensorboard",
        },
        "tensorboard": {"tensorboard_dir": str(tmp_path / "tb")},
    }
    mon = TrainingMetricsMonitor(config, model=model, optimizer=opt)
    batches = synthetic_batches(TINY, 4)
    ref: dict[int, dict[str, Any]] = {}
    for step in range(1, 3):
        loss = model.loss(next(batches).to(device))
        loss.backward()
        params = list(model.parameters())
        r: dict[str, Any] = {"loss": loss.item(), "grad": _f64_norm([p.grad for p in params])}
        r["local"] = {n: _f64_norm([p.grad]) for n, p in zip(names, params)}
        opt.step()
        opt.zero_grad(set_to_none=True)
        r["m"] = {n: _f64_norm([opt.state[p]["exp_avg"]]) for n, p in zip(names, params)}
        r["weight"] = _f64_norm(params)
        mon.step(loss=loss)
        ref[step] = r
    mon.close()
    s = scalars(read_events(tmp_path / "tb" / "rank_0"))
    f32 = 1.2e-7
    targeted = [n for n in names if n.startswith("layers.0.")]
    assert targeted
    for step, r in ref.items():
        assert s["loss"][step] == pytest.approx(r["loss"], rel=2e-6)
        assert s["grad-norm"][step] == pytest.approx(r["grad"], rel=f32)
        assert s["device_local_norm"][step] == pytest.approx(r["grad"], rel=f32)
        assert s["weight_norm"][step] == pytest.approx(r["weight"], rel=f32)
        assert s["local_loss"][step] == pytest.approx(r["loss"], rel=2e-6)
        for n in targeted:
            assert s[f"local_norm/{n}"][step] == pytest.approx(r["local"][n], rel=f32), n
            assert s[f"adam_m_norm/{n}"][step] == pytest.approx(r["m"][n], rel=f32), n


def test_transformers_callback(tmp_path: Path, device: torch.device) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tensorboard")
    from test_integrations_transformers import BATCH, SEQ, STEPS, Tokens
    from trainprobe.integrations.transformers import TrainProbeCallback

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=SEQ, n_embd=32, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
    )
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        per_device_train_batch_size=BATCH,
        max_steps=STEPS,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=device.type == "cpu",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    metrics = {"monitor_config": {"monitor_on": True}, "tensorboard": {"tensorboard_dir": str(tmp_path / "tb")}}
    v2 = {
        "output_dir": str(tmp_path / "v2"),
        "monitors": {"weight_grad": {"enabled": True}, "param": {"enabled": True}},
    }
    if device.type == "cuda" and hasattr(args, "_n_gpu"):
        args._n_gpu = 1  # one GPU, not DataParallel over every visible one
    callback = TrainProbeCallback(metrics_config=metrics, monitor_v2_config=v2)
    trainer = transformers.Trainer(
        model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=Tokens(32), callbacks=[callback]
    )
    trainer.train()
    assert next(trainer.model.parameters()).device.type == device.type
    from test_metrics_helpers import read_events, scalars

    s = scalars(read_events(tmp_path / "tb" / "rank_0"))
    logged = {e["step"]: e for e in trainer.state.log_history if "loss" in e}
    for step in range(1, STEPS + 1):
        assert s["grad-norm"][step] == pytest.approx(logged[step]["grad_norm"], rel=1e-5)
        assert s["loss"][step] == pytest.approx(logged[step]["loss"], abs=1e-4)
    assert len({r["step"] for r in rows_of(tmp_path / "v2", "weight_grad")}) == STEPS


# -- no hidden host synchronisation (CUDA) ------------------------------------------------------
def _count_device_to_host_copies(run: Callable[[], None]) -> int:
    """Device-to-host memory copies the CUDA profiler sees while ``run`` runs (and its writer
    threads finish: the caller stops the tool inside ``run``)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if "DtoH" in e.name or "Device -> Pinned" in e.name)


@contextlib.contextmanager
def no_sync() -> Iterator[None]:
    """Any host synchronisation of the CUDA stream raises inside (``set_sync_debug_mode``)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _v1_attach(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Callable[[], None]]:
    def attach(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[], None]:
        mon = make_v1(tmp_path, monkeypatch, V1_FULL)
        mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
        return mon.stop

    return attach


@NEEDS_CUDA
@pytest.mark.parametrize("tool", ["v2", "v1"])
def test_cuda_no_sync_inside_a_monitored_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tool: str
) -> None:
    """The monitored steps run under ``set_sync_debug_mode("error")``: a hidden ``.item()`` or
    host copy would raise (and the fault handler would disable the monitor: rows would be missing
    and an error logged). Then the device-to-host copies of a run are counted: at most one per
    monitor (V2: module, weight_grad, optimizer, param; V1: xy, wg, mv, param) per step, plus one
    each when the tool stops; a copy per tensor would be dozens per step."""
    device = torch.device("cuda")
    attach = v2_attach(tmp_path / "a", V2_ALL) if tool == "v2" else _v1_attach(tmp_path / "a", monkeypatch)
    plain = train_twin(device, "fp32", 3, around_step=no_sync)  # the loop itself is sync-free
    with caplog.at_level(logging.WARNING):
        monitored = train_twin(device, "fp32", 3, attach, around_step=no_sync)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert_same_training(plain, monitored)
    if tool == "v2":
        for name in V2_ALL:
            assert {int(r["step"]) for r in rows_of(tmp_path / "a" / "out", name)} == {0, 1, 2}, name
    else:
        for kind in ("actv", "grad_reduced", "exp_avg", "param_updated"):
            assert {r["step"] for r in table(run_dir(tmp_path / "a"), kind)} == {"0", "1", "2"}, kind
    steps, monitors = 4, 4
    attach = v2_attach(tmp_path / "b", V2_ALL) if tool == "v2" else _v1_attach(tmp_path / "b", monkeypatch)
    copies = _count_device_to_host_copies(lambda: train_twin(device, "fp32", steps, attach))
    assert 1 <= copies <= (steps + 1) * monitors, f"{copies} device-to-host copies, {steps} steps, {monitors} monitors"


@NEEDS_CUDA
def test_cuda_no_sync_inside_a_dumped_step(tmp_path: Path) -> None:
    """The dump's statistics stay on the device between ``start()`` and ``stop()``; they are
    read back once when the step's files are written."""
    device = torch.device("cuda")
    debugger = PrecisionDebugger(
        config_path=write_config(tmp_path, {"task": "statistics", "level": "mix", "dump_path": str(tmp_path / "d")})
    )
    model = TwoLinear().to(device)
    x = torch.randn(10, 8, device=device)
    for _ in range(2):
        debugger.start(model=model)
        with no_sync():
            model(x).sum().backward()
        debugger.stop()
        debugger.step()
    data = _dump_json(tmp_path / "d", 1)
    assert any(k.startswith("Module.linear_1.Linear.forward.") for k in data)
    assert any(k.startswith("Functional.linear.") for k in data)
    assert all(isinstance(e["Norm"], float) for e in _tensor_entries(data))


def test_lightning_callback(tmp_path: Path, device: torch.device) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    pytest.importorskip("tensorboard")
    from test_integrations_lightning import ACCUM, BATCH, STEPS, Regressor, loader
    from test_metrics_helpers import read_events, scalars
    from trainprobe.integrations.lightning import TrainProbeCallback

    torch.manual_seed(0)
    module = Regressor()
    metrics = {"monitor_config": {"monitor_on": True}, "tensorboard": {"tensorboard_dir": str(tmp_path / "tb")}}
    v2 = {
        "output_dir": str(tmp_path / "v2"),
        "monitors": {"weight_grad": {"enabled": True}, "param": {"enabled": True}},
    }
    trainer = pl.Trainer(
        max_steps=STEPS,
        accumulate_grad_batches=ACCUM,
        accelerator=device.type,
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[TrainProbeCallback(metrics_config=metrics, monitor_v2_config=v2)],
        default_root_dir=str(tmp_path),
    )
    trainer.fit(module, loader())
    assert next(module.parameters()).device.type == device.type
    s = scalars(read_events(tmp_path / "tb" / "rank_0"))
    for step in range(1, STEPS + 1):
        micro = module.losses[(step - 1) * ACCUM : step * ACCUM]
        assert s["loss"][step] == pytest.approx(sum(micro) / ACCUM, rel=1e-6)
        assert s["grad-norm"][step] == pytest.approx(module.grad_norms[step], rel=1e-5)
        assert s["batch-size"][step] == BATCH * ACCUM
    assert len({r["step"] for r in rows_of(tmp_path / "v2", "weight_grad")}) == STEPS
    assert len({r["step"] for r in rows_of(tmp_path / "v2", "param")}) == STEPS
