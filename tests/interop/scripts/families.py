"""Four model families for the interop harness, each under Monitor V2, Monitor V1 and the dump.

Usage: python families.py --pkg msprobe|trainprobe --what WHAT --out DIR

WHAT is a family (``conv``, ``transformer``, ``moe``, ``accum``), trained once without a monitor,
then under Monitor V1 (``v1``: all four distributions, AnomalyTurbulence alerts dumped to
``anomaly.json``) and Monitor V2 (``v2``: module, weight_grad, optimizer, param), V2 last because
the reference's ``stop()`` leaves the optimizer broken; or ``<family>-dump-<L0|L1|mix|md5>``, the
family dumped at that level (``md5``: level mix with ``summary_mode`` md5) for 2 steps, then
trained on undumped (the reference's ``PrecisionDebugger`` is one per process: one dump per
process). Each writes ``losses.json`` (run -> losses) and ``ends.json`` (run -> how it ended), as
``suite.py`` does; only the package name differs between the two sides.

* ``conv``: Conv2d + BatchNorm2d, a residual block of a depthwise conv, GroupNorm and a pointwise
  conv, Linear; SGD with Nesterov momentum and StepLR (the learning rate halves every step).
* ``transformer``: an embedding tied to the output head, RMSNorm, rotary self-attention through
  ``F.scaled_dot_product_attention`` (causal), an ``nn.MultiheadAttention`` block; AdamW with two
  parameter groups (weight decay on matrices, none on norms and biases, another learning rate).
* ``moe``: a top-2 router over four experts; an expert that receives no token is not called.
* ``accum``: a model returning a tuple and a dict, a module called twice per forward; gradient
  accumulation over 2 micro-batches (``grad_acc_steps`` 2).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
FAMILIES = ("conv", "transformer", "moe", "accum")
DUMPS = ("L0", "L1", "mix", "md5")
STEPS = 4
DUMPED = 2


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.depthwise = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.gn = nn.GroupNorm(2, 8)
        self.pointwise = nn.Conv2d(8, 8, 1)
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.stem(x)))
        h = h + self.pointwise(F.relu(self.gn(self.depthwise(h))))  # the residual block
        return self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))


class RotaryAttention(nn.Module):
    """Causal self-attention with rotary position embeddings, through scaled_dot_product_attention."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        half = d // heads // 2
        self.register_buffer("freq", 1.0 / (10000 ** (torch.arange(half).float() / half)), persistent=False)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        angles = torch.arange(x.shape[-2]).float()[:, None] * self.freq[None, :]
        cos, sin = angles.cos(), angles.sin()
        a, b = x.chunk(2, dim=-1)
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(self.rotate(q), self.rotate(k), v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, d))


class Transformer(nn.Module):
    def __init__(self, vocab: int = 12, d: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.norm1 = nn.RMSNorm(d)
        self.attn = RotaryAttention(d, heads=2)
        self.norm2 = nn.RMSNorm(d)
        self.mha = nn.MultiheadAttention(d, 2, batch_first=True)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        h = h + self.attn(self.norm1(h))
        n = self.norm2(h)
        h = h + self.mha(n, n, n, need_weights=False)[0]
        return self.head(h)


class Expert(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class MoE(nn.Module):
    """A top-2 router over four experts; experts without a token are not called."""

    def __init__(self, d: int = 6, experts: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(4, d)
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(Expert(d) for _ in range(experts))
        self.out = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        weights, chosen = torch.topk(self.router(h).softmax(dim=-1), 2, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        mixed = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            token, slot = torch.nonzero(chosen == e, as_tuple=True)
            if token.numel() == 0:
                continue  # idle this step: not called
            mixed = mixed.index_add(0, token, weights[token, slot, None] * expert(h[token]))
        return self.out(mixed + h)


class Pair(nn.Module):
    """Returns a tuple (main, aux)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.a(x))
        return h, self.b(h)


class Accum(nn.Module):
    """A tuple output, a dict output, and ``shared`` called twice per forward."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.pair = Pair(d)
        self.shared = nn.Linear(d, d)
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h, aux = self.pair(x)
        h = self.shared(torch.relu(self.shared(h)))
        return {"logits": self.head(h), "aux": aux}


Batch = tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def seed(value: int = 1234) -> None:
    random.seed(value)
    torch.manual_seed(value)


def mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).pow(2).mean()


def tokens(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def accum_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return (out["logits"] - y).pow(2).mean() + 0.1 * out["aux"].pow(2).mean()


class Setup:
    """A fresh model, its optimizer (and scheduler), its micro-batches per step and its loss."""

    def __init__(self, family: str) -> None:
        seed()
        gen = torch.Generator().manual_seed(99)
        self.scheduler: Any = None
        self.acc = 1
        if family == "conv":
            self.model: nn.Module = ConvNet()
            self.opt: torch.optim.Optimizer = torch.optim.SGD(
                self.model.parameters(), lr=0.05, momentum=0.9, nesterov=True
            )
            self.scheduler = torch.optim.lr_scheduler.StepLR(self.opt, step_size=1, gamma=0.5)
            self.data = [
                [(torch.randn(4, 3, 6, 6, generator=gen), torch.randn(4, 3, generator=gen))] for _ in range(STEPS)
            ]
            self.loss: LossFn = mse
        elif family == "transformer":
            self.model = Transformer()
            decay = [p for n, p in self.model.named_parameters() if p.dim() >= 2]
            rest = [p for n, p in self.model.named_parameters() if p.dim() < 2]
            self.opt = torch.optim.AdamW(
                [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 5e-3}], lr=1e-2
            )
            self.data = [
                [(torch.randint(0, 12, (2, 5), generator=gen), torch.randint(0, 12, (2, 5), generator=gen))]
                for _ in range(STEPS)
            ]
            self.loss = tokens
        elif family == "moe":
            self.model = MoE()
            self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-2)
            self.data = [[(torch.randn(3, 4, generator=gen), torch.randn(3, 2, generator=gen))] for _ in range(STEPS)]
            self.loss = mse
        else:
            self.model = Accum()
            self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.5)
            self.acc = 2
            self.data = [
                [(torch.randn(2, 6, generator=gen), torch.randn(2, 3, generator=gen)) for _ in range(self.acc)]
                for _ in range(STEPS)
            ]
            self.loss = accum_loss

    def step(self, micro: list[Batch]) -> float:
        total = 0.0
        for x, y in micro:
            loss = self.loss(self.model, x, y) / len(micro)
            loss.backward()
            total += float(loss.detach())
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        return total


def config(out: Path, name: str, base: str, **changes: Any) -> str:
    """The shared config ``base`` with ``changes`` applied, written as ``out/config_<name>.json``."""
    data = json.loads((CONFIGS / base).read_text())
    data.update(changes)
    path = out / f"config_{name}.json"
    path.write_text(json.dumps(data, indent=2))
    return str(path)


def run_v1(pkg: str, family: str, out: Path) -> list[float]:
    os.environ["MONITOR_OUTPUT_DIR"] = str(out / "v1")
    api = importlib.import_module(f"{pkg}.pytorch")
    s = Setup(family)
    mon = api.TrainerMon(config_file_path=config(out, "v1", "monitor_v1.json"), params_have_main_grad=False)
    mon.set_monitor(s.model, grad_acc_steps=s.acc, optimizer=s.opt, dp_group=None, tp_group=None, start_iteration=0)
    return [s.step(micro) for micro in s.data]


def run_v2(pkg: str, family: str, out: Path) -> list[float]:
    trainer = importlib.import_module(f"{pkg}.core.monitor_v2.trainer")
    s = Setup(family)
    (out / "v2").mkdir()
    mon = trainer.TrainerMonitorV2(config(out, "v2", "monitor_v2.json", output_dir=str(out / "v2")), fr="pytorch")
    mon.start(model=s.model, optimizer=s.opt, grad_acc_steps=s.acc)
    losses = [s.step(micro) for micro in s.data]
    mon.stop()
    return losses


def run_dump(pkg: str, family: str, out: Path, kind: str) -> list[float]:
    api = importlib.import_module(f"{pkg}.pytorch")
    level = "mix" if kind == "md5" else kind
    base = json.loads((CONFIGS / "dump.json").read_text())
    base["statistics"]["summary_mode"] = "md5" if kind == "md5" else "statistics"
    name = f"dump-{kind}"
    path = out / f"config_{name}.json"
    path.write_text(json.dumps({**base, "level": level, "dump_path": str(out / name)}, indent=2))
    debugger = api.PrecisionDebugger(config_path=str(path))
    s = Setup(family)
    losses = []
    for step, micro in enumerate(s.data):
        if step >= DUMPED:
            losses.append(s.step(micro))
            continue
        debugger.start(model=s.model)
        losses.append(s.step(micro))
        debugger.stop()
        debugger.step()
    return losses


def runs(pkg: str, what: str, out: Path) -> dict[str, Callable[[], list[float]]]:
    """Name -> run, in the order they run."""
    family, _, dump = what.partition("-dump-")
    if dump:
        return {f"dump-{dump}": lambda: run_dump(pkg, family, out, dump)}
    return {"v1": lambda: run_v1(pkg, family, out), "v2": lambda: run_v2(pkg, family, out)}


WHATS = FAMILIES + tuple(f"{f}-dump-{d}" for f in FAMILIES for d in DUMPS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pkg", choices=("msprobe", "trainprobe"), required=True)
    parser.add_argument("--what", choices=WHATS, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.chdir(out)
    family = args.what.partition("-dump-")[0]
    plain = Setup(family)
    losses: dict[str, list[float]] = {"baseline": [plain.step(micro) for micro in plain.data]}
    ends: dict[str, str] = {}
    for name, run in runs(args.pkg, args.what, out).items():
        try:
            losses[name] = run()
            ends[name] = "ok"
        except SystemExit as exc:
            ends[name] = f"SystemExit({exc.code})"
        except Exception as exc:  # noqa: BLE001 - how the run ended is what is compared
            ends[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
    (out / "losses.json").write_text(json.dumps(losses))
    (out / "ends.json").write_text(json.dumps(ends, indent=2))


if __name__ == "__main__":
    main()
