"""Run Megatron on a machine with no accelerator: `torch.cuda` calls that Megatron makes become their CPU
meaning, so that models, MoE dispatchers, RNG trackers and the training loop work on CPU tensors.

Applied only when neither CUDA nor an NPU is present (see `register_device_cpu`). Megatron uses
`torch.cuda.current_device()` as a device for tensors, streams and events for overlap, the CUDA RNG state
for its dropout tracker and memory statistics for logging; here the device is "cpu", streams and events
are torch.cpu's no-op ones (work is synchronous), the RNG state is the CPU generator's and memory
statistics are zero.
"""
from __future__ import annotations

import time
from typing import Any, Optional

import torch


class Stream(torch.cpu.Stream):
    """A CUDA-stream-shaped no-op: CPU work is already ordered."""

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> "Stream":
        return super().__new__(cls)

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        super().__init__()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def record_event(self, event: Optional["Event"] = None) -> "Event":
        event = event if event is not None else Event()
        event.record(self)
        return event


class Event(torch.cpu.Event):
    """A CUDA-event-shaped marker; with `enable_timing`, elapsed_time() in milliseconds of wall time."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        super().__init__()
        self.recorded_at: Optional[float] = None

    def record(self, stream: Any = None) -> None:
        self.recorded_at = time.perf_counter()

    def elapsed_time(self, end: "Event") -> float:
        return (end.recorded_at - self.recorded_at) * 1e3


_STREAM = Stream()


def current_device() -> torch.device:
    return torch.device("cpu")


def current_stream(device: Any = None) -> Stream:
    return _STREAM


def stream(s: Any = None) -> Any:
    return torch.cpu.stream(s)


def synchronize(device: Any = None) -> None:
    pass


def set_device(device: Any) -> None:
    pass


def device_count() -> int:
    return 1


def get_rng_state(device: Any = "cuda") -> torch.Tensor:
    return torch.get_rng_state()


def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    torch.set_rng_state(new_state)


def manual_seed(seed: int) -> None:
    torch.manual_seed(seed)


def empty_cache() -> None:
    pass


def memory_stat(device: Any = None) -> int:
    return 0


def memory_stats(device: Any = None) -> dict:
    return {}


# torch.cuda.<name> -> CPU replacement
TORCH_CUDA = {
    "current_device": current_device,
    "current_stream": current_stream,
    "default_stream": current_stream,
    "stream": stream,
    "Stream": Stream,
    "Event": Event,
    "synchronize": synchronize,
    "set_device": set_device,
    "device_count": device_count,
    "get_rng_state": get_rng_state,
    "set_rng_state": set_rng_state,
    "manual_seed": manual_seed,
    "empty_cache": empty_cache,
    "memory_allocated": memory_stat,
    "max_memory_allocated": memory_stat,
    "memory_reserved": memory_stat,
    "max_memory_reserved": memory_stat,
    "memory_stats": memory_stats,
}


def accelerator_present() -> bool:
    """Whether CUDA or an Ascend NPU is usable (then nothing here applies)."""
    if torch.cuda.is_available():
        return True
    npu = getattr(torch, "npu", None)  # registered by torch_npu when it was imported
    return bool(npu is not None and npu.is_available())


def register_device_cpu(registry) -> None:
    """Route Megatron's torch.cuda calls to the CPU (call only when `accelerator_present()` is False)."""
    for name, replacement in TORCH_CUDA.items():
        registry.register(f"torch.cuda.{name}", replacement)
