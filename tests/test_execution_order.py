"""One execution order for every offline tool (:mod:`trainprobe.engine.execution_order`): its key on
plain fields, and real tiny-GPT training with Monitor V1 alerts and a weight ×1e30 at step 30,
where ``anomaly-analyse``, ``report`` (its alerts, its timeline's star) and a scan of the CSV rows
must name the same first event."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from test_v1_support import make_v1
from trainprobe.demo.gpt import GPTConfig, TinyGPT
from trainprobe.engine.execution_order import (
    BACKWARD,
    FORWARD,
    OPTIMIZER,
    execution_key,
    phase_of_table,
    row_positions,
    table_of,
)
from trainprobe.tools.anomalies.analyser import AnomalyEvent, analyse
from trainprobe.tools.anomalies.analyser import execution_key as event_key
from trainprobe.tools.reporting.data import event_group, event_target, load_report_data
from trainprobe.tools.runs.rows import find_csv_files, read_table

SPIKE_STEP = 30
SPIKED = "layers.1.mlp.fc1"
#: Where training computes each table inside one step, earliest first.
STEP_ORDER = [
    ("actv", 0),
    ("actv", 1),
    ("actv_grad", 1),
    ("grad_unreduced", 1),
    ("actv", 2),  # the next micro-batch: after the backward of micro-batch 1
    ("grad_reduced", 0),
    ("other", 0),  # collectives
    ("param_origin", 0),
    ("exp_avg", 0),
    ("exp_avg_sq", 0),
    ("param_updated", 0),
]


# --------------------------------------------------------------------------- the key on plain fields


def _event(tag: str, position: int, micro: int = 0) -> AnomalyEvent:
    data = {"rank": 0, "step": 3, "micro_step": micro, "pp_stage": 0, "vpp_stage": -1, "call_id": position}
    return AnomalyEvent(key=tag, data={**data, "tag_name": tag}, source=Path("x"), phase="", once_per_step=False)


def test_v2_group_events_take_their_monitor_and_scope_phase(caplog):
    """The report names V2 onsets ``<target>/rank<r>/<monitor>/<scope>``: the group decides, not
    the scope alone (``reduced`` was an unknown table: ordered before the forward phase)."""
    forward = _event("fc1/rank0/module/forward", position=5, micro=1)
    reduced = _event("fc1.weight/rank0/weight_grad/reduced", position=0, micro=1)
    backward = _event("fc1/rank0/module/backward", position=9, micro=1)
    assert event_key(forward) < event_key(backward) < event_key(reduced)
    assert event_key(reduced) == execution_key(3, "grad_reduced", vpp_stage=-1)
    assert "no known phase" not in caplog.text


def test_key_orders_tables_as_training_computes_them():
    keys = [execution_key(4, table, micro_step=micro, position=99 - n) for n, (table, micro) in enumerate(STEP_ORDER)]
    assert keys == sorted(keys)
    assert execution_key(3, "param_updated") < execution_key(4, "unknown_table") < execution_key(4, "actv")
    assert execution_key(4, "actv", position=1, rank=1) < execution_key(4, "actv", position=2, rank=0)
    assert execution_key(4, "actv", position=2, rank=0) < execution_key(4, "actv", position=2, rank=1)
    # mg_direction rows of `other` belong to the optimizer, after the state, before the new parameters
    mg = execution_key(4, "other", target="fc1.weight.mg_direction")
    assert execution_key(4, "exp_avg_sq") < mg < execution_key(4, "param_updated")
    assert execution_key(4, "other", target="all_reduce.0") < execution_key(4, "param_origin")


def test_pipeline_stages_forward_up_backward_down():
    assert execution_key(1, "actv", vpp_stage=0, pp_stage=1) < execution_key(1, "actv", vpp_stage=1, pp_stage=0)
    assert execution_key(1, "actv_grad", pp_stage=1) < execution_key(1, "actv_grad", pp_stage=0)


def test_v2_groups_and_reference_tags_map_to_tables():
    assert table_of("weight_grad", "reduced") == table_of("weight_grad/reduced") == "grad_reduced"
    assert table_of("module/backward") == "actv_grad" and table_of("actv") == "actv"
    assert execution_key(2, "module/forward") == execution_key(2, "actv") == execution_key(2, "output")
    assert execution_key(2, "acc_grad", micro_step=1) == execution_key(2, "grad_unreduced", micro_step=1)
    assert phase_of_table("post_grad") == (BACKWARD, True) and phase_of_table("input") == (FORWARD, False)
    assert phase_of_table("optimizer/exp_avg") == (OPTIMIZER, True)


def test_row_positions_count_per_step():
    assert row_positions([3, 3, 3, 4, 4, 3]) == [0, 1, 2, 0, 1, 3]


def test_row_positions_of_any_key_and_of_numpy_arrays():
    """One numbering for every tool: per step (execution order's position), per (step, target)
    (csv2db's call index), and over numpy columns without a Python step per row (the report)."""
    import numpy as np

    assert row_positions([(1, "a"), (1, "b"), (1, "a"), (2, "a"), (1, "a")]) == [0, 0, 1, 0, 2]
    rng = np.random.default_rng(0)
    steps = rng.integers(0, 5, size=2000)
    ids = rng.integers(0, 3, size=2000)
    by_step = row_positions(steps)
    assert isinstance(by_step, np.ndarray) and by_step.dtype == np.int64
    assert by_step.tolist() == row_positions(steps.tolist())
    pairs = row_positions(np.column_stack([steps, ids]))
    assert isinstance(pairs, np.ndarray)
    assert pairs.tolist() == row_positions(list(zip(steps.tolist(), ids.tolist())))
    assert row_positions(np.zeros(0, dtype=np.int64)).tolist() == []
    assert row_positions(np.zeros((0, 2), dtype=np.int64)).tolist() == []
    with pytest.raises(ValueError, match="1-D or 2-D array of keys, got 3 dimensions"):
        row_positions(np.zeros((1, 1, 1), dtype=np.int64))


# --------------------------------------------------------------------------- real training


@pytest.fixture(scope="module")
def spiked_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Monitor V1 output (activations, gradients, optimizer state, alerts dumped) of a tiny GPT
    whose ``layers.1.mlp.fc1.weight`` is multiplied by 1e30 before step 30."""
    tmp_path = tmp_path_factory.mktemp("spiked")
    config = {
        "targets": {},
        "all_xy": True,
        "xy_distribution": True,
        "wg_distribution": True,
        "mv_distribution": True,
        "param_distribution": True,
        "ops": ["min", "max", "norm", "nans"],
        "alert": {
            "rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 1000}}, {"rule_name": "AnomalyNan"}],
            "dump": True,
        },
    }
    monkeypatch = pytest.MonkeyPatch()
    try:
        torch.manual_seed(0)
        model = TinyGPT(GPTConfig(vocab_size=40, seq_len=8, d_model=16, n_heads=2, n_layers=2))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        mon = make_v1(tmp_path, monkeypatch, config, params_have_main_grad=False)
        mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
        for step in range(SPIKE_STEP + 2):
            if step == SPIKE_STEP:
                with torch.no_grad():
                    model.layers[1].mlp.fc1.weight.mul_(1e30)
            model.loss(torch.randint(0, 40, (4, 8))).backward()
            opt.step()
            opt.zero_grad()
        mon.stop()
    finally:
        monkeypatch.undo()
    return tmp_path / "out"


def _csv_scan(root: Path) -> tuple[int, str, str]:
    """The first CSV row, in execution order, whose norm is non-finite or deviates by more than
    1000 times its target's (non-zero) mean norm over the earlier steps: (step, table, target)."""
    found = []
    for file in find_csv_files(root):
        table = read_table(file)
        steps = table.int_column(table.step_col)
        norms = table.value_columns()[table.ops.index("norm")]
        micro = table.micro_column()
        vpp = table.int_column(table.vpp_col)
        for row, position in enumerate(row_positions(steps)):
            target = table.rows[row][table.target_col]
            found.append((steps[row], file.data_type, target, micro[row], position, vpp[row], norms[row]))
    found.sort(key=lambda r: r[0])
    history: dict[tuple[str, str], list[float]] = {}
    hits = []
    for step, data_type, target, micro, position, vpp, norm in found:
        past = history.setdefault((data_type, target), [])
        mean = sum(past) / len(past) if past else math.nan
        if not math.isfinite(norm) or (past and mean != 0 and abs(norm - mean) > 1000 * abs(mean)):
            key = execution_key(step, data_type, target=target, micro_step=micro, position=position, vpp_stage=vpp)
            hits.append((key, step, data_type, target))
        elif math.isfinite(norm):
            past.append(norm)
    first = min(hits)
    return first[1], first[2], first[3]


def test_every_tool_names_the_same_first_event(spiked_run: Path):
    result = analyse(spiked_run / "anomaly_detected", topk=1000)
    first = result.events[0]
    named = (first["step"], event_group(first), event_target(first))
    assert named == (SPIKE_STEP, "actv", f"{SPIKED}.output")  # the spiked layer's output: right

    data = load_report_data(spiked_run)
    assert [e.key for e in data.alerts] == [e.key for e in result.events]  # the report's alerts: same order
    star = data.timeline[0]  # the timeline's star (alerts and NaN/inf rows of the CSVs together)
    assert (star.data["step"], event_group(star), event_target(star)) == named
    assert star.key == first.key
    assert _csv_scan(spiked_run) == named
    # the first NaN/inf row (a later module: LayerNorm of a 1e30 input) comes after it
    nonfinite = data.first_nonfinite
    assert nonfinite is not None and nonfinite.data["step"] == SPIKE_STEP
    assert event_key(star) < event_key(nonfinite)
    timeline = [event_key(e) for e in data.timeline]
    assert timeline == sorted(timeline)


def test_alerts_and_csv_rows_share_positions(spiked_run: Path):
    """Every alert of the forward phase got the position of its CSV row: alerts and NaN/inf rows
    of one step and table follow the order of the rows in the CSV."""
    data = load_report_data(spiked_run)
    forward = [e for e in data.alerts if e.data["step"] == SPIKE_STEP and event_group(e) == "actv"]
    assert forward and all(e.position is not None for e in forward)
    run = next(p for p in spiked_run.iterdir() if "-rank0-" in p.name)
    rows = [line.split(",")[1] for line in (run / f"actv_{SPIKE_STEP}-{SPIKE_STEP}.csv").read_text().splitlines()[1:]]
    assert [rows[e.position] for e in forward] == [event_target(e) for e in forward]
    json.dumps([e.position for e in forward])  # plain ints
