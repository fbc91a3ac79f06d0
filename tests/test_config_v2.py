"""Monitor V2 config: every ConfigError names the JSON path and says what is accepted."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch

from trainprobe import ConfigError, TrainerMonitorV2
from trainprobe.engine.schedule import Schedule
from trainprobe.engine.stats.ops import DEFAULT_EPS, DEFAULT_OPS
from trainprobe.frontdoors.monitor_v2.config import (
    CcConfig,
    ModuleMonitorConfig,
    MonitorV2Config,
    load_monitor_v2_config,
)

TOP_KEYS = (
    "framework, output_dir, format, async_write, rank, start_step, stop_step, step_interval, "
    "step_count_per_record, patch_optimizer_step, collect_times, global_stats, anomaly, monitors"
)
OPS_LIST = "min, max, mean, norm, nans, zeros"


def exact(message: str) -> str:
    """A ``match=`` pattern for exactly ``message``."""
    return f"^{re.escape(message)}$"


def write(tmp_path: Path, data, name: str = "monitor_v2_config.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data), encoding="utf-8")
    return path


def load_both_ways(tmp_path: Path, data: dict, **kwargs) -> MonitorV2Config:
    """Load ``data`` from a dict and from a file; both must give the same config."""
    from_dict = load_monitor_v2_config(data, **kwargs)
    from_file = load_monitor_v2_config(write(tmp_path, data), **kwargs)
    assert from_dict == from_file
    return from_dict


def raises_both_ways(tmp_path: Path, data: dict, message: str, **kwargs) -> None:
    """``data`` is rejected with exactly ``message``, as a dict, as a file and via TrainerMonitorV2."""
    with pytest.raises(ConfigError, match=exact(message)):
        load_monitor_v2_config(data, **kwargs)
    path = write(tmp_path, data)
    with pytest.raises(ConfigError, match=exact(message)):
        load_monitor_v2_config(path, **kwargs)
    with pytest.raises(ConfigError, match=exact(message)):
        TrainerMonitorV2(str(path), fr=kwargs.get("framework"))


@pytest.fixture(autouse=True)
def _rank_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)


# -- unknown keys and names ------------------------------------------------------------


def test_unknown_top_level_key_with_hint(tmp_path: Path) -> None:
    raises_both_ways(
        tmp_path,
        {"monitor": {}},
        f"monitor: unknown field; did you mean 'monitors'? Known fields: {TOP_KEYS}",
    )


def test_unknown_top_level_key_typo_of_step(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=re.escape("start_stpe: unknown field; did you mean 'start_step'?")):
        load_monitor_v2_config({"start_stpe": 1})


def test_unknown_top_level_key_without_hint() -> None:
    with pytest.raises(ConfigError, match=r"^xyz: unknown field") as info:
        load_monitor_v2_config({"xyz": 1})
    assert "did you mean" not in str(info.value)
    assert str(info.value).endswith(f"Known fields: {TOP_KEYS}")


def test_unknown_key_inside_monitor(tmp_path: Path) -> None:
    raises_both_ways(
        tmp_path,
        {"monitors": {"module": {"enabeld": True}}},
        "monitors.module.enabeld: unknown field; did you mean 'enabled'? "
        "Known fields: enabled, ops, eps, targets, record_eval_mode",
    )


def test_unknown_key_inside_weight_grad() -> None:
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "monitors.weight_grad.grad_acc_step: unknown field; did you mean 'grad_acc_steps'? "
            "Known fields: enabled, ops, eps, monitor_mbs_grad, micro_batch_number, grad_acc_steps"
        ),
    ):
        load_monitor_v2_config({"monitors": {"weight_grad": {"enabled": True, "grad_acc_step": 2}}})


def test_v1_style_key_inside_monitor_rejected() -> None:
    with pytest.raises(ConfigError, match=r"^monitors\.optimizer\.wg_distribution: unknown field"):
        load_monitor_v2_config({"monitors": {"optimizer": {"wg_distribution": True}}})


def test_unknown_monitor_name(tmp_path: Path) -> None:
    raises_both_ways(
        tmp_path,
        {"monitors": {"modul": {"enabled": True}}},
        "monitors.modul: unknown field; did you mean 'module'? Known fields: module, weight_grad, optimizer, param, cc",
    )


def test_unknown_monitor_name_fsdp_grad() -> None:
    with pytest.raises(ConfigError, match=r"^monitors\.fsdp_grad: unknown field"):
        load_monitor_v2_config({"monitors": {"fsdp_grad": {"enabled": True}}})


# -- wrong types -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "data,message",
    [
        ({"start_step": "3"}, "start_step: must be an integer, not a string '3'"),
        ({"start_step": 1.5}, "start_step: must be an integer, not a number 1.5"),
        ({"start_step": True}, "start_step: must be an integer, not a boolean True"),
        ({"stop_step": [5]}, "stop_step: must be an integer, not a list [5]"),
        ({"step_interval": "2"}, "step_interval: must be an integer, not a string '2'"),
        ({"collect_times": 2.5}, "collect_times: must be an integer, not a number 2.5"),
        ({"step_count_per_record": {}}, "step_count_per_record: must be an integer, not an object {}"),
        ({"output_dir": ["a"]}, "output_dir: must be a string, not a list ['a']"),
        ({"output_dir": 3}, "output_dir: must be a string, not an integer 3"),
        ({"framework": 1}, "framework: must be a string, not an integer 1"),
        ({"format": False}, "format: must be a string, not a boolean False"),
        ({"async_write": "yes"}, "async_write: must be true or false, not a string 'yes'"),
        ({"patch_optimizer_step": 1}, "patch_optimizer_step: must be true or false, not an integer 1"),
        ({"monitors": {"module": {"enabled": 1}}}, "monitors.module.enabled: must be true or false, not an integer 1"),
        (
            {"monitors": {"weight_grad": {"enabled": "true"}}},
            "monitors.weight_grad.enabled: must be true or false, not a string 'true'",
        ),
        (
            {"monitors": {"module": {"record_eval_mode": 0}}},
            "monitors.module.record_eval_mode: must be true or false, not an integer 0",
        ),
        (
            {"monitors": {"weight_grad": {"monitor_mbs_grad": "no"}}},
            "monitors.weight_grad.monitor_mbs_grad: must be true or false, not a string 'no'",
        ),
        (
            {"monitors": {"optimizer": {"mv_distribution": 1}}},
            "monitors.optimizer.mv_distribution: must be true or false, not an integer 1",
        ),
        (
            {"monitors": {"param": {"param_distribution": []}}},
            "monitors.param.param_distribution: must be true or false, not a list []",
        ),
        (
            {"monitors": {"weight_grad": {"micro_batch_number": "4"}}},
            "monitors.weight_grad.micro_batch_number: must be an integer, not a string '4'",
        ),
        ({"monitors": {"module": {"eps": "x"}}}, "monitors.module.eps: must be a finite number, not a string 'x'"),
        ({"monitors": {"module": {"eps": True}}}, "monitors.module.eps: must be a finite number, not a boolean True"),
        (
            {"monitors": {"module": {"targets": "mlp"}}},
            "monitors.module.targets: must be a list of strings, not a string",
        ),
        (
            {"monitors": {"module": {"targets": ["mlp", 1]}}},
            "monitors.module.targets[1]: must be a string, not an integer 1",
        ),
        (
            {"monitors": {"cc": {"cc_codeline": "a.py[1]"}}},
            "monitors.cc.cc_codeline: must be a list of strings, not a string",
        ),
        (
            {"monitors": {"cc": {"cc_pre_hook": "y"}}},
            "monitors.cc.cc_pre_hook: must be true or false, not a string 'y'",
        ),
        (
            {"monitors": {"cc": {"module_ranks": 0}}},
            "monitors.cc.module_ranks: must be a list of integers, not an integer",
        ),
        ({"monitors": []}, "monitors: must be an object, not a list"),
        ({"monitors": {"module": True}}, "monitors.module: must be an object, not a boolean"),
        ({"monitors": {"cc": "on"}}, "monitors.cc: must be an object, not a string"),
    ],
)
def test_wrong_types(tmp_path: Path, data: dict, message: str) -> None:
    raises_both_ways(tmp_path, data, message)


def test_nan_eps_rejected() -> None:
    with pytest.raises(ConfigError, match=exact("monitors.param.eps: must be a finite number, not a number nan")):
        load_monitor_v2_config({"monitors": {"param": {"eps": float("nan")}}})


# -- ops -------------------------------------------------------------------------------


def test_unknown_op(tmp_path: Path) -> None:
    raises_both_ways(
        tmp_path,
        {"monitors": {"weight_grad": {"enabled": True, "ops": ["min", "nrom"]}}},
        f"monitors.weight_grad.ops[1]: 'nrom' is not one of {OPS_LIST}",
    )


def test_unknown_op_in_each_monitor() -> None:
    for name in ("module", "weight_grad", "optimizer", "param", "cc"):
        with pytest.raises(ConfigError, match=exact(f"monitors.{name}.ops[0]: 'std' is not one of {OPS_LIST}")):
            load_monitor_v2_config({"monitors": {name: {"enabled": True, "ops": ["std"]}}})


def test_non_string_op() -> None:
    with pytest.raises(ConfigError, match=exact(f"monitors.module.ops[2]: 3 is not one of {OPS_LIST}")):
        load_monitor_v2_config({"monitors": {"module": {"ops": ["min", "max", 3]}}})


def test_ops_not_a_list(tmp_path: Path) -> None:
    raises_both_ways(
        tmp_path,
        {"monitors": {"optimizer": {"enabled": True, "ops": "norm"}}},
        f"monitors.optimizer.ops: must be a list of op names ({OPS_LIST}), not a string",
    )


def test_ops_order_preserved_and_duplicates_dropped(tmp_path: Path) -> None:
    cfg = load_both_ways(
        tmp_path,
        {"monitors": {"weight_grad": {"enabled": True, "ops": ["norm", "nans", "min", "norm", "NANS", "zeros"]}}},
    )
    assert cfg.weight_grad.ops == ("norm", "nans", "min", "zeros")


@pytest.mark.parametrize("ops", [[], None])
def test_empty_or_absent_ops_use_default(tmp_path: Path, ops) -> None:
    entry = {"enabled": True}
    if ops is not None:
        entry["ops"] = ops
    cfg = load_both_ways(tmp_path, {"monitors": {"param": entry}})
    assert cfg.param.ops == DEFAULT_OPS == ("min", "max", "mean", "norm", "nans")


def test_every_monitor_has_default_ops_and_eps() -> None:
    cfg = load_monitor_v2_config({})
    for name in ("module", "weight_grad", "optimizer", "param", "cc"):
        monitor = getattr(cfg, name)
        assert monitor.ops == DEFAULT_OPS and monitor.eps == DEFAULT_EPS == 1e-8


# -- numeric bounds --------------------------------------------------------------------


@pytest.mark.parametrize(
    "data,message",
    [
        ({"start_step": -1}, "start_step: must be >= 0, got -1"),
        ({"stop_step": -3}, "stop_step: must be >= 0, got -3"),
        (
            {"start_step": 5, "stop_step": 5},
            "stop_step: must be greater than start_step (5), got 5; stop_step is exclusive",
        ),
        (
            {"start_step": 5, "stop_step": 3},
            "stop_step: must be greater than start_step (5), got 3; stop_step is exclusive",
        ),
        ({"stop_step": 0}, "stop_step: must be greater than start_step (0), got 0; stop_step is exclusive"),
        ({"step_interval": 0}, "step_interval: must be >= 1, got 0"),
        ({"collect_times": 0}, "collect_times: must be >= 1, got 0"),
        ({"collect_times": -5}, "collect_times: must be >= 1, got -5"),
        ({"step_count_per_record": 0}, "step_count_per_record: must be >= 1, got 0"),
        ({"monitors": {"module": {"eps": 0}}}, "monitors.module.eps: must be greater than 0, got 0"),
        ({"monitors": {"cc": {"eps": -1e-8}}}, "monitors.cc.eps: must be greater than 0, got -1e-08"),
        (
            {"monitors": {"weight_grad": {"grad_acc_steps": 0}}},
            "monitors.weight_grad.grad_acc_steps: must be >= 1, got 0",
        ),
        (
            {"monitors": {"weight_grad": {"micro_batch_number": -2}}},
            "monitors.weight_grad.micro_batch_number: must be >= 1, got -2",
        ),
        ({"monitors": {"cc": {"module_ranks": [0, -1]}}}, "monitors.cc.module_ranks[1]: must be >= 0, got -1"),
    ],
)
def test_bounds(tmp_path: Path, data: dict, message: str) -> None:
    raises_both_ways(tmp_path, data, message)


def test_schedule_fields_parsed(tmp_path: Path) -> None:
    data = {"start_step": 2, "stop_step": 30, "step_interval": 3, "collect_times": 5, "step_count_per_record": 2}
    cfg = load_both_ways(tmp_path, data)
    assert cfg.schedule == Schedule(
        start_step=2, stop_step=30, step_interval=3, collect_times=5, step_count_per_record=2
    )


def test_null_fields_mean_default() -> None:
    cfg = load_monitor_v2_config({"stop_step": None, "collect_times": None, "rank": None, "monitors": None})
    assert cfg == load_monitor_v2_config({})
    assert cfg.schedule == Schedule() and cfg.ranks == ()


# -- format / framework ----------------------------------------------------------------


def test_format_tensorboard_rejected(tmp_path: Path) -> None:
    raises_both_ways(tmp_path, {"format": "tensorboard"}, "format: 'tensorboard' is not one of csv, parquet")


def test_format_csv_case_insensitive() -> None:
    assert load_monitor_v2_config({"format": "CSV"}).format == "csv"


def test_framework_unknown(tmp_path: Path) -> None:
    raises_both_ways(tmp_path, {"framework": "jax"}, "framework: 'jax' is not one of pytorch, mindspore, ms, pt, torch")


@pytest.mark.parametrize("value", ["mindspore", "ms", "MindSpore", " MS "])
def test_framework_mindspore_aliases(value: str) -> None:
    # the dialect accepts it; whether MindSpore is installed is checked by the front door
    # (tests/test_mindspore_config.py)
    assert load_monitor_v2_config({"framework": value}).framework == "mindspore"


@pytest.mark.parametrize("value", ["pytorch", "pt", "torch", "PyTorch", "Torch"])
def test_framework_pytorch_aliases(value: str) -> None:
    assert load_monitor_v2_config({"framework": value}).framework == "pytorch"


@pytest.mark.parametrize("fr", ["pytorch", "pt", "torch", "PT"])
def test_fr_override_aliases(tmp_path: Path, fr: str) -> None:
    # fr wins over the file's framework, even one that would be rejected
    path = write(tmp_path, {"framework": "mindspore"})
    assert load_monitor_v2_config(path, framework=fr).framework == "pytorch"
    assert TrainerMonitorV2(path, fr=fr).config.framework == "pytorch"


@pytest.mark.parametrize("fr", ["mindspore", "ms"])
def test_fr_override_mindspore(tmp_path: Path, fr: str) -> None:
    path = write(tmp_path, {"framework": "pytorch"})
    assert load_monitor_v2_config(path, framework=fr).framework == "mindspore"


def test_fr_override_unknown(tmp_path: Path) -> None:
    path = write(tmp_path, {})
    with pytest.raises(ConfigError, match=exact("fr: 'jax' is not one of pytorch, mindspore, ms, pt, torch")):
        TrainerMonitorV2(path, fr="jax")
    with pytest.raises(ConfigError, match=exact("fr: must be a string such as 'pytorch', not 3")):
        TrainerMonitorV2(path, fr=3)  # type: ignore[arg-type]


def test_default_framework_is_pytorch() -> None:
    assert load_monitor_v2_config({}).framework == "pytorch"


# -- rank ------------------------------------------------------------------------------


def test_rank_as_int_and_list(tmp_path: Path) -> None:
    assert load_both_ways(tmp_path, {"rank": 3}).ranks == (3,)
    assert load_both_ways(tmp_path, {"rank": [0, 2, 5]}).ranks == (0, 2, 5)
    cfg = load_both_ways(tmp_path, {"rank": []})
    assert cfg.ranks == () and cfg.monitors_rank(0) and cfg.monitors_rank(17)
    cfg = load_monitor_v2_config({"rank": [1, 3]})
    assert cfg.monitors_rank(3) and not cfg.monitors_rank(0)


@pytest.mark.parametrize(
    "rank,message",
    [
        (-1, "rank: must be >= 0, got -1"),
        ([0, -1], "rank[1]: must be >= 0, got -1"),
        ("0", "rank: must be an integer, not a string '0'"),
        ([0.5], "rank[0]: must be an integer, not a number 0.5"),
        ([0, "1"], "rank[1]: must be an integer, not a string '1'"),
        (True, "rank: must be an integer, not a boolean True"),
    ],
)
def test_rank_invalid(tmp_path: Path, rank, message: str) -> None:
    raises_both_ways(tmp_path, {"rank": rank}, message)


# -- the file itself -------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.json"
    message = f"config file {str(path)!r} does not exist; pass the path of a JSON file"
    with pytest.raises(ConfigError, match=exact(message)):
        load_monitor_v2_config(path)
    with pytest.raises(ConfigError, match=exact(message)):
        TrainerMonitorV2(str(path))


def test_directory_is_not_a_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a folder; pass the path of the file inside it"):
        TrainerMonitorV2(tmp_path)


def test_invalid_json_names_line_and_column(tmp_path: Path) -> None:
    path = write(tmp_path, '{\n  "start_step": 1\n  "stop_step": 2\n}\n')
    message = f"config file {str(path)!r} is not valid JSON: Expecting ',' delimiter at line 3 column 3"
    with pytest.raises(ConfigError, match=exact(message)):
        load_monitor_v2_config(path)
    with pytest.raises(ConfigError, match=exact(message)):
        TrainerMonitorV2(path)


def test_invalid_json_trailing_comma(tmp_path: Path) -> None:
    path = write(tmp_path, '{"monitors": {"module": {"enabled": true,}}}')
    with pytest.raises(ConfigError, match=r"is not valid JSON: .* at line 1 column \d+$"):
        TrainerMonitorV2(path)


def test_empty_file(tmp_path: Path) -> None:
    path = write(tmp_path, "")
    with pytest.raises(ConfigError, match=re.escape("is not valid JSON: Expecting value at line 1 column 1")):
        load_monitor_v2_config(path)


def test_not_utf8_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_bytes(b'{"output_dir": "\xff\xfe"}')
    with pytest.raises(ConfigError, match=r"cannot be read"):
        load_monitor_v2_config(path)


@pytest.mark.parametrize(
    "text,kind",
    [("[1, 2]", "a list"), ('"csv"', "a string"), ("3", "an integer"), ("null", "null"), ("true", "a boolean")],
)
def test_top_level_not_an_object(tmp_path: Path, text: str, kind: str) -> None:
    path = write(tmp_path, text)
    message = f"config file {str(path)!r}: the top level must be a JSON object, not {kind}"
    with pytest.raises(ConfigError, match=exact(message)):
        TrainerMonitorV2(str(path))


def test_path_may_be_str_or_pathlib(tmp_path: Path) -> None:
    path = write(tmp_path, {"output_dir": "out", "rank": 0})
    assert load_monitor_v2_config(str(path)) == load_monitor_v2_config(path)
    assert (
        TrainerMonitorV2(str(path)).config
        == TrainerMonitorV2(path).config
        == TrainerMonitorV2({"output_dir": "out", "rank": 0}).config
    )


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


# -- full example and defaults ---------------------------------------------------------


def test_quick_start_example(tmp_path: Path) -> None:
    data = {
        "framework": "pytorch",
        "output_dir": "./monitor_v2_out",
        "rank": [0],
        "start_step": 0,
        "step_interval": 1,
        "step_count_per_record": 1,
        "collect_times": 100,
        "format": "csv",
        "monitors": {
            "weight_grad": {
                "enabled": True,
                "ops": ["min", "max", "mean", "norm", "nans"],
                "eps": 1e-8,
                "monitor_mbs_grad": False,
            }
        },
    }
    cfg = load_both_ways(tmp_path, data)
    assert cfg.enabled_monitors() == ["weight_grad"]
    assert cfg.output_dir == Path("./monitor_v2_out")
    assert cfg.ranks == (0,)
    assert cfg.schedule == Schedule(collect_times=100)
    assert cfg.weight_grad.monitor_mbs_grad is False
    assert cfg.async_write is None and cfg.patch_optimizer_step is None


def test_defaults() -> None:
    cfg = load_monitor_v2_config({})
    assert cfg.framework == "pytorch"
    assert cfg.output_dir == Path("./") and cfg.format == "csv" and cfg.ranks == ()
    assert cfg.schedule == Schedule()
    assert cfg.enabled_monitors() == []
    assert cfg.optimizer.mv_distribution is True and cfg.param.param_distribution is True
    assert cfg.weight_grad.micro_batch_number is None and cfg.weight_grad.grad_acc_steps is None
    assert cfg.cc == CcConfig(ops=DEFAULT_OPS)


def test_optional_booleans_keep_absent_as_none() -> None:
    cfg = load_monitor_v2_config({"async_write": False, "patch_optimizer_step": True})
    assert cfg.async_write is False and cfg.patch_optimizer_step is True
    cfg = load_monitor_v2_config({"async_write": True, "patch_optimizer_step": False})
    assert cfg.async_write is True and cfg.patch_optimizer_step is False


def test_empty_output_dir_is_current_dir() -> None:
    assert load_monitor_v2_config({"output_dir": ""}).output_dir == Path("./")


def test_all_monitor_fields(tmp_path: Path) -> None:
    data = {
        "monitors": {
            "module": {"targets": ["encoder.layers.0", "mlp"], "record_eval_mode": True, "eps": 1e-6},
            "weight_grad": {"enabled": True, "monitor_mbs_grad": True, "micro_batch_number": 4, "grad_acc_steps": 8},
            "optimizer": {"enabled": True, "mv_distribution": False, "ops": ["norm"]},
            "param": {"enabled": True, "param_distribution": False},
            "cc": {
                "enabled": True,
                "cc_codeline": ["train.py[23]"],
                "cc_log_only": True,
                "cc_pre_hook": True,
                "module_ranks": [0, 1],
            },
        }
    }
    cfg = load_both_ways(tmp_path, data)
    assert cfg.enabled_monitors() == ["module", "weight_grad", "optimizer", "param", "cc"]
    assert cfg.module == ModuleMonitorConfig(
        enabled=True, ops=DEFAULT_OPS, eps=1e-6, targets=("encoder.layers.0", "mlp"), record_eval_mode=True
    )
    assert cfg.weight_grad.monitor_mbs_grad and cfg.weight_grad.micro_batch_number == 4
    assert cfg.weight_grad.grad_acc_steps == 8
    assert cfg.optimizer.mv_distribution is False and cfg.optimizer.ops == ("norm",)
    assert cfg.param.param_distribution is False
    assert cfg.cc == CcConfig(
        enabled=True,
        ops=DEFAULT_OPS,
        cc_codeline=("train.py[23]",),
        cc_log_only=True,
        cc_pre_hook=True,
        module_ranks=(0, 1),
    )
    assert isinstance(cfg.module.eps, float)


def test_integer_eps_accepted_as_float() -> None:
    cfg = load_monitor_v2_config({"monitors": {"weight_grad": {"enabled": True, "eps": 1}}})
    assert cfg.weight_grad.eps == 1.0 and isinstance(cfg.weight_grad.eps, float)


# -- enabled semantics -----------------------------------------------------------------


def test_module_enabled_by_default_when_present(tmp_path: Path) -> None:
    cfg = load_both_ways(tmp_path, {"monitors": {"module": {"targets": ["mlp"]}}})
    assert cfg.module.enabled and cfg.enabled_monitors() == ["module"]


@pytest.mark.parametrize("name", ["weight_grad", "optimizer", "param", "cc"])
def test_other_monitors_disabled_by_default_when_present(tmp_path: Path, name: str, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="trainprobe"):
        cfg = load_both_ways(tmp_path, {"monitors": {name: {"ops": ["norm"]}}})
    assert not getattr(cfg, name).enabled
    assert cfg.enabled_monitors() == []
    assert f'monitors.{name} is configured but off: add "enabled": true' in caplog.text


def test_absent_monitors_are_disabled() -> None:
    assert load_monitor_v2_config({"monitors": {}}).enabled_monitors() == []
    assert load_monitor_v2_config({"monitors": {"module": None}}).enabled_monitors() == []


def test_explicit_enabled_false_and_true() -> None:
    cfg = load_monitor_v2_config(
        {"monitors": {"module": {"enabled": False}, "weight_grad": {"enabled": True}, "param": {"enabled": True}}}
    )
    assert cfg.enabled_monitors() == ["weight_grad", "param"]


def test_enabled_monitors_fixed_order() -> None:
    cfg = load_monitor_v2_config(
        {"monitors": {name: {"enabled": True} for name in ("cc", "param", "optimizer", "weight_grad", "module")}}
    )
    assert cfg.enabled_monitors() == ["module", "weight_grad", "optimizer", "param", "cc"]


def test_empty_monitor_objects_count_as_present(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="trainprobe"):
        cfg = load_monitor_v2_config({"monitors": {"module": {}, "weight_grad": {}}})
    assert cfg.module.enabled and not cfg.weight_grad.enabled
    assert "monitors.weight_grad is configured but off" in caplog.text
    assert "monitors.module" not in caplog.text


def test_null_monitor_is_absent(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="trainprobe"):
        cfg = load_monitor_v2_config({"monitors": {"module": None, "param": None}})
    assert cfg.enabled_monitors() == []
    assert caplog.text == ""


def test_legacy_cc_enable_does_not_warn_off(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="trainprobe"):
        cfg = load_monitor_v2_config({"monitors": {"cc": {"cc_distribution": {"enable": True}}}})
    assert cfg.cc.enabled
    assert "configured but off" not in caplog.text


def test_cc_field_error_path_with_legacy_block() -> None:
    with pytest.raises(ConfigError, match=exact("monitors.cc.cc_log_only: must be true or false, not a string 'y'")):
        load_monitor_v2_config({"monitors": {"cc": {"cc_log_only": "y", "cc_distribution": {"enable": True}}}})


# -- cc, legacy cc_distribution --------------------------------------------------------


def test_legacy_cc_distribution(tmp_path: Path) -> None:
    data = {
        "monitors": {
            "cc": {
                "cc_distribution": {
                    "enable": True,
                    "cc_codeline": ["train.py[23]", "model.py[7]"],
                    "cc_pre_hook": True,
                    "cc_log_only": False,
                }
            }
        }
    }
    cfg = load_both_ways(tmp_path, data)
    assert cfg.cc == CcConfig(
        enabled=True,
        ops=DEFAULT_OPS,
        cc_codeline=("train.py[23]", "model.py[7]"),
        cc_pre_hook=True,
        cc_log_only=False,
    )
    assert cfg.enabled_monitors() == ["cc"]


def test_legacy_cc_distribution_disabled() -> None:
    cfg = load_monitor_v2_config({"monitors": {"cc": {"cc_distribution": {"enable": False, "cc_log_only": True}}}})
    assert not cfg.cc.enabled and cfg.cc.cc_log_only


def test_legacy_cc_distribution_with_enabled_and_ops() -> None:
    cfg = load_monitor_v2_config(
        {
            "monitors": {
                "cc": {
                    "enabled": True,
                    "ops": ["max", "nans"],
                    "module_ranks": [1],
                    "cc_distribution": {"cc_log_only": True},
                }
            }
        }
    )
    assert cfg.cc == CcConfig(enabled=True, ops=("max", "nans"), cc_log_only=True, module_ranks=(1,))


def test_legacy_cc_distribution_unknown_key() -> None:
    with pytest.raises(
        ConfigError,
        match=exact(
            "monitors.cc.cc_distribution.cc_codelines: unknown field; did you mean 'cc_codeline'? "
            "Known fields: enable, cc_codeline, cc_log_only, cc_pre_hook, module_ranks"
        ),
    ):
        load_monitor_v2_config({"monitors": {"cc": {"cc_distribution": {"enable": True, "cc_codelines": []}}}})


def test_legacy_cc_distribution_wrong_types() -> None:
    with pytest.raises(ConfigError, match=exact("monitors.cc.cc_distribution: must be an object, not a list")):
        load_monitor_v2_config({"monitors": {"cc": {"cc_distribution": []}}})
    with pytest.raises(
        ConfigError, match=exact("monitors.cc.cc_distribution.enable: must be true or false, not a string 'yes'")
    ):
        load_monitor_v2_config({"monitors": {"cc": {"cc_distribution": {"enable": "yes"}}}})
    with pytest.raises(
        ConfigError, match=exact("monitors.cc.cc_distribution.cc_codeline[0]: must be a string, not an integer 5")
    ):
        load_monitor_v2_config({"monitors": {"cc": {"cc_distribution": {"enable": True, "cc_codeline": [5]}}}})


# -- TrainerMonitorV2 construction and start() -----------------------------------------


def _model_and_optimizer():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_constructor_accepts_dict_and_keeps_config(tmp_path: Path) -> None:
    mon = TrainerMonitorV2({"output_dir": str(tmp_path), "monitors": {"param": {"enabled": True}}})
    assert mon.config.enabled_monitors() == ["param"]
    assert mon.current_step == 0
    assert mon.output_dir == tmp_path / "rank_0"


def test_constructor_raises_on_invalid_field(tmp_path: Path) -> None:
    path = write(tmp_path, {"monitors": {"weight_grad": {"enabled": True, "ops": ["nrom"]}}})
    with pytest.raises(ConfigError, match=exact(f"monitors.weight_grad.ops[0]: 'nrom' is not one of {OPS_LIST}")):
        TrainerMonitorV2(str(path))


@pytest.mark.parametrize(
    "monitors,names",
    [
        ({"weight_grad": {"enabled": True}}, "weight_grad"),
        ({"optimizer": {"enabled": True}}, "optimizer"),
        ({"param": {"enabled": True}}, "param"),
        ({"weight_grad": {"enabled": True}, "param": {"enabled": True}}, "weight_grad, param"),
        (
            {"weight_grad": {"enabled": True}, "optimizer": {"enabled": True}, "param": {"enabled": True}},
            "weight_grad, optimizer, param",
        ),
    ],
)
def test_start_without_optimizer(tmp_path: Path, monitors: dict, names: str) -> None:
    mon = TrainerMonitorV2({"output_dir": str(tmp_path), "monitors": monitors})
    model, _ = _model_and_optimizer()
    message = f"start(): monitors {names} need the optimizer; call start(model=..., optimizer=...)"
    with pytest.raises(ConfigError, match=exact(message)):
        mon.start(model=model)
    with pytest.raises(ConfigError, match="need the optimizer"):
        mon.start()
    mon.stop()
    assert not (tmp_path / "rank_0").exists()


def test_start_module_without_model(tmp_path: Path) -> None:
    mon = TrainerMonitorV2({"output_dir": str(tmp_path), "monitors": {"module": {"enabled": True}}})
    _, optimizer = _model_and_optimizer()
    message = "start(): monitors.module is enabled but no model was passed; call start(model=...)"
    with pytest.raises(ConfigError, match=exact(message)):
        mon.start(optimizer=optimizer)
    with pytest.raises(ConfigError, match=exact(message)):
        mon.start()
    mon.stop()


def test_start_module_default_enabled_without_model(tmp_path: Path) -> None:
    mon = TrainerMonitorV2({"output_dir": str(tmp_path), "monitors": {"module": {"targets": ["0"]}}})
    with pytest.raises(ConfigError, match=r"^start\(\): monitors\.module is enabled but no model was passed"):
        mon.start()


def test_start_failure_leaves_monitor_startable(tmp_path: Path) -> None:
    mon = TrainerMonitorV2({"output_dir": str(tmp_path), "monitors": {"param": {"enabled": True}}})
    model, optimizer = _model_and_optimizer()
    with pytest.raises(ConfigError):
        mon.start(model=model)
    mon.start(model=model, optimizer=optimizer)
    try:
        assert (tmp_path / "rank_0").is_dir()
    finally:
        mon.stop()


def test_start_twice_raises(tmp_path: Path) -> None:
    mon = TrainerMonitorV2(
        {"output_dir": str(tmp_path), "patch_optimizer_step": False, "monitors": {"weight_grad": {"enabled": True}}}
    )
    model, optimizer = _model_and_optimizer()
    mon.start(model=model, optimizer=optimizer)
    try:
        with pytest.raises(
            RuntimeError, match=re.escape("TrainerMonitorV2.start(): already started; call stop() first")
        ):
            mon.start(model=model, optimizer=optimizer)
    finally:
        mon.stop()
    # after stop() it may start again
    mon.start(model=model, optimizer=optimizer)
    mon.stop()
    mon.stop()  # idempotent


def test_start_twice_raises_on_unmonitored_rank(tmp_path: Path) -> None:
    mon = TrainerMonitorV2({"output_dir": str(tmp_path), "rank": [5], "monitors": {"weight_grad": {"enabled": True}}})
    mon.start()  # rank 0 is not monitored: no optimizer needed, nothing attached
    with pytest.raises(RuntimeError, match="already started"):
        mon.start()
    mon.stop()
    assert not (tmp_path / "rank_0").exists()


def test_start_with_invalid_grad_acc_steps(tmp_path: Path) -> None:
    mon = TrainerMonitorV2({"output_dir": str(tmp_path), "monitors": {"weight_grad": {"enabled": True}}})
    model, optimizer = _model_and_optimizer()
    with pytest.raises(ConfigError, match=exact("start(grad_acc_steps=...): must be an integer >= 1, got 0")):
        mon.start(model=model, optimizer=optimizer, grad_acc_steps=0)
    with pytest.raises(ConfigError, match=exact("start(micro_batch_number=...): must be an integer >= 1, got 'x'")):
        mon.start(model=model, optimizer=optimizer, micro_batch_number="x")


def test_start_with_bad_model_type(tmp_path: Path) -> None:
    mon = TrainerMonitorV2({"output_dir": str(tmp_path), "monitors": {"module": {"enabled": True}}})
    with pytest.raises(ConfigError, match=r"start\(model=\.\.\.\): expected a torch\.nn\.Module"):
        mon.start(model="not a model")


def test_integral_floats_are_integers_in_v2() -> None:
    cfg = load_monitor_v2_config({"collect_times": 1e8, "step_interval": 2.0, "step_count_per_record": 2e0})
    assert cfg.schedule.collect_times == 100_000_000 and isinstance(cfg.schedule.collect_times, int)
    assert cfg.schedule.step_interval == 2 and cfg.schedule.step_count_per_record == 2
    with pytest.raises(ConfigError, match=r"^collect_times: must be an integer, not a number inf"):
        load_monitor_v2_config({"collect_times": float("inf")})


def test_deep_json_is_a_config_error_naming_the_file(tmp_path: Path) -> None:
    deep = tmp_path / "deep.json"
    deep.write_text('{"a":' * 100_000 + "1" + "}" * 100_000)
    with pytest.raises(ConfigError, match=r"deep\.json' is nested too deeply"):
        load_monitor_v2_config(deep)
