"""Exports of a run to other tools: SQLite (``trainprobe csv2db``: ``sqlite``, its rows
``sqlite_rows`` and database ``sqlite_schema``) and TensorBoard (``trainprobe csv2tb``:
``tensorboard``).

The names below are loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainprobe._lazy import lazy_exports

if TYPE_CHECKING:
    from trainprobe.tools.exports.sqlite import CSV2DBConfig, csv2db
    from trainprobe.tools.exports.tensorboard import csv2tensorboard_by_step

_EXPORTS = {
    "CSV2DBConfig": "trainprobe.tools.exports.sqlite",
    "csv2db": "trainprobe.tools.exports.sqlite",
    "csv2tensorboard_by_step": "trainprobe.tools.exports.tensorboard",
}
__all__ = ["CSV2DBConfig", "csv2db", "csv2tensorboard_by_step"]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
