"""The dump dialect: defaults, every field, and errors that name the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from trainprobe.dump.api_catalog import ApiCatalog, read_api_yaml
from trainprobe.dump.config import DumpConfig, load_dump_config, parse_dump_config
from trainprobe.errors import ConfigError


def test_defaults_are_l1_statistics_of_everything() -> None:
    cfg = load_dump_config(None)
    assert (cfg.task, cfg.level, cfg.ranks, cfg.steps, cfg.summary_mode) == ("statistics", "L1", (), (), "statistics")
    assert cfg.forward and cfg.backward and cfg.inputs and cfg.outputs


def test_spec_example_parses() -> None:
    cfg = parse_dump_config(
        {
            "task": "tensor",
            "dump_path": "/home/data_dump",
            "rank": [0, 1],
            "step": [0, "2-4"],
            "level": "mix",
            "async_dump": True,
            "extra_info": True,
            "tensor": {"scope": ["A", "B"], "list": ["relu"], "data_mode": ["forward", "input"]},
        }
    )
    assert cfg.steps == (0, 2, 3, 4) and cfg.ranks == (0, 1) and cfg.async_dump
    assert cfg.scope == ("A", "B") and cfg.names == ("relu",)
    assert cfg.forward and not cfg.backward and cfg.inputs and not cfg.outputs


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"task": "acc"}, r"task: 'acc' is not one of statistics, tensor, structure, overflow_check"),
        ({"level": "L2"}, r"level: 'L2' is not one of L0, L1, mix, debug"),
        ({"statistics": {"summary_mode": "sha"}}, r"statistics.summary_mode: 'sha' is not one of"),
        ({"statistics": {"data_mode": ["fwd"]}}, r"statistics.data_mode\[0\]: 'fwd' is not one of all, forward"),
        ({"statistics": {"scope": ["only-one"]}}, r"statistics.scope: must be \[\] or \[first, last\]"),
        ({"statistics": {"lst": []}}, r"statistics.lst: unknown field; did you mean 'list'"),
        ({"stepp": []}, r"stepp: unknown field; did you mean 'step'"),
        ({"step": ["3-1"]}, r"step\[0\]: range '3-1' must satisfy"),
        ({"rank": [-1]}, r"rank\[0\]: must be >= 0"),
        ({"dump_enable": "yes"}, r"dump_enable: must be true or false"),
        ({"async_dump": 1}, r"async_dump: must be true or false"),
    ],
)
def test_mistakes_name_the_field(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_dump_config(config)


def test_constructor_arguments_override_the_file(tmp_path: Path) -> None:
    cfg = DumpConfig().with_overrides(task="tensor", dump_path=tmp_path, level="mix", step=[1, 2])
    assert (cfg.task, cfg.dump_path, cfg.level, cfg.steps) == ("tensor", str(tmp_path), "mix", (1, 2))
    with pytest.raises(ConfigError, match="task: 'x' is not one of"):
        DumpConfig().with_overrides(task="x")


def test_missing_or_broken_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_dump_config(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{", encoding="utf-8")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        load_dump_config(bad)


def test_shipped_api_list_covers_the_common_ops() -> None:
    import torch
    import torch.nn.functional as F

    catalog = ApiCatalog.load()
    assert catalog.name_of(F.linear) == "Functional.linear"
    assert catalog.name_of(torch.Tensor.add) == "Tensor.add"
    assert catalog.name_of(torch.Tensor.__matmul__) == "Tensor.__matmul__"
    assert catalog.name_of(torch.matmul) == "Torch.matmul"
    assert catalog.name_of(torch._VF.lstm) == "VF.lstm"
    assert "all_reduce" in catalog.distributed


def test_user_api_list(tmp_path: Path) -> None:
    path = tmp_path / "ops.yaml"
    path.write_text("functional:\n  - relu\n  - not_an_api\ntorch:\n  - matmul\n", encoding="utf-8")
    assert read_api_yaml(path) == {"functional": ["relu", "not_an_api"], "torch": ["matmul"]}
    catalog = ApiCatalog.load(path)
    assert sorted(catalog.names.values()) == ["Functional.relu", "Torch.matmul"]
    path.write_text("jax:\n  - relu\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"unknown namespace\(s\) \['jax'\]"):
        ApiCatalog.load(path)
