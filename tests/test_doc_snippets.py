"""Every ```python block of README.md and docs/*.md runs as written.

Each block runs in a fresh folder (a subprocess, ``cwd`` = that folder, trainprobe from this
checkout), after the config files its page defines are written there: a ```json/```yaml block is
the file ``NAME`` when the line before it (blank lines skipped) is ``<!-- snippet: file NAME -->``
or starts with the backticked name (```config.json`:``). A block that cannot run here is marked
on the line before it with ``<!-- snippet: skip (why) -->``; :data:`SKIPPED` lists them, so a
new skip (or a marker lost in an edit) fails :func:`test_every_block_runs_or_is_listed_as_skipped`.
A page may need files made by a run first: ``<!-- snippet: setup NAME -->`` runs the setup
script :data:`SETUPS` names in the same folder before the block.

The setups run once each, then the blocks in parallel, each in a copy of its setup's folder (a
module-scoped fixture); each test then checks one block's result.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TIMEOUT_S = 240
WORKERS = 3

SKIPPED: dict[str, int] = {
    "docs/diagnose.md": 1,  # --engine spark with the user's own SparkSession: the [spark] extra and Java
    "docs/diff.md": 1,  # two runs to compare: the tests of tests/test_tool_diff.py train them
    "docs/mindspore.md": 2,  # needs MindSpore
    "docs/parallelism.md": 4,  # sharded runs (tests/test_sharded_full_tensors.py, test_live_global_stats.py, test_anomaly_full_tensors.py) and a pipeline (test_pipeline_monitor.py), on gloo
    "docs/monitor_v1.md": 1,  # tensor parallelism: needs two ranks (tests/test_v1_tp.py trains it on gloo)
    "docs/monitor_v2.md": 1,  # the cc step boundary: needs a process group
    "docs/steps.md": 1,  # the same, as a loop
    "docs/precision_dump.md": 2,  # two files of one program; a user's own module_a
    "docs/query.md": 1,  # Spark: needs a SparkSession (the [spark] extra and Java)
    "docs/training_metrics.md": 2,  # Hugging Face Trainer and Lightning (two blocks): a model and data to download
}
"""How many blocks of each page are marked ``skip`` (every other page: none)."""

_V1_RUN = """
import json, math, os, shutil, torch
from pathlib import Path
from torch import nn
from trainprobe import TrainerMon


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


os.environ["MONITOR_OUTPUT_DIR"] = "monitor_output"
cfg = {"targets": {}, "wg_distribution": True, "param_distribution": True, "format": "csv",
       "ops": ["min", "max", "norm", "nans"],
       "alert": {"rules": [{"rule_name": "AnomalyNan"}], "dump": True}}
Path("v1_setup.json").write_text(json.dumps(cfg))
torch.manual_seed(0)
model = MLP()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
mon = TrainerMon("v1_setup.json", params_have_main_grad=False)
mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
for step in range(5):
    model(torch.randn(4, 6)).square().mean().backward()
    if step >= 2:
        model.fc2.bias.grad[0] = math.nan
    opt.step()
    opt.zero_grad()
mon.stop()
# the docs' examples: two ranks, written at Dec03_21-34-41
(run,) = [p for p in Path("monitor_output").iterdir() if "-rank0-" in p.name]
rest = run.name.split("-rank0-")[1]
run.rename(run.with_name(f"Dec03_21-34-41-rank0-{rest}"))
shutil.copytree(run.with_name(f"Dec03_21-34-41-rank0-{rest}"), run.with_name(f"Dec03_21-34-41-rank1-{rest}"))
"""

_TB = """
from trainprobe.tools import csv2tensorboard_by_step
csv2tensorboard_by_step("monitor_output", None, None, process_num=1, data_type_list=["grad_reduced"], output_dirpath="./tb")
"""

_METRICS_RUN = """
import torch
from torch import nn
from trainprobe import TrainingMetricsMonitor

config = {"monitor_config": {"monitor_on": True, "dump_path": "./dump", "local_loss_format": ["tensorboard"]},
          "tensorboard": {"tensorboard_dir": "worker/tensorboard"}}
model = nn.Linear(6, 3)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
mon = TrainingMetricsMonitor(config, model=model, optimizer=opt)
for step in range(5):
    loss = model(torch.randn(4, 6)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    mon.step(loss=loss)
mon.close()
"""

_DB = """
from trainprobe.tools.exports.sqlite import CSV2DBConfig, csv2db
csv2db(CSV2DBConfig(monitor_path="monitor_output", process_num=1, data_type_list=["grad_reduced"], output_dirpath="."))
"""

SETUPS: dict[str, str] = {"v1-run": _V1_RUN, "tb": _TB, "metrics-run": _METRICS_RUN, "db": _DB}
"""Scripts a block may need run first (``<!-- snippet: setup NAME ... -->``, in that order):
``v1-run`` leaves a Monitor V1 output in ``./monitor_output`` (and ``~``, HOME being the
block's folder): runs of ranks 0 and 1 made at ``Dec03_21-34-41`` with ``grad_reduced``,
``grad_unreduced``, ``param_origin`` CSVs of an MLP (``fc1``, ``fc2``) whose gradients are NaN
from step 2, and ``anomaly_detected/``; ``tb`` converts its ``grad_reduced`` to ``./tb``;
``db`` converts its ``grad_reduced`` to ``./monitor_metrics.db``; ``metrics-run`` leaves a training-metrics output (``./dump``, ``worker/tensorboard``)."""

_MARK = re.compile(r"<!--\s*snippet:\s*(skip|file|setup)\b\s*(.*?)\s*-->")
_NAMED = re.compile(r"^`([\w.-]+\.(?:json|ya?ml))`")


@dataclass
class Snippet:
    """One ```python block: where it is, its code, why it is skipped, what it needs."""

    page: str
    line: int
    code: str
    skip: str | None = None
    setup: str | None = None
    files: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def _blocks(text: str) -> Iterator[tuple[int, str, str, str]]:
    """``(line, language, code, the non-blank line before it)`` of each fenced block."""
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        if lines[i].startswith("```") and len(lines[i]) > 3:
            lang = lines[i][3:].strip()
            end = i + 1
            while end < len(lines) and not lines[end].startswith("```"):
                end += 1
            before = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
            yield i + 1, lang, "\n".join(lines[i + 1 : end]) + "\n", before
            i = end
        elif lines[i].startswith("```"):  # an unlabelled block: skip to its end
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                i += 1
        i += 1


def _snippets() -> list[Snippet]:
    found = []
    for page in PAGES:
        rel = page.relative_to(ROOT).as_posix()
        files: dict[str, str] = {}
        mine = []
        for line, lang, code, before in _blocks(page.read_text(encoding="utf-8")):
            mark = _MARK.search(before)
            if lang in ("json", "yaml", "yml"):
                named = _NAMED.match(before.strip())
                if mark is not None and mark.group(1) == "file":
                    files[mark.group(2)] = code
                elif named is not None:
                    files.setdefault(named.group(1), code)
            elif lang == "python":
                snippet = Snippet(rel, line, code)
                if mark is not None and mark.group(1) == "skip":
                    snippet.skip = mark.group(2) or "?"
                elif mark is not None and mark.group(1) == "setup":
                    snippet.setup = mark.group(2)
                mine.append(snippet)
        for snippet in mine:
            snippet.files = dict(files)
        found.extend(mine)
    return found


SNIPPETS = _snippets()
RUNNABLE = [s for s in SNIPPETS if s.skip is None]


def _env(folder: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        "HOME": str(folder),  # "~/monitor_output" in a block is the folder's
        "TRAINPROBE_FUSED_STATS": "off",
    }


def _python(folder: Path, name: str, code: str) -> tuple[int, str]:
    """Run ``code`` as ``folder/name``: exit status and output."""
    (folder / name).write_text(code, encoding="utf-8")
    try:
        done = subprocess.run(
            [sys.executable, name], cwd=folder, env=_env(folder), capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return 124, f"{name}: timed out after {TIMEOUT_S} s"
    return done.returncode, done.stdout + done.stderr


def _prepare(root: Path, chains: set[str]) -> dict[str, tuple[Path, int, str]]:
    """Run each setup chain once (its prefixes shared): chain -> (folder, status, output)."""
    made: dict[str, tuple[Path, int, str]] = {"": (root / "empty", 0, "")}
    (root / "empty").mkdir()
    for chain in sorted(chains, key=lambda c: len(c.split())):
        names = chain.split()
        for i in range(1, len(names) + 1):
            key = " ".join(names[:i])
            if key in made:
                continue
            base, status, output = made[" ".join(names[: i - 1])]
            folder = root / f"setup{len(made)}"
            shutil.copytree(base, folder)
            if status == 0:
                status, output = _python(folder, f"setup_{names[i - 1]}.py", SETUPS[names[i - 1]])
            made[key] = (folder, status, output)
    return made


def _run(snippet: Snippet, folder: Path, base: tuple[Path, int, str]) -> tuple[int, str, float]:
    """Run ``snippet`` in ``folder`` (a copy of the prepared ``base``): status, output, seconds."""
    started = time.perf_counter()
    if base[1] != 0:
        return base[1], f"setup {snippet.setup} failed:\n{base[2]}", 0.0
    shutil.copytree(base[0], folder)
    for name, text in snippet.files.items():
        (folder / name).write_text(text, encoding="utf-8")
    status, output = _python(folder, "snippet.py", snippet.code)
    return status, output, time.perf_counter() - started


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, float]]:
    """Every runnable block's result: the setups first (once each), then the blocks in parallel."""
    root = tmp_path_factory.mktemp("snippets")
    started = time.perf_counter()
    bases = _prepare(root, {s.setup or "" for s in RUNNABLE})
    with ThreadPoolExecutor(WORKERS) as pool:
        futures = {
            s.id: pool.submit(_run, s, root / f"block{i:02d}", bases[s.setup or ""]) for i, s in enumerate(RUNNABLE)
        }
        done = {key: f.result() for key, f in futures.items()}
    slowest = sorted(done.items(), key=lambda kv: -kv[1][2])[:3]
    print(f"\n{len(done)} doc snippets in {time.perf_counter() - started:.1f} s; slowest:", end=" ")
    print(", ".join(f"{key} {r[2]:.1f} s" for key, r in slowest))
    return done


def test_every_block_runs_or_is_listed_as_skipped() -> None:
    skipped: dict[str, int] = {}
    for s in SNIPPETS:
        if s.skip is not None:
            assert s.skip.startswith("(") and s.skip.endswith(")") and len(s.skip) > 2, f"{s.id}: say why"
            skipped[s.page] = skipped.get(s.page, 0) + 1
    assert skipped == SKIPPED
    assert len(SNIPPETS) == len(RUNNABLE) + sum(SKIPPED.values())
    assert len(RUNNABLE) >= 18
    assert all(name in SETUPS for s in RUNNABLE for name in (s.setup or "").split())


@pytest.mark.parametrize("snippet", RUNNABLE, ids=[s.id for s in RUNNABLE])
def test_snippet_runs(snippet: Snippet, results: dict[str, tuple[int, str, float]]) -> None:
    code, output, _ = results[snippet.id]
    assert code == 0, f"{snippet.id} failed:\n{output[-3000:]}"
