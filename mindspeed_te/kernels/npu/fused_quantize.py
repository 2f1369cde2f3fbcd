"""The NPU backend's fused norm / activation + quantize (`NpuFusedQuantize`, a base of `NpuQuantize`): the kernels
that make the next GEMM's quantized input straight from the norm's or the activation's input, where torch_npu has
them and their rule is the recipe's (docs/npu.md, "Fused norm and activation quantize").

- `npu_rms_norm_dynamic_mx_quant` (op-plugin 26.0.0 on): RMSNorm + the rowwise MXFP8 form. It rounds the norm's
  float32 result to x's dtype before its MX quantize (as npu_rms_norm + npu_dynamic_mx_quant do), with
  npu_dynamic_mx_quant's scale rules (scale_alg 1 = TE's round-up, 0 = OCP floor). It makes no columnwise form and
  returns no norm output, so it serves a linear that needs neither (a frozen weight: no wgrad); torch_npu gives it
  no backward: the norm's gradient is npu_rms_norm_backward with the kernel's rstd, as npu_rms_norm's autograd.
- `npu_swiglu_mx_quant_with_dual_axis` (op-plugin 26.1.0 on): SwiGLU (silu of the left half times the right half,
  TE's swiglu) rounded to x's dtype, then both MXFP8 layouts, as npu_dynamic_mx_quant_with_dual_axis makes them.

Everything else goes to the unfused path (`super()`: the norm or the activation, then `quantize`)."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from mindspeed_te.kernels.npu.common import _HALF
from mindspeed_te.quantizers import MXFP8Quantizer, Quantizer, record_nonfinite_many
from mindspeed_te.tensor import MXFP8TensorStorage, QuantizedTensorStorage


class _RmsNormMxQuantize(torch.autograd.Function):
    """npu_rms_norm_dynamic_mx_quant forward; its output is a stand-in for the norm's (a zero-stride view, no
    values), through which the norm's gradient reaches x and gamma: npu_rms_norm_backward(dy, x, gamma, rstd), the
    backward op-plugin's derivatives.yaml gives npu_rms_norm, its float32 dgamma cast to gamma's dtype as autograd
    casts that one's."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, gamma: torch.Tensor, npu: Any, eps: float, kwargs: dict,
                made: list) -> torch.Tensor:
        y, scale, rstd = npu.npu_rms_norm_dynamic_mx_quant(x, gamma, epsilon=eps, **kwargs)
        made.extend((y, scale))
        ctx.npu = npu
        ctx.save_for_backward(x, gamma, rstd)
        ctx.set_materialize_grads(False)
        return x.new_empty(1).expand(x.shape)

    @staticmethod
    def backward(ctx: Any, dy: Optional[torch.Tensor]) -> tuple:
        if dy is None:
            return None, None, None, None, None, None
        x, gamma, rstd = ctx.saved_tensors
        dx, dgamma = ctx.npu.npu_rms_norm_backward(dy.contiguous(), x, gamma, rstd)
        return dx, dgamma.to(gamma.dtype), None, None, None, None


def _mx_kwargs(npu_dtype: Callable[[Any], Any], q: MXFP8Quantizer) -> dict:
    return dict(dst_type=npu_dtype(q.fp8_dtype), scale_alg=1 if q.rounding == "ceil" else 0)


class NpuFusedQuantize:
    """fuses_norm_quantize / norm_quantize and fuses_activation_quantize / activation_quantize of the NPU backend;
    the reference's composition (on this backend's norm, activation ops and quantize) where no kernel applies."""

    npu: Any
    _npu_dtype: Callable[[Any], Any]  # NpuQuantize's

    def fuses_norm_quantize(self, normalization: str, x: torch.Tensor, gamma: torch.Tensor,
                            quantizer: Quantizer) -> bool:
        """RMSNorm into the rowwise MXFP8 form alone (32-blocks), of a float16/bfloat16 x with 2 to 7 dims whose
        rows and last dim are whole blocks (aclnnRmsNormDynamicMxQuant: x "FLOAT16、BFLOAT16", "1-7" dims; gamma
        one-dimensional, of x's dtype or FLOAT32), on a torch_npu that has the kernel. Its rstd comes back only
        when x requires grad (op-plugin: "bool output_rstd = x.requires_grad();"), so a gamma that needs a
        gradient needs an x that does too."""
        if not (normalization == "RMSNorm" and isinstance(quantizer, MXFP8Quantizer) and quantizer.block_len == 32
                and quantizer.rowwise_usage and not quantizer.columnwise_usage
                and hasattr(self.npu, "npu_rms_norm_dynamic_mx_quant")):
            return False
        rows = x.numel() // max(x.shape[-1], 1) if x.dim() else 0
        return (x.dtype in _HALF and 2 <= x.dim() <= 7 and rows > 0 and rows % 32 == 0 and x.shape[-1] % 32 == 0
                and gamma.dim() == 1 and gamma.dtype in (x.dtype, torch.float32)
                and (x.requires_grad or not gamma.requires_grad))

    def norm_quantize(self, normalization: str, x: torch.Tensor, gamma: torch.Tensor, beta: Optional[torch.Tensor],
                      eps: float, quantizer: Quantizer) -> tuple[torch.Tensor, QuantizedTensorStorage]:
        if not self.fuses_norm_quantize(normalization, x, gamma, quantizer):
            return super().norm_quantize(normalization, x, gamma, beta, eps, quantizer)  # type: ignore[misc]
        made: list[torch.Tensor] = []
        stand_in = _RmsNormMxQuantize.apply(x, gamma, self.npu, eps, _mx_kwargs(self._npu_dtype, quantizer), made)
        y, scale = made
        out = MXFP8TensorStorage(quantizer.fp8_dtype, x.shape, x.dtype)
        out.rowwise_data, out.rowwise_scale_inv = y, scale.reshape(y.numel() // y.shape[-1], -1)[:, : x.shape[-1] // 32]
        return stand_in, record_nonfinite_many([quantizer], [out])[0]

    def fuses_activation_quantize(self, activation: str, x: torch.Tensor, quantizer: Quantizer) -> bool:
        """SwiGLU into MXFP8 (32-blocks; both layouts come from the kernel, the columnwise one kept only when
        asked for) of a float16/bfloat16 x whose rows and half-width are whole blocks
        (aclnnSwigluMxQuantWithDualAxis: x "FLOAT16、BFLOAT16", "[M, 2N]"), on a torch_npu that has the kernel."""
        if not (activation == "swiglu" and isinstance(quantizer, MXFP8Quantizer) and quantizer.block_len == 32
                and quantizer.rowwise_usage and hasattr(self.npu, "npu_swiglu_mx_quant_with_dual_axis")):
            return False
        rows = x.numel() // max(x.shape[-1], 1) if x.dim() else 0
        return x.dtype in _HALF and x.dim() >= 2 and rows > 0 and rows % 32 == 0 and x.shape[-1] % 64 == 0

    def activation_quantize(self, activation: str, x: torch.Tensor, quantizer: Quantizer,
                            fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedTensorStorage:
        if not self.fuses_activation_quantize(activation, x, quantizer):
            return super().activation_quantize(activation, x, quantizer, fn)  # type: ignore[misc]
        x2d = x.detach().reshape(-1, x.shape[-1])
        # activate_left=True: "A_i = x_i的前半部分, B_i = x_i的后半部分", swish(A) * B: TE's swiglu.
        y1, s1, y2, s2 = self.npu.npu_swiglu_mx_quant_with_dual_axis(
            x2d, activate_left=True, **_mx_kwargs(self._npu_dtype, quantizer))  # type: ignore[arg-type]
        m, n = y1.shape
        out = MXFP8TensorStorage(quantizer.fp8_dtype, torch.Size((*x.shape[:-1], n)), x.dtype)
        out.rowwise_data, out.rowwise_scale_inv = y1.reshape(out.shape), s1.reshape(m, -1)[:, : n // 32]
        if quantizer.columnwise_usage:  # as _quantize_mx keeps the dual-axis kernel's
            out.columnwise_data, out.columnwise_scale_pairs = y2.t(), s2
        return record_nonfinite_many([quantizer], [out])[0]
