"""torch-native backend: `torch._scaled_mm` for per-tensor E4M3/E5M2 operands, the reference otherwise."""
from __future__ import annotations

from typing import Optional

import torch

from mindspeed_te.formats import FP8Dtype
from mindspeed_te.kernels.reference import Operand, ReferenceBackend, check_accumulate
from mindspeed_te.tensor import Float8TensorStorage

_SCALED_MM_DTYPES = (FP8Dtype.E4M3, FP8Dtype.E5M2)


def _scaled_mm_operand(t: Operand, columnwise: bool) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(data as a row-major (rows, k) matrix, scale_inv) when `_scaled_mm` can take this operand."""
    if not isinstance(t, Float8TensorStorage) or t.fp8_dtype not in _SCALED_MM_DTYPES or t.data is None:
        return None
    data = t.columnwise_data.contiguous() if columnwise else t.data.reshape(-1, t.shape[-1])
    return data, t.scale_inv.reshape(()).float()


class TorchBackend(ReferenceBackend):
    """Uses torch's own scaled GEMM where it applies (CUDA, and CPU where torch implements it)."""

    name = "torch"

    def available(self) -> tuple[bool, str]:
        """On CUDA, TransformerEngine's rule for FP8 GEMMs: compute capability >= 8.9, below which
        `torch._scaled_mm` refuses FP8 operands. MXFP8 and blockwise operands are not given to `_scaled_mm`
        here (the reference emulates their GEMMs), so TE's 10.0 for MXFP8 does not apply. On the CPU torch
        implements `_scaled_mm` itself."""
        if not torch.cuda.is_available():
            return True, ""
        capability = torch.cuda.get_device_capability()
        if capability >= (8, 9):
            return True, ""
        return False, (f"the CUDA device {torch.cuda.get_device_name()} has compute capability "
                       f"{capability[0]}.{capability[1]}; FP8 GEMMs (torch._scaled_mm) need >= 8.9")

    def gemm(self, a, b, *, a_columnwise=False, b_columnwise=False, out_dtype=torch.float32, bias=None, out=None):
        check_accumulate(out, bias)
        pa, pb = _scaled_mm_operand(a, a_columnwise), _scaled_mm_operand(b, b_columnwise)
        if pa is None or pb is None or not hasattr(torch, "_scaled_mm"):
            return super().gemm(a, b, a_columnwise=a_columnwise, b_columnwise=b_columnwise,
                                out_dtype=out_dtype, bias=bias, out=out)
        (a_data, a_scale), (b_data, b_scale) = pa, pb
        mm_dtype = torch.float32 if out is not None else out_dtype
        # CUDA's _scaled_mm takes no bias with a float32 output: there it is added to the float32 product
        fused_bias = bias is not None and mm_dtype != torch.float32
        result = torch._scaled_mm(a_data, b_data.t(), scale_a=a_scale, scale_b=b_scale,
                                  bias=bias.to(mm_dtype) if fused_bias else None, out_dtype=mm_dtype)
        if bias is not None and not fused_bias:
            result = result + bias.float()
        return out.add_(result) if out is not None else result
