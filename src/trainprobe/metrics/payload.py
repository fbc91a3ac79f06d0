"""One step's raw measurements on their way from the training thread to the writer thread.

The training thread adds host numbers and device tensors by key; :meth:`StepPayload.seal`
concatenates the tensors of each device into one float64 vector and starts one non-blocking
copy to (pinned) host memory per device. The writer thread calls :meth:`StepPayload.values`,
which waits for that copy there, never on the training thread: at most one device-to-host
transfer per device and step, and no synchronisation of the training thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

Value = float | list[float]


@dataclass(slots=True)
class _Copy:
    keys: list[tuple[str, int, bool]]  # key, length, scalar
    host: torch.Tensor
    event: object | None


@dataclass(slots=True)
class StepPayload:
    """Raw values of one step.

    Attributes:
        step: the training step (1-based).
        samples: samples consumed so far over all ranks (the ``-vs-samples`` axis), or None.
    """

    step: int
    samples: int | None = None
    host: dict[str, Value] = field(default_factory=dict)
    _device: dict[str, tuple[torch.Tensor, bool]] = field(default_factory=dict)
    _copies: list[_Copy] = field(default_factory=list)

    def put(self, key: str, value: float | int | torch.Tensor | list[float]) -> None:
        """Add a host number, a list of host numbers, or a tensor (0-d: a scalar; else flattened)."""
        if isinstance(value, torch.Tensor):
            t = value.detach()
            if t.device.type == "cpu":
                self.host[key] = t.item() if t.dim() == 0 else t.reshape(-1).double().tolist()
            else:
                self._device[key] = (t, t.dim() == 0)
        elif isinstance(value, list):
            self.host[key] = [float(v) for v in value]
        else:
            self.host[key] = float(value)

    def seal(self) -> None:
        """Start the device-to-host copies (one per device); call once, on the training thread."""
        by_device: dict[torch.device, list[tuple[str, torch.Tensor, bool]]] = {}
        for key, (t, scalar) in self._device.items():
            by_device.setdefault(t.device, []).append((key, t, scalar))
        self._device = {}
        for items in by_device.values():
            flat = torch.cat([t.reshape(-1).to(torch.float64) for _, t, _ in items])
            keys = [(key, t.numel(), scalar) for key, t, scalar in items]
            event = None
            if flat.device.type == "cuda":
                host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
                host.copy_(flat, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            else:
                host = flat.to("cpu")
            self._copies.append(_Copy(keys, host, event))

    def values(self) -> dict[str, Value]:
        """Every value as host numbers; waits for the device copies (writer thread)."""
        out = dict(self.host)
        for copy in self._copies:
            if copy.event is not None:
                copy.event.synchronize()  # type: ignore[attr-defined]
            flat = copy.host.tolist()
            offset = 0
            for key, n, scalar in copy.keys:
                out[key] = flat[offset] if scalar else flat[offset : offset + n]
                offset += n
        return out
