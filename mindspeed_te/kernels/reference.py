"""Reference backend: exact dequantize + float32 matmul. Runs every recipe and format on any device."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from mindspeed_te.formats import as_float32, cast_from_fp8
from mindspeed_te.kernels.base import KernelBackend, Operand
from mindspeed_te.quantizers import Quantizer, record_nonfinite
from mindspeed_te.tensor import Float8TensorStorage, QuantizedTensorStorage


def operand_2d(t: Operand, columnwise: bool) -> torch.Tensor:
    """A GEMM operand as a float32 (rows, k) matrix: the tensor flattened to 2-D, or its transpose when the
    columnwise form is asked for (the GEMM then contracts the tensor's first, flattened, dimension)."""
    if isinstance(t, QuantizedTensorStorage):
        values = t.dequantize(torch.float32, columnwise=columnwise)
    else:
        values = as_float32(t)
    if values.dim() != 2:
        values = values.reshape(-1, values.shape[-1])
    return values.t() if columnwise else values


def _decoded_2d(t: Float8TensorStorage, columnwise: bool) -> torch.Tensor:
    """The float32 codes (unscaled) of a per-tensor operand's data flattened to 2-D, (M, K); its
    columnwise form is the transpose of this (checked here, taken by the caller)."""
    t._require(columnwise)
    values = cast_from_fp8(t.data, t.fp8_dtype)
    return values if values.dim() == 2 else values.reshape(-1, values.shape[-1])


def check_accumulate(out: Optional[torch.Tensor], bias: Optional[torch.Tensor]) -> None:
    if out is not None and (out.dtype != torch.float32 or bias is not None):
        raise ValueError("gemm: `out` (accumulation) must be a float32 tensor and cannot be combined with `bias`")


class ReferenceBackend(KernelBackend):
    """Emulates every quantized kernel exactly with torch ops."""

    name = "reference"

    def quantize(self, quantizer: Quantizer, x: torch.Tensor) -> QuantizedTensorStorage:
        return record_nonfinite(quantizer, quantizer.quantize(x))

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  mask: Optional[torch.Tensor], scale: float, dropout: float) -> torch.Tensor:
        """softmax(Q Kᵀ · scale + mask) V on [s, b, heads, d] inputs (key/value may have fewer heads);
        `mask` is a boolean "may attend" mask or an additive float one. Returns [s, b, heads · d]."""
        s_q, b, h, _ = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        if k.shape[1] != h:
            k = k.repeat_interleave(h // k.shape[1], dim=1)
            v = v.repeat_interleave(h // v.shape[1], dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                               scale=scale)
        return out.permute(2, 0, 1, 3).reshape(s_q, b, h * v.shape[-1])

    def rms_norm(self, x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
        """x / sqrt(mean(x², trailing gamma dims) + eps) · gamma in float32 (float64 stays), x's dtype out."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        return torch.nn.functional.rms_norm(x.to(dtype), gamma.shape, gamma.to(dtype), eps).to(x.dtype)

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
        """a · bᵀ over the shared last dim (+ bias). With `out`, the product is accumulated into it in
        float32 (Megatron's main_grad; no bias then) and `out` is returned."""
        check_accumulate(out, bias)
        if isinstance(a, Float8TensorStorage) and isinstance(b, Float8TensorStorage):
            # Per-tensor scales factor out of the sum: decode, multiply, then scale (as the NPU kernel does).
            # The columnwise form is the transposed view of the data: decode the stored codes, then transpose.
            a_values, b_values = _decoded_2d(a, a_columnwise), _decoded_2d(b, b_columnwise)
            result = torch.mm(a_values.t() if a_columnwise else a_values, b_values if b_columnwise else b_values.t())
            result = result.mul_(as_float32(b.scale_inv)).mul_(as_float32(a.scale_inv))
        else:
            result = self.gemm_operand(a, a_columnwise) @ self.gemm_operand(b, b_columnwise).t()
        if out is not None:
            return out.add_(result)
        if bias is not None:
            result = result + bias.float()
        return result if result.dtype == out_dtype else result.to(out_dtype)

    def gemm_operand(self, t: Operand, columnwise: bool) -> torch.Tensor:
        """A GEMM operand as the float32 (rows, k) matrix that `gemm`'s dequantize + matmul multiplies."""
        return operand_2d(t, columnwise)

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
