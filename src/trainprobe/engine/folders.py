"""Output folders: create one, or say in a :class:`ConfigError` which field names the unusable path.

Every front door creates its output folder through :func:`make_output_folder`, so a folder under
a file, an unwritable parent, a name too long or a NUL byte is reported the same way, at
construction or ``start()``, before any hook is attached.
"""

from __future__ import annotations

import os
from pathlib import Path

from trainprobe.engine.errors import ConfigError


def make_output_folder(path: str | Path, field: str) -> Path:
    """``path`` created (parents included) and writable, as a :class:`Path`.

    Args:
        path: the folder to create or reuse.
        field: the config field or environment variable that named it, for the message.

    Raises:
        ConfigError: the folder cannot be created or is not writable; the message names ``field``.
    """
    text = str(path)
    if "\0" in text:
        raise ConfigError(f"{field}: {text!r} contains a NUL byte; pass a folder path")
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{field}: cannot create the output folder {text!r}: {exc.strerror or exc}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"{field}: the output folder {text!r} is not writable; choose another folder")
    return folder
