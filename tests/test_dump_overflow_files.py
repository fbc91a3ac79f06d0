"""Task overflow_check's tensor files and overflow_nums, and how ``.pt`` files are written
(snapshots, one file per tensor per step with hard links for repeats, files of a crashed run)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import write_config
from dump_models import ModuleOP
from trainprobe.dump import PrecisionDebugger
from trainprobe.engine.errors import ConfigError

INF = float("inf")


def rank_dir(root: Path, step: int = 0) -> Path:
    dirs = sorted((root / f"step{step}").iterdir())
    assert len(dirs) == 1, dirs
    return dirs[0]


def load(root: Path, step: int = 0) -> dict[str, Any]:
    return json.loads((rank_dir(root, step) / "dump.json").read_text())


def tensor_file(root: Path, entry: dict[str, Any]) -> torch.Tensor:
    return torch.load(rank_dir(root) / "dump_tensor_data" / entry["data_name"], weights_only=True)


def overflow_debugger(tmp_path: Path, level: str = "L1", overflow_nums: int | None = None) -> PrecisionDebugger:
    section: dict[str, Any] = {} if overflow_nums is None else {"overflow_nums": overflow_nums}
    config = {"task": "overflow_check", "level": level, "dump_path": str(tmp_path / "d"), "overflow_check": section}
    return PrecisionDebugger(config_path=write_config(tmp_path, config))


def test_overflow_check_saves_the_tensors_of_the_first_overflowing_api(tmp_path: Path) -> None:
    debugger = overflow_debugger(tmp_path)
    x = torch.tensor([1.0, 0.0, 2.0])
    debugger.start()
    y = x * 2
    z = torch.log(y - 2.0)  # log(0) = -inf, log(-2) = nan: the first overflow
    torch.exp(y * 100)  # overflows too, but overflow_nums defaults to 1
    debugger.stop()
    debugger.step()
    dump = load(tmp_path / "d")
    assert dump["dump_data_dir"] == str(rank_dir(tmp_path / "d") / "dump_tensor_data")
    record = dump["data"]["Torch.log.0.forward"]
    assert list(dump["data"]) == ["Torch.log.0.forward"]
    assert record["input_args"][0]["data_name"] == "Torch.log.0.forward.input.0.pt"
    assert record["output"][0]["data_name"] == "Torch.log.0.forward.output.0.pt"
    assert torch.equal(tensor_file(tmp_path / "d", record["input_args"][0]), y - 2.0)
    torch.testing.assert_close(tensor_file(tmp_path / "d", record["output"][0]), z, equal_nan=True, rtol=0, atol=0)
    files = sorted(p.name for p in (rank_dir(tmp_path / "d") / "dump_tensor_data").iterdir())
    assert files == ["Torch.log.0.forward.input.0.pt", "Torch.log.0.forward.output.0.pt"]


def test_overflow_nums_minus_one_keeps_every_overflow_over_steps(tmp_path: Path) -> None:
    debugger = overflow_debugger(tmp_path, overflow_nums=-1)
    y = torch.tensor([2.0, 0.0, 4.0])
    for _ in range(2):
        debugger.start()
        torch.log(y - 2.0)
        torch.exp(y * 100)
        debugger.stop()
        debugger.step()
    for step in (0, 1):
        assert list(load(tmp_path / "d", step)["data"]) == ["Torch.log.0.forward", "Torch.exp.0.forward"]


def test_overflow_nums_counts_over_the_whole_run(tmp_path: Path) -> None:
    debugger = overflow_debugger(tmp_path, overflow_nums=3)
    y = torch.tensor([2.0, 0.0])
    for _ in range(2):
        debugger.start()
        torch.log(y - 2.0)
        torch.exp(y * 100)
        debugger.stop()
        debugger.step()
    assert list(load(tmp_path / "d", 0)["data"]) == ["Torch.log.0.forward", "Torch.exp.0.forward"]
    assert list(load(tmp_path / "d", 1)["data"]) == ["Torch.log.0.forward"]
    assert debugger.collector.overflow_done


def test_inputs_of_an_in_place_api_are_saved_as_they_were_before_the_call(tmp_path: Path) -> None:
    debugger = overflow_debugger(tmp_path)
    x = torch.tensor([1.0, 2.0])
    debugger.start()
    x.mul_(torch.tensor([3e38, 3e38]))  # 6e38 overflows float32
    debugger.stop()
    debugger.step()
    record = load(tmp_path / "d")["data"]["Tensor.mul_.0.forward"]
    assert torch.equal(tensor_file(tmp_path / "d", record["input_args"][0]), torch.tensor([1.0, 2.0]))
    assert torch.equal(tensor_file(tmp_path / "d", record["output"][0]), torch.tensor([3e38, INF]))


def test_a_backward_overflow_is_kept_with_its_gradients(tmp_path: Path) -> None:
    debugger = overflow_debugger(tmp_path)
    x = torch.tensor([0.0, 4.0], requires_grad=True)
    debugger.start()
    torch.sqrt(x).sum().backward()  # forward finite; d sqrt(x)/dx at 0 is inf
    debugger.stop()
    debugger.step()
    data = load(tmp_path / "d")["data"]
    assert list(data) == ["Torch.sqrt.0.backward"]
    record = data["Torch.sqrt.0.backward"]
    assert torch.equal(tensor_file(tmp_path / "d", record["input"][0]), torch.ones(2))
    assert torch.equal(tensor_file(tmp_path / "d", record["output"][0]), torch.tensor([INF, 0.25]))


def test_l0_keeps_the_overflowing_module_with_its_parameters(tmp_path: Path) -> None:
    debugger = overflow_debugger(tmp_path, level="L0")
    model = ModuleOP()
    with torch.no_grad():
        model.linear.weight.fill_(3e38)
    debugger.start(model)
    model(torch.ones(2, 8))
    debugger.stop()
    debugger.step()
    data = load(tmp_path / "d")["data"]
    assert list(data) == ["Module.linear.Linear.forward.0"]
    params = data["Module.linear.Linear.forward.0"]["parameters"]
    assert params["weight"]["data_name"] == "Module.linear.Linear.forward.0.parameters.weight.pt"
    assert torch.equal(tensor_file(tmp_path / "d", params["weight"]), model.linear.weight.detach())
    assert torch.equal(tensor_file(tmp_path / "d", params["bias"]), model.linear.bias.detach())


def test_l0_keeps_overflowing_parameter_gradients(tmp_path: Path) -> None:
    debugger = overflow_debugger(tmp_path, level="L0", overflow_nums=-1)
    model = ModuleOP()
    debugger.start(model)
    out = model(torch.ones(2, 8))
    (out * torch.tensor(3e38)).sum().backward()  # the Linear's gradients: 3e38 summed over a batch of 2
    debugger.stop()
    debugger.step()
    data = load(tmp_path / "d")["data"]
    assert list(data) == ["Module.linear.Linear.parameters_grad.0"]
    grads = data["Module.linear.Linear.parameters_grad.0"]
    assert torch.equal(tensor_file(tmp_path / "d", grads["weight"][0]), model.linear.weight.grad)
    assert torch.equal(tensor_file(tmp_path / "d", grads["bias"][0]), model.linear.bias.grad)


@pytest.mark.parametrize("value", [0, -2, 1.5, "3", True])
def test_bad_overflow_nums_is_a_config_error(tmp_path: Path, value: Any) -> None:
    cfg = write_config(tmp_path, {"task": "overflow_check", "overflow_check": {"overflow_nums": value}})
    with pytest.raises(ConfigError, match=r"overflow_check.overflow_nums: must be an integer >= 1, or -1"):
        PrecisionDebugger(config_path=cfg)


# -- .pt files --------------------------------------------------------------------------------
def test_files_hold_the_value_at_the_time_of_the_call(tmp_path: Path) -> None:
    debugger = PrecisionDebugger(task="tensor", level="L1", dump_path=str(tmp_path / "d"))
    x = torch.tensor([-1.0, 2.0])
    debugger.start()
    y = torch.relu(x)
    y.add_(10.0)  # changes y in place after relu's output was dumped
    debugger.stop()
    debugger.step()
    data = load(tmp_path / "d")["data"]
    assert torch.equal(tensor_file(tmp_path / "d", data["Torch.relu.0.forward"]["output"][0]), torch.tensor([0.0, 2.0]))
    after = data["Tensor.add_.0.forward"]["output"][0]
    assert torch.equal(tensor_file(tmp_path / "d", after), torch.tensor([10.0, 12.0]))


def test_a_tensor_dumped_twice_in_a_step_is_serialised_once(tmp_path: Path) -> None:
    debugger = PrecisionDebugger(task="tensor", level="L1", dump_path=str(tmp_path / "d"))
    x = torch.randn(64, 64)
    debugger.start()
    y = torch.relu(x)
    torch.neg(y)  # y again, as neg's input
    debugger.stop()
    debugger.step()
    data = load(tmp_path / "d")["data"]
    a = rank_dir(tmp_path / "d") / "dump_tensor_data" / data["Torch.relu.0.forward"]["output"][0]["data_name"]
    b = rank_dir(tmp_path / "d") / "dump_tensor_data" / data["Torch.neg.0.forward"]["input_args"][0]["data_name"]
    assert a != b and a.read_bytes() == b.read_bytes()
    assert torch.equal(torch.load(b, weights_only=True), y)
    files = debugger.files
    assert files.bytes_written == 4 * x.numel() * 4  # relu in/out, neg in/out
    assert files.bytes_serialised == 3 * x.numel() * 4  # relu's output once


def test_files_of_ops_that_ran_survive_a_crash(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import torch
        from trainprobe.dump import PrecisionDebugger
        debugger = PrecisionDebugger(task="tensor", level="L1", dump_path={str(tmp_path / "d")!r})
        debugger.start()
        for _ in range(20):
            torch.relu(torch.randn(256, 1024))
        raise RuntimeError("the training crashed")
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "the training crashed" in proc.stderr
    files = list((tmp_path / "d").glob("step0/*/dump_tensor_data/*.pt"))
    assert len(files) == 40
    for f in files:
        assert torch.load(f, weights_only=True).shape == (256, 1024)
    assert not list((tmp_path / "d").glob("step0/*/dump.json"))  # JSON only at stop()/step()


def test_device_statistics_are_read_back_at_once_when_the_json_is_written() -> None:
    from trainprobe.dump import entries

    # On an accelerator the statistics row stays a device tensor; a CPU float64 row plays it here.
    rows = [torch.tensor([2.0, -1.0, 0.5, 5**0.5], dtype=torch.float64), torch.tensor([INF, 0.0, INF, INF]).double()]
    made = [entries._entry_with_statistics(torch.tensor([2.0, -1.0]), row) for row in rows]
    assert list(made[0]) == ["type", "dtype", "shape", "Max", "Min", "Mean", "Norm", "requires_grad", "_stats"]
    assert made[0]["Max"] is None
    assert [entries.has_overflow(e) for e in made] == [False, True]
    entries.resolve_pending()
    assert made[0] == {"type": "torch.Tensor", "dtype": "torch.float32", "shape": [2], "Max": 2.0, "Min": -1.0,
                       "Mean": 0.5, "Norm": 5**0.5, "requires_grad": False}  # fmt: skip
    assert (made[1]["Max"], made[1]["Min"], made[1]["Norm"]) == ("inf", 0.0, "inf")
    assert entries.has_overflow(made[1])


def test_backward_after_stop_is_added_by_step(tmp_path: Path) -> None:
    debugger = PrecisionDebugger(task="statistics", level="L0", dump_path=str(tmp_path / "d"))
    model = ModuleOP()
    debugger.start(model)
    out = model(torch.randn(3, 8))
    debugger.stop()  # before the backward, as the spec allows
    assert list(load(tmp_path / "d")["data"]) == ["Module.linear.Linear.forward.0"]
    out.sum().backward()
    debugger.step()
    assert list(load(tmp_path / "d")["data"]) == [
        "Module.linear.Linear.forward.0",
        "Module.linear.Linear.backward.0",
        "Module.linear.Linear.parameters_grad.0",
    ]


def test_a_backward_record_whose_verdict_changes_is_dropped_and_gives_its_place_back(tmp_path: Path) -> None:
    debugger = overflow_debugger(tmp_path, overflow_nums=1)
    x = torch.tensor([0.0, 4.0], requires_grad=True)
    debugger.start()
    y = torch.sqrt(x)
    debugger.stop()
    y.sum().backward(retain_graph=True)  # input gradient finite, output inf: kept, its files written
    assert debugger.collector.overflow_done
    assert debugger.store is not None
    debugger.store.files.wait()
    tensor_dir = rank_dir(tmp_path / "d") / "dump_tensor_data"
    assert sorted(p.name for p in tensor_dir.iterdir()) == [
        "Torch.sqrt.0.backward.input.0.pt",
        "Torch.sqrt.0.backward.output.0.pt",
    ]
    (y * torch.tensor([INF, 1.0])).sum().backward()  # now its input gradient overflows too
    debugger.step()
    assert load(tmp_path / "d")["data"] == {}
    assert list(tensor_dir.iterdir()) == []
    debugger.start()  # the dropped record's place in overflow_nums is free again
    torch.log(torch.tensor([-1.0]))
    debugger.stop()
    debugger.step()
    assert list(load(tmp_path / "d", 1)["data"]) == ["Torch.log.0.forward"]
