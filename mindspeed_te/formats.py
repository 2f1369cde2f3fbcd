"""8-bit element formats (E4M3, E5M2, HiF8) and the casts between them and float32.

Every cast goes through one dispatcher, `_cast`: the fused C kernel when it applies (mindspeed_te.fused_cast),
else torch ops, in one call for small inputs and chunk by chunk for large ones. Encoding computes the float32
values x / scale (an unscaled cast divides by 1, which is exact and quiets NaNs, see mindspeed_te.hif8),
then looks HiF8 codes up in a table by the values' top 16 bits, or clamps and casts to E4M3/E5M2. Decoding
looks the codes up in a table of the format's 256 values.

Large tensors are processed in cache-sized chunks: each chunk goes through the few ops of a conversion
(divide, clamp, cast, or divide, index, gather) while it is still in cache, instead of each op streaming
the whole tensor through memory.
"""
from __future__ import annotations

import enum
import sys
from typing import Optional

import torch

from mindspeed_te import fused_cast, hif8
from mindspeed_te.fp4 import FP4Dtype, e2m1_decode, e2m1_encode, pack_fp4, unpack_fp4
from mindspeed_te.hif8 import HIF8_MAX

__all__ = [
    "HIF8_MAX",
    "FP8Dtype",
    "hif8_encode",
    "hif8_decode",
    "cast_to_fp8",
    "cast_from_fp8",
    "scaled_cast",
    "quantize_table",
    "decode_table",
    "as_float32",
    # FP4 (E2M1), from mindspeed_te.fp4
    "FP4Dtype",
    "e2m1_encode",
    "e2m1_decode",
    "pack_fp4",
    "unpack_fp4",
]

_HIGH_HALF = 1 if sys.byteorder == "little" else 0  # which uint16 of a float32 holds sign, exponent, mantissa top
_E4M3_OVERFLOW = 464.0  # midpoint between 448 and the would-be 480: above it a non-saturating cast gives NaN

# Elements per chunk: a 2 MiB float32 scratch (plus 4 MiB of int64 table indices for HiF8) that stays in
# cache between the ops of a chain. Measured on 2 cores over 64 MiB inputs: 2^19 is a few percent faster
# than 2^18, 2^16 is 20-30% slower (per-op dispatch), 2^20 slower again for HiF8 (indices spill from L3).
# Inputs up to this size skip the chunk loop: below it the per-op overhead is what counts.
_CHUNK = 1 << 19


class FP8Dtype(enum.Enum):
    """Element format of quantized data."""

    E4M3 = "e4m3"
    E5M2 = "e5m2"
    HIF8 = "hif8"

    @property
    def max(self) -> float:
        """Largest finite value."""
        return _DTYPE_MAX[self.value]

    @property
    def storage_dtype(self) -> torch.dtype:
        """The torch dtype holding the data (HiF8 codes live in uint8)."""
        return _STORAGE_DTYPE[self.value]


_DTYPE_MAX = {"e4m3": 448.0, "e5m2": 57344.0, "hif8": HIF8_MAX}
_STORAGE_DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "hif8": torch.uint8}


# Constant tables ------------------------------------------------------------------------------------------
def _native_decode_table(fp8_dtype: FP8Dtype) -> torch.Tensor:
    return torch.arange(256, dtype=torch.int64).to(torch.uint8).view(fp8_dtype.storage_dtype).float()


_BUILDERS = {
    "encode_hif8": lambda: hif8.encode_table(saturate=False),
    "encode_sat_hif8": lambda: hif8.encode_table(saturate=True),
    "decode_hif8": hif8.decode_table,
    "decode_e4m3": lambda: _native_decode_table(FP8Dtype.E4M3),
    "decode_e5m2": lambda: _native_decode_table(FP8Dtype.E5M2),
}
_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}  # built lazily, once per device


def _table(kind: str, device: torch.device) -> torch.Tensor:
    """The constant table `kind` (a key of _BUILDERS) on `device`, built on first use."""
    key = (kind, device)
    table = _TABLES.get(key)
    if table is None:
        cpu = torch.device("cpu")
        if (kind, cpu) not in _TABLES:
            _TABLES[(kind, cpu)] = _BUILDERS[kind]()
        table = _TABLES[key] = _TABLES[(kind, cpu)].to(device)
    return table


def quantize_table(fp8_dtype: FP8Dtype, device: torch.device) -> Optional[torch.Tensor]:
    """The `table` argument of mindspeed_te.fused_cast's quantize functions: HiF8's saturating encode
    table, None for E4M3 and E5M2 (the kernels round those arithmetically)."""
    return _table("encode_sat_hif8", device) if fp8_dtype is FP8Dtype.HIF8 else None


def decode_table(fp8_dtype: FP8Dtype, device: torch.device) -> torch.Tensor:
    """The float32 values of the format's 256 codes, indexed by code."""
    return _table("decode_" + fp8_dtype.value, device)


_ONES: dict[torch.device, torch.Tensor] = {}


def _one(device: torch.device) -> torch.Tensor:
    """A float32 1 on `device`, the scale_inv of an unscaled cast."""
    one = _ONES.get(device)
    if one is None:
        one = _ONES[device] = torch.ones(1, dtype=torch.float32, device=device)
    return one


# Layout helpers -------------------------------------------------------------------------------------------
def as_float32(t: torch.Tensor) -> torch.Tensor:
    """t in float32, without a call when it already is (each call costs microseconds on small GEMMs)."""
    return t if t.dtype == torch.float32 else t.float()


def _memory_order(t: torch.Tensor) -> Optional[list[int]]:
    """The permutation that makes a dense but permuted tensor (e.g. a transpose) contiguous, so it can be
    converted without a copy and the result keeps its layout, as torch's own casts do. None when t is
    contiguous already or not dense."""
    if t.is_contiguous() or t.dim() < 2:
        return None
    perm = sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.size(d)))
    return perm if t.permute(perm).is_contiguous() else None


def _inverse(perm: list[int]) -> list[int]:
    inv = [0] * len(perm)
    for i, d in enumerate(perm):
        inv[d] = i
    return inv


def _layout(x: torch.Tensor, divisor: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor],
                                                                     Optional[list[int]]]:
    """(x in memory order as a contiguous view, the divisor aligned with it, the permutation to undo).

    x is flattened to 1-D when there is no divisor or a single-element one; with a block divisor the
    chunks run along x's leading dimension (in memory order), and the divisor is sliced alongside when it
    varies along that dimension."""
    perm = _memory_order(x)
    if perm is None and not x.is_contiguous():
        x = x.contiguous()  # not dense: one copy, the result is contiguous
    if divisor is not None and divisor.numel() != 1:
        divisor = divisor.reshape((1,) * (x.dim() - divisor.dim()) + tuple(divisor.shape))
        if perm is not None:
            divisor = divisor.permute(perm)
    xc = x.permute(perm) if perm is not None else x
    if divisor is None or divisor.numel() == 1 or xc.dim() == 0:
        xc = xc.reshape(-1)
    return xc, divisor, perm


def _index_by_halves(device: torch.device) -> bool:
    """Whether the top-16-bit table index can be one strided copy of the high uint16 halves (CPU/CUDA);
    elsewhere support for uint16 varies, and a shift and a mask do it."""
    return device.type in ("cpu", "cuda")


def _top_halves(values: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
    """The top 16 bits of each element of a contiguous float32 tensor, unsigned, as int64 (into `out`)."""
    flat = values.view(-1)
    if _index_by_halves(flat.device):
        halves = flat.view(torch.uint16)[_HIGH_HALF::2]
        return halves.long() if out is None else out.copy_(halves)
    index = torch.bitwise_right_shift(flat.view(torch.int32), 16, out=out).bitwise_and_(0xFFFF)
    return index if out is not None else index.long()


# The one cast dispatcher ----------------------------------------------------------------------------------
def _cast(x: torch.Tensor, fp8_dtype: FP8Dtype, divisor: Optional[torch.Tensor] = None,
          table: Optional[torch.Tensor] = None) -> torch.Tensor:
    """With a `divisor` (float32, broadcastable to x), the saturating codes of x / divisor in `fp8_dtype`:
    HiF8 by lookup in its encode `table`, E4M3/E5M2 by a clamp and torch's cast. Without one, the float32
    values of the codes x (uint8 or the format's dtype). The result has x's shape (a dense permuted x
    keeps its layout); the fused kernel is used when it applies, else torch ops."""
    if divisor is None:
        table = decode_table(fp8_dtype, x.device)
        fused = fused_cast.decode(x, table)  # takes float8 dtypes as they are (a view costs microseconds)
        x = x if fused is not None else x.view(torch.uint8)
        out_dtype = torch.float32
    else:
        if x.dtype == torch.float64:  # quantized from its float32 rounding, like every other input
            x = x.float()
        if divisor.numel() == 1 and divisor.dim() != min(x.dim(), 1):
            # per tensor: 1-D, since a 0-d divisor acts as a scalar (the division would run in x's dtype);
            # 0-d only against a 0-d x, which keeps the result 0-d
            divisor = divisor.reshape(() if x.dim() == 0 else 1)
        fused = fused_cast.scaled_cast(x, divisor, fp8_dtype.value, table)
        out_dtype = fp8_dtype.storage_dtype
    if fused is not None:
        return fused
    if x.numel() <= _CHUNK and (x.is_contiguous() or table is None):  # one call: the fewest ops
        return _cast_chunk(x, fp8_dtype, divisor, table).view(x.shape)

    xc, divisor, perm = _layout(x, divisor)
    out = torch.empty(xc.shape if perm is None else x.permute(perm).shape, dtype=out_dtype, device=x.device)
    n = xc.numel()
    if n:
        row_numel = n // xc.shape[0]
        step = max(1, _CHUNK // row_numel)  # rows per chunk
        size = min(n, step * row_numel)
        values = torch.empty(size, dtype=torch.float32, device=x.device) if divisor is not None else None
        index = torch.empty(size, dtype=torch.int64, device=x.device) if table is not None else None
        per_row = divisor is not None and divisor.dim() > 0 and divisor.shape[0] != 1
        parts, outs = xc.split(step), out.view(-1).split(step * row_numel)
        divisors = divisor.split(step) if per_row else [divisor] * len(parts)
        for part, dst, div in zip(parts, outs, divisors):
            k = dst.numel()
            buf = None if values is None else values[:k].view(part.shape)
            _cast_chunk(part, fp8_dtype, div, table, dst, buf, None if index is None else index[:k])
    out = out.view(x.permute(perm).shape if perm is not None else x.shape)
    return out.permute(_inverse(perm)) if perm is not None else out


def _cast_chunk(x: torch.Tensor, fp8_dtype: FP8Dtype, divisor: Optional[torch.Tensor],
                table: Optional[torch.Tensor], out: Optional[torch.Tensor] = None,
                values: Optional[torch.Tensor] = None, index: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The ops of `_cast` on one chunk, into the flat `out` and through the scratch buffers `values`
    (float32, x's shape) and `index` (int64, flat) when given; fresh tensors otherwise."""
    if divisor is not None:
        quotient = torch.div(x, divisor, out=values)
        quotient = quotient if values is not None else as_float32(quotient)
        if table is None:
            quotient.clamp_(-fp8_dtype.max, fp8_dtype.max)
            return quotient.to(fp8_dtype.storage_dtype) if out is None else out.copy_(quotient.view(-1))
        index = _top_halves(quotient, index)
    else:
        codes = x.reshape(-1)
        index = codes.long() if index is None else index.copy_(codes)
        table = table.view(torch.int32)  # torch's gather is 2x faster on int32 than on float32
    result = torch.gather(table, 0, index, out=None if out is None else out.view(table.dtype))
    return result.view(torch.float32) if divisor is None else result


# Public conversions ---------------------------------------------------------------------------------------
def hif8_encode(x: torch.Tensor, saturate: bool = False) -> torch.Tensor:
    """HiF8 codes (uint8, same shape) of a float tensor, rounding half away from zero. Without `saturate`,
    |x| >= 40960 becomes +-Inf; with it, +-32768. NaN -> 0x80, -0 -> 0x00. Inputs are taken as float32
    (exact for 16-bit floats; float64 is rounded to float32 first)."""
    if not x.is_floating_point():
        raise TypeError(f"hif8_encode expects a floating-point tensor, got {x.dtype}")
    table = _table("encode_sat_hif8" if saturate else "encode_hif8", x.device)
    return _cast(x.detach(), FP8Dtype.HIF8, _one(x.device), table)


def hif8_decode(data: torch.Tensor) -> torch.Tensor:
    """Exact float32 values of HiF8 codes (same shape; a transposed input gives a transposed result)."""
    if data.dtype != torch.uint8:
        raise TypeError(f"hif8_decode expects uint8 codes, got {data.dtype}")
    return _cast(data, FP8Dtype.HIF8)


def cast_to_fp8(x: torch.Tensor, fp8_dtype: FP8Dtype, saturate: bool = True) -> torch.Tensor:
    """Round x to the format (nearest-even for E4M3/E5M2, half away from zero for HiF8). With `saturate`,
    values beyond the largest finite one (and +-Inf) become +-max; NaN stays NaN. Without it, overflow
    becomes NaN for E4M3 (which has no Inf) and +-Inf for E5M2 and HiF8, as in the OCP spec and ml_dtypes."""
    if fp8_dtype is FP8Dtype.HIF8:
        return hif8_encode(x, saturate)
    if saturate:
        return _cast(x.detach(), fp8_dtype, _one(x.device))
    if fp8_dtype is FP8Dtype.E4M3:
        # torch 2.x casts E4M3 overflow to +-448; the format's rule is NaN past the 448/480 midpoint
        values = as_float32(x)
        nan = torch.copysign(torch.full_like(values, float("nan")), values)
        return torch.where(values.abs() > _E4M3_OVERFLOW, nan, values).to(fp8_dtype.storage_dtype)
    return x.to(fp8_dtype.storage_dtype)


def cast_from_fp8(data: torch.Tensor, fp8_dtype: FP8Dtype) -> torch.Tensor:
    """Exact float32 values of quantized data (E4M3/E5M2 data may also come as its uint8 bytes)."""
    if fp8_dtype is FP8Dtype.HIF8:
        return hif8_decode(data)
    return _cast(data, fp8_dtype)


def scaled_cast(x: torch.Tensor, scale_inv: torch.Tensor, fp8_dtype: FP8Dtype) -> torch.Tensor:
    """Saturating cast of x / scale_inv, computed in float32 with one IEEE division (the NPU quantize
    kernels' formula, so every backend gives the same bits): the quantize hot path.

    `scale_inv` is a float32 tensor broadcastable to x: one element for per-tensor scaling, or e.g.
    (..., nblocks, 1) against x of shape (..., nblocks, block). It is only used in tensor ops (no host
    sync). Equals cast_to_fp8(x.float() / scale_inv, fp8_dtype, saturate=True) bit for bit, in x's shape."""
    scale_inv = as_float32(scale_inv)
    if scale_inv.numel() != 1 and scale_inv.dim() > x.dim():
        raise ValueError(f"scale_inv of shape {tuple(scale_inv.shape)} does not broadcast to {tuple(x.shape)}")
    return _cast(x.detach(), fp8_dtype, scale_inv, quantize_table(fp8_dtype, x.device))
