"""Live full-tensor statistics (issue #32 item 6, Monitor V2 ``"global_stats": true``): on real
gloo ranks, tensor parallelism on two (ColwiseParallel / RowwiseParallel) and 2-D FSDP2 + TP on a
2×2 mesh, ``monitor.global_stats(step)`` on every rank equals the statistics of the gathered full
tensors (``DTensor.full_tensor()``, float64) — gradient, parameter before and after the step, Adam
moments — within 1e-6 relative (min/max exact, NaN and element counts exact), and equals the
read side's ``weight_grad_full`` view of the same run. A NaN in one rank's shard shows in the
merged values; a rank whose packing fails leaves its tensors out on every rank without stopping
training; a config that cannot work is refused at start naming the field."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("duckdb")
pytest.importorskip("pyarrow")

from conftest import write_config  # noqa: E402
from test_distributed_v2 import launch  # noqa: E402
from test_sharded_full_tensors import Net  # noqa: E402
from trainprobe import TrainerMonitorV2  # noqa: E402
from trainprobe.engine.errors import ConfigError  # noqa: E402

OPS = ["min", "max", "mean", "norm", "nans", "zeros"]
STEPS = 3
NAN_STEP = STEPS - 1  # TP: a NaN in rank 1's shard of fc1.weight's gradient at the last step
MONITORS = ("weight_grad", "param", "optimizer")

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)


def _stats(t: torch.Tensor) -> dict[str, float]:
    """Float64 reference statistics of a full tensor."""
    t = t.detach().double().flatten()
    return {
        "min": t.min().item(), "max": t.max().item(), "mean": t.mean().item(), "norm": t.norm().item(),
        "nans": float(t.isnan().sum().item()), "zeros": (t.abs() < 1e-8).double().mean().item(),
    }


def _full(t: Any) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _config(root: Path, rank: int, name: str, top: dict[str, Any] | None = None) -> Path:
    monitors = {m: {"enabled": True, "ops": OPS} for m in MONITORS}
    cfg = {"output_dir": str(root / name), "global_stats": True, "monitors": monitors, **(top or {})}
    return write_config(root, cfg, name=f"{name}_rank{rank}.json")


def _model(layout: str) -> tuple[torch.nn.Module, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    if layout == "tp":
        model = Net(6)
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, plan)
        return model, None
    from torch.distributed.fsdp import fully_shard

    model = Net(8)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], plan)
    fully_shard(model, mesh=mesh["dp"])
    return model, mesh["dp"]


def _train(rank: int, root: Path, layout: str) -> None:
    """Train STEPS steps; save, per step, the live values and the gathered tensors' statistics."""
    model, dp = _model(layout)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    mon = TrainerMonitorV2(_config(root, rank, layout))
    mon.start(model=model, optimizer=opt)
    live, want = {}, {}
    for step in range(STEPS):
        seed = 10 * step + (dp.get_local_rank() if dp is not None else 0)
        model(torch.randn(5, 8, generator=torch.Generator().manual_seed(seed))).square().mean().backward()
        if layout == "tp" and step == NAN_STEP and rank == 1:
            model.fc1.weight.grad.to_local()[0, 0] = math.nan
        ref = {}
        for name, p in model.named_parameters():
            ref[f"weight_grad|{name}|reduced"] = _stats(_full(p.grad))
            ref[f"param|{name}|param_origin"] = _stats(_full(p))
        opt.step()
        for name, p in model.named_parameters():
            ref[f"param|{name}|param_updated"] = _stats(_full(p))
            for moment in ("exp_avg", "exp_avg_sq"):
                ref[f"optimizer|{name}.{moment}|{moment}"] = _stats(_full(opt.state[p][moment]))
        opt.zero_grad()
        live[step] = {"|".join(k): v for k, v in mon.global_stats(step).items()}
        want[step] = ref
    latest = mon.global_stats()
    mon.stop()
    after_stop = mon.global_stats(STEPS - 1)
    out = {"live": live, "want": want, "latest_is_last": latest == after_stop == mon.global_stats(STEPS - 1)}
    (root / f"{layout}_rank{rank}.json").write_text(json.dumps(out))


def _fault_and_refusals(rank: int, root: Path) -> None:
    """TP: rank 1's packing breaks; then configs refused at start (every rank)."""
    model, _ = _model("tp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2(_config(root, rank, "fault"))
    errors: list[str] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: errors.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("trainprobe").addHandler(handler)
    try:
        mon.start(model=model, optimizer=opt)
        if rank == 1:
            mon._live._slot_of = {}  # type: ignore[union-attr]  # the fault: every sharded row's slot unknown
        seen = []
        for step in range(2):
            model(torch.randn(5, 8, generator=torch.Generator().manual_seed(step))).square().mean().backward()
            opt.step()
            opt.zero_grad()
            seen.append(sorted("|".join(k) for k in mon.global_stats(step)))
        mon.stop()
    finally:
        logging.getLogger("trainprobe").removeHandler(handler)
    refused = {}
    for case, top in {"rank": {"rank": [0]}, "bad": {"global_stats": "yes"}}.items():
        try:
            TrainerMonitorV2(_config(root, rank, f"refused_{case}", top)).start(model=model, optimizer=opt)
        except ConfigError as exc:
            refused[case] = str(exc)
    only_module = {"output_dir": str(root / "refused_module"), "global_stats": True, "monitors": {"module": {}}}
    try:
        TrainerMonitorV2(write_config(root, only_module, name=f"m{rank}.json")).start(model=model)
    except ConfigError as exc:
        refused["module"] = str(exc)
    (root / f"fault_rank{rank}.json").write_text(json.dumps({"seen": seen, "errors": errors, "refused": refused}))


def _cc_run(rank: int, root: Path) -> None:
    """TP with ``cc`` on, with and without ``global_stats``: the loop's own all_reduce each step."""
    counts = {}
    for name, live in (("cc_live", True), ("cc_plain", False)):
        model, _ = _model("tp")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        monitors = {"weight_grad": {"enabled": True, "ops": OPS}, "cc": {"enabled": True, "ops": OPS}}
        cfg = {"output_dir": str(root / name), "global_stats": live, "monitors": monitors}
        mon = TrainerMonitorV2(write_config(root, cfg, name=f"{name}_rank{rank}.json"))
        mon.start(model=model, optimizer=opt)
        for step in range(STEPS):
            model(torch.randn(5, 8, generator=torch.Generator().manual_seed(step))).square().mean().backward()
            dist.all_reduce(torch.ones(3) * step)  # the loop's collective: a cc row
            opt.step()
            opt.zero_grad()
        counts[name] = mon._live.collectives if mon._live is not None else -1
        mon.stop()
    (root / f"cc_rank{rank}.json").write_text(json.dumps(counts))


def _tp_entry(rank: int, root: Path) -> None:
    _train(rank, root, "tp")
    dist.barrier()
    _fault_and_refusals(rank, root)
    dist.barrier()
    _cc_run(rank, root)


def _two_d_entry(rank: int, root: Path) -> None:
    _train(rank, root, "2d")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("live")
    launch(_tp_entry, root, timeout=300, world=2)
    launch(_two_d_entry, root, timeout=300, world=4)
    return root


def _saved(root: Path, layout: str) -> list[dict[str, Any]]:
    world = 2 if layout == "tp" else 4
    return [json.loads((root / f"{layout}_rank{r}.json").read_text()) for r in range(world)]


def _same(got: float, want: float, op: str) -> bool:
    if math.isnan(want):
        return math.isnan(got)
    if op in ("min", "max", "nans"):  # exact: float64 of the float32 elements, counts
        return got == float(torch.tensor(want, dtype=torch.float32)) if op != "nans" else got == want
    return got == pytest.approx(want, rel=1e-6, abs=1e-9 if op == "mean" else 1e-12)


@pytest.mark.parametrize("layout", ["tp", "2d"])
def test_live_values_equal_the_gathered_full_tensors(runs: Path, layout: str) -> None:
    for rank, saved in enumerate(_saved(runs, layout)):
        assert saved["latest_is_last"]
        for step in range(STEPS):
            live, want = saved["live"][str(step)], saved["want"][str(step)]
            assert sorted(live) == sorted(want), (rank, step)  # every tensor, whole, replica or shard
            for key, values in want.items():
                assert set(live[key]) == set(OPS)
                bad = {op: (live[key][op], v) for op, v in values.items() if not _same(live[key][op], v, op)}
                assert not bad, (rank, step, key, bad)


def test_a_nan_in_one_shard_shows_in_the_merged_values(runs: Path) -> None:
    for saved in _saved(runs, "tp"):
        grad = saved["live"][str(NAN_STEP)]["weight_grad|fc1.weight|reduced"]
        assert grad["nans"] == 1 and math.isnan(grad["max"]) and math.isnan(grad["min"]) and math.isnan(grad["norm"])
        assert not math.isnan(saved["live"][str(NAN_STEP - 1)]["weight_grad|fc1.weight|reduced"]["norm"])


@pytest.mark.parametrize("layout", ["tp", "2d"])
def test_live_values_equal_the_read_sides_full_view(runs: Path, layout: str) -> None:
    from trainprobe.tools.query.layer import connect

    con = connect(runs / layout)
    rows = con.execute(
        f"SELECT step, name, {', '.join(OPS)}, complete FROM weight_grad_full WHERE scope = 'reduced' ORDER BY step, name"
    ).fetchall()
    steps = STEPS - 1 if layout == "tp" else STEPS  # the read side's min/max of a NaN piece differ (DuckDB)
    checked = 0
    for saved in _saved(runs, layout):
        for step, name, *values, complete in rows:
            if step >= steps:
                continue
            live = saved["live"][str(step)][f"weight_grad|{name}|reduced"]
            assert complete
            for op, value in zip(OPS, values):
                assert live[op] == pytest.approx(value, rel=1e-6, abs=1e-12), (step, name, op)
            checked += 1
    assert checked == len(_saved(runs, layout)) * steps * 4


def test_a_rank_whose_packing_fails_leaves_its_tensors_out_everywhere(runs: Path) -> None:
    saved = [json.loads((runs / f"fault_rank{r}.json").read_text()) for r in range(2)]
    # rank 0 keeps the replicated bias (its own row is the full tensor's); rank 1 contributes nothing
    kept = [["weight_grad|fc2.bias|reduced"], []]
    for rank, got in enumerate(saved):
        for keys in got["seen"]:
            assert [k for k in keys if k.startswith("weight_grad|")] == kept[rank], (rank, keys)
    faults = [m for m in saved[1]["errors"] if "global_stats: packing" in m]
    assert len(faults) == 1 and "left out from now on" in faults[0]
    assert saved[0]["errors"] == []


def test_one_collective_per_step_and_no_cc_row_of_its_own(runs: Path) -> None:
    """One collective per collected step; ``cc`` writes the same rows with global_stats on and off."""
    from conftest import rows_of

    for rank in range(2):
        assert json.loads((runs / f"cc_rank{rank}.json").read_text())["cc_live"] == STEPS
        seen = {}
        for name in ("cc_live", "cc_plain"):
            rows = rows_of(runs / name, "cc", rank)
            seen[name] = [(r["step"], r["module_name"], r["scope"]) for r in rows]
        assert seen["cc_live"] == seen["cc_plain"], rank
        assert len({s for s, _, _ in seen["cc_plain"]}) == STEPS  # the loop's all_reduce, each step
        assert not any("gather" in n for _, n, _ in seen["cc_live"]), seen["cc_live"]


def test_configs_that_cannot_work_are_refused_naming_the_field(runs: Path) -> None:
    for rank in range(2):
        refused = json.loads((runs / f"fault_rank{rank}.json").read_text())["refused"]
        assert refused["rank"].startswith("global_stats: every rank takes part") and "[1]" in refused["rank"]
        assert refused["bad"].startswith("global_stats:")
        assert refused["module"].startswith("global_stats: merges the rows of monitors.weight_grad")


def test_single_process_gives_the_local_rows(tmp_path: Path) -> None:
    """One process: every tensor is whole, no collective; the values are the rows written."""
    from conftest import rows_of

    torch.manual_seed(0)
    model = Net(7)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMonitorV2(_config(tmp_path, 0, "single", {"step_interval": 2}))
    mon.start(model=model, optimizer=opt)
    for _ in range(3):
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert mon.global_stats(1) == {} and mon._live is not None and mon._live.collectives == 0
    mon.stop()
    rows = {r["module_name"]: r for r in rows_of(tmp_path / "single", "weight_grad") if r["step"] == "2"
            and r["scope"] == "reduced"}
    live = mon.global_stats()
    assert live == mon.global_stats(2) and len(live) == 4 * 3  # SGD: no moments
    for name, row in rows.items():
        assert live[("weight_grad", name, "reduced")] == {op: float(row[op]) for op in OPS}


def test_global_stats_must_be_a_boolean(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^global_stats: .*true or false"):
        TrainerMonitorV2(_config(tmp_path, 0, "bad", {"global_stats": 1}))
