"""Compare a target dump with a golden dump, tensor by tensor (``trainprobe compare``).

Tensors are matched by name; names left over on both sides are matched by order within the same
API or module (``Functional.linear.3.forward.input.0`` with the next unmatched
``Functional.linear.*.forward.input.0``). The mode follows the dumps: ``tensor`` when both hold
``.pt`` files, ``md5`` when both carry checksums, ``statistics`` otherwise. Column names and
order are the reference tool's (:data:`COLUMNS`); "NPU" is the target, "Bench" the golden.
One file per compared rank directory, named as the reference tool names it:
``compare_result[_{step}_{rank}]_{YYYYmmddHHMMSS}.csv`` (or ``.xlsx``; ``debug_compare_result...``
for ``debug.json`` dumps). A tensor file that cannot be read (a FIFO, a link out of the dump, a
file that is not a tensor or needs code to unpickle) is reported on its own row as an ``error``
and the comparison goes on.
"""

from __future__ import annotations

import csv
import io
import os
import re
import sys
import time
from collections import defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainprobe.dump.compare_load import Item, RankDump, is_tensor, load_rank, order_key, pair_dirs, tensor_path
from trainprobe.dump.compare_metrics import (
    STAT_KEYS,
    Verdict,
    check_numbers,
    check_structure,
    statistics_values,
    tensor_values,
)
from trainprobe.engine.errors import ConfigError
from trainprobe.engine.folders import check_output_folder, make_output_folder
from trainprobe.engine.sinks.files import write_atomically

HEAD = ["NPU Name", "Bench Name", "NPU Dtype", "Bench Dtype", "NPU Tensor Shape", "Bench Tensor Shape",
        "NPU Requires_grad", "Bench Requires_grad"]  # fmt: skip
SUMMARY = ["NPU max", "NPU min", "NPU mean", "NPU l2norm", "Bench max", "Bench min", "Bench mean", "Bench l2norm"]
TAIL = ["Requires_grad Consistent", "Result", "Err_message", "NPU_Stack_Info"]
COLUMNS: dict[str, list[str]] = {
    "statistics": HEAD
    + [
        "Max diff",
        "Min diff",
        "Mean diff",
        "L2norm diff",
        "MaxRelativeErr",
        "MinRelativeErr",
        "MeanRelativeErr",
        "NormRelativeErr",
    ]  # fmt: skip
    + SUMMARY
    + TAIL,
    "tensor": HEAD
    + ["Cosine", "EucDist", "MaxAbsErr", "MaxRelativeErr", "One Thousandth Err Ratio", "Five Thousandths Err Ratio"]
    + SUMMARY
    + TAIL
    + ["Data_name"],
    "md5": HEAD + ["NPU MD5", "BENCH MD5"] + TAIL,
}
PROGRESS_MIN_ROWS = 2000


@dataclass(frozen=True, slots=True)
class Divergence:
    """The first row (in the target's execution order) that did not pass."""

    name: str
    record: str
    result: str
    reason: str


@dataclass(frozen=True, slots=True)
class PairResult:
    """One compared rank directory."""

    label: str
    mode: str
    output: Path
    rows: int
    first: Divergence | None


def match(target: list[Item], golden: list[Item]) -> list[tuple[Item, Item | None]]:
    """Each target item with its golden item (None when there is none), in target order."""
    by_name = {item.name: item for item in golden}
    used: set[str] = set()
    pairs: list[tuple[Item, Item | None]] = []
    for item in target:
        g = by_name.get(item.name)
        if g is not None and g.name not in used:
            used.add(g.name)
            pairs.append((item, g))
        else:
            pairs.append((item, None))
    leftovers: dict[str, deque[Item]] = defaultdict(deque)
    for item in golden:
        if item.name not in used:
            leftovers[order_key(item.name)].append(item)
    out: list[tuple[Item, Item | None]] = []
    for t, g in pairs:
        if g is None:
            queue = leftovers.get(order_key(t.name))
            g = queue.popleft() if queue else None
        out.append((t, g))
    return out


def pick_mode(target: RankDump, golden: RankDump) -> str:
    """``tensor``, ``md5`` or ``statistics`` (see the module docstring)."""
    if target.task == "tensor" and golden.task == "tensor":
        return "tensor"
    if target.has_md5 and golden.has_md5:
        return "md5"
    return "statistics"


def _stats(entry: dict[str, Any] | None) -> list[Any]:
    if entry is None:
        return ["N/A"] * 4
    return [entry.get(k, "N/A") if entry.get(k) is not None else "N/A" for k in STAT_KEYS]


def _load_tensor(dump: RankDump, entry: dict[str, Any]) -> tuple[torch.Tensor | None, str]:
    """The tensor of ``entry`` from the dump's ``dump_tensor_data``, or None and why not
    (``""`` when the file is simply absent)."""
    name = entry.get("data_name")
    if not name:
        return None, ""
    try:
        path = tensor_path(dump.tensor_dir, str(name))
        value = torch.load(path, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        return None, ""
    except Exception as exc:  # noqa: BLE001 - any unreadable file is that row's error, never the run's
        return None, f"{name}: cannot be loaded ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    if not isinstance(value, torch.Tensor):
        return None, f"{name}: holds a {type(value).__name__}, not a tensor"
    return value, ""


def _stack_of(dump: RankDump, record: str) -> str:
    stack = dump.stack.get(record)
    if isinstance(stack, list):
        return "\n".join(str(s) for s in stack)
    return "N/A"


def compare_rank(target: RankDump, golden: RankDump) -> tuple[str, list[list[Any]], Divergence | None]:
    """The mode, the rows and the first divergence of two rank directories."""
    mode = pick_mode(target, golden)
    rows: list[list[Any]] = []
    first: Divergence | None = None
    pairs = match(target.items, golden.items)
    where_t, where_g = f"NPU {target.main_file}", f"Bench {golden.main_file}"
    for t, g in _progress(pairs, len(pairs)):
        verdict = Verdict()
        te, ge = t.entry, g.entry if g is not None else None
        row: list[Any] = [t.name, g.name if g else "N/A", te.get("dtype"), ge.get("dtype") if ge else "N/A",
                          str(te.get("shape")), str(ge.get("shape")) if ge else "N/A",
                          te.get("requires_grad"), ge.get("requires_grad") if ge else "N/A"]  # fmt: skip
        if ge is None:
            verdict.flag("error", "golden (Bench) data not found")
            middle: list[Any] = ["N/A"] * {"statistics": 8, "tensor": 6, "md5": 2}[mode]
            if mode == "md5":
                middle[0] = te.get("md5", "N/A")
        else:
            check_structure(te, ge, verdict)
        if mode != "md5":
            check_numbers(te, where_t, verdict)
            if ge is not None:
                check_numbers(ge, where_g, verdict)
        if ge is not None:
            if mode == "md5":
                middle = [te.get("md5", "N/A"), ge.get("md5", "N/A")]
                if te.get("md5") != ge.get("md5"):
                    verdict.flag("error", "checksums differ")
            elif mode == "tensor" and is_tensor(te) and is_tensor(ge):
                (a, why_a), (b, why_b) = _load_tensor(target, te), _load_tensor(golden, ge)
                if why_a or why_b:
                    verdict.flag("error", "; ".join(w for w in (why_a, why_b) if w))
                    middle = ["N/A"] * 6
                elif a is None or b is None:
                    verdict.flag("warning", "tensor file missing; statistics compared instead")
                    statistics_values(te, ge, verdict)
                    middle = ["N/A"] * 6
                else:
                    middle = tensor_values(a, b, verdict)
            elif mode == "tensor":
                statistics_values(te, ge, verdict)
                middle = ["N/A"] * 6
            else:
                middle = statistics_values(te, ge, verdict)
        row += middle
        if mode != "md5":
            row += _stats(te) + _stats(ge)
        consistent = ge is not None and te.get("requires_grad") == ge.get("requires_grad")
        row += [consistent, verdict.result, verdict.message, _stack_of(target, t.record)]
        if mode == "tensor":
            row.append(str([te.get("data_name", "-1"), ge.get("data_name", "-1") if ge else "-1"]))
        rows.append(row)
        if first is None and verdict.result != "pass":
            first = Divergence(t.name, t.record, verdict.result, verdict.message)
    return mode, rows, first


def _progress(items: list[Any], total: int) -> Iterable[Any]:
    if total < PROGRESS_MIN_ROWS:
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, total=total, desc="compare", unit="tensor", file=sys.stderr)


_FORMULA_STARTS = frozenset("=+-@\t\r")
_KEPT_TYPES = frozenset({int, float, bool, type(None)})
_NUMBER_TEXT = re.compile(r"[+-]?(?:\d+\.?\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?|inf|infinity|nan)", re.IGNORECASE)


def as_text_cell(value: Any) -> Any:
    """``value`` as a table cell that no spreadsheet runs as a formula (CSV injection).

    Numbers (``int``, ``float``; a negative one included), ``bool`` and ``None`` are kept as
    they are. A string that starts with ``=``, ``+``, ``-``, ``@``, a tab or a carriage return
    gets a leading ``'`` (``=HYPERLINK(...)`` → ``'=HYPERLINK(...)``), unless it is the text of
    a number (``-1.5``, ``-inf``, ``nan``), which is kept. Anything else becomes its ``str``
    under the same rule.
    """
    if type(value) is not str:
        if value is None or isinstance(value, (bool, int, float)):
            return value
        value = str(value)
    if not value or value[0] not in _FORMULA_STARTS or _NUMBER_TEXT.fullmatch(value):
        return value
    return "'" + value


OUTPUT_PATH = "output_path"
"""How messages name the folder of the result tables (``compare -o/--output_path``)."""


def write_table(path: Path, columns: list[str], rows: list[list[Any]], xlsx: bool) -> None:
    """Write ``rows`` under ``columns`` to ``path`` (CSV, or xlsx with openpyxl); every cell
    goes through :func:`as_text_cell`, so no cell of either is a formula.

    Raises:
        ConfigError: the folder of ``path`` cannot be created (naming ``output_path``).
    """
    make_output_folder(path.parent, OUTPUT_PATH)
    keep, starts = _KEPT_TYPES, _FORMULA_STARTS  # the common cells without a call (tables of millions)
    cells = [
        [v if type(v) in keep or (type(v) is str and v[:1] not in starts) else as_text_cell(v) for v in row]
        for row in [columns, *rows]
    ]
    if xlsx:
        try:
            from openpyxl import Workbook
        except ImportError:
            raise ConfigError("--xlsx needs openpyxl: pip install openpyxl (or trainprobe[compare])") from None
        wb = Workbook()
        ws = wb.active
        ws.title = "compare_result"
        for row in cells:
            ws.append(row)  # openpyxl makes a formula of a string starting with "=": none is left
        write_atomically(path, wb.save)
    else:
        buf = io.StringIO()
        writer = csv.writer(buf)
        writer.writerows(cells)
        write_atomically(path, buf.getvalue())


def compare_dumps(target: str | os.PathLike[str], golden: str | os.PathLike[str], output: str | os.PathLike[str],
                  *, xlsx: bool = False) -> list[PairResult]:  # fmt: skip
    """Compare every rank directory of ``target`` with ``golden``'s, writing one table each.

    Raises:
        ConfigError: missing, unreadable or mismatched dumps; an ``output`` folder that cannot
            be created (named ``output_path``, as the command line's ``-o``; created with the
            first table).
    """
    out_dir = check_output_folder(os.fspath(output), OUTPUT_PATH)
    stamp = time.strftime("%Y%m%d%H%M%S", time.localtime())
    results: list[PairResult] = []
    for label, tdir, gdir in pair_dirs(Path(target), Path(golden)):
        t, g = load_rank(tdir), load_rank(gdir)
        mode, rows, first = compare_rank(t, g)
        prefix = (
            "debug_compare_result"
            if (tdir / "debug.json").is_file() and not (tdir / "dump.json").is_file()
            else "compare_result"
        )
        name = f"{prefix}_{label}" if label else prefix
        path = out_dir / f"{name}_{stamp}.{'xlsx' if xlsx else 'csv'}"
        write_table(path, COLUMNS[mode], rows, xlsx)
        results.append(PairResult(label, mode, path, len(rows), first))
    return results
