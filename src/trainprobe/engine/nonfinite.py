"""The one non-finite rule of trainprobe: which row of a monitor table is NaN/inf.

A row is non-finite when one of its ops is NaN or ±inf, or one of its count ops
(:data:`~trainprobe.engine.stats.ops.COUNT_OPS`: ``nans``, the number of NaN elements) is above 0. The op reported is the
first such op in the row's column order. The query layer writes the same rule as SQL
(:func:`trainprobe.tools.sql.questions.nonfinite_sql`) for ``trainprobe query --first-nonfinite``,
``diagnose``, ``diff`` and the report; the online rules of Monitor V2
(:mod:`trainprobe.engine.anomaly`) apply it to each step's rows as they are written.

Standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from trainprobe.engine.stats.ops import COUNT_OPS

__all__ = ["COUNT_OPS", "first_nonfinite_op"]


def first_nonfinite_op(ops: Sequence[str], values: Sequence[float]) -> int | None:
    """The index (into ``ops``) of the row's first non-finite op, or None for a finite row.

    >>> first_nonfinite_op(("min", "max", "nans"), (0.0, float("inf"), 0.0))
    1
    >>> first_nonfinite_op(("min", "nans"), (0.0, 3.0))
    1
    >>> first_nonfinite_op(("min", "nans"), (0.0, 0.0)) is None
    True
    """
    for index, (op, value) in enumerate(zip(ops, values)):
        if op in COUNT_OPS:
            if value > 0:  # NaN > 0 is False: a NaN count is caught below
                return index
            if math.isnan(value):
                return index
        elif not math.isfinite(value):
            return index
    return None
