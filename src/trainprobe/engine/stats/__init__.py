"""Statistics: what each op means (``ops``) and how tensors become numbers (``torch_stats``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainprobe._lazy import lazy_exports

if TYPE_CHECKING:
    from trainprobe.engine.stats.ops import ALL_OPS, DEFAULT_EPS, DEFAULT_OPS, parse_ops

_EXPORTS = {
    "ALL_OPS": "trainprobe.engine.stats.ops",
    "DEFAULT_EPS": "trainprobe.engine.stats.ops",
    "DEFAULT_OPS": "trainprobe.engine.stats.ops",
    "parse_ops": "trainprobe.engine.stats.ops",
}
__all__ = ["ALL_OPS", "DEFAULT_EPS", "DEFAULT_OPS", "parse_ops"]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
