"""The adapter interface: what the engine needs from a training framework.

The engine (config dialects, :class:`~trainprobe.schedule.Schedule`, probes' bookkeeping,
records, sinks, the session, alerts, tools) is written once. Everything that touches a
framework's tensors, modules, autograd or optimizers goes through one :class:`Backend`:

* statistics: ``stats(ops, eps)`` returns a :class:`StatsKernel` (tensor → one row of values
  in the order of ``ops``);
* module hooks: ``tensor_type`` (what :func:`~trainprobe.probes.tensor_walk.tensors_in` looks
  for), ``records_forward`` (training mode), ``grad_recording``/``wants_grad``/``hook_grad``
  (gradient hooks on the tensors of a call);
* models and optimizers: ``model_view`` (names of modules and parameters), ``unwrap_optimizer``
  (an object with the :class:`StepHooks` methods, which the session hooks), ``optimizer_moments``
  (Adam-family ``exp_avg``/``exp_avg_sq``), ``weight_grad_probe`` (gradients are where the
  frameworks differ most);
* process: ``rank``, ``distributed``;
* collectives: ``collective_api`` (a :class:`~trainprobe.probes.collectives.CollectiveApi`: the
  namespaces and primitive classes the ``cc`` probe wraps, how asynchronous calls complete).

Two adapters exist: :mod:`trainprobe.adapters.pytorch` (the default) and
:mod:`trainprobe.mindspore.backend`. :func:`backend_for` resolves a framework name without
importing a framework that was not asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from trainprobe.errors import ConfigError

if TYPE_CHECKING:
    from trainprobe.config.monitor_v2 import WeightGradConfig
    from trainprobe.probes.base import Probe, StepClock
    from trainprobe.probes.collectives import CollectiveApi
    from trainprobe.probes.model_view import ModelView, NamedParam


class Removable(Protocol):
    """A hook handle."""

    def remove(self) -> None:
        """Unregister the hook (idempotent)."""
        ...


class StatsKernel(Protocol):
    """Turns tensors into rows of statistics, in the order of ``ops``.

    A row is a ``list[float]`` (values already on the host) or, for the PyTorch adapter on an
    accelerator, a float64 device tensor that :mod:`trainprobe.records` copies to the host once
    per monitor per step.
    """

    ops: tuple[str, ...]

    def row(self, t: Any) -> Any:
        """Statistics of one tensor."""
        ...

    def rows(self, tensors: Sequence[Any]) -> list[Any]:
        """Statistics of several tensors, one row each, in order."""
        ...


class StepHooks(Protocol):
    """An optimizer as the session sees it: PyTorch's step hook methods (hooks are called with
    ``(optimizer, args, kwargs)`` just before and just after the optimizer updates the
    parameters)."""

    def register_step_pre_hook(self, hook: Callable[[Any, Any, Any], None]) -> Removable:
        """Call ``hook`` just before each optimizer step."""
        ...

    def register_step_post_hook(self, hook: Callable[[Any, Any, Any], None]) -> Removable:
        """Call ``hook`` just after each optimizer step."""
        ...


class Backend(Protocol):
    """One training framework, as the engine uses it."""

    name: str
    """Framework name as the config dialects spell it (``pytorch``, ``mindspore``)."""
    tensor_type: type | tuple[type, ...]
    """The framework's tensor class(es)."""

    def collective_api(self) -> CollectiveApi | None:
        """The framework's collectives for the ``cc`` monitor, or None where it cannot run."""
        ...

    def stats(self, ops: Sequence[str], eps: float) -> StatsKernel:
        """A statistics kernel for ``ops`` (names from :data:`trainprobe.stats.ops.ALL_OPS`)."""
        ...

    def records_forward(self, module: Any, record_eval_mode: bool) -> bool:
        """Whether a forward call of ``module`` is recorded (training, or ``record_eval_mode``)."""
        ...

    def grad_recording(self) -> bool:
        """Whether autograd records the operations running now (gradients will flow)."""
        ...

    def wants_grad(self, t: Any) -> bool:
        """Whether a gradient will be computed for ``t`` (only asked while recording)."""
        ...

    def hook_grad(self, t: Any, fn: Callable[[Any], None]) -> Removable | None:
        """Call ``fn(grad)`` when the gradient of ``t`` is computed, without changing it.
        Returns a handle the caller removes at the end of the step, or None when the hook lives
        and dies with the tensor."""
        ...

    def optimizer_moments(
        self, optimizer: Any, params: Sequence[NamedParam]
    ) -> tuple[list[tuple[NamedParam, str, Any]], bool]:
        """``(param, "exp_avg" | "exp_avg_sq", tensor)`` for every moment the optimizer keeps, and
        whether it keeps any per-parameter state at all."""
        ...

    def rank(self) -> int:
        """This process's rank (0 without a distributed setup)."""
        ...

    def distributed(self) -> bool:
        """Whether the framework's distributed communication is initialised."""
        ...

    def model_view(self, model: Any) -> ModelView:
        """Names of the modules and parameters of ``model`` (a module or a list of chunks).

        Raises:
            ConfigError: ``model`` is not a module or a list of them.
        """
        ...

    def unwrap_optimizer(self, optimizer: Any) -> Any:
        """The optimizer the probes read, which also has the :class:`StepHooks` methods.

        Raises:
            ConfigError: not an optimizer of this framework.
        """
        ...

    def weight_grad_probe(
        self,
        clock: StepClock,
        config: WeightGradConfig,
        params: list[NamedParam],
        micro_batches: int,
        view: ModelView,
        *,
        optimizer: Any = None,
        grad_of: Callable[[Any], Any] | None = None,
        keep_reduced: Callable[[NamedParam], bool] | None = None,
    ) -> Probe:
        """The ``weight_grad`` probe of this framework (``unreduced`` and ``reduced`` rows)."""
        ...


def backend_for(framework: str, where: str = "framework") -> Backend:
    """The adapter of ``framework`` (``pytorch`` or ``mindspore``), imported on first use.

    Raises:
        ConfigError: naming ``where``, when the framework is unknown, not installed, or
            installed but unusable.
    """
    if framework == "pytorch":
        from trainprobe.adapters.pytorch import TORCH

        return TORCH
    if framework == "mindspore":
        try:
            from trainprobe.mindspore.backend import MINDSPORE
        except ImportError as exc:
            raise ConfigError(f"{where}: 'mindspore' cannot be used: {exc}") from exc
        return MINDSPORE
    raise ConfigError(f"{where}: {framework!r} is not one of pytorch, mindspore")
