"""Bench groups "quantize" and "hif8": quantize throughput as a ratio to `Tensor.copy_` of the same tensor.

1.0x means "as fast as a memory copy" and higher is better. The copy writes into memory it has written before;
a quantize allocates its outputs, and glibc's default allocator hands freed heap tops above its trim threshold
back to the OS, so that each call can fault its outputs' pages in again (both layouts of a 64 MiB tensor: two
16 MiB outputs). The "glibc defaults" rows show that cost; the target rows are measured after the bench raises
glibc's trim and mmap thresholds (mallopt), as a caching allocator (the NPU's) keeps memory mapped.
"""
from __future__ import annotations

import ctypes
from typing import Callable

import torch

from mindspeed_te.bench.report import best_time
from mindspeed_te.formats import hif8_encode
from mindspeed_te.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
)
from mindspeed_te.recipe_state import RecipeState


def forward_quantizer(recipe, role: str = "input", columnwise: bool = False):
    """The forward quantizer of a recipe for one tensor role (input or weight)."""
    state = RecipeState.create(recipe, forward=True, num_quantizers=3)
    quantizer = state.make_quantizers()[0 if role == "input" else 1]
    quantizer.set_usage(rowwise=True, columnwise=columnwise)
    return quantizer


def quantize_cases() -> dict[str, Callable]:
    """The quantizes of a training step. A per-tensor quantize makes one copy (its columnwise form is the
    transposed view); blockwise 1x128 activations and MXFP8 tensors are made in both layouts (fprop reads the
    rowwise one, wgrad the columnwise one), 128x128 weights in one (it serves both). The rowwise-only
    cases show what the columnwise copy costs."""
    return {
        "quantize delayed E4M3": forward_quantizer(DelayedScaling(fp8_format=Format.E4M3)),
        "quantize delayed HiF8": forward_quantizer(DelayedScaling(fp8_format=Format.HIF8)),
        "quantize current E4M3": forward_quantizer(Float8CurrentScaling(fp8_format=Format.E4M3)),
        "quantize current HiF8": forward_quantizer(Float8CurrentScaling(fp8_format=Format.HIF8)),
        "quantize blockwise 1x128 E4M3, both layouts": forward_quantizer(Float8BlockScaling(), columnwise=True),
        "quantize blockwise 1x128 E4M3, rowwise only": forward_quantizer(Float8BlockScaling()),
        "quantize blockwise 128x128 E4M3": forward_quantizer(Float8BlockScaling(), role="weight"),
        "quantize mxfp8 E4M3, both layouts": forward_quantizer(MXFP8BlockScaling(), columnwise=True),
        "quantize mxfp8 E4M3, rowwise only": forward_quantizer(MXFP8BlockScaling()),
    }


def keep_freed_memory_mapped() -> bool:
    """Raise glibc's trim threshold (M_TRIM_THRESHOLD, -1) and fix its mmap threshold at its 32 MiB maximum
    (M_MMAP_THRESHOLD, -3) for this process, so freed outputs stay mapped for the next call. False where
    there is no glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(-1, 1 << 30)) and bool(libc.mallopt(-3, 1 << 25))


def bench_quantize(size_mib: int, repeats: int) -> list[tuple[str, float, str]]:
    numel = size_mib * 2**20 // 4
    x = torch.randn(numel // 4096, 4096)
    dst = torch.empty_like(x)
    cases = quantize_cases()
    copy_t = best_time(lambda: dst.copy_(x), repeats)  # allocates nothing: the allocator does not matter
    rows = [("copy_ baseline", 1.0, f"{copy_t * 1e3:.2f} ms")]
    for name in [name for name in cases if name.endswith("both layouts")]:
        t = best_time(lambda q=cases[name]: q(x), repeats)
        rows.append((f"{name}, glibc defaults", copy_t / t, f"{t * 1e3:.2f} ms"))
    if not keep_freed_memory_mapped():
        rows = rows[:1]  # not glibc: the rows below are measured with the platform's allocator as it is
    for name, quantizer in cases.items():
        t = best_time(lambda q=quantizer: q(x), repeats)
        rows.append((name, copy_t / t, f"{t * 1e3:.2f} ms"))
    return rows


def bench_hif8(size_mib: int, repeats: int) -> list[tuple[str, float, str]]:
    import numpy as np

    try:
        import en_dtypes
    except ImportError:
        return [("hif8_encode vs en_dtypes", float("nan"), "en_dtypes not installed")]
    # en_dtypes is slow: both sides encode the same sixteenth of the tensor, best of the same repeats.
    part = torch.randn(size_mib * 2**20 // 4 // 16)
    array = part.numpy()
    ours = best_time(lambda: hif8_encode(part, saturate=True), repeats)
    theirs = best_time(lambda: np.clip(array, -32768, 32768).astype(en_dtypes.hifloat8), repeats)
    return [("hif8_encode vs en_dtypes", theirs / ours,
             f"ours {ours * 1e3:.2f} ms, en_dtypes {theirs * 1e3:.1f} ms, {part.numel():,} elements")]
