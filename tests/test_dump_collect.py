"""PrecisionDebugger on real models: the spec's examples, every level × task × summary_mode,
float64 agreement, bitwise-unchanged training, filters, faults and clean detachment."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import _get_current_function_mode_stack

from conftest import write_config
from dump_models import ConvNet, ModuleOP, TinyGPT, TwoLinear
from trainprobe.dump import PrecisionDebugger, module_dump, module_dump_end
from trainprobe.dump.compare_load import stacks_by_name
from trainprobe.engine.errors import ConfigError


def rank_dir(root: Path, step: int = 0) -> Path:
    dirs = sorted((root / f"step{step}").iterdir())
    assert len(dirs) == 1, dirs
    return dirs[0]


def load(root: Path, step: int = 0, file: str = "dump.json") -> dict[str, Any]:
    return json.loads((rank_dir(root, step) / file).read_text())


def tensor_entries(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, dict):
        if value.get("type") == "torch.Tensor":
            return [value]
        return [e for v in value.values() for e in tensor_entries(v)]
    if isinstance(value, list):
        return [e for v in value for e in tensor_entries(v)]
    return []


def ref64(t: torch.Tensor) -> dict[str, float]:
    x = t.detach().to(torch.float64)
    return {"Max": x.max().item(), "Min": x.min().item(), "Mean": x.mean().item(), "Norm": x.norm().item()}


def assert_stats(entry: dict[str, Any], t: torch.Tensor, rel: float = 1e-6) -> None:
    """The entry's statistics equal ``t``'s float64 ones (``t`` may be a float64 recomputation)."""
    assert entry["shape"] == list(t.shape)
    if t.dtype != torch.float64:
        assert entry["dtype"] == str(t.dtype)
    for key, value in ref64(t).items():
        assert entry[key] == pytest.approx(value, rel=rel, abs=1e-6 if rel > 1e-6 else 1e-9), key


def test_quick_start_l1_statistics_agree_with_float64(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, {"task": "statistics", "dump_path": str(tmp_path / "d"), "level": "L1"})
    debugger = PrecisionDebugger(config_path=cfg)
    model = ModuleOP()
    debugger.start(model=model)
    x = torch.randn(10, 8)
    out = model(x)
    out.sum().backward()
    debugger.stop()
    debugger.step()
    dump = load(tmp_path / "d")
    assert dump["task"] == "statistics" and dump["level"] == "L1" and dump["framework"] == "pytorch"
    data = dump["data"]
    assert list(data) == [
        "Functional.linear.0.forward",
        "Functional.relu.0.forward",
        "Tensor.sum.0.forward",
        "Tensor.sum.0.backward",
        "Functional.relu.0.backward",
        "Functional.linear.0.backward",
    ]
    linear = data["Functional.linear.0.forward"]
    assert_stats(linear["input_args"][0], x)
    assert_stats(linear["input_args"][1], model.linear.weight)
    pre = F.linear(x.double(), model.linear.weight.double(), model.linear.bias.double())
    assert_stats(linear["output"][0], pre, rel=1e-5)
    assert linear["output"][0]["requires_grad"] is True
    relu_bwd = data["Functional.relu.0.backward"]
    assert_stats(relu_bwd["input"][0], torch.ones(10, 4))  # d(sum)/d(relu out)
    assert_stats(relu_bwd["output"][0], (pre > 0).double())
    grouped = load(tmp_path / "d", file="stack.json")
    assert all(isinstance(v, list) and len(v) == 2 for v in grouped.values())  # {"0": [[names], [frames]]}
    stack = stacks_by_name(grouped)
    assert "dump_models.py" in stack["Functional.relu.0.forward"][0]
    assert "test_dump_collect.py" in stack["Functional.relu.0.forward"][-1] or any(
        "test_dump_collect" in s for s in stack["Functional.relu.0.forward"]
    )
    assert load(tmp_path / "d", file="construct.json") == {}


def test_l0_tensor_follows_the_spec_layout(tmp_path: Path) -> None:
    debugger = PrecisionDebugger(task="tensor", level="L0", dump_path=str(tmp_path))
    model = ConvNet()
    debugger.start(model)
    x = torch.randn(2, 3, 6, 6)
    model(x).sum().backward()
    debugger.stop()
    debugger.step()
    rd = rank_dir(tmp_path)
    data = load(tmp_path)["data"]
    fwd = data["Module.conv2.Conv2d.forward.0"]
    assert set(fwd) == {"input_args", "input_kwargs", "output", "parameters"}
    assert set(fwd["parameters"]) == {"weight", "bias"}
    assert fwd["parameters"]["bias"]["data_name"] == "Module.conv2.Conv2d.forward.0.parameters.bias.pt"
    assert fwd["input_args"][0]["data_name"] == "Module.conv2.Conv2d.forward.0.input.0.pt"
    grads = data["Module.conv2.Conv2d.parameters_grad.0"]
    assert grads["weight"][0]["data_name"] == "Module.conv2.Conv2d.parameters_grad.0.weight.pt"
    bwd = data["Module.conv2.Conv2d.backward.0"]
    assert bwd["input"][0]["data_name"] == "Module.conv2.Conv2d.backward.0.input.0.pt"
    assert "Module.Conv2d" not in json.dumps(list(data))  # the root is not dumped
    assert not any(name.startswith("Module.ConvNet") for name in data)
    for entry in tensor_entries(data):
        t = torch.load(rd / "dump_tensor_data" / entry["data_name"], weights_only=True)
        assert_stats(entry, t)
    w = torch.load(rd / "dump_tensor_data" / "Module.conv2.Conv2d.parameters_grad.0.weight.pt", weights_only=True)
    assert torch.equal(w, model.conv2.weight.grad)
    assert load(tmp_path, file="construct.json")["Module.conv2.Conv2d.forward.0"] is None


LEVELS = ["L0", "L1", "mix"]
TASKS = [("statistics", "statistics"), ("statistics", "md5"), ("statistics", "xor"), ("tensor", "statistics"),
         ("structure", "statistics"), ("overflow_check", "statistics")]  # fmt: skip


@pytest.mark.parametrize("model_name", ["conv", "gpt"])
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize(("task", "summary"), TASKS)
def test_every_level_task_and_summary_mode(
    tmp_path: Path, model_name: str, level: str, task: str, summary: str
) -> None:
    config = {"task": task, "level": level, "dump_path": str(tmp_path / "d"), task: {"summary_mode": summary}}
    debugger = PrecisionDebugger(config_path=write_config(tmp_path, config))
    if model_name == "conv":
        model: Any = ConvNet()
        inputs = torch.randn(2, 3, 5, 5)
        loss_fn = lambda: model(inputs).square().mean()  # noqa: E731
    else:
        model = TinyGPT()
        idx = torch.randint(0, 40, (2, 6))
        loss_fn = lambda: model.loss(idx)  # noqa: E731
    debugger.start(model)
    loss_fn().backward()
    debugger.stop()
    debugger.step()
    dump = load(tmp_path / "d")
    assert dump["task"] == task and dump["level"] == level
    data = dump["data"]
    if task == "overflow_check":
        assert data == {}  # finite model: nothing overflows
        return
    names = list(data)
    has_module = any(n.startswith("Module.") for n in names)
    has_api = any(not n.startswith("Module.") for n in names)
    assert has_module == (level in ("L0", "mix")) and has_api == (level in ("L1", "mix"))
    assert any(".backward" in n for n in names)
    construct = load(tmp_path / "d", file="construct.json")
    if level == "mix":
        assert any(not k.startswith("Module.") and v and v.startswith("Module.") for k, v in construct.items())
    entries = tensor_entries(data)
    assert entries
    for entry in entries:
        if task == "structure":
            assert "Max" not in entry and "md5" not in entry
        else:
            assert all(k in entry for k in ("Max", "Min", "Mean", "Norm"))
        if summary == "md5":
            assert len(entry["md5"]) == 8
        elif summary == "xor":
            assert len(entry["md5"]) == 16
        else:
            assert "md5" not in entry
        assert ("data_name" in entry) == (task == "tensor")
    if task == "tensor":
        files = list((rank_dir(tmp_path / "d") / "dump_tensor_data").glob("*.pt"))
        assert len(files) == len(entries)


def test_md5_is_crc32_of_the_bytes(tmp_path: Path) -> None:
    import zlib

    debugger = PrecisionDebugger(
        config_path=write_config(tmp_path, {"dump_path": str(tmp_path / "d"), "statistics": {"summary_mode": "md5"}})
    )
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    debugger.start()
    torch.relu(x)
    debugger.stop()
    debugger.step()
    entry = load(tmp_path / "d")["data"]["Torch.relu.0.forward"]["input_args"][0]
    assert entry["md5"] == f"{zlib.crc32(x.numpy().tobytes()):08x}"


def test_overflow_check_keeps_only_the_op_that_overflows(tmp_path: Path) -> None:
    debugger = PrecisionDebugger(task="overflow_check", level="L1", dump_path=str(tmp_path))
    x = torch.tensor([1.0, 0.0, 2.0], requires_grad=True)
    debugger.start()
    y = x * 2
    z = torch.log(y - 2.0)  # log(0) = -inf, log(-2) = nan
    w = z + 1  # inputs already overflow: not recorded
    debugger.stop()
    debugger.step()
    data = load(tmp_path)["data"]
    assert list(data) == ["Torch.log.0.forward"]
    assert "Torch.log.0.forward" in stacks_by_name(load(tmp_path, file="stack.json"))
    del w


def _train(
    model: torch.nn.Module, steps: int, debugger: PrecisionDebugger | None, level: str = "mix"
) -> list[torch.Tensor]:
    torch.manual_seed(5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        idx = torch.randint(0, 40, (3, 7))
        if debugger is not None:
            debugger.start(model if level != "L1" else None)
        loss = model.loss(idx)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if debugger is not None:
            debugger.stop()
            debugger.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(("level", "task"), [("mix", "statistics"), ("L1", "tensor"), ("L0", "statistics")])
def test_dumping_does_not_change_training_bitwise(tmp_path: Path, level: str, task: str) -> None:
    all_reduce = dist.all_reduce
    torch.manual_seed(1)
    model_a = TinyGPT()
    model_b = TinyGPT()
    model_b.load_state_dict(model_a.state_dict())
    plain = _train(model_a, 3, None)
    debugger = PrecisionDebugger(task=task, level=level, dump_path=str(tmp_path))
    dumped = _train(model_b, 3, debugger, level)
    assert all(torch.equal(a, b) for a, b in zip(plain, dumped))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step0", "step1", "step2"]
    names = list(load(tmp_path)["data"])
    adamw = ("Tensor.sqrt", "Tensor.mul_", "Tensor.addcdiv_")  # what AdamW's step() calls, dumped as the reference does
    assert any(n.startswith(adamw) for n in names) == (level != "L0")
    # nothing left behind: hooks, function modes, patched functions (API wrappers only pass calls through)
    for m in model_b.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
    assert all(not p._backward_hooks for p in model_b.parameters())
    assert _get_current_function_mode_stack() == []
    assert dist.all_reduce is all_reduce


def test_module_dump_dumps_only_the_module(tmp_path: Path) -> None:
    debugger = PrecisionDebugger(level="L1", dump_path=str(tmp_path))
    module = TwoLinear()
    debugger.start()
    x = torch.randn(10, 8)
    module_dump(module, "MyModuleOP")
    out = module(x)
    module_dump_end()
    loss = out.sum()
    loss.backward()
    debugger.stop()
    debugger.step()
    names = list(load(tmp_path)["data"])
    assert names[:2] == ["Module.MyModuleOP.TwoLinear.forward.0", "Tensor.sum.0.forward"]
    assert "Module.MyModuleOP.TwoLinear.backward.0" in names
    assert not any("linear" in n or "relu" in n for n in names)
    assert not module._forward_hooks and not module._forward_pre_hooks


def test_cross_file_class_level_start_stop(tmp_path: Path) -> None:
    PrecisionDebugger(level="L1", dump_path=str(tmp_path))
    module = TwoLinear(cross_file=True)
    out = module(torch.randn(10, 8))
    out.sum().backward()
    PrecisionDebugger.step()
    names = list(load(tmp_path)["data"])
    assert names[0] == "Functional.linear.0.forward"
    assert "Functional.linear.1.forward" not in names and not any("relu" in n for n in names)
    assert "Functional.linear.0.backward" in names


def test_save_debug_statistics_and_gradient(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, {"task": "statistics", "level": "debug", "dump_path": str(tmp_path / "d")})
    debugger = PrecisionDebugger(config_path=cfg)
    x = torch.randn(4, 3, requires_grad=True)
    y = x * 3
    PrecisionDebugger.save(y, "y")
    debugger.save({"a": y, "n": 2, "s": "hi"}, "z", save_backward=False)
    (y.square().sum()).backward()
    debugger.step()
    data = load(tmp_path / "d", file="debug.json")["data"]
    assert list(data) == ["y.0.debug", "z.0.debug", "y_grad.0.debug"]
    assert_stats(data["y.0.debug"], y)
    assert_stats(data["y_grad.0.debug"], 2 * y)
    assert data["z.0.debug"]["n"] == {"type": "int", "value": 2}
    assert data["z.0.debug"]["s"] == {"type": "str", "value": "hi"}


def test_save_tensor_task_writes_pt_files(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, {"task": "tensor", "level": "debug", "dump_path": str(tmp_path / "d")})
    debugger = PrecisionDebugger(config_path=cfg)
    x = torch.randn(5, requires_grad=True)
    debugger.save([x, x + 1], "pair")
    (x * 2).sum().backward()
    debugger.step()
    rd = rank_dir(tmp_path / "d")
    data = json.loads((rd / "debug.json").read_text())["data"]
    assert data["pair.0.debug"][1]["data_name"] == "pair.0.debug.1.pt"
    assert torch.equal(torch.load(rd / "dump_tensor_data" / "pair.0.debug.1.pt", weights_only=True), x.detach() + 1)
    assert torch.equal(
        torch.load(rd / "dump_tensor_data" / "pair_grad.0.debug.0.pt", weights_only=True), torch.full((5,), 2.0)
    )


def test_filters_list_scope_data_mode(tmp_path: Path) -> None:
    def run(section: dict[str, Any], sub: str) -> list[str]:
        out = tmp_path / sub
        cfg = write_config(tmp_path / f"c{sub}", {"level": "mix", "dump_path": str(out), "statistics": section})
        debugger = PrecisionDebugger(config_path=cfg)
        model = ConvNet()
        debugger.start(model)
        model(torch.randn(1, 3, 4, 4)).sum().backward()
        debugger.stop()
        debugger.step()
        return list(load(out)["data"])

    listed = run({"list": ["relu", "Module.fc."]}, "a")
    assert set(listed) == {
        "Functional.relu.0.forward",
        "Functional.relu.0.backward",
        "Functional.leaky_relu.0.forward",  # "relu" is a substring of it
        "Functional.leaky_relu.0.backward",
        "Module.fc.Linear.forward.0",
        "Module.fc.Linear.backward.0",
        "Module.fc.Linear.parameters_grad.0",
    }
    scoped = run(
        {"scope": ["Functional.relu.0.forward", "Functional.leaky_relu.0.forward"], "data_mode": ["forward"]}, "b"
    )
    # a module's record comes when it returns, after what ran inside it (the reference's order)
    assert scoped == ["Functional.relu.0.forward", "Functional.conv2d.1.forward", "Module.conv2.Conv2d.forward.0",
                      "Functional.leaky_relu.0.forward"]  # fmt: skip
    inputs_only = run({"data_mode": ["backward", "input"]}, "c")
    assert inputs_only and all(".backward" in n or "parameters_grad" in n for n in inputs_only)


def test_steps_rank_id_init_step_and_dump_enable(tmp_path: Path) -> None:
    cfg_path = write_config(tmp_path, {"dump_path": str(tmp_path / "d"), "step": ["1-2", 4], "dump_enable": True})
    debugger = PrecisionDebugger(config_path=cfg_path)
    debugger.set_init_step(1)
    for step in range(1, 6):
        if step == 2:
            cfg = json.loads(cfg_path.read_text())
            cfg["dump_enable"] = False
            cfg_path.write_text(json.dumps(cfg))
        if step == 4:
            cfg["dump_enable"] = True
            cfg_path.write_text(json.dumps(cfg) + " ")
        debugger.start(rank_id=7)
        torch.relu(torch.randn(3))
        debugger.stop()
        debugger.step()
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["step1", "step4"]
    assert [p.name for p in (tmp_path / "d" / "step4").iterdir()] == ["rank7"]


def test_token_range_dumps_only_those_forward_calls(tmp_path: Path) -> None:
    debugger = PrecisionDebugger(level="L0", dump_path=str(tmp_path))
    model = ModuleOP()
    debugger.start(model=model, token_range=[2, 3])
    with torch.no_grad():
        for token in range(1, 6):
            model(torch.full((1, 8), float(token)))
    debugger.stop()
    debugger.step()
    data = load(tmp_path)["data"]
    assert list(data) == ["Module.linear.Linear.forward.0", "Module.linear.Linear.forward.1"]
    assert [r["input_args"][0]["Max"] for r in data.values()] == [2.0, 3.0]  # tokens 2 and 3 (1-based)


def test_register_and_restore_custom_api(tmp_path: Path) -> None:
    import types

    custom = types.ModuleType("module_a")
    custom.compute = lambda x: x * 2 + 1  # type: ignore[attr-defined]
    original = custom.compute
    debugger = PrecisionDebugger(level="L1", dump_path=str(tmp_path))
    debugger.register_custom_api(custom, "compute")
    debugger.start()
    custom.compute(torch.ones(2))
    debugger.stop()
    debugger.step()
    debugger.restore_custom_api(custom, "compute")
    assert custom.compute is original
    names = list(load(tmp_path)["data"])
    assert names == ["module_a.compute.0.forward"]  # the ops inside are not dumped twice


def test_a_fault_disables_dumping_and_training_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trainprobe.dump import collector

    debugger = PrecisionDebugger(level="L1", dump_path=str(tmp_path))

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(collector, "value_entry", broken)
    debugger.start()
    y = torch.relu(torch.tensor([-1.0, 2.0]))
    debugger.stop()
    debugger.step()
    assert torch.equal(y, torch.tensor([0.0, 2.0]))
    log = (rank_dir(tmp_path) / "dump_error_info.log").read_text()
    assert "disk on fire" in log
    assert debugger.collector.disabled
    assert _get_current_function_mode_stack() == []


def test_async_dump_and_nan_statistics(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, {"task": "tensor", "async_dump": True, "dump_path": str(tmp_path / "d")})
    debugger = PrecisionDebugger(config_path=cfg)
    x = torch.tensor([1.0, float("nan"), 3.0])
    debugger.start()
    torch.abs(x)
    debugger.stop()
    debugger.step()
    entry = load(tmp_path / "d")["data"]["Torch.abs.0.forward"]["output"][0]
    assert entry["Max"] == "nan" and entry["Norm"] == "nan"
    t = torch.load(rank_dir(tmp_path / "d") / "dump_tensor_data" / entry["data_name"], weights_only=True)
    assert math.isnan(t[1].item())


def test_bad_arguments_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="level L0 dumps modules"):
        PrecisionDebugger(level="L0", dump_path=str(tmp_path)).start()
    with pytest.raises(ConfigError, match="token_range"):
        PrecisionDebugger(level="L1", dump_path=str(tmp_path)).start(model=ModuleOP(), token_range=[3, 1])
    with pytest.raises(ConfigError, match="rank_id"):
        PrecisionDebugger(level="L1", dump_path=str(tmp_path)).start(rank_id=-1)
    with pytest.raises(ConfigError, match=r"start\(model=\.\.\.\): expected a torch.nn.Module"):
        PrecisionDebugger(level="mix", dump_path=str(tmp_path)).start(model="net")
    with pytest.raises(ConfigError, match="level: 'L3' is not one of"):
        PrecisionDebugger(level="L3")
    with pytest.raises(ConfigError, match="task: 'tensors' is not one of"):
        PrecisionDebugger(task="tensors")


@pytest.mark.parametrize("level", ["L0", "L1"])
def test_a_tensor_changed_without_its_version_counter_is_summarised_again(tmp_path: Path, level: str) -> None:
    """A write through ``.data`` (as GradScaler.unscale_ or a weight clamp does) leaves autograd's
    version counter alone: the second call's statistics must still be the changed tensor's."""
    debugger = PrecisionDebugger(task="statistics", level=level, dump_path=str(tmp_path))
    linear = torch.nn.Linear(4, 3)
    model = torch.nn.Sequential(linear)
    x = torch.randn(2, 4)
    debugger.start(model)
    with torch.no_grad():
        model(x)
        linear.weight.data.mul_(2)
        x.data.mul_(3)
        model(x)
    debugger.stop()
    debugger.step()
    data = load(tmp_path)["data"]
    if level == "L0":
        second = data["Module.0.Linear.forward.1"]
        assert_stats(second["parameters"]["weight"], linear.weight)
    else:
        second = data["Functional.linear.1.forward"]
        assert_stats(second["input_args"][1], linear.weight)
    assert_stats(second["input_args"][0], x)


def test_the_log_line_names_the_files_save_writes(tmp_path: Path) -> None:
    """A dump of save() calls writes debug.json alone, and its one INFO line says so."""
    import subprocess
    import sys

    cfg = write_config(tmp_path, {"task": "statistics", "level": "debug", "dump_path": str(tmp_path / "d")})
    code = (
        "import logging, torch\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "from trainprobe import PrecisionDebugger\n"
        f"d = PrecisionDebugger(config_path={str(cfg)!r})\n"
        "y = torch.randn(3, requires_grad=True) * 3\n"
        "PrecisionDebugger.save(y, 'y'); y.sum().backward(); d.step()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if "trainprobe dump: writing" in line]
    assert len(said) == 1 and "writing debug.json per step, first under " in said[0], done.stderr
