"""Records: the rows a probe produces, kept apart from how they are written.

A probe appends ``(RowKey, values)`` pairs to a :class:`RowBuffer` while the step runs. At the
end of the step :meth:`RowBuffer.drain` hands them over as a :class:`StepBatch`; any values
still on an accelerator are copied to the host by the backend's copier (PyTorch: stacked, one non-blocking copy per device), and the
background writer waits for that copy (:meth:`StepBatch.rows`) off the training thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from trainprobe.engine.log import info_once

RowValues = Any
"""One row's values: a ``list`` of host floats, or a backend's row still on its device (anything
with ``device`` and ``tolist()``, e.g. a float64 torch tensor) that :meth:`RowBuffer.drain`
copies to the host with the backend's :data:`DeviceCopier`."""


@dataclass(frozen=True, slots=True)
class RowKey:
    """Where a row belongs: ``vpp_stage``, object name, scope and micro-batch (or None)."""

    vpp_stage: int
    name: str
    scope: str
    micro_step: int | None = None


class HostCopy(Protocol):
    """Rows of one device on their way to the host (a backend's :data:`DeviceCopier` result)."""

    def tolist(self) -> list[list[float]]:
        """The rows as host floats, in the order given; may wait for the copy (writer thread)."""
        ...


DeviceCopier = Callable[[list[Any]], HostCopy]
"""Starts the copy of one device's rows to the host: the backend's part of :meth:`RowBuffer.drain`
(PyTorch: one stacked, non-blocking copy per device, :mod:`trainprobe.backends.torch.device_copy`)."""


class RowsOnHost:
    """The default :data:`DeviceCopier`: each row's own ``tolist()``, called on the writer thread
    (for rows that are host arrays already, or a backend with nothing better)."""

    def __init__(self, values: list[Any]) -> None:
        self.values = values

    def tolist(self) -> list[list[float]]:
        return [v.tolist() for v in self.values]


@dataclass
class StepBatch:
    """The rows of one monitor for one step, ready for a sink.

    ``rows()`` may block until the device-to-host copy is done, so sinks call it on the writer
    thread, never on the training thread.
    """

    monitor: str
    step: int
    keys: list[RowKey]
    _host: dict[int, list[Any]] = field(default_factory=dict)
    _copies: list[tuple[list[int], HostCopy]] = field(default_factory=list)

    _all_host: list[Any] | None = None
    """Every row's values when none was on a device (``_host`` and ``_copies`` are then empty)."""

    def values(self) -> list[list[float]]:
        """Every row's values as host floats, in the order of :attr:`keys`."""
        if self._all_host is not None:
            return self._all_host
        values = dict(self._host)
        for indices, copy in self._copies:
            for index, row in zip(indices, copy.tolist()):
                values[index] = row
        return [values[i] for i in range(len(self.keys))]

    def rows(self) -> list[tuple[RowKey, list[float]]]:
        """Every row as host floats, in the order the probe produced them."""
        return list(zip(self.keys, self.values()))

    def __len__(self) -> int:
        return len(self.keys)


@dataclass(frozen=True, slots=True)
class NamedScalar:
    """One named value of a step (the training metrics), and where it goes.

    Attributes:
        tag: TensorBoard tag / log name.
        value: the number.
        formats: where it goes: a subset of ``{"log", "tensorboard"}``.
        vs_samples: also written as ``<tag>-vs-samples`` against the samples axis.
        summary: part of the step's one-line summary in the log.
        dump: also written to the per-rank ``training_state.jsonl``.
    """

    tag: str
    value: float
    formats: frozenset[str]
    vs_samples: bool = False
    summary: bool = False
    dump: bool = False


@dataclass
class ScalarBatch:
    """Named scalars of one monitor for one step (host floats, nothing left to copy), and text
    entries ``(tag, markdown)`` for TensorBoard's TEXT page (written at step 0).

    ``samples`` is the samples consumed so far over all ranks (the ``-vs-samples`` axis), or
    None when unknown."""

    monitor: str
    step: int
    samples: int | None
    scalars: list[NamedScalar]
    texts: tuple[tuple[str, str], ...] = ()

    def __len__(self) -> int:
        return len(self.scalars) + len(self.texts)


_HOST_ROWS = {list}


class RowBuffer:
    """Rows collected during a step; appends are thread-safe (collective callbacks may run on
    a communication thread). ``copier`` starts the copy of device rows to the host
    (:data:`DeviceCopier`; the probes pass their backend's)."""

    def __init__(self, copier: DeviceCopier = RowsOnHost) -> None:
        self._copier = copier
        self._keys: list[RowKey] = []
        self._values: list[RowValues] = []
        self._lock = threading.Lock()

    def add(self, key: RowKey, values: RowValues | None) -> None:
        """Append one row; None (what a statistics kernel gives for a tensor without values, see
        :meth:`~trainprobe.engine.backend.StatsKernel.row`) appends nothing."""
        if values is None:
            _no_values([key])
            return
        with self._lock:
            self._keys.append(key)
            self._values.append(values)

    def extend(self, keys: Sequence[RowKey], values: Iterable[RowValues | None]) -> None:
        """Append rows in order, leaving out the None ones (as :meth:`add`)."""
        values = list(values)
        assert len(keys) == len(values)
        if any(v is None for v in values):  # not `None in values`: a device row's == is a torch call
            _no_values([k for k, v in zip(keys, values) if v is None])
            kept = [(k, v) for k, v in zip(keys, values) if v is not None]
            keys, values = [k for k, _ in kept], [v for _, v in kept]
        with self._lock:
            self._keys.extend(keys)
            self._values.extend(values)

    def clear(self) -> None:
        """Drop every pending row."""
        with self._lock:
            self._keys, self._values = [], []

    def discard(self, keys: Collection[RowKey]) -> None:
        """Drop the pending rows whose key is in ``keys`` (a row read again replaces its first
        reading, as weight_grad does when a step runs more backward passes than expected)."""
        with self._lock:
            kept = [(k, v) for k, v in zip(self._keys, self._values) if k not in keys]
            self._keys, self._values = [k for k, _ in kept], [v for _, v in kept]

    def __len__(self) -> int:
        return len(self._keys)

    def pending(self) -> tuple[list[RowKey], list[RowValues]]:
        """The pending keys and values as they are (device rows stay on their device), not taken."""
        with self._lock:
            return list(self._keys), list(self._values)

    def snapshot(self) -> list[tuple[RowKey, list[float]]]:
        """The pending rows as host floats, without taking them (for on-demand reads such as
        Monitor V1's ``generate_xy_metrics``). Rows still on a device are copied as
        :meth:`drain` copies them (once per device) and waited for: one synchronisation per
        device, not one per row."""
        with self._lock:
            keys, values = list(self._keys), list(self._values)
        return [(k, list(v)) for k, v in self._batch("", 0, keys, values).rows()]

    def drain(self, monitor: str, step: int) -> StepBatch:
        """Take every pending row as a batch; start device-to-host copies without waiting."""
        with self._lock:
            keys, values = self._keys, self._values
            self._keys, self._values = [], []
        return self._batch(monitor, step, keys, values)

    def _batch(self, monitor: str, step: int, keys: list[RowKey], values: list[RowValues]) -> StepBatch:
        """``keys`` and ``values`` as a batch: host rows as they are, device rows grouped by
        device, each group's copy to the host started with the buffer's copier."""
        batch = StepBatch(monitor, step, keys)
        if set(map(type, values)) <= _HOST_ROWS:  # the CPU case: nothing to copy
            batch._all_host = values
            return batch
        on_device: dict[Any, list[int]] = {}
        for i, v in enumerate(values):
            if isinstance(v, list):
                batch._host[i] = v
            else:
                on_device.setdefault(getattr(v, "device", None), []).append(i)
        for indices in on_device.values():
            batch._copies.append((indices, self._copier([values[i] for i in indices])))
        return batch


def _no_values(keys: list[RowKey]) -> None:
    """Say once per process that tensors without values get no row (the first one named)."""
    key = keys[0]
    info_once(
        "rows-no-values",
        f"trainprobe: {key.name} ({key.scope}) is a tensor without values (device='meta'); such tensors have "
        "no rows, monitoring goes on with the others",
    )
