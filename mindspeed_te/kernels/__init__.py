"""One kernel interface, three backends: npu (torch_npu), torch (`torch._scaled_mm`), reference (exact emulation).

The backend is chosen per tensor device; `MINDSPEED_TE_BACKEND` = auto | npu | torch | reference forces one.
"auto" picks npu for NPU tensors, torch for CUDA tensors and the reference elsewhere: on CPU torch's scaled
GEMM upcasts the FP8 operands internally and runs no faster than the reference's decode + float32 GEMM.

The environment is read once, at the first kernel call, and again only after `reset_backend()` (which
`FP8GlobalStateManager.reset()` calls): a run keeps one backend however its environment changes later.
"""
from __future__ import annotations

import functools
import os
import sys
from typing import Union

import torch

from mindspeed_te.kernels.base import Capabilities, KernelBackend
from mindspeed_te.kernels.reference import ReferenceBackend
from mindspeed_te.kernels.torch_native import TorchBackend

BACKEND_ENV = "MINDSPEED_TE_BACKEND"
BACKEND_CHOICES = ("auto", "npu", "torch", "reference")
SIMULATOR_ENV = "MINDSPEED_TE_NPU_SIMULATOR"  # =1 or a chip name (Ascend950DT): the NPU backend on the simulator

Backend = KernelBackend  # the contract (kernels/base.py); the npu module is imported only when asked for
__all__ = ["BACKEND_CHOICES", "BACKEND_ENV", "SIMULATOR_ENV", "Backend", "Capabilities", "KernelBackend", "get_backend",
           "requested_backend", "reset_backend"]

_REFERENCE = ReferenceBackend()
_TORCH = TorchBackend()


@functools.lru_cache(maxsize=1)
def requested_backend() -> str:
    """The backend asked for through the environment, validated; read once until `reset_backend()` (an
    invalid value is not cached: every call raises until it is fixed)."""
    value = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if value not in BACKEND_CHOICES:
        raise ValueError(f"{BACKEND_ENV}={value!r} is not valid; allowed: {', '.join(BACKEND_CHOICES)}")
    return value


def get_backend(device: Union[torch.device, str, None] = None) -> Backend:
    """The backend for tensors on `device` (a device, or its name: "npu", "cuda:0"; None is the CPU). A name is
    read without torch.device, which knows "npu" only once torch_npu is imported."""
    choice = requested_backend()
    if device is None:
        device_type = "cpu"
    else:
        device_type = device.type if isinstance(device, torch.device) else str(device).partition(":")[0]
    if choice == "auto":
        choice = "npu" if device_type == "npu" else "torch" if device_type == "cuda" else "reference"
    if choice == "npu":
        from mindspeed_te.kernels.npu import get_npu_backend

        return get_npu_backend()
    return _TORCH if choice == "torch" else _REFERENCE


def reset_backend() -> None:
    """Forget the resolved choice and the NPU backend built from the environment: the next kernel call reads
    the environment again. Resolution is left to that call, so a reset never fails on a bad value."""
    requested_backend.cache_clear()
    npu = sys.modules.get("mindspeed_te.kernels.npu")
    # tests may replace get_npu_backend by a plain function, which has no cache
    cache_clear = getattr(getattr(npu, "get_npu_backend", None), "cache_clear", None)
    if cache_clear is not None:
        cache_clear()
