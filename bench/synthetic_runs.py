"""Synthetic Monitor V2 ``weight_grad`` runs for the query benchmark (``bench_query.py``).

A run has ``ranks`` rank folders ``rank_<r>/``, each holding one file per window of ``window``
steps, ``weight_grad_step<a>-<b>.csv`` (or ``.parquet``), with the header trainprobe writes:
``vpp_stage,step,module_name,scope,micro_step,min,max,mean,norm,nans``; each step has
``params`` parameters in two scopes (``unreduced`` with micro_step 0, then ``reduced``).
Exactly one value is NaN: the ``norm`` of parameter ``nan_param`` on rank ``nan_rank`` at step
``nan_step`` (``reduced`` scope), so "the first NaN of the run" has one known answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

HEADER = ("vpp_stage", "step", "module_name", "scope", "micro_step", "min", "max", "mean", "norm", "nans")


@dataclass(frozen=True)
class Shape:
    """Size of a synthetic run and where its one NaN is."""

    ranks: int
    steps: int
    params: int
    window: int
    nan_rank: int
    nan_step: int
    nan_param: int

    @property
    def rows(self) -> int:
        return self.ranks * self.steps * self.params * 2


def _param(i: int) -> str:
    return f"layers.{i // 4}.{('q', 'k', 'v', 'o')[i % 4]}_proj.weight"


def write_csv_run(root: Path, shape: Shape) -> Path:
    """The run as CSV under ``root`` (created); returns ``root``."""
    names = [_param(i) for i in range(shape.params)]
    for rank in range(shape.ranks):
        folder = root / f"rank_{rank}"
        folder.mkdir(parents=True, exist_ok=True)
        for first in range(0, shape.steps, shape.window):
            last = min(first + shape.window, shape.steps) - 1
            lines = [",".join(HEADER)]
            for step in range(first, last + 1):
                base = 0.001 * (1 + step % 97) * (1 + rank % 5)
                for scope, micro in (("unreduced", "0"), ("reduced", "")):
                    for i, name in enumerate(names):
                        norm = base * (1 + i % 7)
                        cell = "nan" if (rank, step, i, scope) == _nan_at(shape) else repr(norm)
                        lines.append(
                            f"0,{step},{name},{scope},{micro},{-base!r},{base!r},{base / 10!r},{cell},0"
                        )
            (folder / f"weight_grad_step{first}-{last}.csv").write_text("\n".join(lines) + "\n")
    return root


def _nan_at(shape: Shape) -> tuple[int, int, int, str]:
    return (shape.nan_rank, shape.nan_step, shape.nan_param, "reduced")


def write_parquet_run(root: Path, shape: Shape, row_group: int = 1 << 20) -> Path:
    """The run as Parquet under ``root`` (created), made column by column with NumPy (fast enough
    for 10^8 rows); returns ``root``."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    names = pa.array([_param(i) for i in range(shape.params)] * 2).dictionary_encode()
    scopes = pa.array(["unreduced"] * shape.params + ["reduced"] * shape.params).dictionary_encode()
    micro_one = np.array([0] * shape.params + [-1] * shape.params)
    factor = np.tile(1 + np.arange(shape.params) % 7, 2).astype(np.float64)
    per_step = 2 * shape.params
    for rank in range(shape.ranks):
        folder = root / f"rank_{rank}"
        folder.mkdir(parents=True, exist_ok=True)
        for first in range(0, shape.steps, shape.window):
            last = min(first + shape.window, shape.steps) - 1
            steps = np.arange(first, last + 1)
            n = len(steps)
            step_col = np.repeat(steps, per_step)
            base = np.repeat(0.001 * (1 + steps % 97) * (1 + rank % 5), per_step)
            norm = base * np.tile(factor, n)
            if rank == shape.nan_rank and first <= shape.nan_step <= last:
                norm[(shape.nan_step - first) * per_step + shape.params + shape.nan_param] = np.nan
            micro = np.tile(micro_one, n)
            table = pa.table(
                {
                    "vpp_stage": pa.array(np.zeros(n * per_step, dtype=np.int64)),
                    "step": pa.array(step_col.astype(np.int64)),
                    "module_name": pa.chunked_array([names] * n),
                    "scope": pa.chunked_array([scopes] * n),
                    "micro_step": pa.array(micro, mask=micro < 0, type=pa.int64()),
                    "min": pa.array(-base),
                    "max": pa.array(base),
                    "mean": pa.array(base / 10),
                    "norm": pa.array(norm),
                    "nans": pa.array(np.zeros(n * per_step)),
                }
            )
            pq.write_table(table, folder / f"weight_grad_step{first}-{last}.parquet", row_group_size=row_group)
    return root
