"""Dump names and layout are the reference tool's, pinned on real models: Python operators as
``Tensor.__add__``, ``Torch.*`` vs ``Functional.*`` by what the code called, positional
``input_args``, backward ``output`` per autograd node, AdamW's APIs, risk level, filters."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import write_config
from trainprobe.dump import PrecisionDebugger
from trainprobe.dump.api_catalog import ApiCatalog
from trainprobe.engine.errors import ConfigError

ADAMW = [
    "Tensor.__iadd__",
    "Tensor.mul_",
    "Tensor.lerp_",
    "Tensor.mul_",
    "Tensor.addcmul_",
    "Tensor.sqrt",
    "Tensor.__truediv__",
    "Tensor.add_",
    "Tensor.addcdiv_",
]
"""What single-tensor AdamW.step() calls per parameter, in order."""

FORWARD = [
    "Functional.embedding.0.forward",
    "Functional.multi_head_attention_forward.0.forward",
    "Functional.dropout.0.forward",
    "Tensor.__add__.0.forward",
    "Functional.layer_norm.0.forward",
    "Functional.linear.0.forward",
    "Torch.relu.0.forward",  # activation=F.relu was bound before the wrappers: F.relu's torch.relu is seen
    "Functional.dropout.1.forward",
    "Functional.linear.1.forward",
    "Functional.dropout.2.forward",
    "Tensor.__add__.1.forward",
    "Functional.layer_norm.1.forward",
    "Functional.linear.2.forward",
    "Functional.cross_entropy.0.forward",  # the two reshape calls before it: low risk, not dumped
]
BACKWARD = [  # dropout with p=0 has no backward record
    "Functional.cross_entropy.0.backward",
    "Functional.linear.2.backward",
    "Functional.layer_norm.1.backward",
    "Tensor.__add__.1.backward",
    "Functional.linear.1.backward",
    "Torch.relu.0.backward",
    "Functional.linear.0.backward",
    "Functional.layer_norm.0.backward",
    "Tensor.__add__.0.backward",
    "Functional.multi_head_attention_forward.0.backward",
    "Functional.embedding.0.backward",
]


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(self.emb(ids)))


def _config(tmp_path: Path, level: str = "L1", **section: Any) -> Path:
    task = {"scope": [], "list": [], "data_mode": ["all"], "summary_mode": "statistics", **section}
    cfg = {"task": "statistics", "dump_path": str(tmp_path / "dump"), "level": level, "statistics": task}
    return write_config(tmp_path, cfg)


def _dump(root: Path, file: str = "dump.json") -> dict[str, Any]:
    (rank,) = (root / "dump" / "step0").iterdir()
    return json.loads((rank / file).read_text())


def _train_encoder(tmp_path: Path, level: str = "L1", clip: bool = False, **section: Any) -> None:
    debugger = PrecisionDebugger(config_path=_config(tmp_path, level, **section))
    torch.manual_seed(0)
    model = Encoder()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    ids, target = torch.randint(0, 50, (2, 5)), torch.randint(0, 50, (2, 5))
    debugger.start(model=model)
    opt.zero_grad()
    loss = F.cross_entropy(model(ids).reshape(-1, 50), target.reshape(-1))
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    debugger.stop()
    debugger.step()


def test_transformer_l1_names_are_the_reference_names(tmp_path: Path) -> None:
    _train_encoder(tmp_path)
    names = list(_dump(tmp_path)["data"])
    n_params = len(list(Encoder().parameters()))
    counts: dict[str, int] = {}
    adamw = []
    for _ in range(n_params):
        for api in ADAMW:
            adamw.append(f"{api}.{counts.get(api, 0)}.forward")
            counts[api] = counts.get(api, 0) + 1
    assert names == FORWARD + BACKWARD + adamw


def test_positional_arguments_stay_positional(tmp_path: Path) -> None:
    _train_encoder(tmp_path)
    data = _dump(tmp_path)["data"]
    norm = data["Functional.layer_norm.0.forward"]  # nn.LayerNorm: F.layer_norm(x, shape, weight, bias, eps)
    assert len(norm["input_args"]) == 5 and norm["input_kwargs"] == {}
    assert norm["input_args"][1] == [{"type": "int", "value": 16}]
    assert [norm["input_args"][i]["shape"] for i in (0, 2, 3)] == [[2, 5, 16], [16], [16]]
    assert norm["input_args"][4] == {"type": "float", "value": 1e-05}
    emb = data["Functional.embedding.0.forward"]  # nn.Embedding passes all seven positionally
    assert len(emb["input_args"]) == 7 and emb["input_kwargs"] == {}
    assert emb["input_args"][2:4] == [None, None]
    drop = data["Functional.dropout.0.forward"]
    assert drop["input_args"][1:] == [
        {"type": "float", "value": 0.0},
        {"type": "bool", "value": True},
        {"type": "bool", "value": False},
    ]


def test_backward_output_is_the_nodes_input_gradients(tmp_path: Path) -> None:
    _train_encoder(tmp_path)
    data = _dump(tmp_path)["data"]
    add = data["Tensor.__add__.0.backward"]  # x + sa(x): each argument gets this add's gradient
    assert len(add["input"]) == 1 and len(add["output"]) == 2
    assert add["output"][0] == add["output"][1] == add["input"][0]
    emb = data["Functional.embedding.0.backward"]  # the indices have no gradient: one entry
    assert [e["shape"] for e in emb["output"]] == [[50, 16]]
    ce = data["Functional.cross_entropy.0.backward"]  # composite: per differentiable argument
    assert [e["shape"] for e in ce["output"]] == [[10, 50]]
    ln = data["Functional.layer_norm.0.backward"]
    assert [e["shape"] for e in ln["output"]] == [[2, 5, 16], [16], [16]]


def test_scalar_operand_gets_a_null_gradient_and_dunder_names(tmp_path: Path) -> None:
    debugger = PrecisionDebugger(config_path=_config(tmp_path))
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, 2, requires_grad=True)
    debugger.start()
    y = (x * 2 - 1) @ w
    z = y.add(1).sum()
    z.backward()
    debugger.stop()
    debugger.step()
    data = _dump(tmp_path)["data"]
    assert list(data) == [
        "Tensor.__mul__.0.forward",
        "Tensor.__sub__.0.forward",
        "Tensor.__matmul__.0.forward",
        "Tensor.add.0.forward",
        "Tensor.sum.0.forward",
        "Tensor.sum.0.backward",
        "Tensor.add.0.backward",
        "Tensor.__matmul__.0.backward",
        "Tensor.__sub__.0.backward",
        "Tensor.__mul__.0.backward",
    ]
    mul = data["Tensor.__mul__.0.backward"]["output"]
    assert mul[1] is None and mul[0]["shape"] == [3, 4]
    expected = (2.0 * w.detach().sum(1)).expand(3, 4)  # d(x*2)/dx times the gradient from the matmul
    assert mul[0]["Max"] == expected.max().item() and mul[0]["Min"] == expected.min().item()
    assert data["Tensor.__mul__.0.forward"]["input_args"][1] == {"type": "int", "value": 2}


def test_captured_function_and_nested_calls(tmp_path: Path) -> None:
    relu = getattr(F.relu, "trainprobe_api", F.relu)  # F.relu as bound before any debugger existed
    debugger = PrecisionDebugger(config_path=_config(tmp_path))
    x = torch.randn(4)
    debugger.start()
    relu(x)  # F.relu's own torch.relu call is what is seen
    F.relu(x)  # looked up now: Functional.relu, and its torch.relu inside is not dumped again
    torch.linalg.norm(x)  # listed as linalg.norm, named after its last part
    debugger.stop()
    debugger.step()
    assert list(_dump(tmp_path)["data"]) == [
        "Torch.relu.0.forward",
        "Functional.relu.0.forward",
        "Torch.norm.0.forward",
    ]


def test_list_and_scope_accept_reference_names(tmp_path: Path) -> None:
    _train_encoder(tmp_path / "a", list=["__add__"])
    assert list(_dump(tmp_path / "a")["data"]) == [
        "Tensor.__add__.0.forward",
        "Tensor.__add__.1.forward",
        "Tensor.__add__.1.backward",
        "Tensor.__add__.0.backward",
    ]
    _train_encoder(tmp_path / "b", list=["Functional.linear", "reshape"])  # a list lifts the risk filter
    names = list(_dump(tmp_path / "b")["data"])
    assert [n for n in names if n.endswith("forward")] == [
        "Functional.linear.0.forward",
        "Functional.linear.1.forward",
        "Functional.linear.2.forward",
        "Tensor.reshape.0.forward",
        "Tensor.reshape.1.forward",
    ]
    _train_encoder(tmp_path / "c", scope=["Tensor.__add__.0.forward", "Functional.linear.1.forward"])
    forward = [n for n in _dump(tmp_path / "c")["data"] if n.endswith("forward")]
    assert forward == [
        "Tensor.__add__.0.forward",
        "Functional.layer_norm.0.forward",
        "Functional.linear.0.forward",
        "Torch.relu.0.forward",
        "Functional.dropout.1.forward",
        "Functional.linear.1.forward",
    ]


def test_mix_gives_optimizer_and_clip_grad_apis_their_parents(tmp_path: Path) -> None:
    _train_encoder(tmp_path, level="mix", clip=True)
    construct = _dump(tmp_path, "construct.json")
    data = _dump(tmp_path)["data"]
    assert construct["optimizer"] is None and construct["clip_grad"] is None
    assert construct["Tensor.addcdiv_.0.forward"] == "optimizer"
    assert construct["Functional.linear.0.forward"] == "Module.layer.linear1.Linear.forward.0"
    clip = [n for n, parent in construct.items() if parent == "clip_grad"]
    assert clip and all(n in data for n in clip)
    assert "Module.layer.TransformerEncoderLayer.forward.0" in data


def test_catalog_names_behind_installed_wrappers(tmp_path: Path) -> None:
    PrecisionDebugger(config_path=_config(tmp_path))  # installs the wrappers
    catalog = ApiCatalog.load()
    assert catalog.name_of(torch.Tensor.__add__.trainprobe_api) == "Tensor.__add__"  # type: ignore[attr-defined]
    assert catalog.name_of(F.linear.trainprobe_api) == "Functional.linear"  # type: ignore[attr-defined]


def test_trainprobe_threads_are_never_dumped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import trainprobe.dump.store as store

    monkeypatch.setattr(store, "_save_pt", None)  # the .pt writer thread probes torch.save with torch calls again
    cfg = {"task": "tensor", "dump_path": str(tmp_path / "dump"), "level": "L1", "tensor": {"list": []}}
    debugger = PrecisionDebugger(config_path=write_config(tmp_path, cfg))
    x = torch.randn(3, requires_grad=True)
    debugger.start()
    (x * 3).sum().backward()
    debugger.files.wait()  # the writer thread ran while dumping was on
    debugger.stop()
    debugger.step()
    assert list(_dump(tmp_path)["data"]) == [
        "Tensor.__mul__.0.forward",
        "Tensor.sum.0.forward",
        "Tensor.sum.0.backward",
        "Tensor.__mul__.0.backward",
    ]


@pytest.mark.parametrize(
    ("risk_level", "expected"),
    [
        (None, ["Tensor.__mul__.0.forward", "Torch.matmul.0.forward"]),
        ("ALL", ["Tensor.transpose.0.forward", "Tensor.__mul__.0.forward", "Torch.matmul.0.forward"]),
        ("CORE", ["Torch.matmul.0.forward"]),
    ],
)
def test_risk_level(tmp_path: Path, risk_level: str | None, expected: list[str]) -> None:
    cfg: dict[str, Any] = {"task": "statistics", "dump_path": str(tmp_path / "dump"), "level": "L1"}
    if risk_level is not None:
        cfg["risk_level"] = risk_level
    debugger = PrecisionDebugger(config_path=write_config(tmp_path, cfg))
    x = torch.randn(2, 3)
    debugger.start()
    torch.matmul(x.transpose(0, 1) * 2, x)
    debugger.stop()
    debugger.step()
    assert list(_dump(tmp_path)["data"]) == expected


def test_bad_risk_level_names_the_field(tmp_path: Path) -> None:
    cfg = {"task": "statistics", "dump_path": str(tmp_path / "dump"), "risk_level": "LOW"}
    with pytest.raises(ConfigError, match=r"risk_level: 'LOW' is not one of CORE, FOCUS, ALL"):
        PrecisionDebugger(config_path=write_config(tmp_path, cfg))


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(x)


def test_backward_output_is_the_calls_own_gradient(tmp_path: Path) -> None:
    """x feeds both the Linear and the residual add: the Linear's backward output (module and
    F.linear, made of several autograd nodes) is the gradient through the Linear only."""
    debugger = PrecisionDebugger(config_path=_config(tmp_path, "mix"))
    torch.manual_seed(0)
    model = Residual()
    x = torch.randn(3, 5, 4, requires_grad=True)
    debugger.start(model=model)
    model(x).sum().backward()
    debugger.stop()
    debugger.step()
    data = _dump(tmp_path)["data"]
    through_linear = model.lin.weight.detach().sum(0).expand(3, 5, 4)  # d sum(x W^T + b) / dx
    for name in ("Module.lin.Linear.backward.0", "Functional.linear.0.backward"):
        grads = data[name]["output"]
        assert grads[0]["Max"] == pytest.approx(through_linear.max().item(), rel=1e-6), name
        assert grads[0]["Min"] == pytest.approx(through_linear.min().item(), rel=1e-6), name
    linear = data["Functional.linear.0.backward"]["output"]  # input, weight, bias: argument order
    assert [e["shape"] for e in linear] == [[3, 5, 4], [4, 4], [4]]
    assert linear[2]["Max"] == linear[2]["Min"] == 15.0
    total = data["Tensor.__add__.0.backward"]["output"]  # add is one node: both operands get its gradient
    assert total[0]["Max"] == total[0]["Min"] == 1.0
