"""``print_struct`` and ``stack_info``.

* :class:`StructProbe` (``print_struct``): during the first step, the structure of every module's
  inputs, outputs and their gradients, written after that step to
  ``<MONITOR_OUTPUT_DIR>/module_struct/rank<r>/module_struct.json`` in the reference's format::

      "0:fc1": {"input": {"config": "tuple[1]", "0": "size=(4, 6), dtype=torch.float32"}, ...}

  ``input_grad``/``output_grad`` describe the inputs/outputs that require a gradient (a
  gradient has its tensor's size and dtype). The front door then ends the run with exit code 0.
* :class:`StackProbe` (``stack_info``): the call stack of every module's first forward call in
  the first collected step, written to ``<run folder>/stack_info.csv`` (columns ``module_name,
  stack_info``; modules by their written name with the ``<vpp_stage>:`` prefix, the root as
  ``0:``), frames of torch, mindspore and trainprobe left out.
"""

from __future__ import annotations

import csv
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainprobe.backends.torch.backend import TORCH
from trainprobe.engine.probes.base import Probe, StepClock
from trainprobe.engine.probes.model_view import ModelView
from trainprobe.engine.sinks.files import write_json_atomically
from trainprobe.engine.tensor_walk import call_tensors, tensors_in


def _describe(value: Any, tensors: list[torch.Tensor]) -> dict[str, str]:
    config = "tensor" if isinstance(value, torch.Tensor) else f"tuple[{len(tensors)}]"
    out = {"config": config}
    for i, t in enumerate(tensors):
        out[str(i)] = f"size={tuple(t.shape)}, dtype={t.dtype}"
    return out


class StructProbe(Probe):
    """Records the module structure during the first step (see the module docstring)."""

    name = "print_struct"

    def __init__(self, clock: StepClock, view: ModelView, root: Path, rank: int) -> None:
        super().__init__(clock, ("norm",), 1e-8, backend=TORCH)
        self.view = view
        self.first_step = clock.step
        self.path = root / "module_struct" / f"rank{rank}" / "module_struct.json"
        self.struct: dict[str, dict[str, Any]] = {}
        self._written = False

    def attach(self) -> None:
        for _, name, module in self.view.modules():
            self.keep(module.register_forward_hook(self.eager(self._hook(name)), with_kwargs=True))

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
            if self.clock.step != self.first_step or name in self.struct:
                return
            inputs = call_tensors(args, kwargs, torch.Tensor)
            outputs = list(tensors_in(out, 0, torch.Tensor))
            entry = {"input": _describe(args[0] if len(args) == 1 and not kwargs else args, inputs)}
            entry["output"] = _describe(out, outputs)
            entry["input_grad"] = _describe(None, [t for t in inputs if t.requires_grad])
            entry["output_grad"] = _describe(None, [t for t in outputs if t.requires_grad])
            self.struct[name] = entry

        return hook

    def done(self) -> bool:
        """After the first step: write the file (once) and return True."""
        if self.clock.step <= self.first_step:
            return False
        if not self._written:
            write_json_atomically(self.path, self.struct, indent=4)
            self._written = True
        return True


_LIBRARY_DIRS = tuple(f"{os.sep}{name}{os.sep}" for name in ("torch", "mindspore", "trainprobe"))


def _user_stack() -> str:
    frames = [f for f in traceback.extract_stack()[:-2] if not any(d in f.filename for d in _LIBRARY_DIRS)]
    return "\n".join(f"File {f.filename}, line {f.lineno}, in {f.name}" for f in frames[-12:])


class StackProbe(Probe):
    """Call stacks of the modules' first forward calls in the first collected step."""

    name = "stack_info"

    def __init__(
        self, clock: StepClock, view: ModelView, folder: Path, names: Callable[[str], str] | None = None
    ) -> None:
        super().__init__(clock, ("norm",), 1e-8, backend=TORCH)
        self.view = view
        self.names = names or (lambda name: name)
        self.path = folder / "stack_info.csv"
        self.stacks: dict[str, str] = {}
        self._finished = False

    def attach(self) -> None:
        for _, name, module in self.view.modules():
            self.keep(module.register_forward_pre_hook(self.eager(self._hook(name))))

    def _hook(self, name: str) -> Any:
        written = self.names(name)

        def hook(module: nn.Module, args: Any) -> None:
            if self.active and not self._finished and written not in self.stacks:
                self.stacks[written] = _user_stack()

        return hook

    def end_step(self) -> None:
        if self._finished or not self.stacks:
            return
        self._finished = True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("w", newline="", encoding="utf-8") as fh:
            out = csv.writer(fh)
            out.writerow(["module_name", "stack_info"])
            out.writerows(self.stacks.items())
        self.detach()
