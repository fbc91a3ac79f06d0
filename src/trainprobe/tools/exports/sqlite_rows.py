"""csv2db's rows: one monitor file as columns (:class:`ParsedFile`), ready for the database, and
the Python reader kept for the files DuckDB does not take (a torn or empty file, a link, a
file DuckDB refuses: :func:`parse_file` says precisely what is wrong, or reads what DuckDB's
stricter reader would not).

Targets: a row's target is ``(name, vpp_stage, micro_step, scope, call_index)``;
``call_index`` numbers the rows of one key within one step of a file (:func:`call_indices`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain, compress, repeat

from trainprobe.engine.execution_order import row_positions as call_indices  # the one row numbering within a key
from trainprobe.tools.runs.files import RunFile
from trainprobe.tools.runs.rows import read_table

#: Ops whose metric_id is at least this have no nan_mask bit (SQLite integers are 64-bit).
NAN_BITS = 63

TargetKey = tuple[str, int, "int | None", "str | None", int]  # (name, vpp_stage, micro_step, scope, call_index)
BaseKey = tuple[str, int, "int | None", "str | None"]  # the same without the call index


@dataclass(frozen=True)
class ParsedFile:
    """One monitor file read into columns, ready for the database (by DuckDB,
    :mod:`trainprobe.tools.runs.read`, or by :func:`parse_file`).

    ``targets`` holds the file's distinct target keys (with the call index, see
    :func:`call_indices`) in first-seen order and ``target_index`` one index into it per row;
    ``steps`` one step per row; ``values`` one list per op (one float per row, NaN for an
    empty cell); ``nan_masks`` has bit ``i`` set where op ``i`` of the file is NaN, or is None when
    the file holds no NaN; ``span`` the smallest and largest step (None: not computed).
    """

    file: RunFile
    size: int
    mtime_ns: int
    ops: tuple[str, ...]
    targets: list[TargetKey]
    target_index: list[int]
    steps: list[int]
    values: list[list[float]]
    nan_masks: list[int] | None
    torn: int
    warnings: tuple[str, ...] = ()
    span: tuple[int, int] | None = None  # (smallest, largest) step when the reader knows it; None: not given


def parse_file(file: RunFile) -> ParsedFile:
    """Read ``file`` (complete rows only; an empty file gives no rows) into columns; see
    :class:`ParsedFile`.

    Raises:
        ConfigError: the header is not a monitor header.
    """
    stat = file.path.stat()
    table = read_table(file)
    rows = table.rows
    names = [row[table.target_col] for row in rows]
    scopes = [row[table.scope_col] or None for row in rows] if table.scope_col >= 0 else repeat(None)
    values = table.value_columns()
    steps = table.int_column(table.step_col)
    vpps, micros = table.int_column(table.vpp_col), table.micro_column()
    targets, index = number_targets(list(zip(names, vpps, micros, scopes)), steps)
    return ParsedFile(
        file=file,
        size=stat.st_size,
        mtime_ns=stat.st_mtime_ns,
        ops=table.ops,
        targets=targets,
        target_index=index,
        steps=steps,
        values=values,
        nan_masks=_nan_masks(values, len(rows)),
        torn=table.torn,
    )


def _repeats(steps: list[int], index: list[int], distinct: int) -> bool:
    """Whether some ``(step, index)`` pair occurs twice. Fast path (C-level list compares) for
    the usual file: blocks of ``distinct`` rows holding every target once in the same order, one
    step per block, no step in two blocks; anything else takes a set of the pairs."""
    count = len(index)
    if distinct and count % distinct == 0 and index == list(range(distinct)) * (count // distinct):
        firsts = steps[0::distinct]
        blocks = chain.from_iterable(map(repeat, firsts, repeat(distinct, len(firsts))))
        if len(set(firsts)) == len(firsts) and steps == list(blocks):
            return False
    return len(set(zip(steps, index))) < count


def number_targets(keys: Sequence[BaseKey], steps: list[int]) -> tuple[list[TargetKey], list[int]]:
    """The distinct targets of a file's rows (``keys``, one per row, with ``steps``) in first-seen
    order, with the call index (:func:`call_indices`) where a key repeats within a step, and one
    index into them per row."""
    targets, index = _first_seen([(*key, 0) for key in keys])
    if _repeats(steps, index, len(targets)):  # a key repeats within a step: number the calls
        calls = call_indices(list(zip(steps, index)))
        targets, index = _first_seen([(*key, call) for key, call in zip(keys, calls)])
    return targets, index


def _first_seen(keys: list[TargetKey]) -> tuple[list[TargetKey], list[int]]:
    targets = list(dict.fromkeys(keys))
    position = {key: i for i, key in enumerate(targets)}
    return targets, list(map(position.__getitem__, keys))


def _nan_masks(values: list[list[float]], count: int) -> list[int] | None:
    """Per row, bit ``i`` set where ``values[i]`` is NaN; None when there is no NaN."""
    masks: list[int] | None = None
    for bit, column in enumerate(values[:NAN_BITS]):
        total = sum(column)
        if total == total:  # no NaN (a NaN or inf - inf makes the sum NaN)
            continue
        flags = list(map(math.isnan, column))
        if not any(flags):
            continue
        if masks is None:
            masks = [0] * count
        for index in compress(range(count), flags):
            masks[index] |= 1 << bit
    return masks

