"""A bounded config fuzzer: a few hundred random mutations of a valid config of each dialect
(Monitor V2, Monitor V1, precision dump, training metrics) either load or raise ConfigError,
never anything else. Seeded, so a failure is reproducible; runs in seconds."""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from test_dump_config import REFERENCE_SHIPPED
from test_v1_config import FULL as V1_FULL
from trainprobe.dump.config import load_dump_config, parse_dump_config
from trainprobe.engine.errors import ConfigError
from trainprobe.frontdoors.metrics.config import load_training_metrics_config
from trainprobe.frontdoors.monitor_v1.config import load_monitor_v1_config
from trainprobe.frontdoors.monitor_v2.config import load_monitor_v2_config

V2_FULL: dict[str, Any] = {
    "framework": "pytorch",
    "output_dir": "./out",
    "format": "csv",
    "async_write": True,
    "rank": [0],
    "start_step": 0,
    "stop_step": 10,
    "step_interval": 1,
    "step_count_per_record": 1,
    "patch_optimizer_step": False,
    "monitors": {
        "module": {"enabled": True, "ops": ["min", "max"], "eps": 1e-8, "targets": [], "record_eval_mode": False},
        "weight_grad": {"enabled": True, "ops": ["norm"]},
        "optimizer": {"enabled": True},
        "param": {"enabled": True},
        "cc": {"enabled": False, "cc_codeline": [], "cc_log_only": False, "cc_pre_hook": False, "module_ranks": []},
    },
}
METRICS_FULL: dict[str, Any] = {
    "seed": 0,
    "monitor_config": {
        "monitor_on": True,
        "dump_path": "./dump",
        "target": ["layers.0"],
        "invert": False,
        "step_interval": 1,
        "local_loss_format": ["log", "tensorboard"],
    },
    "tensorboard": {"tensorboard_dir": "./tb", "tensorboard_queue_size": 10},
}
JUNK: list[Any] = [
    None, True, False, 0, -1, 1, 2.0, 2.5, 1e8, 1e300, -1e300, float("nan"), float("inf"), 10**40, "",
    "x", "0-3", "norm", "tensor", [], [1, "a"], ["min"], {}, {"a": 1}, [[[[]]]], {"enabled": True},
]  # fmt: skip


def _containers(value: Any, out: list[Any]) -> list[Any]:
    if isinstance(value, dict):
        out.append(value)
        for v in value.values():
            _containers(v, out)
    elif isinstance(value, list):
        out.append(value)
        for v in value:
            _containers(v, out)
    return out


def mutate(config: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """``config`` with one to three random edits: replace, delete, rename (typo) or add a value."""
    data = copy.deepcopy(config)
    for _ in range(rng.randint(1, 3)):
        target = rng.choice(_containers(data, []))
        action = rng.choice(("replace", "replace", "delete", "typo", "add"))
        if isinstance(target, list):
            if target and action != "add":
                target[rng.randrange(len(target))] = copy.deepcopy(rng.choice(JUNK))
            else:
                target.append(copy.deepcopy(rng.choice(JUNK)))
            continue
        keys = list(target)
        if action == "add" or not keys:
            target[rng.choice(["extra", "acc_check", "risk_level", "Ops", "stepinterval"])] = rng.choice(JUNK)
            continue
        key = rng.choice(keys)
        if action == "replace":
            target[key] = copy.deepcopy(rng.choice(JUNK))
        elif action == "delete":
            del target[key]
        else:
            target[key[:-1] + key[-1].upper()] = target.pop(key)
    return data


DIALECTS: dict[str, tuple[dict[str, Any], Callable[[Any], Any]]] = {
    "monitor_v2": (V2_FULL, load_monitor_v2_config),
    "monitor_v1": (V1_FULL, load_monitor_v1_config),
    "dump": (REFERENCE_SHIPPED, parse_dump_config),
    "metrics": (METRICS_FULL, load_training_metrics_config),
}


FILE_LOADERS: dict[str, Callable[[Path], Any]] = {
    "monitor_v2": load_monitor_v2_config,
    "monitor_v1": load_monitor_v1_config,
    "dump": load_dump_config,
    "metrics": load_training_metrics_config,
}
"""Each dialect's loader of a file (the dump's ``parse_dump_config`` takes a dict only)."""


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
def test_random_mutations_load_or_raise_config_error(dialect: str, tmp_path: Path) -> None:
    valid, load = DIALECTS[dialect]
    load(copy.deepcopy(valid))  # the starting point is valid
    rng = random.Random(f"trainprobe-{dialect}")
    outcomes = {"loaded": 0, "rejected": 0}
    for i in range(300):
        data = mutate(valid, rng)
        try:
            load(data)
            outcomes["loaded"] += 1
        except ConfigError:
            outcomes["rejected"] += 1
        except Exception as exc:  # noqa: BLE001 - the point of the test
            pytest.fail(f"mutation {i} of {dialect}: {type(exc).__name__}: {exc}\n{json.dumps(data, default=str)}")
    assert outcomes["loaded"] and outcomes["rejected"], outcomes  # the mutations reach both outcomes


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
def test_random_mutations_through_files(dialect: str, tmp_path: Path) -> None:
    """The same through JSON files (what users pass): text junk too. A file that is no longer
    JSON is a ConfigError naming the file; one that still is loads or names a field."""
    valid, _ = DIALECTS[dialect]
    load = FILE_LOADERS[dialect]
    rng = random.Random(f"files-{dialect}")
    text = json.dumps(valid)
    outcomes = {"loaded": 0, "not JSON": 0, "bad field": 0}
    for i in range(60):
        chars = list(text)
        for _ in range(rng.randint(1, 4)):
            chars[rng.randrange(len(chars))] = rng.choice('{}[]",:0 1e-x\\\0')
        path = tmp_path / f"c{i}.json"
        path.write_text("".join(chars), encoding="utf-8")
        try:
            json.loads(path.read_text(encoding="utf-8"))
            is_json = True
        except ValueError:
            is_json = False
        try:
            load(path)
            outcomes["loaded"] += 1
            assert is_json, path.read_text(encoding="utf-8")
        except ConfigError as exc:
            message = str(exc)
            assert "\n" not in message
            if is_json:
                outcomes["bad field"] += 1
                assert str(path) not in message and not message.startswith("<top level>"), message
            else:
                outcomes["not JSON"] += 1
                assert str(path) in message and "not valid JSON" in message, message
    assert outcomes["not JSON"] and outcomes["loaded"] + outcomes["bad field"], outcomes
