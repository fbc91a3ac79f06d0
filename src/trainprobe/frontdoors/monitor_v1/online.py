"""Monitor V1's ``anomaly`` block: the online rules of Monitor V2 over V1's statistics.

The block is the one of :mod:`trainprobe.engine.anomaly.config` (``rules``, ``spike_rule``,
``spike_factor``, ``actions``, ``dump``, ``before_update``), judged by the same
:class:`~trainprobe.frontdoors.monitor_v2.anomaly_watch.AnomalyWatch` on the rows V1 already
computes, named as V1's files write them (:class:`V1Tables`), so that each event is worded as
``trainprobe diagnose`` words the same row of the V1 run::

    step 14, rank 0, grad_reduced layers.1.mlp.fc1.weight: norm = 11.0546, 102.5x its running median 0.107859 (spike)

Where things go (V1's layout):

* events: ``<MONITOR_OUTPUT_DIR>/<MonDD_HH-MM-SS>-rank<r>-<id>/anomaly_events.jsonl``, the rank's
  run folder (created for it with ``format: api`` too); the same JSON Lines as V2's;
* the ``dump`` action: ``<MONITOR_OUTPUT_DIR>/anomaly_dump/step<N>/rank<r>/`` (a precision dump,
  read by ``trainprobe compare``).

V1's own alert rules (``alert.rules``, ``AnomalyTurbulence``/``AnomalyNan``, ``alert.dump``,
``anomaly.json``) are untouched and run beside the block.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainprobe.engine.anomaly.config import AnomalyConfig
from trainprobe.engine.anomaly.events import AnomalyEvent
from trainprobe.engine.probes.base import StepClock
from trainprobe.engine.records import RowKey
from trainprobe.engine.stats.ops import COUNT_OPS
from trainprobe.frontdoors.monitor_v1 import output
from trainprobe.frontdoors.monitor_v1.naming import bare
from trainprobe.frontdoors.monitor_v2.anomaly_watch import DUMP_FOLDER, Agree, AnomalyWatch, Group, Rows

JUDGED_TABLES: frozenset[str] = frozenset(t for t in output.TABLES if t not in output.L2_COLUMNS)
"""The V1 tables whose columns are the configured ops (the l2 features have their own)."""


class V1Tables:
    """V1's rows as its files write them: the table of each row (:func:`output.table_of
    <trainprobe.frontdoors.monitor_v1.output.table_of>`), the name without its ``<vpp_stage>:``
    prefix, the scope the table's name (as the query layer reads a V1 file), a micro-step only
    where the table has the column, and the values rounded to ``ndigits`` where the files round.

    Args:
        ops: the statistics (value order).
        ndigits: the rounding of the data files (None: not rounded, ``format`` api/tensorboard).
        mbs_grad: ``monitor_mbs_grad`` (``grad_unreduced`` then has a micro-step column).
    """

    def __init__(self, ops: tuple[str, ...], ndigits: int | None, mbs_grad: bool) -> None:
        self.ndigits = ndigits
        self._micro = frozenset(output.MICRO_STEP_TABLES + (("grad_unreduced",) if mbs_grad else ()))
        self._counts = tuple(op in COUNT_OPS for op in ops)

    def judged(self, monitor: str) -> bool:
        """Every probe's rows are looked at (the table decides, per row)."""
        return True

    def groups(self, monitor: str, rows: Rows) -> list[Group]:
        """``rows`` cut into runs of one judged table, renamed and rounded as written."""
        out: list[Group] = []
        for position, (key, values) in enumerate(rows):
            table = output.table_of(monitor, key)
            if table not in JUDGED_TABLES:
                continue
            written = RowKey(
                key.vpp_stage,
                bare(key.name),
                table,
                key.micro_step if table in self._micro else None,
            )
            row = (written, self._rounded(values))
            if out and out[-1][0] == table and out[-1][1] + len(out[-1][2]) == position:
                out[-1][2].append(row)
            else:
                out.append((table, position, [row]))
        return out

    def _rounded(self, values: list[float]) -> list[float]:
        digits = self.ndigits
        if digits is None:
            return [float(v) for v in values]
        return [float(v) if count else round(float(v), digits) for v, count in zip(values, self._counts)]


def v1_watch(
    config: AnomalyConfig,
    *,
    ops: tuple[str, ...],
    ndigits: int | None,
    mbs_grad: bool,
    rank: int,
    run_folder: Path,
    clock: StepClock,
    model: Any,
    on_anomaly: Callable[[AnomalyEvent], Any] | None,
    agree: Agree | None,
) -> AnomalyWatch:
    """The watch of one V1 configuration (see the module docstring): events in ``run_folder``,
    dumps under ``$MONITOR_OUTPUT_DIR/anomaly_dump``; ``agree``: how the ranks agree on a stop
    (None: this process alone)."""
    return AnomalyWatch(
        config,
        rank=rank,
        rank_dir=run_folder,
        output_dir=output.output_root(),
        first_step=clock.step,
        clock=clock,
        model=model,
        on_anomaly=on_anomaly,
        agree=agree,
        tables=V1Tables(ops, ndigits, mbs_grad),
        dump_folder=output.output_root() / DUMP_FOLDER,
    )
