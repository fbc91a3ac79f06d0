"""A MindSpore optimizer as the engine sees it: step hooks, its gradients, its moments.

A MindSpore optimizer is a ``Cell`` called with the gradients (``optimizer(grads)``, also
inside ``nn.TrainOneStepCell``). Its forward pre-hook is the step pre-hook (the gradients it
receives are the ``reduced`` gradients) and its forward hook the step post-hook; both are
removed through their handles, so nothing is patched.

Adam-family moments are read from the optimizer's parameter tuples, aligned with
``optimizer.parameters`` and renamed as PyTorch names them: ``moment1``/``moment2``
(``nn.Adam``, ``nn.LazyAdam``), ``moments1``/``moments2`` (``nn.AdamWeightDecay``, ``nn.Lamb``)
and ``exp_avg``/``exp_avg_sq`` (``mint.optim``, ``experimental.optim``) become
``exp_avg``/``exp_avg_sq``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mindspore import nn

from trainprobe.errors import ConfigError

MOMENT_ATTRIBUTES: tuple[tuple[str, str], ...] = (
    ("moment1", "moment2"),
    ("moments1", "moments2"),
    ("exp_avg", "exp_avg_sq"),
)
"""``(first, second)`` moment attribute names of MindSpore's Adam-family optimizers."""

StepHook = Callable[[Any, Any, Any], None]


class MindSporeOptimizer:
    """Wraps a MindSpore optimizer cell.

    Attributes:
        cell: the optimizer (``nn.Optimizer`` or ``experimental.optim.Optimizer``).
        parameters: its parameters, in the order of the gradients it is called with.
        gradients: the gradients of the call in progress (between the pre- and post-hooks of a
            step; None otherwise).
        class_name: the optimizer's class name, for messages.
    """

    def __init__(self, cell: nn.Cell) -> None:
        self.cell = cell
        self.parameters: list[Any] = list(cell.parameters)
        self.gradients: tuple[Any, ...] | None = None
        self.class_name = type(cell).__name__

    def register_step_pre_hook(self, hook: StepHook) -> Any:
        """Call ``hook(self, args, kwargs)`` when the optimizer is called, before it updates
        the parameters; :attr:`gradients` is set first."""

        def pre(cell: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self.gradients = _gradients(args, kwargs)
            hook(self, args, kwargs)

        return self.cell.register_forward_pre_hook(pre, with_kwargs=True)

    def register_step_post_hook(self, hook: StepHook) -> Any:
        """Call ``hook(self, args, kwargs)`` after the optimizer has updated the parameters."""

        def post(cell: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            try:
                hook(self, args, kwargs)
            finally:
                self.gradients = None

        return self.cell.register_forward_hook(post, with_kwargs=True)

    def moments(self) -> dict[str, list[Any]] | None:
        """``{"exp_avg": [...], "exp_avg_sq": [...]}`` aligned with :attr:`parameters`, or None
        for an optimizer without Adam-family moments."""
        for first, second in MOMENT_ATTRIBUTES:
            m, v = getattr(self.cell, first, None), getattr(self.cell, second, None)
            if m is not None and v is not None and len(m) == len(v) == len(self.parameters):
                return {"exp_avg": list(m), "exp_avg_sq": list(v)}
        return None


def _gradients(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    grads = args[0] if args else kwargs.get("gradients")
    return tuple(grads) if isinstance(grads, (tuple, list)) else None


def unwrap_optimizer(optimizer: Any) -> MindSporeOptimizer:
    """The MindSpore optimizer inside ``optimizer``: the cell itself, a wrapper holding it in
    ``.optimizer``, or a :class:`MindSporeOptimizer`.

    Raises:
        ConfigError: no MindSpore optimizer is found.
    """
    current = optimizer
    for _ in range(8):
        if isinstance(current, MindSporeOptimizer):
            return current
        if isinstance(current, nn.Cell) and hasattr(current, "parameters") and _is_optimizer(current):
            return MindSporeOptimizer(current)
        inner = getattr(current, "optimizer", None)
        if inner is None or inner is current:
            break
        current = inner
    raise ConfigError(
        "start(optimizer=...): expected a MindSpore optimizer (mindspore.nn.Optimizer or a "
        f"mindspore.experimental/mint optimizer) or a wrapper holding one in .optimizer, got {type(optimizer).__name__}"
    )


def _is_optimizer(cell: nn.Cell) -> bool:
    if isinstance(cell, nn.Optimizer):
        return True
    try:
        from mindspore.experimental.optim import Optimizer as ExperimentalOptimizer
    except ImportError:  # older MindSpore
        return False
    return isinstance(cell, ExperimentalOptimizer)
