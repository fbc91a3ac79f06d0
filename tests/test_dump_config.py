"""The dump dialect: defaults, every field, and errors that name the field."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from conftest import write_config
from trainprobe.dump.api_catalog import ApiCatalog, read_api_yaml
from trainprobe.dump.config import DumpConfig, load_dump_config, parse_dump_config
from trainprobe.engine.errors import ConfigError


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


# -- reference configs, accepted-but-ignored keys, ranges, paths (issues 14.1, 15.2, 15.4, 15.6) --
# The key structure of the reference tool's shipped ``config.json`` (written here by hand).
REFERENCE_SHIPPED = {
    "task": "statistics",
    "dump_path": "./dump_path",
    "rank": [],
    "step": [],
    "level": "L1",
    "extra_info": True,
    "async_dump": False,
    "statistics": {"scope": [], "list": [], "data_mode": ["all"], "summary_mode": "statistics"},
    "tensor": {"scope": [], "list": [], "data_mode": ["all"]},
    "acc_check": {"white_list": [], "black_list": [], "error_data_path": "./"},
}


@pytest.fixture
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    import trainprobe.engine.log

    monkeypatch.setattr(trainprobe.engine.log, "_seen", set())


def test_reference_shipped_config_loads_with_one_warning(
    tmp_path: Path, fresh_warnings: None, caplog: pytest.LogCaptureFixture
) -> None:
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps(REFERENCE_SHIPPED))
    with caplog.at_level("WARNING", logger="trainprobe"):
        cfg = load_dump_config(path)
        load_dump_config(path)
    assert (cfg.task, cfg.level, cfg.data_mode) == ("statistics", "L1", ("all",))
    warned = [r.getMessage() for r in caplog.records if "acc_check" in r.getMessage()]
    assert warned == [
        "config field acc_check: belongs to another msProbe tool that trainprobe does not implement; ignored"
    ]


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"precision": "high"}, "precision"),
        ({"custom_op_namespaces": ["my_ops"]}, "custom_op_namespaces"),
        ({"load": {"path": "./x", "modules": ["m"]}}, "load"),
        ({"diff_check": {"diff_nums": 3}}, "diff_check"),
        ({"nan_check": {}}, "nan_check"),
        ({"exception_dump": {}}, "exception_dump"),
        ({"statistics": {"slice": [0, 1]}}, "statistics.slice"),
        ({"statistics": {"request_id": 1}}, "statistics.request_id"),
        ({"task": "tensor", "tensor": {"bench_path": "./b"}}, "tensor.bench_path"),
    ],
)
def test_reference_keys_not_implemented_are_accepted_and_named_in_a_warning(
    data: dict[str, Any], field: str, fresh_warnings: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="trainprobe"):
        parse_dump_config(data)
    assert any(r.getMessage().startswith(f"config field {field}: ") for r in caplog.records)


def test_unknown_key_still_rejected_with_did_you_mean() -> None:
    with pytest.raises(ConfigError, match=r"^acc_chek: unknown field; did you mean 'acc_check'\?"):
        parse_dump_config({"acc_chek": {}})
    with pytest.raises(ConfigError, match=r"^statistics\.slise: unknown field; did you mean 'slice'\?"):
        parse_dump_config({"statistics": {"slise": []}})


def test_integral_floats_are_integers() -> None:
    cfg = parse_dump_config({"step": [1.0, 3e0], "rank": [0.0], "statistics": {"overflow_nums": 2.0}})
    assert cfg.steps == (1, 3) and cfg.ranks == (0,) and cfg.overflow_nums == 2
    with pytest.raises(ConfigError, match=r"^step\[0\]: must be an integer, not a number 1\.5"):
        parse_dump_config({"step": [1.5]})


def test_huge_step_range_is_kept_as_a_range() -> None:
    import time

    began = time.perf_counter()
    cfg = parse_dump_config({"step": ["0-1000000000000", 5, "20-30"], "rank": ["0-3", 7]})
    assert time.perf_counter() - began < 0.5
    assert 999_999_999_999 in cfg.steps and 10**12 + 1 not in cfg.steps and -1 not in cfg.steps
    assert 2 in cfg.ranks and 7 in cfg.ranks and 5 not in cfg.ranks
    assert cfg.ranks == (0, 1, 2, 3, 7) and len(cfg.steps) == 10**12 + 1


@pytest.mark.parametrize("path", ["dump\0here", "x" * 5000])
def test_unusable_dump_path_fails_at_construction(path: str) -> None:
    from trainprobe.dump import PrecisionDebugger

    with pytest.raises(ConfigError, match=r"^dump_path: "):
        parse_dump_config({"dump_path": path})
    with pytest.raises(ConfigError, match=r"^dump_path: "):
        PrecisionDebugger(dump_path=path)


def test_very_deep_json_is_a_config_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConfigError, match=r"deep\.json' is nested too deeply"):
        load_dump_config(path)


def _unusable(tmp_path: Path, kind: str) -> Path:
    """A dump_path of the given kind that no dump can be written under."""
    if kind == "file":
        (tmp_path / "a_file").write_text("x")
        return tmp_path / "a_file"
    if kind == "under a file":
        (tmp_path / "a_file").write_text("x")
        return tmp_path / "a_file" / "dump"
    if kind == "fifo":
        os.mkfifo(tmp_path / "a_fifo")
        return tmp_path / "a_fifo"
    if kind == "read-only file system":
        return Path("/proc/self/trainprobe_dump")  # refused even to root
    folder = tmp_path / "read_only"
    folder.mkdir()
    folder.chmod(0o555)
    return folder / "dump"


@pytest.mark.parametrize("kind", ["file", "under a file", "fifo", "read-only file system", "read-only folder"])
def test_unusable_dump_path_is_a_config_error_at_construction(
    tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue #27.4: refused when the debugger is created, in one line naming dump_path, before
    any hook or API wrapper is installed; nothing is logged."""
    from trainprobe.dump import PrecisionDebugger

    if kind == "read-only folder" and os.geteuid() == 0:
        pytest.skip("root writes into a read-only folder")
    path = _unusable(tmp_path, kind)
    with pytest.raises(ConfigError, match=r"^dump_path: .*(cannot create|not writable)") as info:
        PrecisionDebugger(dump_path=str(path))
    assert "\n" not in str(info.value) and str(path) in str(info.value)
    with pytest.raises(ConfigError, match=r"^dump_path: "):
        PrecisionDebugger(config_path=write_config(tmp_path / "cfg", {"dump_path": str(path)}))
    assert caplog.records == []
