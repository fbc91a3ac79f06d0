"""How trainprobe's modules import each other.

* Every module imports on its own (a fresh interpreter per batch, trainprobe's modules cleared
  before each one), so no module works only because another was imported first.
* No import cycles: the module-level imports between trainprobe's modules (``if TYPE_CHECKING``
  blocks aside) form an acyclic graph, and so do the imports inside functions, which may only
  defer a dependency, never point back up. A package's lazy exports (``trainprobe._lazy``) name
  their modules as strings and are not edges.
* ``import trainprobe``, the ``trainprobe`` command and the offline tools load no torch.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import trainprobe

SRC = Path(trainprobe.__file__).resolve().parent
HAS_MINDSPORE = importlib.util.find_spec("mindspore") is not None


@functools.lru_cache(maxsize=1)
def _mindspore_usable() -> bool:
    """Whether ``trainprobe.mindspore`` imports here: MindSpore installed and working with this
    NumPy (``make test`` installs MindSpore 2.10 into .venv, which runs NumPy 2: unusable there,
    usable in the .venv/ms overlay)."""
    if not HAS_MINDSPORE:
        return False
    done = subprocess.run([sys.executable, "-c", "import trainprobe.mindspore"], capture_output=True, timeout=300)
    return done.returncode == 0


TOOLS = (
    "trainprobe.tools",
    "trainprobe.tools.anomalies.analyser",
    "trainprobe.tools.anomalies.events",
    "trainprobe.tools.anomalies.order",
    "trainprobe.tools.anomalies.output",
    "trainprobe.tools.anomalies.read",
    "trainprobe.tools.exports.sqlite",
    "trainprobe.tools.exports.tensorboard",
    "trainprobe.tools.diagnosis.answer",
    "trainprobe.tools.diagnosis.cli",
    "trainprobe.tools.sql.diagnose",
    "trainprobe.tools.rundiff.answer",
    "trainprobe.tools.rundiff.cli",
    "trainprobe.tools.rundiff.html",
    "trainprobe.tools.rundiff.match",
    "trainprobe.tools.sql.diff",
    "trainprobe.tools.runs.layout",
    "trainprobe.tools.runs.rows",
    "trainprobe.tools.runs.options",
    "trainprobe.tools.query.layer",
    "trainprobe.tools.query.cli",
    "trainprobe.tools.query.convert",
    "trainprobe.tools.runs.files",
    "trainprobe.tools.engines.spark",
    "trainprobe.tools.sql.questions",
    "trainprobe.tools.reporting.report",
    "trainprobe.tools.reporting.cells",
    "trainprobe.tools.reporting.collect",
    "trainprobe.tools.reporting.data",
    "trainprobe.tools.reporting.digest",
    "trainprobe.tools.reporting.downsample",
    "trainprobe.tools.reporting.events",
    "trainprobe.tools.reporting.figures",
    "trainprobe.tools.reporting.groups",
    "trainprobe.tools.reporting.html",
    "trainprobe.tools.reporting.onsets",
    "trainprobe.tools.reporting.read",
    "trainprobe.tools.reporting.rows",
    "trainprobe.tools.reporting.run",
    "trainprobe.tools.reporting.types",
)
TORCH_FREE = ("trainprobe", "trainprobe.cli", "trainprobe.engine.layout", "trainprobe.dump.cli", *TOOLS)


def _modules() -> dict[str, Path]:
    """Every module of the package: dotted name → file."""
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _needs_mindspore(name: str) -> bool:
    return name == "trainprobe.mindspore" or name.startswith("trainprobe.mindspore.") or "mindspore" in name


def _start(code: str, *args: str, cwd: Path | None = None) -> subprocess.Popen[str]:
    """Start ``code`` in a fresh interpreter (this one's ``sys.path``)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd,
    )


def _wait(process: subprocess.Popen[str], timeout: float = 120) -> str:
    """The stdout of a process started by :func:`_start`, which must succeed."""
    try:
        out, err = process.communicate(timeout=timeout)
    finally:
        process.kill()
    assert process.returncode == 0, err[-4000:]
    return out


def _run(code: str, *args: str, cwd: Path | None = None, timeout: float = 120) -> str:
    """Run ``code`` in a fresh interpreter; its stdout."""
    return _wait(_start(code, *args, cwd=cwd), timeout)


# -- each module alone -----------------------------------------------------------------------

_IMPORT_EACH = """
import importlib, json, sys, traceback
failed = {}
for name in json.loads(sys.argv[1]):
    for loaded in [m for m in sys.modules if m == "trainprobe" or m.startswith("trainprobe.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except BaseException:
        failed[name] = traceback.format_exc(limit=-3)
print(json.dumps(failed))
"""


def test_every_module_imports_alone() -> None:
    usable = _mindspore_usable()
    names = [n for n in MODULES if n != "trainprobe.__main__" and (usable or not _needs_mindspore(n))]
    assert len(names) > 100
    # two interpreters at once: the integrations (importing lightning alone takes seconds) and the rest
    slow = [n for n in names if n.startswith("trainprobe.integrations.")]
    batches = [slow, [n for n in names if n not in slow]]
    running = [_start(_IMPORT_EACH, json.dumps(batch)) for batch in batches]
    failed = {}
    for process in running:
        failed.update(json.loads(_wait(process, timeout=300)))
    assert failed == {}, "\n".join(f"{name}:\n{trace}" for name, trace in failed.items())


def test_mindspore_package_without_mindspore_says_what_to_install() -> None:
    if _mindspore_usable():
        pytest.skip("checks the message where MindSpore is missing or unusable")
    out = _run("""
        try:
            import trainprobe.mindspore
        except ImportError as exc:
            print(exc)
        """)
    assert 'pip install "trainprobe[mindspore]"' in out


# -- no cycles -------------------------------------------------------------------------------


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(body: list[ast.stmt], deferred: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements run when the module is imported (``deferred``: also those inside
    functions and classes); ``if TYPE_CHECKING:`` blocks never run."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _imports(node.body, deferred)
            yield from _imports(node.orelse, deferred)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _imports(block, deferred)
        elif isinstance(node, (ast.With, ast.For, ast.While)):
            yield from _imports(node.body, deferred)
        elif deferred and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield from _imports(node.body, deferred)


def _targets(name: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The trainprobe modules an import statement names."""
    if isinstance(node, ast.Import):
        out = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = name.split(".") if is_package else name.split(".")[:-1]
            package = package[: len(package) - node.level + 1]
            base = ".".join([*package, base] if base else package)
        out = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    return [t for t in out if t == "trainprobe" or t.startswith("trainprobe.")]


def import_graph(deferred: bool) -> dict[str, set[str]]:
    """Module → the trainprobe modules its import runs (a module imported as ``a.b.c`` also
    runs the packages ``a`` and ``a.b``, unless they contain the importer: those ran first)."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        deps: set[str] = set()
        for node in _imports(ast.parse(path.read_text(encoding="utf-8")).body, deferred):
            for target in _targets(name, path.name == "__init__.py", node):
                parts = target.split(".")
                for i in range(1, len(parts) + 1):
                    step = ".".join(parts[:i])
                    if step in MODULES and name != step and not name.startswith(step + "."):
                        deps.add(step)
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (``[a, b, ..., a]``), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_sees_imports_and_parent_packages() -> None:
    graph = import_graph(deferred=False)
    assert "trainprobe.engine.layout" in graph["trainprobe.tools.runs.layout"]
    assert "trainprobe.engine.sinks" in graph["trainprobe.tools.anomalies.output"]  # via trainprobe.engine.sinks.files
    assert "trainprobe.engine.backend" not in graph["trainprobe.engine.probes.base"]  # TYPE_CHECKING only
    assert "trainprobe.engine.errors" in import_graph(deferred=True)["trainprobe.backends"]


def test_no_import_cycles_at_module_level() -> None:
    assert find_cycle(import_graph(deferred=False)) is None


def test_no_import_cycles_through_function_level_imports() -> None:
    """An import inside a function defers a dependency (an optional framework, a heavy module);
    it must not be the way back of a cycle (``probes.base`` importing the adapters that import
    the probes, as it once did)."""
    assert find_cycle(import_graph(deferred=True)) is None


# -- no torch where none is needed -----------------------------------------------------------


@pytest.mark.parametrize("module", TORCH_FREE)
def test_module_loads_no_torch(module: str) -> None:
    assert _run(f"import sys, {module}; print('torch' in sys.modules)").strip() == "False"


ENGINE = tuple(n for n in MODULES if n == "trainprobe.engine" or n.startswith("trainprobe.engine."))


def test_the_engine_loads_no_framework() -> None:
    """Every module of ``trainprobe.engine`` together loads neither torch nor MindSpore."""
    assert len(ENGINE) > 25
    loaded = _run(
        "import importlib, json, sys\n"
        "for name in json.loads(sys.argv[1]): importlib.import_module(name)\n"
        "print(sorted(m for m in ('torch', 'mindspore') if m in sys.modules))",
        json.dumps(ENGINE),
    )
    assert loaded.strip() == "[]"


@pytest.mark.parametrize("deferred", [False, True], ids=["module-level", "in-functions"])
def test_the_engine_imports_only_the_engine(deferred: bool) -> None:
    """The engine imports nothing of the backends, the front doors, the dump or the tools, not
    even inside a function: :func:`trainprobe.backends.backend_for` chooses a backend, outside."""
    graph = import_graph(deferred=deferred)
    outside = {
        (name, dep)
        for name in ENGINE
        for dep in graph[name]
        if dep.startswith("trainprobe.") and not dep.startswith("trainprobe.engine") and dep != "trainprobe._lazy"
    }
    assert outside == set()


ENGINE_THIRD_PARTY = {"numpy"}
"""The one third-party package the engine imports at module level (docs/architecture.md)."""
ENGINE_OPTIONAL = {"numpy", "tensorboard", "google_crc32c", "pyarrow"}
"""What it may import inside a function: the optional output formats' libraries (TensorBoard
event files and their C checksum, Parquet), each loaded only when that output is asked for."""


def _third_party(name: str, deferred: bool) -> set[str]:
    """The top-level packages outside the standard library and trainprobe that module ``name`` imports."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in _imports(tree.body, deferred):
        if isinstance(node, ast.ImportFrom) and node.level:
            continue
        for module in [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]:
            top = module.split(".")[0]
            if top not in sys.stdlib_module_names and top not in ("trainprobe", "__future__"):
                found.add(top)
    return found


def test_the_engine_imports_no_third_party_package_but_the_documented_ones() -> None:
    module_level = set().union(*(_third_party(n, deferred=False) for n in ENGINE))
    anywhere = set().union(*(_third_party(n, deferred=True) for n in ENGINE))
    assert module_level <= ENGINE_THIRD_PARTY, module_level - ENGINE_THIRD_PARTY
    assert anywhere <= ENGINE_OPTIONAL, anywhere - ENGINE_OPTIONAL
    assert "pyarrow" in anywhere  # the check sees imports inside functions


_CLI = """
import runpy, sys
sys.argv = ["trainprobe", *sys.argv[1:]]
try:
    runpy.run_module("trainprobe", run_name="__main__")
except SystemExit as exc:
    code = exc.code
print("exit", code, "torch", "torch" in sys.modules)
"""


def test_help_loads_no_torch() -> None:
    assert _run(_CLI, "--help").splitlines()[-1] == "exit 0 torch False"


def test_top_level_names_are_the_modules_objects() -> None:
    from trainprobe.dump.debugger import PrecisionDebugger
    from trainprobe.frontdoors.monitor_v1.trainer import TrainerMon
    from trainprobe.frontdoors.monitor_v2.trainer import TrainerMonitorV2

    assert trainprobe.TrainerMonitorV2 is TrainerMonitorV2
    assert trainprobe.TrainerMon is TrainerMon
    assert trainprobe.PrecisionDebugger is PrecisionDebugger
    assert set(trainprobe.__all__) <= set(dir(trainprobe))
    for name in trainprobe.__all__:
        assert getattr(trainprobe, name) is not None
    with pytest.raises(AttributeError, match="module 'trainprobe' has no attribute 'TrainerMonitorV3'"):
        trainprobe.TrainerMonitorV3  # noqa: B018


def test_compatibility_paths_still_import() -> None:
    out = _run("""
        from trainprobe import (ConfigError, PrecisionDebugger, TrainerMon, TrainerMonitorV2,
            TrainingMetricsMonitor, module_dump, module_dump_end, random_save, seed_all)
        from trainprobe.core.monitor_v2.trainer import TrainerMonitorV2 as V2
        from trainprobe.core.monitor.csv2db import CSV2DBConfig, csv2db
        from trainprobe.core.monitor.anomaly_processor import analyse
        from trainprobe.pytorch import TrainerMon as V1, PrecisionDebugger as PD, save
        from trainprobe.pytorch.monitor.module_hook import TrainerMon as V1b
        from trainprobe.pytorch.monitor.csv2tb import csv2tensorboard_by_step
        from trainprobe.pytorch.precision_debugger import PrecisionDebugger as PD2
        from trainprobe.frontdoors.monitor_v2 import MonitorV2Config, load_monitor_v2_config
        from trainprobe.frontdoors.metrics import TrainingMetricsConfig, load_training_metrics_config
        from trainprobe.engine.sinks import CsvSink, TableLayout, Writer
        from trainprobe.engine.stats import ALL_OPS, parse_ops
        from trainprobe.tools import analyse as a2, csv2tensorboard_by_step as c2, write_report
        assert V2 is TrainerMonitorV2 and V1 is TrainerMon is V1b and PD is PrecisionDebugger is PD2
        print("ok")
        """)
    assert out.strip() == "ok"


def test_tools_on_real_output_load_no_torch(monitor_runs, tmp_path: Path) -> None:
    """Each tool run on what the monitors wrote (two ranks, V1 and V2) imports no torch."""
    runs = [
        ["csv2db", str(monitor_runs.v1), "-o", str(tmp_path / "db1")],
        ["csv2db", str(monitor_runs.v2), "-o", str(tmp_path / "db2")],
        ["csv2tb", str(monitor_runs.v1), "-o", str(tmp_path / "tb1")],
        ["report", str(monitor_runs.v1), "-o", str(tmp_path / "report.html")],
        ["anomaly-analyse", "-d", str(monitor_runs.v1 / "anomaly_detected"), "-o", str(tmp_path / "an")],
    ]
    for args in runs:
        assert _run(_CLI, *args).splitlines()[-1] == "exit 0 torch False", args
    assert (tmp_path / "report.html").is_file() and list((tmp_path / "tb1").rglob("events.out.tfevents.*"))
