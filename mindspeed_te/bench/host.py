"""Host time of the NPU path: the torch_npu simulator with every `npu_*` kernel replaced by a no-op that returns
tensors of the shapes, strides and dtypes the real simulated kernel returns for the same input signature (found
by calling it once, then cached), so that what is timed is the Python around the kernels (the library's host
work, torch's dispatch and the aten ops, which run for real on tiny tensors), not the simulator's CPU emulation.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

_Meta = Any  # a nest of tuples / lists holding ("tensor", shape, stride, dtype), ("input", path) or a plain value


class NoOpKernels:
    """While active, each `npu_*` kernel of the simulator `npu` returns empty tensors of the shapes, strides and
    dtypes the real kernel returned for the first call with the same input signature (shapes, strides, dtypes
    and the other arguments' values); an output that was one of the call's input tensors (an in-place kernel)
    is that input again. A call whose signature cannot be keyed (an argument that is not hashable) runs the real
    kernel. With `verify`, every call runs the real kernel and checks that the cached metadata matches what it
    returned (`AssertionError` if not); the real outputs are returned. `calls` counts the no-op calls,
    `real_calls` the calls that ran the kernel."""

    def __init__(self, npu: Any, verify: bool = False) -> None:
        self._npu = npu
        self.verify = verify
        self.cache: dict[tuple, _Meta] = {}
        self.calls = 0
        self.real_calls = 0
        self._patched: dict[str, Any] = {}

    def __enter__(self) -> NoOpKernels:
        for name in sorted(set(vars(self._npu)) | set(dir(type(self._npu)))):
            if name.startswith("npu_") and callable(getattr(self._npu, name)):
                self._patched[name] = vars(self._npu).get(name)
                setattr(self._npu, name, self._no_op(name, getattr(self._npu, name)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, own in self._patched.items():
            if own is None:
                delattr(self._npu, name)  # the class's kernel shows through again
            else:
                setattr(self._npu, name, own)
        self._patched.clear()

    def _no_op(self, name: str, kernel: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            inputs: list[torch.Tensor] = []
            try:
                key = (name, _key(args, inputs), _key(kwargs, inputs))
                hash(key)
            except TypeError:
                self.real_calls += 1
                return kernel(*args, **kwargs)
            meta = self.cache.get(key)
            if meta is None or self.verify:
                self.real_calls += 1
                out = kernel(*args, **kwargs)
                got = _meta(out, {id(t): i for i, t in enumerate(inputs)})
                if meta is not None and meta != got:
                    raise AssertionError(f"{name}: the no-op would return {meta}, the kernel returned {got}")
                self.cache[key] = got
                return out
            self.calls += 1
            return _build(meta, inputs)

        return call


def _key(value: Any, inputs: list[torch.Tensor]) -> Any:
    """A hashable signature of a kernel argument (tensors by shape, stride and dtype, collected in `inputs`)."""
    if isinstance(value, torch.Tensor):
        inputs.append(value)
        return ("tensor", tuple(value.shape), value.stride(), value.dtype)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_key(v, inputs) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _key(v, inputs)) for k, v in sorted(value.items())))
    return value


def _meta(out: Any, inputs: dict[int, int]) -> _Meta:
    if isinstance(out, torch.Tensor):
        if id(out) in inputs:
            return ("input", inputs[id(out)])
        return ("tensor", tuple(out.shape), out.stride(), out.dtype)
    if isinstance(out, (list, tuple)):
        return (type(out).__name__, tuple(_meta(o, inputs) for o in out))
    return ("value", out)


def _build(meta: _Meta, inputs: list[torch.Tensor]) -> Any:
    kind, *rest = meta
    if kind == "tensor":
        shape, stride, dtype = rest
        return torch.empty_strided(shape, stride, dtype=dtype)
    if kind == "input":
        return inputs[rest[0]]
    if kind in ("tuple", "list"):
        items = [_build(m, inputs) for m in rest[0]]
        return tuple(items) if kind == "tuple" else items
    return rest[0]


def metadata(out: Any) -> _Meta:
    """Shapes, strides and dtypes of a kernel's output (a nest of tensors and values), for comparisons."""
    return _meta(out, {})


def noop_host_time(repeats: int, chip: str = "1", size: int = 64) -> tuple[float, float, int]:
    """Best host time of an FP8 linear forward + backward (the linear bench's case: fp8_linear with persistent
    tensorwise E4M3 quantizers, bf16, `size`^3) on the NPU backend over the simulator with no-op kernels, and of
    bf16 nn.Linear's forward + backward of the same shape; and how many kernel calls one step made."""
    from mindspeed_te.bench.launches import npu_simulated
    from mindspeed_te.bench.linear import _linear_case, _torch_linear_step
    from mindspeed_te.recipe import Float8CurrentScaling, Format

    torch_step = _torch_linear_step(size, size, size, torch.bfloat16)
    with npu_simulated(chip) as npu:
        step = _linear_case(Float8CurrentScaling(fp8_format=Format.E4M3), size, size, size, torch.bfloat16)[0]
        with NoOpKernels(npu) as kernels:
            step()  # the real kernels once: the outputs' shapes
            calls = kernels.calls
            step()
            calls = kernels.calls - calls
            # One intra-op thread: the host's work is serial, and on a busy machine the baseline's GEMMs would
            # otherwise wait for a descheduled pool thread (best times of 10 ms seen for 150 us of work).
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                ours, base = _interleaved_best((step, torch_step), repeats)
            finally:
                torch.set_num_threads(threads)
    return ours, base, calls


def _interleaved_best(steps: tuple[Callable[[], object], ...], repeats: int) -> list[float]:
    """Best wall time of each step over `repeats` rounds that run every step once in turn (after a warm-up
    round), so that a load change on a shared machine hits all of them alike."""
    for step in steps:
        step()
    best = [float("inf")] * len(steps)
    for _ in range(repeats):
        for i, step in enumerate(steps):
            start = time.perf_counter()
            step()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def bench_host_noop(repeats: int) -> list[tuple[str, float, str]]:
    ours, base, calls = noop_host_time(repeats * 20)
    return [("host overhead 64x64 fwd+bwd, NPU path with no-op kernels / nn.Linear", ours / base,
             f"fp8 {ours * 1e6:.0f} us ({calls} torch_npu calls, no-ops), bf16 nn.Linear {base * 1e6:.0f} us "
             "(tensorwise E4M3, simulated 950PR, one thread)")]
