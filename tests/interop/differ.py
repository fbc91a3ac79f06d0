"""Differences between what the reference tool and trainprobe wrote for the same run.

Every comparison returns :class:`Diff` records. A record's ``id`` names *what* differs
(area, file or table, kind: ``v1/actv: header``) and stays the same while the difference
stays; its ``detail`` says how (counts, first examples) and may change from run to run.
``docs/compatibility.md`` lists the ids; the harness asserts the two sets are equal.

What legitimately differs is normalised before comparing: V1 run-folder timestamps and
random suffixes, window suffixes of file names, the process id in ``proc<pid>`` dump
folders, absolute paths and line numbers in call stacks.
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REL_TOL = 1e-5
ABS_TOL = 1e-9
EXAMPLES = 3
KEY_COLUMNS = ("vpp_stage", "step", "module_name", "name", "scope", "micro_step")


@dataclass(frozen=True, order=True)
class Diff:
    """One difference: a stable ``id`` and a human-readable ``detail``."""

    id: str
    detail: str


def examples(items: Iterable[Any]) -> str:
    """The first few items, then how many more."""
    items = sorted(map(str, items))
    head = ", ".join(items[:EXAMPLES])
    return head + (f" (+{len(items) - EXAMPLES} more)" if len(items) > EXAMPLES else "")


def close(a: str, b: str, scale: float = 0.0) -> bool:
    """Cells equal as numbers within REL_TOL (NaN equals NaN), else as strings.

    ``scale`` is the tensor's largest magnitude where known: a mean or a norm near zero is
    compared to REL_TOL of it (float32 and float64 sums of the same tensor differ there).
    """
    try:
        x, y = float(a), float(b)
    except ValueError:
        return a == b
    if math.isnan(x) or math.isnan(y):
        return math.isnan(x) and math.isnan(y)
    return math.isclose(x, y, rel_tol=REL_TOL, abs_tol=max(ABS_TOL, REL_TOL * scale))


def magnitude(values: Mapping[str, Any]) -> float:
    """Largest of |min| and |max| among ``values`` (any capitalisation), 0 if absent."""
    found = [0.0]
    for key, value in values.items():
        if str(key).lower() in ("min", "max"):
            try:
                found.append(abs(float(value)))
            except (TypeError, ValueError):
                continue
    return max(v for v in found if not math.isnan(v) and not math.isinf(v))


# ---------------------------------------------------------------- CSV trees (V1, V2)

V1_RUN = re.compile(r"^[A-Z][a-z]{2}\d{2}_\d{2}-\d{2}-\d{2}-(rank\d+)-[0-9a-f]+$")
PROC = re.compile(r"^proc\d+$")
WINDOW = re.compile(r"^(.*?)_(?:step)?\d+-\d+\.csv$")


def csv_tables(root: Path) -> dict[str, list[Path]]:
    """CSV files under ``root`` by table: run folder normalised to ``rank<r>``, window dropped."""
    tables: dict[str, list[Path]] = {}
    for path in sorted(root.rglob("*.csv")):
        parts = [V1_RUN.sub(r"\1", p) for p in path.relative_to(root).parent.parts]
        match = WINDOW.match(path.name)
        table = "/".join([*parts, match.group(1) if match else path.stem])
        tables.setdefault(table, []).append(path)
    return tables


def window_names(root: Path) -> set[str]:
    """File names relative to ``root`` with the V1 run folder normalised (windows kept)."""
    return {"/".join(V1_RUN.sub(r"\1", p) for p in path.relative_to(root).parts) for path in root.rglob("*.csv")}


def read_rows(paths: list[Path]) -> tuple[list[str], list[dict[str, str]]]:
    """Header of the first file and the rows of all of them."""
    header: list[str] = []
    rows: list[dict[str, str]] = []
    for path in paths:
        with path.open(newline="") as handle:
            reader = csv.DictReader(handle)
            header = header or list(reader.fieldnames or [])
            rows.extend(reader)
    return header, rows


def diff_csv_trees(area: str, ref: Path, tp: Path) -> list[Diff]:
    """File names, headers, row keys and values of two CSV trees."""
    out: list[Diff] = []
    ref_names, tp_names = window_names(ref), window_names(tp)
    ref_tables, tp_tables = csv_tables(ref), csv_tables(tp)
    if ref_names - tp_names:
        out.append(Diff(f"{area}: files only in reference", examples(ref_names - tp_names)))
    if tp_names - ref_names:
        out.append(Diff(f"{area}: files only in trainprobe", examples(tp_names - ref_names)))
    for table in sorted(ref_tables.keys() & tp_tables.keys()):
        out += diff_table(f"{area}/{table}", read_rows(ref_tables[table]), read_rows(tp_tables[table]))
    return out


def diff_table(
    area: str, ref: tuple[list[str], list[dict[str, str]]], tp: tuple[list[str], list[dict[str, str]]]
) -> list[Diff]:
    """Header, row keys (the key columns both have) and values (rows matched by key)."""
    (ref_header, ref_rows), (tp_header, tp_rows) = ref, tp
    out: list[Diff] = []
    if ref_header != tp_header:
        out.append(Diff(f"{area}: header", f"reference {ref_header}; trainprobe {tp_header}"))
    keys = [c for c in KEY_COLUMNS if c in ref_header and c in tp_header]
    values = [c for c in ref_header if c in tp_header and c not in keys]
    ref_by = {tuple(r[c] for c in keys): r for r in ref_rows}
    tp_by = {tuple(r[c] for c in keys): r for r in tp_rows}
    if len(ref_rows) - len(ref_by) != len(tp_rows) - len(tp_by):  # as many shared keys on both sides is no difference
        out.append(
            Diff(
                f"{area}: duplicate row keys",
                f"reference {len(ref_rows) - len(ref_by)}, "
                f"trainprobe {len(tp_rows) - len(tp_by)} rows share a key {keys}",
            )
        )
    only_ref, only_tp = ref_by.keys() - tp_by.keys(), tp_by.keys() - ref_by.keys()
    if only_ref:
        out.append(Diff(f"{area}: rows only in reference", f"{len(only_ref)} keys {keys}, e.g. {examples(only_ref)}"))
    if only_tp:
        out.append(Diff(f"{area}: rows only in trainprobe", f"{len(only_tp)} keys {keys}, e.g. {examples(only_tp)}"))
    how = ""
    if only_ref or only_tp:
        ref_by, tp_by = loose(ref_by, keys), loose(tp_by, keys)
        how = " (rows matched without vpp_stage and chunk prefix)"
        still = [
            f"{side} {len(k)}: {examples(k)}"
            for side, k in (("reference", ref_by.keys() - tp_by.keys()), ("trainprobe", tp_by.keys() - ref_by.keys()))
            if k
        ]
        out = [
            Diff(d.id, d.detail + f"; without vpp_stage and chunk prefix, only in {'; '.join(still) or 'neither'}")
            if ": rows only in " in d.id
            else d
            for d in out
        ]
    bad: Counter[str] = Counter()
    first: dict[str, str] = {}
    for key in ref_by.keys() & tp_by.keys():
        scale = magnitude(ref_by[key])
        for col in values:
            a, b = ref_by[key][col], tp_by[key][col]
            if not close(a, b, scale):
                bad[col] += 1
                first.setdefault(col, f"{key}: {a} vs {b}")
    for col, count in sorted(bad.items()):
        out.append(Diff(f"{area}: values of {col}", f"{count} rows differ{how}, e.g. {first[col]}"))
    return out


CHUNK = re.compile(r"^\d+:")


def loose(rows: dict[tuple[str, ...], dict[str, str]], keys: list[str]) -> dict[tuple[str, ...], dict[str, str]]:
    """Rows keyed without vpp_stage and without the ``<chunk>:`` name prefix (a key seen twice dropped)."""
    out: dict[tuple[str, ...], dict[str, str]] = {}
    seen: set[tuple[str, ...]] = set()
    for row in rows.values():
        key = tuple(CHUNK.sub("", row[c]) for c in keys if c != "vpp_stage")
        if key in seen:
            out.pop(key, None)
        else:
            out[key] = row
        seen.add(key)
    return out


# ---------------------------------------------------------------- anomaly.json


def load_json(path: Path) -> Any:
    return json.loads(path.read_text())


def diff_anomalies(area: str, ref: Path, tp: Path) -> list[Diff]:
    """Events (tag, step), their fields, call_id order and message wording."""
    a, b = load_json(ref), load_json(tp)
    ev_a = {(e["tag_name"], e["step"]): e for e in a.values()}
    ev_b = {(e["tag_name"], e["step"]): e for e in b.values()}
    out: list[Diff] = []
    if ev_a.keys() - ev_b.keys():
        out.append(
            Diff(
                f"{area}: events only in reference",
                f"{len(ev_a.keys() - ev_b.keys())} of {len(ev_a)}, e.g. {examples(ev_a.keys() - ev_b.keys())}",
            )
        )
    if ev_b.keys() - ev_a.keys():
        out.append(
            Diff(
                f"{area}: events only in trainprobe",
                f"{len(ev_b.keys() - ev_a.keys())} of {len(ev_b)}, e.g. {examples(ev_b.keys() - ev_a.keys())}",
            )
        )
    common = sorted(ev_a.keys() & ev_b.keys())
    fields_a = {f for e in a.values() for f in e}
    fields_b = {f for e in b.values() for f in e}
    if fields_a != fields_b:
        out.append(Diff(f"{area}: event fields", f"reference {sorted(fields_a)}; trainprobe {sorted(fields_b)}"))
    order_a = [k for k in sorted(common, key=lambda k: ev_a[k].get("call_id", 0))]
    order_b = [k for k in sorted(common, key=lambda k: ev_b[k].get("call_id", 0))]
    if order_a != order_b:
        out.append(Diff(f"{area}: call_id order", f"{len(common)} common events ordered differently"))
    number = re.compile(r"-?\d+(\.\d+)?(e-?\d+)?")
    wording = [k for k in common if number.sub("#", ev_a[k]["message"]) != number.sub("#", ev_b[k]["message"])]
    if wording:
        k = wording[0]
        out.append(
            Diff(f"{area}: message", f"{len(wording)} differ, e.g. {ev_a[k]['message']!r} vs {ev_b[k]['message']!r}")
        )
    keys_a = {re.sub(r"_call_\d+$", "", k) for k in a}
    keys_b = {re.sub(r"_call_\d+$", "", k) for k in b}
    if (keys_a & keys_b) != keys_a | keys_b and not (ev_a.keys() ^ ev_b.keys()):
        out.append(Diff(f"{area}: event keys", examples(keys_a ^ keys_b)))
    return out


# ---------------------------------------------------------------- dumps


def dump_dirs(root: Path) -> dict[str, Path]:
    """``step<N>/<rank dir>`` folders of a dump root, the process id normalised."""
    return {f"{d.parent.name}/{PROC.sub('proc', d.name)}": d for d in sorted(root.glob("step*/*")) if d.is_dir()}


def leaves(value: Any, prefix: str = "") -> dict[str, Any]:
    """A JSON value flattened to ``path -> scalar``."""
    if isinstance(value, Mapping):
        items = value.items()
    elif isinstance(value, list):
        items = ((str(i), v) for i, v in enumerate(value))
    else:
        return {prefix: value}
    flat: dict[str, Any] = {}
    for k, v in items:
        flat.update(leaves(v, f"{prefix}.{k}" if prefix else str(k)))
    return flat


def same_scalar(a: Any, b: Any, scale: float = 0.0) -> bool:
    if isinstance(a, bool) or isinstance(b, bool) or not isinstance(a, float | int) or not isinstance(b, float | int):
        return a == b
    return close(str(a), str(b), scale)


def diff_dump_json(area: str, ref: Path, tp: Path) -> list[Diff]:
    """Top-level fields, entry names, each entry's fields and values."""
    a, b = load_json(ref), load_json(tp)
    out: list[Diff] = []
    top = {k: a.get(k) for k in a if k != "data"}, {k: b.get(k) for k in b if k != "data"}
    top = tuple({k: v for k, v in t.items() if k != "dump_data_dir"} for t in top)
    if top[0] != top[1]:
        out.append(Diff(f"{area}: top-level fields", f"reference {top[0]}; trainprobe {top[1]}"))
    da, db = a.get("data", {}), b.get("data", {})
    if da.keys() - db.keys():
        out.append(
            Diff(
                f"{area}: entries only in reference", f"{len(da.keys() - db.keys())}: {examples(da.keys() - db.keys())}"
            )
        )
    if db.keys() - da.keys():
        out.append(
            Diff(
                f"{area}: entries only in trainprobe",
                f"{len(db.keys() - da.keys())}: {examples(db.keys() - da.keys())}",
            )
        )
    fields: Counter[str] = Counter()
    values: Counter[str] = Counter()
    first: dict[str, str] = {}
    for name in sorted(da.keys() & db.keys()):
        la, lb = leaves(da[name]), leaves(db[name])
        if la.keys() != lb.keys():
            fields["x"] += 1
            first.setdefault(
                "fields",
                f"{name}: only reference {examples(la.keys() - lb.keys())}; "
                f"only trainprobe {examples(lb.keys() - la.keys())}",
            )
        for path in la.keys() & lb.keys():
            if path.endswith("data_name"):
                continue
            parent = path.rsplit(".", 1)[0]
            scale = magnitude({k.rsplit(".", 1)[-1]: v for k, v in la.items() if k.rsplit(".", 1)[0] == parent})
            if not same_scalar(la[path], lb[path], scale):
                field = next(p for p in reversed(path.split(".")) if not p.isdigit())
                values[field] += 1
                first.setdefault(field, f"{name}.{path}: {la[path]} vs {lb[path]}")
    if fields:
        out.append(Diff(f"{area}: entry fields", f"{fields['x']} entries, e.g. {first['fields']}"))
    for field, count in sorted(values.items()):
        out.append(Diff(f"{area}: values of {field}", f"{count} differ, e.g. {first[field]}"))
    return out


def stack_by_name(data: Any) -> tuple[str, dict[str, list[str]]]:
    """Both stack.json layouts as ``name -> frames``, with the layout's name."""
    if data and all(isinstance(v, list) and len(v) == 2 and isinstance(v[0], list) for v in data.values()):
        return "grouped", {n: v[1] for v in data.values() for n in v[0]}
    return "by-name", {n: v for n, v in data.items()}


SCRIPTS = ("train.py", "families.py")
"""The training scripts whose frames in ``stack.json`` are compared."""


def script_frames(frames: list[str]) -> list[str]:
    """The frames in the training scripts, without paths and line numbers."""
    kept = []
    for frame in frames:
        match = re.match(r"File (.*?), line \d+, in (.*)", frame, re.S)
        if match and Path(match.group(1)).name in SCRIPTS:
            kept.append(f"{Path(match.group(1)).name} {match.group(2).strip()}")
    return kept


def diff_stack_json(area: str, ref: Path, tp: Path) -> list[Diff]:
    (layout_a, a), (layout_b, b) = stack_by_name(load_json(ref)), stack_by_name(load_json(tp))
    out: list[Diff] = []
    if layout_a != layout_b:
        out.append(Diff(f"{area}: layout", f"reference {layout_a}; trainprobe {layout_b}"))
    if a.keys() - b.keys():
        out.append(
            Diff(f"{area}: names only in reference", f"{len(a.keys() - b.keys())}: {examples(a.keys() - b.keys())}")
        )
    if b.keys() - a.keys():
        out.append(
            Diff(f"{area}: names only in trainprobe", f"{len(b.keys() - a.keys())}: {examples(b.keys() - a.keys())}")
        )
    bad = [n for n in sorted(a.keys() & b.keys()) if script_frames(a[n]) != script_frames(b[n])]
    if bad:
        n = bad[0]
        out.append(
            Diff(
                f"{area}: script frames", f"{len(bad)} names, e.g. {n}: {script_frames(a[n])} vs {script_frames(b[n])}"
            )
        )
    return out


def diff_construct_json(area: str, ref: Path, tp: Path) -> list[Diff]:
    a, b = load_json(ref), load_json(tp)
    out: list[Diff] = []
    if a.keys() - b.keys():
        out.append(
            Diff(f"{area}: names only in reference", f"{len(a.keys() - b.keys())}: {examples(a.keys() - b.keys())}")
        )
    if b.keys() - a.keys():
        out.append(
            Diff(f"{area}: names only in trainprobe", f"{len(b.keys() - a.keys())}: {examples(b.keys() - a.keys())}")
        )
    bad = [n for n in a.keys() & b.keys() if a[n] != b[n]]
    if bad:
        n = sorted(bad)[0]
        out.append(Diff(f"{area}: parents", f"{len(bad)} differ, e.g. {n}: {a[n]} vs {b[n]}"))
    return out


def diff_dumps(area: str, ref: Path, tp: Path) -> list[Diff]:
    """Folders, the three JSON files and the tensor file names of two dump roots."""
    da, db = dump_dirs(ref), dump_dirs(tp)
    out: list[Diff] = []
    if da.keys() != db.keys():
        out.append(Diff(f"{area}: step/rank folders", f"reference {sorted(da)}; trainprobe {sorted(db)}"))
    for key in sorted(da.keys() & db.keys()):
        step = key.split("/")[0]
        for name, fn in (
            ("dump.json", diff_dump_json),
            ("stack.json", diff_stack_json),
            ("construct.json", diff_construct_json),
        ):
            pa, pb = da[key] / name, db[key] / name
            if pa.exists() != pb.exists():
                out.append(Diff(f"{area}/{name}: present in one only", f"{key}: reference {pa.exists()}"))
            elif pa.exists():
                out += [Diff(d.id, f"{step}: {d.detail}") for d in fn(f"{area}/{name}", pa, pb)]
        ta = {p.name for p in (da[key] / "dump_tensor_data").glob("*")}
        tb = {p.name for p in (db[key] / "dump_tensor_data").glob("*")}
        if ta - tb:
            out.append(
                Diff(
                    f"{area}/dump_tensor_data: files only in reference", f"{step}: {len(ta - tb)}: {examples(ta - tb)}"
                )
            )
        if tb - ta:
            out.append(
                Diff(
                    f"{area}/dump_tensor_data: files only in trainprobe", f"{step}: {len(tb - ta)}: {examples(tb - ta)}"
                )
            )
    return merge(out)


def merge(diffs: list[Diff]) -> list[Diff]:
    """One record per id (details of several steps joined)."""
    by_id: dict[str, list[str]] = {}
    for d in diffs:
        by_id.setdefault(d.id, []).append(d.detail)
    return [Diff(i, " | ".join(details)) for i, details in by_id.items()]


# ---------------------------------------------------------------- print_struct, run folders


def diff_module_struct(area: str, ref: Path, tp: Path) -> list[Diff]:
    """Module names and each part (input, output, input_grad, output_grad) of ``module_struct.json``."""
    if ref.exists() != tp.exists():
        return [Diff(f"{area}: present in one only", f"reference {ref.exists()}")]
    if not ref.exists():
        return []
    a, b = load_json(ref), load_json(tp)
    out: list[Diff] = []
    if a.keys() - b.keys():
        out.append(
            Diff(f"{area}: names only in reference", f"{len(a.keys() - b.keys())}: {examples(a.keys() - b.keys())}")
        )
    if b.keys() - a.keys():
        out.append(
            Diff(f"{area}: names only in trainprobe", f"{len(b.keys() - a.keys())}: {examples(b.keys() - a.keys())}")
        )
    bad: dict[str, list[str]] = {}
    for name in sorted(a.keys() & b.keys()):
        for part in sorted(a[name].keys() | b[name].keys()):
            if a[name].get(part) != b[name].get(part):
                bad.setdefault(part, []).append(f"{name}: {a[name].get(part)} vs {b[name].get(part)}")
    for part, found in sorted(bad.items()):
        out.append(Diff(f"{area}: {part}", f"{len(found)} modules differ, e.g. {found[0]}"))
    return out


V1_STAMP = re.compile(r"^([A-Z][a-z]{2}\d{2}_\d{2}-\d{2}-\d{2})-rank\d+-[0-9a-f]+$")


def clock_offset(root: Path) -> float | None:
    """Hours between a V1 run folder's timestamp and UTC (its files' modification time), or None."""
    from datetime import datetime, timezone

    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        match = V1_STAMP.match(folder.name)
        files = [p.stat().st_mtime for p in folder.iterdir()] if match else []
        if match and files:
            written = datetime.fromtimestamp(min(files), timezone.utc).replace(tzinfo=None)
            stamp = datetime.strptime(f"{written.year}{match.group(1)}", "%Y%b%d_%H-%M-%S")
            return round((stamp - written).total_seconds() / 3600)
    return None


def diff_run_folder_clock(area: str, ref: Path, tp: Path) -> list[Diff]:
    """The clock of the V1 run folders' timestamps (the names are normalised elsewhere)."""
    a, b = clock_offset(ref), clock_offset(tp)
    if a != b:
        return [Diff(f"{area}: run-folder timestamp clock", f"reference UTC{a:+}h, trainprobe UTC{b:+}h (TZ=UTC)")]
    return []
