"""The training-metrics dialect: defaults, the tensorboard fallback, and every user mistake
rejected with a ConfigError that names the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trainprobe.engine.errors import ConfigError
from trainprobe.frontdoors.metrics.config import LOG, TENSORBOARD, load_training_metrics_config

SPEC_YAML = """\
seed: 0
output_dir: './output'

monitor_config:
    monitor_on: True
    dump_path: './dump'
    target: ['layers.0', 'layers.1'] # 只监控第一、二层的参数
    invert: False
    step_interval: 1
    local_loss_format: ['log', 'tensorboard']
    device_local_loss_format: ['log', 'tensorboard']
    local_norm_format: ['log', 'tensorboard']
    device_local_norm_format: ['log', 'tensorboard']
    optimizer_state_format: null
    weight_state_format: null
    throughput_baseline: null
    print_struct: False

tensorboard:
    tensorboard_dir: 'worker/tensorboard'
    tensorboard_queue_size: 10
    log_loss_scale_to_tensorboard: True
    log_timers_to_tensorboard: True

callbacks:
    - type: MFLossMonitor
      per_print_times: 1
"""


def test_spec_example_yaml_loads(tmp_path: Path) -> None:
    path = tmp_path / "train.yaml"
    path.write_text(SPEC_YAML, encoding="utf-8")
    cfg = load_training_metrics_config(path)
    mon = cfg.monitor
    assert mon.monitor_on and mon.target == ("layers.0", "layers.1") and mon.step_interval == 1
    assert mon.local_norm_format == {LOG, TENSORBOARD}
    assert mon.optimizer_state_format == frozenset() and mon.throughput_baseline is None
    assert cfg.tensorboard is not None and cfg.tensorboard.tensorboard_dir == Path("worker/tensorboard")
    assert cfg.tensorboard.log_timers_to_tensorboard and not cfg.tensorboard.log_expert_load_to_tensorboard
    assert [tag for tag, _ in cfg.text] == ["seed", "output_dir", "monitor_config", "tensorboard", "callbacks"]
    assert mon.targeted("model.layers.1.w") and not mon.targeted("model.layers.2.w")


def test_json_file_and_defaults(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"monitor_config": {}}), encoding="utf-8")
    cfg = load_training_metrics_config(path)
    assert not cfg.monitor.monitor_on and cfg.monitor.target == (".*",) and cfg.tensorboard is None
    assert cfg.monitor.dump_path == Path("./dump") and cfg.step_interval == 1


def test_tensorboard_format_falls_back_to_log_without_tensorboard_section() -> None:
    cfg = load_training_metrics_config({"monitor_config": {"local_norm_format": "tensorboard"}})
    assert cfg.monitor.local_norm_format == {LOG}


def test_invert_selects_the_complement() -> None:
    cfg = load_training_metrics_config({"monitor_config": {"target": ["attn"], "invert": True}})
    assert cfg.monitor.targeted("layers.0.mlp.w") and not cfg.monitor.targeted("layers.0.attn.w")


BAD: list[tuple[dict[str, Any], str]] = [
    (
        {"monitor_config": {"monitor_onn": True}},
        r"monitor_config\.monitor_onn: unknown field; did you mean 'monitor_on'",
    ),
    ({"tensorboard": {"tensorboard_dir": "x", "queue": 1}}, r"tensorboard\.queue: unknown field"),
    ({"monitor_config": {"local_norm_format": "tb"}}, r"monitor_config\.local_norm_format: 'tb' is not one of log"),
    (
        {"monitor_config": {"optimizer_state_format": ["log", "csv"]}},
        r"monitor_config\.optimizer_state_format\[1\]: 'csv' is not one of log, tensorboard",
    ),
    ({"monitor_config": {"weight_state_format": 3}}, r"monitor_config\.weight_state_format: must be 'log'"),
    ({"monitor_config": {"throughput_baseline": 0}}, r"monitor_config\.throughput_baseline: must be greater than 0"),
    ({"monitor_config": {"throughput_baseline": -5.0}}, r"monitor_config\.throughput_baseline: must be greater than 0"),
    ({"monitor_config": {"throughput_baseline": "fast"}}, r"monitor_config\.throughput_baseline: must be a finite"),
    ({"monitor_config": {"step_interval": 0}}, r"monitor_config\.step_interval: must be >= 1"),
    ({"monitor_config": {"step_interval": 1.5}}, r"monitor_config\.step_interval: must be an integer"),
    ({"monitor_config": {"monitor_on": "yes"}}, r"monitor_config\.monitor_on: must be true or false"),
    ({"monitor_config": {"target": "layers"}}, r"monitor_config\.target: must be a list of strings"),
    ({"monitor_config": {"target": ["ok", "("]}}, r"monitor_config\.target\[1\]: invalid regular expression"),
    ({"monitor_config": {"target": []}}, r"monitor_config\.target: must list at least one"),
    ({"tensorboard": {"log_timers_to_tensorboard": True}}, r"tensorboard\.tensorboard_dir: is required"),
    ({"tensorboard": {"tensorboard_dir": "x", "tensorboard_queue_size": 0}}, r"tensorboard\.tensorboard_queue_size"),
    ({"tensorboard": {"tensorboard_dir": "x", "log_timers_to_tensorboard": 1}}, r"log_timers_to_tensorboard: must be"),
    ({"monitor_config": [1]}, r"monitor_config: must be an object"),
]


@pytest.mark.parametrize(("config", "match"), BAD)
def test_bad_values_name_the_field(config: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_training_metrics_config(config)


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_training_metrics_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("monitor_config: [unclosed", encoding="utf-8")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_training_metrics_config(bad)
    top = tmp_path / "list.yaml"
    top.write_text("- 1\n- 2\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_training_metrics_config(top)


# -- YAML aliases, depth, paths (issues 15.5, 15.6, 15.11) -----------------------------------------
LAUGHS = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{b}: &{b} [{', '.join(['*' + a] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi", strict=True)
)


def test_billion_laughs_is_rejected_quickly(tmp_path: Path) -> None:
    import time

    pytest.importorskip("yaml")
    path = tmp_path / "laughs.yaml"
    path.write_text(LAUGHS)
    began = time.perf_counter()
    with pytest.raises(ConfigError, match=r"laughs\.yaml': expands to more than 100000 values"):
        load_training_metrics_config(path)
    assert time.perf_counter() - began < 5


def test_self_referencing_alias_is_rejected(tmp_path: Path) -> None:
    pytest.importorskip("yaml")
    path = tmp_path / "circle.yaml"
    path.write_text("monitor_config: &m\n  loop: *m\n")
    with pytest.raises(ConfigError, match=r"circle\.yaml': a YAML alias refers to itself"):
        load_training_metrics_config(path)


def test_a_few_aliases_are_fine(tmp_path: Path) -> None:
    pytest.importorskip("yaml")
    path = tmp_path / "ok.yaml"
    path.write_text("common: &c [log]\nmonitor_config:\n  monitor_on: true\n  local_loss_format: *c\n")
    assert load_training_metrics_config(path).monitor.monitor_on


@pytest.mark.parametrize("name", ["deep.json", "deep.yaml"])
def test_deep_files_are_config_errors(tmp_path: Path, name: str) -> None:
    pytest.importorskip("yaml")
    path = tmp_path / name
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConfigError, match=rf"{name.replace('.', '[.]')}' is (nested too deeply|not valid YAML)"):
        load_training_metrics_config(path)


def test_integral_float_step_interval_and_folder_path(tmp_path: Path) -> None:
    cfg = load_training_metrics_config({"monitor_config": {"step_interval": 2.0}})
    assert cfg.step_interval == 2 and isinstance(cfg.step_interval, int)
    with pytest.raises(ConfigError, match="is a folder; pass the path of the file inside it"):
        load_training_metrics_config(tmp_path)


@pytest.mark.parametrize(
    ("data", "forwarded", "timers"),
    [
        ({"monitor_config": {"local_norm_format": "tensorboard"}}, True, False),
        ({"monitor_config": {"local_norm_format": "tensorboard"}, "tensorboard": {"log_timers_to_tensorboard": True}},
         True, True),
        ({"monitor_config": {"local_norm_format": "tensorboard"}, "tensorboard": {"tensorboard_dir": "tb"}},
         False, False),
    ],
)  # fmt: skip
def test_in_a_trainer_the_trainers_loggers_stand_in_for_tensorboard(
    data: dict[str, Any], forwarded: bool, timers: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """``trainer_loggers=True`` (the callbacks): without ``tensorboard_dir`` (no section, or a
    section without it, whose other keys apply) the scalars are forwarded, and ``tensorboard`` in
    a format stays ``tensorboard`` (no fallback to the log, no warning); with it, event files."""
    with caplog.at_level("WARNING", logger="trainprobe"):
        cfg = load_training_metrics_config(data, trainer_loggers=True)
    assert cfg.forwarded is forwarded
    assert cfg.tensorboard is not None and cfg.tensorboard.log_timers_to_tensorboard is timers
    assert cfg.tensorboard.tensorboard_dir == (None if forwarded else Path("tb"))
    assert cfg.monitor.local_norm_format == {TENSORBOARD}
    assert not [r for r in caplog.records if "no tensorboard section" in r.getMessage()]
    assert not load_training_metrics_config({"monitor_config": {}}).forwarded  # outside a trainer: never
