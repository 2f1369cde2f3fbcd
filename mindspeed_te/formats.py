"""8-bit element formats: E4M3, E5M2 and HiF8, and the `Format` enum recipes choose them with.

HiF8 (Huawei's tapered 8-bit float) has no torch dtype; its codes travel in `torch.uint8` tensors.

Encoding HiF8 is one table lookup per element. Rounding half away from zero to at most 3 mantissa bits only
looks at the bits down to the half-ULP bit, and those all sit in the top 16 bits of a float32 (sign,
exponent, 7 mantissa bits), so a 65536-entry table indexed by them gives the exact code. The one thing the
low 16 bits can change is NaN-versus-Inf (a NaN whose payload is only in the low bits); every float op
quiets a NaN by setting the top mantissa bit, so the encoder first passes the data through one float op
(a multiply by 1, or the division by `scale_inv` in `scaled_cast`).

Large tensors are processed in cache-sized chunks: each chunk goes through the few ops of a conversion
(divide, clamp, cast, or divide, index, gather) while it is still in cache, instead of each op streaming
the whole tensor through memory.
"""
from __future__ import annotations

import enum
import sys
from typing import NamedTuple, Optional

import torch

from mindspeed_te import fused_cast

__all__ = [
    "HIF8_MAX",
    "FP8Dtype",
    "Format",
    "hif8_encode",
    "hif8_decode",
    "cast_to_fp8",
    "cast_from_fp8",
    "scaled_cast",
    "as_float32",
]

HIF8_MAX = 32768.0
HIF8_NAN = 0x80
HIF8_INF = 0x6F
HIF8_MAX_CODE = 0x6E
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


class _FormatHelper(NamedTuple):
    """A Format's value, as in TransformerEngine (`Format.E4M3.value.max_fwd`), plus the element dtypes."""

    fwd: str
    bwd: str
    max_fwd: float
    max_bwd: float


class Format(enum.Enum):
    """TransformerEngine's recipe.Format, plus HIF8: element dtypes and default target maxima of forward
    tensors (activations, weights) and backward tensors (gradients). HiF8's targets 15 and 224 are the tops
    of its 3- and 2-mantissa-bit ranges (MindSpeed's choice); recipes can override them."""

    E4M3 = _FormatHelper("E4M3", "E4M3", 448.0, 448.0)
    E5M2 = _FormatHelper("E5M2", "E5M2", 57344.0, 57344.0)
    HYBRID = _FormatHelper("E4M3", "E5M2", 448.0, 57344.0)
    HIF8 = _FormatHelper("HIF8", "HIF8", 15.0, 224.0)

    @property
    def fwd_dtype(self) -> FP8Dtype:
        return FP8Dtype[self.value.fwd]

    @property
    def bwd_dtype(self) -> FP8Dtype:
        return FP8Dtype[self.value.bwd]

    @property
    def max_fwd(self) -> float:
        return self.value.max_fwd

    @property
    def max_bwd(self) -> float:
        return self.value.max_bwd

    @classmethod
    def from_name(cls, name: str) -> "Format":
        """Format from Megatron's --fp8-format value (case-insensitive)."""
        key = str(name).strip().upper()
        if key not in cls.__members__:
            allowed = ", ".join(m.lower() for m in cls.__members__)
            raise ValueError(f"fp8 format {name!r} is not supported; allowed: {allowed}")
        return cls[key]


# HiF8 tables --------------------------------------------------------------------------------------------
def _mantissa_bits(exponent: int) -> int:
    """HiF8 precision is tapered: 3 mantissa bits for |E| <= 3, 2 up to 7, 1 up to 15."""
    mag = abs(exponent)
    return 3 if mag <= 3 else 2 if mag <= 7 else 1


def _hif8_code(exponent: int) -> int:
    """Code of the positive normal value 2^exponent (mantissa field 0), |exponent| <= 15: a dot prefix
    that gives the exponent width D, the exponent's sign, the low D-1 bits of |E|, then the mantissa."""
    mag, neg = abs(exponent), int(exponent < 0)
    mbits = _mantissa_bits(exponent)
    if mag == 0:
        return 0b0001 << 3
    if mag == 1:
        return 0b001 << 4 | neg << 3
    width = mag.bit_length()  # D = 2, 3, 4 with prefixes 01, 10, 11
    return (width - 1) << 5 | neg << 4 | (mag - (1 << (width - 1))) << mbits


# Per binade of the input (float32 exponent E, -24..16): mantissa bits kept and the code of 2^E. Below 2^-15
# HiF8 has only powers of two (denormal codes 1..7 = 2^-22..2^-16), so 0 mantissa bits there; [2^-23,
# 2^-22) rounds up to 2^-22 (ties away from 0 at the midpoint 2^-23); 2^16 stands for "overflow" (Inf code;
# 1.5 * 2^15, the would-be mantissa 1 of 2^15, is the Inf code too, so 40960 and up round to Inf).
_EXP_LO, _EXP_HI = -24, 16
_BINADE_MBITS = [0] * 9 + [_mantissa_bits(e) for e in range(-15, 16)] + [0]
_BINADE_BASE = [0, 1] + [e + 23 for e in range(-22, -15)] + [_hif8_code(e) for e in range(-15, 16)] + [HIF8_INF]


def _build_encode_table() -> torch.Tensor:
    """Non-saturating code for each top-16-bit pattern of a float32, by rounding the 7 mantissa bits the
    pattern holds to the binade's precision, half away from zero (vectorized over all 65536 patterns)."""
    p = torch.arange(65536, dtype=torch.int64)
    sign, biased, mant = p >> 15, (p >> 7) & 0xFF, p & 0x7F
    exponent = biased - 127
    mbits_t = torch.tensor(_BINADE_MBITS, dtype=torch.int64)
    base_t = torch.tensor(_BINADE_BASE, dtype=torch.int64)
    e = exponent.clamp(_EXP_LO, _EXP_HI)
    m = mbits_t[e - _EXP_LO]
    q = (mant + (64 >> m)) >> (7 - m)  # add half an ULP of the target precision, truncate
    carry = q >> m  # rounded up to the next power of two
    q = q - (carry << m)
    body = base_t[(e + carry).clamp(max=_EXP_HI) - _EXP_LO] + q
    body = torch.where(exponent < -23, 0, body)  # below 2^-23: 0
    body = torch.where(exponent >= 16, HIF8_INF, body)  # 2^16 and up, and Inf
    code = torch.where(body == 0, 0, sign << 7 | body)  # -0 and tiny negatives become the one zero, 0x00
    code = torch.where((biased == 255) & (mant != 0), HIF8_NAN, code)
    return code.to(torch.uint8)


def _build_decode_table() -> torch.Tensor:
    """Value of each of the 256 codes, parsed from the bit layout (vectorized over the codes)."""
    c = torch.arange(256, dtype=torch.int64)
    sign, b = c >> 7, c & 0x7F
    # dot prefix -> exponent width D: 11 -> 4, 10 -> 3, 01 -> 2, 001 -> 1, 0001 -> 0, 0000 -> denormal
    d4, d3, d2, d1 = b >= 0x60, (b >= 0x40) & (b < 0x60), (b >= 0x20) & (b < 0x40), (b >= 0x10) & (b < 0x20)
    d0, denormal = (b >= 0x08) & (b < 0x10), b < 0x08
    mbits = torch.where(d4, 1, torch.where(d3, 2, 3))
    width = torch.where(d4, 4, torch.where(d3, 3, torch.where(d2, 2, torch.where(d1, 1, 0))))
    neg_bit = torch.where(d1, (b >> 3) & 1, (b >> 4) & 1)
    low_bits = (b >> mbits) & ((1 << (width - 1).clamp(min=0)) - 1)
    magnitude = torch.where(d0, 0, (1 << (width - 1).clamp(min=0)) + low_bits)
    exponent = torch.where(neg_bit.bool() & ~d0, -magnitude, magnitude)
    mantissa = b & ((1 << mbits) - 1)
    value = torch.exp2(exponent.double()) * (1 + mantissa.double() / (1 << mbits).double())
    value = torch.where(denormal, torch.exp2((b - 23).double()), value)
    value = torch.where(b == 0, 0.0, value)
    value = torch.where(b == HIF8_INF, float("inf"), value)
    value = torch.where(sign == 1, -value, value)
    value = torch.where(c == HIF8_NAN, float("nan"), value)
    return value.to(torch.float32)


_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}  # constant lookup tables, built lazily per device


def _build_table(kind: str) -> torch.Tensor:
    if kind == "encode":
        return _build_encode_table()
    if kind == "encode_sat":
        table = _build_encode_table()
        table[table == HIF8_INF] = HIF8_MAX_CODE
        table[table == (0x80 | HIF8_INF)] = 0x80 | HIF8_MAX_CODE
        return table
    if kind == "decode_hif8":
        return _build_decode_table()
    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8)  # "decode_e4m3", "decode_e5m2"
    return codes.view(FP8Dtype(kind[len("decode_"):]).storage_dtype).float()


def _table(kind: str, device: torch.device) -> torch.Tensor:
    """The constant table `kind` on `device`, built on first use: "encode" / "encode_sat" (HiF8 codes by
    the top 16 bits of a float32), "decode_hif8" / "decode_e4m3" / "decode_e5m2" (values of the codes)."""
    key = (kind, device)
    table = _TABLES.get(key)
    if table is None:
        cpu = torch.device("cpu")
        if (kind, cpu) not in _TABLES:
            _TABLES[(kind, cpu)] = _build_table(kind)
        table = _TABLES[key] = _TABLES[(kind, cpu)].to(device)
    return table


def quantize_table(fp8_dtype: FP8Dtype, device: torch.device) -> Optional[torch.Tensor]:
    """The `table` argument of mindspeed_te.fused_cast's quantize functions: HiF8's saturating encode
    table, None for E4M3 and E5M2 (the kernels round those arithmetically)."""
    return _table("encode_sat", device) if fp8_dtype is FP8Dtype.HIF8 else None


_ONES: dict[torch.device, torch.Tensor] = {}


def _one(device: torch.device) -> torch.Tensor:
    """A float32 1 on `device`, the scale_inv of an unscaled cast."""
    one = _ONES.get(device)
    if one is None:
        one = _ONES[device] = torch.ones(1, dtype=torch.float32, device=device)
    return one


# Layout and chunking helpers -------------------------------------------------------------------------------
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


def _convert(x: torch.Tensor, out_dtype: torch.dtype, first: str, *, divisor: Optional[torch.Tensor] = None,
             limit: Optional[float] = None, table: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Converts x chunk by chunk; returns the result in x's shape, keeping a dense permuted layout.

    Per chunk, `first` makes float32 values in a cached scratch buffer: "div" (x / divisor), "quiet"
    (x * 1: exact, and every NaN comes out quiet, with a bit set in the top 16 bits), "clamp" (to
    +-limit) or "none" (the chunk itself, for decoding). Then a clamp to +-limit if `limit` is given and
    first != "clamp", and the output: a `table` lookup (HiF8 encode: indexed by the top 16 bits; decode:
    indexed by the code) or a cast to out_dtype."""
    xc, divisor, perm = _layout(x, divisor)
    out = torch.empty(x.permute(perm).shape if perm is not None else x.shape, dtype=out_dtype, device=x.device)
    n = xc.numel()
    if n:
        rows = xc.shape[0]
        row_numel = n // rows
        step = max(1, _CHUNK // row_numel)
        size = min(n, step * row_numel)
        device = x.device
        scratch = torch.empty(size, dtype=torch.float32, device=device) if first != "none" else None
        ints = torch.empty(size, dtype=torch.int64, device=device) if table is not None else None
        per_row = divisor is not None and divisor.dim() > 0 and divisor.shape[0] != 1
        if n == size:  # one chunk: skip the splits (small tensors pay per call, not per byte)
            parts, outs, divisors = (xc,), (out.view(-1),), (divisor,)
        else:
            parts, outs = xc.split(step), out.view(-1).split(step * row_numel)
            divisors = divisor.split(step) if per_row else None
        encode = table is not None and first != "none"
        halves = _index_by_halves(device)  # table index: the top 16 bits of each float32, unsigned
        for i, part in enumerate(parts):
            dst = outs[i]
            k = dst.numel()
            if scratch is not None:
                flat = scratch if k == size else scratch[:k]
                buf = flat if part.dim() == 1 else flat.view(part.shape)
                if first == "div":
                    torch.div(part, divisors[i] if per_row else divisor, out=buf)
                elif first == "quiet":
                    torch.mul(part, 1.0, out=buf)
                elif part.dtype == torch.float32:  # "clamp"
                    torch.clamp(part, -limit, limit, out=buf)
                else:
                    buf.copy_(part).clamp_(-limit, limit)  # clamp's out= must have the input's dtype
                if limit is not None and first != "clamp":
                    flat.clamp_(-limit, limit)
            index = None if ints is None else ints if k == size else ints[:k]
            if encode:
                if halves:
                    index.copy_(flat.view(torch.uint16)[_HIGH_HALF::2])
                else:
                    torch.bitwise_right_shift(flat.view(torch.int32), 16, out=index).bitwise_and_(0xFFFF)
                torch.gather(table, 0, index, out=dst)
            elif table is not None:  # decode
                torch.gather(table, 0, index.copy_(part.reshape(-1)), out=dst.view(table.dtype))
            else:
                dst.copy_(flat)
    if perm is not None:
        out = out.permute(_inverse(perm))
    return out


def _index_by_halves(device: torch.device) -> bool:
    """Whether the top-16-bit table index can be one strided copy of the high uint16 halves (CPU/CUDA);
    elsewhere support for uint16 varies, and a shift and a mask do it."""
    return device.type in ("cpu", "cuda")


def _encode_small(values: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """HiF8 codes of a fresh contiguous float32 tensor whose NaNs are quiet, in the fewest ops: below one
    chunk the per-op cost of a few microseconds is what counts, not memory traffic."""
    flat = values.view(-1)
    if _index_by_halves(flat.device):
        index = flat.view(torch.uint16)[_HIGH_HALF::2].long()
    else:
        index = torch.bitwise_right_shift(flat.view(torch.int32), 16).bitwise_and_(0xFFFF).long()
    return torch.gather(table, 0, index).view(values.shape)


# Public conversions ---------------------------------------------------------------------------------------
def hif8_encode(x: torch.Tensor, saturate: bool = False) -> torch.Tensor:
    """HiF8 codes (uint8, same shape) of a float tensor, rounding half away from zero. Without `saturate`,
    |x| >= 40960 becomes +-Inf; with it, +-32768. NaN -> 0x80, -0 -> 0x00. Inputs are taken as float32
    (exact for 16-bit floats; float64 is rounded to float32 first)."""
    if not x.is_floating_point():
        raise TypeError(f"hif8_encode expects a floating-point tensor, got {x.dtype}")
    x = x.detach()
    table = _table("encode_sat" if saturate else "encode", x.device)
    fused = fused_cast.scaled_cast(x, _one(x.device), "hif8", table)  # x / 1 is exact and quiets NaNs
    if fused is not None:
        return fused
    if x.numel() <= _CHUNK and x.is_contiguous():
        values = torch.mul(x, 1.0) if x.dtype == torch.float32 else x.float().mul_(1.0)  # quiets NaNs
        return _encode_small(values, table)
    return _convert(x, torch.uint8, "quiet", table=table)


def hif8_decode(data: torch.Tensor) -> torch.Tensor:
    """Exact float32 values of HiF8 codes (same shape; a transposed input gives a transposed result)."""
    if data.dtype != torch.uint8:
        raise TypeError(f"hif8_decode expects uint8 codes, got {data.dtype}")
    fused = fused_cast.decode(data, _table("decode_hif8", data.device))
    if fused is not None:
        return fused
    table = _table("decode_hif8", data.device).view(torch.int32)  # torch's gather is 2x faster on int32 than float32
    if data.numel() <= _CHUNK and data.is_contiguous():
        return torch.gather(table, 0, data.view(-1).long()).view(torch.float32).view(data.shape)
    return _convert(data, torch.float32, "none", table=table)


def cast_to_fp8(x: torch.Tensor, fp8_dtype: FP8Dtype, saturate: bool = True) -> torch.Tensor:
    """Round x to the format (nearest-even for E4M3/E5M2, half away from zero for HiF8). With `saturate`,
    values beyond the largest finite one (and +-Inf) become +-max; NaN stays NaN. Without it, overflow
    becomes NaN for E4M3 (which has no Inf) and +-Inf for E5M2 and HiF8, as in the OCP spec and ml_dtypes."""
    if fp8_dtype is FP8Dtype.HIF8:
        return hif8_encode(x, saturate)
    if not saturate:
        if fp8_dtype is FP8Dtype.E4M3:
            # torch 2.x casts E4M3 overflow to +-448; the format's rule is NaN past the 448/480 midpoint
            values = as_float32(x)
            nan = torch.copysign(torch.full_like(values, float("nan")), values)
            return torch.where(values.abs() > _E4M3_OVERFLOW, nan, values).to(fp8_dtype.storage_dtype)
        return x.to(fp8_dtype.storage_dtype)
    fused = fused_cast.scaled_cast(x.detach(), _one(x.device), fp8_dtype.value)
    if fused is not None:
        return fused
    if x.numel() <= _CHUNK:
        return as_float32(x).clamp(-fp8_dtype.max, fp8_dtype.max).to(fp8_dtype.storage_dtype)
    return _convert(x.detach(), fp8_dtype.storage_dtype, "clamp", limit=fp8_dtype.max)


_DECODE_TABLE = {f: "decode_" + f.value for f in FP8Dtype}


def cast_from_fp8(data: torch.Tensor, fp8_dtype: FP8Dtype) -> torch.Tensor:
    """Exact float32 values of quantized data (E4M3/E5M2 data may also come as its uint8 bytes)."""
    if fp8_dtype is FP8Dtype.HIF8:
        return hif8_decode(data)
    fused = fused_cast.decode(data, _table(_DECODE_TABLE[fp8_dtype], data.device))
    if fused is not None:
        return fused
    if data.dtype == torch.uint8:
        data = data.view(fp8_dtype.storage_dtype)
    return data.float()


def scaled_cast(x: torch.Tensor, scale_inv: torch.Tensor, fp8_dtype: FP8Dtype) -> torch.Tensor:
    """Saturating cast of x / scale_inv, computed in float32 with one IEEE division (the NPU quantize
    kernels' formula, so every backend gives the same bits): the quantize hot path.

    `scale_inv` is a float32 tensor broadcastable to x: one element for per-tensor scaling, or e.g.
    (..., nblocks, 1) against x of shape (..., nblocks, block). It is only used in tensor ops (no host
    sync). Equals cast_to_fp8(x.float() / scale_inv, fp8_dtype, saturate=True) bit for bit, in x's shape."""
    scale_inv = as_float32(scale_inv)
    if scale_inv.numel() == 1:
        if scale_inv.dim() != min(x.dim(), 1):
            # per tensor: 1-D, since a 0-d divisor acts as a scalar (the division would run in x's dtype);
            # 0-d only against a 0-d x, which keeps the result 0-d and float32
            scale_inv = scale_inv.reshape(() if x.dim() == 0 else 1)
    elif scale_inv.dim() > x.dim():
        raise ValueError(f"scale_inv of shape {tuple(scale_inv.shape)} does not broadcast to {tuple(x.shape)}")
    x = x.detach()
    if x.dtype == torch.float64:  # quantized from its float32 rounding, like every other input
        x = x.float()
    table = quantize_table(fp8_dtype, x.device)
    fused = fused_cast.scaled_cast(x, scale_inv, fp8_dtype.value, table)
    if fused is not None:
        return fused
    small = x.numel() <= _CHUNK
    if table is not None:  # HiF8
        if small and x.is_contiguous():
            return _encode_small(torch.div(x, scale_inv), table)
        return _convert(x, torch.uint8, "div", divisor=scale_inv, table=table)
    limit = fp8_dtype.max
    if small:  # the fewest ops
        return torch.div(x, scale_inv).clamp_(-limit, limit).to(fp8_dtype.storage_dtype)
    return _convert(x, fp8_dtype.storage_dtype, "div", divisor=scale_inv, limit=limit)
