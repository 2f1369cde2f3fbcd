"""How FusedAdam stores a state tensor (exp_avg, exp_avg_sq, master_param) and turns it into float32 and back.

Formats, by the name `state_format` gives them:
- "fp32": the tensor itself; the update works on it in place.
- "bf16": a bfloat16 tensor, no scale (TransformerEngine's rule): stored = round-to-nearest-even(x).
- "fp16", "e4m3", "hif8": a float16 / float8_e4m3fn / HiF8-code (uint8) tensor and one float32 scale per tensor.
- "mxfp8": E4M3 codes and one E8M0 scale (uint8, 2^(byte - 127)) per 32 consecutive elements of the flattened
  tensor, as in the OCP MX formats.

The scale rule (all scaled formats): scale = the smallest power of two s with amax <= TARGET * s, where amax is
the largest magnitude of the tensor (of the block for mxfp8) and TARGET is 448 for E4M3, 2^15 for float16 and 8
for HiF8; stored = format(x / s), the value is stored * s. TransformerEngine's FusedAdam scales by
amax / 448 (FP8) and amax / (65504 / 2) (float16) instead, not a power of two. A power of two makes x / s and
stored * s exact, so quantizing the stored values again gives them back bit for bit: a checkpoint holds the
float32 values (as TE's does) and a resume continues with exactly the state it saved. (Proof: the largest
stored magnitude lies in [TARGET / 2, TARGET], so the rule picks s again, or s / 2 when it is exactly TARGET / 2;
then every code doubles, which is exact in E4M3 and float16, and in HiF8 below 8 because its mantissa never
gets shorter towards 1.) The range used is one binade less at worst. HiF8's target 8 keeps the largest values
in its 3-mantissa-bit band (|exponent| <= 3) and leaves 25 binades below it (E4M3: 17), which suits the second
moment's wide range.

Every function takes lists (one entry per parameter of a group) and uses torch._foreach_* ops where torch has
them: decoding a float16/E4M3/bf16 list is one foreach copy (+ one foreach multiply by the scales); encoding it
is one foreach norm (the amaxes), a few ops on the stacked amaxes, one foreach divide and one foreach copy.
HiF8 and mxfp8 encode and decode tensor by tensor (no foreach op reads HiF8 codes or per-block scales).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Union

import torch
import torch.nn.functional as F

from mindspeed_te.formats import FP8Dtype, hif8_decode, scaled_cast

__all__ = ["StateFormat", "FORMATS", "state_format", "decode", "encode", "pow2_scales", "MX_BLOCK",
           "split_remainders", "join_remainders"]

MX_BLOCK = 32


@dataclasses.dataclass(frozen=True)
class StateFormat:
    name: str
    storage: torch.dtype  # dtype of the stored tensor
    target: Optional[float] = None  # scaled formats: the largest scaled magnitude
    block: int = 0  # mxfp8: elements per scale; 0: one scale per tensor
    te_dtype: Optional[torch.dtype] = None  # how TransformerEngine names it (torch.uint8: FP8)

    @property
    def scaled(self) -> bool:
        return self.target is not None

    @property
    def bits(self) -> int:
        return torch.finfo(self.storage).bits if self.storage.is_floating_point else 8


FORMATS = {
    "fp32": StateFormat("fp32", torch.float32, te_dtype=torch.float32),
    "bf16": StateFormat("bf16", torch.bfloat16, te_dtype=torch.bfloat16),
    "fp16": StateFormat("fp16", torch.float16, 2.0 ** 15, te_dtype=torch.float16),
    "e4m3": StateFormat("e4m3", torch.float8_e4m3fn, 448.0, te_dtype=torch.uint8),
    "hif8": StateFormat("hif8", torch.uint8, 8.0),
    "mxfp8": StateFormat("mxfp8", torch.float8_e4m3fn, 448.0, block=MX_BLOCK),
}
_ALIASES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.uint8: "e4m3",
            torch.float8_e4m3fn: "e4m3", "fp8": "e4m3", "float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def state_format(spec: Union[str, torch.dtype, StateFormat], keyword: str, allowed: tuple[str, ...]) -> StateFormat:
    """The format a FusedAdam keyword names: a torch dtype as TransformerEngine takes it (torch.uint8 is FP8
    E4M3) or a name ("fp8", "e4m3", "hif8", "mxfp8", ...). A ValueError names the keyword and what it takes."""
    if isinstance(spec, StateFormat):
        name = spec.name
    else:
        name = _ALIASES.get(spec.lower() if isinstance(spec, str) else spec, spec)
    if name not in allowed:
        names = ", ".join(allowed)
        raise ValueError(f"FusedAdam: {keyword}={spec!r} is not supported; {keyword} takes {names} "
                         "(torch.float32/bfloat16/float16, torch.uint8 = FP8 E4M3 as in TransformerEngine)")
    return FORMATS[name]


def pow2_scales(amax: torch.Tensor, target: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, exponents): per element of `amax`, the smallest power of two s = 2^k with amax <= target * s,
    k clamped to float32's normal range [-126, 127]. Exact: computed from frexp, not from a logarithm."""
    t_mant, t_exp = math.frexp(target)
    mant, exp = torch.frexp(amax.float())
    k = (exp - t_exp + (mant > t_mant).to(exp.dtype)).clamp(-126, 127)
    scales = torch.bitwise_left_shift(k + 127, 23).view(torch.float32)  # the float32 2^k, bit by bit
    return scales, k


# Decoding ---------------------------------------------------------------------------------------------
def decode(fmt: StateFormat, stored: list[torch.Tensor], scales: list[Optional[torch.Tensor]]) -> list[torch.Tensor]:
    """Float32 values of the stored tensors: the tensors themselves for fp32, else new tensors."""
    if not stored or fmt.name == "fp32":
        return list(stored)
    if fmt.name == "hif8":
        out = [hif8_decode(codes) for codes in stored]
    elif fmt.block:
        return [_mx_decode(codes, scale) for codes, scale in zip(stored, scales)]
    else:
        out = [torch.empty_like(s, dtype=torch.float32) for s in stored]
        torch._foreach_copy_(out, stored)
    if fmt.scaled:
        torch._foreach_mul_(out, scales)
    return out


def _mx_blocks(flat: torch.Tensor) -> torch.Tensor:
    pad = -flat.numel() % MX_BLOCK
    return (F.pad(flat, (0, pad)) if pad else flat).view(-1, MX_BLOCK)


def _mx_decode(codes: torch.Tensor, e8m0: torch.Tensor) -> torch.Tensor:
    scales = torch.bitwise_left_shift(e8m0.to(torch.int32), 23).view(torch.float32)
    blocks = _mx_blocks(codes.reshape(-1).float()) * scales[:, None]
    return blocks.view(-1)[:codes.numel()].view(codes.shape)


# Encoding ---------------------------------------------------------------------------------------------
def encode(fmt: StateFormat, values: list[torch.Tensor], stored: list[torch.Tensor],
           scales: list[Optional[torch.Tensor]]) -> None:
    """Store float32 `values` into `stored` (and their new scales into `scales`, in place). The values of a
    scaled format are divided by their scales in place (they are the step's temporaries)."""
    if not stored or fmt.name == "fp32":
        return
    if fmt.block:
        for x, codes, scale in zip(values, stored, scales):
            _mx_encode(x, codes, scale)
        return
    if fmt.scaled:
        amax = torch.stack(torch._foreach_norm(values, float("inf")))
        new, _ = pow2_scales(amax, fmt.target)
        torch._foreach_copy_(scales, list(new.unbind()))
    if fmt.name == "hif8":
        for x, codes, scale in zip(values, stored, scales):
            codes.copy_(scaled_cast(x, scale, FP8Dtype.HIF8))
        return
    if fmt.scaled:
        torch._foreach_div_(values, scales)
    torch._foreach_copy_(stored, values)


def _mx_encode(x: torch.Tensor, codes: torch.Tensor, e8m0: torch.Tensor) -> None:
    blocks = _mx_blocks(x.reshape(-1))
    scales, k = pow2_scales(blocks.abs().amax(dim=1), FORMATS["mxfp8"].target)
    e8m0.copy_((k + 127).to(torch.uint8))
    scaled = (blocks / scales[:, None]).view(-1)[:x.numel()]
    codes.copy_(scaled.view(codes.shape))


def scale_like(fmt: StateFormat, like: torch.Tensor) -> Optional[torch.Tensor]:
    """A new scale for a state shaped like `like`: one float32 1.0 per tensor, or E8M0 1.0 (127) per mxfp8
    block; None for fp32. (bf16 gets a 1.0 too, which it never uses, as TransformerEngine keeps one.)"""
    if fmt.name == "fp32":
        return None
    if fmt.block:
        return torch.full((-(-like.numel() // MX_BLOCK),), 127, dtype=torch.uint8, device=like.device)
    return torch.ones(1, dtype=torch.float32, device=like.device)


# Master weights as bf16 parameter + 16-bit remainder -------------------------------------------------
# In int32 arithmetic (two's complement, wrapping), a float32's bits X split into the low 16 bits as a signed
# int16 r (r = low - 2^16 when low >= 0x8000) and b = (X - r) / 2^16, which is the top 16 bits plus one exactly
# when r < 0: TransformerEngine's bf16 parameter (nearest, ties away from zero) and remainder. Back:
# X = b * 2^16 + r. Both ways are foreach ops on integer views (no bit operation needed).
def join_remainders(params: list[torch.Tensor], remainders: list[torch.Tensor]) -> list[torch.Tensor]:
    """The float32 masters whose split is (bfloat16 parameter, int16 remainder) (new tensors)."""
    if not params:
        return []
    bits = [torch.empty(p.shape, dtype=torch.int32, device=p.device) for p in params]
    low = [torch.empty(p.shape, dtype=torch.int32, device=p.device) for p in params]
    torch._foreach_copy_(bits, [p.view(torch.int16) for p in params])
    torch._foreach_copy_(low, remainders)
    torch._foreach_mul_(bits, 1 << 16)
    torch._foreach_add_(bits, low)
    return [b.view(torch.float32) for b in bits]


def split_remainders(masters: list[torch.Tensor], params: list[torch.Tensor], remainders: list[torch.Tensor]) -> None:
    """Write each float32 master as its bfloat16 parameter and int16 remainder, in place."""
    if not masters:
        return
    bits = [m.view(torch.int32) for m in masters]
    torch._foreach_copy_(remainders, bits)  # int32 -> int16 keeps the low 16 bits
    low = [torch.empty(m.shape, dtype=torch.int32, device=m.device) for m in masters]
    torch._foreach_copy_(low, remainders)
    high = torch._foreach_sub(bits, low)  # b * 2^16, exactly (a multiple of 2^16 with 16 significant bits)
    torch._foreach_copy_([p.view(torch.int16) for p in params], torch._foreach_div(high, float(1 << 16)))
