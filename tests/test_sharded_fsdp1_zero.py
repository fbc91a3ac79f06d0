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
"""

from __future__ import annotations

import json
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
from test_sharded_full_tensors import OPS, Net  # noqa: E402
from trainprobe import TrainerMonitorV2  # noqa: E402

WORLD, STEPS = 2, 3
LAYOUTS = ("fsdp1_orig", "fsdp1_flat", "zero")
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


def _train(rank: int, root: Path, layout: str) -> None:
    model, opt = _model(layout)
    params = dict(model.named_parameters())
    size = {n: (REAL if layout == "fsdp1_flat" else p.numel() if layout == "zero" else _numel(model, n)) for n, p in params.items()}
    owner = None
    if layout == "zero":
        owner = {n: int(opt._param_to_rank[p]) for n, p in params.items()}  # type: ignore[attr-defined]
    cfg = {"output_dir": str(root / layout), "monitors": {m: {"enabled": True, "ops": OPS} for m in MONITORS}}
    mon = TrainerMonitorV2(write_config(root, cfg, name=f"{layout}_rank{rank}.json"))
    mon.start(model=model, optimizer=opt)
    full: dict[str, Any] = {}
    for step in range(STEPS):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(100 + step + 10 * rank))
        model(x).square().mean().backward()
        grads = {n: p.grad for n, p in params.items() if p.grad is not None}
        ref = {"weight_grad": _gathered(grads, size, {n: 0 for n in size} if owner else None)}
        opt.step()
        ref["param"] = _gathered({n: p for n, p in params.items()}, size, {n: 0 for n in size} if owner else None)
        moments = {f"{n}.{m}": s for n, s in size.items() for m in ("exp_avg", "exp_avg_sq")}
        moment_owner = {f"{n}.{m}": owner[n] for n in size for m in ("exp_avg", "exp_avg_sq")} if owner else None
        ref["optimizer"] = _gathered(_state(opt, params), moments, moment_owner)
        full[str(step)] = ref
        opt.zero_grad()
    mon.stop()
    if rank == 0:
        (root / f"{layout}_full.json").write_text(json.dumps(full))


def _numel(model: torch.nn.Module, name: str) -> int:
    """An original parameter's element count (FSDP1 with use_orig_params: the rank holds a 1-D piece)."""
    inner = dict(Net(7).named_parameters())
    return inner[name.removeprefix("_fsdp_wrapped_module.")].numel()


def _entry(rank: int, root: Path) -> None:
    for layout in LAYOUTS:
        _train(rank, root, layout)
        dist.barrier()


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
    for rank, lay in enumerate(layouts):  # a rank's copy of a parameter it does not step: before the broadcast
        for name, ranks in holders.items():
            scope = lay.get(("param", name.removesuffix(".exp_avg"), "param_updated"))
            assert (scope is None) == (ranks[0] == rank)
            assert scope is None or scope["kind"] == "rank_local"


def _reference(values: list[float]) -> dict[str, float]:
    t = torch.tensor(values, dtype=torch.float64)
    return {"min": t.min().item(), "max": t.max().item(), "mean": t.mean().item(), "norm": t.norm().item(),
            "nans": float(t.isnan().sum().item()), "numel": float(t.numel())}


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
