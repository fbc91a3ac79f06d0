"""Runs of the interop harness: the same training scripts and tools under both packages.

``collect(out)`` runs everything into ``out`` (``out/ref/...`` written by the reference tool,
``out/tp/...`` by trainprobe, ``out/cross/...`` by the tools) and returns every difference
found (:class:`differ.Diff`). The reference runs under ``$TRAINPROBE_REF_PYTHON`` (the
``.venv-ref`` that ``make interop`` creates); trainprobe under this interpreter with
``src`` on the path. Nothing here is imported by trainprobe or by the normal test suite.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from differ import (
    Diff,
    diff_anomalies,
    diff_csv_trees,
    diff_dumps,
    diff_module_struct,
    diff_run_folder_clock,
    examples,
    read_rows,
)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SCRIPT = HERE / "scripts" / "train.py"
SUITE = HERE / "scripts" / "suite.py"
SUITE_WHATS = ("cnn", "gru", "tied", "dump-scope", "dump-list")
FAMILIES_SCRIPT = HERE / "scripts" / "families.py"
FAMILIES = ("conv", "transformer", "moe", "accum")
FAMILY_DUMPS = ("L0", "L1", "mix", "md5")
FAMILY_WHATS = FAMILIES + tuple(f"{f}-dump-{d}" for f in FAMILIES for d in FAMILY_DUMPS)
"""families.py's processes: per family its monitors (V1, V2), then one process per dump level."""
REF_ENV = "TRAINPROBE_REF_PYTHON"
WHATS = ("baseline", "v2", "v1", "v1-tb", "dump-L0", "dump-L1", "dump-mix", "dump-tensor")
JOBS = int(os.environ.get("INTEROP_JOBS", "4"))


def ref_python() -> str:
    """The reference tool's interpreter, or an error saying how to get one."""
    path = os.environ.get(REF_ENV, "")
    if not path or not Path(path).is_file():
        raise RuntimeError(
            f"{REF_ENV} is not set to the reference tool's python ({path!r}): run `make interop`, "
            "which creates .venv-ref with mindstudio-probe==26.2.0 and runs this harness"
        )
    return path


def env() -> dict[str, str]:
    """Same threads for both sides (same numerics); trainprobe's sources on the path."""
    e = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0", TZ="UTC")
    e["PYTHONPATH"] = str(REPO / "src")
    e.pop("MONITOR_OUTPUT_DIR", None)
    return e


def run(cmd: Sequence[str], log: Path, cwd: Path | None = None) -> int:
    """Run ``cmd`` with stdout+stderr into ``log``; return the exit code."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as handle:
        return subprocess.run(
            list(cmd), stdout=handle, stderr=subprocess.STDOUT, env=env(), cwd=cwd or log.parent, timeout=600
        ).returncode


def train_all(out: Path) -> list[Diff]:
    """Every training script under both packages; a failing run or changed losses is a Diff."""
    sides = (("ref", ref_python()), ("tp", sys.executable))
    # the suite's and the families' processes first: each trains several configs, so they are the longest
    jobs = [(side, python, what) for what in SUITE_WHATS + FAMILY_WHATS + WHATS for side, python in sides]
    pkg = {"ref": "msprobe", "tp": "trainprobe"}

    def one(job: tuple[str, str, str]) -> int:
        side, python, what = job
        script = SUITE if what in SUITE_WHATS else FAMILIES_SCRIPT if what in FAMILY_WHATS else SCRIPT
        return run(
            [python, str(script), "--pkg", pkg[side], "--what", what, "--out", str(out / side / what)],
            out / "logs" / f"{side}_{what}.log",
        )

    with ThreadPoolExecutor(JOBS) as pool:
        codes = dict(zip(jobs, pool.map(one, jobs), strict=True))
    diffs = [
        Diff(f"{what}: run fails under {side}", f"exit {code}, see logs/{side}_{what}.log")
        for (side, _, what), code in codes.items()
        if code
    ]
    diffs += suite_runs(out)
    for side, name in (("ref", "reference"), ("tp", "trainprobe")):
        base = out / side / "baseline" / "losses_baseline.json"
        for what in WHATS[1:]:
            got = out / side / what / f"losses_{what}.json"
            if base.exists() and got.exists() and json.loads(base.read_text()) != json.loads(got.read_text()):
                diffs.append(
                    Diff(
                        f"{what}: {name} changes training",
                        f"losses without monitoring {base.read_text()}; with {got.read_text()}",
                    )
                )
    return diffs


def suite_runs(out: Path) -> list[Diff]:
    """How each run of the suite and the families ended, and whether it changed training (the
    losses of its model without a monitor, in the same process)."""
    diffs: list[Diff] = []
    for what in SUITE_WHATS + FAMILY_WHATS:
        ends, losses = {}, {}
        for side in ("ref", "tp"):
            folder = out / side / what
            ends[side] = json.loads((folder / "ends.json").read_text()) if (folder / "ends.json").exists() else {}
            losses[side] = json.loads((folder / "losses.json").read_text()) if (folder / "losses.json").exists() else {}
        for name in sorted(ends["ref"].keys() | ends["tp"].keys()):
            a, b = ends["ref"].get(name, "missing"), ends["tp"].get(name, "missing")
            if a != b:
                diffs.append(Diff(f"{what}/{name}: how the run ends", f"reference {a}; trainprobe {b}"))
        for side, who in (("ref", "reference"), ("tp", "trainprobe")):
            base = losses[side].get("baseline")
            for name, got in losses[side].items():
                if name != "baseline" and got != base[: len(got)]:
                    diffs.append(
                        Diff(f"{what}/{name}: {who} changes training", f"losses without monitoring {base}; with {got}")
                    )
    return diffs


def diff_suite(out: Path) -> list[Diff]:
    """What the two packages wrote for the suite's runs."""
    ref, tp = out / "ref", out / "tp"
    diffs: list[Diff] = []
    for what, run_name in (("cnn", "v1"), ("gru", "v1"), ("tied", "v1-dynamic"), ("tied", "v1-struct")):
        diffs += diff_csv_trees(f"{what}/{run_name}", ref / what / run_name, tp / what / run_name)
    for what in ("cnn", "gru", "tied"):
        diffs += diff_csv_trees(f"{what}/v2", ref / what / "v2", tp / what / "v2")
    struct = Path("module_struct") / "rank0" / "module_struct.json"
    diffs += diff_module_struct(
        "tied/v1-struct/module_struct.json", ref / "tied" / "v1-struct" / struct, tp / "tied" / "v1-struct" / struct
    )
    diffs += diff_run_folder_clock("v1", ref / "cnn" / "v1", tp / "cnn" / "v1")
    for what in ("dump-scope", "dump-list"):
        diffs += diff_dumps(what, ref / what / what, tp / what / what)
    return diffs + diff_families(out)


def diff_families(out: Path) -> list[Diff]:
    """What the two packages wrote for the families' runs: V1 (its tables and ``anomaly.json``),
    V2, and the four dumps."""
    ref, tp = out / "ref", out / "tp"
    diffs: list[Diff] = []
    for family in FAMILIES:
        for run_name in ("v1", "v2"):
            diffs += diff_csv_trees(f"{family}/{run_name}", ref / family / run_name, tp / family / run_name)
        a, b = (side / family / "v1" / "anomaly_detected" / "rank0" / "anomaly.json" for side in (ref, tp))
        if a.exists() != b.exists():
            diffs.append(Diff(f"{family}/v1/anomaly.json: present in one only", f"reference {a.exists()}"))
        elif a.exists():
            diffs += diff_anomalies(f"{family}/v1/anomaly.json", a, b)
        for dump in FAMILY_DUMPS:
            what, name = f"{family}-dump-{dump}", f"dump-{dump}"
            diffs += diff_dumps(f"{family}/{name}", ref / what / name, tp / what / name)
    return diffs


def tb_tags(root: Path) -> set[str]:
    """Scalar tags of every event file under ``root``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags: set[str] = set()
    for path in root.rglob("events.out.tfevents*"):
        acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
        acc.Reload()
        tags.update(acc.Tags()["scalars"])
    return tags


def diff_outputs(out: Path) -> list[Diff]:
    """What the two packages wrote for the same scripts."""
    ref, tp = out / "ref", out / "tp"
    diffs = diff_csv_trees("v2", ref / "v2" / "v2", tp / "v2" / "v2")
    diffs += diff_csv_trees("v1", ref / "v1" / "v1", tp / "v1" / "v1")
    tags_a, tags_b = tb_tags(ref / "v1-tb" / "v1-tb"), tb_tags(tp / "v1-tb" / "v1-tb")
    if not tags_a and tags_b:
        diffs.append(
            Diff(
                "v1-tb: no event files from reference",
                f"format tensorboard wrote {len(list((ref / 'v1-tb').rglob('*.csv')))} CSV files instead",
            )
        )
    elif tags_a != tags_b:
        diffs.append(
            Diff(
                "v1-tb: tags",
                f"only reference {examples(tags_a - tags_b)}; only trainprobe {examples(tags_b - tags_a)}",
            )
        )
    for area in ("v1", "v1-tb"):
        a = ref / area / area / "anomaly_detected" / "rank0" / "anomaly.json"
        b = tp / area / area / "anomaly_detected" / "rank0" / "anomaly.json"
        if a.exists() != b.exists():
            diffs.append(Diff(f"{area}/anomaly.json: present in one only", f"reference {a.exists()}"))
        elif a.exists() and area == "v1":
            diffs += diff_anomalies(f"{area}/anomaly.json", a, b)
    for what in WHATS[4:]:
        diffs += diff_dumps(what, ref / what / what, tp / what / what)
    return diffs + diff_suite(out)


# ---------------------------------------------------------------- cross-tool runs


def tp_tool(*args: str) -> list[str]:
    return [sys.executable, "-m", "trainprobe", *args]


def ref_code(code: str, *args: str) -> list[str]:
    return [ref_python(), "-c", code, *args]


REF_CSV2TB = (
    "import sys; from msprobe.pytorch.monitor.csv2tb import csv2tensorboard_by_step as f; "
    "f(monitor_path=sys.argv[1], output_dirpath=sys.argv[2])"
)
REF_COMPARE = "import sys; from msprobe.msprobe import main; sys.argv[0] = 'msprobe'; sys.exit(main())"


def csv_row_count(root: Path) -> int:
    return sum(len(read_rows([p])[1]) for p in root.rglob("*.csv"))


def compare_pairs(out: Path) -> dict[str, tuple[Path, Path]]:
    """Name -> (target, golden) of every ``compare`` run (each by both tools): the reference's
    steps 1 vs 0 and trainprobe's step 0 against the reference's, of train.py's dumps and of
    each family's L1 and md5 dumps."""
    l1, tensor = out / "ref" / "dump-L1" / "dump-L1", out / "ref" / "dump-tensor" / "dump-tensor"
    tp_l1 = out / "tp" / "dump-L1" / "dump-L1"
    pairs = {
        "ref-ref": (l1 / "step1", l1 / "step0"),
        "ref-ref-tensor": (tensor / "step1", tensor / "step0"),
        "tp-ref": (tp_l1 / "step0", l1 / "step0"),
    }
    for family in FAMILIES:
        ref_l1, ref_md5, tp_md5 = (
            out / side / f"{family}-dump-{kind}" / f"dump-{kind}"
            for side, kind in (("ref", "L1"), ("ref", "md5"), ("tp", "md5"))
        )
        pairs[f"{family}-ref-ref"] = (ref_l1 / "step1", ref_l1 / "step0")
        pairs[f"{family}-md5-ref-ref"] = (ref_md5 / "step1", ref_md5 / "step0")
        pairs[f"{family}-md5-tp-ref"] = (tp_md5 / "step0", ref_md5 / "step0")
    return pairs


def cross_jobs(out: Path) -> dict[str, tuple[list[str], Path | None]]:
    """Name -> (command, cwd) of every cross-tool run."""
    v1, cross = out / "ref" / "v1" / "v1", out / "cross"
    anomalies = v1 / "anomaly_detected"
    pairs = compare_pairs(out)
    jobs: dict[str, tuple[list[str], Path | None]] = {
        "csv2db": (tp_tool("csv2db", str(v1), "-o", str(cross / "csv2db")), None),
        "csv2tb": (tp_tool("csv2tb", str(v1), "-o", str(cross / "csv2tb")), None),
        "ref-csv2tb": (ref_code(REF_CSV2TB, str(v1), str(cross / "ref-csv2tb")), None),
        "report": (tp_tool("report", str(out / "ref" / "v1" / "v1"), "-o", str(cross / "report.html")), None),
        "anomaly-analyse": (tp_tool("anomaly-analyse", "-d", str(anomalies), "-o", str(cross / "anomaly")), None),
        "ref-anomaly-analyse": (
            [
                ref_python(),
                "-m",
                "msprobe.core.monitor.anomaly_processor",
                "-d",
                str(anomalies),
                "-o",
                str(cross / "ref-anomaly"),
            ],
            None,
        ),
    }
    for name, (target, golden) in pairs.items():
        jobs[f"compare-{name}"] = (
            tp_tool("compare", "-tp", str(target), "-gp", str(golden), "-o", str(cross / f"compare-{name}")),
            None,
        )
        jobs[f"ref-compare-{name}"] = (
            ref_code(
                REF_COMPARE, "compare", "-tp", str(target), "-gp", str(golden), "-o", str(cross / f"ref-compare-{name}")
            ),
            None,
        )
    return jobs


def run_cross(out: Path) -> dict[str, int]:
    jobs = cross_jobs(out)
    (out / "cross").mkdir(parents=True, exist_ok=True)
    (out / "cross" / "ref-anomaly").mkdir(exist_ok=True)
    with ThreadPoolExecutor(JOBS) as pool:
        codes = pool.map(
            lambda item: run(item[1][0], out / "logs" / f"cross_{item[0]}.log", item[1][1] or out), jobs.items()
        )
        return dict(zip(jobs, codes, strict=True))


def compare_summary(folder: Path) -> tuple[list[str], int, int, Counter[str]]:
    """Header, row count, unmatched rows (no golden counterpart) and verdict counts of the compare table(s)."""
    header: list[str] = []
    rows: list[dict[str, str]] = []
    for path in sorted(folder.glob("*.csv")):
        h, r = read_rows([path])
        header, rows = header or h, rows + r
    unmatched = sum(r.get("Bench Name", "") in ("N/A", "") for r in rows)
    return header, len(rows), unmatched, Counter(r.get("Result", "?") for r in rows)


def diff_cross(out: Path, codes: dict[str, int]) -> list[Diff]:
    """Exit codes, nothing dropped, and the tools' results against the reference's own."""
    cross, diffs = out / "cross", []
    for name, code in codes.items():
        if code and name.startswith("ref-"):
            diffs.append(Diff(f"cross/{name}: reference exits {code}", f"see logs/cross_{name}.log"))
        elif code:
            last = (out / "logs" / f"cross_{name}.log").read_text().strip().splitlines()[-1:]
            diffs.append(Diff(f"cross/{name}: trainprobe exits {code}", last[0][:300] if last else ""))
    v1 = out / "ref" / "v1" / "v1"
    if codes["csv2db"] == 0:
        diffs += diff_csv2db(cross / "csv2db", csv_row_count(v1), out / "logs" / "cross_csv2db.log")
    if codes["csv2tb"] == 0 and codes["ref-csv2tb"] == 0:
        a, b = tb_tags(cross / "ref-csv2tb"), tb_tags(cross / "csv2tb")
        if a != b:
            diffs.append(
                Diff(
                    "cross/csv2tb: tags differ from the reference's csv2tensorboard_by_step",
                    f"only reference {len(a - b)}: {examples(a - b)}; only trainprobe {len(b - a)}: {examples(b - a)}",
                )
            )
    if codes["report"] == 0 and re.search(r"skip|warn", (out / "logs" / "cross_report.log").read_text(), re.I):
        diffs.append(
            Diff(
                "cross/report: warns on the reference's V1 tree",
                (out / "logs" / "cross_report.log").read_text().strip()[-300:],
            )
        )
    if codes["anomaly-analyse"] == 0:
        diffs += diff_anomaly_analyse(
            cross / "ref-anomaly" / "anomaly_analyse.json", cross / "anomaly" / "anomaly_analyse.json"
        )
    for name in compare_pairs(out):
        if codes[f"compare-{name}"] or codes[f"ref-compare-{name}"]:
            continue
        (ha, na, ua, va), (hb, nb, ub, vb) = (
            compare_summary(cross / f"ref-compare-{name}"),
            compare_summary(cross / f"compare-{name}"),
        )
        if ha != hb:
            diffs.append(
                Diff(
                    f"cross/compare-{name}: header",
                    f"only reference {sorted(set(ha) - set(hb))}; only trainprobe {sorted(set(hb) - set(ha))}",
                )
            )
        if na != nb:
            diffs.append(Diff(f"cross/compare-{name}: rows", f"reference {na}, trainprobe {nb}"))
        if ua != ub:
            diffs.append(
                Diff(f"cross/compare-{name}: unmatched rows", f"reference {ua} of {na}, trainprobe {ub} of {nb}")
            )
        if va != vb:
            diffs.append(Diff(f"cross/compare-{name}: verdicts", f"reference {dict(va)}, trainprobe {dict(vb)}"))
    return diffs


def diff_csv2db(folder: Path, csv_rows: int, log: Path) -> list[Diff]:
    dbs = list(folder.glob("*.db"))
    if not dbs:
        return [Diff("cross/csv2db: no database", str(folder))]
    with sqlite3.connect(dbs[0]) as db:
        (stored,) = db.execute("SELECT COUNT(*) FROM metric_values").fetchone()
    text = log.read_text()
    if "skipped" in text and not re.search(r"\b0 skipped", text):
        return [Diff("cross/csv2db: rows skipped", text.strip().splitlines()[-1][:300])]
    if stored != csv_rows:
        return [Diff("cross/csv2db: row count", f"{csv_rows} CSV rows, {stored} in the database")]
    return []


def diff_anomaly_analyse(ref: Path, tp: Path) -> list[Diff]:
    if not ref.exists() or not tp.exists():
        return [Diff("cross/anomaly-analyse: output missing", f"reference {ref.exists()}, trainprobe {tp.exists()}")]
    a, b = json.loads(ref.read_text()), json.loads(tp.read_text())
    if a != b:
        return [
            Diff(
                "cross/anomaly-analyse: anomaly_analyse.json differs from the reference's",
                f"reference {json.dumps(a)[:200]}; trainprobe {json.dumps(b)[:200]}",
            )
        ]
    return []


def collect(out: Path) -> list[Diff]:
    """Run everything into ``out``; every difference found, sorted by id."""
    diffs = train_all(out)
    diffs += diff_outputs(out)
    diffs += diff_cross(out, run_cross(out))
    return sorted({Diff(d.id, d.detail.replace(str(out), "OUT")) for d in diffs})
