"""Front-door checks: unusable output folders and config paths are ConfigErrors naming the field,
MindSpore missing says how to install it, ``trainprobe.pytorch.save``, ``expert_load`` type."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from models import MLP
from test_metrics_helpers import tiny_gpt
from trainprobe import TrainerMonitorV2
from trainprobe.engine.errors import ConfigError
from trainprobe.frontdoors.metrics import TrainingMetricsMonitor
from trainprobe.frontdoors.monitor_v1 import TrainerMon

V2_MONITORS = {"param": {"enabled": True}}


def _blocker(tmp_path: Path) -> Path:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    return blocker


def test_v2_start_under_a_file_is_a_config_error_naming_output_dir(tmp_path: Path) -> None:
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2({"output_dir": str(_blocker(tmp_path) / "out"), "monitors": V2_MONITORS})
    with pytest.raises(ConfigError, match=r"^output_dir: cannot create the output folder .*a_file/out/rank_0"):
        mon.start(model=model, optimizer=opt)
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


def test_v2_start_with_a_name_too_long_is_a_config_error(tmp_path: Path) -> None:
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2({"output_dir": str(tmp_path / ("x" * 300)), "monitors": V2_MONITORS})
    with pytest.raises(ConfigError, match=r"^output_dir: cannot create the output folder .*File name too long"):
        mon.start(model=model, optimizer=opt)


def _v1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, output: Path, config_path: object = None) -> TrainerMon:
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(output))
    path = tmp_path / "monitor_config.json"
    path.write_text(json.dumps({"wg_distribution": True}), encoding="utf-8")
    return TrainerMon(str(path) if config_path is None else config_path, params_have_main_grad=False)


def test_v1_set_monitor_under_a_file_is_a_config_error_naming_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = _v1(tmp_path, monkeypatch, _blocker(tmp_path) / "out")
    with pytest.raises(ConfigError, match=r"^MONITOR_OUTPUT_DIR: cannot create the output folder .*a_file/out"):
        mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)


@pytest.mark.parametrize("bad", [3, None, [b"x"]])
def test_non_path_config_is_a_config_error_in_every_front_door(bad: object) -> None:
    """V1, the dump and the metrics monitor, as V2 already did."""
    from trainprobe.dump import PrecisionDebugger

    model, opt = tiny_gpt()
    if bad is not None:
        with pytest.raises(ConfigError, match="expected a path"):
            TrainerMon(bad)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="expected a path"):
            TrainingMetricsMonitor(bad, model, opt)  # type: ignore[arg-type]
    if bad == 3:
        with pytest.raises(ConfigError, match="expected a path"):
            PrecisionDebugger(config_path=bad)  # type: ignore[arg-type]


def test_config_path_that_is_a_folder_says_so(tmp_path: Path) -> None:
    from trainprobe.dump import PrecisionDebugger

    model, opt = tiny_gpt()
    for make in (TrainerMon, lambda p: TrainingMetricsMonitor(p, model, opt), PrecisionDebugger):
        with pytest.raises(ConfigError, match="is a folder; pass the path of the file inside it"):
            make(str(tmp_path))


def test_pytorch_save_is_exported_and_records(tmp_path: Path) -> None:
    import trainprobe.pytorch as tp

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"task": "statistics", "level": "debug", "dump_path": str(tmp_path / "d")}))
    debugger = tp.PrecisionDebugger(config_path=str(cfg))
    x = torch.ones(3, requires_grad=True)
    tp.save(x * 2, "y")
    debugger.step()
    found = list((tmp_path / "d").rglob("debug.json"))
    assert len(found) == 1
    assert list(json.loads(found[0].read_text())["data"])[:1] == ["y.0.debug"]
    assert "save" in tp.__all__


def _hide_mindspore(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``import mindspore`` fail as if it were not installed, and forget trainprobe's
    MindSpore modules so they are imported (and check) afresh."""
    monkeypatch.setitem(sys.modules, "mindspore", None)
    for name in [n for n in sys.modules if n == "trainprobe.mindspore" or n.startswith("trainprobe.mindspore.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys.modules["trainprobe"], "mindspore", None, raising=False)
    real_find_spec = __import__("importlib.util").util.find_spec

    def find_spec(name: str, *args: object) -> object:
        return None if name == "mindspore" else real_find_spec(name, *args)

    monkeypatch.setattr("importlib.util.find_spec", find_spec)


def test_mindspore_missing_v2_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    _hide_mindspore(monkeypatch)
    with pytest.raises(
        ConfigError, match=r"^fr: 'mindspore' cannot be used: .*pip install \"trainprobe\[mindspore\]\""
    ):
        TrainerMonitorV2({"monitors": V2_MONITORS}, fr="mindspore")


def test_mindspore_missing_v1_import_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    _hide_mindspore(monkeypatch)
    with pytest.raises(ImportError, match=r"pip install \"trainprobe\[mindspore\]\""):
        import trainprobe.mindspore  # noqa: F401


@pytest.mark.parametrize("bad", [[1.0, 2.0], "layer0", 3])
def test_expert_load_not_a_mapping_raises_at_the_call(tmp_path: Path, bad: object) -> None:
    model, opt = tiny_gpt()
    cfg = {
        "monitor_config": {"monitor_on": True, "dump_path": str(tmp_path / "d")},
        "tensorboard": {"tensorboard_dir": str(tmp_path / "tb"), "log_expert_load_to_tensorboard": True},
    }
    mon = TrainingMetricsMonitor(cfg, model, opt)
    try:
        with pytest.raises(TypeError, match=r"step\(expert_load=...\): expected a mapping"):
            mon.step(loss=1.0, expert_load=bad)  # type: ignore[arg-type]
        mon.step(loss=1.0, expert_load={"layer0": [1.0, 2.0]})  # a mapping still works
    finally:
        mon.close()


@pytest.mark.parametrize("field", ["monitor_config.dump_path", "tensorboard.tensorboard_dir"])
def test_metrics_folder_with_a_nul_byte_is_a_config_error(tmp_path: Path, field: str) -> None:
    model, opt = tiny_gpt()
    bad = str(tmp_path / "bad\0name")
    cfg: dict = {"monitor_config": {"monitor_on": True, "dump_path": str(tmp_path / "d"), "local_loss_format": "log"}}
    if field == "tensorboard.tensorboard_dir":
        cfg["tensorboard"] = {"tensorboard_dir": bad}
    else:
        cfg["monitor_config"]["dump_path"] = bad
    with pytest.raises(ConfigError, match=rf"^{field}: .* contains a NUL byte"):
        TrainingMetricsMonitor(cfg, model, opt)
    assert not model._forward_hooks and not opt._optimizer_step_pre_hooks


def test_v2_output_dir_with_a_nul_byte_is_a_config_error(tmp_path: Path) -> None:
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2({"output_dir": str(tmp_path / "a\0b"), "monitors": V2_MONITORS})
    with pytest.raises(ConfigError, match=r"^output_dir: .* contains a NUL byte"):
        mon.start(model=model, optimizer=opt)
