"""The package logger, its default handler, and once-only warnings.

trainprobe's messages go to the ``trainprobe`` logger (``trainprobe.frontdoors.metrics`` for the training
metrics' ``log`` output). They are shown without any set-up, the way Lightning and Hugging Face
show theirs, and defer to the user's logging configuration as soon as there is one:

* **No logging configured** (the root logger has no handler): INFO and above print to stderr as
  ``<LEVEL> <message>`` through trainprobe's own handler. Per-step lines are never INFO, except the
  metrics ``log`` output the user asked for.
* **Logging configured** (``logging.basicConfig(...)``, a framework's set-up, pytest): the default
  handler stays silent and records propagate to the user's handlers, filtered by the root logger's
  level (INFO lines appear only if the root level lets them through).
* **Set explicitly**: ``logging.getLogger("trainprobe").setLevel(...)`` or the environment variable
  ``TRAINPROBE_LOG_LEVEL`` (``DEBUG``, ``INFO``, ``WARNING``, ``ERROR``) wins over both rules.

Example::

    TRAINPROBE_LOG_LEVEL=WARNING torchrun train.py   # only warnings and errors from trainprobe
"""

from __future__ import annotations

import logging
import os
import sys
import threading

LEVEL_ENV = "TRAINPROBE_LOG_LEVEL"

logger = logging.getLogger("trainprobe")

_seen: set[str] = set()
_seen_lock = threading.Lock()


def _root_configured() -> bool:
    """True once the user (or a framework) has given the root logger a handler."""
    return bool(logging.getLogger().handlers)


class _DefaultHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """stderr output used only while nobody has configured logging."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(levelname)s %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if _root_configured():
            return
        self.stream = sys.stderr  # follow redirections made after import (tests, notebooks)
        super().emit(record)


class _RootLevelWhenConfigured(logging.Filter):
    """Below WARNING, honour the root logger's level once logging is configured, unless the
    ``trainprobe`` level was set by the user (the default level is INFO, set by trainprobe)."""

    def __init__(self, default_level: int) -> None:
        super().__init__()
        self._default_level = default_level

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING or logger.level != self._default_level:
            return True
        return not _root_configured() or record.levelno >= logging.getLogger().getEffectiveLevel()


def _install_default_handler() -> None:
    """Give the ``trainprobe`` logger its default level, handler and filter (once)."""
    if any(isinstance(h, _DefaultHandler) for h in logger.handlers):
        return
    logger.addHandler(_DefaultHandler())
    requested = os.environ.get(LEVEL_ENV, "").strip().upper()
    if requested:
        level = logging.getLevelName(requested)
        if isinstance(level, int):
            logger.setLevel(level)
        else:
            logger.setLevel(logging.INFO)
            logger.warning("%s=%r is not a logging level; using INFO", LEVEL_ENV, requested)
    elif logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
        logger.addFilter(_RootLevelWhenConfigured(logging.INFO))


_install_default_handler()


def _first_time(key: str) -> bool:
    with _seen_lock:
        if key in _seen:
            return False
        _seen.add(key)
        return True


def info_once(key: str, message: str) -> None:
    """Log ``message`` at INFO the first time ``key`` is seen (where output goes, not per step)."""
    if _first_time(key):
        logger.info(message)


def warn_once(key: str, message: str) -> None:
    """Log ``message`` as a warning the first time ``key`` is seen in this process."""
    if _first_time(key):
        logger.warning(message)


def error_once(key: str, message: str, *, traceback: bool = True) -> None:
    """Log ``message`` (with the active exception's traceback, if any, unless ``traceback`` is
    false) once per ``key``."""
    if _first_time(key):
        logger.error(message, exc_info=traceback)
