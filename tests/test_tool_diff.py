"""``trainprobe diff`` on real trainings of the demo GPT (tests/diff_runs.py): reruns, a perturbed
weight, bf16 autocast, renamed and shifted runs, Parquet, the output files and bad input."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("duckdb")

from diff_runs import SCALED, resumed_copy, train  # noqa: E402
from reference_layouts import write_reference_v1  # noqa: E402
from trainprobe.cli import main  # noqa: E402
from trainprobe.engine.errors import ConfigError  # noqa: E402
from trainprobe.tools.rundiff.answer import diff  # noqa: E402
from trainprobe.tools.rundiff.cli import parse_steps  # noqa: E402

SRC = Path(__file__).resolve().parent.parent / "src"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Four trainings, 8 steps each: ``base``, ``same`` (same seed), ``scaled`` (SCALED x1.001 after
    step 5), ``bf16`` (bf16 autocast)."""
    root = tmp_path_factory.mktemp("diff_runs")
    return {
        "base": train(root / "base"),
        "same": train(root / "same"),
        "scaled": train(root / "scaled", scale_after=5),
        "bf16": train(root / "bf16", bf16=True),
    }


def rewrite(src: Path, dst: Path, step_shift: int = 0, rename: tuple[str, str] | None = None) -> Path:
    """A copy of the V2 run ``src`` with every step moved by ``step_shift`` (rows below 0 dropped) and
    ``module_name`` prefixed/renamed (``rename``: old part, new part)."""
    for path in sorted(src.glob("rank_*/*.csv")):
        with path.open(newline="") as fh:
            rows = list(csv.reader(fh))
        header, body = rows[0], rows[1:]
        step, name = header.index("step"), header.index("module_name")
        out_rows = []
        for row in body:
            row = list(row)
            row[step] = str(int(row[step]) + step_shift)
            if int(row[step]) < 0:
                continue
            if rename is not None:
                row[name] = row[name].replace(*rename) if rename[0] else rename[1] + row[name]
            out_rows.append(row)
        target = dst / path.parent.name / path.name
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("w", newline="") as fh:
            csv.writer(fh, lineterminator="\n").writerows([header, *out_rows])
    return dst


def test_same_seed_is_bit_equal_and_the_command_exits_0(runs, capsys):
    result = diff(runs["base"], runs["same"], exact=True)
    assert result.exit_code == 0 and result.first is None
    assert result.counts["compared"] == result.counts["equal"] > 1000
    assert result.counts["only_baseline"] == result.counts["only_candidate"] == 0
    assert main(["diff", str(runs["base"]), str(runs["same"]), "--exact"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"no divergence: {result.counts['compared']:,} matched rows, all bit-equal"


def test_a_weight_scaled_after_step_5_diverges_at_step_6_on_that_tensor(runs, capsys):
    # scaled once step 5 is over (after its optimizer step, whose param_updated row was already
    # written): the first row that can differ is step 6's, and the first one in execution order
    # is its module's forward output (the weight's param_origin row is in the optimizer phase, at
    # the end of step 6: first only when the param table alone is compared), as docs/diff.md shows
    result = diff(runs["base"], runs["scaled"], exact=True)
    assert result.exit_code == 1
    assert result.first is not None and result.first.step == 6
    assert (result.first.table, result.first.scope, result.first.name) == (
        "module", "forward", SCALED.rsplit(".", 1)[0] + ".output.0"), result.first
    param = diff(runs["base"], runs["scaled"], exact=True, tables=["param"]).first
    assert param is not None and (param.step, param.scope, param.name) == (6, "param_origin", SCALED), param
    assert diff(runs["base"], runs["scaled"], exact=True, steps=(0, 5)).exit_code == 0
    default = diff(runs["base"], runs["scaled"])  # 1.001 is a 1e-3 change: the default rtol flags its effects
    assert default.first is not None and default.first.step >= 6
    assert main(["diff", str(runs["base"]), str(runs["scaled"]), "--exact"]) == 1
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith("first divergence: step 6, ") and SCALED.rsplit(".", 1)[0] in line


def test_bf16_autocast_diverges_at_step_0_at_the_first_bf16_matmul(runs, tmp_path):
    result = diff(runs["base"], runs["bf16"], out=tmp_path / "out")
    assert result.exit_code == 1
    first = result.first
    assert first is not None and (first.step, first.table, first.scope) == (0, "module", "forward")
    # embeddings and LayerNorm stay fp32 under autocast: the first bf16 op is the qkv projection
    assert first.name == "layers.0.attn.qkv.output.0"
    assert [d.step for d in result.divergences] == sorted(d.step for d in result.divergences)
    # the "largest" table: one row per tensor, by the factor of its norm (it used to rank by the
    # relative difference, which saturates near 1 and listed a parameter twice, as param_updated at s
    # and param_origin at s+1)
    assert result.largest and all(d.op == "norm" for d in result.largest)
    factors = [d.factor for d in result.largest]
    assert factors == sorted(factors, reverse=True) and all(f is not None and f > 1 for f in factors)  # type: ignore[operator]
    assert len({tensor_of(d.table, d.name) for d in result.largest}) == len(result.largest)
    with (tmp_path / "out" / "diff.csv").open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == result.counts["diverged"]
    assert (rows[0]["step"], rows[0]["name"], rows[0]["worst_op"]) == ("0", first.name, first.op)
    assert float(rows[0][f"{first.op}_rel_diff"]) == pytest.approx(first.rel_diff)
    assert [int(r["step"]) for r in rows] == sorted(int(r["step"]) for r in rows)
    summary = json.loads((tmp_path / "out" / "diff_summary.json").read_text())
    assert summary["schema"] == 2 and summary["answer"] == result.answer() and summary["exit_code"] == 1
    assert summary["counts"] == result.counts and summary["first"]["name"] == first.name


def test_rtol_decides_and_exact_rejects_within_tolerance_rows(runs):
    loose = diff(runs["base"], runs["bf16"], rtol=10.0)
    assert loose.exit_code == 0 and loose.counts["within_tolerance"] > 0
    assert diff(runs["base"], runs["bf16"], ops=["nans"]).exit_code == 0  # no NaN in either
    with pytest.raises(ConfigError, match="--ops: \\['nrom'\\] in no table"):
        diff(runs["base"], runs["same"], ops=["nrom"])
    with pytest.raises(ConfigError, match="--rtol: must be a finite number"):
        diff(runs["base"], runs["same"], rtol=-1)


def test_wrapper_prefixes_are_normalised_and_a_map_renames(runs, tmp_path):
    wrapped = rewrite(runs["base"], tmp_path / "wrapped", rename=("", "module._orig_mod."))
    assert diff(runs["base"], wrapped, exact=True).exit_code == 0
    renamed = rewrite(runs["base"], tmp_path / "renamed", rename=("layers.", "blocks."))
    mapping = tmp_path / "names.yaml"
    mapping.write_text("# blocks.<i> in the candidate is layers.<i> in the baseline\n'^blocks\\.': 'layers.'\n")
    assert diff(runs["base"], renamed, exact=True, mapping=mapping).exit_code == 0
    without = diff(runs["base"], renamed, exact=True)
    assert without.counts["only_baseline"] == without.counts["only_candidate"] > 0
    assert without.only_candidate[0].name.startswith("blocks.")
    (tmp_path / "bad.json").write_text('[["(unclosed", "x"]]')
    with pytest.raises(ConfigError, match="--map: pattern '\\(unclosed'"):
        diff(runs["base"], renamed, mapping=tmp_path / "bad.json")


def test_offset_aligns_a_shifted_run(runs, tmp_path):
    shifted = rewrite(runs["base"], tmp_path / "shifted", step_shift=-2)  # its step 0 is the baseline's 2
    result = diff(runs["base"], shifted, exact=True, offset=2)
    assert result.exit_code == 0 and result.counts["only_candidate"] == 0
    assert {r.step for r in result.only_baseline} == {0}  # the earliest examples; steps 0-1 are missing
    assert result.counts["only_baseline"] == 2 * result.counts["compared"] // 6
    assert diff(runs["base"], shifted, exact=True).exit_code == 1


def test_csv_against_parquet_of_the_same_run_is_bit_equal(runs, tmp_path):
    from trainprobe.tools.query.convert import convert_run

    parquet = tmp_path / "parquet"
    shutil.copytree(runs["base"], parquet)
    convert_run(parquet, remove_csv=True)
    assert not list(parquet.rglob("*.csv"))
    assert diff(runs["base"], parquet, exact=True).exit_code == 0


def test_a_torn_last_line_is_a_row_in_one_run_only_not_a_crash(runs, tmp_path):
    torn = tmp_path / "torn"
    shutil.copytree(runs["base"], torn)
    path = torn / "rank_0" / "param_step4-7.csv"
    path.write_bytes(path.read_bytes()[:-7])  # the last record cut mid-way
    result = diff(runs["base"], torn, exact=True)
    assert result.exit_code == 0 and result.counts["only_baseline"] == 1
    assert result.only_baseline[0].step == 7


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("empty", "run: no monitor data file"),
        ("dump", "is a precision dump folder, not monitor output: compare dumps with `trainprobe compare`"),
        ("unrelated", "run: no monitor data file"),
        ("v1", "the runs are of different kinds"),
        ("nothing_in_common", "the runs have no row in common"),
        ("missing", "not a folder"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(runs, tmp_path, case, message):
    candidate = tmp_path / case
    if case == "empty":
        candidate.mkdir()
    elif case == "dump":
        (candidate / "step0" / "rank0").mkdir(parents=True)
        (candidate / "step0" / "rank0" / "dump.json").write_text('{"task": "statistics", "data": {}}')
    elif case == "unrelated":
        candidate.mkdir()
        (candidate / "losses.csv").write_text("step,loss\n0,1.5\n")
        (candidate / "rank_0").mkdir()
        (candidate / "rank_0" / "metrics.csv").write_text("a,b\n1,2\n")
    elif case == "v1":
        write_reference_v1(candidate)
    elif case == "nothing_in_common":
        rewrite(runs["base"], candidate, rename=("", "other."))
    proc = subprocess.run(
        [sys.executable, "-m", "trainprobe", "diff", str(runs["base"]), str(candidate)],
        capture_output=True, text=True, env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"}, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainprobe diff: error: ") and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_steps_option_parses_ranges():
    assert parse_steps("0:1000") == (0, 1000)
    assert parse_steps("5") == (5, 5)
    assert parse_steps(":3") == (0, 3)
    assert parse_steps("7:")[0] == 7  # type: ignore[index]
    with pytest.raises(ConfigError, match="--steps: 'a:b' is not A:B"):
        parse_steps("a:b")
    with pytest.raises(ConfigError, match="--steps: the first step 5 is after the last 2"):
        diff(".", ".", steps=(5, 2))


def test_help_does_not_import_duckdb():
    code = "import sys; from trainprobe.cli import build_parser; build_parser(); print('duckdb' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"}, timeout=60)
    assert proc.stdout.strip() == "False", proc.stderr


def test_html_page_marks_the_first_divergence(runs, tmp_path):
    page = tmp_path / "diff.html"
    result = diff(runs["base"], runs["scaled"], exact=True, html=page)
    text = page.read_text()
    from test_tool_report import DomFacts

    facts = DomFacts()
    facts.feed(text)
    assert facts.external == [] and len(text) > 1_000_000  # self-contained: Plotly's JavaScript inlined
    assert text.count('class="plotly-graph-div"') == len(result.ops)  # one heatmap per table
    first = result.first
    assert first is not None and first.step == 6 and first.name.startswith(SCALED.rsplit(".", 1)[0])
    label = first.name if first.scope == first.table else f"{first.scope} {first.name}"
    assert f'"x":["{first.step}"],"y":["{label}"]' in text  # the first divergence is ringed
    assert html_escape(result.answer()) in text


def html_escape(text: str) -> str:
    import html

    return html.escape(text)


@pytest.mark.skipif(not Path("/usr/bin/chromium").exists(), reason="needs Debian's chromium (apt-get install -y chromium)")
def test_html_page_renders_in_chromium(runs, tmp_path):
    from test_tool_report import assert_page_ok, render

    page = diff(runs["base"], runs["bf16"], html=tmp_path / "diff.html")
    assert page.exit_code == 1
    assert_page_ok(render(tmp_path / "diff.html", tmp_path / "chromium", height=2000))


def test_a_key_twice_in_a_run_pairs_first_with_first(runs, tmp_path):
    # a module called twice in a step writes two rows with one key: the second call's row of the
    # candidate differs; it must be compared with the baseline's second row, not with both
    def twice(dst: Path, change: bool) -> Path:
        shutil.copytree(runs["base"], dst)
        path = dst / "rank_0" / "param_step0-3.csv"
        lines = path.read_text().splitlines()
        extra = lines[1].split(",")
        if change:
            extra[-2] = str(float(extra[-2]) * 2)  # norm
        path.write_text("\n".join([*lines[:2], ",".join(extra), *lines[2:]]) + "\n")
        return dst

    result = diff(twice(tmp_path / "b", False), twice(tmp_path / "c", True), exact=True)
    assert result.counts["diverged"] == 1 and result.counts["only_baseline"] == result.counts["only_candidate"] == 0
    assert result.first is not None and result.first.op == "norm" and result.first.step == 0


def test_a_key_repeated_across_files_pairs_file_order_whatever_the_folders_are_called(runs, tmp_path):
    # a resumed run writes steps 2-3 again in a file of its own, with other values: the baseline
    # and the candidate are the same run in two folders, so nothing may diverge. Pairing used to
    # follow the hash of each file's full path, which differs between the folders: the candidate
    # folder is chosen so that the two paths' hashes order the other way round in it
    import duckdb

    def hash_order(run: Path) -> bool:
        paths = [str(run / "rank_0" / name) for name in ("param_step0-3.csv", "param_step2-3.csv")]
        first, second = duckdb.connect().execute("SELECT hash(?), hash(?)", paths).fetchone()
        return bool(first < second)

    baseline = resumed_copy(runs["base"], tmp_path / "b")
    name = next(n for n in (f"c{i}" for i in range(64)) if hash_order(tmp_path / n) != hash_order(baseline))
    candidate = resumed_copy(runs["base"], tmp_path / name)
    result = diff(baseline, candidate, exact=True)
    assert result.counts["diverged"] == result.counts["only_baseline"] == result.counts["only_candidate"] == 0
    assert result.counts["equal"] > 0 and result.first is None


SUMMARY_KEYS = {
    "schema", "answer", "diverged", "exit_code", "baseline", "candidate", "settings", "first", "counts", "tables",
    "ops", "micro_step_matched", "divergences", "largest", "only_baseline", "only_candidate", "tables_only", "notes",
}
ROW_KEYS = {
    "table", "step", "micro_step", "rank", "vpp_stage", "name", "scope", "op", "baseline", "candidate", "rel_diff",
    "candidate_name", "tolerance", "factor",
}


def tensor_of(table: str, name: str) -> tuple[str, str]:
    """The tensor a row summarises, as the "largest" table counts them: a parameter before and after
    the step is one, and so is its gradient unreduced and reduced."""
    kinds = {"param": "param", "param_origin": "param", "param_updated": "param",
             "weight_grad": "grad", "grad_unreduced": "grad", "grad_reduced": "grad"}
    return kinds.get(table, table), name
COUNT_KEYS = ["equal", "within_tolerance", "diverged", "only_baseline", "only_candidate"]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m trainprobe diff ARGS`` in a fresh process."""
    return subprocess.run(
        [sys.executable, "-m", "trainprobe", "diff", *args],
        capture_output=True, text=True, env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"}, timeout=120,
    )


def csv_rows(folder: Path, table: str) -> int:
    """Data rows of ``table``'s CSV files in ``folder/rank_0``."""
    return sum(len(p.read_text().splitlines()) - 1 for p in (folder / "rank_0").glob(f"{table}_step*.csv"))


def test_cli_tables_limit_and_every_summary_field(runs, tmp_path):
    """``--tables param,weight_grad --limit 2 --exact --steps 0:7 --out``: against a candidate
    (weight scaled after step 5) without its optimizer files and with the last param row lost,
    every documented key of diff_summary.json holds what docs/diff.md says."""
    cand = tmp_path / "cand"
    shutil.copytree(runs["scaled"], cand)
    for path in (cand / "rank_0").glob("optimizer_*.csv"):
        path.unlink()
    last_param = cand / "rank_0" / "param_step4-7.csv"
    lines = last_param.read_text().splitlines()
    lost = lines[-1].split(",")  # vpp_stage, step, module_name, scope, ...
    last_param.write_text("\n".join(lines[:-1]) + "\n")
    full = json.loads(json.dumps(diff(runs["base"], runs["scaled"], exact=True).summary()))

    proc = cli(str(runs["base"]), str(cand), "--exact", "--tables", "param,weight_grad", "--limit", "2",
               "--steps", "0:7", "--out", str(tmp_path / "out"))
    assert proc.returncode == 1, proc.stderr
    s = json.loads((tmp_path / "out" / "diff_summary.json").read_text())
    assert set(s) == SUMMARY_KEYS
    assert s["schema"] == 2 and s["diverged"] is True and s["exit_code"] == 1
    assert s["baseline"] == str(runs["base"]) and s["candidate"] == str(cand)
    assert s["settings"] == {"rtol": 1e-3, "exact": True, "offset": 0, "steps": [0, 7], "dtype": "float32",
                             "dtype_source": "assumed", "tolerance": "bit-equal", "noise": None}
    first = s["first"]
    assert proc.stdout.splitlines()[0] == s["answer"]
    assert s["answer"].startswith("first divergence: step 6, ")
    assert f"{first['table']} {first['scope']} {first['name']} {first['op']} " in s["answer"]
    # only the tables asked for are compared; their counts are those of the full comparison
    assert set(s["tables"]) == set(s["ops"]) == set(s["micro_step_matched"]) == {"param", "weight_grad"}
    assert s["tables"]["weight_grad"] == full["tables"]["weight_grad"]
    assert s["ops"] == {t: ["min", "max", "mean", "norm", "nans"] for t in ("param", "weight_grad")}
    assert s["micro_step_matched"] == {"param": False, "weight_grad": True}
    param = s["tables"]["param"]
    assert param["only_baseline"] == 1 and param["only_candidate"] == 0
    assert sum(param[k] for k in COUNT_KEYS[:3]) == csv_rows(runs["base"], "param") - 1
    assert s["counts"] == {
        "compared": sum(s["tables"][t][k] for t in s["tables"] for k in COUNT_KEYS[:3]),
        **{k: sum(s["tables"][t][k] for t in s["tables"]) for k in COUNT_KEYS},
    }
    assert s["counts"]["compared"] + 1 == csv_rows(runs["base"], "param") + csv_rows(runs["base"], "weight_grad")
    # --limit 2: two divergences, the earliest, execution order; the first is the first of them
    assert len(s["divergences"]) == 2 and s["first"] == s["divergences"][0]
    assert all(set(r) == ROW_KEYS and r["table"] in ("param", "weight_grad") for r in s["divergences"])
    assert [r["step"] for r in s["divergences"]] == [6, 6]
    assert f"earliest divergences (2 of {s['counts']['diverged']:,}, execution order):" in proc.stdout
    assert 1 <= len(s["largest"]) <= 2
    assert len({tensor_of(r["table"], r["name"]) for r in s["largest"]}) == len(s["largest"])  # one per tensor
    # ranked by the factor of the norm: the top one is the full comparison's top among these tables
    assert s["largest"][0]["factor"] == max(
        r["factor"] for r in full["largest"] if r["table"] in ("param", "weight_grad"))
    # the row the candidate lost, in one run only: no op, no values
    assert s["only_candidate"] == []
    (only,) = s["only_baseline"]
    assert set(only) == ROW_KEYS
    assert (only["table"], only["step"], only["name"], only["scope"]) == ("param", int(lost[1]), lost[2], lost[3])
    assert only["op"] is None and only["baseline"] is None and only["candidate"] is None and only["rel_diff"] is None
    assert s["tables_only"] == {"baseline": ["optimizer"], "candidate": []}
    assert "tables only in baseline: optimizer" in proc.stdout
    with (tmp_path / "out" / "diff.csv").open(newline="") as fh:
        table_col = [row["table"] for row in csv.DictReader(fh)]
    assert len(table_col) == s["counts"]["diverged"] and set(table_col) == {"param", "weight_grad"}


def test_cli_limit_0_lists_none_but_still_answers_the_first_divergence(runs, tmp_path):
    """Before, ``--limit 0`` printed "no divergence" (and ``first`` null) with exit status 1."""
    proc = cli(str(runs["base"]), str(runs["scaled"]), "--exact", "--limit", "0", "--output", str(tmp_path))
    assert proc.returncode == 1, proc.stderr
    s = json.loads((tmp_path / "diff_summary.json").read_text())
    assert s["divergences"] == [] and s["largest"] == []
    assert s["first"] is not None and s["first"]["step"] == 6
    assert proc.stdout.splitlines()[0] == s["answer"] and s["answer"].startswith("first divergence: step 6, rank 0, ")
    assert "earliest divergences" not in proc.stdout
    assert cli(str(runs["base"]), str(runs["scaled"]), "--limit", "-1").returncode == 2
    # what it wrote is said, one line a file; nothing else is left in the folder (atomic writes)
    assert [line for line in proc.stderr.splitlines() if line.startswith("wrote ")] == [
        f"wrote {tmp_path / 'diff.csv'}", f"wrote {tmp_path / 'diff_summary.json'}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["diff.csv", "diff_summary.json"]


def test_cli_tables_naming_no_table_is_bad_input(runs):
    """Before: "the runs have no row in common", as if the runs were unrelated."""
    proc = cli(str(runs["base"]), str(runs["same"]), "--tables", "param,weightgrad")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == (
        "trainprobe diff: error: --tables: ['weightgrad'] in neither run (baseline tables: "
        "['module', 'optimizer', 'param', 'weight_grad'], candidate tables: ['module', 'optimizer', 'param', "
        "'weight_grad'])"
    )
    only = cli(str(runs["base"]), str(runs["same"]), "--exact", "--tables", "optimizer")
    assert only.returncode == 0, only.stderr
    assert only.stdout.splitlines()[0] == f"no divergence: {csv_rows(runs['base'], 'optimizer'):,} matched rows, all bit-equal"


def _v1_run(out: Path, nan_at: int | None) -> Path:
    """A single-process Monitor V1 run (activations and both gradient tables) of 3 steps; with
    ``nan_at``, ``fc1.weight`` holds a NaN from that step on (its forward output first)."""
    import json

    from trainprobe import TrainerMon

    out.mkdir(parents=True)
    config = {"targets": {}, "all_xy": True, "xy_distribution": True, "wg_distribution": True,
              "ops": ["min", "max", "norm", "nans"], "step_count_per_record": 3}
    (out / "config.json").write_text(json.dumps(config))
    old = os.environ.get("MONITOR_OUTPUT_DIR")
    os.environ["MONITOR_OUTPUT_DIR"] = str(out / "run")
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        mon = TrainerMon(str(out / "config.json"), params_have_main_grad=False)
        mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
        for step in range(3):
            if step == nan_at:
                with torch.no_grad():
                    model[0].weight[0, 0] = float("nan")
            model(torch.ones(3, 4) * (step + 1)).sum().backward()
            opt.step()
            opt.zero_grad()
        mon.stop()
    finally:
        if old is None:
            os.environ.pop("MONITOR_OUTPUT_DIR", None)
        else:
            os.environ["MONITOR_OUTPUT_DIR"] = old
    return out / "run"


def test_v1_diff_names_the_forward_row_before_the_gradients(tmp_path: Path) -> None:
    """V1's grad_unreduced has no micro_step column: it sorts with micro-step 0's backward, after
    that micro-step's forward (as diagnose orders it), not before the forward."""
    base = _v1_run(tmp_path / "base", None)
    cand = _v1_run(tmp_path / "cand", nan_at=1)
    result = diff(base, cand)
    assert result.first is not None and result.first.step == 1
    assert result.first.table == "actv", result.first.describe()
    assert result.first.name.startswith("0"), result.first.describe()  # model[0]'s output: the first forward row
