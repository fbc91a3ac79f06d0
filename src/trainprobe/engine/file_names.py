"""File names made from user or data strings, and the check that a path stays in its folder.

Names of dump files come from strings trainprobe does not control: ``save(x, name)``, module
and class names, keyword-argument names, dictionary keys found in the data. :func:`safe_file_name`
turns any such string into one harmless file name, and :func:`path_under` joins a name to a
folder only when the result stays directly inside it. Whatever was recorded under the original
string (a JSON key, a CSV cell) keeps the original; only the file name is changed.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

MAX_NAME_BYTES = 255
"""The longest file name (UTF-8 bytes) most file systems accept (ext4, XFS, tmpfs, NTFS)."""

_DIGEST_CHARS = 12
_PLAIN = re.compile(r"[A-Za-z0-9_:+\-]+(?:\.[A-Za-z0-9_:+\-]+)*")
"""Names that are safe at a glance (the dump's usual ``Functional.relu.0.forward.input.0``)."""
_DIGEST_MARKER = re.compile(rf"~[0-9a-fA-F]{{{_DIGEST_CHARS}}}\Z")
"""How a cleaned name ends before its suffix; a name ending so is cleaned too (never kept as is)."""


def _unsafe_char(c: str) -> bool:
    return c in "/\\" or not c.isprintable() or "\ud800" <= c <= "\udfff"


def safe_file_name(name: str, suffix: str = "") -> str:
    """``name + suffix`` as a single, harmless file name.

    The result never holds a path separator (``/``, ``\\``), NUL or any other character that
    is not printable (control characters, line and paragraph separators, lone surrogates),
    never holds ``..``, is never empty, ``.`` or ``..``, and is at most :data:`MAX_NAME_BYTES`
    bytes in UTF-8. A name that already is all of that is returned unchanged (so
    ``Functional.relu.0.forward.input.0`` + ``.pt`` stays as it is); any other gets its unsafe
    characters replaced by ``_`` and ``~`` plus 12 hex digits of a SHA-256 of the original
    before ``suffix``. A name that itself ends like that (``~`` and 12 hex digits, the digest
    marker) also gets a digest of its own, so no name kept as it is can equal a cleaned one: two
    different names never end up as the same file (short of a 48-bit SHA-256 prefix collision).
    ``suffix`` (such as ``.pt``) is kept as given and must itself be safe.

    Raises:
        ValueError: ``suffix`` is not a safe file name ending.
    """
    if _unsafe_text(suffix) or len(suffix.encode("utf-8")) > MAX_NAME_BYTES // 2:
        raise ValueError(f"file name suffix {suffix!r} is not safe")
    full = name + suffix
    if not _DIGEST_MARKER.search(name):
        if len(full) <= MAX_NAME_BYTES and _PLAIN.fullmatch(full):
            return full
        if name and is_plain_file_name(full):
            return full
    cleaned = "".join("_" if _unsafe_char(c) else c for c in name)
    cleaned = re.sub(r"\.(?=\.)", "_", cleaned)  # every dot followed by a dot
    if suffix.startswith(".") and cleaned.endswith("."):
        cleaned = cleaned[:-1] + "_"
    digest = "~" + hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:_DIGEST_CHARS]
    budget = MAX_NAME_BYTES - len((digest + suffix).encode("utf-8"))
    stem = cleaned.encode("utf-8")[:budget].decode("utf-8", "ignore")
    return stem + digest + suffix


def _unsafe_text(text: str) -> bool:
    return ".." in text or any(_unsafe_char(c) for c in text)


def is_plain_file_name(name: str) -> bool:
    """Whether ``name`` is one harmless file name: not empty, ``.`` or ``..``, no ``..``, no
    path separator or unprintable character, at most :data:`MAX_NAME_BYTES` bytes in UTF-8
    (every result of :func:`safe_file_name` is one)."""
    return (
        bool(name)
        and name not in (".", "..")
        and not _unsafe_text(name)
        and len(name.encode("utf-8")) <= MAX_NAME_BYTES
    )


def path_under(folder: Path, name: str) -> Path:
    """``folder / name``, checked to be a file directly inside ``folder``.

    Raises:
        ValueError: ``name`` is not a single safe file name (see :func:`is_plain_file_name`), or the
            joined path would leave ``folder``.
    """
    if not is_plain_file_name(name):
        raise ValueError(f"refusing to write {name!r}: not a plain file name")
    path = folder / name
    base = os.path.abspath(folder)
    if os.path.dirname(os.path.abspath(path)) != base:
        raise ValueError(f"refusing to write {name!r}: outside {folder}")
    return path
