"""What the device can run, and the recipe used when none is given.

FP8 needs torch's float8 dtypes and a kernel backend that can run them; MXFP8 also needs the E8M0 scale
dtype. These probes and TransformerEngine's default-recipe rule depend on the device only, not on any
autocast state, so they stand apart from the regions that check them: `AvailabilityMixin` gives the
manager TE's `is_*_available` classmethods and the check an enabled region makes at entry.
"""
from __future__ import annotations

import torch

from mindspeed_te.kernels import get_backend
from mindspeed_te.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
)


def _accelerator_type() -> str:
    """The device type of the current accelerator ("npu", "cuda"), "cpu" where there is none: where an
    autocast region's modules run, so the device whose kernel backend the availability checks and the default
    recipe ask (the CPU's backend emulates everything and would accept any recipe)."""
    accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    return accelerator.type if accelerator is not None else "cpu"


def _fp8_support() -> tuple[bool, str]:
    """FP8 needs torch's float8 dtypes; the reference backend then runs it on any device, the NPU backend
    needs a chip with FP8 matmuls, the torch backend a CUDA device with FP8 GEMMs: the current accelerator's
    backend says, through its contract."""
    if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "float8_e5m2"):
        return False, f"torch {torch.__version__} has no float8 dtypes (need torch >= 2.1)"
    return get_backend(_accelerator_type()).available()


def _mxfp8_support() -> tuple[bool, str]:
    if not hasattr(torch, "float8_e8m0fnu"):
        return False, f"torch {torch.__version__} has no float8_e8m0fnu dtype for MX scales (need torch >= 2.7)"
    return _fp8_support()


def get_default_recipe() -> Recipe:
    """The recipe used when none is given, by TransformerEngine's rule: MXFP8BlockScaling on a device with
    MXFP8 GEMMs, Float8CurrentScaling on CUDA devices of compute capability 12.x (FP8 GEMMs, but MXFP8 not for
    every layout), DelayedScaling everywhere else. Here the device is the current accelerator and its kernel
    backend: an NPU whose kernels run FP8 (the Ascend 950 series, which has MX matmuls) gets MXFP8; the CPU,
    where every format is emulated and none has native GEMMs, keeps DelayedScaling, as do NPUs without FP8."""
    device_type = _accelerator_type()
    if device_type == "cuda":
        capability = torch.cuda.get_device_capability()
        if capability >= (12, 0):
            return Float8CurrentScaling()
        return MXFP8BlockScaling() if capability >= (10, 0) else DelayedScaling()
    backend = get_backend(device_type)
    if backend.capabilities.native_mx_gemm and backend.available()[0]:
        return MXFP8BlockScaling()
    return DelayedScaling()


class AvailabilityMixin:
    """The manager's availability queries (TransformerEngine's classmethods)."""

    @classmethod
    def is_fp8_available(cls) -> tuple[bool, str]:
        """(available, reason) for delayed and current per-tensor scaling."""
        return _fp8_support()

    @classmethod
    def is_mxfp8_available(cls) -> tuple[bool, str]:
        """(available, reason) for MXFP8BlockScaling."""
        return _mxfp8_support()

    @classmethod
    def is_fp8_block_scaling_available(cls) -> tuple[bool, str]:
        """(available, reason) for Float8BlockScaling."""
        return _fp8_support()

    @classmethod
    def is_nvfp4_available(cls) -> tuple[bool, str]:
        """(available, reason) for NVFP4BlockScaling: the NPU has no GEMM with its per-16 E4M3 scales."""
        available, reason = _fp8_support()
        return get_backend(_accelerator_type()).nvfp4_available() if available else (available, reason)

    @classmethod
    def _check_available(cls, recipe: Recipe) -> None:
        """Refuse an enabled region the device cannot run, with the reason."""
        if isinstance(recipe, MXFP8BlockScaling):
            available, reason = cls.is_mxfp8_available()
        elif isinstance(recipe, NVFP4BlockScaling):
            available, reason = cls.is_nvfp4_available()
        elif isinstance(recipe, Float8BlockScaling):
            available, reason = cls.is_fp8_block_scaling_available()
        else:
            available, reason = cls.is_fp8_available()
        if not available:
            kind = "NVFP4" if isinstance(recipe, NVFP4BlockScaling) else "FP8"
            raise RuntimeError(f"{kind} is not available: {reason} (recipe {type(recipe).__name__})")
