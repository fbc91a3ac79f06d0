"""trainprobe's MindSpore backend (PyNative mode): Monitor V2 and Monitor V1 on ``nn.Cell``.

Monitor V2 needs no import from here: ``TrainerMonitorV2(config, fr="mindspore")`` (or
``"framework": "mindspore"`` in the file). Monitor V1::

    from trainprobe.mindspore import TrainerMon

Not imported by ``import trainprobe``. Importing it without a usable MindSpore raises one
ImportError saying what to install (``pip install trainprobe[mindspore]``). See
``docs/mindspore.md``.
"""

from __future__ import annotations

from trainprobe.mindspore.runtime import require_mindspore

require_mindspore()

from trainprobe.mindspore.monitor_v1 import TrainerMon  # noqa: E402 - after the check

__all__ = ["TrainerMon", "require_mindspore"]
