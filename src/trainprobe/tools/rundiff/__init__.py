"""``trainprobe diff``: where two runs part (``answer``), its command line (``cli``), how rows of the
two runs are matched (``match``) and the ``--html`` page (``html``).

The names below are loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainprobe._lazy import lazy_exports

if TYPE_CHECKING:
    from trainprobe.tools.rundiff.answer import DiffResult, diff
    from trainprobe.tools.rundiff.cli import add_parser

_EXPORTS = {
    "DiffResult": "trainprobe.tools.rundiff.answer",
    "add_parser": "trainprobe.tools.rundiff.cli",
    "diff": "trainprobe.tools.rundiff.answer",
}
__all__ = ["DiffResult", "add_parser", "diff"]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
