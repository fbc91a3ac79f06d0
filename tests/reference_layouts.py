"""Small monitor output trees in the layouts the reference tool writes, generated here (no file
of the reference is copied): what the offline tools must read besides trainprobe's own output.

Layout facts, observed on mindstudio-probe 26.2.0 runs of a two-layer MLP with AdamW:

* V1 run folder ``<MonDD_HH-MM-SS>-rank<r>-<8 hex>``; header ``vpp_stage,name,step[,micro_step],
  <ops>,shape,dtype``; names without the ``<vpp>:`` chunk prefix (``fc1.input``, ``fc1.weight``;
  the root module is ``.input``); ``shape`` a quoted list (``"[4, 8]"``, ``[16]``, ``[]``),
  ``dtype`` ``torch.float32``; an activation gradient never computed is a row of ``nan`` in
  every cell, ``shape`` and ``dtype`` included; ``nans`` written as ``0`` or ``0.0``; ``\\n``
  line ends, no byte-order mark (spreadsheet programs add one when they save).
* V2 ``rank_<r>/<monitor>_step<a>-<b>.csv`` written by the csv module: ``\\r\\n`` line ends,
  ``vpp_stage`` -1 without chunks, ``micro_step`` only in ``weight_grad``.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

V1_RUN = "Nov25_06-27-30-rank0-0c5cd257"
V1_OPS = ("min", "max", "norm", "zeros", "nans", "mean")
V2_OPS = ("min", "max", "mean", "norm", "nans")
NAN_ROW = ["nan"] * (len(V1_OPS) + 2)


def _shape(dims: list[int]) -> str:
    return "[" + ", ".join(map(str, dims)) + "]"


def v1_text(header: list[str], rows: list[list[object]]) -> str:
    """As pandas writes it: minimal quoting, ``\\n`` line ends."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return buffer.getvalue()


def v1_activation_rows(step: int) -> list[list[object]]:
    """``actv`` rows of one step: ``vpp_stage,name,step,micro_step,<ops>,shape,dtype``."""
    rows: list[list[object]] = []
    for index, (name, dims) in enumerate(
        [("fc1.input", [4, 8]), ("fc1.output", [4, 16]), ("act.output", [4, 16]), (".output", [4, 4])]
    ):
        value = round(0.5 + index + step / 10, 6)
        rows.append([0, name, step, 0, -value, value, 2 * value, 0.0, 0, value / 10, _shape(dims), "torch.float32"])
    return rows


def v1_gradient_rows(step: int) -> list[list[object]]:
    """``actv_grad`` rows: the gradient of the model input was never computed (all ``nan``)."""
    rows: list[list[object]] = [[0, ".input", step, 0, *NAN_ROW]]
    rows.append([0, ".output", step, 0, -0.08, 0.02, 0.13, 0.0, 0.0, -0.01, "[4, 4]", "torch.float32"])
    return rows


def v1_weight_rows(step: int) -> list[list[object]]:
    """``grad_reduced`` rows: ``vpp_stage,name,step,<ops>,shape,dtype``."""
    params = [("fc1.weight", [16, 8]), ("fc1.bias", [16]), ("fc2.weight", [4, 16]), ("fc2.bias", [4])]
    return [
        [0, name, step, -0.1 * (i + 1), 0.1 * (i + 1), 0.2 + step, 0.0, 0, 0.001 * i, _shape(dims), "torch.float32"]
        for i, (name, dims) in enumerate(params)
    ]


V1_MICRO_HEADER = ["vpp_stage", "name", "step", "micro_step", *V1_OPS, "shape", "dtype"]
V1_HEADER = ["vpp_stage", "name", "step", *V1_OPS, "shape", "dtype"]


def write_reference_v1(root: Path, steps: int = 2) -> Path:
    """A reference-layout V1 tree under ``root`` (one rank, steps ``0..steps-1`` in one window);
    returns the run folder."""
    run = root / V1_RUN
    run.mkdir(parents=True)
    last = steps - 1
    other = [[0, "fc1.weight", s, 1.0, 1.0, 1.0, 0.0, 0, 1.0, "[]", "torch.float32"] for s in range(steps)]
    tables = {
        "actv": (V1_MICRO_HEADER, [r for s in range(steps) for r in v1_activation_rows(s)]),
        "actv_grad": (V1_MICRO_HEADER, [r for s in range(steps) for r in v1_gradient_rows(s)]),
        "grad_reduced": (V1_HEADER, [r for s in range(steps) for r in v1_weight_rows(s)]),
        "other": (V1_HEADER, other),
    }
    for table, (head, rows) in tables.items():
        (run / f"{table}_0-{last}.csv").write_text(v1_text(head, rows), encoding="utf-8")
    return run


def write_reference_v2(root: Path, steps: int = 2) -> Path:
    """A reference-layout V2 tree (``rank_0``, ``\\r\\n`` line ends, vpp_stage -1); returns the rank folder."""
    folder = root / "rank_0"
    folder.mkdir(parents=True)
    last = steps - 1
    module = [["vpp_stage", "step", "module_name", "scope", *V2_OPS]]
    weight = [["vpp_stage", "step", "module_name", "scope", "micro_step", *V2_OPS]]
    for step in range(steps):
        module.append([-1, step, ".input.0", "forward", -1.76, 1.71, -0.11, 5.5, 0.0])
        module.append([-1, step, "fc1.output.0", "backward", -0.01, 0.02, 0.004, 0.06, 0.0])
        weight.append([-1, step, "fc1.weight", "reduced", 1, -0.07, 0.06, -0.002, 0.22 + step, 0.0])
    for name, rows in (("module", module), ("weight_grad", weight)):
        buffer = io.StringIO(newline="")
        csv.writer(buffer).writerows(rows)  # the csv module's default "\r\n"
        (folder / f"{name}_step0-{last}.csv").write_bytes(buffer.getvalue().encode())
    return folder


def write_reference_repeats(root: Path, steps: int = 2, micro_batches: int = 2) -> Path:
    """A reference-layout tree whose keys repeat within a step, as the reference tool writes them:
    V1 ``actv`` with gradient accumulation and no ``micro_step`` column (one set of rows per
    micro-batch) and a V2 ``module`` CSV of a module called twice per step (``fc1`` applied
    twice: two ``fc1.output.0`` rows per step). Every row's value differs. Returns ``root``."""
    run = root / "v1" / V1_RUN
    run.mkdir(parents=True)
    last = steps - 1
    actv = [
        [0, name, s, -v, v, 2 * v, 0.0, 0, v / 10, "[4, 16]", "torch.float32"]
        for s in range(steps)
        for m in range(micro_batches)
        for i, name in enumerate(["fc1.input", "fc1.output", ".output"])
        for v in [round(0.5 + i + s / 10 + m / 100, 6)]
    ]
    (run / f"actv_{0}-{last}.csv").write_text(v1_text(V1_HEADER, actv), encoding="utf-8")
    folder = root / "v2" / "rank_0"
    folder.mkdir(parents=True)
    module: list[list[object]] = [["vpp_stage", "step", "module_name", "scope", *V2_OPS]]
    for step in range(steps):
        for call in range(2):
            value = 0.1 + step + call / 10
            module.append([-1, step, "fc1.input.0", "forward", -value, value, 0.0, 2 * value, 0.0])
            module.append([-1, step, "fc1.output.0", "forward", -value, value, 0.01, 3 * value, 0.0])
    buffer = io.StringIO(newline="")
    csv.writer(buffer).writerows(module)
    (folder / f"module_step0-{last}.csv").write_bytes(buffer.getvalue().encode())
    return root
