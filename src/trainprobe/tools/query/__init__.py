"""The query layer (public API): one set of views over every run, on DuckDB (``layer``), the
``trainprobe query`` and ``trainprobe convert`` command lines (``cli``) and the CSV-to-Parquet
conversion (``convert``)::

    from trainprobe.tools.query import connect
    con = connect("./monitor_output")

The names below are loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainprobe._lazy import lazy_exports

if TYPE_CHECKING:
    from trainprobe.tools.query.layer import (
        connect,
        describe,
        first_nonfinite,
        require,
        short_error,
        summaries,
        table_sql,
    )

_EXPORTS = {
    "connect": "trainprobe.tools.query.layer",
    "describe": "trainprobe.tools.query.layer",
    "first_nonfinite": "trainprobe.tools.query.layer",
    "require": "trainprobe.tools.query.layer",
    "short_error": "trainprobe.tools.query.layer",
    "summaries": "trainprobe.tools.query.layer",
    "table_sql": "trainprobe.tools.query.layer",
}
__all__ = ["connect", "describe", "first_nonfinite", "require", "short_error", "summaries", "table_sql"]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
