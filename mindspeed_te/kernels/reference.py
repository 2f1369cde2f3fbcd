"""Reference backend: exact dequantize + float32 matmul. Runs every recipe and format on any device."""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Sequence, Union

import torch

from mindspeed_te import fused_cast
from mindspeed_te.formats import as_float32, cast_from_fp8, decode_table
from mindspeed_te.kernels import permutation
from mindspeed_te.kernels.base import KernelBackend, Operand
from mindspeed_te.kernels.masks import CausalMask, PackedMask, additive, as_matrix
from mindspeed_te.quantizers import Quantizer, record_nonfinite
from mindspeed_te.tensor import (
    Float8BlockwiseQTensorStorage,
    Float8TensorStorage,
    MXFP4TensorStorage,
    MXFP8TensorStorage,
    NVFP4TensorStorage,
    QuantizedTensorStorage,
)


def operand_2d(t: Operand, columnwise: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A GEMM operand as a float32 (rows, k) matrix: the tensor flattened to 2-D, or its transpose when the
    columnwise form is asked for (the GEMM then contracts the tensor's first, flattened, dimension). With
    `dtype` bfloat16, those values cast to bfloat16 (exact where `holds_bf16_values`)."""
    if isinstance(t, QuantizedTensorStorage):
        values = t.dequantize(dtype, columnwise=columnwise)
    else:
        values = as_float32(t) if dtype == torch.float32 else t.to(dtype)
    if values.dim() != 2:
        values = values.reshape(-1, values.shape[-1])
    return values.t() if columnwise else values


def hadamard_pair(a: Operand, b: Operand, a_columnwise: bool, b_columnwise: bool) -> bool:
    """Whether a · bᵀ contracts two columnwise forms quantized after the same random Hadamard transform (FP4
    storages with equal `columnwise_rht_sign_mask`); one transformed operand alone is transformed back instead,
    by its dequantize."""
    mask = getattr(a, "columnwise_rht_sign_mask", None) if a_columnwise and b_columnwise else None
    return mask is not None and getattr(b, "columnwise_rht_sign_mask", None) == mask


def nvfp4_parts(a: Operand, b: Operand, a_columnwise: bool, b_columnwise: bool
                ) -> Optional[tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]]:
    """For a · bᵀ of two NVFP4 operands read as stored (a lone Hadamard-transformed form is transformed back
    instead, by its dequantize), each one's `block_scaled_values` as its (rows, k) matrix and per-tensor factor:
    the bfloat16 values then meet in a bfloat16 GEMM and the factors scale its float32 sum. Else None."""
    if not (isinstance(a, NVFP4TensorStorage) and isinstance(b, NVFP4TensorStorage)):
        return None
    if not hadamard_pair(a, b, a_columnwise, b_columnwise) and any(
            columnwise and t.columnwise_rht_sign_mask is not None for t, columnwise in ((a, a_columnwise),
                                                                                      (b, b_columnwise))):
        return None
    return a.block_scaled_values(a_columnwise), b.block_scaled_values(b_columnwise)


def holds_bf16_values(t: Operand) -> bool:
    """Whether every value `operand_2d` makes of `t` is a bfloat16 value: FP8 and FP4 codes (E4M3, E5M2, HiF8,
    E2M1 alike) times power-of-2 scales, or a bfloat16 tensor."""
    if isinstance(t, Float8BlockwiseQTensorStorage):
        return t.power_2_scale
    if isinstance(t, QuantizedTensorStorage):
        return isinstance(t, (MXFP8TensorStorage, MXFP4TensorStorage))
    return t.dtype == torch.bfloat16


# From this many multiply-adds on, oneDNN's bf16 GEMM beats its float32 one (2^22 measured as the crossover on
# 2 cores with AMX; 64^3 took 22 us in bf16 and 5 us in float32, 256^3 53 us and 103 us). npu_sim's
# cube_matmul uses the same bound, so that the two sum alike. (The extension's gemm_bf16, where it applies,
# takes every size.)
BF16_KERNEL_MIN_MACS = 1 << 22


def mm_float32(a: torch.Tensor, b: torch.Tensor, bf16_values: bool) -> torch.Tensor:
    """a @ b of float32 matrices (or, with `bf16_values`, bfloat16 ones), summed in float32. When every value is
    a bfloat16 value (`bf16_values`), it runs on bfloat16 dot products (exact products, float32 sums): the same
    result class as the float32 GEMM, at the bf16 GEMM's speed. That is the extension's `gemm_bf16` where it
    applies (any size; its fixed summation order), else, for GEMMs large enough, oneDNN's bf16 GEMM, chosen
    through torch's process-wide matmul precision set for this call only. Values below float32's normal range
    (2^-126) may count as zero on either."""
    if bf16_values and a.device.type == "cpu":
        result = fused_cast.gemm_bf16(a, b.t())
        if result is not None:
            return result
    a, b = as_float32(a), as_float32(b)
    large = a.shape[0] * a.shape[1] * b.shape[1] >= BF16_KERNEL_MIN_MACS
    if not (bf16_values and large and a.device.type == "cpu"):
        return torch.mm(a, b)
    previous = torch._C._get_fp32_precision_getter("mkldnn", "matmul")
    torch._C._set_fp32_precision_setter("mkldnn", "matmul", "bf16")
    try:
        return torch.mm(a, b)
    finally:
        torch._C._set_fp32_precision_setter("mkldnn", "matmul", previous)


def bf16_kernel_rounds(a: Operand, b: Operand, a_columnwise: bool) -> bool:
    """Whether a · bᵀ may run as a bfloat16 GEMM with bfloat16 output: both operands hold bfloat16 values
    (block scales inside them, nothing to apply after the sum) on the CPU, and the GEMM is large enough for
    `mm_float32` to take oneDNN's bf16 kernel. That kernel then rounds its own float32 sum (plus a bfloat16
    bias) once to bfloat16, with neither float32 operands nor a float32 output written. Its sum is a float32 sum
    of the same exact products as mm_float32's; oneDNN may block the sum over k differently for the two output
    dtypes (seen from k = 2048 on, or from 1024 for some shapes), which moves a few outputs by one bfloat16 ulp,
    so the bits are those of mm_float32's sum cast to bfloat16 only where both block k alike."""
    if not (holds_bf16_values(a) and holds_bf16_values(b) and _on_cpu(a) and _on_cpu(b)):
        return False
    a_numel, b_numel = math.prod(a.shape), math.prod(b.shape)
    k = a.shape[-1] if not a_columnwise else a_numel // max(a.shape[-1], 1)
    return a_numel * (b_numel // max(k, 1)) >= BF16_KERNEL_MIN_MACS


def _on_cpu(t: Operand) -> bool:
    if isinstance(t, torch.Tensor):
        return t.device.type == "cpu"
    data = t.rowwise_data if t.rowwise_data is not None else t.columnwise_data
    return data is not None and data.device.type == "cpu"


def gemm_epilogue(acc: torch.Tensor, scale_b: Optional[torch.Tensor], scale_a: Optional[torch.Tensor],
                  bias: Optional[torch.Tensor], out_dtype: torch.dtype, out: Optional[torch.Tensor]) -> torch.Tensor:
    """A GEMM's float32 sum `acc` (overwritten) times x2's scale, then x1's (the order aclnnQuantMatmulV5
    documents), plus the float32 `bias`, as `out_dtype`; or, with `out`, added into that tensor (float32, or
    bfloat16/float16 rounded once from the float32 sum of both). One fused pass where the extension applies, else
    the torch ops, with the same values."""
    if out is None and bias is None and scale_b is None and scale_a is None and acc.dtype == out_dtype:
        return acc  # nothing to apply (a block-scaled GEMM with a float32 result)
    fused = fused_cast.gemm_epilogue(acc, scale_b, scale_a, bias, out_dtype, out)
    if fused is not None:
        return fused
    for scale in (scale_b, scale_a):
        if scale is not None:
            acc = acc.mul_(scale)
    if out is not None:
        return out.add_(acc)
    if bias is not None:
        acc = acc + bias
    return acc if acc.dtype == out_dtype else acc.to(out_dtype)


# What `out` (Megatron's main_grad) may hold: float32, or bfloat16 / float16 with --grad-reduce-in-bf16 / --fp16
# (TransformerEngine then accumulates in main_grad's own dtype).
ACCUMULATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_accumulate(out: Optional[torch.Tensor], bias: Optional[torch.Tensor]) -> None:
    if out is not None and (out.dtype not in ACCUMULATE_DTYPES or bias is not None):
        raise ValueError(f"gemm: `out` (accumulation) must be a float32, bfloat16 or float16 tensor (got "
                         f"{out.dtype}) and cannot be combined with `bias`")


ROTARY_MODES = ("half", "interleave", "interleave-half")


def rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1), on the two halves of the last dim or, interleaved, on each adjacent pair."""
    if interleaved:
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _with_offset_key(mask: Optional[torch.Tensor], offset: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(additive float mask, key, value) with one extra key whose logit is the head's offset and whose value is
    zero: exp(offset) then joins every softmax's denominator and nothing the output."""
    s_q, _, h, _ = query.shape
    dtype = query.dtype
    if mask is None or mask.dtype == torch.bool:
        mask = additive(mask, s_q, key.shape[0], dtype, query.device)
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    mask = mask.expand(mask.shape[0], h, s_q, key.shape[0])
    sink = offset.to(dtype).reshape(1, h, 1, 1).expand(mask.shape[0], h, s_q, 1)
    mask = torch.cat((mask, sink), dim=-1)
    return mask, torch.cat((key, key.new_zeros(1, *key.shape[1:]))), torch.cat(
        (value, value.new_zeros(1, *value.shape[1:])))


class _KeepingInput(torch.autograd.Function):
    """`norm(x, *params)` that keeps x itself for backward, not the float32 copy it computes on (half the bytes
    for a bfloat16 x), and runs the norm again there: the same gradients as autograd through the cast."""

    @staticmethod
    def forward(ctx, norm: Callable[..., torch.Tensor], x: torch.Tensor, *params: Optional[torch.Tensor]
                ) -> torch.Tensor:
        ctx.norm = norm
        ctx.save_for_backward(x, *params)
        return norm(x, *params)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, *params = ctx.saved_tensors
        wanted = ctx.needs_input_grad[1:]
        inputs = [t.detach().requires_grad_(need) if t is not None else None for t, need in zip((x, *params), wanted)]
        with torch.enable_grad():
            y = ctx.norm(*inputs)
        differentiable = [t for t in inputs if t is not None and t.requires_grad]
        grads = iter(torch.autograd.grad(y, differentiable, dy))
        return (None, *(next(grads) if t is not None and t.requires_grad else None for t in inputs))


def _keeping_input(norm: Callable[..., torch.Tensor], x: torch.Tensor, *params: Optional[torch.Tensor]
                   ) -> torch.Tensor:
    if x.dtype == torch.promote_types(x.dtype, torch.float32) or not torch.is_grad_enabled():
        return norm(x, *params)  # no copy to spare
    return _KeepingInput.apply(norm, x, *params)


class ReferenceBackend(KernelBackend):
    """Emulates every quantized kernel exactly with torch ops."""

    name = "reference"
    # Whether `gemm` may take the bfloat16-output GEMM (`bf16_kernel_rounds`), a shortcut of the CPU emulation.
    # A device backend that falls back to this gemm keeps the op sequence its launch counts describe.
    bf16_output_gemm = True

    def __init__(self) -> None:
        # id of an operand in a `read_twice` block -> its decoded codes once made (None until then)
        self._kept_decodes: dict[int, Optional[torch.Tensor]] = {}

    def quantize(self, quantizer: Quantizer, x: torch.Tensor) -> QuantizedTensorStorage:
        return record_nonfinite(quantizer, quantizer.quantize(x))

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  mask: Optional[Union[torch.Tensor, CausalMask, PackedMask]], scale: float, dropout: float, *,
                  empty_rows: bool = False, softmax_offset: Optional[torch.Tensor] = None) -> torch.Tensor:
        """softmax(Q Kᵀ · scale + mask) V on [s, b, heads, d] inputs (key/value may have fewer heads);
        `mask` is a boolean "may attend" mask, an additive float one or a pattern (its matrix). A
        `softmax_offset` is one extra key per head whose logit is the offset and whose value is zero.
        Returns [s, b, heads · d]."""
        s_q, b, h, _ = query.shape
        # torch's causal mode (top-left aligned) instead of the matrix: the same bits, and no s_q x s_k float
        # mask made and kept for backward in every layer
        is_causal = (isinstance(mask, CausalMask) and mask.causal and mask.window is None and softmax_offset is None
                     and (s_q == key.shape[0] or not mask.bottom_right))
        mask = None if is_causal else as_matrix(mask, s_q, key.shape[0], query.device)
        if softmax_offset is not None:
            mask, key, value = _with_offset_key(mask, softmax_offset, query, key, value)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        if k.shape[1] != h:
            k = k.repeat_interleave(h // k.shape[1], dim=1)
            v = v.repeat_interleave(h // v.shape[1], dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                               is_causal=is_causal, scale=scale)
        return out.permute(2, 0, 1, 3).reshape(s_q, b, h * v.shape[-1])

    @contextmanager
    def read_twice(self, t: Operand) -> Iterator[None]:
        """A per-tensor operand's codes are decoded once in the block: both of its layouts are views of the same
        codes (`_decoded_2d`)."""
        if not isinstance(t, Float8TensorStorage):
            yield
            return
        self._kept_decodes[id(t)] = None
        try:
            yield
        finally:
            del self._kept_decodes[id(t)]

    def _decoded_2d(self, t: Float8TensorStorage, columnwise: bool) -> torch.Tensor:
        """The float32 codes (unscaled) of a per-tensor operand's data flattened to 2-D, (M, K); its
        columnwise form is the transpose of this (checked here, taken by the caller). Within `read_twice(t)`
        the first decode serves the block."""
        t._require(columnwise)
        kept = self._kept_decodes.get(id(t))
        if kept is not None:
            return kept
        values = cast_from_fp8(t.data, t.fp8_dtype)
        values = values if values.dim() == 2 else values.reshape(-1, values.shape[-1])
        if id(t) in self._kept_decodes:
            self._kept_decodes[id(t)] = values
        return values

    def layer_norm(self, x: torch.Tensor, gamma: torch.Tensor, beta: Optional[torch.Tensor], eps: float
                   ) -> torch.Tensor:
        """(x - mean) / sqrt(var + eps) · gamma + beta over gamma's trailing dims on x cast to float32 (float64
        stays), x's dtype out. (PyTorch's CPU kernel takes a bfloat16 x with float32 gamma itself, but its dgamma
        and dbeta then carry about three times bfloat16's rounding error.)"""
        def norm(x: torch.Tensor, gamma: torch.Tensor, beta: Optional[torch.Tensor]) -> torch.Tensor:
            dtype = torch.promote_types(x.dtype, torch.float32)
            beta = beta.to(dtype) if beta is not None else None
            return torch.nn.functional.layer_norm(x.to(dtype), gamma.shape, gamma.to(dtype), beta, eps).to(x.dtype)

        return _keeping_input(norm, x, gamma, beta)

    def rms_norm(self, x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
        """x / sqrt(mean(x², trailing gamma dims) + eps) · gamma in float32 (float64 stays), x's dtype out."""
        def norm(x: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
            dtype = torch.promote_types(x.dtype, torch.float32)
            return torch.nn.functional.rms_norm(x.to(dtype), gamma.shape, gamma.to(dtype), eps).to(x.dtype)

        return _keeping_input(norm, x, gamma)

    def norm_quantize(self, normalization: str, x: torch.Tensor, gamma: torch.Tensor, beta: Optional[torch.Tensor],
                      eps: float, quantizer: Quantizer) -> tuple[torch.Tensor, QuantizedTensorStorage]:
        """The norm (`rms_norm` or `layer_norm`, differentiable), then `quantize` of its output."""
        y = self.rms_norm(x, gamma, eps) if normalization == "RMSNorm" else self.layer_norm(x, gamma, beta, eps)
        return y, self.quantize(quantizer, y)

    def activation_quantize(self, activation: str, x: torch.Tensor, quantizer: Quantizer,
                            fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedTensorStorage:
        """fn(x), then `quantize` of it."""
        return self.quantize(quantizer, fn(x))

    def moe_permute(self, tokens: torch.Tensor, routing_map: torch.Tensor,
                    num_out_tokens: Optional[Union[int, torch.Tensor]], probs: Optional[torch.Tensor] = None
                    ) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
        """Torch index ops (kernels/permutation.py); its row map is [2, num_out] int64."""
        return permutation.permute(tokens, routing_map, num_out_tokens, probs)

    def moe_unpermute(self, rows: torch.Tensor, row_map: torch.Tensor, merging_probs: Optional[torch.Tensor],
                      num_tokens: int) -> torch.Tensor:
        return permutation.unpermute(rows, row_map, merging_probs, num_tokens)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str, *,
               unit_tables: bool = False) -> torch.Tensor:
        """TE's unfused arithmetic: each product and the sum rounded in x's dtype."""
        if mode not in ROTARY_MODES:
            raise ValueError(f"rotary mode must be one of {', '.join(ROTARY_MODES)}, got {mode!r}")
        if mode == "interleave-half":
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return x * cos + rotate_half(x, mode == "interleave") * sin

    def gemm(
        self,
        a: Operand,
        b: Operand,
        *,
        a_columnwise: bool = False,
        b_columnwise: bool = False,
        out_dtype: torch.dtype = torch.float32,
        bias: Optional[torch.Tensor] = None,
        out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """a · bᵀ over the shared last dim (+ bias). With `out` (Megatron's main_grad; no bias then), the float32
        product is added into it, rounded once to its dtype, and `out` is returned."""
        check_accumulate(out, bias)
        scales: tuple[Optional[torch.Tensor], Optional[torch.Tensor]] = (None, None)
        nvfp4 = nvfp4_parts(a, b, a_columnwise, b_columnwise)
        if nvfp4 is not None:
            # code * block scale is a bfloat16 value: the bf16 GEMM sums the exact products in float32, then the
            # per-tensor factors scale the sum, b's then a's (as a per-tensor FP8 pair's scales).
            (a_values, a_factor), (b_values, b_factor) = nvfp4
            result = mm_float32(a_values, b_values.t(), bf16_values=True)
            scales = (b_factor, a_factor)
        elif isinstance(a, Float8TensorStorage) and isinstance(b, Float8TensorStorage):
            # Per-tensor scales factor out of the sum: decode, multiply, then scale (as the NPU kernel does).
            # The columnwise form is the transposed view of the data: decode the stored codes, then transpose.
            result = self._codes_gemm(a, b, a_columnwise, b_columnwise)
            if result is None:
                a_values, b_values = self._decoded_2d(a, a_columnwise), self._decoded_2d(b, b_columnwise)
                result = mm_float32(a_values.t() if a_columnwise else a_values,
                                    b_values if b_columnwise else b_values.t(), bf16_values=True)
            scales = (as_float32(b.scale_inv), as_float32(a.scale_inv))
        elif hadamard_pair(a, b, a_columnwise, b_columnwise):
            # Both operands hold their columnwise form Hadamard-transformed along the contraction dim with the
            # same matrix Q (the FP4 recipes' wgrad): the GEMM of the stored values is the product (Q Qᵀ = I).
            result = mm_float32(a.columnwise_hadamard_values(), b.columnwise_hadamard_values().t(),
                                bf16_values=holds_bf16_values(a) and holds_bf16_values(b))
        elif (self.bf16_output_gemm and out is None and out_dtype == torch.bfloat16
              and (bias is None or bias.dtype == torch.bfloat16) and bf16_kernel_rounds(a, b, a_columnwise)):
            a_values = self.gemm_operand(a, a_columnwise, torch.bfloat16)
            b_values = self.gemm_operand(b, b_columnwise, torch.bfloat16).t()
            # A bfloat16 bias is exact in float32: the kernel adds it to its float32 sum before its one rounding.
            return torch.mm(a_values, b_values) if bias is None else torch.addmm(bias, a_values, b_values)
        else:
            result = mm_float32(self.gemm_operand(a, a_columnwise), self.gemm_operand(b, b_columnwise).t(),
                                bf16_values=holds_bf16_values(a) and holds_bf16_values(b))
        return gemm_epilogue(result, *scales, None if bias is None else bias.float(), out_dtype, out)

    @staticmethod
    def _codes_gemm(a: Float8TensorStorage, b: Float8TensorStorage, a_columnwise: bool,
                    b_columnwise: bool) -> Optional[torch.Tensor]:
        """The float32 sum of two per-tensor operands' decoded codes by `gemm_bf16` read straight from the codes
        (no decoded copy: the sums mm_float32 makes of the decoded values), or None where it does not apply."""
        if not fused_cast.gemm_bf16_applies():
            return None
        a._require(a_columnwise)
        b._require(b_columnwise)
        a_codes, b_codes = (t.columnwise_data if columnwise else t.data.reshape(-1, t.shape[-1])
                            for t, columnwise in ((a, a_columnwise), (b, b_columnwise)))
        if a_codes.device.type != "cpu" or b_codes.device.type != "cpu":
            return None
        return fused_cast.gemm_bf16(a_codes, b_codes, decode_table(a.fp8_dtype, a_codes.device),
                                    decode_table(b.fp8_dtype, b_codes.device))

    def gemm_operand(self, t: Operand, columnwise: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A GEMM operand as the float32 (rows, k) matrix that `gemm`'s dequantize + matmul multiplies (cast to
        `dtype` for the bfloat16 GEMM)."""
        return operand_2d(t, columnwise, dtype)

    def grouped_gemm(
        self,
        a: Sequence[Operand],
        b: Sequence[Operand],
        *,
        a_columnwise: bool = False,
        b_columnwise: bool = False,
        out_dtype: torch.dtype = torch.float32,
        out: Optional[Sequence[torch.Tensor]] = None,
    ) -> list[torch.Tensor]:
        """One `gemm` per group: the M-split form (fprop/dgrad: a_i · b_iᵀ) and, with columnwise operands,
        the K-split form used for weight gradients."""
        if len(a) != len(b):
            raise ValueError(f"grouped_gemm needs as many a as b operands, got {len(a)} and {len(b)}")
        outs = out if out is not None else [None] * len(a)
        return [
            self.gemm(ai, bi, a_columnwise=a_columnwise, b_columnwise=b_columnwise, out_dtype=out_dtype, out=oi)
            for ai, bi, oi in zip(a, b, outs)
        ]
