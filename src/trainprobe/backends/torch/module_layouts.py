"""What the ``module`` monitor's rows are (``tensor_layout.json`` entries of monitor ``module``),
read once, at the first call of each monitored module.

Activations are only known while the model runs, so their layouts cannot be read at start as the
parameters' are. :class:`ModuleLayoutProbe` puts a one-shot forward pre-hook and forward hook on
each module the ``module`` monitor records; each reads the layouts of the call's tensors (their
shapes and, for a DTensor, its placements: metadata, no host sync, no collective) and removes
itself, so a module costs nothing from its second call on. The file is rewritten at the end of
a step that described new rows, never otherwise.

What an entry says (scope ``forward`` for ``input``/``output`` rows, ``backward`` for their
``grad_*`` rows):

* a DTensor activation: its placements at first sight (:func:`~trainprobe.backends.torch.placement.layout_of`:
  ``shard`` with offsets, ``replica``); its gradient rows are not described (the gradient's
  placements are not known before the backward pass);
* a plain tensor in a run of several ranks: ``rank_local``, the tensor this rank computed (its
  own batch piece under data parallelism, its local block under tensor parallelism with local
  outputs), forward and gradient rows alike: never merged;
* a plain tensor in a single process: ``whole``.

A module first called with different tensors later (another shape) keeps its first entries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from trainprobe.backends.torch.placement import PARTIAL, WHOLE, is_dtensor, layout_of
from trainprobe.engine.log import warn_once
from trainprobe.engine.probes.base import Probe, ProbeSpec, StepClock
from trainprobe.engine.probes.module import ModuleProbe, output_slots
from trainprobe.engine.tensor_layout import RANK_LOCAL, LayoutFile
from trainprobe.engine.tensor_walk import call_tensors

if TYPE_CHECKING:
    from trainprobe.engine.backend import Backend


class ModuleLayoutProbe(Probe):
    """Describes the rows of ``module_probe`` in ``file`` (module docstring); writes no rows."""

    name = "module_layout"

    def __init__(self, clock: StepClock, module_probe: ModuleProbe, file: LayoutFile, *, backend: Backend) -> None:
        super().__init__(clock, ProbeSpec(("norm",), 1e-8), backend=backend)
        self.module_probe = module_probe
        self.file = file
        self.pending = 0  # one-shot hooks not fired yet
        self._changed = False

    def attach(self) -> None:
        for _, name, module in self.module_probe.targets():
            pre: list[Any] = []
            post: list[Any] = []
            pre.append(module.register_forward_pre_hook(self.eager(self._inputs(name, pre)), with_kwargs=True, prepend=True))
            post.append(module.register_forward_hook(self.eager(self._outputs(name, post)), with_kwargs=True))
            self.keep(pre[0])
            self.keep(post[0])
            self.pending += 2

    def _inputs(self, name: str, handle: list[Any]) -> Any:
        def seen(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self._once(handle, lambda: self._describe(name, "input", call_tensors(args, kwargs, torch.Tensor)))

        return seen

    def _outputs(self, name: str, handle: list[Any]) -> Any:
        def seen(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            self._once(handle, lambda: self._describe(name, "output", output_slots(output, torch.Tensor)))

        return seen

    def _once(self, handle: list[Any], describe: Any) -> None:
        """Run ``describe`` and remove the hook (``handle[0]``) that called it; a failure is
        logged once and describes nothing (training goes on)."""
        if not handle:
            return
        handle.pop().remove()
        self.pending -= 1
        try:
            describe()
        except Exception as exc:  # noqa: BLE001 - a monitor must never break training
            warn_once("module-layout-failed", f"trainprobe: module rows are left out of {self.file.path} ({exc!r})")

    def _describe(self, name: str, kind: str, tensors: list[Any]) -> None:
        naming = self.module_probe.naming
        world = self.file.world_size
        grads = dict(naming.backward(name, kind, tensors))
        for row, t in naming.forward(name, kind, tensors):
            layout = activation_layout(t, world)
            if layout is None:
                continue
            self._changed |= self.file.add("module", row, layout, scope=naming.forward_scope)
            if layout["kind"] != RANK_LOCAL and layout["kind"] != WHOLE:
                continue  # a DTensor's gradient placements are not known yet
            for grad_row, g in grads.items():
                if g is t:
                    self._changed |= self.file.add("module", grad_row, layout, scope=naming.backward_scope)

    def end_step(self) -> None:
        """Rewrite the file when this step described new rows."""
        if not self._changed:
            return
        self._changed = False
        try:
            self.file.write(self.clock.step)
        except OSError as exc:
            warn_once("v2-layout-write", f"trainprobe: {self.file.path}: could not be written ({exc}); rows are still written")


def activation_layout(t: Any, world: int) -> dict[str, Any] | None:
    """The entry of activation ``t`` in a run of ``world`` ranks (module docstring); None for a
    partial sum (never a row)."""
    if is_dtensor(t):
        layout = layout_of(t)
        return None if layout["kind"] == PARTIAL else layout
    shape = [int(s) for s in t.shape]
    if world == 1:
        return {"kind": WHOLE, "numel": int(t.numel()), "local_shape": shape, "global_shape": shape,
                "offsets": [0] * len(shape)}
    return {"kind": RANK_LOCAL, "numel": int(t.numel()), "local_shape": shape, "global_shape": None, "offsets": None}
