"""The PyTorch :class:`~trainprobe.engine.optimizer_view.OptimizerView`, and the one place that finds
the torch optimizers inside what users pass.

:func:`torch_optimizer_view` accepts:

* a ``torch.optim.Optimizer``;
* a wrapper holding one in ``.optimizer`` (DeepSpeed, accelerate, Megatron, Lightning's
  ``LightningOptimizer``), followed down to the innermost optimizer, also through wrappers that
  subclass ``Optimizer`` themselves (accelerate's ``AcceleratedOptimizer``);
* a chain of them in ``.chained_optimizers`` (Megatron's ``ChainedOptimizer``): seen as one
  optimizer whose groups and state are those of its members, in step order;
* mixed-precision wrappers that step float32 master copies of the model's parameters
  (Megatron's ``Float16OptimizerWithFloat16Params`` and ``DistributedOptimizer``): the view
  lists the model parameters and reads their state through the copies (:func:`master_pairs`).

An optimizer that steps an inner torch optimizer of its own inside its ``step()`` (torch's
``ZeroRedundancyOptimizer``, whose ``.optim`` steps this rank's partition of the parameters, then
broadcasts the updated values) is the one the view follows: its step hooks end the monitored
steps (a post-step hook runs after the broadcast), the inner optimizer's steps are neither
monitored steps of their own nor a replacement, and the inner optimizer's state (the moments
of the parameters this rank steps) is the one read (:func:`nested_optimizers`).

A replaced optimizer is followed. Step hooks registered through a view (the sessions' and Monitor
V1's: they end the monitored steps) sit on its first (pre-step) and last (post-step) optimizer;
while any is registered, a process-wide optimizer step pre-hook watches the other optimizers.
When a torch optimizer that is not in the view steps a parameter one of the view's optimizers
steps (the user made a new optimizer over the same parameters: a new learning-rate schedule, a
switch from SGD to Adam), it takes the place of those optimizers in the view, from that very
step: the hooks move to it (its pre-step hook runs in the same step), and every reader of the
view (optimizer state, parameter copies) sees it. One INFO line says so. An optimizer the view
left that steps the parameters again is not followed back (one warning: the monitored steps are
those of the optimizer followed). An optimizer over other parameters (a GAN's second one) is
left alone. Not followed: a new mixed-precision wrapper (its optimizer steps new master copies,
none of the view's).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.log import error_once, info_once, warn_once
from trainprobe.engine.optimizer_view import MOMENTS, MemberHook, Removable, StepHook, chain_verdict, holds

_TORCH_STATE_KEYS: dict[str, frozenset[str]] = {
    "Adam": frozenset({"step", "exp_avg", "exp_avg_sq"}),
    "AdamW": frozenset({"step", "exp_avg", "exp_avg_sq"}),
    "NAdam": frozenset({"step", "exp_avg", "exp_avg_sq", "mu_product"}),
    "RAdam": frozenset({"step", "exp_avg", "exp_avg_sq"}),
    "SparseAdam": frozenset({"step", "exp_avg", "exp_avg_sq"}),
    "Adamax": frozenset({"step", "exp_avg", "exp_inf"}),
    "SGD": frozenset({"momentum_buffer"}),
    "Adagrad": frozenset({"step", "sum"}),
    "Adadelta": frozenset({"step", "square_avg", "acc_delta"}),
    "ASGD": frozenset({"step", "eta", "mu", "ax"}),
    "RMSprop": frozenset({"step", "square_avg", "momentum_buffer", "grad_avg"}),
    "Rprop": frozenset({"step", "prev", "step_size"}),
    "LBFGS": frozenset({"func_evals", "n_iter", "d", "t", "old_dirs", "old_stps", "ro", "H_diag"}),
    "Adafactor": frozenset({"step", "row_var", "col_var", "variance"}),
}
"""Per-parameter state keys that ``torch.optim``'s own optimizers can keep, by class name."""

TORCH_STATE_KEYS: dict[type, frozenset[str]] = {
    cls: keys for name, keys in _TORCH_STATE_KEYS.items() if isinstance(cls := getattr(torch.optim, name, None), type)
}
"""The state keys of ``torch.optim`` classes present in this PyTorch (for optimizers that have
taken no step yet; subclasses are matched through their base classes)."""

_MASTER_LAYOUTS: tuple[tuple[str, str], ...] = (
    ("float16_groups", "fp32_from_float16_groups"),  # Megatron Float16OptimizerWithFloat16Params
    ("model_float16_groups", "shard_fp32_from_float16_groups"),  # Megatron DistributedOptimizer
    ("model_fp32_groups", "shard_fp32_groups"),  # its fp32 parameters' shards
)
"""Attribute pairs by which mixed-precision wrappers hold (model parameters, the optimizer's
copies of them), group by group."""

_DEPTH = 8
"""How many ``.optimizer`` attributes are followed at most."""


def innermost_optimizer(optimizer: object, where: str = "start(optimizer=...)") -> torch.optim.Optimizer:
    """The torch optimizer that really steps inside ``optimizer``: following ``.optimizer``
    attributes of wrappers (DeepSpeed, accelerate, Megatron, Lightning style), also of wrappers
    that subclass ``Optimizer`` themselves, down to the innermost ``torch.optim.Optimizer``.

    Raises:
        ConfigError: naming ``where``, when no ``torch.optim.Optimizer`` is found.
    """
    current, found = optimizer, None
    for _ in range(_DEPTH):
        if isinstance(current, torch.optim.Optimizer):
            found = current
        inner = getattr(current, "optimizer", None)
        if inner is None or inner is current:
            break
        current = inner
    if found is not None:
        return found
    raise ConfigError(
        f"{where}: expected a torch.optim.Optimizer, a wrapper holding one in .optimizer, or a chain "
        f"(.chained_optimizers), got {type(optimizer).__name__}"
    )


def _chain(optimizer: object) -> list[Any] | None:
    """The members of a chain of optimizers (a list or tuple of them, or ``.chained_optimizers``),
    or None.

    Raises:
        ConfigError: an empty list or tuple.
    """
    if isinstance(optimizer, (list, tuple)):
        if not optimizer:
            raise ConfigError("start(optimizer=...): an empty list; pass the optimizers you step, in step order")
        return list(optimizer)
    chain = getattr(optimizer, "chained_optimizers", None)
    return list(chain) if isinstance(chain, (list, tuple)) and chain else None


def unwrap_all(optimizer: object, where: str = "start(optimizer=...)") -> list[torch.optim.Optimizer]:
    """The torch optimizers inside ``optimizer`` (a chain's members in step order; one otherwise).

    Raises:
        ConfigError: naming ``where``, when none is found.
    """
    chain = _chain(optimizer)
    if chain is not None:
        return [o for inner in chain for o in unwrap_all(inner, where)]
    return [innermost_optimizer(optimizer, where)]


def master_pairs(optimizer: object) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(model parameter, the copy the inner optimizer steps)`` for every parameter a
    mixed-precision wrapper (Megatron's ``Float16OptimizerWithFloat16Params`` and
    ``DistributedOptimizer``, chains of them) keeps a float32 master copy or shard of; empty for
    anything else. DeepSpeed ZeRO keeps flat partitions with no per-parameter copy: not mapped."""
    chain = _chain(optimizer)
    if chain is not None:
        return [pair for inner in chain for pair in master_pairs(inner)]
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for model_attr, master_attr in _MASTER_LAYOUTS:
        models, masters = getattr(optimizer, model_attr, None), getattr(optimizer, master_attr, None)
        if not isinstance(models, (list, tuple)) or not isinstance(masters, (list, tuple)):
            continue
        for model_group, master_group in zip(models, masters):
            pairs += [(m, c) for m, c in zip(model_group, master_group) if m is not c]
    return pairs


def nested_optimizers(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers ``optimizer`` steps inside its own ``step()`` and keeps the state in:
    ``ZeroRedundancyOptimizer``'s ``.optim`` (this rank's partition of the parameters), through
    any depth; empty for an ordinary optimizer."""
    out: list[torch.optim.Optimizer] = []
    current: object = optimizer
    for _ in range(_DEPTH):
        inner = getattr(current, "optim", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner is current or inner is optimizer:
            break
        out.append(inner)
        current = inner
    return out


def torch_optimizer_view(optimizer: object, where: str = "start(optimizer=...)") -> TorchOptimizerView:
    """The view of what the user steps (see the module docstring); a view is returned as is.

    Raises:
        ConfigError: naming ``where``, when no torch optimizer is found in ``optimizer``.
    """
    if isinstance(optimizer, TorchOptimizerView):
        return optimizer
    return TorchOptimizerView(unwrap_all(optimizer, where), master_pairs(optimizer))


class TorchOptimizerView:
    """:class:`~trainprobe.engine.optimizer_view.OptimizerView` over torch optimizers (a chain's
    members, in step order), seen through the model's parameters where ``pairs`` maps them to
    the master copies the optimizers step.

    Attributes:
        optimizers: the torch optimizers, in step order (the first one's step pre-hook and the
            last one's post-hook are the view's); a replaced one is followed (see the module
            docstring): the list then names the optimizer that took its place.
    """

    def __init__(
        self, optimizers: Sequence[torch.optim.Optimizer], pairs: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()
    ) -> None:
        if not optimizers:
            raise ValueError("TorchOptimizerView needs at least one optimizer")
        self.optimizers = list(optimizers)
        self._model_of = {id(copy): model for model, copy in pairs}
        self._copy_of = {id(model): copy for model, copy in pairs}
        self._hooks: list[_ViewHook] = []  # the step hooks registered through the view
        self._members: list[_MemberHooks] = []  # the per-optimizer hooks registered through it
        self._watch: Removable | None = None  # the process-wide pre-hook, while hooks are registered
        self._stepped = _param_ids(self.optimizers)  # ids of the tensors the view's optimizers step
        self._shares: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, bool]] = (
            weakref.WeakKeyDictionary()
        )  # another optimizer -> (its tensor count when judged, whether it steps one of ours)
        self._left: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # optimizers replaced

    @property
    def class_name(self) -> str:
        return "/".join(dict.fromkeys(type(o).__name__ for o in self.optimizers))

    def groups(self) -> list[Mapping[str, Any]]:
        groups: list[Mapping[str, Any]] = [g for o in self.optimizers for g in o.param_groups]
        if not self._model_of:
            return groups
        return [_ModelGroup(g, self._model_of) for g in groups]

    def state_of(self, param: Any) -> Mapping[str, Any] | None:
        copy = self._copy_of.get(id(param), param)
        for o in self.optimizers:
            for holder in (o, *nested_optimizers(o)):
                if copy in holder.state:  # never insert into the state's defaultdict
                    entry: Mapping[str, Any] = holder.state[copy]
                    return entry
        return None

    def moments_of(self, param: Any) -> dict[str, Any]:
        entry = self.state_of(param)
        if not entry:
            return {}
        return {m: value for m in MOMENTS if isinstance(value := entry.get(m), torch.Tensor)}

    def keeps_state(self, needs: Collection[str], *, every: bool = True, stepped: bool = False) -> bool | None:
        """See :meth:`~trainprobe.engine.optimizer_view.OptimizerView.keeps_state`. Each optimizer's
        non-empty state entries, for any of its parameters, are authoritative: True when one
        holds the keys, False when none does (state of another kind, such as SGD's
        ``momentum_buffer``). With no state yet: the keys its ``torch.optim`` class (or base
        class) keeps; for other classes False once it has ``stepped`` while one of its
        parameters had a gradient (it keeps no per-parameter state at all), else None. A chain
        keeps the state when one of its optimizers does; an optimizer with an inner one
        (:func:`nested_optimizers`) when its inner one does."""
        return chain_verdict(
            _keeps_state(_state_keeper(o), needs, every=every, stepped=stepped) for o in self.optimizers
        )

    def copy_of(self, param: Any) -> Any:
        return self._copy_of.get(id(param), param)

    def register_step_pre_hook(self, hook: StepHook) -> Removable:
        """``hook`` before each step of the first optimizer (moved to a replacement)."""
        return self._add(_ViewHook(self, hook, post=False))

    def register_step_post_hook(self, hook: StepHook) -> Removable:
        """``hook`` after each step of the last optimizer (moved to a replacement)."""
        return self._add(_ViewHook(self, hook, post=True))

    @property
    def several(self) -> bool:
        """Whether the view holds several optimizers (then :meth:`register_member_hooks`)."""
        return len(self.optimizers) > 1

    def stepped_by(self, optimizer: torch.optim.Optimizer) -> frozenset[int]:
        """Ids of the tensors ``optimizer`` steps: its own and the model parameters they copy."""
        ids = _param_ids([optimizer])
        return frozenset(ids | {id(self._model_of[i]) for i in ids if i in self._model_of})

    def register_member_hooks(self, pre: MemberHook, post: MemberHook, end: Callable[[], None]) -> Removable:
        """See :meth:`~trainprobe.engine.optimizer_view.SeveralOptimizers.register_member_hooks`."""
        return self._add_members(_MemberHooks(self, pre, post, end))

    def _add_members(self, hooks: _MemberHooks) -> _MemberHooks:
        self._members.append(hooks)
        if self._watch is None:
            self._watch = register_optimizer_step_pre_hook(self._any_step)
        return hooks

    # -- following a replaced optimizer (see the module docstring) ---------------------------
    def _add(self, hook: _ViewHook) -> _ViewHook:
        self._hooks.append(hook)
        if self._watch is None:
            self._watch = register_optimizer_step_pre_hook(self._any_step)
        return hook

    def _removed(self, hook: _ViewHook | _MemberHooks) -> None:
        """``hook`` was removed; the last one takes the process-wide pre-hook with it."""
        if hook in self._hooks:
            self._hooks.remove(hook)
        if hook in self._members:
            self._members.remove(hook)
        if not self._hooks and not self._members and self._watch is not None:
            self._watch.remove()
            self._watch = None

    def _any_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """The process-wide step pre-hook: follow ``optimizer`` when it replaced ours. Runs
        before the optimizer's own pre-hooks, so hooks moved to it run in this step. Never
        raises into training."""
        if any(o is optimizer for o in self.optimizers) or self._nested(optimizer) or not self._steps_ours(optimizer):
            return
        try:
            if optimizer in self._left:
                warn_once(
                    f"optimizer-left-steps-again-{id(self)}",
                    f"trainprobe: {type(optimizer).__name__}, which {self.class_name} replaced, steps the "
                    f"monitored parameters again; the monitor follows {self.class_name} only (its steps end "
                    f"the monitored steps, its state is the one read); pass the optimizer you step to the "
                    "monitor if that is not the one",
                )
                return
            self.follow(optimizer)
        except Exception as exc:  # noqa: BLE001 - a monitor must never break training
            error_once(f"optimizer-follow-{id(self)}", f"trainprobe: following a new optimizer failed: {exc!r}")

    def _nested(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` is stepped by one of the view's optimizers inside its own step
        (:func:`nested_optimizers`): part of that step, not a replacement."""
        return any(inner is optimizer for o in self.optimizers for inner in nested_optimizers(o))

    def _steps_ours(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` steps a tensor one of the view's optimizers steps (judged again
        when its number of tensors changes)."""
        count = sum(len(g["params"]) for g in optimizer.param_groups)
        known = self._shares.get(optimizer)
        if known is not None and known[0] == count:
            return known[1]
        stepped = self._stepped
        verdict = any(id(p) in stepped for g in optimizer.param_groups for p in g["params"])
        self._shares[optimizer] = (count, verdict)
        return verdict

    def follow(self, new: torch.optim.Optimizer) -> None:
        """Put ``new`` in the place of the view's optimizers that step a tensor it steps (the
        first of them; the others leave the chain) and move the view's step hooks to the
        optimizers that are now first and last."""
        theirs = _param_ids([new])
        before = self.class_name
        optimizers: list[torch.optim.Optimizer] = []
        for o in self.optimizers:
            if not theirs.isdisjoint(_param_ids([o])):
                self._left.add(o)
                o = new
            if not any(o is kept for kept in optimizers):
                optimizers.append(o)
        self.optimizers = optimizers
        self._stepped = _param_ids(optimizers)
        self._shares = weakref.WeakKeyDictionary()
        for hook in list(self._hooks):
            hook.move()
        for members in list(self._members):
            members.move()
        info_once(
            f"optimizer-followed-{id(self)}-{id(new)}",
            f"trainprobe: a new optimizer ({type(new).__name__}) steps the monitored parameters in place of "
            f"{before}; the monitor follows it from this step on (its steps end the monitored steps, its state "
            "is the one read)",
        )


class _ViewHook:
    """A step hook registered through a :class:`TorchOptimizerView`: on its first (pre-step) or
    last (post-step) optimizer, moved there again when the view follows a replaced one."""

    def __init__(self, view: TorchOptimizerView, hook: StepHook, *, post: bool) -> None:
        self.view = view
        self.hook = hook
        self.post = post
        self.owner = self._owner()
        self.handle = self._register()
        self.removed = False

    def _owner(self) -> torch.optim.Optimizer:
        return self.view.optimizers[-1] if self.post else self.view.optimizers[0]

    def _register(self) -> Removable:
        if self.post:
            return self.owner.register_step_post_hook(self.hook)
        return self.owner.register_step_pre_hook(self.hook)

    def move(self) -> None:
        """Onto the view's optimizer of now, if that changed (the order of the moved hooks is
        the order they were registered in)."""
        if self.removed or self._owner() is self.owner:
            return
        self.handle.remove()
        self.owner = self._owner()
        self.handle = self._register()

    def remove(self) -> None:
        """Unregister the hook (idempotent)."""
        if self.removed:
            return
        self.removed = True
        self.handle.remove()
        self.view._removed(self)


class _MemberHooks:
    """Hooks around each step of each optimizer of a view (see
    :meth:`~trainprobe.engine.optimizer_view.SeveralOptimizers.register_member_hooks`), moved
    onto the view's optimizers of now when it follows a replaced one."""

    def __init__(self, view: TorchOptimizerView, pre: MemberHook, post: MemberHook, end: Callable[[], None]) -> None:
        self.view = view
        self.pre, self.post, self.end = pre, post, end
        self.removed = False
        self._handles: list[Removable] = []
        self._owners: list[torch.optim.Optimizer] = []
        self._stepped: list[torch.optim.Optimizer] = []  # the optimizers that stepped in this training step
        self._register()

    def _register(self) -> None:
        self._owners = list(self.view.optimizers)
        for o in self._owners:
            self._handles.append(o.register_step_pre_hook(self._before))
            self._handles.append(o.register_step_post_hook(self._after))

    def _before(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if any(o is optimizer for o in self._stepped):
            warn_once(
                f"optimizer-steps-twice-{id(self)}-{id(optimizer)}",
                f"trainprobe: {type(optimizer).__name__} stepped again before {self._last_name()} (the last of the "
                "optimizers passed) ended the training step; each of its updates in that step gets its own "
                "weight_grad/optimizer/param rows under the same step number",
            )
        self.pre(self.view.stepped_by(optimizer))

    def _after(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._stepped.append(optimizer)
        self.post(self.view.stepped_by(optimizer))
        if optimizer is not self._owners[-1]:
            return
        missing = [o for o in self._owners if not any(s is o for s in self._stepped)]
        self._stepped = []
        if missing:
            warn_once(
                f"optimizer-not-stepped-{id(self)}",
                f"trainprobe: {self._last_name()}, the last of the optimizers passed, ended a training step in "
                f"which {', '.join(type(o).__name__ for o in missing)} did not step (its rows are then filed "
                "under the next step); pass the optimizers in the order each training step steps them",
            )
        self.end()

    def _last_name(self) -> str:
        return type(self._owners[-1]).__name__

    def move(self) -> None:
        """Onto the view's optimizers of now, if they changed."""
        if self.removed or self._owners == self.view.optimizers:
            return
        self._unregister()
        self._register()

    def _unregister(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()

    def remove(self) -> None:
        """Unregister the hooks (idempotent)."""
        if self.removed:
            return
        self.removed = True
        self._unregister()
        self.view._removed(self)


def _param_ids(optimizers: Sequence[torch.optim.Optimizer]) -> set[int]:
    """Ids of the tensors ``optimizers`` step."""
    return {id(p) for o in optimizers for g in o.param_groups for p in g["params"]}


def _state_keeper(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose ``state`` holds what ``optimizer`` keeps: its innermost nested one
    (:func:`nested_optimizers`), or itself."""
    nested = nested_optimizers(optimizer)
    return nested[-1] if nested else optimizer


def _keeps_state(
    optimizer: torch.optim.Optimizer, needs: Collection[str], *, every: bool, stepped: bool
) -> bool | None:
    """:meth:`TorchOptimizerView.keeps_state` of one torch optimizer."""
    seen = False
    for entry in optimizer.state.values():
        if isinstance(entry, Mapping) and entry:
            seen = True
            if holds([k for k, v in entry.items() if v is not None], needs, every=every):
                return True
    if seen:
        return False
    for cls in type(optimizer).__mro__:
        keys = TORCH_STATE_KEYS.get(cls)
        if keys is not None:
            return holds(keys, needs, every=every)
    if stepped and any(p.grad is not None for g in optimizer.param_groups for p in g["params"]):
        return False
    return None


class _ModelGroup(Mapping[str, Any]):
    """A live view of a parameter group whose ``params`` name model parameters."""

    def __init__(self, group: Mapping[str, Any], model_of: dict[int, torch.Tensor]) -> None:
        self._group = group
        self._model_of = model_of

    def __getitem__(self, key: str) -> Any:
        value = self._group[key]
        if key == "params":
            return [self._model_of.get(id(p), p) for p in value]
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._group)

    def __len__(self) -> int:
        return len(self._group)
