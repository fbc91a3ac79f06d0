"""Values → the JSON entries of ``dump.json``.

A tensor becomes ``{"type": "torch.Tensor", "dtype", "shape", "Max", "Min", "Mean", "Norm",
"requires_grad"}`` plus ``"md5"`` (summary_mode md5: CRC-32 of the bytes, 8 hex digits; xor: XOR
of the bytes as 64-bit words, 16 hex digits) and ``"data_name"`` when its ``.pt`` file is saved
(the record name made a safe file name by :func:`~trainprobe.engine.file_names.safe_file_name`).
Task ``structure`` keeps type, dtype, shape and requires_grad only. A meta tensor
(``device="meta"``) holds no data: its entry has its dtype, shape and requires_grad, ``null``
statistics, no checksum and no ``.pt`` file (no ``data_name``), and the dump goes on. Other values:
``{"type": "int", "value": 3}``, ``torch.dtype``/``torch.Size``/``slice`` likewise, ``None`` →
``null``, lists/tuples → lists, dicts → objects, anything else ``{"type": <class name>}``.

On accelerators the four statistics stay on the device until :func:`resolve_pending` reads all
of them back at once (one device-to-host copy per device) when the JSON files are written; until
then the entry holds ``null`` in their places and the device row under ``"_stats"``.
"""

from __future__ import annotations

import math
import threading
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trainprobe.backends.torch.numpy_view import numpy_view
from trainprobe.backends.torch.stats import TensorStats
from trainprobe.engine.file_names import safe_file_name
from trainprobe.engine.tensor_walk import named_tensors_in

STAT_KEYS = ("Max", "Min", "Mean", "Norm")
_STATS = TensorStats(("max", "min", "mean", "norm"))
_STATS_KEY = "_stats"


@dataclass(frozen=True, slots=True)
class EntryOptions:
    """How tensors are described: ``statistics`` (bool), ``summary_mode``, and ``save`` (a
    callable taking ``(file_name, tensor, entry)`` for a tensor whose entry names ``file_name``
    in ``data_name``; it may remove that key when the file cannot be written; None when no
    ``.pt`` files are written)."""

    statistics: bool
    summary_mode: str = "statistics"
    save: Callable[[str, torch.Tensor, dict[str, Any]], None] | None = None


def statistics_row(t: torch.Tensor) -> Any:
    """Max/Min/Mean/Norm of ``t`` as it is now (None: a meta tensor, no values). Never reused
    from an earlier record: a write through ``.data`` (``GradScaler.unscale_``, a weight clamp,
    an in-place collective) changes a tensor without moving autograd's version counter, so no
    cheap test tells an unchanged tensor from a changed one."""
    return _STATS.row(t)


def checksum(t: torch.Tensor, mode: str) -> str:
    """CRC-32 (``md5``) or 64-bit XOR (``xor``) of the tensor's bytes, as hex."""
    x = t.detach()
    if x.device.type != "cpu":
        x = x.cpu()
    raw = numpy_view(x.contiguous().reshape(-1).view(torch.uint8))
    if mode == "xor":
        pad = (-raw.size) % 8
        words = np.concatenate([raw, np.zeros(pad, np.uint8)]).view(np.uint64) if pad else raw.view(np.uint64)
        return f"{int(np.bitwise_xor.reduce(words)) if words.size else 0:016x}"
    return f"{zlib.crc32(raw.data) & 0xFFFFFFFF:08x}"


def tensor_entry(t: torch.Tensor, data_name: str | None, opts: EntryOptions) -> dict[str, Any]:
    """The entry of one tensor (see the module docstring)."""
    if not opts.statistics:
        entry: dict[str, Any] = {"type": "torch.Tensor", "dtype": str(t.dtype), "shape": list(t.shape)}
        entry["requires_grad"] = t.requires_grad
    elif (row := statistics_row(t)) is None:  # no values (a meta tensor): null statistics, no checksum
        entry = {"type": "torch.Tensor", "dtype": str(t.dtype), "shape": list(t.shape)}
        entry.update(dict.fromkeys(STAT_KEYS))
        entry["requires_grad"] = t.requires_grad
    else:
        entry = _entry_with_statistics(t, row)
        if opts.summary_mode != "statistics":
            entry["md5"] = checksum(t, opts.summary_mode)
    if data_name is not None and opts.save is not None and not t.is_meta:
        name = safe_file_name(data_name, ".pt")
        entry["data_name"] = name
        opts.save(name, t, entry)
    return entry


def _entry_with_statistics(t: torch.Tensor, row: Any) -> dict[str, Any]:
    if isinstance(row, list):
        mx, mn, mean, norm = row
        total = mx + mn + mean + norm
        if total - total != 0.0:  # inf or NaN somewhere (or a finite sum that overflowed)
            mx, mn, mean, norm = (_json_float(v) for v in row)
        return {"type": "torch.Tensor", "dtype": str(t.dtype), "shape": list(t.shape), "Max": mx, "Min": mn,
                "Mean": mean, "Norm": norm, "requires_grad": t.requires_grad}  # fmt: skip
    entry = {"type": "torch.Tensor", "dtype": str(t.dtype), "shape": list(t.shape), "Max": None, "Min": None,
             "Mean": None, "Norm": None, "requires_grad": t.requires_grad, _STATS_KEY: row}  # fmt: skip
    with _PENDING_LOCK:
        _PENDING.append((entry, row))
    return entry


_PENDING: list[tuple[dict[str, Any], torch.Tensor]] = []
_PENDING_LOCK = threading.Lock()


def resolve_pending() -> None:
    """Fill in every entry whose statistics are still on a device: the rows are stacked and
    copied to the host once per device (one synchronisation instead of one per tensor)."""
    with _PENDING_LOCK:
        items = list(_PENDING)
        _PENDING.clear()
    if not items:
        return
    unique: dict[int, torch.Tensor] = {}
    for _, row in items:
        unique.setdefault(id(row), row)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for row in unique.values():
        by_device.setdefault(row.device, []).append(row)
    values: dict[int, list[float]] = {}
    for rows in by_device.values():
        for row, host in zip(rows, torch.stack(rows).cpu().tolist()):
            values[id(row)] = host
    for entry, row in items:
        if entry.get(_STATS_KEY) is row:
            del entry[_STATS_KEY]
            entry.update(zip(STAT_KEYS, (_json_float(v) for v in values[id(row)])))


def _json_float(v: float) -> float | str | None:
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


def value_entry(value: Any, data_name: str | None, opts: EntryOptions) -> Any:
    """The entry of any value; nested lists/dicts get ``.i`` / ``.key`` name suffixes."""
    if isinstance(value, torch.Tensor):
        return tensor_entry(value, data_name, opts)
    if value is None:
        return None
    if isinstance(value, bool):
        return {"type": "bool", "value": value}
    if isinstance(value, (int, float)):
        return {"type": type(value).__name__, "value": _json_float(value) if isinstance(value, float) else value}
    if isinstance(value, str):
        return {"type": "str", "value": value}
    if isinstance(value, torch.dtype):
        return {"type": "torch.dtype", "value": str(value)}
    if isinstance(value, torch.Size):
        return {"type": "torch.Size", "value": list(value)}
    if isinstance(value, torch.device):
        return {"type": "torch.device", "value": str(value)}
    if isinstance(value, slice):
        return {"type": "slice", "value": [_plain(value.start), _plain(value.stop), _plain(value.step)]}
    if isinstance(value, (list, tuple)):
        return [value_entry(v, _sub(data_name, i), opts) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {str(k): value_entry(v, _sub(data_name, k), opts) for k, v in value.items()}
    return {"type": type(value).__name__}


def _plain(v: Any) -> Any:
    return v if v is None or isinstance(v, (int, float, str)) else str(v)


def _sub(name: str | None, key: Any) -> str | None:
    return None if name is None else f"{name}.{key}"


def as_list(value: Any) -> list[Any]:
    """An output as the list dump.json holds (a tuple/list as is, anything else wrapped)."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def tensors_in(value: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` for every tensor nested in ``value`` (paths like ``0.1``, ``key``): the
    engine's walk (:func:`trainprobe.engine.tensor_walk.named_tensors_in`) over torch tensors."""
    return named_tensors_in(value, torch.Tensor, prefix)


def has_overflow(entry: Any) -> bool:
    """Whether any tensor described in ``entry`` holds inf or NaN (from its statistics)."""
    if isinstance(entry, dict):
        if entry.get("type") == "torch.Tensor":
            row = entry.get(_STATS_KEY)
            if row is not None:
                return not bool(torch.isfinite(row).all())
            return any(isinstance(entry.get(k), str) for k in ("Max", "Min", "Norm"))
        return any(has_overflow(v) for v in entry.values())
    if isinstance(entry, list):
        return any(has_overflow(v) for v in entry)
    return False
