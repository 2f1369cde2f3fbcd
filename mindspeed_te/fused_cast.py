"""The fused CPU quantize kernels (the optional C extension `mindspeed_te._fused_cast`), behind tensor APIs.

Quantizing with torch ops costs one pass over memory per op (divide, clamp, cast) and a few microseconds of
dispatch each; the extension reads every element once and also serves small tensors in one call. It covers
the per-tensor hot path: contiguous float32/bfloat16 CPU tensors, one float32 scale. Every function returns
None when its input is outside that, and the caller then uses the torch ops, which give the same bits.

`MINDSPEED_TE_FUSED_CAST=0` switches the extension off (the torch path is then used everywhere).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

try:
    from mindspeed_te import _fused_cast as _ext
except ImportError:  # not built (no compiler at install time, or a source tree without `pip install -e .`)
    _ext = None

__all__ = ["available", "amax", "scaled_cast"]

_IN_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_OUT_FORMATS = {"e4m3": 0, "e5m2": 1, "hif8": 2}


def available() -> bool:
    """Whether the extension is built and switched on."""
    return _ext is not None and os.environ.get("MINDSPEED_TE_FUSED_CAST", "1") != "0"


def _applies(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in _IN_DTYPES and x.is_contiguous() and available()


def amax(x: torch.Tensor) -> Optional[torch.Tensor]:
    """max |x| as a float32 0-d tensor (NaN if x holds one), or None when the extension does not apply."""
    if not _applies(x):
        return None
    out = torch.empty((), dtype=torch.float32)
    _ext.amax(x.data_ptr(), _IN_DTYPES[x.dtype], x.numel(), out.data_ptr(), torch.get_num_threads())
    return out


def scaled_cast(x: torch.Tensor, scale_inv: torch.Tensor, fmt: str,
                hif8_table: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Codes of sat(x / scale_inv) in format `fmt` ("e4m3", "e5m2" or "hif8" with its 65536-entry uint8
    saturating or plain encode table) as uint8 in x's shape, or None when the extension does not apply."""
    if not (_applies(x) and scale_inv.numel() == 1 and scale_inv.dtype == torch.float32
            and scale_inv.device.type == "cpu"):
        return None
    out = torch.empty(x.shape, dtype=torch.uint8)
    table = hif8_table.data_ptr() if hif8_table is not None else 0
    _ext.scaled_cast(x.data_ptr(), _IN_DTYPES[x.dtype], x.numel(), scale_inv.data_ptr(), out.data_ptr(),
                     _OUT_FORMATS[fmt], table, torch.get_num_threads())
    return out
