"""Hostile config files at every front door (Monitor V2 JSON, Monitor V1 JSON, the training
metrics' YAML/JSON, the precision dump's JSON): each is one ConfigError naming the file and, where
it can, the key, never a raw ``ValueError`` or a multi-line traceback (docs/security.md,
"Config files")."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from test_config_fuzz import METRICS_FULL, V2_FULL
from test_dump_config import REFERENCE_SHIPPED
from test_v1_config import FULL as V1_FULL
from trainprobe.dump.config import load_dump_config
from trainprobe.engine.errors import ConfigError
from trainprobe.frontdoors.metrics.config import load_training_metrics_config
from trainprobe.frontdoors.monitor_v1.config import load_monitor_v1_config
from trainprobe.frontdoors.monitor_v2.config import load_monitor_v2_config

LONG = "1" * 5000
MAX_CONFIG_BYTES = 16 << 20  # engine.fields.MAX_CONFIG_BYTES, as documented
# (loader, a valid config, the integer field replaced by a 5,000-digit literal, its path in errors)
DOORS: dict[str, tuple[Callable[[Any], Any], dict[str, Any], str, str]] = {
    "v2": (load_monitor_v2_config, V2_FULL, '"step_count_per_record": 1', "step_count_per_record"),
    "v1": (load_monitor_v1_config, V1_FULL, '"start_step": 0', "start_step"),
    "metrics": (load_training_metrics_config, METRICS_FULL, '"step_interval": 1', "monitor_config.step_interval"),
    "dump": (load_dump_config, REFERENCE_SHIPPED, '"rank": []', "rank[0]"),
}


def _long_value(field: str) -> str:
    name = field.split(":")[0]
    return f"{name}: [{LONG}]" if field.endswith("[]") else f"{name}: {LONG}"


@pytest.mark.parametrize("door", sorted(DOORS))
def test_a_5000_digit_integer_names_its_key(tmp_path: Path, door: str) -> None:
    load, valid, field, where = DOORS[door]
    text = json.dumps(valid)
    assert field in text
    path = tmp_path / "config.json"
    path.write_text(text.replace(field, _long_value(field)))
    with pytest.raises(ConfigError, match=re.escape(f"config.json': {where}: an integer of 5000 digits")):
        load(path)


def test_a_100k_digit_yaml_integer_names_its_key_and_line(tmp_path: Path) -> None:
    path = tmp_path / "train.yaml"
    path.write_text("seed: 0\nmonitor_config:\n  monitor_on: true\n  step_interval: " + "7" * 100_000 + "\n")
    with pytest.raises(ConfigError, match=r"monitor_config\.step_interval \(line 4\): an integer of 100000 digits"):
        load_training_metrics_config(path)
    path.write_text("seed: 0x" + "f" * 100_000 + "\n")  # any base: str() of it fails too
    with pytest.raises(ConfigError, match=r"seed \(line 1\): an integer of 100000 digits"):
        load_training_metrics_config(path)


@pytest.mark.parametrize("door", sorted(DOORS))
def test_a_repeated_json_key_is_refused_naming_it(tmp_path: Path, door: str) -> None:
    load, valid, _, _ = DOORS[door]
    key = next(iter(valid))
    text = json.dumps(valid)
    path = tmp_path / "config.json"
    path.write_text("{" + json.dumps(key) + ": " + json.dumps(valid[key]) + ", " + text[1:])
    with pytest.raises(ConfigError, match=rf"key '{key}' appears twice in one object; keep one"):
        load(path)


def test_repeated_yaml_keys_are_refused_where_trainprobe_reads(tmp_path: Path) -> None:
    path = tmp_path / "train.yaml"
    path.write_text("monitor_config:\n  step_interval: 1\n  monitor_on: true\n  step_interval: 5\n")
    with pytest.raises(ConfigError, match=r"monitor_config\.step_interval appears twice \(lines 2 and 4\)"):
        load_training_metrics_config(path)
    path.write_text("tensorboard:\n  tensorboard_dir: a\nseed: 1\ntensorboard:\n  tensorboard_dir: b\n")
    with pytest.raises(ConfigError, match=r"tensorboard appears twice \(lines 1 and 4\)"):
        load_training_metrics_config(path)
    # the rest of the file is the trainer's: its own loader decides, as with the reference tool
    path.write_text("seed: 1\nseed: 2\nmodel:\n  a: 1\n  a: 2\nmonitor_config:\n  monitor_on: true\n")
    assert load_training_metrics_config(path).monitor.monitor_on


def test_a_multi_line_yaml_error_is_one_line_with_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("monitor_config:\n  target: [a, b\n  step_interval: 3\n")
    with pytest.raises(ConfigError) as caught:
        load_training_metrics_config(path)
    message = str(caught.value)
    assert "\n" not in message
    assert f"config file {str(path)!r} is not valid YAML: {path}:3:16: " in message
    assert "flow sequence that starts at line 2 column 11" in message
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


@pytest.mark.parametrize("text", ["", "\n", "# nothing\n", "null\n", "~\n", "---\n"])
def test_an_empty_or_null_metrics_yaml_is_refused(tmp_path: Path, text: str) -> None:
    path = tmp_path / "train.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"train\.yaml' is empty \(or null\); .* monitor_config and/or a tensorboard"):
        load_training_metrics_config(path)


def test_an_empty_or_null_metrics_json_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "train.json"
    path.write_text("null")
    with pytest.raises(ConfigError, match=r"train\.json' is empty \(or null\)"):
        load_training_metrics_config(path)


@pytest.mark.parametrize("door", sorted(DOORS))
def test_an_oversized_config_is_refused_before_parsing(tmp_path: Path, door: str) -> None:
    load = DOORS[door][0]
    path = tmp_path / ("config.yaml" if door == "metrics" else "config.json")
    with path.open("w") as handle:  # one 17 MiB key: PyYAML needed ~40 s to reject 50 MB of it
        handle.write("a" * (MAX_CONFIG_BYTES + (1 << 20)) + ": 1\n")
    began = time.perf_counter()
    with pytest.raises(ConfigError, match=r"holds \d+ bytes, more than the 16 MiB a configuration may hold"):
        load(path)
    assert time.perf_counter() - began < 2.0
