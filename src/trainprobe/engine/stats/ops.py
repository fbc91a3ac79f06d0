"""The statistics a monitor can compute ("ops"), defined once for every dialect.

| op    | meaning                                              | accumulated in                 |
|-------|------------------------------------------------------|--------------------------------|
| min   | smallest element                                     | the tensor's dtype (exact)     |
| max   | largest element                                      | the tensor's dtype (exact)     |
| mean  | arithmetic mean                                      | float64                        |
| norm  | L2 norm, sqrt(sum x^2)                               | float32, float64 near over/underflow |
| nans  | number of NaN elements (an exact count)              | int64                          |
| zeros | fraction of elements with abs(x) < eps (extension)   | int64 count / numel            |

Integer and boolean tensors are summarised as float64; complex tensors by their magnitude;
sums and norms of bfloat16/float16/float32 tensors never overflow or underflow: the mean is
accumulated in float64, and a norm whose float32 value is above 1e18 or below 1e-15 is
recomputed in float64 (on accelerators the norm is always accumulated in float64).
An empty tensor gives min = max = mean = nan, norm = 0, nans = 0, zeros = 0.
NaN propagates into min, max, mean and norm, as in PyTorch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.fields import join_path, type_name

ALL_OPS: tuple[str, ...] = ("min", "max", "mean", "norm", "nans", "zeros")
DEFAULT_OPS: tuple[str, ...] = ("min", "max", "mean", "norm", "nans")
COUNT_OPS: frozenset[str] = frozenset({"nans"})
DEFAULT_EPS = 1e-8
EMPTY_TENSOR_VALUES: dict[str, float] = {
    "min": math.nan,
    "max": math.nan,
    "mean": math.nan,
    "norm": 0.0,
    "nans": 0.0,
    "zeros": 0.0,
}
"""The statistics of an empty tensor (see the table above)."""


def parse_ops(
    value: Any, where: str, accepted: Sequence[str] = ALL_OPS, default: Sequence[str] = DEFAULT_OPS
) -> tuple[str, ...]:
    """Validate a user's ``ops`` list, keeping its order and dropping repeats.

    An absent or empty list means ``default``.

    Raises:
        ConfigError: not a list, or an entry that is not one of ``accepted``
            (``monitors.module.ops[1]: 'nrom' is not one of min, max, ...``).
    """
    if value is None:
        return tuple(default)
    if not isinstance(value, list):
        raise ConfigError(f"{where}: must be a list of op names ({', '.join(accepted)}), not {type_name(value)}")
    ops: list[str] = []
    for i, item in enumerate(value):
        if not isinstance(item, str) or item.strip().lower() not in accepted:
            raise ConfigError(f"{join_path(where, i)}: {item!r} is not one of {', '.join(accepted)}")
        name = item.strip().lower()
        if name not in ops:
            ops.append(name)
    return tuple(ops) if ops else tuple(default)


def format_value(op: str, value: float, ndigits: int | None = None) -> str:
    """One statistic as written to a CSV cell: counts as integers, others with full precision,
    or rounded to ``ndigits`` decimals when it is given."""
    if op in COUNT_OPS and value == value:  # not NaN
        return str(int(value))
    if ndigits is not None:
        return repr(round(float(value), ndigits))
    return repr(float(value))
