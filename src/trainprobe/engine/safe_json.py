"""Loading JSON input safely: the one JSON reader of trainprobe's offline tools.

:func:`load_json_file` reads a regular file through :func:`trainprobe.engine.safe_files.read_text`
(size bound, no FIFO or device, byte-order mark dropped, UTF-8 checked) and parses it with a
nesting bound, so a hostile file (a 100,000-deep ``[[[[...``, a ``NaN`` where a number belongs)
is one :class:`~trainprobe.engine.errors.ConfigError` naming the file, never a ``RecursionError`` or a
traceback.

Rules:

* nesting deeper than ``max_depth`` (default :data:`MAX_DEPTH`) is refused; the check walks the
  parsed value without recursion, and a document too deep for the parser itself is refused too;
* the constants ``NaN``, ``Infinity`` and ``-Infinity`` (not JSON) are refused;
* a key repeated in one object is refused (Python's ``json`` would silently keep the last);
* a lone surrogate escape (``"\\ud800"``), which decodes to a string that cannot be printed or
  written as UTF-8, is refused.

Example::

    from trainprobe.engine.safe_json import load_json_file
    document = load_json_file("anomaly_detected/rank0/anomaly.json")
"""

from __future__ import annotations

import json
import os
from typing import Any

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.safe_files import read_text

#: Deepest nesting of arrays and objects accepted.
MAX_DEPTH = 64
#: Largest JSON file read (bytes).
MAX_JSON_BYTES = 1 << 30


def loads_checked(text: str, where: str, *, max_depth: int = MAX_DEPTH) -> Any:
    """``text`` parsed as JSON, checked as described in the module docstring.

    Raises:
        ConfigError: ``<where>: not valid JSON (...)``, ``<where>: nested deeper than 64 levels``,
            ``<where>: NaN is not JSON``, ``<where>: key 'x' appears twice in one object``.
    """
    try:
        document = json.loads(text, parse_constant=_refuse_constant, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not valid JSON ({exc})") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested deeper than {max_depth} levels; refused") from None
    except _Refused as exc:
        raise ConfigError(f"{where}: {exc}") from None
    except ValueError as exc:  # an integer of more than 4300 digits
        raise ConfigError(f"{where}: not valid JSON ({str(exc)[:80]})") from None
    if depth_of(document, limit=max_depth) > max_depth:
        raise ConfigError(f"{where}: nested deeper than {max_depth} levels; refused")
    try:  # a lone surrogate escape ("\ud800") decodes to a str that cannot be printed or written
        json.dumps(document, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(
            f"{where}: holds a lone surrogate escape such as \\ud800, which is not text; refused"
        ) from None
    return document


def load_json_file(
    path: str | os.PathLike[str],
    *,
    max_bytes: int = MAX_JSON_BYTES,
    max_depth: int = MAX_DEPTH,
    within: str | os.PathLike[str] | None = None,
) -> Any:
    """The JSON document in the regular file ``path`` (see the module docstring); with
    ``within``, only a file inside that folder (see :func:`~trainprobe.engine.safe_files.read_bytes`).

    Raises:
        ConfigError: the message starts with the path.
    """
    return loads_checked(read_text(path, max_bytes=max_bytes, within=within), str(path), max_depth=max_depth)


def depth_of(value: Any, *, limit: int) -> int:
    """How deep arrays and objects nest in ``value`` (a scalar: 0, ``[]``: 1), counted without
    recursion; stops counting once past ``limit`` (returns ``limit + 1``)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return limit + 1
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


class _Refused(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    raise _Refused(f"{name} is not JSON (write a number or null)")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Refused(f"key {key!r} appears twice in one object")
        out[key] = value
    return out
