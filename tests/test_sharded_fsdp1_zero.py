"""FSDP1 and ZeRO-style sharding on gloo (issue #32, items 1 and 7): each rank's
``tensor_layout.json`` says what its rows are, and the full-tensor views rebuild the statistics of
the gathered tensors (float64 reference) exactly: norm and mean within 1e-6 relative, min/max
exact, element counts exact.

* ``FullyShardedDataParallel(use_orig_params=True)``: each original parameter on a rank is a 1-D
  view of its part of the rank's flat shard, possibly empty (``fc1.weight`` spans both ranks, the
  other parameters lie on rank 1 alone);
* ``use_orig_params=False``: the rows are of the ``FlatParameter``, whose last rank holds FSDP's
  padding (zeros that must reach no merged value);
* ``ZeroRedundancyOptimizer`` over DDP: each rank keeps the optimizer state of some parameters,
  whole, and none of the others.

The reference of each monitored tensor is gathered in the workers: every rank's local tensor
(flattened, float64) in rank order, which for FSDP1 is the flat tensor, cut to its real elements.

The same runs check the follow-ups of #32 on these layouts:

* the monitor follows the ``ZeroRedundancyOptimizer`` passed, not the Adam it steps inside: one
  row per (step, name, scope) on each rank, and ``param_updated`` read after ``step()`` returned
  (after the owner's broadcast) on every rank;
* live full-tensor statistics (``"global_stats": true``) on every rank equal the gathered
  tensors' (FSDP1's 1-D pieces and flat shards with padding; ZeRO's one-rank moments);
* a healthy FSDP1 ``use_orig_params=True`` run whose rank 0 holds empty pieces has no row for
  them, no online anomaly event, and ``trainprobe diagnose`` (full tensors and ``--rank-local``)
  finds nothing.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("duckdb")
pytest.importorskip("pyarrow")

from conftest import rows_of, write_config  # noqa: E402
from test_distributed_v2 import launch  # noqa: E402
from test_sharded_full_tensors import OPS, Net  # noqa: E402
from trainprobe import TrainerMonitorV2  # noqa: E402

WORLD, STEPS = 2, 3
LAYOUTS = ("fsdp1_orig", "fsdp1_flat", "zero")
RULES_RUN = "fsdp1_rules"  # fsdp1_orig with the online rules on the rank-local rows (no global_stats)
ANOMALY = {"rules": ["nonfinite", "spike"], "actions": ["log"]}
LIVE_OPS = [*OPS, "zeros"]
REAL = 8 * 7 + 7 + 7 * 3 + 3  # Net(7)'s elements: the flat parameter without its padding
MONITORS = ("weight_grad", "param", "optimizer")

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)


def _model(layout: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    if layout == "zero":
        ddp = DistributedDataParallel(Net(7))
        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
    fsdp = FullyShardedDataParallel(Net(7), use_orig_params=layout == "fsdp1_orig", device_id=torch.device("cpu"))
    return fsdp, torch.optim.Adam(fsdp.parameters(), lr=0.01)


def _gathered(local: dict[str, torch.Tensor], size: dict[str, int], owner: dict[str, int] | None = None) -> dict[str, list[float]]:
    """Each name's full tensor: the ranks' flattened local tensors in rank order, cut to
    ``size[name]`` elements (FSDP1), or the tensor of rank ``owner[name]`` (ZeRO's state)."""
    pieces: list[Any] = [None] * WORLD
    dist.all_gather_object(pieces, {n: t.detach().double().flatten().tolist() for n, t in local.items()})
    out = {}
    for name in size:
        if owner is not None:
            out[name] = pieces[owner[name]][name]
        else:
            out[name] = [v for p in pieces for v in p.get(name, [])][: size[name]]
    return out


def _state(opt: torch.optim.Optimizer, params: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps its rank's state in .optim
    out = {}
    for name, p in params.items():
        for moment, t in inner.state.get(p, {}).items():
            if moment in ("exp_avg", "exp_avg_sq"):
                out[f"{name}.{moment}"] = t
    return out


def _train(rank: int, root: Path, layout: str, run: str | None = None) -> None:
    run = run or layout
    live_on = run != RULES_RUN
    model, opt = _model(layout)
    params = dict(model.named_parameters())
    size = {n: (REAL if layout == "fsdp1_flat" else p.numel() if layout == "zero" else _numel(model, n)) for n, p in params.items()}
    owner = None
    if layout == "zero":
        owner = {n: int(opt._param_to_rank[p]) for n, p in params.items()}  # type: ignore[attr-defined]
    monitors = {m: {"enabled": True, "ops": LIVE_OPS} for m in MONITORS}
    cfg = {"output_dir": str(root / run), "monitors": monitors, "global_stats": live_on, "anomaly": ANOMALY}
    mon = TrainerMonitorV2(write_config(root, cfg, name=f"{run}_rank{rank}.json"))
    mon.start(model=model, optimizer=opt)
    full: dict[str, Any] = {}
    live: dict[str, Any] = {}
    after_step: dict[str, Any] = {}  # this rank's parameters once step() returned
    for step in range(STEPS):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(100 + step + 10 * rank))
        model(x).square().mean().backward()
        grads = {n: p.grad for n, p in params.items() if p.grad is not None}
        ref = {"weight_grad": _gathered(grads, size, {n: 0 for n in size} if owner else None)}
        opt.step()
        after_step[str(step)] = {n: _reference(p.detach().double().flatten().tolist()) for n, p in params.items() if p.numel()}
        ref["param"] = _gathered({n: p for n, p in params.items()}, size, {n: 0 for n in size} if owner else None)
        moments = {f"{n}.{m}": s for n, s in size.items() for m in ("exp_avg", "exp_avg_sq")}
        moment_owner = {f"{n}.{m}": owner[n] for n in size for m in ("exp_avg", "exp_avg_sq")} if owner else None
        ref["optimizer"] = _gathered(_state(opt, params), moments, moment_owner)
        full[str(step)] = ref
        opt.zero_grad()
        live[str(step)] = {"|".join(k): v for k, v in mon.global_stats(step).items()}
    collectives = mon._live.collectives if mon._live is not None else 0
    mon.stop()
    saved = {"live": live, "after_step": after_step, "collectives": collectives}
    (root / f"{run}_rank{rank}_saved.json").write_text(json.dumps(saved))
    if rank == 0:
        (root / f"{run}_full.json").write_text(json.dumps(full))


def _numel(model: torch.nn.Module, name: str) -> int:
    """An original parameter's element count (FSDP1 with use_orig_params: the rank holds a 1-D piece)."""
    inner = dict(Net(7).named_parameters())
    return inner[name.removeprefix("_fsdp_wrapped_module.")].numel()


def _entry(rank: int, root: Path) -> None:
    for layout in LAYOUTS:
        _train(rank, root, layout)
        dist.barrier()
    _train(rank, root, "fsdp1_orig", RULES_RUN)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fsdp1_zero")
    launch(_entry, root, timeout=300, world=WORLD)
    return root


def _layouts(root: Path) -> list[dict[tuple[str, str, str | None], dict[str, Any]]]:
    docs = [json.loads((root / f"rank_{r}" / "tensor_layout.json").read_text()) for r in range(WORLD)]
    return [{(e["monitor"], e["name"], e["scope"]): e for e in d["tensors"]} for d in docs]


def test_fsdp1_original_parameters_are_flat_pieces(runs: Path) -> None:
    l0, l1 = _layouts(runs / "fsdp1_orig")
    w0, w1 = (lay[("weight_grad", "_fsdp_wrapped_module.fc1.weight", None)] for lay in (l0, l1))
    assert w0["kind"] == w1["kind"] == "shard" and w0["global_shape"] == w1["global_shape"] == [7, 8]
    assert w0["flat_offset"] == 0 and w1["flat_offset"] == w0["numel"] and w0["numel"] + w1["numel"] == 56
    assert w0["local_shape"] == [w0["numel"]] and w0["offsets"] is None
    empty = l0[("param", "_fsdp_wrapped_module.fc2.bias", None)]  # rank 0's flat shard ends inside fc1.weight
    assert (empty["kind"], empty["numel"], empty["flat_offset"]) == ("shard", 0, None)
    assert l1[("param", "_fsdp_wrapped_module.fc2.bias", None)]["numel"] == 3


def test_fsdp1_flat_parameter_says_its_padding(runs: Path) -> None:
    l0, l1 = _layouts(runs / "fsdp1_flat")
    name = "_fsdp_wrapped_module._flat_param"
    f0, f1 = l0[("param", name, None)], l1[("param", name, None)]
    chunk = math.ceil(REAL / WORLD)
    assert (f0["offsets"], f1["offsets"]) == ([0], [chunk]) and f0["global_shape"] == [REAL]
    assert (f0["padding"], f1["padding"]) == (0, WORLD * chunk - REAL)
    assert l0[("optimizer", f"{name}.exp_avg_sq", None)]["padding"] == 0
    assert l0[("weight_grad", name, "unreduced")]["kind"] == "rank_local"


def test_zero_optimizer_state_is_described_on_its_rank_only(runs: Path) -> None:
    layouts = _layouts(runs / "zero")
    holders: dict[str, list[int]] = {}
    for rank, lay in enumerate(layouts):
        for monitor, name, _ in lay:
            if monitor == "optimizer" and name.endswith(".exp_avg"):
                holders.setdefault(name, []).append(rank)
                assert lay[(monitor, name, None)]["state_rank"] == rank and lay[(monitor, name, None)]["kind"] == "whole"
    assert sorted(holders) == sorted(f"module.{n}.exp_avg" for n, _ in Net(7).named_parameters())
    assert all(len(r) == 1 for r in holders.values()) and {r[0] for r in holders.values()} == {0, 1}


def test_zero_param_updated_is_described_as_the_whole_parameter(runs: Path) -> None:
    for lay in _layouts(runs / "zero"):
        assert not [key for key, entry in lay.items() if key[0] == "param" and entry["kind"] == "rank_local"]


def _reference(values: list[float]) -> dict[str, float]:
    t = torch.tensor(values, dtype=torch.float64)
    return {"min": t.min().item(), "max": t.max().item(), "mean": t.mean().item(), "norm": t.norm().item(),
            "nans": float(t.isnan().sum().item()), "numel": float(t.numel()),
            "zeros": (t.abs() < 1e-8).double().mean().item()}


def _f32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_full_views_equal_the_gathered_tensors(runs: Path, layout: str) -> None:
    from trainprobe.tools.query.layer import connect

    full = json.loads((runs / f"{layout}_full.json").read_text())
    con = connect(runs / layout)
    checked: dict[str, int] = {}
    scopes = {"weight_grad": "'reduced'", "param": "'param_updated'", "optimizer": "'exp_avg', 'exp_avg_sq'"}
    for table in MONITORS:
        rows = con.execute(
            f"SELECT step, name, min, max, mean, norm, nans, numel, complete FROM {table}_full "
            f"WHERE scope IN ({scopes[table]}) AND kind = 'merged' ORDER BY step, name"
        ).fetchall()
        for step, name, lo, hi, mean, norm, nans, numel, complete in rows:
            want = _reference(full[str(step)][table][name])
            assert norm == pytest.approx(want["norm"], rel=1e-6), (table, step, name)
            assert mean == pytest.approx(want["mean"], rel=1e-6, abs=1e-12), (table, step, name)
            assert (nans, numel, complete) == (want["nans"], want["numel"], True), (table, step, name)
            # exact, or unknown where FSDP's padding zero may be the extreme (never the padding's 0)
            assert lo == _f32(want["min"]) or (lo is None and layout == "fsdp1_flat" and want["min"] >= 0), (name, lo)
            assert hi == _f32(want["max"]) or (hi is None and layout == "fsdp1_flat" and want["max"] <= 0), (name, hi)
            checked[table] = checked.get(table, 0) + 1
    tensors = 1 if layout == "fsdp1_flat" else 4
    assert checked == {"weight_grad": STEPS * tensors, "param": STEPS * tensors, "optimizer": 2 * STEPS * tensors}


def test_padding_zeros_reach_no_merged_extreme(runs: Path) -> None:
    """exp_avg_sq is >= 0: the padded rank's min is the padding's 0, so the merged min is unknown
    (NULL), while its max, norm and mean are exact (test above)."""
    from trainprobe.tools.query.layer import connect

    con = connect(runs / "fsdp1_flat")
    [(rank_min,)] = con.execute(
        "SELECT min FROM optimizer WHERE rank = 1 AND scope = 'exp_avg_sq' AND step = 0"
    ).fetchall()
    [(merged_min,)] = con.execute(
        "SELECT min FROM optimizer_full WHERE scope = 'exp_avg_sq' AND step = 0"
    ).fetchall()
    assert rank_min == 0.0 and merged_min is None


# -- ZeroRedundancyOptimizer: the monitor follows what the user steps -------------------------
def _keys(root: Path, table: str, rank: int) -> list[tuple[str, str, str]]:
    return [(r["step"], r["module_name"], r["scope"]) for r in rows_of(root, table, rank)]


@pytest.mark.parametrize("table", MONITORS)
def test_zero_writes_each_row_once_per_rank(runs: Path, table: str) -> None:
    for rank in range(WORLD):
        keys = _keys(runs / "zero", table, rank)
        assert keys and len(keys) == len(set(keys)), (rank, [k for k in keys if keys.count(k) > 1][:4])
        assert {k[0] for k in keys} == {str(s) for s in range(STEPS)}, rank
    per_step = {r: len(_keys(runs / "zero", "weight_grad", r)) // STEPS for r in range(WORLD)}
    assert per_step == {0: 8, 1: 8}  # 4 parameters, reduced and unreduced, once


def test_zero_param_updated_is_read_after_the_broadcast_on_every_rank(runs: Path) -> None:
    for rank in range(WORLD):
        after = json.loads((runs / f"zero_rank{rank}_saved.json").read_text())["after_step"]
        rows = [r for r in rows_of(runs / "zero", "param", rank) if r["scope"] == "param_updated"]
        assert len(rows) == STEPS * 4, rank
        for row in rows:
            want = after[row["step"]][row["module_name"]]
            assert float(row["norm"]) == pytest.approx(want["norm"], rel=1e-6), (rank, row["step"], row["module_name"])
            assert (float(row["min"]), float(row["max"])) == (_f32(want["min"]), _f32(want["max"])), (rank, row)


# -- live full-tensor statistics on FSDP1 and ZeRO --------------------------------------------
_LIVE_TABLES = {"weight_grad": ("reduced",), "param": ("param_updated",), "optimizer": ("exp_avg", "exp_avg_sq")}


def _live_matches(layout: str, key: str, got: dict[str, float], want: dict[str, float]) -> list[str]:
    """The ops of a live full-tensor value that differ from the gathered tensor's."""
    bad = []
    for op in LIVE_OPS:
        if op in ("min", "max"):
            padding_may_decide = layout == "fsdp1_flat" and (want[op] >= 0 if op == "min" else want[op] <= 0)
            if op not in got and padding_may_decide:
                continue  # unknown where FSDP's padding zero may be the extreme (never the padding's 0)
            if got.get(op) != _f32(want[op]):
                bad.append(f"{key} {op}: {got.get(op)} != {want[op]}")
        elif op == "nans":
            if got[op] != want[op]:
                bad.append(f"{key} nans: {got[op]} != {want[op]}")
        elif got[op] != pytest.approx(want[op], rel=1e-6, abs=1e-12):
            bad.append(f"{key} {op}: {got[op]} != {want[op]}")
    return bad


@pytest.mark.parametrize("layout", LAYOUTS)
def test_live_values_equal_the_gathered_tensors_on_every_rank(runs: Path, layout: str) -> None:
    full = json.loads((runs / f"{layout}_full.json").read_text())
    names = {n for step in full.values() for n in step["param"]}
    for rank in range(WORLD):
        saved = json.loads((runs / f"{layout}_rank{rank}_saved.json").read_text())
        assert saved["collectives"] == STEPS, rank  # one per step, whatever the layout
        for step in range(STEPS):
            live, ref = saved["live"][str(step)], full[str(step)]
            bad: list[str] = []
            checked = 0
            for table, scopes in _LIVE_TABLES.items():
                for scope in scopes:
                    for name in names:
                        row = f"{name}.{scope}" if table == "optimizer" else name
                        key = f"{table}|{row}|{scope}"
                        assert key in live, (rank, step, key)  # every rank: its pieces, empty ones, others' state
                        bad += _live_matches(layout, key, live[key], _reference(ref[table][row]))
                        checked += 1
            assert not bad, (layout, rank, step, bad)
            assert checked == 4 * len(names)


def test_live_values_leave_a_padding_extreme_out_only(runs: Path) -> None:
    """exp_avg_sq >= 0: rank 1's flat shard ends in padding zeros, so its min (0) may be the
    padding's; the merged min is left out on every rank, the max (exact) is there."""
    for rank in range(WORLD):
        live = json.loads((runs / f"fsdp1_flat_rank{rank}_saved.json").read_text())["live"]["0"]
        value = live["optimizer|_fsdp_wrapped_module._flat_param.exp_avg_sq|exp_avg_sq"]
        assert "min" not in value and value["max"] > 0 and value["zeros"] < 1, (rank, value)


# -- FSDP1 empty pieces: no false NaN anomaly ------------------------------------------------
def _diagnose(run: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, "-m", "trainprobe", "diagnose", str(run), *flags]
    return subprocess.run(args, capture_output=True, text=True, timeout=300, check=False)


def test_an_empty_piece_has_no_param_rows(runs: Path) -> None:
    l0, _ = _layouts(runs / RULES_RUN)
    empty = sorted(name for (monitor, name, _), e in l0.items() if monitor == "param" and e["numel"] == 0)
    assert empty == [f"_fsdp_wrapped_module.{n}" for n in ("fc1.bias", "fc2.bias", "fc2.weight")]
    every = {f"_fsdp_wrapped_module.{n}" for n, _ in Net(7).named_parameters()}
    for table in MONITORS:
        held = [{_param_of(r["module_name"]) for r in rows_of(runs / RULES_RUN, table, rank)} for rank in range(WORLD)]
        assert held == [every - set(empty), every], table  # rank 1 holds a piece of each


def _param_of(row_name: str) -> str:
    for moment in (".exp_avg_sq", ".exp_avg"):
        if row_name.endswith(moment):
            return row_name.removesuffix(moment)
    return row_name


@pytest.mark.parametrize("run", [RULES_RUN, *LAYOUTS])
def test_healthy_sharded_runs_fire_no_online_event(runs: Path, run: str) -> None:
    for rank in range(WORLD):
        events = runs / run / f"rank_{rank}" / "anomaly_events.jsonl"
        assert not events.exists() or not events.read_text().strip(), (rank, events.read_text()[:300])


@pytest.mark.parametrize("flags", [(), ("--rank-local",)])
def test_diagnose_finds_no_anomaly_in_a_healthy_run_with_empty_pieces(runs: Path, flags: tuple[str, ...]) -> None:
    done = _diagnose(runs / RULES_RUN, *flags)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("no anomaly") and "online:" not in done.stdout, done.stdout
