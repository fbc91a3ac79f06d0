"""Compatibility import path of the reference tool (``msprobe.pytorch``): re-exports, plus
:func:`save`, the spec's module-level name for ``PrecisionDebugger.save``."""

from typing import Any

from trainprobe.dump import PrecisionDebugger, module_dump, module_dump_end, random_save, seed_all


def save(variable: Any, name: str, save_backward: bool = True) -> None:
    """``PrecisionDebugger.save`` on the debugger created last: record ``variable`` as
    ``{name}.{n}.debug`` (and its gradient, with ``save_backward``); level ``debug`` only."""
    PrecisionDebugger.save(variable, name, save_backward)


__all__ = ["PrecisionDebugger", "module_dump", "module_dump_end", "random_save", "save", "seed_all"]
