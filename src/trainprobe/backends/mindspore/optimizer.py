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

from collections.abc import Collection, Mapping
from typing import Any

from mindspore import nn

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.optimizer_view import MOMENTS, StepHook, holds

MOMENT_ATTRIBUTES: tuple[tuple[str, str], ...] = (
    ("moment1", "moment2"),
    ("moments1", "moments2"),
    ("exp_avg", "exp_avg_sq"),
)
"""``(first, second)`` moment attribute names of MindSpore's Adam-family optimizers."""


class MindSporeOptimizer:
    """Wraps a MindSpore optimizer cell: its :class:`~trainprobe.engine.optimizer_view.OptimizerView`.

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
        self._positions: dict[int, int] | None = None

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

    def groups(self) -> list[Mapping[str, Any]]:
        """One group holding :attr:`parameters` (MindSpore's group settings are not read)."""
        return [{"params": self.parameters}]

    def state_of(self, param: Any) -> Mapping[str, Any] | None:
        """The moments of ``param`` (MindSpore keeps no other per-parameter state the probes read)."""
        return self.moments_of(param) or None

    def moments_of(self, param: Any) -> dict[str, Any]:
        """``exp_avg``/``exp_avg_sq`` of ``param``, empty for a parameter the optimizer does not
        hold or an optimizer without Adam-family moments."""
        pair = self._moment_tuples()
        i = self._position().get(id(param)) if pair is not None else None
        if pair is None or i is None:
            return {}
        return {"exp_avg": pair[0][i], "exp_avg_sq": pair[1][i]}

    def _position(self) -> dict[int, int]:
        if self._positions is None:
            self._positions = {id(p): i for i, p in enumerate(self.parameters)}
        return self._positions

    def keeps_state(self, needs: Collection[str], *, every: bool = True, stepped: bool = False) -> bool | None:
        """Whether its moment tuples hold ``needs`` (decided from the optimizer's attributes,
        known from the start: never None)."""
        return holds(MOMENTS if self._moment_tuples() is not None else (), needs, every=every)

    def copy_of(self, param: Any) -> Any:
        """``param`` itself (MindSpore optimizers step the model's parameters)."""
        return param

    def moments(self) -> dict[str, list[Any]] | None:
        """``{"exp_avg": [...], "exp_avg_sq": [...]}`` aligned with :attr:`parameters`, or None
        for an optimizer without Adam-family moments."""
        pair = self._moment_tuples()
        return None if pair is None else {"exp_avg": list(pair[0]), "exp_avg_sq": list(pair[1])}

    def _moment_tuples(self) -> tuple[Any, Any] | None:
        """The cell's (first, second) moment tuples, aligned with :attr:`parameters`, or None."""
        for first, second in MOMENT_ATTRIBUTES:
            m, v = getattr(self.cell, first, None), getattr(self.cell, second, None)
            if m is not None and v is not None and len(m) == len(v) == len(self.parameters):
                return m, v
        return None


def _gradients(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    grads = args[0] if args else kwargs.get("gradients")
    return tuple(grads) if isinstance(grads, (tuple, list)) else None


def unwrap_optimizer(optimizer: Any, where: str = "start(optimizer=...)") -> MindSporeOptimizer:
    """The view of the MindSpore optimizer inside ``optimizer``: the cell itself, a wrapper
    holding it in ``.optimizer``, or a :class:`MindSporeOptimizer`.

    Raises:
        ConfigError: naming ``where``, when no MindSpore optimizer is found.
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
        f"{where}: expected a MindSpore optimizer (mindspore.nn.Optimizer or a "
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
