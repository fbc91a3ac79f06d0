"""trainprobe compare: golden vs perturbed runs of a real conv net, in every mode, through the
CLI (subprocess) and in process."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from dump_models import ConvNet
from trainprobe.dump.cli import main
from trainprobe.dump.compare import COLUMNS, compare_dumps
from trainprobe.dump.debugger import PrecisionDebugger

PERTURBED = "Functional.leaky_relu.0.forward"


def dump_run(root: Path, *, perturbed: bool, task: str, summary: str = "statistics", extra_call: bool = False) -> Path:
    config = {"task": task, "level": "mix", "dump_path": str(root), task: {"summary_mode": summary}}
    (root.parent / f"{root.name}.json").write_text(json.dumps(config), encoding="utf-8")
    debugger = PrecisionDebugger(config_path=root.parent / f"{root.name}.json")
    torch.manual_seed(3)
    model = ConvNet(perturbed=perturbed)
    x = torch.randn(2, 3, 6, 6)
    debugger.start(model)
    if extra_call:
        torch.nn.functional.relu(torch.randn(3))  # shifts every later Functional.relu count by one
    model(x).square().mean().backward()
    debugger.stop()
    debugger.step()
    return root


def read(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        return list(reader.fieldnames or []), list(reader)


@pytest.mark.parametrize(("task", "summary", "mode"), [("statistics", "statistics", "statistics"),
                                                       ("tensor", "statistics", "tensor"),
                                                       ("statistics", "md5", "md5")])  # fmt: skip
def test_compare_finds_the_perturbed_op_first(tmp_path: Path, task: str, summary: str, mode: str) -> None:
    golden = dump_run(tmp_path / "golden", perturbed=False, task=task, summary=summary)
    target = dump_run(tmp_path / "target", perturbed=True, task=task, summary=summary)
    [result] = compare_dumps(target, golden, tmp_path / "out")
    assert result.mode == mode
    assert result.first is not None and result.first.record == PERTURBED
    # the perturbation is the negative slope, a float argument: its own row (input.1, as the
    # reference lists non-tensor arguments) is the first divergence, in md5 mode too (the
    # checksum of a non-tensor is the CRC-32 of its text, the reference's)
    assert result.first.name == f"{PERTURBED}.input.1"
    header, rows = read(result.output)
    assert header == COLUMNS[mode]
    by_name = {r["NPU Name"]: r for r in rows}
    if mode == "md5":
        slope = by_name[f"{PERTURBED}.input.1"]
        crc = {v: f"{zlib.crc32(str(v).encode()):08x}" for v in (0.2, 0.01)}
        assert (slope["NPU MD5"], slope["BENCH MD5"], slope["Result"]) == (crc[0.2], crc[0.01], "error")
        assert slope["Err_message"] == "checksums differ"
    assert by_name[f"{PERTURBED}.input.0"]["Result"] == "pass"
    assert by_name[f"{PERTURBED}.output.0"]["Result"] in ("warning", "error")
    assert by_name[f"{PERTURBED}.output.0"]["Err_message"]
    assert "dump_models.py" in by_name[f"{PERTURBED}.input.0"]["NPU_Stack_Info"]
    first_rows = rows[: [r["NPU Name"] for r in rows].index(f"{PERTURBED}.input.0")]
    assert first_rows and all(r["Result"] == "pass" for r in first_rows)
    if mode == "tensor":
        row = by_name[f"{PERTURBED}.output.0"]
        assert float(row["Cosine"]) < 1.0 and float(row["MaxAbsErr"]) > 0
        same = by_name[f"{PERTURBED}.input.0"]
        assert float(same["Cosine"]) == pytest.approx(1.0) and float(same["EucDist"]) == 0.0
        assert float(same["One Thousandth Err Ratio"]) == 1.0
    if mode == "statistics":
        row = by_name["Module.conv1.Conv2d.forward.0.output.0"]
        assert float(row["Max diff"]) == 0.0 and row["MaxRelativeErr"] == "0%"


def test_compare_statistics_against_float64(tmp_path: Path) -> None:
    golden = dump_run(tmp_path / "golden", perturbed=False, task="tensor")
    target = dump_run(tmp_path / "target", perturbed=True, task="tensor")
    [result] = compare_dumps(target, golden, tmp_path / "out")
    row = {r["NPU Name"]: r for r in read(result.output)[1]}[f"{PERTURBED}.output.0"]
    tdir, gdir = (next((p / "step0").iterdir()) / "dump_tensor_data" for p in (target, golden))
    a = torch.load(tdir / f"{PERTURBED}.output.0.pt", weights_only=True).double()
    b = torch.load(gdir / f"{PERTURBED}.output.0.pt", weights_only=True).double()
    assert float(row["Cosine"]) == pytest.approx((a.flatten() @ b.flatten() / (a.norm() * b.norm())).item(), rel=1e-12)
    assert float(row["EucDist"]) == pytest.approx((a - b).norm().item(), rel=1e-12)
    assert float(row["MaxAbsErr"]) == pytest.approx((a - b).abs().max().item(), rel=1e-12)
    rel = ((a - b).abs() / b.abs()).flatten()
    assert float(row["Five Thousandths Err Ratio"]) == pytest.approx((rel <= 0.005).double().mean().item())


def test_counts_that_differ_are_matched_by_order(tmp_path: Path) -> None:
    golden = dump_run(tmp_path / "golden", perturbed=False, task="statistics")
    target = dump_run(tmp_path / "target", perturbed=False, task="statistics", extra_call=True)
    [result] = compare_dumps(target, golden, tmp_path / "out")
    rows = {r["NPU Name"]: r for r in read(result.output)[1]}
    # the extra Functional.relu.0 of the target takes golden's relu.0 by name; relu.1 then
    # has no golden of its name and is matched by order with nothing left: not found
    assert rows["Functional.relu.1.forward.output.0"]["Bench Name"] == "N/A"
    assert rows["Functional.conv2d.0.forward.output.0"]["Result"] == "pass"


def test_cli_subprocess_and_first_divergence(tmp_path: Path) -> None:
    golden = dump_run(tmp_path / "golden", perturbed=False, task="statistics")
    target = dump_run(tmp_path / "target", perturbed=True, task="statistics")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainprobe.dump.cli",
            "compare",
            "-tp",
            str(target),
            "-gp",
            str(golden / "step0"),
            "-o",
            str(tmp_path / "out"),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "mismatched dumps" in proc.stderr
    assert "Traceback" not in proc.stderr
    step_t = next((target / "step0").iterdir())
    step_g = next((golden / "step0").iterdir())
    assert main(["compare", "-tp", str(step_t), "-gp", str(step_g), "-o", str(tmp_path / "out")]) == 0
    assert main(["compare", "-tp", str(target), "-gp", str(golden), "-o", str(tmp_path / "x"), "--xlsx"]) == 0
    from openpyxl import load_workbook

    [xlsx] = list((tmp_path / "x").glob("compare_result_step0_proc*.xlsx"))
    ws = load_workbook(xlsx).active
    assert [c.value for c in ws[1]] == COLUMNS["statistics"]


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "-tp", str(tmp_path / "nope"), "-gp", str(tmp_path), "-o", str(tmp_path / "o")]) == 2
    assert "no such directory" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["compare", "-tp", str(empty), "-gp", str(empty), "-o", str(tmp_path / "o")]) == 2
    assert "not a dump" in capsys.readouterr().err
    broken = tmp_path / "broken" / "step0" / "rank0"
    broken.mkdir(parents=True)
    (broken / "dump.json").write_text('{"data": ', encoding="utf-8")
    assert main(["compare", "-tp", str(broken), "-gp", str(broken), "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "cannot be read as JSON" in err and err.count("\n") == 1
