"""The cube unit's arithmetic: a matmul whose products are exact and whose sums are float32.

A float32 matmul of FP8/HiF8 values computes that: every value of those formats, times a power-of-2 scale, is
also a bfloat16 value, so each product is exact in float32. Where every input value is a bfloat16 value, this
lets oneDNN take its bfloat16 kernel (no rounding of the inputs, float32 sums) instead of the float32 one. The
reference backend makes the same choice for the same operands, so the two sum in the same order and agree
bit for bit. Products below float32's normal range (about 1e-38) may count as zero on that kernel.
"""
from __future__ import annotations

import torch

__all__ = ["cube_matmul"]


def _all_bfloat16(t: torch.Tensor) -> bool:
    return t.dtype == torch.bfloat16 or (t.dtype == torch.float32 and torch.equal(t, t.bfloat16().float()))


def cube_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.matmul of float32 (or bfloat16, taken as float32) operands with exact products and float32 sums."""
    exact_in_bf16 = a.device.type == "cpu" and _all_bfloat16(a) and _all_bfloat16(b)
    a, b = a.float(), b.float()
    if not exact_in_bf16:
        return torch.matmul(a, b)
    matmul_flags = torch.backends.mkldnn.matmul
    kept = matmul_flags.fp32_precision
    matmul_flags.fp32_precision = "bf16"
    try:
        return torch.matmul(a, b)
    finally:
        matmul_flags.fp32_precision = kept
