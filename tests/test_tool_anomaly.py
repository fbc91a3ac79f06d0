"""Anomaly analyser (``trainprobe anomaly-analyse``, ``python -m trainprobe.core.monitor.anomaly_processor``):
execution order against a hand-built set of events across ranks, pipeline stages, virtual stages,
phases and micro-steps; top-k, step lists, output folder, command lines, bad input; and the
output of real Monitor V1 runs (one process, and two ranks)."""

from __future__ import annotations

import io
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from models import MLP
from monitor_runs import NAN_RANK, NAN_STEP
from test_v1_support import make_v1
from trainprobe.engine.errors import ConfigError
from trainprobe.tools.anomalies.analyser import (
    BACKWARD,
    FORWARD,
    OPTIMIZER,
    UNKNOWN,
    analyse,
    execution_key,
    format_table,
    main,
    parse_step_list,
    phase_of,
    print_result,
)

Event = tuple[str, dict[str, Any]]


def event(rank: int, step: int, micro: int, pp: int, vpp: int, call: int, name: str, table: str) -> Event:
    """An anomaly.json entry as Monitor V1 writes it."""
    tag = f"{name}/rank{rank}/{table}"
    return f"{tag}_step_{step}_call_{call}", {
        "rank": rank,
        "step": step,
        "micro_step": micro,
        "pp_stage": pp,
        "vpp_stage": vpp,
        "call_id": call,
        "tag_name": tag,
        "message": f"Rule AnomalyNan reports anomaly signal in ({tag!r}, 'norm') at step {step}.",
        "group_mates": [0, 1],
    }


# Two pipeline stages (rank r = pp stage r, except the collectives O and P), two virtual stages,
# two micro-batches. Letters name the events; EXPECTED is the order training executed them.
EVENTS: dict[str, Event] = {
    "Q": event(1, 0, 0, 1, 0, 99, "0:fc1.weight", "param_origin"),  # step 0 comes before step 1
    "A": event(1, 1, 0, 1, 0, 5, "0:fc1.output", "actv"),
    "B": event(0, 1, 0, 0, 0, 9, "0:fc1.input", "actv"),  # forward: (vpp0, pp0) before (vpp0, pp1)
    "C": event(0, 1, 0, 0, 1, 2, "1:fc1.output", "actv"),  # (vpp1, pp0) after (vpp0, pp1)
    "D": event(1, 1, 0, 1, 1, 7, "1:fc2.output_grad", "actv_grad"),  # backward: (1,1) (1,0) (0,1) (0,0)
    "E": event(0, 1, 0, 0, 1, 3, "1:1.self_attention.core_attention_flash_0", "input_grad"),
    "F": event(1, 1, 0, 1, 0, 1, "0:fc2", "output_grad"),
    "G": event(0, 1, 0, 0, 0, 4, "0:fc1.weight", "grad_unreduced"),
    "H": event(0, 1, 1, 0, 0, 1, "0:fc1", "output"),  # micro-batch 1 after every event of micro-batch 0
    # once per step, after every micro-batch: reduced gradients and collectives, then the optimizer
    "I": event(0, 1, 2, 0, 0, 20, "0:fc1.weight", "grad_reduced"),
    "J": event(1, 1, 2, 1, 0, 20, "0:fc2.weight", "grad_reduced"),
    "O": event(1, 1, 0, 0, 0, 40, "all_reduce.0.out.0@train.py[12]", "other"),
    "P": event(0, 1, 0, 0, 0, 40, "all_reduce.0.out.0@train.py[12]", "other"),  # same key as O: rank 0 first
    "K": event(0, 1, 0, 0, 0, 21, "0:fc1.weight", "exp_avg"),
    "L": event(0, 1, 0, 0, 0, 30, "0:fc1.weight", "param_updated"),
    "M": event(1, 1, 0, 1, 0, 25, "0:fc2.weight", "exp_avg_sq"),
    "N": event(0, 1, 0, 0, 0, 22, "0:fc1.weight.mg_direction", "other"),
    "R": event(0, 2, 0, 0, 0, 1, "0:fc1.input", "actv"),
    "S": event(1, 3, 0, 1, 0, 1, "0:fc1.input", "actv"),
}
EXPECTED = "Q B A C D E F G H J I P O M K N L R S".split()


def write_events(root: Path, letters: str | None = None) -> Path:
    """``root/anomaly_detected/rank<r>/anomaly.json`` holding the events (shuffled)."""
    folder = root / "anomaly_detected"
    per_rank: dict[int, dict[str, Any]] = {}
    for letter in reversed(letters.split() if letters else list(EVENTS)):
        key, value = EVENTS[letter]
        per_rank.setdefault(value["rank"], {})[key] = value
    for rank, events in per_rank.items():
        (folder / f"rank{rank}").mkdir(parents=True, exist_ok=True)
        (folder / f"rank{rank}" / "anomaly.json").write_text(json.dumps(events, indent=4), encoding="utf-8")
    return folder


def keys(letters: list[str]) -> list[str]:
    return [EVENTS[letter][0] for letter in letters]


def run_cli(*args: str, module: str = "trainprobe") -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", module, *(["anomaly-analyse"] if module == "trainprobe" else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


# --------------------------------------------------------------------------- order and selection


def test_execution_order_exact_and_output_layout(tmp_path):
    folder = write_events(tmp_path)
    result = analyse(folder, topk=100)
    assert [e.key for e in result.events] == keys(EXPECTED)
    assert result.selected == result.found == len(EVENTS) and len(result.files) == 2
    assert result.output == folder / "anomaly_analyse.json"
    written = json.loads(result.output.read_text(encoding="utf-8"))
    assert list(written) == keys(EXPECTED)  # a dict keyed as the input, in execution order
    assert written == {key: value for key, value in (EVENTS[letter] for letter in EXPECTED)}
    phases = [e.phase for e in result.events]
    assert phases[:4] == [OPTIMIZER, FORWARD, FORWARD, FORWARD] and phases[4:8] == [BACKWARD] * 4
    keys_sorted = [execution_key(e) for e in result.events]
    assert keys_sorted == sorted(keys_sorted)


def test_topk_default_and_given(tmp_path):
    folder = write_events(tmp_path)
    assert [e.key for e in analyse(folder).events] == keys(EXPECTED[:8])
    result = analyse(folder, topk=3)
    assert [e.key for e in result.events] == keys(EXPECTED[:3])
    assert list(json.loads(result.output.read_text())) == keys(EXPECTED[:3])
    with pytest.raises(ConfigError, match=r"topk: expected an integer >= 1, got 0"):
        analyse(folder, topk=0)


@pytest.mark.parametrize(
    ("text", "steps"),
    [("[2,3]", [2, 3]), ("2,3", [2, 3]), (" [ 2 , 3 ] ", [2, 3]), ("1", [1]), ("[]", []), ("", [])],
)
def test_step_list_forms(text, steps):
    assert parse_step_list(text) == steps


@pytest.mark.parametrize("text", ["[2,x]", "-1", "[1,,2]", "2;3", "[2"])
def test_step_list_bad(text):
    with pytest.raises(ConfigError, match=r"step_list: .* is not a list of steps"):
        parse_step_list(text)


def test_step_list_selects(tmp_path):
    folder = write_events(tmp_path)
    result = analyse(folder, topk=100, step_list=[3, 0])
    assert [e.key for e in result.events] == keys(["Q", "S"])
    assert result.selected == 2 and result.found == len(EVENTS)
    assert [e.key for e in analyse(folder, topk=100, step_list=[]).events] == keys(EXPECTED)
    assert analyse(folder, step_list=[7]).events == []
    assert json.loads((folder / "anomaly_analyse.json").read_text()) == {}
    with pytest.raises(ConfigError, match=r"step_list: expected integers >= 0, got '2'"):
        analyse(folder, step_list=["2"])  # type: ignore[list-item]


def test_output_folder_and_parent_of_anomaly_detected(tmp_path):
    folder = write_events(tmp_path / "mon")
    out = tmp_path / "new" / "nested"
    result = analyse(folder, out_path=out, topk=2)
    assert result.output == out / "anomaly_analyse.json" and result.output.is_file()
    assert not (folder / "anomaly_analyse.json").exists()
    result = analyse(tmp_path / "mon", topk=2)  # the monitor output folder that contains anomaly_detected
    assert result.output == folder / "anomaly_analyse.json"
    assert [e.key for e in result.events] == keys(EXPECTED[:2])
    analyse(folder, topk=100)  # a re-run does not read its own output
    assert len(json.loads((folder / "anomaly_analyse.json").read_text())) == len(EVENTS)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"out_path: .*file' exists and is not a folder"):
        analyse(folder, out_path=tmp_path / "file")


@pytest.mark.parametrize(
    ("tag", "phase", "once"),
    [
        ("0:fc1.input/rank0/actv", FORWARD, False),
        ("0:1.self_attention.core_attention_flash_0/rank0/input", FORWARD, False),
        ("0:fc1/rank3/output", FORWARD, False),
        ("0:fc1/rank0/linear_hook", FORWARD, False),
        ("0:fc1/rank0/attention_hook", FORWARD, False),
        ("0:fc1.output_grad/rank0/actv_grad", BACKWARD, False),
        ("0:1.self_attention.core_attention_flash_0/rank0/input_grad", BACKWARD, False),
        ("0:fc1/rank0/output_grad", BACKWARD, False),
        ("0:fc1.weight/rank0/grad_unreduced", BACKWARD, False),
        ("0:fc1.weight/rank0/grad_reduced", BACKWARD, True),
        ("all_reduce.0.out.0@a.py[3]/rank0/other", BACKWARD, True),
        ("0:fc1.weight.mg_direction/rank0/other", OPTIMIZER, True),
        ("0:fc1.weight/rank0/exp_avg", OPTIMIZER, True),
        ("0:fc1.weight/rank0/exp_avg_sq", OPTIMIZER, True),
        ("0:fc1.weight/rank0/param", OPTIMIZER, True),
        ("0:fc1.weight/rank0/param_origin", OPTIMIZER, True),
        ("0:fc1.weight/rank0/param_updated", OPTIMIZER, True),
        ("0:fc1.weight/rank0/adam_update", OPTIMIZER, True),
        ("0:fc1.weight/rank0/adam_ratio", OPTIMIZER, True),
        # the reference tool's tags: names carry ':<micro_step>', weight gradients acc/pre/post_grad
        ("0:fc1.input:0/rank0/actv", FORWARD, False),
        ("0:.output:1/rank0/actv_grad", BACKWARD, False),
        ("0:fc1.weight/rank0/acc_grad", BACKWARD, False),
        ("0:fc1.weight/rank0/pre_grad", BACKWARD, False),
        ("0:fc1.weight/rank0/post_grad", BACKWARD, True),
        ("0:layers.0.mlp.router/rank0/moe_router_weight_hook", FORWARD, False),
    ],
)
def test_phase_of_tags(tag, phase, once):
    assert phase_of(tag) == (phase, once)


def test_unknown_tag_is_ordered_before_forward_with_one_warning(tmp_path, caplog):
    """An unknown suffix no longer stops the analysis: the reference tool gives it stage -1."""
    assert phase_of("0:fc1/rank0/weird") == (UNKNOWN, False)
    assert phase_of("0:fc2/rank0/weird") == (UNKNOWN, False)
    assert sum("no known phase for 'weird'" in r.getMessage() for r in caplog.records) == 1
    folder = tmp_path / "anomaly_detected" / "rank0"
    folder.mkdir(parents=True)
    base = {"rank": 0, "step": 1, "micro_step": 0, "pp_stage": 0, "vpp_stage": 0, "message": "", "group_mates": [0]}
    events = {
        "f": {**base, "call_id": 0, "tag_name": "0:fc1.input:0/rank0/actv"},
        "u": {**base, "call_id": 9, "tag_name": "0:fc1/rank0/weird"},
    }
    (folder / "anomaly.json").write_text(json.dumps(events), encoding="utf-8")
    assert [e.key for e in analyse(tmp_path).events] == ["u", "f"]


# --------------------------------------------------------------------------- bad input


def test_missing_and_empty_folders(tmp_path):
    with pytest.raises(ConfigError, match=r"data_path: '.*nowhere' does not exist"):
        analyse(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match=r"holds no rank<r>/anomaly.json"):
        analyse(tmp_path)
    (tmp_path / "anomaly_detected" / "rank0").mkdir(parents=True)  # a rank folder without the file
    with pytest.raises(ConfigError, match=r"anomaly_detected' holds no rank<r>/anomaly.json"):
        analyse(tmp_path)
    (tmp_path / "f").write_text("{}")
    with pytest.raises(ConfigError, match=r"is not a folder"):
        analyse(tmp_path / "f")


def test_malformed_files_name_the_file(tmp_path):
    folder = write_events(tmp_path)
    bad = folder / "rank1" / "anomaly.json"
    bad.write_text('{"a": ', encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(bad))}: not valid JSON \(Expecting value: line 1"):
        analyse(folder)
    bad.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(bad))}: expected a JSON object of events, got list"):
        analyse(folder)
    bad.write_bytes(b"\xff\xfe{")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(bad))}: not UTF-8 text \(byte 0xff at offset 0\)"):
        analyse(folder)


def _with(changes: dict[str, Any], drop: str | None = None) -> dict[str, Any]:
    key, value = EVENTS["A"]
    value = {**value, **changes}
    if drop:
        del value[drop]
    return {key: value}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (_with({}, drop="step"), r"event '0:fc1.output/rank1/actv_step_1_call_5': missing field 'step'"),
        (_with({}, drop="group_mates"), r"missing field 'group_mates'"),
        (_with({"extra": 1}), r"event '0:fc1.output/rank1/actv_step_1_call_5': unknown field 'extra'"),
        (_with({"step": "1"}), r"field 'step' must be an integer, got '1'"),
        (_with({"call_id": True}), r"field 'call_id' must be an integer, got True"),
        (_with({"tag_name": 3}), r"field 'tag_name' must be a string, got 3"),
        (_with({"group_mates": [0, "1"]}), r"field 'group_mates' must be a list of integers"),
        ({"k": [1]}, r"event 'k': expected an object, got list"),
    ],
)
def test_bad_events_name_file_and_key(tmp_path, content, message):
    path = tmp_path / "anomaly_detected" / "rank1" / "anomaly.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(content), encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: .*{message}"):
        analyse(tmp_path)


def test_same_key_in_two_files(tmp_path):
    folder = write_events(tmp_path, "A")
    (folder / "rank5").mkdir()
    (folder / "rank5" / "anomaly.json").write_text(json.dumps(dict([EVENTS["A"]])))
    with pytest.raises(
        ConfigError, match=r"rank5/anomaly.json: event .*: the same key is also in .*rank1/anomaly.json"
    ):
        analyse(folder)


# --------------------------------------------------------------------------- printing and command lines


def test_printed_table_plain_and_rich(tmp_path, capsys):
    folder = write_events(tmp_path)
    assert main(["-d", str(folder), "-k", "3", "-s", "[1]"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "first 3 of 16 anomalies (steps 1; 19 in 2 file(s)), in execution order"
    assert out[1].split() == [
        "order",
        "step",
        "micro_step",
        "phase",
        "vpp_stage",
        "pp_stage",
        "rank",
        "call_id",
        "rule",
        "tag_name",
    ]
    assert out[3].split() == ["1", "1", "0", "forward", "0", "0", "0", "9", "AnomalyNan", "0:fc1.input/rank0/actv"]
    assert out[1].index("tag_name") == out[3].index("0:fc1.input")  # aligned columns
    assert out[-1] == f"written to {folder / 'anomaly_analyse.json'}"
    assert format_table([]).splitlines()[0].split()[0] == "order"
    assert main(["-d", str(folder), "-s", "9"]) == 0
    assert capsys.readouterr().out.startswith("no anomalies in steps 9 (19 in 2 file(s))\n")

    pytest.importorskip("rich")

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    print_result(analyse(folder, topk=100), [], stream)
    text = stream.getvalue()
    assert "all_reduce.0.out.0@train.py[12]/rank0/other" in text  # brackets are not rich markup, nothing cut
    assert "1:1.self_attention.core_attention_flash_0/rank0/input_grad" in text


def test_command_lines_success_and_errors(tmp_path):
    folder = write_events(tmp_path)
    done = run_cli("-d", str(folder), "-k", "4", "-s", "[1]", "-o", str(tmp_path / "o1"))
    assert done.returncode == 0, done.stderr
    assert "first 4 of 16 anomalies" in done.stdout and "0:fc1.input/rank0/actv" in done.stdout
    assert list(json.loads((tmp_path / "o1" / "anomaly_analyse.json").read_text())) == keys(EXPECTED[1:5])

    done = run_cli(
        "--data_path",
        str(tmp_path),
        "--topk",
        "4",
        "--step_list",
        "1",
        module="trainprobe.core.monitor.anomaly_processor",
    )
    assert done.returncode == 0, done.stderr
    assert list(json.loads((folder / "anomaly_analyse.json").read_text())) == keys(EXPECTED[1:5])

    missing = tmp_path / "missing"
    for module in ("trainprobe", "trainprobe.core.monitor.anomaly_processor"):
        done = run_cli("-d", str(missing), module=module)
        assert done.returncode == 2
        assert done.stderr == f"trainprobe anomaly-analyse: error: data_path: '{missing}' does not exist\n"

    (folder / "rank0" / "anomaly.json").write_text("{oops", encoding="utf-8")
    done = run_cli("-d", str(folder))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith(
        f"trainprobe anomaly-analyse: error: {folder / 'rank0' / 'anomaly.json'}: not valid JSON"
    )
    assert done.stderr.count("\n") == 1


# --------------------------------------------------------------------------- real monitor output


def test_real_v1_run_first_anomaly_is_the_injected_nan(tmp_path, monkeypatch, capsys):
    config = {
        "targets": {},
        "all_xy": True,
        "xy_distribution": True,
        "wg_distribution": True,
        "mv_distribution": True,
        "param_distribution": True,
        "ops": ["norm", "nans"],
        "alert": {"rules": [{"rule_name": "AnomalyNan"}], "dump": True},
    }
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    mon = make_v1(tmp_path, monkeypatch, config, params_have_main_grad=False)
    mon.set_monitor(model, grad_acc_steps=2, optimizer=opt)
    for step in range(4):
        for micro in range(2):
            x = torch.randn(4, 6)
            if (step, micro) == (2, 1):
                x[0, 0] = math.nan  # the input of the second micro-batch of step 2
            model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    mon.stop()
    capsys.readouterr()

    result = analyse(tmp_path / "out", topk=1000)
    events = result.events
    assert len(events) == result.found > 20
    first = events[0]
    assert (first["step"], first["micro_step"], first.phase) == (2, 1, FORWARD)
    assert first["tag_name"] == "0:.input:1/rank0/actv"
    step2 = [(e.phase, e["tag_name"].rsplit("/", 1)[1]) for e in events if e["step"] == 2]
    phases = [p for p, _ in step2]
    assert phases == sorted(phases, key=[FORWARD, BACKWARD, OPTIMIZER].index)  # forward, backward, optimizer
    tables = [t for _, t in step2]
    assert tables.index("post_grad") > tables.index("actv_grad")
    assert tables.index("exp_avg") > max(i for i, t in enumerate(tables) if t == "post_grad")
    assert {e["step"] for e in events} == {2, 3}
    assert all(e.data["step"] == 3 for e in events[len(step2) :])


def test_two_rank_v1_run(monitor_runs, tmp_path):
    result = analyse(monitor_runs.v1 / "anomaly_detected", out_path=tmp_path, topk=1000)
    assert len(result.files) == 2
    first = result.events[0]
    assert (first["rank"], first["step"], first["tag_name"]) == (NAN_RANK, NAN_STEP, "0:fc2.bias/rank1/post_grad")
    order = [execution_key(e) for e in result.events]
    assert order == sorted(order)
    # in the backward phase the later pipeline stage (rank 1 here) comes first
    reduced = [e["rank"] for e in result.events if e["step"] == NAN_STEP + 1 and e["tag_name"].endswith("post_grad")]
    assert reduced == sorted(reduced, reverse=True) and set(reduced) == {0, 1}
    written = json.loads((tmp_path / "anomaly_analyse.json").read_text())
    assert list(written) == [e.key for e in result.events]


# --------------------------------------------------------------------------- the reference tool's files


def reference_event(tag: str, step: int, call: int, micro: int = 0) -> tuple[str, dict[str, Any]]:
    """One event as the reference tool's V1 monitor writes it (key ``<tag>_step_<s>_call_<id>``,
    call_id -1 for parameter states it does not number)."""
    message = f"Rule AnomalyTurbulence reports anomaly signal in ('{tag}', 'norm') at step {step}, current value 2.0"
    value = {
        "rank": 0,
        "step": step,
        "micro_step": micro,
        "pp_stage": 0,
        "vpp_stage": 0,
        "call_id": call,
        "tag_name": tag,
        "message": message,
        "group_mates": [0],
    }
    return f"{tag}_step_{step}_call_{call}", value


def test_reference_anomaly_json_is_analysed(tmp_path):
    """The layout of the reference tool's anomaly.json (indent 1, tags with ':<micro>', acc_grad and
    post_grad weight gradients, call_id -1): read, ordered, written back key for key."""
    events = dict(
        [
            reference_event("0:fc1.weight/rank0/post_grad", 1, 20),
            reference_event("0:fc2.bias/rank0/param_origin", 1, -1),
            reference_event("0:fc1.weight/rank0/exp_avg", 1, 24),
            reference_event("0:fc1.weight/rank0/acc_grad", 1, 19),
            reference_event(".output:0/rank0/actv_grad", 1, 9),
            reference_event("0:fc1.input:0/rank0/actv", 1, 0),
            reference_event("0:fc1.input:0/rank0/actv", 0, 0),
        ]
    )
    folder = tmp_path / "monitor_output" / "anomaly_detected" / "rank0"
    folder.mkdir(parents=True)
    (folder / "anomaly.json").write_text(json.dumps(events, indent=1), encoding="utf-8")
    result = analyse(tmp_path / "monitor_output", topk=10)
    assert [(e["step"], e["tag_name"].rsplit("/", 1)[1], e.phase) for e in result.events] == [
        (0, "actv", "forward"),
        (1, "actv", "forward"),
        (1, "actv_grad", "backward"),
        (1, "acc_grad", "backward"),
        (1, "post_grad", "backward"),  # once per step: after the micro-steps
        (1, "param_origin", "optimizer"),  # call_id -1 first in its phase (the reference: before forward)
        (1, "exp_avg", "optimizer"),
    ]
    written = json.loads(result.output.read_text(encoding="utf-8"))
    assert list(written) == [e.key for e in result.events]
    assert all(written[k] == events[k] for k in written)


def test_reference_file_with_a_byte_order_mark(tmp_path):
    key, value = reference_event("0:fc1.weight/rank0/acc_grad", 2, 3)
    folder = tmp_path / "anomaly_detected" / "rank0"
    folder.mkdir(parents=True)
    (folder / "anomaly.json").write_bytes(b"\xef\xbb\xbf" + json.dumps({key: value}).encode())
    assert [e.key for e in analyse(tmp_path).events] == [key]


def test_the_reference_option_spelling_step(tmp_path, capsys):
    """The reference's anomaly_processor spells the step list ``-s``/``--step``."""
    key, value = reference_event("0:fc1.weight/rank0/acc_grad", 2, 3)
    other_key, other = reference_event("0:fc1.weight/rank0/acc_grad", 3, 3)
    folder = tmp_path / "anomaly_detected" / "rank0"
    folder.mkdir(parents=True)
    (folder / "anomaly.json").write_text(json.dumps({key: value, other_key: other}), encoding="utf-8")
    assert main(["-d", str(tmp_path / "anomaly_detected"), "--step", "[3]"]) == 0
    written = json.loads((tmp_path / "anomaly_detected" / "anomaly_analyse.json").read_text(encoding="utf-8"))
    assert list(written) == [other_key]
