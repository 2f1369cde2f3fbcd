"""HiF8, Huawei's tapered 8-bit float: its special codes and the lookup tables that encode and decode it.

HiF8 has no torch dtype; its codes travel in `torch.uint8` tensors.

Encoding HiF8 is one table lookup per element. Rounding half away from zero to at most 3 mantissa bits only
looks at the bits down to the half-ULP bit, and those all sit in the top 16 bits of a float32 (sign,
exponent, 7 mantissa bits), so a 65536-entry table indexed by them gives the exact code. The one thing the
low 16 bits can change is NaN-versus-Inf (a NaN whose payload is only in the low bits); every float op
quiets a NaN by setting the top mantissa bit, so encoders pass the data through one float op first (the
division by the scale in `mindspeed_te.formats`).
"""
from __future__ import annotations

import torch

__all__ = ["HIF8_MAX", "HIF8_NAN", "HIF8_INF", "HIF8_MAX_CODE", "encode_table", "decode_table"]

HIF8_MAX = 32768.0
HIF8_NAN = 0x80
HIF8_INF = 0x6F
HIF8_MAX_CODE = 0x6E


def _mantissa_bits(exponent: int) -> int:
    """HiF8 precision is tapered: 3 mantissa bits for |E| <= 3, 2 up to 7, 1 up to 15."""
    mag = abs(exponent)
    return 3 if mag <= 3 else 2 if mag <= 7 else 1


def _code(exponent: int) -> int:
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
_BINADE_BASE = [0, 1] + [e + 23 for e in range(-22, -15)] + [_code(e) for e in range(-15, 16)] + [HIF8_INF]


def encode_table(saturate: bool) -> torch.Tensor:
    """The 65536 uint8 codes indexed by the top 16 bits of a float32, by rounding the 7 mantissa bits the
    index holds to the binade's precision, half away from zero (vectorized over all patterns). Overflow
    gives +-Inf, or +-HIF8_MAX with `saturate`; NaN gives HIF8_NAN; -0 and tiny negatives give 0x00."""
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
    if saturate:
        body = torch.where(body == HIF8_INF, HIF8_MAX_CODE, body)
    code = torch.where(body == 0, 0, sign << 7 | body)  # -0 and tiny negatives become the one zero, 0x00
    code = torch.where((biased == 255) & (mant != 0), HIF8_NAN, code)
    return code.to(torch.uint8)


def decode_table() -> torch.Tensor:
    """The float32 value of each of the 256 codes, parsed from the bit layout (vectorized over the codes)."""
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
