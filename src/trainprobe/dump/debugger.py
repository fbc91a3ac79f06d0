"""``PrecisionDebugger``: the precision-dump front door.

Usage (the reference tool's)::

    debugger = PrecisionDebugger(config_path="./config.json")
    for batch in loader:
        debugger.start(model)        # L0 / mix need the model
        loss = model(batch).sum(); loss.backward(); optimizer.step()
        debugger.stop()              # writes the JSON files of the step so far
        debugger.step()              # completes the step: backward data, next step directory

Output: ``dump_path/step{N}/rank{R}/`` (``proc{pid}`` without a rank) holding ``dump.json``,
``stack.json``, ``construct.json``, ``dump_tensor_data/*.pt`` and, after a dump error,
``dump_error_info.log``. ``start``/``stop``/``step``/``save``/``set_init_step`` also work on the
class (``PrecisionDebugger.start()``): they act on the debugger created last. ``stop()`` and
``step()`` leave the model and its tensors exactly as they were before ``start()``; the L1 API
wrappers installed by the constructor stay in place and only pass calls through while not dumping.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from trainprobe.backends.torch.stats import shared_fused
from trainprobe.dump.api_catalog import ApiCatalog
from trainprobe.dump.api_hooks import api_wrapper, install_api_wrappers, patch_distributed, watch_phases
from trainprobe.dump.collector import Collector
from trainprobe.dump.config import DumpConfig, load_dump_config
from trainprobe.dump.entries import EntryOptions, tensors_in, value_entry
from trainprobe.dump.module_hooks import ModuleHooks, named_submodules
from trainprobe.dump.store import StepStore, TensorFileWriter, disk_full, report_write_error
from trainprobe.engine.errors import ConfigError
from trainprobe.engine.fields import config_file, load_json_object
from trainprobe.engine.folders import make_output_folder
from trainprobe.engine.log import info_once, warn_once
from trainprobe.engine.patching import AttrPatch

Model = nn.Module | Sequence[nn.Module]


class _on_instance_or_current:
    """A method callable on an instance or on the class (then on the debugger created last)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]

    def __get__(self, obj: Any, cls: Any) -> Callable[..., Any]:
        if obj is not None:
            return functools.partial(self.fn, obj)

        def on_current(*args: Any, **kwargs: Any) -> Any:
            current = cls._current
            if current is None:
                warn_once(
                    f"dump-no-debugger-{self.fn.__name__}",
                    f"trainprobe dump: PrecisionDebugger.{self.fn.__name__}() called before any "
                    "PrecisionDebugger(...) was created; ignored",
                )
                return None
            return self.fn(current, *args, **kwargs)

        return on_current


class PrecisionDebugger:
    """Dumps the forward and backward data of APIs (L1), modules (L0) or both (mix).

    Args:
        config_path: the ``config.json`` (None: every default: L1 statistics of all ranks/steps).
        task, dump_path, level, step: override the file's values.
        api_list: a ``support_wrap_ops.yaml`` replacing the shipped list of L1 APIs.

    Raises:
        ConfigError: an invalid config field or argument (naming it); a ``dump_path`` that
            cannot be created as a writable folder (a file, a path under a file, a FIFO, an
            unwritable folder) is one, reported here rather than at the first ``stop()``.
    """

    _current: ClassVar[PrecisionDebugger | None] = None

    def __init__(
        self,
        config_path: str | os.PathLike[str] | None = None,
        task: str | None = None,
        dump_path: str | os.PathLike[str] | None = None,
        level: str | None = None,
        step: int | list[int] | None = None,
        *,
        api_list: str | os.PathLike[str] | None = None,
    ) -> None:
        self.config_path = None if config_path is None else config_file(config_path, "config_path")
        overrides: dict[str, Any] = {"task": task, "dump_path": dump_path, "level": level, "step": step}
        self.config: DumpConfig = load_dump_config(self.config_path).with_overrides(**overrides)
        make_output_folder(self.config.dump_path, "dump_path")
        self._config_mtime = self._mtime()
        self.catalog = (
            ApiCatalog.load(None if api_list is None else Path(api_list))
            if self.config.level in ("L1", "mix")
            else ApiCatalog()
        )
        self.collector = Collector(self.config)
        self.collector.bind()
        if self.config.level in ("L1", "mix"):
            install_api_wrappers(self.collector, self.catalog)
        self.current_step = 0
        self.files = TensorFileWriter(self.config.async_dump)
        shared_fused().prepare()  # the statistics' one-read pass: loaded now, or built aside (never compiled here)
        self.store: StepStore | None = None
        self._started = False
        self._patch = AttrPatch()
        self._custom = AttrPatch()
        self._modules = ModuleHooks(self.collector)
        self._module_dump: ModuleHooks | None = None
        self._model: Model | None = None
        self._run_handles: list[Any] = []
        self._token = 0
        self._rank_id: int | None = None
        self._save_counts: dict[str, int] = {}
        type(self)._current = self

    # -- configuration ------------------------------------------------------------------
    def _mtime(self) -> float | None:
        try:
            return self.config_path.stat().st_mtime_ns if self.config_path is not None else None
        except OSError:
            return None

    def _reload_dump_enable(self) -> None:
        """Re-read ``dump_enable`` when the config file changed (dynamic on/off)."""
        mtime = self._mtime()
        if mtime is None or mtime == self._config_mtime:
            return
        self._config_mtime = mtime
        try:
            value = load_json_object(self.config_path).get("dump_enable")  # type: ignore[arg-type]
        except ConfigError as exc:
            warn_once(f"dump-reload-{mtime}", f"trainprobe dump: config not re-read ({exc})")
            return
        if value is None or isinstance(value, bool):
            from dataclasses import replace

            self.config = replace(self.config, dump_enable=value)
            self.collector.config = self.config

    def _rank(self) -> int | None:
        if self._rank_id is not None:
            return self._rank_id
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
        return None

    def _dumps_this_step(self) -> bool:
        cfg = self.config
        if cfg.dump_enable is False:
            return False
        if cfg.steps and self.current_step not in cfg.steps:
            return False
        rank = self._rank()
        return not (cfg.ranks and rank is not None and rank not in cfg.ranks)

    def _ensure_store(self, *, debug: bool = False) -> StepStore:
        if self.store is None:
            rank = self._rank()
            rank_dir = (
                Path(self.config.dump_path)
                / f"step{self.current_step}"
                / (f"rank{rank}" if rank is not None else f"proc{os.getpid()}")
            )
            header = {
                "task": self.config.task,
                "level": self.config.level,
                "framework": "pytorch",
                "dump_data_dir": (
                    str(rank_dir / "dump_tensor_data") if self.config.task in ("tensor", "overflow_check") else None
                ),
            }
            self.store = StepStore(rank_dir, header, self.files, debug=debug)
            self.collector.set_store(self.store)
        return self.store

    # -- start / stop / step ------------------------------------------------------------
    @_on_instance_or_current
    def start(
        self, model: Model | None = None, token_range: Sequence[int] | None = None, rank_id: int | None = None
    ) -> None:
        """Start dumping (see the class docstring).

        Raises:
            ConfigError: L0/mix or ``token_range`` without ``model``, a bad ``token_range`` or
                ``rank_id``.
        """
        cfg = self.config
        if model is not None and not (
            isinstance(model, nn.Module)
            or (isinstance(model, (list, tuple)) and model and all(isinstance(m, nn.Module) for m in model))
        ):
            raise ConfigError(
                f"start(model=...): expected a torch.nn.Module or a list of them, got {type(model).__name__}"
            )
        if model is None and cfg.level in ("L0", "mix"):
            raise ConfigError(f"start(model=...): level {cfg.level} dumps modules, pass the model to start()")
        if token_range is not None:
            if model is None:
                raise ConfigError("start(token_range=...): pass the model too; tokens are its forward calls")
            if (
                not isinstance(token_range, (list, tuple))
                or len(token_range) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in token_range)
                or token_range[0] > token_range[1]
            ):
                raise ConfigError(
                    f"start(token_range=...): expected [start, end] with 0 <= start <= end, got {token_range!r}"
                )
        if rank_id is not None:
            if isinstance(rank_id, bool) or not isinstance(rank_id, int) or rank_id < 0:
                raise ConfigError(f"start(rank_id=...): expected an integer >= 0, got {rank_id!r}")
            if self.store is None:
                self._rank_id = rank_id
        if self._started:
            return
        self._reload_dump_enable()
        if cfg.level == "debug" or not self._dumps_this_step() or self.collector.disabled:
            return
        self._ensure_store()
        self._started = True
        if cfg.level in ("L0", "mix") and model is not None:
            modules = named_submodules(model)
            self._modules.attach(modules)
            self._modules.attach_param_grads(modules)
        if cfg.level in ("L1", "mix"):
            patch_distributed(self._patch, self.collector, self.catalog.distributed)
        if cfg.level == "mix":
            self._run_handles.extend(watch_phases(self._patch, self.collector))
        if token_range is not None:
            self._attach_token_counter(model, tuple(token_range))  # type: ignore[arg-type]
        else:
            self.collector.recording = True

    def _attach_token_counter(self, model: Model, token_range: tuple[int, int]) -> None:
        roots = [model] if isinstance(model, nn.Module) else list(model)
        first, last = token_range

        def count(module: nn.Module, args: Any) -> None:
            if module is roots[0]:
                self._token += 1
            self.collector.recording = first <= self._token <= last

        for root in roots:
            self._run_handles.append(root.register_forward_pre_hook(count))

    @_on_instance_or_current
    def stop(self) -> None:
        """Stop dumping and write the step's JSON files so far (backward data that arrives
        before ``step()`` is added then)."""
        if not self._started:
            return
        self._started = False
        self.collector.recording = False
        self.collector.suppress = 0
        self.collector.phase = None
        self._patch.restore()
        self._modules.remove_forward()
        handles, self._run_handles = self._run_handles, []
        for h in handles:
            h.remove()
        self._flush()

    def __enter__(self) -> PrecisionDebugger:
        """``with PrecisionDebugger(...) as debugger:``: ``stop()`` runs when the block ends, also
        when the training loop raises, so the patches and hooks are removed and the step's files so
        far are written."""
        return self

    def __exit__(self, *exc_info: object) -> None:
        """The block ended, normally or by an exception (which propagates): :meth:`stop`."""
        self.stop()

    def _flush(self) -> None:
        store = self.store
        if store is None:
            return
        try:
            self.collector.backward.drop_unoverflowed()
            store.flush(construct=self.config.level in ("L0", "mix"))
        except Exception as exc:  # noqa: BLE001 - dumping never crashes training
            if disk_full(exc, store.rank_dir):  # one "no space left" line; a later step may fit again
                target = exc.filename if isinstance(exc, OSError) and exc.filename else store.rank_dir / "dump.json"
                report_write_error(exc, Path(target))
                return
            self.collector.fail(exc, "writing the JSON files")
            return
        written = [n for n in ("dump.json", "stack.json", "construct.json", "debug.json") if (store.rank_dir / n).exists()]
        info_once(  # the files this dump writes (save()'s debug.json alone, say), named once
            f"dump-where-{store.rank_dir.parent.parent}",
            f"trainprobe dump: writing {_and(written)} per step, first under {store.rank_dir}",
        )

    @_on_instance_or_current
    def step(self) -> None:
        """End the step: write its files, forget its gradient hooks, move to ``step{N+1}``."""
        if self._started:
            self.stop()
        self._flush()
        self.collector.new_step()
        self.files.new_step()
        self._modules.remove()
        self.store = None
        self.collector.set_store(None)
        self._save_counts.clear()
        self.current_step += 1
        self._reload_dump_enable()
        shared_fused().step_boundary()  # the one-read pass, if built aside since start: from the next step

    @_on_instance_or_current
    def set_init_step(self, step: int) -> None:
        """Number the steps from ``step`` (call before the training loop)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"set_init_step(step): expected an integer >= 0, got {step!r}")
        self.current_step = step

    # -- custom APIs ------------------------------------------------------------------------
    @_on_instance_or_current
    def register_custom_api(self, module: Any, api: str, api_prefix: str | None = None) -> None:
        """Dump calls of ``module.api`` as ``{api_prefix}.{api}.{n}.forward`` (prefix default:
        the module's name) until :meth:`restore_custom_api`."""
        original = getattr(module, api, None)
        if not callable(original):
            raise ConfigError(f"register_custom_api: {getattr(module, '__name__', module)!r} has no callable {api!r}")
        prefix = api_prefix if api_prefix is not None else getattr(module, "__name__", type(module).__name__)
        self._custom.replace(module, api, api_wrapper(self.collector, f"{prefix}.{api}", original))

    @_on_instance_or_current
    def restore_custom_api(self, module: Any, api: str) -> None:
        """Put back the original ``module.api``."""
        if not self._custom.restore(module, api):
            warn_once(f"dump-restore-{api}", f"trainprobe dump: {api!r} was not registered; nothing restored")

    # -- module_dump -----------------------------------------------------------------------
    def module_dump(self, module: nn.Module, name: str) -> None:
        """Dump ``module`` as ``Module.{name}.{Class}`` and nothing inside it until
        :meth:`module_dump_end`."""
        if not isinstance(module, nn.Module):
            raise ConfigError(f"module_dump(module, ...): expected a torch.nn.Module, got {type(module).__name__}")
        if not isinstance(name, str) or not name:
            raise ConfigError("module_dump(..., module_name): expected a non-empty string")
        self.module_dump_end()
        self._module_dump = ModuleHooks(self.collector)
        self._module_dump.attach([(f"Module.{name}.{type(module).__name__}", module)], only_self=True)

    def module_dump_end(self) -> None:
        """End :meth:`module_dump`."""
        hooks, self._module_dump = self._module_dump, None
        if hooks is not None:
            hooks.remove_forward()
            self.collector.suppress = 0

    # -- save ----------------------------------------------------------------------------
    @_on_instance_or_current
    def save(self, variable: Any, name: str, save_backward: bool = True) -> None:
        """Record ``variable`` as ``{name}.{n}.debug`` in ``debug.json`` and, with
        ``save_backward``, its gradient as ``{name}_grad.{n}.debug`` (level ``debug`` only)."""
        if self.config.level != "debug":
            warn_once("dump-save-level", 'trainprobe dump: save() needs "level": "debug" in the config; ignored')
            return
        if not isinstance(name, str) or not name:
            raise ConfigError("save(variable, name): name must be a non-empty string")
        if not self._dumps_this_step() or self.collector.disabled:
            return
        self.collector.guarded(f"save({name!r})", self._save)(variable, name, save_backward)

    def _save(self, variable: Any, name: str, save_backward: bool) -> None:
        store = self._ensure_store(debug=True)
        n = self._save_counts.get(name, 0)
        self._save_counts[name] = n + 1
        record_name = f"{name}.{n}.debug"
        store.add(record_name, value_entry(variable, record_name, self.collector.options(record_name)))
        if not save_backward or not torch.is_grad_enabled():
            return
        targets = [(path, t) for path, t in tensors_in(variable) if t.requires_grad]
        if not targets:
            return
        grad_name = f"{name}_grad.{n}.debug"
        grad_record = _placeholders(variable)
        slots = {path: slot for path, slot in _slots(grad_record)}
        opts: EntryOptions = self.collector.options(grad_name)
        added = {"done": False}

        for path, t in targets:

            def hook(grad: torch.Tensor, path: str = path) -> None:
                s = self.store
                if s is None:
                    return
                data_name = f"{grad_name}.{path}" if path else grad_name
                slots[path].update(value_entry(grad, data_name, opts))
                if not added["done"]:
                    added["done"] = True
                    s.add(grad_name, grad_record)
                else:
                    s.touch()

            self.collector.handles.append(t.register_hook(self.collector.guarded(f"gradient of {name}", hook)))


def _placeholders(value: Any) -> Any:
    """``value``'s structure with an empty dict for each tensor and null for everything else."""
    if isinstance(value, torch.Tensor):
        return {}
    if isinstance(value, (list, tuple)):
        return [_placeholders(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _placeholders(v) for k, v in value.items()}
    return None


def _slots(value: Any, prefix: str = "") -> list[tuple[str, dict[str, Any]]]:
    if isinstance(value, dict) and not value:
        return [(prefix, value)]
    out: list[tuple[str, dict[str, Any]]] = []
    items = enumerate(value) if isinstance(value, list) else value.items() if isinstance(value, dict) else ()
    for k, v in items:
        out.extend(_slots(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def module_dump(module: nn.Module, module_name: str) -> None:
    """Dump only ``module`` itself (not its insides) under ``module_name`` until
    :func:`module_dump_end`; needs a started :class:`PrecisionDebugger`."""
    current = PrecisionDebugger._current
    if current is None:
        raise ConfigError("module_dump: create a PrecisionDebugger first")
    current.module_dump(module, module_name)


def module_dump_end() -> None:
    """End :func:`module_dump`."""
    current = PrecisionDebugger._current
    if current is not None:
        current.module_dump_end()


def _and(names: list[str]) -> str:
    """``a, b and c``."""
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1] if names else "no file"
