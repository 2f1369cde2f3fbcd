"""Scaling math as pure functions on tensors.

Everything stays a tensor operation: no `.item()`, no Python branching on tensor values, so scale updates
can run on an accelerator without host synchronization. Quantizers and the state manager call these.
"""
from __future__ import annotations

from typing import Callable, Union

import torch

from mindspeed_te import fused_cast
from mindspeed_te.formats import as_float32

FLT_MAX = torch.finfo(torch.float32).max

AmaxComputeAlgo = Union[str, Callable[[torch.Tensor], torch.Tensor]]


def _power_2_floor(value: torch.Tensor) -> torch.Tensor:
    """Round positive float32 values down to a power of two (clear the mantissa bits); exact."""
    bits = value.contiguous().view(torch.int32)
    return torch.bitwise_and(bits, 0x7F800000).view(torch.float32)


def _div(numerator: float, denominator: torch.Tensor) -> torch.Tensor:
    """numerator / denominator with one IEEE rounding (torch turns `scalar / tensor` into
    `reciprocal(tensor) * scalar`, which rounds twice)."""
    return torch.div(torch.full_like(denominator, numerator), denominator)


def _quotient(numerator: torch.Tensor, denominator: float) -> torch.Tensor:
    """numerator / denominator with one IEEE rounding. CUDA computes `tensor / Python number` as a product with
    the number's rounded reciprocal (off by one bit for some values, e.g. amax / 448), so there the number
    becomes a tensor; the CPU and the NPU divide."""
    if numerator.device.type != "cuda":
        return numerator / denominator
    return torch.div(numerator, torch.full((), denominator, dtype=numerator.dtype, device=numerator.device))


def compute_amax_from_history(amax_history: torch.Tensor, algo: AmaxComputeAlgo) -> torch.Tensor:
    """The amax a delayed-scaling update uses: max over the window or the newest value (slot 0)."""
    if callable(algo):
        return algo(amax_history)
    if algo == "max":
        return amax_history.amax(dim=0)
    if algo == "most_recent":
        return amax_history[0].clone()
    raise ValueError(f"amax_compute_algo must be 'max', 'most_recent' or a callable, got {algo!r}")


def roll_amax_history(amax_history: torch.Tensor) -> torch.Tensor:
    """Advance the [L, n] history window after a step.

    Slot 0 holds the amax of the step that just ended. A column whose new amax is positive and finite is
    rolled (new[i] = old[i + 1], the new amax goes to the end, slot 0 is cleared for the next step); a
    column whose new amax is 0 (the tensor was not seen) or not finite (NaN/Inf data) keeps its window, so
    one bad step cannot poison the history.
    """
    newest = amax_history[0]
    valid = torch.isfinite(newest) & (newest > 0)
    rolled = torch.roll(amax_history, shifts=-1, dims=0)
    kept = amax_history.clone()
    updated = torch.where(valid.unsqueeze(0), rolled, kept)
    updated[0] = 0.0
    return updated


def compute_scale(
    amax: torch.Tensor, scale: torch.Tensor, fp8_max: float, margin: float = 0.0
) -> torch.Tensor:
    """Delayed-scaling scale: (fp8_max / amax) / 2^margin; the old scale where amax is 0 or not finite;
    FLT_MAX where the quotient overflows."""
    new_scale = _div(fp8_max, amax) / (2.0**margin)
    new_scale = torch.where(torch.isinf(new_scale), torch.full_like(new_scale, FLT_MAX), new_scale)
    usable = torch.isfinite(amax) & (amax > 0)
    return torch.where(usable, new_scale, scale)


def delayed_scaling_update(
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    fp8_max: float,
    margin: float,
    amax_compute_algo: AmaxComputeAlgo,
    scaling_factor_compute_algo: Callable | None = None,
    recipe: object = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One delayed-scaling step for n tensors: returns (new amax_history [L, n], new scale [n]).

    The amax is computed over the window before it is rolled (the newest amax in slot 0 included), as
    TransformerEngine does. A column whose newest amax is 0 (the tensor was not seen, e.g. an MoE expert
    without tokens) or not finite keeps its scale and its window, as TransformerEngine's fused update does
    for 0; a non-finite amax never enters the history (see `roll_amax_history`).
    """
    newest = amax_history[0]
    finite_history = torch.where(torch.isfinite(newest), newest, torch.zeros_like(newest))
    window = torch.cat([finite_history.unsqueeze(0), amax_history[1:]], dim=0)
    amax = compute_amax_from_history(window, amax_compute_algo)
    if scaling_factor_compute_algo is not None:
        fp8_max_t = torch.full_like(scale, fp8_max)
        new_scale = scaling_factor_compute_algo(amax, scale, fp8_max_t, recipe)
    else:
        new_scale = compute_scale(amax, scale, fp8_max, margin)
    seen = torch.isfinite(newest) & (newest > 0)
    return roll_amax_history(amax_history), torch.where(seen, new_scale, scale)


def batched_delayed_update(amax_history: torch.Tensor, scale: torch.Tensor, fp8_max: torch.Tensor, margin: float,
                           amax_compute_algo: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`delayed_scaling_update` for the built-in algorithms in a fixed handful of device ops, whatever the
    number of columns: (new history, new scale). Slot 0 of `amax_history` [L, n] is cleared of NaN/Inf in
    place; `fp8_max` is a 0-d tensor or one per column, so the quotient is one IEEE division. Same results: a
    non-finite newest amax counts as 0, and a column whose newest amax is 0 keeps its window and scale."""
    newest = torch.nan_to_num(amax_history[0], nan=0.0, posinf=0.0, out=amax_history[0])
    amax = amax_history.amax(dim=0) if amax_compute_algo == "max" else newest
    new_scale = torch.div(fp8_max, amax)
    if margin:
        new_scale.div_(2.0**margin)
    new_scale.clamp_(max=FLT_MAX)
    seen = newest > 0
    new_scale = torch.where(seen, new_scale, scale)
    history = torch.where(seen, torch.roll(amax_history, shifts=-1, dims=0), amax_history)
    history[0] = 0.0
    return history, new_scale


_SMALL = 1 << 16  # elements below which per-op overhead, not memory traffic, dominates


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a float32 0-d tensor, NaN if x holds a NaN. One pass with aminmax, which is several times
    faster on CPU than abs().amax() and needs no temporary."""
    fused = fused_cast.amax(x)
    if fused is not None:
        return fused
    if x.numel() < _SMALL:
        return as_float32(x.abs().amax())  # fewer ops: cheaper below a few hundred KiB
    low, high = torch.aminmax(x)
    return as_float32(torch.maximum(high, low.neg()))


def current_scale(
    amax: torch.Tensor, fp8_max: float, amax_epsilon: float = 0.0, power_2_scale: bool = False
) -> torch.Tensor:
    """Current-scaling scale from an amax tensor (any shape): fp8_max / max(amax, eps); 1 where amax is 0,
    Inf or NaN; FLT_MAX where the quotient overflows; optionally rounded down to a power of two."""
    if amax_epsilon > 0:
        amax = torch.clamp(amax, min=amax_epsilon)
    amax = torch.nan_to_num(amax, nan=0.0, posinf=0.0)  # non-finite amaxes fall back to scale 1 below
    scale = torch.full_like(amax, fp8_max).div_(amax).clamp_(max=FLT_MAX)
    scale = torch.where(amax > 0, scale, 1.0)
    if power_2_scale:
        scale = _power_2_floor(scale)
    return scale


def current_scale_inv(
    amax: torch.Tensor, fp8_max: float, amax_epsilon: float = 0.0, power_2_scale: bool = False
) -> torch.Tensor:
    """Current-scaling decode scale, the form the NPU's dynamic-quant kernels produce (data = x / scale_inv):
    max(amax, eps) / fp8_max in one IEEE division, never below 1/FLT_MAX; 1 where amax is 0, Inf or NaN.
    With `power_2_scale` it is the inverse of the power-of-two `current_scale`, so it is exact."""
    fused = fused_cast.current_scale_inv(amax, fp8_max, amax_epsilon, power_2_scale)
    if fused is not None:
        return fused
    if power_2_scale:
        return current_scale(amax, fp8_max, amax_epsilon, True).reciprocal()
    if amax_epsilon > 0:
        amax = torch.clamp(amax, min=amax_epsilon)
    amax = torch.nan_to_num(amax, nan=0.0, posinf=0.0)
    scale_inv = _quotient(amax, fp8_max).clamp_(min=1.0 / FLT_MAX)
    return torch.where(amax > 0, scale_inv, 1.0)


def mark_nonfinite(scale_inv: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """scale_inv where the matching amax is finite, NaN where it is NaN or Inf (one elementwise op, no host
    sync). Quantization casts with a finite scale, so the codes and any stored scale stay finite; the NaN
    decode scale makes the tensor dequantize to NaN, and the GEMM it enters gives a non-finite output, as it
    would in high precision (a saturated Inf would otherwise look like a large finite value)."""
    return torch.add(scale_inv, amax, alpha=0.0)  # scale_inv + 0 · amax, one op: 0 · NaN = 0 · Inf = NaN


def pad_to_multiple(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad a 2-D tensor so both dims are whole multiples of the tile size."""
    pad_r = (-x.shape[0]) % rows
    pad_c = (-x.shape[1]) % cols
    if pad_r or pad_c:
        x = torch.nn.functional.pad(x, (0, pad_c, 0, pad_r))
    return x


def tile_view(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """View a 2-D tensor whose dims are multiples of (rows, cols) as [R, rows, C, cols] tiles."""
    m, k = x.shape
    return x.reshape(m // rows, rows, k // cols, cols)


def mx_scale_exponent(amax: torch.Tensor, fp8_max: float, emax_elem: int, rounding: str) -> torch.Tensor:
    """Unbiased power-of-two exponent of each MX block's decode scale, clamped to E8M0's range [-127, 127].

    "ceil": 2^ceil(log2(amax / fp8_max)), the smallest power of two that keeps the block unsaturated.
    "floor": floor(log2(amax)) - emax_elem, the OCP MX rule (elements may saturate).
    Blocks whose amax is 0 or not finite get exponent -127 / 0 respectively (their data is 0 or non-finite).
    """
    amax = amax.float()
    safe = torch.where(torch.isfinite(amax) & (amax > 0), amax, torch.ones_like(amax))
    if rounding == "ceil":
        # frexp gives safe/fp8_max = m * 2^e with m in [0.5, 1): ceil(log2) is e, or e - 1 for an exact power of 2.
        # float64: a float32 quotient can round down onto a power of two and let the block saturate.
        ratio = _quotient(safe.double(), fp8_max)
        mant, exp = torch.frexp(ratio)
        exponent = torch.where(mant == 0.5, exp - 1, exp)
        exponent = torch.where(ratio > 0, exponent, torch.full_like(exponent, -127))
    elif rounding == "floor":
        _, exp = torch.frexp(safe)
        exponent = (exp - 1) - emax_elem
    else:
        raise ValueError(f"MX scale rounding must be 'ceil' or 'floor', got {rounding!r}")
    exponent = torch.where(amax > 0, exponent, torch.full_like(exponent, -127))
    exponent = torch.where(torch.isfinite(amax), exponent, torch.zeros_like(exponent))
    return exponent.clamp(-127, 127).to(torch.int32)


def e8m0_encode(exponent: torch.Tensor) -> torch.Tensor:
    """Unbiased exponent -> E8M0 byte (bias 127) stored as uint8."""
    return (exponent.to(torch.int32) + 127).to(torch.uint8)


def e8m0_decode(code: torch.Tensor) -> torch.Tensor:
    """E8M0 byte -> float32 2^(code - 127); 0xFF is NaN."""
    return code.view(torch.float8_e8m0fnu).float()
