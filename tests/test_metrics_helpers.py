"""Helpers of the training-metrics tests: a tiny GPT and reading event files back with
TensorBoard's own reader."""

from __future__ import annotations

from pathlib import Path

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainprobe.demo.gpt import GPTConfig, TinyGPT

TINY = GPTConfig(vocab_size=50, seq_len=16, d_model=32, n_heads=2, n_layers=2)


def tiny_gpt(seed: int = 0) -> tuple[TinyGPT, torch.optim.AdamW]:
    """A 2-layer d32 GPT and its AdamW, seeded."""
    torch.manual_seed(seed)
    model = TinyGPT(TINY)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def read_events(log_dir: Path) -> EventAccumulator:
    """Every scalar and text event of one folder."""
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def scalars(acc: EventAccumulator) -> dict[str, dict[int, float]]:
    """``{tag: {step: value}}``."""
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def texts(acc: EventAccumulator) -> dict[str, str]:
    """``{tag: text}`` of the TEXT page."""
    out = {}
    for tag in acc.Tags()["tensors"]:
        event = acc.Tensors(tag)[0]
        out[tag.removesuffix("/text_summary")] = event.tensor_proto.string_val[0].decode()
    return out
