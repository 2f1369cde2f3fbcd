"""Activation offload to host memory: TransformerEngine's `get_cpu_offload_context`, which Megatron's
--cpu-offloading calls around each transformer layer.

The tensors a layer saves for backward go to host memory as they are saved and come back before the layer's
backward. Quantized activations travel as their codes and scales (1 byte an element in FP8). Two routes feed
one schedule: torch's saved-tensor hooks for the tensors torch ops save, and `stash` / `unstash` for what this
package's autograd functions keep on their ctx (the hooks never see those).

On an accelerator the copies run on a side stream, non-blocking, into pinned host memory: the forward does not
wait for an offload, and each layer's reload is started one layer ahead in backward. A device tensor is released
when its layer's forward ends (held until then so that each storage is copied once; `record_stream` keeps the
allocator from reusing it before the copy ends). On a CPU the same steps run as plain copies, so the path is
checked there, but nothing is saved.

Which tensors go follows TE's rule: at least 256 Ki elements, not a parameter, not marked by
`mark_not_offload`. A view goes with its whole storage, once per layer, unless that storage is more than
`MAX_STORAGE_PER_VIEW` times the view. Weights stay: the modules keep quantized weights out of `stash`.
"""
from __future__ import annotations

import contextlib
from copy import copy as shallow_copy
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from mindspeed_te.tensor import QuantizedTensorStorage

__all__ = ["get_cpu_offload_context", "mark_not_offload", "offloading", "stash", "unstash", "OffloadSchedule",
           "MIN_OFFLOAD_NUMEL"]

# TE's heuristic: smaller tensors cost more in copy latency than they save.
MIN_OFFLOAD_NUMEL = 256 * 1024
# A view goes with its whole storage (once per layer, however many views of it are saved), unless the storage is
# more than this many times the view: copying it all would cost more than it frees.
MAX_STORAGE_PER_VIEW = 4
_NOT_OFFLOAD = "_mindspeed_te_not_offload"

# The schedule whose context is entered (one layer's forward), read by `stash`.
_active: Optional[OffloadSchedule] = None


def mark_not_offload(*tensors: Any) -> None:
    """Keep these tensors (or every tensor of these quantized storages) on the device when saved."""
    for t in tensors:
        if isinstance(t, torch.Tensor):
            setattr(t, _NOT_OFFLOAD, True)
        elif isinstance(t, QuantizedTensorStorage):
            mark_not_offload(*(v for v in vars(t).values() if isinstance(v, torch.Tensor)))


def _offloadable(t: torch.Tensor) -> bool:
    base = t._base if t._base is not None else t
    if any(isinstance(u, torch.nn.Parameter) or getattr(u, _NOT_OFFLOAD, False) for u in (t, base)):
        return False
    nbytes = t.numel() * t.element_size()
    return t.numel() >= MIN_OFFLOAD_NUMEL and t.untyped_storage().nbytes() <= MAX_STORAGE_PER_VIEW * nbytes


@dataclass(eq=False)
class _HostCopy:
    """One offloaded storage: its host copy, and its device copy once reloaded."""

    schedule: OffloadSchedule
    host: torch.Tensor  # flat, the storage's dtype
    device: torch.device
    readers: int = 0  # saved views not yet read back
    copied: Any = None  # event: the offload copy is done (accelerators only)
    reloaded: Optional[torch.Tensor] = None
    loaded: Any = None  # event: the reload is done


@dataclass(eq=False)
class _SavedView:
    """A saved tensor as a view of an offloaded storage."""

    copy: _HostCopy
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


@dataclass(eq=False)
class _Group:
    """The offloaded storages of one layer's forward; `storages` holds them (strongly, so that an address is
    not reused) until the layer ends, to copy each once."""

    copies: list[_HostCopy] = field(default_factory=list)
    storages: dict[int, tuple[_HostCopy, torch.UntypedStorage]] = field(default_factory=dict)
    reloading: bool = False


class OffloadSchedule:
    """The state behind one `get_cpu_offload_context`: which layer runs, the side stream, the groups."""

    def __init__(self, num_layers: int, model_layers: int, retain_pinned_cpu_buffers: bool = False):
        self.num_layers, self.model_layers = num_layers, model_layers
        self.retain_pinned_cpu_buffers = retain_pinned_cpu_buffers
        self.layer = 0  # the forward layer index within a model pass
        self.group = _Group()
        self._previous: Optional[_Group] = None
        self.host_bytes = 0  # held in host memory now
        self.inside_context = False  # Megatron's own linears read this attribute
        self._recording = False
        self._streams: dict[torch.device, Any] = {}
        self._pinned: dict[tuple, list[torch.Tensor]] = {}  # retain_pinned_cpu_buffers: free host buffers
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    # -- the context and the sync function -------------------------------------------------------------------
    def __enter__(self) -> OffloadSchedule:
        global _active
        self.inside_context, _active = True, self
        self._recording = torch.is_grad_enabled()  # (autograd runs forwards and pack hooks without grad mode)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        global _active
        self._hooks.__exit__(*exc)
        self.inside_context, _active = False, None

    def offloading(self) -> bool:
        return self.inside_context and self._recording and self.layer < self.num_layers

    def commit(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The sync function: ends this layer's group; in backward, the boundary reloads it and the one
        before it (one layer ahead of the compute)."""
        group, previous = self.group, self._previous
        group.storages.clear()
        self._previous, self.group = group, _Group()
        self.layer += 1
        if self.layer == self.model_layers:
            self.layer, self._previous = 0, None
        if not group.copies and (previous is None or not previous.copies):
            return hidden_states
        return _LayerBoundary.apply(hidden_states, self, group, previous)

    # -- moving tensors ---------------------------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> Any:
        if not (self.offloading() and _offloadable(t)):
            return t
        storage = t.untyped_storage()
        known = self.group.storages.get(storage._cdata)
        copy = known[0] if known is not None else self._offload(t, storage)
        copy.readers += 1
        return _SavedView(copy, t.size(), t.stride(), t.storage_offset())

    def unpack(self, saved: Any) -> torch.Tensor:
        return self.reload(saved) if isinstance(saved, _SavedView) else saved

    def _stream(self, device: torch.device) -> Any:
        if device.type == "cpu":
            return None
        if device not in self._streams:
            self._streams[device] = torch.get_device_module(device).Stream(device=device)
        return self._streams[device]

    def _host_buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        free = self._pinned.get((numel, dtype)) if self.retain_pinned_cpu_buffers else None
        if free:
            return free.pop()
        return torch.empty(numel, dtype=dtype, pin_memory=device.type != "cpu")

    def _offload(self, t: torch.Tensor, storage: torch.UntypedStorage) -> _HostCopy:
        flat = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, (storage.nbytes() // t.element_size(),))
        host = self._host_buffer(flat.numel(), t.dtype, t.device)
        copy = _HostCopy(self, host, t.device)
        stream = self._stream(t.device)
        if stream is None:
            host.copy_(flat)
        else:
            module = torch.get_device_module(t.device)
            stream.wait_stream(module.current_stream(t.device))
            with module.stream(stream):
                host.copy_(flat, non_blocking=True)
                copy.copied = module.Event()
                copy.copied.record(stream)
            flat.record_stream(stream)  # the allocator keeps the memory until the copy has read it
        self.group.copies.append(copy)
        self.group.storages[storage._cdata] = (copy, storage)
        self.host_bytes += host.numel() * host.element_size()
        return copy

    def start_reload(self, group: Optional[_Group]) -> None:
        if group is None or group.reloading:
            return
        group.reloading = True
        for copy in group.copies:
            if copy.reloaded is not None or copy.host is None:
                continue
            stream = self._stream(copy.device)
            if stream is None:  # already in host memory
                copy.reloaded = copy.host
                continue
            module = torch.get_device_module(copy.device)
            stream.wait_event(copy.copied)
            with module.stream(stream):
                copy.reloaded = copy.host.to(copy.device, non_blocking=True)
                copy.loaded = module.Event()
                copy.loaded.record(stream)

    def reload(self, view: _SavedView) -> torch.Tensor:
        copy = view.copy
        if copy.reloaded is None:  # read before its layer's boundary came back (e.g. outside the block)
            self.start_reload(_Group([copy]))
        flat = copy.reloaded
        if copy.loaded is not None:
            module = torch.get_device_module(copy.device)
            current = module.current_stream(copy.device)
            current.wait_event(copy.loaded)
            flat.record_stream(current)
            copy.loaded = None
        copy.readers -= 1
        if copy.readers == 0:  # the last saved view of this storage: the host copy is done with
            self.host_bytes -= copy.host.numel() * copy.host.element_size()
            if self.retain_pinned_cpu_buffers and copy.device.type != "cpu":
                self._pinned.setdefault((copy.host.numel(), copy.host.dtype), []).append(copy.host)
            copy.host = copy.reloaded = None
        return torch.as_strided(flat, view.size, view.stride, view.offset)


class _LayerBoundary(torch.autograd.Function):
    """Identity on the layer's output; its backward runs just before the layer's backward."""

    @staticmethod
    def forward(ctx, hidden_states: torch.Tensor, schedule: OffloadSchedule, group: _Group,
                previous: Optional[_Group]) -> torch.Tensor:
        ctx.schedule, ctx.group, ctx.previous = schedule, group, previous
        return hidden_states.view_as(hidden_states)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.schedule.start_reload(ctx.group)
        ctx.schedule.start_reload(ctx.previous)
        ctx.group = ctx.previous = None
        return grad, None, None, None


def offloading() -> bool:
    """Whether what autograd functions keep now goes to host memory (an offloaded layer's forward)."""
    return _active is not None and _active.offloading()


def stash(obj: Any) -> Any:
    """What an autograd function keeps for backward, offloaded when an offload context is active: a tensor,
    or a quantized storage whose codes and scales go (a shallow copy; the original, e.g. a cache, stays)."""
    schedule = _active
    if obj is None or not offloading():
        return obj
    if isinstance(obj, torch.Tensor):
        return schedule.pack(obj)
    if isinstance(obj, QuantizedTensorStorage):
        fields = {k: v for k, v in vars(obj).items() if isinstance(v, torch.Tensor) and _offloadable(v)}
        if not fields:
            return obj
        moved = shallow_copy(obj)
        for name, value in fields.items():
            setattr(moved, name, schedule.pack(value))
        return moved
    return obj


def unstash(obj: Any) -> Any:
    """The inverse of `stash`, in backward."""
    if isinstance(obj, _SavedView):
        return obj.copy.schedule.reload(obj)
    if isinstance(obj, QuantizedTensorStorage):
        for name, value in list(vars(obj).items()):
            if isinstance(value, _SavedView):
                setattr(obj, name, value.copy.schedule.reload(value))
    return obj


def get_cpu_offload_context(enabled: bool = False, num_layers: Optional[int] = 1, model_layers: int = 1,
                            offload_activations: bool = True, offload_weights: bool = False,
                            double_buffering: bool = False, manual_synchronization: bool = False,
                            retain_pinned_cpu_buffers: bool = False, offload_stream: Any = None
                            ) -> tuple[Any, Callable[[torch.Tensor], torch.Tensor]]:
    """TE's context and sync function: wrap each layer's forward in the context and pass its output through
    the sync function. The first `num_layers` of `model_layers` layers are offloaded. `double_buffering` is
    accepted and unused, as in TE; offloading weights and TE's manual synchronization are refused."""
    if not enabled:
        return contextlib.nullcontext(), (lambda x: x)
    if manual_synchronization or offload_stream is not None:
        raise ValueError("get_cpu_offload_context: manual_synchronization / offload_stream (TE's manual offload "
                         "control) are not supported; use the default schedule (num_layers of model_layers)")
    if offload_weights:
        raise ValueError("get_cpu_offload_context: offload_weights=True (--cpu-offloading-weights) is not "
                         "supported: mindspeed_te offloads activations only, as TransformerEngine 2.x does")
    if not offload_activations:
        raise ValueError("get_cpu_offload_context: offload_activations=False (--no-cpu-offloading-activations) "
                         "leaves nothing to offload; set it to True or turn --cpu-offloading off")
    if num_layers is None or not 0 < num_layers < model_layers:
        raise ValueError(f"get_cpu_offload_context: num_layers (--cpu-offloading-num-layers) must be between 1 "
                         f"and model_layers - 1 = {model_layers - 1}; got {num_layers}")
    schedule = OffloadSchedule(num_layers, model_layers, retain_pinned_cpu_buffers)
    return schedule, schedule.commit
