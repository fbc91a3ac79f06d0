"""trainprobe's MindSpore backend (PyNative mode): Monitor V2 and Monitor V1 on ``nn.Cell``.

Monitor V2 needs no import from here: ``TrainerMonitorV2(config, fr="mindspore")`` (or
``"framework": "mindspore"`` in the file). Monitor V1::

    from trainprobe.mindspore import TrainerMon

Not imported by ``import trainprobe``. Importing it without a usable MindSpore raises one
ImportError saying what to install (``pip install trainprobe[mindspore]``). See
``docs/mindspore.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainprobe._lazy import lazy_exports
from trainprobe.backends.mindspore.runtime import require_mindspore

if TYPE_CHECKING:
    from trainprobe.frontdoors.monitor_v1.mindspore import TrainerMon

require_mindspore()

_EXPORTS = {"TrainerMon": "trainprobe.frontdoors.monitor_v1.mindspore"}
"""``TrainerMon`` is imported on first use: the backend (``trainprobe.backends.mindspore.backend``, which
Monitor V2 loads through :func:`trainprobe.backends.backend_for`) does not need Monitor V1."""
__all__ = ["TrainerMon", "require_mindspore"]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
