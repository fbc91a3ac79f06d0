"""``trainprobe diff``'s tolerance on real trainings of the demo GPT (tests/diff_variants.py, issue #34):
reruns that differ only by rounding pass the default, real changes are named at their first row,
``--noise`` measures a run's own rerun noise, the "largest" table has one row per tensor with a
factor that does not saturate, and unreduced gradients come in the order backward computes them."""

from __future__ import annotations

import csv
import json
import math
import re
import shutil
from pathlib import Path

import pytest

pytest.importorskip("duckdb")

from diff_variants import NAN_WEIGHT, SIZE, Variant, train  # noqa: E402
from test_tool_diff import _v1_run, cli, tensor_of  # noqa: E402
from trainprobe.cli import main  # noqa: E402
from trainprobe.engine.errors import ConfigError  # noqa: E402
from trainprobe.tools.rundiff.answer import diff  # noqa: E402
from trainprobe.tools.sql.diff import DTYPE_RTOL, NOISE_MARGIN, fmt_factor  # noqa: E402

STEPS = 10
MANUAL = Variant(attention="qs_k")
"""The baseline: attention written out as (q·s)kᵀ."""
FP32 = {
    "base": MANUAL,
    "refactor": Variant(attention="qk_s"),  # (qkᵀ)·s: the same maths, another rounding
    "threads": Variant(attention="qs_k", threads=1),
    "fused": Variant(attention="sdpa", adam="fused"),  # the fused attention and AdamW kernels
    "lr_bug": Variant(attention="qs_k", lr_bug_from=8),
    "ln_eps": Variant(attention="qs_k", ln_eps=1e-2),
    "spike": Variant(attention="qs_k", spike_at=5),
    "nan": Variant(attention="qs_k", nan_at=4),
}
BF16 = {
    "bf16": Variant(attention="qs_k", bf16=True),
    "bf16_rerun": Variant(attention="qk_s", bf16=True),
    "bf16_fused": Variant(attention="sdpa", adam="fused", bf16=True),
    "bf16_lr_bug": Variant(attention="qs_k", lr_bug_from=8, bf16=True),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every variant of :data:`FP32` and :data:`BF16`, trained for :data:`STEPS` steps."""
    root = tmp_path_factory.mktemp("variants")
    return {name: train(root / name, variant, steps=STEPS) for name, variant in {**FP32, **BF16}.items()}


def test_rounding_level_reruns_pass_the_default(runs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """The op-order refactor, one thread instead of two, the fused kernels: not one bit-equal row
    after the first steps, yet within the default tolerance (the old rule, a mean against its own
    small value, flagged the refactor at a bias' mean)."""
    for name in ("refactor", "threads", "fused"):
        exact = diff(runs["base"], runs[name], exact=True)
        if name != "threads":  # another thread count may round alike on a small machine: then nothing to tolerate
            assert exact.exit_code == 1 and exact.counts["diverged"] > 100, name  # they do differ
        default = diff(runs["base"], runs[name])
        assert default.exit_code == 0, (name, default.answer())
        assert default.counts["within_tolerance"] == exact.counts["diverged"]
        assert default.answer() == f"no divergence: {default.counts['compared']:,} matched rows, all within rtol 0.001"
    refactor = diff(runs["base"], runs["refactor"], exact=True).first
    assert refactor is not None and (refactor.step, refactor.table, refactor.scope) == (0, "module", "forward")
    assert ".attn." in refactor.name  # the attention is where the two orders first round differently
    assert main(["diff", str(runs["base"]), str(runs["refactor"]), str(runs["threads"]), str(runs["fused"])]) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("== ")] == [
        f"== {runs[n]}" for n in ("refactor", "threads", "fused")]


def test_real_changes_are_named_at_their_first_row(runs: dict[str, Path]) -> None:
    """An LR bug from step 8, LayerNorm's eps 1e-5 → 1e-2, ×50 token embeddings at step 5, a NaN
    in a weight after step 4: each diverges at the first row training computed differently."""
    lr = diff(runs["base"], runs["lr_bug"])
    assert lr.exit_code == 1 and lr.first is not None
    # the learning rate acts in step 8's optimizer step: its first parameter after the update
    assert (lr.first.step, lr.first.table, lr.first.scope, lr.first.name) == (8, "param", "param_updated",
                                                                             "tok_emb.weight"), lr.first
    assert diff(runs["base"], runs["lr_bug"], exact=True, steps=(0, 7)).exit_code == 0  # nothing before
    eps = diff(runs["base"], runs["ln_eps"]).first
    assert eps is not None and (eps.step, eps.scope, eps.name) == (0, "forward", "layers.0.ln1.output.0"), eps
    spike = diff(runs["base"], runs["spike"]).first
    assert spike is not None and (spike.step, spike.scope, spike.name) == (5, "forward", "layers.0.input.0"), spike
    assert spike.factor is not None and spike.factor > 10
    nan = diff(runs["base"], runs["nan"]).first
    assert nan is not None and (nan.step, nan.scope) == (5, "forward"), nan
    assert nan.name == NAN_WEIGHT.rsplit(".", 1)[0] + ".output.0" and math.isnan(nan.candidate or 0.0)
    assert math.isfinite(nan.baseline or math.nan) and nan.rel_diff == math.inf


def test_unreduced_gradients_come_in_backward_order(runs: dict[str, Path]) -> None:
    """Step 5 of the NaN run: every gradient is NaN; backward computes the head's first, the
    embeddings' last, although the files list parameters in model order."""
    from diff_variants import _GPT

    names = [n for n, _ in _GPT(SIZE, MANUAL).named_parameters()]
    assert names[0] == "tok_emb.weight"
    result = diff(runs["base"], runs["nan"], tables=["weight_grad"], limit=len(names))
    assert result.first is not None and (result.first.step, result.first.scope) == (5, "unreduced")
    assert result.first.name == names[-1] == "head.bias"
    assert [d.name for d in result.divergences] == names[::-1]
    assert {d.scope for d in result.divergences} == {"unreduced"}


def test_the_largest_table_has_one_row_per_tensor_and_a_factor(runs: dict[str, Path], tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The ×50 embedding spike: one row per tensor (a parameter's param_updated at s is its
    param_origin at s+1, its unreduced gradient is its reduced one without DDP), ranked by the
    factor of the norm, which reads ×N where the relative difference would saturate below 1."""
    result = diff(runs["base"], runs["spike"], out=tmp_path / "out")
    largest = result.largest
    assert len(largest) == 20 and len({tensor_of(d.table, d.name) for d in largest}) == 20
    assert all(d.op == "norm" for d in largest)
    factors = [d.factor or 0.0 for d in largest]
    assert factors == sorted(factors, reverse=True) and factors[0] > 10
    top = largest[0]
    assert top.rel_diff is not None and top.rel_diff < 1  # |a-b|/max(|a|,|b|): bounded, hence the factor
    # the factor and the relative difference of a norm, in float64 from the two values
    a, b = abs(top.baseline or 0.0), abs(top.candidate or 0.0)
    assert top.factor == pytest.approx(max(a, b) / min(a, b), rel=1e-12)
    assert top.rel_diff == pytest.approx(abs(a - b) / max(a, b), rel=1e-12)
    summary = json.loads((tmp_path / "out" / "diff_summary.json").read_text())
    assert [r["factor"] for r in summary["largest"]] == factors
    with (tmp_path / "out" / "diff.csv").open(newline="") as fh:
        first = next(csv.DictReader(fh))
    assert float(first["factor"]) == pytest.approx(result.first.factor)  # type: ignore[union-attr]
    assert main(["diff", str(runs["base"]), str(runs["spike"])]) == 1
    out = capsys.readouterr().out
    section = out.split("largest changes (one row per tensor, by its norm where it has one):\n")[1]
    assert section.splitlines()[0].split() == ["step", "rank", "table", "tensor", "op", "baseline", "candidate",
                                               "change", "rel_diff", "tol"]
    assert fmt_factor(top.factor) in section.splitlines()[1]


def test_noise_measures_a_bf16_runs_own_rerun_noise(runs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """bf16 autocast: Monitor V2 files carry no dtype, float32's 1e-3 flags the fused kernels'
    rounding; ``--noise RERUN`` (the other op order) measures the run's noise, passes the fused
    kernels and still names the LR bug at step 8's optimizer step."""
    base, rerun = runs["bf16"], runs["bf16_rerun"]
    assert diff(base, runs["bf16_fused"]).exit_code == 1  # float32's tolerance on a bf16 run
    fused = diff(base, runs["bf16_fused"], noise=rerun)
    assert fused.exit_code == 0, fused.answer()
    assert fused.answer().endswith(f"all within rtol 0.001 or {NOISE_MARGIN:g}× the rerun noise")
    levels = fused.noise_levels["param"]["param_updated"]
    assert set(levels) == {"min", "max", "mean", "norm"} and 1e-3 < max(levels.values()) < 1e-1
    lr = diff(base, runs["bf16_lr_bug"], noise=rerun)
    assert lr.exit_code == 1 and lr.first is not None
    assert (lr.first.step, lr.first.table, lr.first.scope) == (8, "param", "param_updated"), lr.first
    assert lr.first.tolerance is not None and lr.first.tolerance > DTYPE_RTOL["float32"]  # raised by the noise
    assert main(["diff", str(base), str(runs["bf16_fused"]), str(runs["bf16_lr_bug"]), "--noise", str(rerun)]) == 1
    out = capsys.readouterr().out
    assert out.count("tolerance: rtol 0.001 or 10× the rerun noise: the rerun ") == 2
    assert f"== {runs['bf16_lr_bug']}\nfirst divergence: step 8, rank 0, param param_updated " in out
    # the precision stated instead: bf16's rtol passes the kernels too
    stated = diff(base, runs["bf16_fused"], dtype="bfloat16")
    assert stated.exit_code == 0 and stated.rtol == DTYPE_RTOL["bfloat16"]
    assert stated.answer().endswith("within rtol 0.3 (bfloat16)")


def test_noise_and_dtype_bad_input(runs: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--dtype: one of float64, float32, float16, bfloat16, not 'fp8'"):
        diff(runs["base"], runs["refactor"], dtype="fp8")
    v1 = _v1_run(tmp_path / "v1", None)
    with pytest.raises(ConfigError, match=re.escape(f"--noise {v1} is Monitor V1 output")):
        diff(runs["base"], runs["refactor"], noise=v1)
    proc = cli(str(runs["base"]), str(runs["refactor"]), "--exact", "--noise", str(runs["threads"]))
    assert proc.returncode == 2 and "--exact and --noise: give one" in proc.stderr
    proc = cli(str(runs["base"]), str(runs["refactor"]), str(runs["threads"]), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and "--output and --html: one candidate at a time" in proc.stderr


def test_v1_precision_from_its_files_and_its_6_decimal_rounding(tmp_path: Path) -> None:
    """Monitor V1 rows carry a dtype (float32 here) and 6 decimals. A tensor of tiny values (one
    ``grad_reduced`` row set to min 0, max 2e-6, norm 3e-6 in both runs): its max moved by one
    unit of the last decimal is no difference (the old rule read 2e-6 vs 3e-6 as 0.33); moved to
    9e-6 it diverges, by a factor measured from the unit, ×4.5, not from 0."""
    base = _v1_run(tmp_path / "base", None)
    assert diff(base, base).dtype == "float32" and diff(base, base).dtype_source == "files"

    def tiny(dst: Path, maximum: str) -> Path:
        shutil.copytree(base, dst)
        path = next(dst.rglob("grad_reduced_*.csv"))
        lines = path.read_text().splitlines()
        header = lines[0].split(",")
        cells = lines[1].split(",")
        for op, value in (("min", "0.0"), ("max", maximum), ("norm", "0.000003")):
            cells[header.index(op)] = value
        path.write_text("\n".join([lines[0], ",".join(cells), *lines[2:]]) + "\n")
        return dst

    reference = tiny(tmp_path / "b", "0.000002")
    within = diff(reference, tiny(tmp_path / "c1", "0.000003"))
    assert within.exit_code == 0 and within.counts["within_tolerance"] == 1, within.answer()
    moved = diff(reference, tiny(tmp_path / "c2", "0.000009"))
    assert moved.counts["diverged"] == 1 and moved.first is not None and moved.first.op == "max"
    assert moved.first.factor == pytest.approx(1 + 7e-6 / 2e-6, rel=1e-9)  # from the smaller value, 2e-6
    assert moved.first.rel_diff == pytest.approx((7e-6 - 1e-6) / 9e-6, rel=1e-9)  # less the rounding unit


def test_factor_is_printed_as_times_n() -> None:
    assert [fmt_factor(v) for v in (1.0, 1.0023, 1.5, 2.37, 100.0, 4000.4, 1.2e7, math.inf, 1 + 3e-7)] == [
        "×1", "×1.0023", "×1.5", "×2.37", "×100", "×4,000", "×1.2e+07", "×inf", "×1+3.0e-07"]
