"""Argument checks shared by the kernels: one concern each, the message names the argument and what is allowed."""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch

from mindspeed_te.testing.npu_sim.dtypes import NPU_ONLY_NAMES, NUMBER_TO_NATIVE, Dtype, DtypeArg
from mindspeed_te.testing.npu_sim.errors import NpuContractError, NpuSimNotImplemented, NpuTypeError, NpuValueError


def dtype_name(d: Any) -> str:
    if isinstance(d, torch.dtype):
        return str(d)
    return NPU_ONLY_NAMES.get(d, repr(d))


def dtype_names(allowed: Sequence[Any]) -> str:
    return ", ".join(dtype_name(a) for a in allowed)


def dtype_arg(name: str, value: DtypeArg, *, required: bool = False) -> Optional[Dtype]:
    """Canonical form of a dtype argument (None stays None unless `required`)."""
    if value is None:
        if required:
            raise NpuTypeError(f"{name} is required")
        return None
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        if value in NPU_ONLY_NAMES:
            return value
        if value in NUMBER_TO_NATIVE:
            return NUMBER_TO_NATIVE[value]
    raise NpuTypeError(f"{name}={value!r} is not a dtype (a torch.dtype or a torch_npu dtype number)")


def check_dtype(name: str, value: Any, allowed: Sequence[Any]) -> None:
    if value not in allowed:
        raise NpuTypeError(f"{name} must be one of [{dtype_names(allowed)}], got {dtype_name(value)}")


def check_tensor(name: str, t: Any, dtypes: Optional[Sequence[torch.dtype]] = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise NpuTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None:
        check_dtype(f"{name}.dtype", t.dtype, dtypes)
    return t


def check_dims(name: str, t: torch.Tensor, lo: int, hi: int) -> None:
    if not lo <= t.dim() <= hi:
        want = f"{lo}" if lo == hi else f"{lo} to {hi}"
        raise NpuValueError(f"{name} must have {want} dims, got shape {tuple(t.shape)}")


def check_shape(name: str, t: torch.Tensor, *expected: tuple[int, ...]) -> None:
    if tuple(t.shape) not in expected:
        want = " or ".join(str(e) for e in expected)
        raise NpuValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")


def check_choice(name: str, value: Any, allowed: Sequence[Any], why: str = "") -> None:
    if value not in allowed or isinstance(value, bool) != any(isinstance(a, bool) for a in allowed):
        suffix = f" {why}" if why else ""
        raise NpuValueError(f"{name} must be one of {list(allowed)}{suffix}, got {value!r}")


def check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise NpuTypeError(f"{name} must be an int, got {value!r}")
    return value


def check_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise NpuTypeError(f"{name} must be a finite float, got {value!r}")
    return float(value)


def check_none(name: str, value: Any, why: str) -> None:
    if value is not None:
        raise NpuValueError(f"{name} must be None {why}")


def check_axis(name: str, axis: Any, ndim: int) -> int:
    check_int(name, axis)
    if not -ndim <= axis < ndim:
        raise NpuValueError(f"{name}={axis} is out of range [{-ndim}, {ndim - 1}]")
    return axis % ndim


def layouts(t: torch.Tensor, dims: tuple[int, int] = (-2, -1)) -> set[str]:
    """Which of "row" (contiguous) and "col" (transposed view of a contiguous tensor over `dims`) fit `t`;
    both when a size-1 dim makes them indistinguishable."""
    found = set()
    if t.is_contiguous():
        found.add("row")
    if t.transpose(*dims).is_contiguous():
        found.add("col")
    return found


def check_layout(name: str, t: torch.Tensor, allowed: Sequence[str] = ("row", "col"),
                  dims: tuple[int, int] = (-2, -1)) -> set[str]:
    found = layouts(t, dims) & set(allowed)
    if not found:
        want = {"row": "contiguous", "col": "the transposed view of a contiguous tensor"}
        raise NpuValueError(f"{name} must be " + " or ".join(want[a] for a in allowed)
                            + f" (shape {tuple(t.shape)}, strides {t.stride()})")
    return found


def check_scale_layout(name: str, scale: torch.Tensor, data_layouts: set[str],
                        dims: tuple[int, int] = (-2, -1)) -> None:
    """A scale tensor is a transposed view exactly when its data tensor is."""
    if not layouts(scale, dims) & data_layouts:
        kind = "a transposed view" if data_layouts == {"col"} else "contiguous"
        raise NpuValueError(f"{name} must be {kind}, as its data tensor is (strides {scale.stride()})")


def check_same_device(tensors: dict[str, Optional[torch.Tensor]]) -> None:
    devices = {n: t.device for n, t in tensors.items() if isinstance(t, torch.Tensor)}
    if len(set(devices.values())) > 1:
        raise NpuValueError(f"all tensors must be on one device, got {devices}")


def check_list(name: str, value: Any, length: Optional[int] = None) -> list:
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in value):
        raise NpuTypeError(f"{name} must be a list of tensors, got {type(value).__name__}")
    if length is not None and len(value) != length:
        raise NpuValueError(f"{name} must hold {length} tensor(s), got {len(value)}")
    return list(value)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)



def kernel(fn: Optional[Callable] = None, *, differentiable: bool = False) -> Callable:
    """Count a call once its checks passed; prefix contract errors with the kernel name. Kernels torch_npu
    gives no backward (the quantizers, the quantized GEMM) run under no_grad, as their outputs carry no graph."""
    if fn is None:
        return functools.partial(kernel, differentiable=differentiable)
    name = fn.__name__

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            if differentiable:
                result = fn(self, *args, **kwargs)
            else:
                with torch.no_grad():
                    result = fn(self, *args, **kwargs)
        except (NpuContractError, NpuSimNotImplemented) as err:
            raise type(err)(f"{name}: {err}") from None
        self.launch_counts[name] += 1
        return result

    return wrapper

