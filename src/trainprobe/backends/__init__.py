"""The framework backends, each an implementation of :class:`trainprobe.engine.backend.Backend`.

* :mod:`trainprobe.backends.torch`: PyTorch (the default);
* :mod:`trainprobe.backends.mindspore`: MindSpore (PyNative).

A backend registers itself with one line of :data:`BACKENDS` (framework name → the module and the
name of its ``Backend`` object); :func:`backend_for` imports only the framework asked for. The
engine names no backend. (Other modules import a framework too: the front doors' framework
parts, the dump, the integrations; see docs/architecture.md.)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from trainprobe.engine.errors import ConfigError

if TYPE_CHECKING:
    from trainprobe.engine.backend import Backend

__all__ = ["BACKENDS", "backend_for"]

BACKENDS: dict[str, tuple[str, str]] = {
    "pytorch": ("trainprobe.backends.torch.backend", "TORCH"),
    "mindspore": ("trainprobe.backends.mindspore.backend", "MINDSPORE"),
}
"""Framework name (as configs spell it after normalisation) → (module, ``Backend`` object)."""


def backend_for(framework: str, where: str = "framework") -> Backend:
    """The backend of ``framework`` (a key of :data:`BACKENDS`), imported on first use.

    Raises:
        ConfigError: naming ``where``, when the framework is unknown, not installed, or
            installed but unusable.
    """
    entry = BACKENDS.get(framework)
    if entry is None:
        raise ConfigError(f"{where}: {framework!r} is not one of {', '.join(BACKENDS)}")
    module, name = entry
    try:
        backend: Backend = getattr(importlib.import_module(module), name)
    except ImportError as exc:
        if framework == "pytorch":  # torch is a dependency of trainprobe: a broken install is not a config error
            raise
        raise ConfigError(f"{where}: {framework!r} cannot be used: {exc}") from exc
    return backend
