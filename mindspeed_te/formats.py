"""8-bit element formats: E4M3, E5M2 and HiF8, and the `Format` enum recipes choose them with.

HiF8 (Huawei's tapered 8-bit float) has no torch dtype; its codes travel in `torch.uint8` tensors. Encoding
uses the fact that round-half-away-from-zero to at most 3 mantissa bits depends only on the top 16 bits of
a float32 (sign, exponent, 7 mantissa bits, the half bit among them) plus "is anything below set" (which
only matters to tell NaN from Inf), so one 65536-entry table lookup per element encodes exactly.
Large tensors are processed in cache-sized chunks so the few integer ops per element stay in L2.
"""
from __future__ import annotations

import enum
import math
from typing import Callable

import torch

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
_CHUNK = 1 << 19  # elements per chunk: 2 MiB of float32, which keeps a chunk's temporaries in L2


class FP8Dtype(enum.Enum):
    """Element format of quantized data."""

    E4M3 = "e4m3"
    E5M2 = "e5m2"
    HIF8 = "hif8"

    @property
    def max(self) -> float:
        """Largest finite value."""
        return {"e4m3": 448.0, "e5m2": 57344.0, "hif8": HIF8_MAX}[self.value]

    @property
    def storage_dtype(self) -> torch.dtype:
        """The torch dtype holding the data (HiF8 codes live in uint8)."""
        return {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "hif8": torch.uint8}[self.value]


class Format(enum.Enum):
    """TransformerEngine's recipe.Format, plus HIF8: element dtypes and default target maxima of forward
    tensors (activations, weights) and backward tensors (gradients). HiF8's targets 15 and 224 are the tops
    of its 3- and 2-mantissa-bit ranges (MindSpeed's choice); recipes can override them."""

    E4M3 = ("E4M3", "E4M3", 448.0, 448.0)
    E5M2 = ("E5M2", "E5M2", 57344.0, 57344.0)
    HYBRID = ("E4M3", "E5M2", 448.0, 57344.0)
    HIF8 = ("HIF8", "HIF8", 15.0, 224.0)

    @property
    def fwd_dtype(self) -> FP8Dtype:
        return FP8Dtype[self.value[0]]

    @property
    def bwd_dtype(self) -> FP8Dtype:
        return FP8Dtype[self.value[1]]

    @property
    def max_fwd(self) -> float:
        return self.value[2]

    @property
    def max_bwd(self) -> float:
        return self.value[3]

    @classmethod
    def from_name(cls, name: str) -> "Format":
        """Format from Megatron's --fp8-format value (case-insensitive)."""
        key = str(name).strip().upper()
        if key not in cls.__members__:
            allowed = ", ".join(m.lower() for m in cls.__members__)
            raise ValueError(f"fp8 format {name!r} is not supported; allowed: {allowed}")
        return cls[key]


# HiF8 tables --------------------------------------------------------------------------------------------
def _hif8_code(sign: int, exponent: int, mantissa: int) -> int:
    """Bit pattern of a normal HiF8 value (-1)^sign * 2^exponent * (1 + mantissa / 2^mbits)."""
    mag, neg = abs(exponent), int(exponent < 0)
    if mag == 0:
        body = 0b0001 << 3 | mantissa
    elif mag == 1:
        body = 0b001 << 4 | neg << 3 | mantissa
    elif mag <= 3:
        body = 0b01 << 5 | neg << 4 | (mag - 2) << 3 | mantissa
    elif mag <= 7:
        body = 0b10 << 5 | neg << 4 | (mag - 4) << 2 | mantissa
    else:
        body = 0b11 << 5 | neg << 4 | (mag - 8) << 1 | mantissa
    return sign << 7 | body


def _mantissa_bits(exponent: int) -> int:
    mag = abs(exponent)
    return 3 if mag <= 3 else 2 if mag <= 7 else 1


def _hif8_decode_table() -> list[float]:
    """All 256 codes -> value, built from the bit layout."""
    table = [0.0] * 256
    for exponent in range(-15, 16):
        mbits = _mantissa_bits(exponent)
        for mantissa in range(1 << mbits):
            for sign in (0, 1):
                value = (-1.0) ** sign * 2.0**exponent * (1 + mantissa / (1 << mbits))
                table[_hif8_code(sign, exponent, mantissa)] = value
    for m in range(1, 8):  # denormals 2^(m - 23)
        table[m], table[0x80 | m] = 2.0 ** (m - 23), -(2.0 ** (m - 23))
    table[HIF8_INF], table[0x80 | HIF8_INF] = float("inf"), float("-inf")
    table[HIF8_NAN] = float("nan")
    return table


def _hif8_encode_magnitude(value: float) -> int:
    """Code (without sign) of a finite positive float, round half away from zero, overflow to Inf."""
    if value < 2.0**-23:
        return 0
    exponent = math.frexp(value)[1] - 1
    if exponent < -15:  # denormal range: powers of two 2^-22 .. 2^-16, i.e. no mantissa bits
        steps = int(value / 2.0**exponent + 0.5)  # 1 or 2 (2 carries into the next power)
        exponent += steps - 1
        if exponent < -15:
            return max(exponent + 23, 1)
        return _hif8_code(0, exponent, 0)
    mbits = _mantissa_bits(exponent)
    q = int(value / 2.0 ** (exponent - mbits) + 0.5)  # in [2^mbits, 2^(mbits+1)]
    if q == 1 << (mbits + 1):
        exponent, q = exponent + 1, 1 << _mantissa_bits(exponent + 1)
        mbits = _mantissa_bits(exponent)
    if exponent > 15:
        return HIF8_INF
    return _hif8_code(0, exponent, q - (1 << mbits))


def _build_encode_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """65536-entry tables (non-saturating, saturating) indexed by the top 16 bits of a float32, where the
    lowest index bit is also set when any of the 16 dropped bits is (so NaN payloads there stay NaN)."""
    patterns = (torch.arange(65536, dtype=torch.int64) << 16).to(torch.int32).view(torch.float32)
    codes = []
    for bits, value in zip(range(65536), patterns.tolist()):
        sign = (bits >> 15) & 1
        if value != value:
            codes.append(HIF8_NAN)
            continue
        magnitude = abs(value)
        code = HIF8_INF if magnitude == float("inf") else _hif8_encode_magnitude(magnitude)
        codes.append(0 if code == 0 else (sign << 7 | code))  # -0 and tiny negatives become +0
    plain = torch.tensor(codes, dtype=torch.uint8)
    saturated = plain.clone()
    saturated[plain == HIF8_INF] = HIF8_MAX_CODE
    saturated[plain == (0x80 | HIF8_INF)] = 0x80 | HIF8_MAX_CODE
    return plain, saturated


_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def _table(kind: str, device: torch.device) -> torch.Tensor:
    """Lazily built, per-device constant tables ("encode", "encode_sat", "decode")."""
    key = (kind, device)
    if key not in _TABLES:
        cpu = ("encode", torch.device("cpu"))
        if cpu not in _TABLES:
            plain, saturated = _build_encode_tables()
            _TABLES[cpu] = plain
            _TABLES[("encode_sat", torch.device("cpu"))] = saturated
            _TABLES[("decode", torch.device("cpu"))] = torch.tensor(_hif8_decode_table(), dtype=torch.float32)
        _TABLES[key] = _TABLES[(kind, torch.device("cpu"))].to(device)
    return _TABLES[key]


def _encode_chunk(bits: torch.Tensor, table: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor) -> None:
    """out = table[top 16 bits of `bits`, with the sticky low bit]; `scratch` is an int32 buffer."""
    torch.bitwise_and(bits, 0xFFFF, out=scratch)
    scratch.add_(0xFFFF).bitwise_or_(bits)  # bit 16 := bit 16 | any of bits 0..15
    scratch.bitwise_right_shift_(16).bitwise_and_(0xFFFF)
    torch.index_select(table, 0, scratch, out=out)


def _chunked(numel: int, device: torch.device, body: Callable[[slice, torch.Tensor], None]) -> None:
    scratch = torch.empty(min(numel, _CHUNK), dtype=torch.int32, device=device)
    for start in range(0, numel, _CHUNK):
        stop = min(start + _CHUNK, numel)
        body(slice(start, stop), scratch[: stop - start])


def hif8_encode(x: torch.Tensor, saturate: bool = False) -> torch.Tensor:
    """HiF8 codes (uint8, same shape) of a float tensor, rounding half away from zero. Without `saturate`,
    |x| >= 40960 becomes +-Inf; with it, +-32768. NaN -> 0x80, -0 -> 0x00."""
    flat = x.detach().reshape(-1)
    flat = as_float32(flat).contiguous()
    bits = flat.view(torch.int32)
    table = _table("encode_sat" if saturate else "encode", flat.device)
    out = torch.empty(flat.numel(), dtype=torch.uint8, device=flat.device)
    _chunked(flat.numel(), flat.device, lambda s, scratch: _encode_chunk(bits[s], table, out[s], scratch))
    return out.reshape(x.shape)


def hif8_decode(data: torch.Tensor) -> torch.Tensor:
    """Exact float32 values of HiF8 codes."""
    if data.dtype != torch.uint8:
        raise TypeError(f"hif8_decode expects uint8 codes, got {data.dtype}")
    if data.dim() >= 2 and not data.is_contiguous() and data.transpose(-1, -2).is_contiguous():
        # keep a transposed view transposed, as a native dtype cast does
        return hif8_decode(data.transpose(-1, -2)).transpose(-1, -2)
    table = _table("decode", data.device)
    return torch.index_select(table, 0, data.reshape(-1).to(torch.int32)).reshape(data.shape)


# Casts ----------------------------------------------------------------------------------------------------
def as_float32(t: torch.Tensor) -> torch.Tensor:
    """t in float32, without a call when it already is (each call costs microseconds on small GEMMs)."""
    return t if t.dtype == torch.float32 else t.float()


def cast_to_fp8(x: torch.Tensor, fp8_dtype: FP8Dtype, saturate: bool = True) -> torch.Tensor:
    """Round x to the format (nearest-even for E4M3/E5M2, half away from zero for HiF8). With `saturate`,
    values beyond the largest finite one (and +-Inf) become +-max; NaN stays NaN."""
    if fp8_dtype is FP8Dtype.HIF8:
        return hif8_encode(x, saturate)
    x = as_float32(x)
    if saturate:
        x = x.clamp(-fp8_dtype.max, fp8_dtype.max)
    return x.to(fp8_dtype.storage_dtype)


def cast_from_fp8(data: torch.Tensor, fp8_dtype: FP8Dtype) -> torch.Tensor:
    """Exact float32 values of quantized data."""
    if fp8_dtype is FP8Dtype.HIF8:
        return hif8_decode(data)
    return data.float()


def scaled_cast(x: torch.Tensor, scale_inv: torch.Tensor, fp8_dtype: FP8Dtype) -> torch.Tensor:
    """Saturating cast of x / scale_inv (computed in float32, one IEEE division, as the NPU's quantize
    kernels do): the quantize hot path.

    `scale_inv` is a float32 tensor broadcastable to x: one element for per-tensor scaling, or e.g.
    (..., nblocks, 1) against x of shape (..., nblocks, block). It stays a tensor (no host sync). A
    one-element scale takes a chunked path whose temporaries stay in cache."""
    scale_inv = as_float32(scale_inv)
    if scale_inv.dim() == 0:
        scale_inv = scale_inv.reshape(1)  # a 0-d divisor would be turned into a multiply by its reciprocal
    if scale_inv.numel() != 1 or x.numel() <= _CHUNK:
        return cast_to_fp8(torch.div(as_float32(x), scale_inv), fp8_dtype, saturate=True)
    flat = x.detach().reshape(-1)
    out = torch.empty(flat.numel(), dtype=fp8_dtype.storage_dtype, device=flat.device)
    scaled = torch.empty(min(flat.numel(), _CHUNK), dtype=torch.float32, device=flat.device)
    limit = fp8_dtype.max
    table = _table("encode_sat", flat.device) if fp8_dtype is FP8Dtype.HIF8 else None

    def body(s: slice, scratch: torch.Tensor) -> None:
        buf = scaled[: s.stop - s.start]
        torch.div(flat[s], scale_inv, out=buf)
        if table is not None:
            _encode_chunk(buf.view(torch.int32), table, out[s], scratch)
        else:
            out[s].copy_(buf.clamp_(-limit, limit))

    _chunked(flat.numel(), flat.device, body)
    return out.reshape(x.shape)
