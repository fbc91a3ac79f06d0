"""Monitor V1 config dialect: defaults and one error per invalid field, naming its JSON path."""

from __future__ import annotations

import json

import pytest

from trainprobe.engine.errors import ConfigError
from trainprobe.frontdoors.monitor_v1.config import load_monitor_v1_config

FULL = {
    "targets": {
        "language_model.encoder.layers.0": {
            "input": "tuple[2]:0",
            "output": "tensor",
            "input_grad": "tuple[2]:0",
            "output_grad": "tuple[1]:0",
        }
    },
    "dynamic_on": False,
    "start_step": 0,
    "collect_times": 100000000,
    "step_interval": 1,
    "print_struct": False,
    "module_ranks": [0, 1, 2, 3],
    "ur_distribution": True,
    "xy_distribution": True,
    "all_xy": True,
    "forward_only": False,
    "backward_only": False,
    "mv_distribution": True,
    "param_distribution": True,
    "wg_distribution": True,
    "monitor_mbs_grad": True,
    "mg_direction": True,
    "cc_distribution": {"enable": True, "cc_codeline": [], "cc_pre_hook": False, "cc_log_only": False},
    "stack_info": False,
    "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}], "dump": False},
    "format": "csv",
    "ops": ["min", "max", "norm", "zeros", "nans", "mean"],
    "eps": 1e-8,
    "ndigits": 12,
    "step_count_per_record": 1,
    "append_output": [],
    "squash_name": True,
    "recording_l2_features": True,
    "l2_targets": {"attention_hook": ["0:0.self_attention"], "linear_hook": []},
    "sa_order": "b,s,h,d",
}


def test_reference_example_loads_with_every_field():
    cfg = load_monitor_v1_config(FULL)
    target = cfg.target("0:language_model.encoder.layers.0")
    assert target is not None and target.specs["input"].index == 0 and target.specs["output"].index is None
    assert cfg.ops == ("min", "max", "norm", "zeros", "nans", "mean")
    assert cfg.alert.rules[0].threshold == 0.5
    assert cfg.cc.enable and cfg.module_ranks == (0, 1, 2, 3)
    assert cfg.l2.linear_hook == () and cfg.l2.sa_order == "b,s,h,d"


def test_defaults(tmp_path):
    path = tmp_path / "c.json"
    path.write_text("{}")
    cfg = load_monitor_v1_config(path)
    assert (cfg.format, cfg.ops, cfg.eps, cfg.ndigits, cfg.collect_times, cfg.squash_name) == (
        "csv",
        ("norm",),
        1e-8,
        6,
        100000000,
        True,
    )
    assert not cfg.dynamic_on and cfg.targets == () and cfg.l2.attention_hook is None


@pytest.mark.parametrize(
    ("patch", "match"),
    [
        ({"tragets": {}}, r"tragets: unknown field; did you mean 'targets'\?"),
        ({"targets": []}, r"targets: must be an object, not a list"),
        ({"targets": {"m": {"inptu": "tensor"}}}, r"targets.m.inptu: unknown field; did you mean 'input'"),
        ({"targets": {"m": {"input": "tuple[2]:5"}}}, r"targets.m.input: element 5 is out of range"),
        ({"targets": {"m": {"output": "tensr"}}}, r"targets.m.output: 'tensr' is not 'tensor'"),
        ({"targets": {"m": {"output": 3}}}, r"targets.m.output: must be a string"),
        ({"dynamic_on": "yes"}, r"dynamic_on: must be true or false"),
        ({"start_step": -1}, r"start_step: must be >= 0"),
        ({"collect_times": 1.5}, r"collect_times: must be an integer"),
        ({"step_interval": 0}, r"step_interval: must be >= 1"),
        ({"print_struct": 1}, r"print_struct: must be true or false"),
        ({"module_ranks": [0, "1"]}, r"module_ranks\[1\]: must be an integer"),
        ({"module_ranks": 3}, r"module_ranks: must be a list of integers"),
        ({"ur_distribution": "true"}, r"ur_distribution: must be true or false"),
        ({"xy_distribution": None, "all_xy": 0}, r"all_xy: must be true or false"),
        ({"forward_only": []}, r"forward_only: must be true or false"),
        ({"backward_only": "no"}, r"backward_only: must be true or false"),
        ({"mv_distribution": 1}, r"mv_distribution: must be true or false"),
        ({"param_distribution": 1}, r"param_distribution: must be true or false"),
        ({"wg_distribution": 1}, r"wg_distribution: must be true or false"),
        ({"monitor_mbs_grad": 1}, r"monitor_mbs_grad: must be true or false"),
        ({"mg_direction": 1}, r"mg_direction: must be true or false"),
        ({"cc_distribution": True}, r"cc_distribution: must be an object"),
        ({"cc_distribution": {"enabled": True}}, r"cc_distribution.enabled: unknown field; did you mean 'enable'"),
        ({"cc_distribution": {"cc_codeline": "a.py"}}, r"cc_distribution.cc_codeline: must be a list of strings"),
        ({"cc_distribution": {"cc_log_only": 1}}, r"cc_distribution.cc_log_only: must be true or false"),
        ({"cc_distribution": {"cc_pre_hook": 1}}, r"cc_distribution.cc_pre_hook: must be true or false"),
        (
            {"cc_distribution": {"cc_codeline": ["a.py", "train.py[23"]}},
            r"cc_distribution.cc_codeline\[1\]: 'train.py\[23' is not a valid regular expression",
        ),
        ({"stack_info": 1}, r"stack_info: must be true or false"),
        ({"alert": {"rules": {}}}, r"alert.rules: must be a list of rules"),
        ({"alert": {"rules": [{"rule_name": "AnomalyX"}]}}, r"alert.rules\[0\].rule_name: 'AnomalyX' is not one of"),
        ({"alert": {"rules": [{"args": {}}]}}, r"alert.rules\[0\].rule_name: is required"),
        (
            {"alert": {"rules": [{"rule_name": "AnomalyTurbulence"}]}},
            r"alert.rules\[0\].args.threshold: AnomalyTurbulence needs a threshold",
        ),
        (
            {"alert": {"rules": [{"rule_name": "AnomalyNan", "args": {"threshold": -1}}]}},
            r"alert.rules\[0\].args.threshold: must be greater than 0",
        ),
        (
            {"alert": {"rules": [{"rule_name": "AnomalyNan", "args": {"thresh": 1}}]}},
            r"alert.rules\[0\].args.thresh: unknown field",
        ),
        ({"alert": {"dump": "true"}}, r"alert.dump: must be true or false"),
        ({"format": "feather"}, r"format: 'feather' is not one of csv, tensorboard, api, parquet"),
        ({"ops": ["min", "nrom"]}, r"ops\[1\]: 'nrom' is not one of"),
        ({"ops": "norm"}, r"ops: must be a list of op names"),
        ({"eps": 0}, r"eps: must be greater than 0"),
        ({"eps": "small"}, r"eps: must be a finite number"),
        ({"ndigits": -1}, r"ndigits: must be >= 0"),
        ({"step_count_per_record": 0}, r"step_count_per_record: must be >= 1"),
        ({"append_output": ["Dec03_21-34-40"]}, r"append_output: must hold two timestamps"),
        ({"append_output": ["Dec03_21-34-40", "yesterday"]}, r"append_output\[1\]: 'yesterday' is not a timestamp"),
        ({"squash_name": "false"}, r"squash_name: must be true or false"),
        ({"recording_l2_features": 1}, r"recording_l2_features: must be true or false"),
        ({"l2_targets": {"mlp_hook": []}}, r"l2_targets.mlp_hook: unknown field"),
        ({"l2_targets": {"linear_hook": "fc"}}, r"l2_targets.linear_hook: must be a list of strings"),
        ({"sa_order": "h,d,s,b"}, r"sa_order: 'h,d,s,b' is not one of"),
    ],
)
def test_invalid_field_names_its_path(patch, match):
    with pytest.raises(ConfigError, match=match):
        load_monitor_v1_config({**FULL, **patch})


def test_empty_ops_mean_norm_and_regex_codelines_load():
    cfg = load_monitor_v1_config({"ops": [], "cc_distribution": {"enable": True, "cc_codeline": ["train.py\\[23\\]"]}})
    assert cfg.ops == ("norm",) and cfg.cc.cc_codeline == ("train.py\\[23\\]",)


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_monitor_v1_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        load_monitor_v1_config(bad)
    bad.write_text(json.dumps([1]))
    with pytest.raises(ConfigError, match="top level must be a JSON object"):
        load_monitor_v1_config(bad)


# -- reference keys, integral floats, unusable files (issues 14.1, 15.6, 15.11) --------------------
def test_reference_logged_default_collect_times_1e8_is_an_integer() -> None:
    cfg = load_monitor_v1_config({"collect_times": 1e8, "step_interval": 2.0, "ndigits": 6.0})
    assert cfg.collect_times == 100_000_000 and isinstance(cfg.collect_times, int)
    assert cfg.step_interval == 2 and isinstance(cfg.ndigits, int)
    with pytest.raises(ConfigError, match=r"^collect_times: must be an integer, not a number 1\.5"):
        load_monitor_v1_config({"collect_times": 1.5})


def test_mg_distribution_is_accepted_with_one_warning(monkeypatch, caplog) -> None:
    import trainprobe.engine.log

    monkeypatch.setattr(trainprobe.engine.log, "_seen", set())
    with caplog.at_level("WARNING", logger="trainprobe"):
        load_monitor_v1_config({"mg_distribution": True})
        load_monitor_v1_config({"mg_distribution": True})
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and messages[0].startswith("config field mg_distribution: ")


def test_unknown_key_near_an_ignored_one_gets_a_hint() -> None:
    with pytest.raises(ConfigError, match=r"^mg_distributon: unknown field; did you mean 'mg_distribution'\?"):
        load_monitor_v1_config({"mg_distributon": True})


def test_deep_json_and_folder_paths_are_config_errors(tmp_path) -> None:
    deep = tmp_path / "deep.json"
    deep.write_text('{"a":' * 100_000 + "1" + "}" * 100_000)
    with pytest.raises(ConfigError, match=r"deep\.json' is nested too deeply"):
        load_monitor_v1_config(deep)
    with pytest.raises(ConfigError, match="is a folder; pass the path of the file inside it"):
        load_monitor_v1_config(tmp_path)
