"""The rows of ``trainprobe report`` as arrays: one file's rows of one group (:class:`Block`),
one group's rows on one rank (:class:`Rows`, blocks joined), and the phase of a V1 table's rows."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainprobe.tools.anomalies.analyser import phase_of


@dataclass
class Block:
    """The rows of one file that belong to one group, as arrays (once digested and kept for the
    matrices, ``micro``, ``vpp``, ``line`` and ``pos`` are empty: :func:`~trainprobe.tools.reporting.collect._slim`)."""

    ops: tuple[str, ...]
    source: Path
    targets: np.ndarray  # ids into the group's target list
    steps: np.ndarray
    micro: np.ndarray
    vpp: np.ndarray
    line: np.ndarray
    pos: np.ndarray  # place among the rows of its step in its file (execution_order.row_positions)
    values: np.ndarray


@dataclass
class Rows:
    """Every row of one group on one rank (blocks joined; values in the group's op order)."""

    targets: np.ndarray  # ids into the group's target list
    steps: np.ndarray
    micro: np.ndarray
    vpp: np.ndarray
    line: np.ndarray
    pos: np.ndarray
    values: np.ndarray
    known: np.ndarray
    source: np.ndarray
    sources: list[Path]


def table_phase(table: str, target: str = "") -> tuple[str, bool]:
    """(phase, once per step) of a row of V1 ``table`` (the analyser's rule)."""
    return phase_of(f"{target}/rank0/{table}")


def join_blocks(parts: list[Block], ops: tuple[str, ...]) -> Rows:
    """One rank's blocks of a group as one set of arrays; values NaN (and not known) where a file
    lacks an op. One block with the group's ops (float64, as read) is not copied: its arrays are
    the rows' (read only)."""
    if len(parts) == 1 and parts[0].ops == ops and parts[0].values.dtype == np.float64:
        block = parts[0]
        return Rows(
            targets=block.targets,
            steps=block.steps,
            micro=block.micro,
            vpp=block.vpp,
            line=block.line,
            pos=block.pos,
            values=block.values,
            known=np.ones(block.values.shape, dtype=bool),
            source=np.zeros(len(block.steps), dtype=np.int64),
            sources=[block.source],
        )
    values = np.full((sum(len(b.steps) for b in parts), len(ops)), np.nan)
    known = np.zeros(values.shape, dtype=bool)
    start = 0
    for block in parts:
        end = start + len(block.steps)
        columns = [ops.index(op) for op in block.ops]
        values[start:end, columns] = block.values
        known[start:end, columns] = True
        start = end
    return Rows(
        targets=np.concatenate([b.targets for b in parts]),
        steps=np.concatenate([b.steps for b in parts]),
        micro=np.concatenate([b.micro for b in parts]),
        vpp=np.concatenate([b.vpp for b in parts]),
        line=np.concatenate([b.line for b in parts]),
        pos=np.concatenate([b.pos for b in parts]),
        values=values,
        known=known,
        source=np.concatenate([np.full(len(b.steps), n) for n, b in enumerate(parts)]),
        sources=[b.source for b in parts],
    )
