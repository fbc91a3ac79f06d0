"""``cc_distribution`` of Monitor V1: the engine's collective probe with the reference's
``cc_codeline``.

A ``cc_codeline`` entry is a regular expression (the spec's example is ``"train.py\\\\[23\\\\]"``)
searched in every frame of the collective's call stack, written ``<path>[<line>]``; an entry that
ends the call site at a path component (``"train.py[23]"``, not ``pretrain.py[23]``) matches as well. An empty list selects
every call. Rows, ``cc_pre_hook`` and ``cc_log_only`` are the engine's
(:mod:`trainprobe.engine.probes.collectives`).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from trainprobe.engine.probes.base import StepClock
from trainprobe.engine.probes.collectives import CcSpec, CollectiveProbe, codeline_matches
from trainprobe.frontdoors.monitor_v1.output import OUTPUT_ENV

if TYPE_CHECKING:
    from trainprobe.engine.backend import Backend

_MAX_FRAMES = 64


class V1CollectiveProbe(CollectiveProbe):
    """Collectives selected by the reference's ``cc_codeline`` patterns."""

    def __init__(self, clock: StepClock, spec: CcSpec, rank: int, log_path: Path, *, backend: Backend) -> None:
        super().__init__(clock, spec, rank, log_path, backend=backend, field=OUTPUT_ENV)
        self._patterns = [re.compile(line) for line in spec.cc_codeline]

    def _selected(self, full_site: str) -> bool:
        lines = self.spec.cc_codeline
        if not lines or any(codeline_matches(full_site, line) for line in lines):
            return True
        frame: FrameType | None = sys._getframe(1)
        for _ in range(_MAX_FRAMES):
            if frame is None:
                break
            site = f"{frame.f_code.co_filename}[{frame.f_lineno}]"
            if any(p.search(site) for p in self._patterns):
                return True
            frame = frame.f_back
        return False
