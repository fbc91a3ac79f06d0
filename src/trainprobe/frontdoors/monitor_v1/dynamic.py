"""Dynamic mode (``DYNAMIC_MONITOR=True``): watching the config file between steps.

At the end of every step the front door asks :meth:`ConfigWatcher.poll` whether the file's
modification time changed. A changed, valid file is returned (monitoring restarts from the next
step with it, ``collect_times`` counted afresh); a changed but invalid file is reported once and
ignored, so the current configuration stays in force. When ``collect_times`` is reached,
:meth:`ConfigWatcher.switch_off` sets ``dynamic_on`` to false in the file, atomically (a temporary
file then ``os.replace``) and keeping every other key as the user wrote it, unless the user
edited the file since it was last read: then the edit wins and the next poll applies it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.fields import load_json_object
from trainprobe.engine.log import logger
from trainprobe.engine.sinks.files import write_atomically
from trainprobe.frontdoors.monitor_v1.config import MonitorV1Config, load_monitor_v1_config

DYNAMIC_ENV = "DYNAMIC_MONITOR"


def dynamic_mode() -> bool:
    """Whether ``$DYNAMIC_MONITOR`` is ``true`` (case-insensitive; anything else: static mode)."""
    return os.environ.get(DYNAMIC_ENV, "").strip().lower() == "true"


class ConfigWatcher:
    """Notices edits of ``path`` by its modification time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._mtime = self._stat()

    def _stat(self) -> int | None:
        try:
            return self.path.stat().st_mtime_ns
        except OSError:
            return None

    def poll(self) -> MonitorV1Config | None:
        """The new configuration if the file changed and is valid, else None."""
        mtime = self._stat()
        if mtime is None or mtime == self._mtime:
            return None
        self._mtime = mtime
        try:
            return load_monitor_v1_config(self.path)
        except ConfigError as exc:
            logger.error(
                "trainprobe: the edited %s is invalid, the current configuration stays in force: %s", self.path, exc
            )
            return None

    def edited(self) -> bool:
        """Whether the file changed since it was last read (an edit the next :meth:`poll` reports)."""
        return self._stat() != self._mtime

    def switch_off(self) -> bool:
        """Write ``"dynamic_on": false`` into the file (atomically, keeping the other keys) unless
        the file was edited since it was last read: that edit is newer than the end of collection,
        so it is left as the user wrote it and the next :meth:`poll` applies it. The file is
        checked again just before the temporary file replaces it.

        Returns:
            Whether the file was written.
        """
        if self.edited():
            return False
        try:
            data = load_json_object(self.path)
            data["dynamic_on"] = False
            if not write_atomically(self.path, json.dumps(data, indent=4), unless=self.edited):
                return False  # edited while we wrote: the user's file stays
        except (ConfigError, OSError) as exc:
            logger.error("trainprobe: could not set dynamic_on to false in %s: %s", self.path, exc)
            return False
        self._mtime = self._stat()  # our own write is no edit
        return True
