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
from trainprobe.mindspore.runtime import require_mindspore

if TYPE_CHECKING:
    from trainprobe.mindspore.monitor_v1 import TrainerMon

require_mindspore()

_EXPORTS = {"TrainerMon": "trainprobe.mindspore.monitor_v1"}
"""``TrainerMon`` is imported on first use: the backend (``trainprobe.mindspore.backend``, which
Monitor V2 loads through :func:`trainprobe.adapters.backend_for`) does not need Monitor V1."""
__all__ = ["TrainerMon", "require_mindspore"]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
