"""Reading dumps for ``trainprobe compare``: locating rank directories and flattening records.

A dump argument may be the dump root (``step*/`` inside), a step directory (``rank*/`` or
``proc*/`` inside) or a rank directory (``dump.json`` or ``debug.json`` inside). Each tensor of a
record becomes one :class:`Item`, named like its ``.pt`` file without the extension
(``Functional.linear.0.forward.input.0``, ``Module.fc.Linear.parameters_grad.0.weight``), in the
order of ``dump.json`` (the order of execution). Values that are not tensors (an ``int`` or
``float`` argument, ``None``) are items too, as the reference tool lists them: their value stands
in for the statistics (:func:`scalar_entry`).

Hostile dumps: ``dump.json`` is read as a regular file of bounded size (no FIFO, no device), a
document nested too deeply is a one-line ``ConfigError``, and a tensor is only ever loaded from a
regular file directly inside the rank's ``dump_tensor_data`` (:func:`tensor_path`), so a
``data_name`` holding an absolute path, ``../`` or a link out of the folder is refused.
"""

from __future__ import annotations

import json
import os
import re
import stat
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.file_names import path_under
from trainprobe.engine.log import logger
from trainprobe.engine.safe_files import read_text

_STEP = re.compile(r"^step(\d+)$")
_RANK = re.compile(r"^(rank\d+|proc\d+)$")


@dataclass(frozen=True, slots=True)
class Item:
    """One tensor of a dump."""

    name: str
    record: str
    entry: dict[str, Any]


@dataclass(slots=True)
class RankDump:
    """The parsed files of one rank directory."""

    path: Path
    task: str
    items: list[Item]
    stack: dict[str, Any]

    @property
    def tensor_dir(self) -> Path:
        """Where its ``.pt`` files are."""
        return self.path / "dump_tensor_data"

    @property
    def main_file(self) -> Path:
        """Its ``dump.json`` (``debug.json`` for a dump of ``save()`` calls)."""
        return main_file(self.path)

    @property
    def has_md5(self) -> bool:
        """Whether its tensors carry checksums (a dump written with summary_mode md5 or xor)."""
        return any("md5" in item.entry for item in self.items if is_tensor(item.entry))


def kind_of(path: Path) -> str:
    """``rank``, ``step`` or ``root`` for a dump directory.

    Raises:
        ConfigError: ``path`` is not a directory or holds no dump.
    """
    if not path.is_dir():
        raise ConfigError(f"{path}: no such directory")
    if is_finished(path):
        return "rank"
    children = [p for p in path.iterdir() if p.is_dir()]
    if any(_RANK.match(p.name) for p in children):
        return "step"
    if any(_STEP.match(p.name) for p in children):
        return "root"
    if _RANK.match(path.name):
        raise ConfigError(f"{path}: an unfinished rank directory (no dump.json: the run was stopped during this step)")
    raise ConfigError(f"{path}: not a dump (no dump.json, rank*/proc* or step* directories inside)")


def is_finished(rank_dir: Path) -> bool:
    """Whether a rank directory holds its ``dump.json`` (or ``debug.json``). The JSON files are
    written last, atomically, by ``stop()``/``step()``: a rank directory without one belongs to
    a step the run was stopped (killed) in, and may hold partial ``.pt`` or ``.tmp`` files."""
    return (rank_dir / "dump.json").is_file() or (rank_dir / "debug.json").is_file()


def pair_dirs(target: Path, golden: Path) -> list[tuple[str, Path, Path]]:
    """``(label, target rank dir, golden rank dir)`` for every pair to compare.

    Rank directories of an unfinished step (:func:`is_finished`) on either side are left out,
    with one warning per step naming them; a step left with no finished rank directory on one
    side is skipped, so a dump killed in step N compares its steps 0..N-1.

    Raises:
        ConfigError: the two paths are of different kinds or have nothing in common.
    """
    kt, kg = kind_of(target), kind_of(golden)
    if kt != kg:
        raise ConfigError(f"mismatched dumps: -tp is a {kt} directory but -gp is a {kg} directory")
    if kt == "rank":
        return [("", target, golden)]
    if kt == "step":
        tranks, granks = _finished_ranks(target), _finished_ranks(golden)
        return [(label, t, g) for label, t, g in _pair_children(tranks, granks, target, golden, "rank")]
    out: list[tuple[str, Path, Path]] = []
    steps = _pair_children(_children(target, _STEP), _children(golden, _STEP), target, golden, "step")
    for step, ts, gs in steps:
        tranks, granks = _finished_ranks(ts), _finished_ranks(gs)
        if not tranks or not granks:
            continue
        out.extend((f"{step}_{rank}", t, g) for rank, t, g in _pair_children(tranks, granks, ts, gs, "rank"))
    if not out:
        raise ConfigError(f"mismatched dumps: {target} and {golden} have no finished step/rank directory in common")
    return out


def _children(folder: Path, pattern: re.Pattern[str]) -> dict[str, Path]:
    return {p.name: p for p in sorted(folder.iterdir()) if p.is_dir() and pattern.match(p.name)}


def _finished_ranks(step_dir: Path) -> dict[str, Path]:
    """The finished rank directories of ``step_dir``; one warning names the unfinished ones."""
    ranks = _children(step_dir, _RANK)
    unfinished = [name for name, path in ranks.items() if not is_finished(path)]
    if unfinished:
        logger.warning(
            "trainprobe compare: skipping %s (%s): unfinished, no dump.json (the run was stopped during this "
            "step; its partial files are not compared)",
            step_dir,
            ", ".join(unfinished),
        )
    elif not ranks:
        logger.warning("trainprobe compare: skipping %s: no rank directory in it", step_dir)
    return {name: path for name, path in ranks.items() if name not in unfinished}


def _pair_children(
    tdirs: dict[str, Path], gdirs: dict[str, Path], target: Path, golden: Path, what: str
) -> list[tuple[str, Path, Path]]:
    common = [n for n in tdirs if n in gdirs]
    if not common and what == "rank":
        tproc = [n for n in tdirs if n.startswith("proc")]
        gproc = [n for n in gdirs if n.startswith("proc")]
        if len(tproc) == 1 and len(gproc) == 1:  # two single-process runs: their pids differ
            return [(tproc[0], tdirs[tproc[0]], gdirs[gproc[0]])]
    if not common:
        raise ConfigError(
            f"mismatched dumps: no {what} directory in common between {target} ({', '.join(tdirs) or 'none'}) "
            f"and {golden} ({', '.join(gdirs) or 'none'})"
        )
    return [(n, tdirs[n], gdirs[n]) for n in common]


MAX_DUMP_JSON_BYTES = 4 << 30
"""The largest dump.json / stack.json read (bytes)."""


def _read_json(path: Path) -> Any:
    """The JSON document in ``path`` (None when it does not exist); dumps may hold ``NaN``.

    Raises:
        ConfigError: ``<path>: ...`` for an unreadable, non-regular, oversized, invalid or too
            deeply nested file.
    """
    if not os.path.lexists(path):
        return None
    text = read_text(path, max_bytes=MAX_DUMP_JSON_BYTES)
    try:
        return json.loads(text)
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to be a dump; refused") from None
    except ValueError as exc:
        raise ConfigError(f"{path}: cannot be read as JSON ({exc})") from None


def tensor_path(tensor_dir: Path, data_name: str) -> Path:
    """The regular file ``data_name`` directly inside ``tensor_dir``.

    Raises:
        ValueError: ``data_name`` is not a plain file name, leaves the folder, or is not a
            regular file there (a FIFO, a device, a link out of the folder).
    """
    path = path_under(tensor_dir, data_name)
    real_dir, real = os.path.realpath(tensor_dir), os.path.realpath(path)
    if os.path.dirname(real) != real_dir:
        raise ValueError(f"refusing {data_name!r}: it links out of {tensor_dir}")
    try:
        mode = os.stat(real).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(path) from None
    if not stat.S_ISREG(mode):
        raise ValueError(f"refusing {data_name!r}: not a regular file")
    return path


def main_file(rank_dir: Path) -> Path:
    """The rank directory's ``dump.json``, or its ``debug.json`` when it has no ``dump.json``."""
    return rank_dir / "dump.json" if (rank_dir / "dump.json").is_file() else rank_dir / "debug.json"


def load_rank(path: Path) -> RankDump:
    """Parse one rank directory.

    Raises:
        ConfigError: its dump.json is missing, unreadable or not a dump.
    """
    main = main_file(path)
    if not is_finished(path):
        raise ConfigError(f"{path}: no dump.json or debug.json (an unfinished step, or not a rank directory)")
    data = _read_json(main)
    if not isinstance(data, dict) or not isinstance(data.get("data"), dict):
        raise ConfigError(f"{main}: not a dump file (expected an object with a 'data' object)")
    items: list[Item] = []
    for record, body in data["data"].items():
        items.extend(flatten_record(str(record), body))
    return RankDump(path, str(data.get("task", "statistics")), items, stacks_by_name(_read_json(path / "stack.json")))


def stacks_by_name(stack: Any) -> dict[str, Any]:
    """``record name -> frames`` from either ``stack.json`` layout: grouped (``{"0": [[names],
    [frames]]}``, the reference tool's and trainprobe's) or by name (older trainprobe dumps)."""
    if not isinstance(stack, dict):
        return {}
    grouped = stack and all(
        isinstance(v, list) and len(v) == 2 and isinstance(v[0], list) and isinstance(v[1], list)
        for v in stack.values()
    )
    if grouped:
        return {str(n): v[1] for v in stack.values() for n in v[0]}
    return stack


_SIDE = {
    "input_args": "input",
    "input_kwargs": "input",
    "output": "output",
    "parameters": "parameters",
    "input": "input",
}


def flatten_record(record: str, body: Any) -> list[Item]:
    """The tensors of one record, named like their ``.pt`` files."""
    out: list[Item] = []
    if ".parameters_grad." in record and isinstance(body, dict):
        for pname, entries in body.items():
            values = entries if isinstance(entries, list) else [entries]
            for i, entry in enumerate(values):
                _walk(f"{record}.{pname}" if i == 0 else f"{record}.{pname}.{i}", record, entry, out)
        return out
    if isinstance(body, dict) and body.get("type") is None and set(body) & set(_SIDE):
        for key, value in body.items():
            side = _SIDE.get(key, key)
            _walk(f"{record}.{side}", record, value, out)
        return out
    _walk(record, record, body, out)
    return out


def scalar_entry(value: Any) -> dict[str, Any]:
    """The entry of a non-tensor value, shaped like a tensor's: ``dtype`` the value's type
    (``"<class 'float'>"``, as the reference writes it), ``shape`` ``[]``, the value as Max,
    Min, Mean and Norm, and as ``md5`` the CRC-32 of the value's text (``str(0.1)``; 8 hex
    digits, the reference's checksum of a non-tensor), so that md5 mode finds a changed
    argument. ``value`` is a dump entry (``{"type": "float", "value": 0.1}``) or ``None`` (no
    checksum: both sides ``N/A``)."""
    if value is None:
        return {"type": None, "dtype": None, "shape": None}
    inner = value.get("value")
    entry: dict[str, Any] = {"type": value.get("type"), "dtype": str(type(inner)), "shape": []}
    entry.update(dict.fromkeys(("Max", "Min", "Mean", "Norm"), inner if not isinstance(inner, (list, dict)) else None))
    entry["md5"] = f"{zlib.crc32(str(value.get('value', '')).encode()) & 0xFFFFFFFF:08x}"
    return entry


def is_tensor(entry: dict[str, Any]) -> bool:
    """Whether an item's entry describes a tensor (not a scalar or ``None``)."""
    return entry.get("type") == "torch.Tensor"


def _walk(name: str, record: str, value: Any, out: list[Item], depth: int = 0) -> None:
    if depth > 32:
        raise ConfigError(f"record {record!r}: nested deeper than 32 levels; not a dump")
    if value is None:
        out.append(Item(name, record, scalar_entry(None)))
    elif isinstance(value, dict):
        if value.get("type") == "torch.Tensor":
            out.append(Item(name, record, value))
        elif isinstance(value.get("type"), str):
            out.append(Item(name, record, scalar_entry(value)))
        else:
            for k, v in value.items():
                _walk(f"{name}.{k}", record, v, out, depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _walk(f"{name}.{i}", record, v, out, depth + 1)


def order_key(name: str) -> str:
    """``name`` without its call count, for matching by order when counts differ."""
    parts = name.split(".")
    if parts[0] == "Module":
        for i, p in enumerate(parts):
            if p in ("forward", "backward", "parameters_grad") and i + 1 < len(parts) and parts[i + 1].isdigit():
                return ".".join(parts[: i + 1] + parts[i + 2 :])
        return name
    for i, p in enumerate(parts):
        if p in ("forward", "backward", "debug") and i > 0 and parts[i - 1].isdigit():
            return ".".join(parts[: i - 1] + parts[i:])
    return name
