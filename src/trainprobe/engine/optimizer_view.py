"""What the engine needs from an optimizer: the :class:`OptimizerView` protocol.

Users pass whatever they step (a ``torch.optim.Optimizer``, a DeepSpeed/accelerate/Megatron
wrapper holding one in ``.optimizer``, a chain of them, a MindSpore optimizer cell); each adapter
turns it into one view, once, with ``Backend.optimizer_view`` (PyTorch:
:func:`trainprobe.backends.torch.optimizer.torch_optimizer_view`, MindSpore:
:func:`trainprobe.backends.mindspore.optimizer.unwrap_optimizer`). The probes and the session then read
the optimizer only through the view's methods: its parameters group by group, each parameter's
state and Adam-family moments, whether it keeps such state at all, its class name for messages,
the copy of a parameter that it really steps, and its step hooks.

This module imports no framework.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, Protocol

from trainprobe.engine.log import warn_once

MOMENTS: tuple[str, str] = ("exp_avg", "exp_avg_sq")
"""The Adam-family moments the probes read, as PyTorch names them (the MindSpore adapter renames
its own to these)."""

StepHook = Callable[[Any, Any, Any], None]
"""A step hook, called with ``(optimizer, args, kwargs)``."""


class Removable(Protocol):
    """A hook handle."""

    def remove(self) -> None:
        """Unregister the hook (idempotent)."""
        ...


class StepHooks(Protocol):
    """An optimizer as the session sees it: PyTorch's step hook methods (hooks are called with
    ``(optimizer, args, kwargs)`` just before and just after the optimizer updates the
    parameters)."""

    def register_step_pre_hook(self, hook: StepHook) -> Removable:
        """Call ``hook`` just before each optimizer step."""
        ...

    def register_step_post_hook(self, hook: StepHook) -> Removable:
        """Call ``hook`` just after each optimizer step."""
        ...


class OptimizerView(StepHooks, Protocol):
    """One optimizer (or a chain of them, seen as one) as the probes read it.

    Parameters are the model's: where a mixed-precision wrapper steps a float32 copy of a model
    parameter, the view lists the model parameter, looks its state up through the copy, and
    :meth:`copy_of` gives the copy.
    """

    @property
    def class_name(self) -> str:
        """The optimizer's class name for messages (a chain's classes joined by ``/``)."""
        ...

    def groups(self) -> list[Mapping[str, Any]]:
        """The parameter groups: ``params`` lists the model's parameters, the other keys are the
        group's settings (``lr``, ``betas``, ``eps``, ...)."""
        ...

    def state_of(self, param: Any) -> Mapping[str, Any] | None:
        """The optimizer's state of ``param`` (None when it has none yet); never adds an entry."""
        ...

    def moments_of(self, param: Any) -> dict[str, Any]:
        """The Adam-family moments of ``param`` it keeps (``exp_avg``/``exp_avg_sq`` → tensor),
        empty when none (yet)."""
        ...

    def keeps_state(self, needs: Collection[str], *, every: bool = True, stepped: bool = False) -> bool | None:
        """Whether the optimizer keeps the per-parameter state ``needs`` (all of the keys, or
        with ``every=False`` any one of them), decided from the optimizer as a whole, never from
        which parameters happen to have state yet. ``stepped``: asked just after a step.

        Returns:
            True (supported: parameters without state yet are skipped), False (never
            supported: warn and switch off) or None (cannot tell yet: ask again next step).
        """
        ...

    def copy_of(self, param: Any) -> Any:
        """The tensor the optimizer steps for the model parameter ``param`` (its float32 master
        copy or shard under a mixed-precision wrapper; ``param`` itself otherwise)."""
        ...


MemberHook = Callable[[frozenset[int]], None]
"""A hook around one optimizer's step among several, called with the ids of the tensors that
optimizer steps (:attr:`~trainprobe.engine.probes.base.StepClock.stepping`)."""


class SeveralOptimizers(Protocol):
    """A view of several optimizers stepped one after another in each training step (a GAN's
    ``[opt_d, opt_g]``, Megatron's ``ChainedOptimizer``): the session takes each one's rows
    around its own step."""

    @property
    def several(self) -> bool:
        """Whether the view holds more than one optimizer."""
        ...

    def register_member_hooks(self, pre: MemberHook, post: MemberHook, end: Callable[[], None]) -> Removable:
        """Call ``pre(ids)`` just before and ``post(ids)`` just after each step of each of the
        view's optimizers (``ids``: the tensors that one steps), and ``end()`` after the last
        optimizer's post-step hook: the last in the order passed ends each training step. One
        warning when an optimizer steps twice before it, or the last one steps while another
        has not (the order passed is not the order stepped)."""
        ...


def warn_unstepped(params: Iterable[tuple[str, Any]], optimizer: OptimizerView, call: str) -> list[str]:
    """Warn once when trainable model parameters (``(name, tensor)``, as the rows name them) are
    stepped by no optimizer passed, while some are (a GAN's ``optimizer=opt_g``): they get no
    weight_grad/optimizer/param rows. Nothing is said when the optimizer steps none of them
    (flat partitions, DeepSpeed ZeRO: its own rows name them). ``call``: the front door's call,
    for the advice. Returns the names left out."""
    stepped = {id(p) for group in optimizer.groups() for p in group["params"]}
    trainable = [(n, p) for n, p in params if getattr(p, "requires_grad", True)]
    left = [n for n, p in trainable if id(p) not in stepped]
    if not left or len(left) == len(trainable):
        return []
    shown = ", ".join(left[:6]) + (f", ... ({len(left)} in all)" if len(left) > 6 else "")
    warn_once(
        f"optimizer-leaves-out-{id(optimizer)}",
        f"trainprobe: {len(left)} trainable parameters of the model are stepped by no optimizer passed "
        f"({shown}); they get no weight_grad, optimizer or param rows. To monitor them, pass every "
        f"optimizer you step, in step order: {call}",
    )
    return left


def holds(keys: Iterable[str], needs: Collection[str], *, every: bool) -> bool:
    """Whether ``keys`` hold all of ``needs`` (or, with ``every=False``, any one of them)."""
    present = set(keys)
    return (all if every else any)(k in present for k in needs)


def chain_verdict(verdicts: Iterable[bool | None]) -> bool | None:
    """The :meth:`OptimizerView.keeps_state` verdict of a chain from those of its optimizers:
    True when one of them keeps the state, False when none ever will, None otherwise."""
    found = list(verdicts)
    if any(v is True for v in found):
        return True
    return False if all(v is False for v in found) else None
