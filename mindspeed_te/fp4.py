"""FP4 (E2M1) elements and the element-level rules of the FP4 recipes, as pure functions on tensors.

- E2M1 codes: 1 sign, 2 exponent, 1 mantissa bit, values +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}, no Inf or NaN (the
  OCP MX spec's FP4; `ml_dtypes.float4_e2m1fn`). Encoding rounds to nearest, ties to even, and saturates to
  +-6 (Inf included), as ml_dtypes does and as TransformerEngine's NVFP4 cast (`cvt.rn.satfinite`) needs. NaN,
  which E2M1 cannot hold, becomes +6 (code 0x7): TE's satfinite rule (transformer_engine/common/util/ptx.cuh,
  `stochastic_round_fp4_e2m1`: "NaN becomes positive MAX_NORM"); ml_dtypes gives +-0 there and TE's Python
  reference quantizer 0. The recipes never rely on it: a block holding NaN gets a NaN scale.
- Stochastic rounding (TE's rule for gradients): with 8 random bits r per element, u = r / 256, step the grid
  spacing at |x| (0.5 below 2, 1 in [2, 4), 2 from 4), t = |x| + u * step rounded once to float32, the result
  is t rounded down onto the grid in the spacing at t, at most 6, with x's sign (NaN: +6). E[result] = |x| up
  to step / 256 (the bits' resolution); TE's software path for chips without `cvt.rs` computes exactly this.
- Packing: two codes per byte, the even element (along the last dim) in the low nibble, the odd one in the
  high nibble (TE: `cvt.rn.satfinite.e2m1x2.f32 d, a, b` puts b in the low nibble and TE passes element 2i as
  b; its reference quantizer packs `codes[:, ::2] + codes[:, 1::2] * 16`).
- The random Hadamard transform (RHT) of TE's NVFP4 recipe: each run of 16 elements along the last dim is
  multiplied by the orthogonal 16x16 matrix diag(s) H / 4, H the Sylvester Hadamard matrix (H[i, j] =
  (-1)^popcount(i & j)) and s TE's fixed sign vector, here its bit mask 0xD7E8 (bit i set: row i negated;
  TE's `rht_matrix_random_sign_mask_t`). Each output is the exact sum rounded once to float32 (TE sums in
  float32 on the tensor cores; the exact sum is what any order gives when it is exact), then to the input's
  dtype (TE transforms bfloat16 data and rounds the transform to bfloat16 before its amax and cast); an exact
  zero is +0 (TE's accumulators start at +0), NaN the positive quiet NaN.
- NVFP4 scales (TE's `compute_global_encode_scaling_factor_FP4`, `compute_decoding_scaling_factor`, the
  quantize and dequantize kernels): S_enc = 448 * 6 / amax in float32 (at most FLT_MAX; 1 where amax is 0 or
  the quotient is 0), S_dec = 1 / S_enc; a block's E4M3 scale is block_amax * (S_enc * float32(1/6)) rounded
  to E4M3 (clamped to 448); its encode multiplier 1 / (float(scale) * S_dec) (at most FLT_MAX); codes are
  E2M1(x * multiplier). Dequantized: code * ((float(scale) * amax) * float32(1 / 2688)).

Stochastic rounding draws its bits from a torch.Generator: the quantizer's own when it has one, else the
hook set with `set_stochastic_rounding_generator` (a function of the device returning a generator, e.g. one
forked from Megatron's CUDA RNG tracker so that tensor-parallel ranks draw as the model's RNG state says),
else the device's default generator (TE's choice: its kernels take their Philox state from the default CUDA
generator, so `torch.manual_seed` and the tracker's `fork()` govern them).
"""
from __future__ import annotations

import enum
import math
import struct
from typing import Callable, Optional

import torch

from mindspeed_te import fused_cast

__all__ = [
    "FP4Dtype",
    "E2M1_VALUES",
    "E2M1_MAX",
    "e2m1_encode",
    "e2m1_decode",
    "decode_packed_fp4",
    "pack_fp4",
    "unpack_fp4",
    "e2m1_decode_table",
    "RHT_SIZE",
    "RHT_SIGN_MASK",
    "rht_matrix",
    "random_hadamard_transform",
    "inverse_hadamard_transform",
    "nvfp4_global_encode_scale",
    "nvfp4_block_factors",
    "nvfp4_block_scales",
    "NVFP4_DEQUANT_FACTOR",
    "nvfp4_decode_scale",
    "set_stochastic_rounding_generator",
    "stochastic_rounding_bits",
]

E2M1_MAX = 6.0
# Code -> value: codes 0-7 the magnitudes, bit 3 the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_NAN_CODE = 0x7

E4M3_MAX = 448.0
FLT_MAX = torch.finfo(torch.float32).max
_FP4_MAX_INV = torch.tensor(1.0 / 6.0, dtype=torch.float32).item()  # float32(1/6), TE's constexpr
NVFP4_DEQUANT_FACTOR = torch.tensor(1.0 / (6.0 * 448.0), dtype=torch.float32).item()  # float32(1/2688)


class FP4Dtype(enum.Enum):
    """Element format of FP4 data."""

    E2M1 = "e2m1"

    @property
    def max(self) -> float:
        """Largest finite value."""
        return E2M1_MAX

    @property
    def emax(self) -> int:
        """Exponent of the largest normal value (6 = 1.5 * 2^2), the OCP MX scale rule's emax."""
        return 2

    @property
    def storage_dtype(self) -> torch.dtype:
        """The torch dtype holding the data: uint8, two codes per byte."""
        return torch.uint8


_TABLES: dict[torch.device, torch.Tensor] = {}


def _values(device: torch.device) -> torch.Tensor:
    table = _TABLES.get(device)
    if table is None:
        table = _TABLES[device] = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return table


def _spacing(a: torch.Tensor) -> torch.Tensor:
    """The E2M1 grid spacing at magnitude a: 0.5 below 2, 1 in [2, 4), 2 from 4 (NaN: 2)."""
    return torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))


def e2m1_encode(x: torch.Tensor, rbits: Optional[torch.Tensor] = None) -> torch.Tensor:
    """E2M1 codes (uint8 in [0, 16), x's shape, one per byte) of the float32 values of x: round to nearest even,
    saturating to +-6, or with `rbits` (integers in [0, 256), x's shape) stochastic rounding (module docstring).
    -0 and negative values that round to 0 keep their sign (code 8); NaN -> 0x7."""
    if not x.is_floating_point():
        raise TypeError(f"e2m1_encode expects a floating-point tensor, got {x.dtype}")
    x = x.detach().float()
    a = x.abs()
    if rbits is not None:
        if rbits.shape != x.shape:
            raise ValueError(f"rbits must have x's shape {tuple(x.shape)}, got {tuple(rbits.shape)}")
        t = a + rbits.float().mul_(1.0 / 256.0) * _spacing(a)  # u * step is exact: one rounding, as fmaf
        step = _spacing(t)
        a = torch.floor(t / step).mul_(step)  # a grid value (or past 6: saturated below)
    magnitude = torch.bucketize(a.contiguous(), _rne_bounds(x.device), out_int32=True)  # |x| rounded, saturated
    codes = torch.add(magnitude, torch.signbit(x), alpha=8).to(torch.uint8)
    return codes.masked_fill_(torch.isnan(x), _NAN_CODE)


_BOUNDS: dict[torch.device, torch.Tensor] = {}


def _rne_bounds(device: torch.device) -> torch.Tensor:
    """float32 bounds b_i such that |x| > b_i rounds to at least magnitude code i + 1 (bucketize counts them): the
    midpoints between neighbouring values, where a tie goes to the even code: down at 0.25, 1.25, 2.5 and 5
    (codes 0, 2, 4, 6), up at 0.75, 1.75 and 3.5 (codes 2, 4, 6: the bound is the float32 just below)."""
    bounds = _BOUNDS.get(device)
    if bounds is None:
        mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)
        up = torch.tensor([False, True, False, True, False, True, False])
        below = torch.nextafter(mids, torch.zeros_like(mids))
        bounds = _BOUNDS[device] = torch.where(up, below, mids).to(device)
    return bounds


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """Exact float32 values of E2M1 codes (integers in [0, 16), one per element)."""
    return _values(codes.device)[codes.long()]


_PAIRS: dict[torch.device, torch.Tensor] = {}


def decode_packed_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Exact float32 values of packed FP4 bytes (`pack_fp4`'s layout), the last dim twice as long: one lookup of
    each byte's two values."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed FP4 data is uint8, got {packed.dtype}")
    table = _PAIRS.get(packed.device)
    if table is None:
        byte = torch.arange(256)
        table = _PAIRS[packed.device] = e2m1_decode(torch.stack((byte & 0x0F, byte >> 4), dim=-1)).to(packed.device)
    return table[packed.long()].reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Two codes per byte along the last dim (even length): element 2i in the low nibble, 2i + 1 in the high;
    contiguous whatever the codes' layout (a kernel reads the bytes as they lie)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"packing FP4 needs an even last dim, got shape {tuple(codes.shape)}")
    codes = codes.to(torch.uint8)
    fused = fused_cast.nibbles(codes, pack=True)
    if fused is not None:
        return fused
    return torch.add(codes[..., 0::2], codes[..., 1::2], alpha=16).contiguous()  # at most 15 + 16 * 15: no carry


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """The codes of packed FP4 bytes, one per byte, the last dim twice as long (two ops, written in place)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed FP4 data is uint8, got {packed.dtype}")
    fused = fused_cast.nibbles(packed, pack=False)
    if fused is not None:
        return fused
    codes = torch.empty(*packed.shape[:-1], packed.shape[-1] * 2, dtype=torch.uint8, device=packed.device)
    torch.bitwise_and(packed, 0x0F, out=codes[..., 0::2])
    torch.bitwise_right_shift(packed, 4, out=codes[..., 1::2])
    return codes


_DECODE_TABLES: dict[torch.device, torch.Tensor] = {}


def e2m1_decode_table(device: torch.device) -> torch.Tensor:
    """The 256 float32 values a byte-code decode kernel indexes (`fused_cast.dequantize_tiles`): E2M1's 16 values,
    then zeros (codes past 15 never occur)."""
    table = _DECODE_TABLES.get(device)
    if table is None:
        table = torch.zeros(256, dtype=torch.float32)
        table[:16] = torch.tensor(E2M1_VALUES)
        table = _DECODE_TABLES[device] = table.to(device)
    return table


# The random Hadamard transform ------------------------------------------------------------------------------
RHT_SIZE = 16
RHT_SIGN_MASK = 0xD7E8  # TE's fixed signs (+ + + - + - - - - - - + - + - -), bit i set where sign i is -1

_RHT: dict[tuple[int, torch.device], torch.Tensor] = {}


def rht_matrix(sign_mask: int = RHT_SIGN_MASK, device: Optional[torch.device] = None) -> torch.Tensor:
    """The float32 16x16 transform diag(s) H / 4 (orthogonal: its transpose is its inverse), s_i = -1 where bit
    i of `sign_mask` is set (0: the plain Hadamard transform)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    key = (sign_mask, device)
    m = _RHT.get(key)
    if m is None:
        i = torch.arange(RHT_SIZE)
        popcount = torch.zeros(RHT_SIZE, RHT_SIZE, dtype=torch.int64)
        both = i[:, None] & i[None, :]
        for bit in range(4):
            popcount += (both >> bit) & 1
        hadamard = 1.0 - 2.0 * (popcount % 2).float()
        signs = torch.tensor([-1.0 if sign_mask >> k & 1 else 1.0 for k in range(RHT_SIZE)])
        m = _RHT[key] = (signs[:, None] * hadamard * 0.25).to(device)
    return m


def _blocks_of_16(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % RHT_SIZE:
        raise ValueError(f"the Hadamard transform needs a last dim divisible by {RHT_SIZE}, got {tuple(x.shape)}")
    # A transposed view (the columnwise source) is laid out row-major in its own dtype first: for bfloat16, that
    # transposing copy and then a contiguous conversion took half the time of one converting transpose (1024^2).
    return x.contiguous().to(torch.float32).reshape(-1, RHT_SIZE)


def _exact_spread(dtype: torch.dtype) -> int:
    """How many binades apart a run's nonzero values may lie for its float64 sum to be exact in any order: the
    products x * (+-1/4) are exact, and every partial sum fits 53 bits = the spread + a value's significant bits
    (8 for bfloat16, at most 24) + 4 for the carry of 16 terms. csrc/nvfp4.c uses the same bounds."""
    return 41 if dtype == torch.bfloat16 else 25


def random_hadamard_transform(x: torch.Tensor, sign_mask: int = RHT_SIGN_MASK) -> torch.Tensor:
    """Each run of 16 elements along x's last dim times `rht_matrix(sign_mask)`: on the CPU the exact sums rounded
    once to float32, then to x's dtype (module docstring). A transposed 2-D view (the columnwise source) takes the
    fused kernel; the torch ops sum in float64 (exact, see _exact_spread) and redo the rare runs too wide for that
    exactly. Other devices keep their float32 matmul (float64 and the redo's host sync would not suit them): the
    same bits wherever that sum is exact, as it is for bfloat16 runs within 12 binades."""
    if x.dim() == 2 and x.t().is_contiguous():
        fused = fused_cast.hadamard_columns(x.t(), sign_mask)
        if fused is not None:
            return fused[0]
    blocks = _blocks_of_16(x)
    if not x.is_cpu:
        return (blocks @ rht_matrix(sign_mask, x.device)).reshape(x.shape).to(x.dtype)
    sums = (blocks.double() @ rht_matrix(sign_mask).double()).add_(0.0)  # + 0: an exact zero is +0
    bits = blocks.view(torch.int32) & 0x7FFFFFFF
    binade = (bits >> 23).clamp_(min=1)  # subnormals share the smallest normals' last bit
    top, bottom = binade.amax(dim=1), binade.masked_fill(bits == 0, 255).amin(dim=1)
    wide = ((top < 255) & (top - bottom > _exact_spread(x.dtype))).nonzero().flatten()
    if wide.numel():
        sums[wide] = _exact_sums(blocks[wide], sign_mask)
    out = sums.float().reshape(x.shape).to(x.dtype)
    return out.masked_fill_(out.isnan(), math.nan)  # one NaN whatever the conversions made (torch's differ)


def _exact_sums(blocks: torch.Tensor, sign_mask: int) -> torch.Tensor:
    """The transform of finite float32 runs (n, 16), each sum rounded to odd in float64 (math.fsum rounds the
    exact sum to nearest; a second fsum with it subtracted gives the sign of what that dropped), which float64
    -> float32 then rounds as the exact sum (53 bits >= 24 + 2): for the runs whose exponents spread too far for
    the float64 sum."""
    signs = (rht_matrix(sign_mask) * 4).to(torch.int64).tolist()
    out = []
    for run in blocks.double().mul_(0.25).tolist():  # x / 4 is exact in float64
        row = []
        for i in range(RHT_SIZE):
            terms = [signs[t][i] * run[t] for t in range(RHT_SIZE)]
            nearest = math.fsum(terms)
            dropped = math.fsum(terms + [-nearest])
            if dropped and not struct.unpack("<q", struct.pack("<d", nearest))[0] & 1:
                nearest = math.nextafter(nearest, math.copysign(math.inf, dropped))
            row.append(nearest)
        out.append(row)
    return torch.tensor(out, dtype=torch.float64)


def inverse_hadamard_transform(y: torch.Tensor, sign_mask: int = RHT_SIGN_MASK) -> torch.Tensor:
    """The inverse of `random_hadamard_transform` on float32 values (times the transpose), in float32."""
    return (_blocks_of_16(y) @ rht_matrix(sign_mask, y.device).t()).reshape(y.shape)


# NVFP4 scales -----------------------------------------------------------------------------------------------
def _divide(numerator: float, denominator: torch.Tensor) -> torch.Tensor:
    """numerator / denominator in one IEEE float32 division."""
    return torch.div(torch.full_like(denominator, numerator), denominator)


def nvfp4_global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """S_enc = 448 * 6 / amax (float32, at most FLT_MAX; 1 where amax is 0 or Inf). A NaN amax gives FLT_MAX,
    as the kernel's fminf does (the tensor then dequantizes to NaN through its amax)."""
    amax = amax.float()
    scale = torch.fmin(_divide(E4M3_MAX * E2M1_MAX, amax), torch.full_like(amax, FLT_MAX))
    return torch.where((amax == 0) | (scale == 0), torch.ones_like(scale), scale)


def nvfp4_block_factors(s_enc: torch.Tensor) -> torch.Tensor:
    """The two float32 factors of the block scale rule, S_enc * float32(1/6) and S_dec = 1 / S_enc, stacked along
    a new last dim: computed once per tensor (the fused kernel takes them as they are)."""
    s_enc = s_enc.float()
    return torch.stack((s_enc * _FP4_MAX_INV, _divide(1.0, s_enc)), dim=-1)


def nvfp4_block_scales(block_amax: torch.Tensor, s_enc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 decode scales (torch.float8_e4m3fn), float32 encode multipliers) of blocks with amax `block_amax`
    under the global encode scale `s_enc` (broadcastable). A NaN block amax gives the NaN scale 0xFF (the block
    dequantizes to NaN), an Inf one 448."""
    factors = nvfp4_block_factors(s_enc)
    decode = block_amax.float() * factors[..., 0]
    scale = torch.clamp(torch.minimum(decode, torch.full_like(decode, FLT_MAX)), -E4M3_MAX, E4M3_MAX)
    scale = scale.to(torch.float8_e4m3fn)
    # A NaN block amax: the byte 0xFF whichever NaN torch made (its vector and scalar loops differ in the sign).
    scale.view(torch.uint8).masked_fill_(torch.isnan(decode), 0xFF)
    denominator = scale.float() * factors[..., 1]
    encode = torch.minimum(_divide(1.0, denominator), torch.full_like(denominator, FLT_MAX))
    return scale, encode


def nvfp4_decode_scale(scale: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """The float32 multiplier of a block's codes: (float(scale) * amax) * float32(1 / (6 * 448)), TE's dequantize
    kernel's product in its order."""
    return (scale.float() * amax.float()) * NVFP4_DEQUANT_FACTOR


# Stochastic rounding's random bits ----------------------------------------------------------------------------
_SR_HOOK: Optional[Callable[[torch.device], Optional[torch.Generator]]] = None


def set_stochastic_rounding_generator(hook: Optional[Callable[[torch.device], Optional[torch.Generator]]]
                                      ) -> None:
    """Where quantizers without a generator of their own draw stochastic rounding's bits: `hook(device)` returns
    the torch.Generator to use (None: the device's default generator); None removes the hook. A Megatron
    integration can return a generator whose state it forks from `tensor_parallel.get_cuda_rng_tracker()`."""
    global _SR_HOOK
    if hook is not None and not callable(hook):
        raise TypeError(f"the stochastic rounding hook must be callable or None, got {type(hook).__name__}")
    _SR_HOOK = hook


def stochastic_rounding_bits(shape: tuple[int, ...], device: torch.device,
                             generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """8 random bits per element (uint8, `shape`) from `generator`, else the hook's, else the device's default:
    the bytes of full-range 64-bit draws, in memory order. A generator that gives one draw per element whatever
    its dtype (the CPU's) gives 8 bytes a draw this way, not 1: a third of the time."""
    if generator is None and _SR_HOOK is not None:
        generator = _SR_HOOK(torch.device(device))
    n = math.prod(shape)
    words = torch.empty(-(-n // 8), dtype=torch.int64, device=device)
    words.random_(-(1 << 63), None, generator=generator)  # `to` None from int64's minimum: every 64-bit value
    return words.view(torch.uint8)[:n].view(shape)
