"""``trainprobe.rerun_check``: does a training step reproduce bit for bit?

When a step goes wrong (a NaN, a spike) the first question is whether the numbers or the machine
are to blame. :func:`rerun_check` runs a step function (forward and backward of one batch, no
optimizer step) twice from the same state: the same RNG states (Python, NumPy, torch CPU and every
initialised CUDA device), the same inputs (the second call gets copies of the first call's
arguments as they were before it ran), the same gradients and buffers to start from. It then
compares, bit for bit, what the two calls produced: the loss the function returned, every
parameter's gradient and every buffer (BatchNorm's running statistics).

* reproducible: the fault is in the numerics (the data, the model, the recipe): ``trainprobe diff``
  it against a healthy run;
* not reproducible: the same computation gave two answers, a transient fault: suspect the device.

Afterwards the model, its gradients, its buffers and the RNG states are exactly as after the first
call alone (``leave="first"``, the default: the step ran once, training goes on), or as before the
check (``leave="before"``: a pure observation, for an ``on_anomaly`` callback). With
``zero_grad=True`` both calls start from no gradients (``.grad`` None), so that what is compared is
this step's gradients alone, not what earlier micro-batches accumulated.

Example (from an ``on_anomaly`` callback, see docs/acting_on_anomalies.md)::

    def step(x, y):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    verdict = trainprobe.rerun_check(step, x, y, model=model, leave="before", zero_grad=True)
    print(verdict.line())   # rerun_check: reproducible (13 values, bit for bit): a numerical fault; ...

Under ``torch.distributed`` every rank of ``group`` must call it together (the step's own
collectives run twice, and one small all-gather says which ranks saw a difference).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trainprobe.backends.torch.dist_info import ranks_flagging
from trainprobe.engine.errors import ConfigError

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class RerunVerdict:
    """What :func:`rerun_check` found.

    Attributes:
        reproducible: every compared value was bitwise equal on every rank.
        losses: the loss of the first and the second call (``float``; ``None`` when the step
            function returned no scalar).
        differed: what differed on this rank, in order: ``"loss"``, ``"grad <param name>"``,
            ``"buffer <buffer name>"``.
        compared: how many values were compared on this rank (loss, gradients, buffers).
        ranks: the ranks on which something differed (``()`` when reproducible; ``(0,)`` for
            a single process that differed).
    """

    reproducible: bool
    losses: tuple[float | None, float | None]
    differed: tuple[str, ...]
    compared: int
    ranks: tuple[int, ...]

    def line(self) -> str:
        """One line for a log or a terminal."""
        if self.reproducible:
            return (
                f"rerun_check: reproducible ({self.compared} values, bit for bit): a numerical fault; "
                "diff it against a healthy run"
            )
        shown = ", ".join(self.differed[:3]) + (f" and {len(self.differed) - 3} more" if len(self.differed) > 3 else "")
        where = f"; on ranks {', '.join(map(str, self.ranks))}" if self.ranks else ""
        mine = f" {shown} differed" if shown else " nothing differed here"
        return f"rerun_check: NOT reproducible:{mine}{where}: a transient fault; suspect the device"

    def to_json(self) -> dict[str, Any]:
        """The verdict as JSON-ready values."""
        return {
            "reproducible": self.reproducible,
            "losses": list(self.losses),
            "differed": list(self.differed),
            "compared": self.compared,
            "ranks": list(self.ranks),
        }


@dataclass
class _State:
    """Gradients, buffers and RNG states at one moment (copies)."""

    grads: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]
    rng: tuple[Any, ...]


def rerun_check(
    step_fn: Callable[..., Any],
    *args: Any,
    model: torch.nn.Module,
    group: Any = None,
    leave: str = "first",
    zero_grad: bool = False,
    **kwargs: Any,
) -> RerunVerdict:
    """Run ``step_fn(*args, **kwargs)`` twice from the same state and say whether it reproduced.

    Args:
        step_fn: forward and backward of one batch (no optimizer step); its return value, when
            a scalar tensor or number, is compared as the loss.
        model: the module whose parameters' gradients and whose buffers are compared and
            restored.
        group: the process group whose ranks call this together (default: the world, when
            ``torch.distributed`` is initialised).
        leave: ``"first"``: the state afterwards is that after the first call; ``"before"``: the
            state before the check (gradients, buffers, RNG states).
        zero_grad: both calls start from no gradients instead of the current ones.

    Returns:
        A :class:`RerunVerdict`.

    Raises:
        ConfigError: ``model`` is not a ``torch.nn.Module``; ``leave`` is neither ``"first"`` nor
            ``"before"``.
    """
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"rerun_check: model must be a torch.nn.Module, got {type(model).__name__}")
    if leave not in ("first", "before"):
        raise ConfigError(f"rerun_check: leave must be 'first' or 'before', got {leave!r}")
    untouched = _capture(model)
    if zero_grad:
        for p in model.parameters():
            p.grad = None
    before = _capture(model) if zero_grad else untouched
    pristine = _clone((args, kwargs))
    first_loss = _scalar(step_fn(*args, **kwargs))
    after_first = _capture(model)
    _restore(model, before)
    second_args, second_kwargs = pristine
    second_loss = _scalar(step_fn(*second_args, **second_kwargs))
    after_second = _capture(model)
    differed = _differences(first_loss, second_loss, after_first, after_second)
    _restore(model, after_first if leave == "first" else untouched)
    compared = (first_loss is not None) + len(after_first.grads) + len(after_first.buffers)
    ranks = ranks_flagging(bool(differed), group)
    return RerunVerdict(
        reproducible=not ranks,
        losses=(_as_float(first_loss), _as_float(second_loss)),
        differed=tuple(differed),
        compared=compared,
        ranks=ranks,
    )


def _capture(model: torch.nn.Module) -> _State:
    grads = {
        name: None if p.grad is None else p.grad.detach().clone() for name, p in model.named_parameters()
    }
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    return _State(grads, buffers, _rng_states())


def _restore(model: torch.nn.Module, state: _State) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            saved = state.grads.get(name)
            if saved is None:
                p.grad = None
            elif p.grad is None or p.grad.shape != saved.shape:
                p.grad = saved.clone()
            else:
                p.grad.copy_(saved)
        for name, b in model.named_buffers():
            if name in state.buffers:
                b.copy_(state.buffers[name])
    _set_rng_states(state.rng)


def _rng_states() -> tuple[Any, ...]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return (random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda)


def _set_rng_states(states: tuple[Any, ...]) -> None:
    py, npy, cpu, cuda = states
    random.setstate(py)
    np.random.set_state(npy)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def _clone(value: Any) -> Any:
    """``value`` with every tensor inside (tuples, lists, dicts) replaced by a copy."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(value.requires_grad)
    if isinstance(value, tuple):
        return tuple(_clone(v) for v in value)
    if isinstance(value, list):
        return [_clone(v) for v in value]
    if isinstance(value, Mapping):
        copied = {k: _clone(v) for k, v in value.items()}
        maker: Any = type(value)
        try:
            return maker(copied)
        except TypeError:  # a mapping class that cannot be built from a dict: a plain dict
            return copied
    return value


def _scalar(value: Any) -> torch.Tensor | None:
    """The step's loss as a detached one-element tensor, or None."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.detach().reshape(()).clone()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor(float(value), dtype=torch.float64)
    return None


def _as_float(value: torch.Tensor | None) -> float | None:
    return None if value is None else float(value)


def _same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Bitwise equality (NaN equals NaN of the same bits; -0.0 differs from 0.0)."""
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    as_int = _INT_OF_SIZE[a.element_size()]
    return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))


def _differences(
    first_loss: torch.Tensor | None, second_loss: torch.Tensor | None, first: _State, second: _State
) -> list[str]:
    out = [] if _same_bits(first_loss, second_loss) else ["loss"]
    out.extend(f"grad {n}" for n, g in first.grads.items() if not _same_bits(g, second.grads.get(n)))
    out.extend(f"buffer {n}" for n, b in first.buffers.items() if not _same_bits(b, second.buffers.get(n)))
    return out
