"""The NPU backend's FP4 (`NpuFP4`, mixed into `NpuBackend`): MXFP4 quantize on the MX kernels' FP4 output, MXFP4
GEMMs in npu_quant_matmul's MX mode, and the NVFP4 refusal.

What the kernels' rules share with the recipes' (docs/npu.md, "FP4"):
  quantize   npu_dynamic_mx_quant(dst_type=float4_e2m1fn_x2, scale_alg=0, round_mode="rint"): the OCP rule
             2^(floor(log2 amax) - 2), nearest-even, saturating: MXFP4BlockScaling's default ("floor") bit for bit.
             Both forms of a bf16/fp16 tensor: one npu_dynamic_mx_quant_with_dual_axis (950PR and 950DT). The
             columnwise form is the kernel's, quantized along the rows as x lies (codes packed along K), which the
             GEMM takes as it is. With the Hadamard transform, the transposed tensor is transformed by torch ops and
             quantized along its last dim. Not on a kernel: scale_rounding="ceil" (scale_alg 2's rounding is not
             ours), stochastic rounding (no kernel draws random bits): the quantizer's torch ops.
  GEMM       npu_quant_matmul, group_sizes [1, 1, 32]: FP4 x FP4 (MX全量化), and E4M3 x FP4 for the
             fp8_activations mode (MX伪量化: x1 (m, k) E4M3, x2 the transposed view of a (n, k) FP4, bf16/fp16
             output and bias, k a multiple of 64). Products exact, sums float32: the reference's values.
  NVFP4      refused at the autocast entry (`nvfp4_available`): no 950 GEMM takes per-16 E4M3 scales.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from mindspeed_te.formats import FP8Dtype
from mindspeed_te.kernels.base import Operand
from mindspeed_te.kernels.npu.common import _MAX_LAST_DIM, _mx_pair
from mindspeed_te.kernels.reference import check_accumulate
from mindspeed_te.quantizers import MXFP4Quantizer
from mindspeed_te.tensor import MXFP4TensorStorage, MXFP8TensorStorage

NVFP4_REFUSAL = ("NVFP4BlockScaling needs a GEMM with per-16 E4M3 block scales, which the Ascend 950 lacks "
                 "(npu_quant_matmul's FP4 modes take E8M0 scales per 32): use MXFP4BlockScaling on the NPU, or "
                 "MINDSPEED_TE_BACKEND=reference to emulate NVFP4")


def _fp4_pair(t: MXFP4TensorStorage, columnwise: bool, as_x2: bool, kernel_form: bool = True
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(data, E8M0 scale pairs) of an MXFP4 operand form as npu_quant_matmul takes it: x1 (rows, k / 2) with
    pairs (rows, ceil(k / 64), 2); x2 the transposed view (k / 2, rows) with the pairs' transposed view. A
    kernel-made columnwise form, (M, K / 2) packed along K with (ceil(M / 64), K, 2) pairs, is the kernel's
    transposed x1 (its .t() view, pairs permuted) and non-transposed x2 (as it is), as MXFP8's (`_mx_pair`);
    `kernel_form=False` takes the storage's own (K, M / 2) form instead (made from it once)."""
    if columnwise and kernel_form and t.columnwise_kernel_data is not None:
        data, pairs = t.columnwise_kernel_data, t.columnwise_scale_pairs
        return (data, pairs) if as_x2 else (data.t(), pairs.permute(1, 0, 2))
    t._require(columnwise)
    if columnwise:
        data, scale_inv = t.columnwise_data, t.columnwise_scale_inv
    else:
        data, scale_inv = t.rowwise_data.reshape(-1, t.rowwise_data.shape[-1]), t.rowwise_scale_inv
    if scale_inv.shape[1] % 2:
        scale_inv = torch.nn.functional.pad(scale_inv, (0, 1))
    pairs = scale_inv.reshape(scale_inv.shape[0], -1, 2)
    return (data.t(), pairs.transpose(0, 1)) if as_x2 else (data, pairs)


class NpuFP4:
    """MXFP4 quantize and GEMM of the NPU backend, and its NVFP4 answer; the next class in the MRO otherwise."""

    npu: Any

    def nvfp4_available(self) -> tuple[bool, str]:
        """NVFP4 is refused on the NPU, as TransformerEngine refuses it on a GPU without NVFP4 GEMMs."""
        return False, NVFP4_REFUSAL

    def _quantize_mxfp4(self, q: MXFP4Quantizer, x: torch.Tensor, x2d: torch.Tensor
                        ) -> Optional[MXFP4TensorStorage]:
        """MXFP4 on the MX quantize kernels where their rule is the quantizer's; None (the quantizer's torch ops)
        for "ceil" scales, stochastic rounding, other block lengths, shapes not of whole 32-blocks (the quantizer
        raises its own error) and empty tensors."""
        m, k = x2d.shape
        if q.rounding != "floor" or q.stochastic_rounding or q.block_len != 32 or m % 32 or k % 32 or not x2d.numel():
            return None
        out = MXFP4TensorStorage(q.fp8_dtype, x.shape, x.dtype)
        kwargs = dict(dst_type=self.npu.float4_e2m1fn_x2, scale_alg=0, round_mode="rint")
        columnwise = q.columnwise_usage and not q.with_rht
        if q.rowwise_usage and columnwise and self._dual_axis_mx(x2d):
            y1, s1, out.columnwise_kernel_data, out.columnwise_scale_pairs = \
                self.npu.npu_dynamic_mx_quant_with_dual_axis(x2d, **kwargs)
            out.rowwise_data, out.rowwise_scale_inv = y1.reshape(*x.shape[:-1], k // 2), s1.reshape(m, -1)[:, : k // 32]
            return out
        if q.rowwise_usage:
            y, pairs = self.npu.npu_dynamic_mx_quant(x2d, axis=-1, **kwargs)
            out.rowwise_data = y.reshape(*x.shape[:-1], k // 2)
            out.rowwise_scale_inv = pairs.reshape(m, -1)[:, : k // 32]
        if columnwise:
            out.columnwise_kernel_data, out.columnwise_scale_pairs = self.npu.npu_dynamic_mx_quant(x2d, axis=-2,
                                                                                                    **kwargs)
        elif q.columnwise_usage:  # the Hadamard transform of the transpose (torch ops), then its rows quantized
            y, pairs = self.npu.npu_dynamic_mx_quant(q._columnwise_source(x2d), axis=-1, **kwargs)
            out.columnwise_data, out.columnwise_scale_inv = y, pairs.reshape(k, -1)[:, : m // 32]
            out.columnwise_rht_sign_mask = q.rht_sign_mask
        return out

    def gemm(self, a: Operand, b: Operand, *, a_columnwise: bool = False, b_columnwise: bool = False,
             out_dtype: torch.dtype = torch.float32, bias: Optional[torch.Tensor] = None,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """An MXFP4 x2 in npu_quant_matmul's MX mode where a mode fits (`_mxfp4_args`); the next gemm otherwise."""
        args = self._mxfp4_args(a, b, a_columnwise, b_columnwise, out_dtype, out) if isinstance(
            b, MXFP4TensorStorage) else None
        if args is None:
            return super().gemm(a, b, a_columnwise=a_columnwise, b_columnwise=b_columnwise, out_dtype=out_dtype,
                                bias=bias, out=out)
        check_accumulate(out, bias)
        x1, x2, kwargs, pseudo = args
        if bias is not None:
            # MX全量化: bias "null/FLOAT32"; MX伪量化: "数据类型要求与输出类型保持一致 ... shape表示(1，n)".
            bias = bias.to(out_dtype).reshape(1, -1) if pseudo else bias.float()
        result = self.npu.npu_quant_matmul(x1, x2, kwargs.pop("scale"), bias=bias,
                                           output_dtype=torch.float32 if out is not None else out_dtype, **kwargs)
        return out.add_(result) if out is not None else result

    def _mxfp4_args(self, a: Operand, b: MXFP4TensorStorage, a_col: bool, b_col: bool, out_dtype: torch.dtype,
                    out: Optional[torch.Tensor]) -> Optional[tuple[torch.Tensor, torch.Tensor, dict, bool]]:
        """(x1, x2, keyword arguments, whether the E4M3 x FP4 mode) of npu_quant_matmul for a · bᵀ, or None:
        FP4 x FP4 (any layout the forms have), or an E4M3 MXFP8 x1 (contiguous) with a transposed FP4 x2, a
        bfloat16/float16 result and k a multiple of 64 (MX伪量化); a last dim past the kernel's 65535, or an empty
        k, goes to the reference."""
        masks = [getattr(t, "columnwise_rht_sign_mask", None) if col else None for t, col in ((a, a_col), (b, b_col))]
        if masks[0] != masks[1]:
            return None  # one form Hadamard-transformed alone: the reference transforms it back first
        e8m0, fp4 = self.npu.float8_e8m0fnu, self.npu.float4_e2m1fn_x2
        if isinstance(a, MXFP4TensorStorage):
            x1, s1 = _fp4_pair(a, a_col, as_x2=False)
            kwargs = dict(x1_dtype=fp4, x2_dtype=fp4)
            pseudo = False
        elif (isinstance(a, MXFP8TensorStorage) and a.fp8_dtype is FP8Dtype.E4M3 and out is None
              and out_dtype in (torch.bfloat16, torch.float16)):
            x1, s1 = _mx_pair(a, a_col, as_x2=False)
            kwargs = dict(x2_dtype=fp4)
            pseudo = True
            if not x1.is_contiguous() or x1.shape[-1] % 64:
                return None
        else:
            return None
        # The E4M3 x FP4 mode takes a transposed x2 only: a kernel-made columnwise weight gives its (K, N / 2) form.
        x2, s2 = _fp4_pair(b, b_col, as_x2=True, kernel_form=not pseudo)
        if min(x1.shape) == 0 or x1.shape[-1] > _MAX_LAST_DIM or x2.shape[-1] > _MAX_LAST_DIM:
            return None
        return x1, x2, dict(scale=s2, pertoken_scale=s1, scale_dtype=e8m0, pertoken_scale_dtype=e8m0,
                            group_sizes=[1, 1, 32], **kwargs), pseudo
