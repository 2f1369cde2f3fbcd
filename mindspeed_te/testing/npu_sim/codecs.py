"""The simulator's own encode/decode of E4M3, E5M2, HiF8 and E8M0, built from the bit layouts alone.

Written apart from `mindspeed_te.formats` on purpose: when the NPU path (through this simulator) equals the
reference backend bit for bit, two implementations agree, not one with itself. Each format is a table of its
256 codes decoded from the bit fields; encoding rounds to the nearest table entry (ties to the even code for
the OCP formats, away from zero for HiF8, as Huawei's converters do). Slower than a fused cast, which is fine
for a test double; tests/test_npu_sim.py checks the tables against ml_dtypes and en_dtypes.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from mindspeed_te.testing.npu_sim.dtypes import HIFLOAT8, Dtype

__all__ = ["CodeTable", "code_table", "decode", "encode", "format_max", "e8m0_values"]


@dataclass(frozen=True)
class CodeTable:
    """One 8-bit float format as data: what every code means and how to pick a code for a value."""

    name: str
    values: torch.Tensor  # float64[256]: value of each code (NaN, +-Inf included)
    ladder: torch.Tensor  # float64: the distinct non-negative finite values ascending, then the overflow step
    ladder_codes: torch.Tensor  # int64: the code of each ladder entry (the last one is Inf or NaN)
    max: float  # largest finite value
    top: float  # the last ladder entry (the step past max, where overflow lands)
    nan_code: int
    ties_away: bool  # round half away from zero (HiF8) instead of half to the even code (OCP)
    negative_zero: bool  # whether 0x80 is -0 (OCP) rather than NaN (HiF8)


def _ocp_value(code: int, ebits: int, mbits: int, ieee_specials: bool) -> float:
    """OCP FP8 (E4M3 with `ieee_specials` False: only S.1111.111 is NaN; E5M2: IEEE-style Inf/NaN)."""
    sign = -1.0 if code & 0x80 else 1.0
    e = (code >> mbits) & ((1 << ebits) - 1)
    m = code & ((1 << mbits) - 1)
    bias = (1 << (ebits - 1)) - 1
    top = (1 << ebits) - 1
    if ieee_specials and e == top:
        return sign * math.inf if m == 0 else math.nan
    if not ieee_specials and e == top and m == (1 << mbits) - 1:
        return math.nan
    if e == 0:
        return sign * m * 2.0 ** (1 - bias - mbits)
    return sign * (1 + m / (1 << mbits)) * 2.0 ** (e - bias)


def _hif8_value(code: int) -> float:
    """HiFloat8: sign, a dot prefix giving the exponent width D, a sign-magnitude exponent whose top bit is
    implicit, and the remaining bits of mantissa; 0000 prefix = denormals 2^(M-23)."""
    if code == 0x80:
        return math.nan
    if code & 0x7F == 0x6F:
        return -math.inf if code & 0x80 else math.inf
    sign = -1.0 if code & 0x80 else 1.0
    r = code & 0x7F
    if r >> 5 == 0b11:
        d, field, mbits = 4, (r >> 1) & 0xF, 1
    elif r >> 5 == 0b10:
        d, field, mbits = 3, (r >> 2) & 0x7, 2
    elif r >> 5 == 0b01:
        d, field, mbits = 2, (r >> 3) & 0x3, 3
    elif r >> 4 == 0b001:
        d, field, mbits = 1, (r >> 3) & 0x1, 3
    elif r >> 3 == 0b0001:
        d, field, mbits = 0, 0, 3
    else:
        m = r & 0x7
        return 0.0 if m == 0 else sign * 2.0 ** (m - 23)
    m = r & ((1 << mbits) - 1)
    if d == 0:
        exponent = 0
    else:
        negative = field >> (d - 1)
        magnitude = (1 << (d - 1)) + (field & ((1 << (d - 1)) - 1))
        exponent = -magnitude if negative else magnitude
    return sign * (1 + m / (1 << mbits)) * 2.0 ** exponent


def _table(name: str, value_of, overflow_code: int, overflow_value: float, nan_code: int, ties_away: bool,
           negative_zero: bool) -> CodeTable:
    values = torch.tensor([value_of(c) for c in range(256)], dtype=torch.float64)
    best: dict[float, int] = {}
    for code in range(256):
        v = values[code].item()
        if math.isfinite(v) and v >= 0 and not (v == 0 and code & 0x80):
            best.setdefault(v, code)
    finite = sorted(best)
    ladder = torch.tensor([*finite, overflow_value], dtype=torch.float64)
    codes = torch.tensor([best[v] for v in finite] + [overflow_code], dtype=torch.int64)
    return CodeTable(name, values, ladder, codes, finite[-1], overflow_value, nan_code, ties_away, negative_zero)


@functools.cache
def code_table(dtype: Dtype) -> CodeTable:
    """The table of torch.float8_e4m3fn, torch.float8_e5m2 or torch_npu.hifloat8 (HIFLOAT8)."""
    if dtype == torch.float8_e4m3fn:
        # The step above 448 would be 480, whose code S.1111.111 is NaN: non-saturating overflow gives NaN.
        return _table("float8_e4m3fn", lambda c: _ocp_value(c, 4, 3, False), 0x7F, 480.0, 0x7F, False, True)
    if dtype == torch.float8_e5m2:
        return _table("float8_e5m2", lambda c: _ocp_value(c, 5, 2, True), 0x7C, 65536.0, 0x7F, False, True)
    if dtype == HIFLOAT8:
        # 0x6F, the would-be 1.5 * 2^15, is Inf: |x| >= 1.25 * 2^15 becomes Inf when not saturating.
        return _table("hifloat8", _hif8_value, 0x6F, 1.5 * 2.0 ** 15, 0x80, True, False)
    raise KeyError(f"no code table for {dtype!r}")


def format_max(dtype: Dtype) -> float:
    return code_table(dtype).max


def encode(x: torch.Tensor, dtype: Dtype, saturate: bool = True) -> torch.Tensor:
    """Codes of the values `x` (any float dtype), as a native float8 tensor or uint8 HiF8 codes. `saturate`
    clamps to +-max first; otherwise overflow becomes Inf (E5M2, HiF8) or NaN (E4M3). NaN stays NaN."""
    t = code_table(dtype)
    xd = x.detach().to(torch.float64).contiguous()
    a = xd.abs()
    if saturate:
        a = torch.clamp(a, max=t.max)
    last = t.ladder.numel() - 1
    hi = torch.searchsorted(t.ladder, a.clamp(max=t.top)).clamp(max=last)
    lo = (hi - 1).clamp(min=0)
    below, above = a - t.ladder[lo], t.ladder[hi] - a
    code_hi, code_lo = t.ladder_codes[hi], t.ladder_codes[lo]
    tie_to_hi = torch.full_like(above, t.ties_away, dtype=torch.bool) if t.ties_away else (code_hi % 2 == 0)
    take_hi = (above < below) | ((above == below) & tie_to_hi)
    code = torch.where(take_hi, code_hi, code_lo)
    negative = torch.signbit(xd)
    if not t.negative_zero:
        negative = negative & (code != 0)  # HiF8 has a single zero; 0x80 is its NaN
    code = torch.where(negative, code | 0x80, code)
    code = torch.where(torch.isnan(xd), torch.full_like(code, t.nan_code), code).to(torch.uint8)
    return code if dtype == HIFLOAT8 else code.view(dtype)


def decode(data: torch.Tensor, dtype: Dtype) -> torch.Tensor:
    """float32 values of codes of `dtype` (native float8 tensors, or HiF8 codes in uint8/bits8), in the codes'
    layout: a transposed view (an x2 given as torch_npu takes it) gives a transposed result. The GEMMs then
    multiply operands laid out as the reference backend's, whose decoded codes are such views too: on the CPU,
    torch.mm may sum in another order when an operand's layout differs (seen with one or two rows)."""
    if data.dim() >= 2 and not data.is_contiguous() and data.transpose(-1, -2).is_contiguous():
        return decode(data.transpose(-1, -2), dtype).transpose(-1, -2)
    codes = data.view(torch.uint8).contiguous().to(torch.int64)
    return code_table(dtype).values.to(torch.float32)[codes]


def e8m0_values(scale: torch.Tensor) -> torch.Tensor:
    """float32 values 2^(b - 127) of E8M0 bytes (0xFF is NaN)."""
    b = scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale
    values = torch.exp2(b.to(torch.float32) - 127.0)
    return values.masked_fill(b == 0xFF, float("nan"))
