"""Monitor output as the offline tools see it: the layouts, data types and header roles, and the
checks of a selection's V1 timestamps and data types (standard library only; no file is read; the
files are found by :mod:`trainprobe.tools.runs.files` and selected by
:mod:`trainprobe.tools.runs.selection`).

Layouts recognised under ``monitor_path``:

* **Monitor V1**: ``<monitor_path>/<MonDD_HH-MM-SS>-rank<r>-<id>/<table>_<a>-<b>.csv`` with the
  header ``vpp_stage,name,step[,micro_step],<ops>[,shape,dtype]``. Both V1 writers are read: the
  reference tool's (names without a chunk prefix, ``fc1.input``; trailing ``shape,dtype`` text
  columns) and trainprobe's earlier one (``0:fc1.input``, no ``shape``/``dtype``).
  ``monitor_path`` may also be one such run folder. Run folders are selected by their timestamp
  (``time_start``/``time_end``, closed range, format ``Dec03_21-34-40``).
* **Monitor V2**: ``<output_dir>/rank_<r>/<monitor>_step<a>-<b>.csv`` with the header
  ``vpp_stage,step,module_name,scope[,micro_step],<ops>`` (``\\r\\n`` or ``\\n`` line ends). V2
  folders carry no timestamp, so a time range does not filter them (said once as a warning).

The *data type* of a file is its prefix: the V1 table (``actv``, ``grad_reduced``, ``other`` ...)
or the V2 monitor (``module``, ``weight_grad``, ``optimizer``, ``param``, ``cc``).

Columns: the layout's key columns and ``micro_step`` (integers within 64 bits; an empty
``micro_step`` cell is "none"), the text columns :data:`TEXT_COLUMNS` (kept as text, never
converted), and every other column is an op whose cells are numbers (``nan``/``inf`` kept; an
empty cell reads as NaN). A header naming a column twice is an error.

The query layer (:mod:`trainprobe.tools.query.layer`) reads these files (and their Parquet twins).

Example::

    roles = column_roles(("vpp_stage", "step", "module_name", "scope", "norm"), "v2", "example")
    assert roles.op_cols == (4,)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.layout import (
    MICRO_COLUMN,
    V1_KEY_COLUMNS,
    V1_TABLES,
    V2_KEY_COLUMNS,
    V2_MONITORS,
    parse_stamp,
)

Layout = Literal["v1", "v2"]
#: V1 tables only the reference tool writes (its MoE router features, forward hooks).
REFERENCE_V1_TABLES: tuple[str, ...] = ("moe_router_weight_hook", "moe_router_logit_hook")
V1_DATA_TYPES: tuple[str, ...] = V1_TABLES + tuple(t for t in REFERENCE_V1_TABLES if t not in V1_TABLES)
V2_DATA_TYPES: tuple[str, ...] = V2_MONITORS
DATA_TYPES: tuple[str, ...] = V1_DATA_TYPES + V2_DATA_TYPES
#: Columns that describe the tensor as text (the reference V1 writer's ``shape,dtype``).
TEXT_COLUMNS: tuple[str, ...] = ("shape", "dtype")
KEY_COLUMNS: dict[Layout, tuple[str, ...]] = {
    "v1": V1_KEY_COLUMNS,
    "v2": V2_KEY_COLUMNS,
}


def parse_time(text: str, field: str) -> datetime:
    """A V1 folder timestamp such as ``Dec03_21-34-40`` (``Feb29`` included: stamps carry no
    year and are read as dates of a leap year).

    Raises:
        ConfigError: naming ``field`` when the text does not have that form.
    """
    try:
        return parse_stamp(text)
    except (TypeError, ValueError):
        raise ConfigError(
            f"{field}: {text!r} is not a monitor timestamp; use the run folder's form, e.g. 'Dec03_21-34-40'"
        ) from None


def check_data_types(data_types: Sequence[str] | None, field: str = "data_type_list") -> tuple[str, ...] | None:
    """The selected data types, checked; None selects all.

    Raises:
        ConfigError: an unknown data type (the message lists the known ones).
    """
    if data_types is None:
        return None
    if isinstance(data_types, str) or not isinstance(data_types, Sequence):
        raise ConfigError(f"{field}: expected a list of data types such as ['grad_reduced'], got {data_types!r}")
    unknown = [t for t in data_types if t not in DATA_TYPES]
    if unknown:
        raise ConfigError(f"{field}: unknown data type(s) {unknown}; known: {', '.join(DATA_TYPES)}")
    return tuple(data_types)


@dataclass(frozen=True)
class ColumnRoles:
    """What each column of a header is: key columns, micro-step, ops (numbers) and text."""

    target_col: int
    step_col: int
    vpp_col: int
    scope_col: int
    micro_col: int
    op_cols: tuple[int, ...]


def column_roles(header: tuple[str, ...], layout: Layout, where: str) -> ColumnRoles:
    """The roles of the columns of ``header`` for ``layout``.

    Raises:
        ConfigError: a column named twice, without a name or with a control character in its
            name, or a key column missing.
    """
    seen: set[str] = set()
    for name in header:
        if name in seen:
            raise ConfigError(f"{where}: the header names column {name!r} twice; a monitor CSV names each once")
        seen.add(name)
    if "" in seen:
        raise ConfigError(f"{where}: the header has a column without a name (column {header.index('') + 1})")
    odd = next((name for name in header if not name.isprintable()), None)
    if odd is not None:
        raise ConfigError(f"{where}: the header's column {odd!r} holds a control character; not a monitor CSV")
    keys = KEY_COLUMNS[layout]
    missing = [k for k in keys if k not in seen]
    if missing:
        raise ConfigError(f"{where}: header {list(header)[:12]} lacks {missing}; is this a monitor CSV?")
    special = {*keys, MICRO_COLUMN, *TEXT_COLUMNS}
    return ColumnRoles(
        target_col=header.index("name" if layout == "v1" else "module_name"),
        step_col=header.index("step"),
        vpp_col=header.index("vpp_stage"),
        scope_col=header.index("scope") if layout == "v2" else -1,
        micro_col=header.index(MICRO_COLUMN) if MICRO_COLUMN in seen else -1,
        op_cols=tuple(i for i, name in enumerate(header) if name not in special),
    )
