"""The events the online rules of Monitor V2 and Monitor V1 wrote during a run, as
``trainprobe diagnose`` shows them beside its answer.

Each rank folder's event file (:mod:`trainprobe.engine.anomaly.events`): V2's
``rank_<r>/anomaly_events.jsonl``, V1's ``<MonDD_HH-MM-SS>-rank<r>-<id>/anomaly_events.jsonl``
(the run folder itself when ``diagnose`` is given one), is read with
:func:`~trainprobe.engine.anomaly.events.read_events`; the answer has one line::

    online: 1 event(s) during the run; the run was stopped at step 7 (rank 0: weight_grad/reduced fc1.weight: ...)

and ``diagnosis.json`` the events themselves. A run monitored without an ``anomaly`` block has
no event file and no line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainprobe.engine.anomaly.events import EVENT_FILE, read_events
from trainprobe.engine.layout import V1_RUN
from trainprobe.engine.printable import printable

_RANK_FOLDER = re.compile(r"rank_?(\d+)$")
_WHERE = re.compile(r"^step \d+(?: micro_step \d+)?, (?:rank \d+|full tensor), ")


@dataclass(frozen=True, slots=True)
class OnlineEvents:
    """The online events of a run.

    Attributes:
        files: how many rank folders hold an event file (0: the run had no online rules).
        events: every event, by step, then rank, then as written (the event files' objects).
    """

    files: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)

    def line(self) -> str | None:
        """The answer's line (None without an event file): how many events, and where the run
        was stopped (the first event whose actions include ``stop``), else the first event."""
        if not self.files:
            return None
        if not self.events:
            return "online: no event during the run"
        text = f"online: {len(self.events)} event(s) during the run"
        stops = [e for e in self.events if "stop" in (e.get("actions") or [])]
        if stops:
            first = stops[0]
            return text + f"; the run was stopped at step {first['step']} (rank {first.get('rank')}: {_what(first)})"
        return text + f"; the first: {printable(str(self.events[0].get('line', '?')))}"


def _what(event: dict[str, Any]) -> str:
    """The event's line without its step and rank (``weight_grad/reduced fc1.weight: ...``)."""
    line = printable(str(event.get("line", "?")))
    return _WHERE.sub("", line, count=1)


def online_events(root: Path) -> OnlineEvents:
    """The online events under ``root``'s rank folders (V2 ``rank_<r>/``, V1
    ``<stamp>-rank<r>-<id>/``, or ``root`` itself when it is a V1 run folder)."""
    files = sorted(
        (folder for folder in _rank_folders(root) if folder.is_dir() and (folder / EVENT_FILE).is_file()),
        key=_rank_of,
    )
    events = [event for folder in files for event in read_events(folder)]
    events.sort(key=lambda e: (e["step"], e.get("rank") if isinstance(e.get("rank"), int) else -1))
    return OnlineEvents(len(files), events)


def _rank_folders(root: Path) -> list[Path]:
    """The folders of ``root`` that may hold one rank's event file."""
    folders = list(root.glob("rank*"))
    if root.is_dir():
        folders += [f for f in root.iterdir() if V1_RUN.fullmatch(f.name)]
    if V1_RUN.fullmatch(root.name):
        folders.append(root)
    return folders


def _rank_of(folder: Path) -> tuple[int, str]:
    """A rank folder's rank (-1 when its name gives none), then its name."""
    v1 = V1_RUN.fullmatch(folder.name)
    if v1:
        return int(v1["rank"]), folder.name
    found = _RANK_FOLDER.search(folder.name)
    return (int(found.group(1)) if found else -1), folder.name
