"""The NPU backend's norms (`NpuNorm`, mixed into `NpuBackend`): layer_norm on torch_npu's LayerNorm kernel
(float32 statistics, x's dtype out) and rms_norm on npu_rms_norm; float64 stays on the reference."""
from __future__ import annotations

from typing import Any, Optional

import torch

from mindspeed_te.kernels.npu.common import _HALF


class NpuNorm:
    """layer_norm and rms_norm of the NPU backend; the reference (next in the MRO) otherwise."""

    npu: Any

    def layer_norm(self, x: torch.Tensor, gamma: torch.Tensor, beta: Optional[torch.Tensor], eps: float
                   ) -> torch.Tensor:
        """torch_npu's LayerNorm kernel on x, gamma and beta as they are (gamma and beta of x's dtype, or float32
        as zero-centered gamma makes them): op-plugin's native_layer_norm (LayerNormKernelNpuOpApi.cpp,
        aclnnLayerNorm) keeps mean and rstd in float32 whatever x's dtype ("acc_type ... at::kFloat") and returns
        x's dtype, which is TE's float32 math without casting x, y and the parameters (4 casts each way) or
        keeping a float32 copy of x for the backward. On NPU tensors torch's layer_norm dispatches to it; the
        simulator models it as `aten_native_layer_norm`. float64 stays on the reference."""
        if x.dtype not in (*_HALF, torch.float32) or gamma.dtype not in (x.dtype, torch.float32) or x.dim() < 2:
            return super().layer_norm(x, gamma, beta, eps)
        if beta is not None and beta.dtype != gamma.dtype:
            beta = beta.to(gamma.dtype)  # beside a float32 zero-centered gamma
        kernel = getattr(self.npu, "aten_native_layer_norm", torch.nn.functional.layer_norm)
        return kernel(x, gamma.shape, gamma, beta, eps)

    def rms_norm(self, x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
        """The fused npu_rms_norm; float64 stays on torch ops. gamma goes in float32 or x's dtype, the pairs
        aclnnRmsNorm takes (x FLOAT16/BFLOAT16 with gamma of its dtype or FLOAT32, x FLOAT32 with FLOAT32): a
        float32 gamma (the zero-centred one, whose small deviations from 1 bfloat16 would round away) as it is."""
        if x.dtype == torch.float64 or x.dim() < 2:
            return super().rms_norm(x, gamma, eps)
        return self.npu.npu_rms_norm(x, gamma if gamma.dtype in (x.dtype, torch.float32) else gamma.float(), eps)[0]
