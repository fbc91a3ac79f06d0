"""The spike rules of ``trainprobe.engine.rules``: one definition each, online and offline.

* every rule's step-by-step verdicts equal its replay of the whole series (the median's
  replay is vectorised), on series with NaN/inf, zeros, spikes and squares;
* the median's reference is the float64 median of its window (NumPy's, computed apart);
* the warm-up cases on generated series: a 100x jump at step 9 is named at step 9 by the default
  rule, while falling early values, zero-initialised growth, Adam's state growing from 0 and a
  slow drift are not flagged; a x10 spike late is found at its step;
* the published rules as published (early max after its first 100, patience names the first
  outlier, the z-score EMA takes the clipped value);
* ``replay_many`` (many series end to end, what ``diagnose`` calls) gives each series' replay;
* ``median`` reproduces ``trainprobe diagnose``'s former SQL rule (a window median in DuckDB,
  kept here as an independent reference) row for row on a real Monitor V2 run of the tiny GPT
  with a gradient spike and a NaN, replayed by hand and through diagnose's own spike scan.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from trainprobe.engine.rules import DEFAULT_RULE, RULES, Verdict, rule_named
from trainprobe.engine.rules.median import RunningMedian
from trainprobe.engine.rules.published import EarlyMax, EmaZScore, MeanPatience
from trainprobe.engine.rules.series import SPIKE_OPS, SQUARED_SCOPES, is_squared, signals


def _stream(rule: Any, steps: np.ndarray, values: np.ndarray, squared: bool) -> list[Verdict]:
    state = rule.start(squared)
    found = []
    for step, value in zip(steps, values, strict=True):
        verdict = rule.update(state, int(step), float(value))
        if verdict is not None:
            found.append(verdict)
    return found


def _noisy(n: int, seed: int, spikes: dict[int, float] | None = None, scale: float = 1.0) -> np.ndarray:
    """A positive series with 20 % log-normal noise, ``spikes`` (step → factor) applied."""
    rng = np.random.default_rng(seed)
    values = scale * np.exp(rng.normal(0, 0.2, n))
    for step, factor in (spikes or {}).items():
        values[step] *= factor
    return values


def _hostile(seed: int) -> np.ndarray:
    """Noise with spikes, NaN, ±inf, zeros and a NaN run: everything a series can hold."""
    rng = np.random.default_rng(seed)
    values = _noisy(300, seed, {40: 30.0, 41: 30.0, 120: 200.0, 250: 12.0, 290: 1e4} | dict.fromkeys(range(270, 280), 8.0))
    values[rng.choice(300, 25, replace=False)] = np.nan
    values[rng.choice(300, 5, replace=False)] = np.inf
    values[rng.choice(300, 5, replace=False)] = -np.inf
    values[:7] = 0.0
    values[rng.choice(300, 10, replace=False)] = 0.0
    values[200:230] = np.nan
    return values


PARAMS: list[tuple[str, dict[str, Any]]] = [
    ("median", {}),
    ("median", {"factor": 3.0, "window": 5, "warmup": 2}),
    ("median", {"factor": 1.5, "window": 1, "warmup": 1}),
    ("early_max", {}),
    ("early_max", {"first": 10, "warmup": 3, "factor": 3.0}),
    ("mean_patience", {}),
    ("mean_patience", {"window": 10, "patience": 1, "factor": 1.5}),
    ("ema_z", {}),
    ("ema_z", {"warmup": 5, "z": 1.5}),
    ("recent_max", {}),
    ("recent_max", {"reference": "median", "factor": 2.0}),
]


@pytest.mark.parametrize(("name", "params"), PARAMS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(PARAMS)])
@pytest.mark.parametrize("squared", [False, True])
def test_streaming_and_replay_give_the_same_verdicts(name: str, params: dict[str, Any], squared: bool) -> None:
    rule = rule_named(name, **params)
    total = 0
    for seed in range(6):
        values = _hostile(seed) ** (2 if squared else 1)  # a series of squares holds squares
        steps = np.arange(len(values)) * 3 + 5  # steps of a run recorded every 3rd step
        online = _stream(rule, steps, values, squared)
        assert rule.replay(steps, values, squared) == online
        assert rule.replay(list(steps), list(values), squared) == online
        total += len(online)
        for v in online:
            assert math.isfinite(v.value) and v.value > 0 and v.score > v.bar
    assert total > 0  # every parameter set finds something in these series


def test_every_rule_is_registered_and_checked_here() -> None:
    from trainprobe.engine.anomaly.finding import REFERENCES

    assert set(RULES) == {name for name, _ in PARAMS}
    assert DEFAULT_RULE in RULES
    for name, make in RULES.items():
        assert make().name == name and make().describe().startswith(name)
        assert name in REFERENCES  # the answers word each rule's reference


@pytest.mark.parametrize(("name", "params"), PARAMS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(PARAMS)])
@pytest.mark.parametrize("squared", [False, True])
def test_replay_many_gives_each_series_replay(
    name: str, params: dict[str, Any], squared: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many series end to end (what diagnose passes: every series of a table at once) give the
    verdicts of each series judged alone, at positions into the arrays; the median's chunks of
    rows cut through series."""
    import trainprobe.engine.rules.median as median

    monkeypatch.setattr(median, "CHUNK", 97)
    rule = rule_named(name, **params)
    series = [_hostile(seed) ** (2 if squared else 1) for seed in range(6)]
    series += [np.array([np.nan]), np.array([5.0, 0.0, 100.0]), _noisy(150, 9, {3: 100.0, 120: 50.0})]
    steps = [np.arange(len(x)) * 3 + 5 for x in series]
    starts = np.cumsum([0] + [len(x) for x in series[:-1]])
    all_steps, all_values = np.concatenate(steps), np.concatenate(series)
    hits = rule.replay_many(starts, all_steps, all_values, squared)
    expected = [v for st, x in zip(steps, series, strict=True) for v in _stream(rule, st, x, squared)]
    assert hits.verdicts(all_steps, all_values) == expected and expected
    owner = np.searchsorted(starts, hits.at, side="right") - 1  # each hit lies in its own series
    assert [int(all_steps[a]) for a in hits.at] == [v.step for v in expected]
    assert list(owner) == sorted(owner)
    assert rule.replay_many([], [], [], squared).verdicts(np.zeros(0, np.int64), np.zeros(0)) == []
    with pytest.raises(ValueError, match="series starts"):
        rule.replay_many([1, 5], all_steps, all_values, squared)


def test_median_reference_is_the_float64_median_of_its_window() -> None:
    values = _hostile(3)
    steps = np.arange(len(values))
    rule = RunningMedian(factor=2.0, window=7, warmup=3)
    found = rule.replay(steps, values)
    assert len(found) > 5
    for v in found:
        window = values[max(0, v.step - 7) : v.step]
        window = window[np.isfinite(window)]
        assert len(window) >= 3
        assert v.reference == pytest.approx(float(np.median(window.astype(np.float64))), rel=1e-15)
        assert v.score == pytest.approx(values[v.step] / np.median(window), rel=1e-15)


def test_median_keeps_todays_semantics() -> None:
    rule = RunningMedian()
    steps = np.arange(30)
    # inside the 10-value warm-up a 100x jump is not named (today's blind spot)
    assert rule.replay(steps, _noisy(30, 1, {9: 100.0})) == []
    late = rule.replay(steps, _noisy(30, 1, {20: 100.0}))
    assert [v.step for v in late] == [20]
    # squares: the bar is factor ** 2
    assert RunningMedian().replay(steps, _noisy(30, 1, {20: 50.0}), squared=True) == []
    # a median of 0 (all-zero history) never gives a verdict
    zeros = np.r_[np.zeros(20), [1.0]]
    assert RunningMedian().replay(np.arange(21), zeros) == []
    # a NaN row takes a place in the window of rows without entering the median
    with_nans = np.r_[np.ones(10), np.full(15, np.nan), [50.0]]
    assert RunningMedian().replay(np.arange(26), with_nans) == []  # 5 finite of the last 20 < warm-up
    assert [v.step for v in RunningMedian(warmup=5).replay(np.arange(26), with_nans)] == [25]


# -- warm-up cases (the default rule) --------------------------------------------------------


def _default_steps(values: np.ndarray, squared: bool = False) -> list[int]:
    return [v.step for v in rule_named(DEFAULT_RULE).replay(np.arange(len(values)), values, squared)]


@pytest.mark.parametrize("seed", range(5))
def test_a_100x_jump_at_step_9_is_named_at_its_step(seed: int) -> None:
    assert _default_steps(_noisy(40, seed, {9: 100.0})) == [9]
    assert _default_steps(_noisy(40, seed, {2: 100.0})) == [2]  # even at the third value


@pytest.mark.parametrize("seed", range(5))
def test_a_x10_spike_late_is_named_at_its_step(seed: int) -> None:
    assert _default_steps(_noisy(200, seed, {150: 10.0})) == [150]
    assert _default_steps(_noisy(200, seed, {150: 100.0}) ** 2, squared=True) == [150]


@pytest.mark.parametrize("seed", range(5))
def test_healthy_warm_up_dynamics_are_not_flagged(seed: int) -> None:
    t = np.arange(200, dtype=np.float64)
    noise = _noisy(200, seed)
    falling = (1 + 30 * np.exp(-t / 8)) * noise  # large early gradients that fall
    zero_init = np.where(t < 3, 0.0, ((t - 2) ** 4) * noise)  # 0, then grows from 0 as t^4
    lr_warmup = np.minimum(t + 1, 20) ** 3 * noise  # growing as the LR warms up, then flat
    adam_v = np.cumsum(0.001 * (noise * 1e-2) ** 2 * 0.999 ** (-t)) * 0.999**t  # exp_avg_sq from 0
    adam_m = np.cumsum(0.1 * noise * 0.9 ** (-t)) * 0.9**t  # exp_avg from 0
    drift = 1.01**t * noise  # x7 over the run
    for series, squared in ((falling, False), (zero_init, False), (lr_warmup, False), (adam_v, True),
                            (adam_m, False), (drift, False)):
        assert _default_steps(series, squared) == []


def test_zeros_are_no_history() -> None:
    rule = rule_named(DEFAULT_RULE)
    state = rule.start()
    assert [rule.update(state, s, 0.0) for s in range(5)] == [None] * 5
    assert state.seen == 0
    assert rule.update(state, 5, 1e-3) is None  # the first non-zero value starts the series
    verdict = rule.update(state, 6, 1.0)  # 1000x its only value: above the n = 1 bar (64)
    assert verdict is not None and (verdict.step, verdict.reference, verdict.bar) == (6, 1e-3, 64.0)


# -- the published rules --------------------------------------------------------------------


def test_early_max_waits_for_its_first_100_values() -> None:
    values = _noisy(200, 0, {150: 20.0})
    found = EarlyMax().replay(np.arange(200), values)
    assert [v.step for v in found] == [150]
    assert found[0].reference == values[:100].max()
    blinded = _noisy(200, 0, {50: 100.0, 150: 20.0})  # a spike among the first 100 raises the bar
    assert EarlyMax().replay(np.arange(200), blinded) == []
    # checked from the 10th value: the step-50 spike is named and kept out of the max
    assert [v.step for v in EarlyMax(warmup=10).replay(np.arange(200), blinded)] == [50, 150]


def test_mean_patience_names_the_first_of_more_than_patience_outliers() -> None:
    four = _noisy(160, 0, dict.fromkeys(range(120, 124), 10.0) | {140: 50.0})
    assert MeanPatience().replay(np.arange(160), four) == []  # 4 in a row, a lone one: not more than 4
    five = _noisy(160, 0, dict.fromkeys(range(120, 125), 10.0))
    found = MeanPatience().replay(np.arange(160), five)
    assert [(v.step, v.decided) for v in found] == [(120, 124)]
    assert found[0].value == five[120] and found[0].reference == pytest.approx(five[20:120].mean())
    early = _noisy(160, 0, dict.fromkeys(range(50, 60), 10.0))
    assert MeanPatience().replay(np.arange(160), early) == []  # before the window of 100 is full


def test_ema_z_takes_the_clipped_value() -> None:
    values = _noisy(80, 0, {40: 100.0, 41: 100.0})
    rule = EmaZScore()
    found = rule.replay(np.arange(80), values)
    assert [v.step for v in found][:2] == [40, 41]  # clipped: the first spike did not hide the second
    assert all(v.bar == 2.5 for v in found)


def test_unknown_rules_and_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown spike rule 'megatron'; one of median, early_max"):
        rule_named("megatron")
    with pytest.raises(ValueError, match="spike rule 'median': .*unexpected keyword argument 'windw'"):
        rule_named("median", windw=3)
    with pytest.raises(ValueError, match=r"need 1 <= warmup \(30\) <= window \(20\)"):
        rule_named("median", warmup=30)
    with pytest.raises(ValueError, match="factor 1.0: need a number above 1"):
        rule_named("recent_max", factor=1.0)
    with pytest.raises(ValueError, match="reference 'mean': 'max' or 'median'"):
        rule_named("recent_max", reference="mean")
    with pytest.raises(ValueError, match="need two 1-d arrays of one length"):
        RunningMedian().replay([1, 2], [1.0])


def test_signals_are_todays() -> None:
    assert SPIKE_OPS == ("norm", "max", "min") and SQUARED_SCOPES == ("exp_avg_sq",)
    assert is_squared("exp_avg_sq") and not is_squared("exp_avg")
    got = signals({"min": np.array([-3.0, np.nan, 1.0]), "max": np.array([2.0, 5.0, np.inf]),
                   "norm": np.array([4.0, -np.inf, 2.0])})
    norm, amax = got["norm"], got["amax"]
    np.testing.assert_array_equal(norm[0], [4.0, np.nan, 2.0])
    np.testing.assert_array_equal(amax[0], [3.0, 5.0, 1.0])
    assert amax[1] == ["min", "max", "min"]  # the finite one where the other is NaN/inf, as online
    assert signals({"max": np.array([-2.0])})["amax"][1] == ["max"]


# -- the median rule is diagnose's rule, on a real run ---------------------------------------


def _train_run(out: Path) -> None:
    """The tiny GPT, 40 steps under Monitor V2: a x50 gradient at step 20, a NaN at step 30."""
    torch = pytest.importorskip("torch")
    from trainprobe import TrainerMonitorV2
    from trainprobe.demo.gpt import GPTConfig, TinyGPT, synthetic_batches

    ops = ["min", "max", "mean", "norm", "nans"]
    config = {"output_dir": str(out), "step_count_per_record": 16,
              "monitors": {m: {"enabled": True, "ops": ops} for m in ("module", "weight_grad", "optimizer", "param")}}
    path = out.parent / "config.json"
    path.write_text(json.dumps(config))
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=100, seq_len=16, d_model=32, n_heads=2, n_layers=2)
    model = TinyGPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    params = dict(model.named_parameters())
    batches = synthetic_batches(cfg, batch_size=4)
    monitor = TrainerMonitorV2(str(path))
    monitor.start(model=model, optimizer=opt)
    for step in range(40):
        model.loss(next(batches)).backward()
        if step == 20:
            params["layers.1.mlp.fc1.weight"].grad *= 50
        if step == 30:
            params["layers.0.mlp.fc2.weight"].grad[0, 0] = math.nan
        opt.step()
        opt.zero_grad()
    monitor.stop()


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("duckdb")
    out = tmp_path_factory.mktemp("rules") / "run"
    _train_run(out)
    return out


def _median_sql(views: dict[str, list[str]], factor: float, window: int, warmup: int) -> str:
    """The running median rule as DuckDB SQL (diagnose's own until it replayed engine/rules):
    a window ``ROWS BETWEEN W PRECEDING AND 1 PRECEDING`` per series, NaN/inf as NULL."""
    def finite(op: str) -> str:
        return f'CASE WHEN abs("{op}") < CAST(\'inf\' AS DOUBLE) THEN abs("{op}") END'

    keys = "rank, name, scope, micro_step, vpp_stage"
    bar = f"CASE WHEN scope = 'exp_avg_sq' THEN {factor ** 2!r} ELSE {factor!r} END"
    pick = f"{finite('min')} IS NOT NULL AND ({finite('max')} IS NULL OR abs(\"min\") > abs(\"max\"))"
    parts = []
    for table in views:
        base = (f"SELECT {keys}, step, file_row, {finite('norm')} AS a_norm, \"norm\" AS v_norm, 'norm' AS o_norm, "
                f"greatest({finite('min')}, {finite('max')}) AS a_amax, CASE WHEN {pick} THEN \"min\" ELSE \"max\" END AS v_amax, "
                f"CASE WHEN {pick} THEN 'min' ELSE 'max' END AS o_amax FROM {table}")
        frame = f"PARTITION BY {keys} ORDER BY step, file_row ROWS BETWEEN {window} PRECEDING AND 1 PRECEDING"
        stats = ", ".join(f"median(a_{k}) OVER w AS m_{k}, count(a_{k}) OVER w AS n_{k}" for k in ("norm", "amax"))
        for k in ("norm", "amax"):
            parts.append(
                f"SELECT '{table}' AS t, rank, step, name, scope, o_{k}, v_{k}, m_{k} FROM "
                f"(SELECT *, {stats} FROM ({base}) WINDOW w AS ({frame})) "
                f"WHERE n_{k} >= {warmup} AND m_{k} > 0 AND a_{k} > {bar} * m_{k}"
            )
    return " UNION ALL ".join(parts)


def _sql_rows(con: Any, views: dict[str, list[str]], rule: RunningMedian) -> set[tuple[Any, ...]]:
    return set(con.sql(_median_sql(views, rule.factor, rule.window, rule.warmup)).fetchall())


def _diagnose_rows(run: Path, rule: RunningMedian) -> set[tuple[Any, ...]]:
    """The spike table of diagnose's own scan (:func:`trainprobe.tools.diagnosis.spikes.keep_spikes`)."""
    import duckdb

    from trainprobe.tools.diagnosis.spikes import keep_spikes
    from trainprobe.tools.engines.duckdb_engine import DuckEngine
    from trainprobe.tools.runs.files import find_run_files

    engine = DuckEngine(run, find_run_files(run), duckdb.connect())
    keep_spikes(engine, "spikes", engine.views(), rule, None)
    return set(engine.fetch('SELECT "table", rank, step, name, scope, op, value, median FROM spikes'))


def _replayed_rows(con: Any, views: dict[str, list[str]], rule: RunningMedian) -> set[tuple[Any, ...]]:
    found = set()
    for table in views:
        rows = con.sql(
            f"SELECT rank, name, scope, micro_step, vpp_stage, step, min, max, norm FROM {table} "
            "ORDER BY rank, name, scope, micro_step, vpp_stage, step, file_row"
        ).fetchall()
        series: dict[tuple[Any, ...], list[tuple[Any, ...]]] = {}
        for row in rows:
            series.setdefault(row[:5], []).append(row)
        for (rank, name, scope, _micro, _vpp), items in series.items():
            ops = {op: np.array([np.nan if x[i] is None else x[i] for x in items], dtype=np.float64)
                   for op, i in (("min", 6), ("max", 7), ("norm", 8))}
            steps = np.array([x[5] for x in items])
            raw = {"norm": ops["norm"]}
            for signal, (values, names) in signals(ops).items():
                for v in rule.replay(steps, values, is_squared(scope)):
                    i = int(np.flatnonzero(steps == v.step)[0])
                    op = names[i]
                    shown = raw["norm"][i] if signal == "norm" else ops[op][i]
                    found.add((table, rank, v.step, name, scope, op, float(shown), v.reference))
    return found


@pytest.mark.parametrize("params", [{}, {"factor": 3.0, "window": 8, "warmup": 3}, {"factor": 1.5, "window": 3, "warmup": 1}])
def test_median_rule_reproduces_diagnose_sql_on_a_real_run(real_run: Path, params: dict[str, Any]) -> None:
    from trainprobe.tools.query.layer import connect, describe

    con = connect(real_run)
    views = {table: [c for c, _ in cols] for table, cols in describe(con).items()}
    rule = RunningMedian(**params)
    sql, replayed = _sql_rows(con, views, rule), _replayed_rows(con, views, rule)
    assert replayed == sql
    assert _diagnose_rows(real_run, rule) == sql
    assert len(sql) > (0 if not params else 10)
    if not params:  # today's answer: the x50 gradient at step 20 and its after-effects
        assert ("weight_grad", 0, 20, "layers.1.mlp.fc1.weight", "reduced", "norm") in {k[:6] for k in sql}
        assert min(k[2] for k in sql) == 20


def test_judge_all_keeps_the_series_with_verdicts() -> None:
    from trainprobe.engine.rules.series import judge_all

    steps = np.arange(40)
    series = [("a", steps, _noisy(40, 0, {30: 100.0}), False), ("b", steps, _noisy(40, 1), False),
              ("c", steps, _noisy(40, 2, {30: 100.0}) ** 2, True)]
    found = judge_all(rule_named(DEFAULT_RULE), series)
    assert sorted(found) == ["a", "c"] and [v.step for v in found["a"]] == [30] == [v.step for v in found["c"]]
