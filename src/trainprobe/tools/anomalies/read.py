"""Reading Monitor V1's anomaly files for ``anomaly-analyse``: every ``rank<r>/anomaly.json`` of an
``anomaly_detected`` folder, as checked events (:mod:`trainprobe.tools.anomalies.events`).

``data_path`` is the ``anomaly_detected`` folder, or the monitor output folder that contains it.
Files are read with :func:`trainprobe.engine.safe_json.load_json_file` (regular files only, size
and nesting bounded, byte-order mark accepted); a ``rank<r>/anomaly.json`` that is a link to a file
outside the folder is skipped unread, with one warning. Every bad input raises
:class:`~trainprobe.engine.errors.ConfigError` with a one-line message naming the folder, or the
file and the event.
"""

from __future__ import annotations

from pathlib import Path

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.layout import ANOMALY_FILE, ANOMALY_FOLDER, ANOMALY_RANK
from trainprobe.engine.log import warn_once
from trainprobe.engine.safe_files import bounded_int, is_inside
from trainprobe.engine.safe_json import load_json_file
from trainprobe.tools.anomalies.events import AnomalyEvent, make_event


def find_anomaly_files(data_path: str | Path) -> tuple[Path, list[Path]]:
    """The ``anomaly_detected`` folder and its ``rank<r>/anomaly.json`` files, in rank order.

    ``data_path`` is the ``anomaly_detected`` folder, or a folder that contains one.

    Raises:
        ConfigError: ``data_path`` does not exist, is not a folder, or holds no such file.
    """
    folder = Path(data_path).expanduser()
    if not folder.exists():
        raise ConfigError(f"data_path: {str(folder)!r} does not exist")
    if not folder.is_dir():
        raise ConfigError(f"data_path: {str(folder)!r} is not a folder")
    files = _rank_files(folder)
    if not files and (folder / ANOMALY_FOLDER).is_dir():
        folder = folder / ANOMALY_FOLDER
        files = _rank_files(folder)
    if not files:
        raise ConfigError(
            f"data_path: {str(folder)!r} holds no rank<r>/{ANOMALY_FILE} (expected the {ANOMALY_FOLDER} "
            "folder that Monitor V1 writes with alert.dump: true)"
        )
    return folder, files


def _rank_files(folder: Path) -> list[Path]:
    """The regular ``rank<r>/anomaly.json`` files directly under ``folder`` that stay inside it,
    in rank order (a link leading out is skipped with one warning)."""
    found: list[tuple[int, Path]] = []
    try:
        children = list(folder.iterdir())
    except OSError as exc:
        raise ConfigError(f"data_path: cannot list {str(folder)!r}: {exc.strerror or exc}") from None
    for child in children:
        match = ANOMALY_RANK.fullmatch(child.name)
        if match and (child / ANOMALY_FILE).is_file():  # regular files (or links to one) only
            if not is_inside(child / ANOMALY_FILE, folder):
                warn_once(
                    f"outside:{child / ANOMALY_FILE}",
                    f"{child / ANOMALY_FILE}: a link to a file outside {str(folder)!r}, skipped (not read)",
                )
                continue
            found.append((bounded_int(match.group(1), "rank", f"data_path: {str(child)!r}"), child / ANOMALY_FILE))
    return [path for _, path in sorted(found)]


def read_anomaly_file(path: Path, within: Path | None = None) -> list[AnomalyEvent]:
    """The events of one ``anomaly.json``, in file order; with ``within``, only a file inside
    that folder (a link leading elsewhere is refused unread).

    Raises:
        ConfigError: unreadable file, malformed JSON, not an object of events, or a bad event
            (see :func:`trainprobe.tools.anomalies.events.check_event`); the message starts with
            the file's path.
    """
    document = load_json_file(path, within=within)
    if not isinstance(document, dict):
        raise ConfigError(f"{path}: expected a JSON object of events, got {type(document).__name__}")
    return [make_event(key, value, path) for key, value in document.items()]


def load_anomalies(data_path: str | Path) -> tuple[Path, list[Path], list[AnomalyEvent]]:
    """The ``anomaly_detected`` folder, its files and every event they hold (rank order, then
    file order).

    Raises:
        ConfigError: see :func:`find_anomaly_files` and :func:`read_anomaly_file`; also the
            same key in two files.
    """
    folder, files = find_anomaly_files(data_path)
    events: list[AnomalyEvent] = []
    seen: dict[str, Path] = {}
    for path in files:
        for event in read_anomaly_file(path, within=folder):
            if event.key in seen:
                raise ConfigError(f"{path}: event {event.key!r}: the same key is also in {seen[event.key]}")
            seen[event.key] = path
            events.append(event)
    return folder, files, events
