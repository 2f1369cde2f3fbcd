"""Counters that make hidden costs visible: host-device synchronizations in a region of code."""
from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# Tensor methods that need the tensor's value on the host: each one blocks until the device is done.
_SYNCING = {
    torch.Tensor.item: "item",
    torch.Tensor.tolist: "tolist",
    torch.Tensor.__bool__: "bool",
    torch.Tensor.__int__: "int",
    torch.Tensor.__float__: "float",
    torch.Tensor.__index__: "index",
    torch.Tensor.numpy: "numpy",
    torch.Tensor.nonzero: "nonzero",
    torch.nonzero: "nonzero",
    torch.Tensor.cpu: "cpu",
}


class HostSyncCounter(TorchFunctionMode):
    """Counts calls that force a host-device synchronization (`.item()`, `.tolist()`, `bool(t)`,
    data-dependent shapes, copies to the host). Use as a context manager; `counts` says what was called."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None) -> Any:
        name = _SYNCING.get(func)
        if name is None and func in (torch.Tensor.to, torch.Tensor.copy_):
            name = _host_copy(func, args, kwargs or {})
        if name is not None:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _host_copy(func, args, kwargs) -> str | None:
    """A device-to-host copy: `.to("cpu")` of a non-CPU tensor, or `cpu_tensor.copy_(device_tensor)`."""
    if func is torch.Tensor.to:
        src = args[0]
        target = kwargs.get("device", args[1] if len(args) > 1 else None)
        if isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu" and src.device.type != "cpu":
            return "to_cpu"
        return None
    dst, src = args[0], args[1]
    if dst.device.type == "cpu" and isinstance(src, torch.Tensor) and src.device.type != "cpu":
        return "copy_to_cpu"
    return None
