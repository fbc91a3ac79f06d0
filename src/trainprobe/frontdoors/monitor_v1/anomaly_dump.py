"""``anomaly_detected/rank<r>/anomaly.json``: every anomaly of the run, one JSON object.

The file is valid JSON after every write, and a write costs only the new entries: the first
write creates it (replacing a file of an earlier run), later ones overwrite its closing brace
with the new entries and a new closing brace. Entries are written in the reference's layout
(4-space indentation).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainprobe.engine.folders import make_output_folder
from trainprobe.frontdoors.monitor_v1.output import OUTPUT_ENV

_CLOSE = b"\n}\n"


class AnomalyFile:
    """Appends anomaly entries to ``path``.

    Args:
        path: the JSON file (its folder is created on the first write, by
            :func:`~trainprobe.engine.folders.make_output_folder`).
        field: what named the folder, for the ConfigError of a folder that cannot be created.
    """

    def __init__(self, path: Path, field: str = OUTPUT_ENV) -> None:
        self.path = path
        self.field = field
        self._end: int | None = None  # offset of the closing brace, None before the first write

    def append(self, entries: Mapping[str, Mapping[str, Any]]) -> None:
        """Add ``entries`` (key → entry) to the file."""
        if not entries:
            return
        body = ",\n".join(f"    {json.dumps(key)}: {_indented(entry)}" for key, entry in entries.items())
        if self._end is None:
            make_output_folder(self.path.parent, self.field)
            head = b"{\n" + body.encode("utf-8")
            self.path.write_bytes(head + _CLOSE)
            self._end = len(head)
            return
        chunk = b",\n" + body.encode("utf-8")
        with self.path.open("r+b") as fh:
            fh.seek(self._end)
            fh.write(chunk + _CLOSE)
            fh.truncate()
        self._end += len(chunk)


def _indented(entry: Mapping[str, Any]) -> str:
    """``entry`` as 4-space indented JSON nested one level deep."""
    return json.dumps(entry, indent=4).replace("\n", "\n    ")
