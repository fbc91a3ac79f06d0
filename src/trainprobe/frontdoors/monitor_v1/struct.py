"""``print_struct`` and ``stack_info``.

* :class:`StructProbe` (``print_struct``): during the first step, the structure of every module's
  inputs, outputs and their gradients, written after that step to
  ``<MONITOR_OUTPUT_DIR>/module_struct/rank<r>/module_struct.json`` as the reference writes it
  (users copy its names into ``targets``)::

      "0:fc1": {"input": {"config": "list[1]", "0": "size=(4, 6), dtype=torch.float32"},
                "output": {"config": "tensor", "tensor": "size=(4, 8), dtype=torch.float32"},
                "input_grad": {"config": "tuple[1]", "0": "<class 'NoneType'>"},
                "output_grad": {"config": "tuple[1]", "0": "size=(4, 8), dtype=torch.float32"}}

  Modules go by their written names (squashed with ``squash_name``; each chunk's root is
  ``0:``). ``input`` lists the call's top-level tensor arguments, positional then keyword
  (``list[N]``); ``output`` is ``tensor`` for one tensor, ``tuple[N]``/``list[N]`` for a sequence
  (a non-tensor item written as its type, ``<class 'NoneType'>``), else its type alone.
  ``input_grad`` has one item per positional argument and ``output_grad`` one per output (a
  single tensor counts as one): the gradient's size and dtype where the tensor requires a
  gradient, ``<class 'NoneType'>`` where it does not, as a module's full backward hook receives
  them; a module none of whose outputs requires a gradient (frozen, or under ``no_grad``) has no
  gradient entries. A module called several times is described by its first call. The front door
  then ends the run with exit code 0.
* :class:`StackProbe` (``stack_info``): the call stack of every module's first forward call in
  the first collected step, written to ``<run folder>/stack_info.csv`` (columns ``module_name,
  stack_info``; modules by their written name with the ``<vpp_stage>:`` prefix, the root as
  ``0:``), frames of torch, mindspore and trainprobe left out: frames whose file lies inside
  the installed package's directory (user code in a folder that merely has such a name, as a
  clone named ``trainprobe``, keeps its frames).
"""

from __future__ import annotations

import csv
import functools
import importlib.util
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainprobe.backends.torch.backend import TORCH
from trainprobe.engine.folders import check_output_folder, make_output_folder
from trainprobe.engine.probes.base import Probe, ProbeSpec, StepClock
from trainprobe.engine.probes.model_view import ModelView
from trainprobe.engine.sinks.files import write_json_atomically
from trainprobe.frontdoors.monitor_v1.output import OUTPUT_ENV


def _item(value: Any) -> str:
    """One tensor as ``size=(..), dtype=..``; anything else as its type."""
    return f"size={tuple(value.shape)}, dtype={value.dtype}" if isinstance(value, torch.Tensor) else str(type(value))


def describe(value: Any) -> dict[str, str]:
    """A call's value (see the module docstring): ``tensor``, ``tuple[N]``/``list[N]`` with one
    entry per item, else its type."""
    if isinstance(value, torch.Tensor):
        return {"config": "tensor", "tensor": _item(value)}
    if isinstance(value, (tuple, list)):
        out = {"config": f"{type(value).__name__}[{len(value)}]"}
        out.update({str(i): _item(item) for i, item in enumerate(value)})
        return out
    return {"config": str(type(value))}


def _wants_grad(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad


def _grads(values: tuple[Any, ...]) -> tuple[Any, ...]:
    """What a full backward hook receives for ``values``: the tensor (standing for its gradient,
    same size and dtype) where it requires a gradient, None elsewhere."""
    return tuple(v if _wants_grad(v) else None for v in values)


def describe_call(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> dict[str, dict[str, str]]:
    """The ``module_struct.json`` entry of one module call (see the module docstring)."""
    inputs = [a for a in args if isinstance(a, torch.Tensor)]
    inputs += [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
    entry = {"input": describe(inputs), "output": describe(out)}
    outputs = (out,) if isinstance(out, torch.Tensor) else tuple(out) if isinstance(out, (tuple, list)) else ()
    if any(_wants_grad(o) for o in outputs):
        entry["input_grad"] = describe(_grads(args))
        entry["output_grad"] = describe(_grads(outputs))
    return entry


class StructProbe(Probe):
    """Records the module structure during the first step (see the module docstring)."""

    name = "print_struct"

    def __init__(
        self,
        clock: StepClock,
        view: ModelView,
        root: Path,
        rank: int,
        names: Callable[[str], str] | None = None,
        *,
        first_step: int | None = None,
    ) -> None:
        """``first_step``: the step whose calls are recorded (default: the clock's step now).

        Raises:
            ConfigError: ``root/module_struct/rank<r>`` cannot be created (naming
                ``MONITOR_OUTPUT_DIR``); it is created when the file is written.
        """
        super().__init__(clock, ProbeSpec(("norm",), 1e-8), backend=TORCH)
        self.view = view
        self.names = names or (lambda name: name)
        self.first_step = clock.step if first_step is None else first_step
        self.path = check_output_folder(root / "module_struct" / f"rank{rank}", OUTPUT_ENV) / "module_struct.json"
        self.struct: dict[str, dict[str, Any]] = {}
        self._written = False

    def attach(self) -> None:
        for _, name, module in self.view.modules():
            self.keep(module.register_forward_hook(self.eager(self._hook(self.names(name))), with_kwargs=True))

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
            if self.clock.step != self.first_step or name in self.struct:
                return
            self.struct[name] = describe_call(args, kwargs, out)

        return hook

    def done(self) -> bool:
        """After the first step: write the file (once) and return True."""
        if self.clock.step <= self.first_step:
            return False
        if not self._written:
            make_output_folder(self.path.parent, OUTPUT_ENV)
            write_json_atomically(self.path, self.struct, indent=2)
            self._written = True
        return True


_LIBRARIES = ("torch", "mindspore", "trainprobe")
"""The packages whose frames ``stack_info`` leaves out."""


@functools.cache
def _library_dirs() -> tuple[Path, ...]:
    """The resolved directories of the installed :data:`_LIBRARIES` packages (one not installed
    is skipped). Found by the package's own ``__init__`` (``importlib.util.find_spec``, which
    imports nothing; a folder without one is no package), never by the words in a path: user code in a folder named ``trainprobe``, ``torch``
    or ``mindspore`` keeps its frames."""
    dirs: list[Path] = []
    for name in _LIBRARIES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is None or not spec.has_location or not spec.origin:
            continue  # not installed, or a namespace package (a bare folder of that name on sys.path)
        dirs.append(Path(spec.origin).resolve().parent)
    return tuple(dirs)


@functools.lru_cache(maxsize=4096)
def _in_library(filename: str) -> bool:
    """Whether the source file ``filename`` (as a frame names it) lies inside one of
    :func:`_library_dirs`; a name that is not a file path (``<string>``, ``<frozen ...>``) does
    not."""
    if filename.startswith("<"):
        return False
    try:
        path = Path(filename).resolve()
    except (OSError, RuntimeError, ValueError):
        return False
    return any(path.is_relative_to(d) for d in _library_dirs())


def _user_stack() -> str:
    """The caller's stack without the frames of torch, mindspore and trainprobe (by the
    packages' installed directories), innermost 12 frames, one ``File <path>, line <n>, in
    <function>`` line each."""
    frames = [f for f in traceback.extract_stack()[:-2] if not _in_library(f.filename)]
    return "\n".join(f"File {f.filename}, line {f.lineno}, in {f.name}" for f in frames[-12:])


class StackProbe(Probe):
    """Call stacks of the modules' first forward calls in the first collected step."""

    name = "stack_info"

    def __init__(
        self, clock: StepClock, view: ModelView, folder: Path, names: Callable[[str], str] | None = None
    ) -> None:
        super().__init__(clock, ProbeSpec(("norm",), 1e-8), backend=TORCH)
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
        make_output_folder(self.path.parent, OUTPUT_ENV)
        with self.path.open("w", newline="", encoding="utf-8") as fh:
            out = csv.writer(fh)
            out.writerow(["module_name", "stack_info"])
            out.writerows(self.stacks.items())
        self.detach()
