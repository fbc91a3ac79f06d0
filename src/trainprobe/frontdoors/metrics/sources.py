"""What the monitor reads from the model and the optimizer, with public hooks only.

* :class:`InputTap`: a forward pre-hook and a forward hook on the root module. In training
  mode with gradients enabled it counts the samples (leading dimension of the first input
  tensor, ``input_ids`` preferred) and tokens (elements of that tensor when it holds integer
  ids) of every forward call, and keeps the loss the model returns (``output.loss`` or
  ``output["loss"]``, detached). Hooks never change inputs or outputs.
* :func:`norms`: per-tensor L2 norms by the engine's statistics kernel (float64 across rows,
  as every monitor's ``norm``), kept on the device on accelerators.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn

from trainprobe.backends.torch.stats import TensorStats
from trainprobe.engine.guard import guarded
from trainprobe.engine.log import error_once


def first_tensor(args: Sequence[Any], kwargs: Mapping[str, Any]) -> torch.Tensor | None:
    """The tensor that describes a batch: ``input_ids`` if given, else the first tensor
    argument, else the first tensor keyword argument (lists/tuples/dicts are searched)."""
    ids = kwargs.get("input_ids")
    if isinstance(ids, torch.Tensor):
        return ids
    for item in list(args) + list(kwargs.values()):
        found = _search(item, depth=0)
        if found is not None:
            return found
    return None


def _search(obj: Any, depth: int) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj
    if depth > 2:
        return None
    if isinstance(obj, Mapping):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        for item in obj:
            found = _search(item, depth + 1)
            if found is not None:
                return found
    return None


def batch_counts(obj: Any) -> tuple[int, int | None]:
    """``(samples, tokens)`` of a batch object (tokens None unless it holds integer ids)."""
    t = first_tensor((obj,), {}) if not isinstance(obj, Mapping) else first_tensor((), obj)
    if t is None or t.dim() == 0:
        return 0, None
    tokens = t.numel() if not (t.is_floating_point() or t.is_complex()) else None
    return int(t.shape[0]), tokens


def output_loss(output: Any) -> torch.Tensor | None:
    """The scalar loss a model returned (``.loss`` attribute or ``["loss"]`` item), if any."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss.detach().reshape(())
    return None


class InputTap:
    """Counts samples and tokens and keeps returned losses during one step.

    ``shares``: the model was called with ``num_items_in_batch`` (Hugging Face's gradient
    accumulation since transformers 4.46): each returned loss is then that micro-batch's share
    of the step's loss (its summed token losses divided by the whole step's token count), so the
    step's loss is their sum, not their mean."""

    def __init__(self, module: nn.Module) -> None:
        self.samples = 0
        self.tokens: int | None = 0
        self.losses: list[torch.Tensor] = []
        self.shares = False
        self.disabled = False
        before = guarded(self._before, off=lambda: self.disabled, fail=lambda exc: self._fail("samples"))
        after = guarded(self._after, off=lambda: self.disabled, fail=lambda exc: self._fail("loss"))
        self._handles = [
            module.register_forward_pre_hook(before, with_kwargs=True),
            module.register_forward_hook(after),
        ]

    @staticmethod
    def _active(module: nn.Module) -> bool:
        return module.training and torch.is_grad_enabled()

    def _fail(self, what: str) -> None:
        """A fault in either hook (the shared guard, :mod:`trainprobe.engine.guard`): both stop, one line."""
        self.disabled = True
        if what == "samples":
            error_once("metrics-input-tap", "trainprobe: counting samples failed; batch-size is no longer gathered")
        else:
            error_once("metrics-loss-tap", "trainprobe: reading the model's loss failed; it is no longer gathered")

    def _before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self._active(module):
            return
        if kwargs.get("num_items_in_batch") is not None:
            self.shares = True
        t = first_tensor(args, kwargs)
        if t is None or t.dim() == 0:
            return
        self.samples += int(t.shape[0])
        if self.tokens is not None:
            self.tokens = None if (t.is_floating_point() or t.is_complex()) else self.tokens + t.numel()

    def _after(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not self._active(module):
            return
        loss = output_loss(output)
        if loss is not None:
            self.losses.append(loss)

    def take(self) -> tuple[int, int | None, list[torch.Tensor], bool]:
        """``(samples, tokens, losses, shares)`` since the last call, and reset."""
        out = (self.samples, self.tokens if self.samples else None, self.losses, self.shares)
        self.samples, self.tokens, self.losses, self.shares = 0, 0, [], False
        return out

    def remove(self) -> None:
        """Remove both hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []


_NORMS = TensorStats(("norm",))


@torch.no_grad()
def norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor | list[float]:
    """L2 norm of each tensor, in order, computed by the engine's statistics kernel
    (:class:`~trainprobe.backends.torch.stats.TensorStats`): float64 accumulation across rows of
    256 elements, as the monitors' ``norm``. CPU tensors give host floats; accelerator tensors
    one float64 vector that stays on their device (moved to the CPU when they live on several
    devices).

    Raises:
        ValueError: a tensor holds no values (``device="meta"``; the metric is then switched off
            with one error line, as for any fault).
    """
    found = _NORMS.rows(tensors)
    if any(row is None for row in found):
        raise ValueError("a meta tensor holds no data to summarise")
    rows = cast("list[list[float] | torch.Tensor]", found)
    if all(isinstance(row, list) for row in rows):
        return [float(row[0]) for row in rows]
    parts = [
        row.reshape(-1)[:1] if isinstance(row, torch.Tensor) else torch.tensor(row[:1], dtype=torch.float64)
        for row in rows
    ]
    if len({p.device for p in parts}) > 1:
        parts = [p.to("cpu") for p in parts]
    return torch.cat(parts)
