"""``trainprobe report``: one self-contained HTML page of a run (``report``): the rows read
(``read``, ``collect``, ``digest``, ``groups``, ``rows``, ``cells``), the numbers behind the page
(``data``, ``run``, ``loss``, ``onsets``, ``findings``, ``full``, ``events``, ``downsample``), its
figures (``figures``) and its HTML (``html``); the public data types in ``types``.

The names below are loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainprobe._lazy import lazy_exports

if TYPE_CHECKING:
    from trainprobe.tools.reporting.report import add_parser, write_report

_EXPORTS = {
    "add_parser": "trainprobe.tools.reporting.report",
    "write_report": "trainprobe.tools.reporting.report",
}
__all__ = ["add_parser", "write_report"]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
