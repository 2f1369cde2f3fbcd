"""Run Megatron on a machine with no accelerator: `torch.cuda` calls that Megatron makes become their CPU
meaning, so that models, MoE dispatchers, RNG trackers and the training loop work on CPU tensors.

Megatron's training code also names the device literally (`device="cuda"`, `.cuda()`), as it does on NPUs,
where torch_npu's transfer_to_npu redirects those calls; here tensor factories, `Tensor.to` and
`Tensor.cuda` send them to the CPU, and `initialize_megatron` is told that no CUDA is fine.

Applied only when neither CUDA nor an NPU is present (see `register_device_cpu`). Megatron uses
`torch.cuda.current_device()` as a device for tensors, streams and events for overlap, the CUDA RNG state
for its dropout tracker and memory statistics for logging; here the device is "cpu", streams and events
are torch.cpu's no-op ones (work is synchronous), the RNG state is the CPU generator's and memory
statistics are zero.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from typing import Any, Callable, Iterator, Optional

import torch

from mindspeed_te.patches.registry import has_module, resolve


class Stream(torch.cpu.Stream):
    """A CUDA-stream-shaped no-op: CPU work is already ordered."""

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> Stream:
        return super().__new__(cls)

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        super().__init__()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def record_event(self, event: Optional[Event] = None) -> Event:
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

    def elapsed_time(self, end: Event) -> float:
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


# Megatron asks for the GPU generation to gate kernels (grouped GEMM needs >= 8) and to decide whether
# CUDA_DEVICE_MAX_CONNECTIONS=1 is needed for communication overlap; the CPU path has every kernel and no
# such constraint, which Megatron spells as compute capability 10 (Blackwell and up).
_CAPABILITY = (10, 0)


def get_device_capability(device: Any = None) -> tuple[int, int]:
    return _CAPABILITY


@dataclasses.dataclass(frozen=True)
class DeviceProperties:
    """What Megatron reads from `torch.cuda.get_device_properties` (generation, name, memory, SMs)."""

    name: str = "cpu"
    major: int = _CAPABILITY[0]
    minor: int = _CAPABILITY[1]
    total_memory: int = 0
    multi_processor_count: int = dataclasses.field(default_factory=lambda: os.cpu_count() or 1)
    gcnArchName: str = "cpu"  # torch.compile's cache key reads this when torch.version.cuda is None


def get_device_properties(device: Any = None) -> DeviceProperties:
    return DeviceProperties()


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
    "get_device_capability": get_device_capability,
    "get_device_properties": get_device_properties,
}


def _device_type(device: Any) -> Optional[str]:
    """The type ("cuda", "cpu", ...) a device argument names; a bare index is a CUDA device's."""
    if isinstance(device, torch.device):
        return device.type
    if isinstance(device, str):
        return device.split(":")[0]
    return "cuda" if isinstance(device, int) and not isinstance(device, bool) else None


def _is_cuda(device: Any) -> bool:
    return _device_type(device) == "cuda"


def _on_cpu(factory: Callable) -> Callable:
    """`factory` with a CUDA `device=` argument turned into the CPU."""

    @functools.wraps(factory)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return wrapped


_FACTORIES = ("tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
              "randperm", "eye", "linspace", "empty_strided", "zeros_like", "ones_like", "empty_like", "full_like")


def _init_data_on_cpu(init_data: Callable) -> Callable:
    """ShardedTensor.init_data(device, init_fn=torch.empty): its default `init_fn` is the torch.empty bound
    when Megatron was imported, which the factory patches above do not reach; the CUDA device it is given
    (for the checkpoint exchange buffers) becomes the CPU here."""

    @functools.wraps(init_data)
    def wrapped(self: Any, device: Any, *args: Any, **kwargs: Any) -> Any:
        return init_data(self, "cpu" if _is_cuda(device) else device, *args, **kwargs)

    return wrapped


def _tensor_to(original: Callable) -> Callable:
    """CUDA targets become the CPU. A quantized tensor moved explicitly to the host (`.to("cpu")`, e.g. the
    copy Megatron's checkpoint writer makes before writing) becomes its dequantized values, as the
    device-to-host copy of one does on a device (the copy runs through the tensor's dispatch), instead of
    the no-op a CPU tensor's `.to("cpu")` is."""
    from mindspeed_te.quantized_tensor import QuantizedTensor

    @functools.wraps(original)
    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if isinstance(self, QuantizedTensor) and _device_type(args[0] if args else kwargs.get("device")) == "cpu":
            return original(self.dequantize(), *args, **kwargs)
        if args and _is_cuda(args[0]):
            args = ("cpu", *args[1:])
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return original(self, *args, **kwargs)

    return to


def _tensor_type(original: Callable) -> Callable:
    """Tensor.type() names CPU tensors as their CUDA type ('torch.cuda.FloatTensor'): Megatron's optimizer
    sorts parameters by that name. A cast to a CUDA type name casts to the CPU type."""

    @functools.wraps(original)
    def type(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if dtype is None:
            name = original(self)
            return name.replace("torch.", "torch.cuda.", 1) if self.is_cpu else name
        if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
            dtype = dtype.replace("torch.cuda.", "torch.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    return type


def _tensor_cuda(self: torch.Tensor, device: Any = None, non_blocking: bool = False, **kwargs: Any) -> torch.Tensor:
    return self


def _allow_no_cuda(initialize_megatron: Callable) -> Callable:
    @functools.wraps(initialize_megatron)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        kwargs["allow_no_cuda"] = True
        return initialize_megatron(*args, **kwargs)

    return wrapped


def _get_megatron_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """Megatron's RNG tracker state getter (tensor_parallel.random), on the CPU generator."""
    return torch.get_rng_state()


def _set_megatron_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _device_arch_version() -> int:
    return _CAPABILITY[0]


def _gloo_backend(backend: Any) -> Any:
    """NCCL needs CUDA: "nccl" (alone or in a "cpu:gloo,cuda:nccl" spec) becomes gloo, which runs every
    collective Megatron uses on CPU tensors."""
    return str(backend).replace("nccl", "gloo") if backend is not None and "nccl" in str(backend) else backend


def _with_gloo(create: Callable) -> Callable:
    """init_process_group / new_group with an NCCL backend request served by gloo."""

    @functools.wraps(create)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if "backend" in kwargs:
            kwargs["backend"] = _gloo_backend(kwargs["backend"])
            if kwargs.get("pg_options") is not None and "nccl" in type(kwargs["pg_options"]).__name__.lower():
                kwargs["pg_options"] = None
        elif args and create.__name__ == "init_process_group":
            args = (_gloo_backend(args[0]), *args[1:])
        return create(*args, **kwargs)

    return wrapped


def _destroying_forgotten_groups(destroy_model_parallel: Callable) -> Callable:
    """Megatron's `destroy_model_parallel` frees only its gloo groups and forgets the NCCL ones, which cost
    nothing until first used. Served by gloo, every forgotten group keeps its connections and its polling
    threads (about 50 threads per rank per `initialize_model_parallel`), until re-initialising many times, as
    Megatron's unit tests do, stalls the machine: destroy every group Megatron created, as it drops them."""

    @functools.wraps(destroy_model_parallel)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        from megatron.core import parallel_state

        created = [group for group in parallel_state._global_process_group_list or () if group is not None]
        result = destroy_model_parallel(*args, **kwargs)
        live = torch.distributed.distributed_c10d._world.pg_map
        for group in created:
            if group in live:  # Megatron destroyed its gloo groups itself
                torch.distributed.destroy_process_group(group)
        return result

    return wrapped


def _uneven_all_gather(all_gather: Callable) -> Callable:
    """all_gather into tensors of different sizes, which NCCL serves (as one broadcast per rank) and gloo
    refuses ("invalid tensor size"): Megatron's checkpoint exchange (gather_rounds) sends empty tensors from
    ranks with nothing left. Same-size gathers go to gloo's all_gather unchanged."""

    @functools.wraps(all_gather)
    def wrapped(tensor_list: list, tensor: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
        if len({tuple(t.shape) for t in tensor_list}) <= 1:
            return all_gather(tensor_list, tensor, group=group, async_op=async_op)
        me = torch.distributed.get_rank(group)
        for rank, out in enumerate(tensor_list):
            if rank == me:
                out.copy_(tensor)
            src = torch.distributed.get_global_rank(group, rank) if group is not None else rank
            torch.distributed.broadcast(out, src=src, group=group)
        return _EagerCollectives() if async_op else None

    return wrapped


def _maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """Megatron's MoE dispatcher moves its split sizes to the host, as numpy arrays for the all-to-all, but
    converts only CUDA tensors; here they are already on the CPU and still need the conversion (a copy, as
    the device-to-host transfer makes one)."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.detach().clone().numpy()
    return tensor


def _no_fused_kernels(args: Any = None) -> None:
    """Megatron's legacy fused CUDA kernels: nothing to build on the CPU (its code falls back to torch)."""


def accelerator_present() -> bool:
    """Whether CUDA or an Ascend NPU is usable (then nothing here applies). The NPU is asked through the
    kernels' NPU module, which imports an installed torch_npu that is not imported yet (torch.npu exists only
    after that) and raises when it cannot be imported, rather than leaving an Ascend host on the CPU."""
    if torch.cuda.is_available():
        return True
    from mindspeed_te.kernels.npu import npu_device_available

    return npu_device_available()


class _EagerCollectives:
    """What `_coalescing_manager` yields, for ops that already ran one by one: nothing left to wait for."""

    def wait(self) -> None:
        return None


@contextlib.contextmanager
def _uncoalesced(group: Any = None, device: Any = None, async_ops: bool = False) -> Iterator[_EagerCollectives]:
    """gloo's coalesced all-gather garbles buckets of different dtypes (--fp8-param-gather puts the uint8
    FP8-weight bucket and the bf16 bucket in one group): run Megatron's coalesced collectives one by one."""
    yield _EagerCollectives()


def register_device_cpu(registry) -> None:
    """Route Megatron's torch.cuda calls to the CPU (call only when `accelerator_present()` is False)."""
    for name, replacement in TORCH_CUDA.items():
        registry.register(f"torch.cuda.{name}", replacement)
    for name in _FACTORIES:
        registry.register(f"torch.{name}", _on_cpu(getattr(torch, name)))
    registry.register("torch.Tensor.to", _tensor_to(torch.Tensor.to))
    registry.register("torch.Tensor.cuda", _tensor_cuda)
    registry.register("torch.Tensor.type", _tensor_type(torch.Tensor.type))
    registry.register("megatron.core.tensor_parallel.random._get_cuda_rng_state", _get_megatron_rng_state)
    registry.register("megatron.core.tensor_parallel.random._set_cuda_rng_state", _set_megatron_rng_state)
    registry.register("torch.distributed.init_process_group", _with_gloo(torch.distributed.init_process_group))
    registry.register("torch.distributed.new_group", _with_gloo(torch.distributed.new_group))
    registry.register("torch.distributed.all_gather", _uneven_all_gather(torch.distributed.all_gather))
    registry.register("megatron.core.distributed.param_and_grad_buffer._coalescing_manager", _uncoalesced)
    target = "megatron.core.dist_checkpointing.mapping.ShardedTensor.init_data"
    registry.register(target, _init_data_on_cpu(resolve(target)))
    if hasattr(resolve("megatron.core.parallel_state"), "_global_process_group_list"):  # 0.15 on lists its groups
        target = "megatron.core.parallel_state.destroy_model_parallel"
        registry.register(target, _destroying_forgotten_groups(resolve(target)))
    registry.register("megatron.core.transformer.moe.moe_utils.maybe_move_tensor_to_cpu", _maybe_move_tensor_to_cpu)
    if has_module("megatron.training"):
        target = "megatron.training.initialize.initialize_megatron"
        registry.register(target, _allow_no_cuda(resolve(target)))
        if has_module("megatron.legacy.fused_kernels"):  # up to 0.16
            registry.register("megatron.legacy.fused_kernels.load", _no_fused_kernels)
        if hasattr(resolve("megatron.training.utils"), "get_device_arch_version"):  # up to 0.17
            registry.register("megatron.training.utils.get_device_arch_version", _device_arch_version)
