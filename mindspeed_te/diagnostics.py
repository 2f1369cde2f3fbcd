"""Counters that make hidden costs visible: host-device synchronizations and device kernel launches in a
region of code."""
from __future__ import annotations

from collections import Counter
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from mindspeed_te.npu_foreach import foreach_launches

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


class HostSyncError(RuntimeError):
    """A host-device synchronization inside a `HostSyncCounter(trap=True)`."""


class HostSyncCounter(TorchFunctionMode):
    """Counts calls that force a host-device synchronization (`.item()`, `.tolist()`, `bool(t)`,
    data-dependent shapes, blocking copies to the host). A tensor in pinned host memory is the target of
    non-blocking copies from a device (which do not wait): copying into it and reading it are host work, not
    counted. Use as a context manager; `counts` says what was called. Torch function modes do not reach into
    autograd backward functions, so while the counter is active the syncing methods are also wrapped to count
    the calls the mode cannot see. With `trap`, each such call raises `HostSyncError` as well, where it is
    made, so that the traceback shows who synchronised (for tests that a region makes none)."""

    def __init__(self, trap: bool = False) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.trap = trap
        self._wrapped: list[tuple[Any, str, Any]] = []  # (owner, attribute, original)

    def __enter__(self) -> HostSyncCounter:
        for func, name in _SYNCING.items():
            owner = torch if func is torch.nonzero else torch.Tensor
            attribute = func.__name__
            original = getattr(owner, attribute)
            setattr(owner, attribute, self._unseen_counted(name, original))
            self._wrapped.append((owner, attribute, original))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for owner, attribute, original in reversed(self._wrapped):
            setattr(owner, attribute, original)
        self._wrapped.clear()
        return super().__exit__(*exc)

    def _unseen_counted(self, name: str, original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self not in torch.overrides._get_current_function_mode_stack() and not _pinned(args):
                self._count(name)  # e.g. inside a backward
            return original(*args, **kwargs)

        return call

    def __torch_function__(self, func, types, args=(), kwargs=None) -> Any:
        name = _SYNCING.get(func)
        if name is None and func in (torch.Tensor.to, torch.Tensor.copy_):
            name = _host_copy(func, args, kwargs or {})
        if name is not None and not _pinned(args):
            self._count(name)
        return func(*args, **(kwargs or {}))

    def _count(self, name: str) -> None:
        self.counts[name] += 1
        if self.trap:
            raise HostSyncError(f"host-device synchronization ({name}) inside a region that must make none")

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _pinned(args: tuple) -> bool:
    """Whether the call reads a tensor in pinned host memory (there is none without an accelerator)."""
    tensor = args[0] if args else None
    return isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu" and tensor.is_pinned()


def _host_copy(func, args, kwargs) -> str | None:
    """A device-to-host copy that waits: `.to("cpu")` of a non-CPU tensor, or `cpu_tensor.copy_(device_tensor)`
    unless it is non-blocking into pinned memory (it is queued on the device's stream; an event says when it
    is done)."""
    if func is torch.Tensor.to:
        src = args[0]
        target = kwargs.get("device", args[1] if len(args) > 1 else None)
        if isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu" and src.device.type != "cpu":
            return "to_cpu"
        return None
    dst, src = args[0], args[1]
    if dst.device.type == "cpu" and isinstance(src, torch.Tensor) and src.device.type != "cpu":
        non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
        return None if non_blocking and dst.is_pinned() else "copy_to_cpu"
    return None


# Allocations reserve memory and dtype arithmetic runs on the host; neither launches a kernel on the device, and
# neither does _unsafe_view (a view that autograd does not treat as one: reshape's second step after its copy).
_NOT_LAUNCHES = ("empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "promote_types",
                 "result_type", "_unsafe_view")


class LaunchCounter(TorchDispatchMode):
    """Counts device kernel launches in a region: every aten op that is not a view or an allocation (on an
    NPU each is a kernel launch) plus every torch_npu kernel call. Pass the torch_npu module (or the
    simulator) as `npu`: its `npu_*` kernels are counted once each (and the simulator's `aten_*` models of aten
    ops torch_npu implements, as those aten ops), and the torch ops the simulator runs to compute them are not
    counted. `counts` says what ran; `total` is the number of launches."""

    def __init__(self, npu: Optional[Any] = None) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self._npu = npu
        self._inside_kernel = 0
        self._patched: dict[str, Any] = {}  # name -> what the module's own __dict__ held (None: nothing)

    def __enter__(self) -> LaunchCounter:
        if self._npu is not None:
            # A module's dir() lists only its own attributes; the simulator's kernels are methods of its class.
            for name in sorted(set(vars(self._npu)) | set(dir(type(self._npu)))):
                if name.startswith(("npu_", "aten_")) and callable(getattr(self._npu, name)):
                    self._patched[name] = vars(self._npu).get(name)
                    setattr(self._npu, name, self._counted(name, getattr(self._npu, name)))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for name, own in self._patched.items():
            if own is None:
                delattr(self._npu, name)  # the class attribute shows through again
            else:
                setattr(self._npu, name, own)
        self._patched.clear()
        return super().__exit__(*exc)

    def _counted(self, name: str, kernel: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self._inside_kernel == 0:
                # The simulator's aten_<op>: the aten op torch_npu implements on NPU tensors
                self.counts[f"aten.{name[5:]}" if name.startswith("aten_") else f"torch_npu.{name}"] += 1
            self._inside_kernel += 1
            try:
                return kernel(*args, **kwargs)
            finally:
                self._inside_kernel -= 1

        return call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None) -> Any:
        name = func.overloadpacket.__name__
        if self._inside_kernel == 0 and not func.is_view and name not in _NOT_LAUNCHES:
            foreach = name.startswith("_foreach")
            self.counts[f"aten.{name}"] += foreach_launches(func, args, kwargs or {}) if foreach else 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def npu_kernels(self) -> int:
        """How many of the launches are torch_npu kernels."""
        return sum(n for name, n in self.counts.items() if name.startswith("torch_npu."))
