"""Dynamic mode (``DYNAMIC_MONITOR=True``): watching the config file between steps.

At the end of every step the front door asks :meth:`ConfigWatcher.poll` whether the file's
modification time changed. A changed, valid file is returned (monitoring restarts from the next
step with it, ``collect_times`` counted afresh); a changed but invalid file is reported once and
ignored, so the current configuration stays in force. When ``collect_times`` is reached,
:meth:`ConfigWatcher.switch_off` sets ``dynamic_on`` to false in the file, atomically (a temporary
file then ``os.replace``) and keeping every other key as the user wrote it.
"""

from __future__ import annotations

import os
from pathlib import Path

from trainprobe.config.fields import load_json_object
from trainprobe.config.monitor_v1 import MonitorV1Config, load_monitor_v1_config
from trainprobe.errors import ConfigError
from trainprobe.log import logger
from trainprobe.sinks.files import write_json_atomically

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

    def switch_off(self) -> None:
        """Write ``"dynamic_on": false`` into the file, keeping the other keys."""
        try:
            data = load_json_object(self.path)
            data["dynamic_on"] = False
            write_json_atomically(self.path, data, indent=4)
        except (ConfigError, OSError) as exc:
            logger.error("trainprobe: could not set dynamic_on to false in %s: %s", self.path, exc)
        self._mtime = self._stat()
