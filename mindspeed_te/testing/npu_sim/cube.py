"""The cube unit's arithmetic: a matmul whose products are exact and whose sums are float32.

A float32 matmul of FP8/HiF8 values computes that: every value of those formats, times a power-of-2 scale, is
also a bfloat16 value, so each product is exact in float32. Where every input value is a bfloat16 value, this
lets oneDNN take its bfloat16 kernel (no rounding of the inputs, float32 sums) instead of the float32 one,
for matmuls large enough that it is the faster.
The reference backend chooses that kernel by the operands' formats (FP8 codes times power-of-2 scales), this
module by the values themselves, on its own; both choose alike unless float32 block scales happen to give only
bfloat16 values, and then the two sums may differ in their last bits. Products below float32's normal range
(about 1e-38) may count as zero on the bfloat16 kernel. Where the output is bfloat16 and nothing is applied
after the sum, both let that kernel round its float32 sum to bfloat16 itself (`cube_matmul_rounded`).

The float32 sums of such a matmul may come out in any order; the reference backend sums one of bfloat16
values, of any size, with mindspeed_te's own bf16 GEMM where the CPU has one (a fixed order, which the
library's tests check against a NumPy emulation of it). `set_bf16_matmul` gives the cube that engine (mindspeed_te's
NPU backend passes it when it runs on the simulator), so that both sum alike; the simulator itself imports
nothing of the library.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = ["cube_matmul", "cube_matmul_rounded", "set_bf16_matmul"]

# (a (M, K), b (N, K)) -> a · bᵀ as float32, or None where it does not apply
Bf16Matmul = Callable[[torch.Tensor, torch.Tensor], Optional[torch.Tensor]]
_bf16_matmul: Optional[Bf16Matmul] = None


def set_bf16_matmul(engine: Optional[Bf16Matmul]) -> None:
    """Sum every 2-D matmul of bfloat16 values with `engine` where it takes it (None: oneDNN, as below)."""
    global _bf16_matmul
    _bf16_matmul = engine


# Below this many multiply-adds the float32 kernel is the faster one; the reference backend draws the line at
# the same size (its BF16_KERNEL_MIN_MACS), so the two sum alike.
MIN_MACS_FOR_BF16 = 4_194_304


def _all_bfloat16(t: torch.Tensor) -> bool:
    """Whether every value is a bfloat16 value (NaN counts as one: a NaN code decodes to one)."""
    if t.dtype != torch.float32:
        return t.dtype == torch.bfloat16
    numbers = t.nan_to_num(0.0, posinf=float("inf"), neginf=float("-inf"))
    return torch.equal(numbers, numbers.bfloat16().float())


def _bf16_kernel_applies(a: torch.Tensor, b: torch.Tensor) -> bool:
    macs = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]).numel() * a.shape[-2] * a.shape[-1] * b.shape[-1]
    return a.device.type == "cpu" and macs >= MIN_MACS_FOR_BF16 and _all_bfloat16(a) and _all_bfloat16(b)


def cube_matmul_rounded(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """cube_matmul's float32 sum rounded once to `out_dtype`. Where the bf16 kernel applies and the output is
    bfloat16, that kernel writes the rounded sum itself (as the reference backend has it do)."""
    if out_dtype == torch.bfloat16 and _bf16_kernel_applies(a, b):
        return torch.matmul(a.bfloat16(), b.bfloat16())
    return cube_matmul(a, b).to(out_dtype)


def cube_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.matmul of float32 (or bfloat16, taken as float32) operands with exact products and float32 sums."""
    if (_bf16_matmul is not None and a.dim() == 2 and b.dim() == 2 and a.device.type == "cpu"
            and _all_bfloat16(a) and _all_bfloat16(b)):
        summed = _bf16_matmul(a, b.t())
        if summed is not None:
            return summed
    exact_in_bf16 = _bf16_kernel_applies(a, b)
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
