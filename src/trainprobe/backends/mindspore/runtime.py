"""Finding a usable MindSpore, and the few runtime facts the adapter reads from it.

Importing :mod:`trainprobe.mindspore` calls :func:`require_mindspore`, which raises one
ImportError saying what to install when MindSpore is missing, or when it is known not to run
with the installed NumPy (MindSpore's wheels up to 2.10.0 are built against NumPy 1.x; with
NumPy 2 every operator fails). It runs no operator: that would initialise MindSpore's runtime
and fix the device before the training script has chosen it. :func:`check_runs_operators` runs
one tiny operator when monitoring starts, when the device is chosen.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from trainprobe.engine.errors import ConfigError

MINDSPORE_INSTALL_HINT = 'pip install "trainprobe[mindspore]"'

LAST_NUMPY1_RELEASE = (2, 10, 0)
"""The newest MindSpore release known to be built against NumPy 1.x (checked: 2.10.0)."""

_module: ModuleType | None = None
_runs_operators = False


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def require_mindspore() -> ModuleType:
    """The ``mindspore`` module, if it is installed and can work with the installed NumPy.

    Raises:
        ImportError: MindSpore is not installed (the message says ``pip install
            trainprobe[mindspore]``), or it is a release built against NumPy 1.x while NumPy 2
            is installed (the message says ``pip install "numpy<2"``).
    """
    global _module
    if _module is not None:
        return _module
    if importlib.util.find_spec("mindspore") is None:
        raise ImportError(f"trainprobe's MindSpore backend needs MindSpore (>= 2.4.10): {MINDSPORE_INSTALL_HINT}")
    import numpy

    ms = importlib.import_module("mindspore")
    version = str(getattr(ms, "__version__", "0"))
    if _version_tuple(numpy.__version__)[0] >= 2 and _version_tuple(version) <= LAST_NUMPY1_RELEASE:
        raise ImportError(
            f"MindSpore {version} is built against NumPy 1.x and cannot run operators with NumPy "
            f'{numpy.__version__}: pip install "numpy<2" (pip install "trainprobe[mindspore]" pins it)'
        )
    _module = ms
    return ms


def check_runs_operators(where: str) -> None:
    """Run one tiny operator (once per process) to prove MindSpore works here.

    Raises:
        ConfigError: naming ``where``, with the operator's error.
    """
    global _runs_operators
    if _runs_operators:
        return
    ms = require_mindspore()
    try:
        ok = float((ms.Tensor([1.0], ms.float32) + 1).asnumpy()[0]) == 2.0
    except Exception as exc:  # noqa: BLE001 - any failure means "unusable here"; reported below
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ConfigError(
            f"{where}: MindSpore {ms.__version__} cannot run an operator here ({type(exc).__name__}: {first})"
        ) from exc
    if not ok:
        raise ConfigError(f"{where}: MindSpore {ms.__version__} computes 1 + 1 != 2 here")
    _runs_operators = True


def pynative_mode() -> bool:
    """Whether MindSpore runs in PyNative (dynamic graph) mode, where hooks work."""
    ms = require_mindspore()
    return ms.get_context("mode") == ms.PYNATIVE_MODE


def device_target() -> str:
    """The device MindSpore computes on (``CPU``, ``GPU``, ``Ascend``)."""
    ms = require_mindspore()
    return str(ms.get_context("device_target"))


def grad_recording() -> bool:
    """Whether PyNative records operations for a gradient now (inside ``value_and_grad`` or a
    ``TrainOneStepCell``)."""
    from mindspore.common.api import _pynative_executor

    return bool(_pynative_executor.requires_grad())
