"""The package logger and once-only warnings."""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger("trainprobe")

_seen: set[str] = set()
_seen_lock = threading.Lock()


def _first_time(key: str) -> bool:
    with _seen_lock:
        if key in _seen:
            return False
        _seen.add(key)
        return True


def warn_once(key: str, message: str) -> None:
    """Log ``message`` as a warning the first time ``key`` is seen in this process."""
    if _first_time(key):
        logger.warning(message)


def error_once(key: str, message: str, *, traceback: bool = True) -> None:
    """Log ``message`` (with the active exception's traceback, if any, unless ``traceback`` is
    false) once per ``key``."""
    if _first_time(key):
        logger.error(message, exc_info=traceback)
