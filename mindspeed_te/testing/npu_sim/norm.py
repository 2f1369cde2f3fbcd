"""npu_rms_norm and its backward kernel npu_rms_norm_backward (aclnnRmsNorm / aclnnRmsNormGrad), and torch_npu's
LayerNorm (aten native_layer_norm and its backward on NPU tensors, aclnnLayerNorm / aclnnLayerNormBackward).

torch_npu gives npu_rms_norm its backward through op-plugin's derivatives.yaml ("self, gamma:
npu_rms_norm_backward(grad, self, gamma, result1)"): one kernel for dx and dgamma. The simulator does the same with
an autograd Function whose backward calls its own counted `npu_rms_norm_backward`, so a launch count of a
backward sees that one kernel (and the cast of the float32 dgamma autograd then makes, as on the device), not the
torch ops that compute it here.

LayerNorm is an aten op torch_npu implements for NPU tensors; on the host's tensors the simulator stands for
it as `aten_native_layer_norm` (the NPU backend calls that where it exists, torch's layer_norm otherwise) with
the NPU kernel's dtypes: op-plugin's native_layer_norm allocates mean and rstd in float32 for a float16/bfloat16
input ("acc_type") and the output like the input. The host's own kernel would not do: given a bfloat16 input
with float32 gamma it keeps float32 statistics, but its dgamma and dbeta carry about three times bfloat16's
rounding error."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from mindspeed_te.testing.npu_sim.checks import check_dims, check_float, check_shape, check_tensor, kernel
from mindspeed_te.testing.npu_sim.dtypes import FLOATS
from mindspeed_te.testing.npu_sim.errors import NpuValueError


def _check_gamma(gamma: torch.Tensor, x: torch.Tensor, x_name: str) -> tuple[int, ...]:
    """The normalized dims of x: gamma "shape需要满足gamma_shape = x_shape[n:], n < x_shape.dims()"."""
    if tuple(gamma.shape) != tuple(x.shape[x.dim() - gamma.dim():]):
        raise NpuValueError(f"gamma {tuple(gamma.shape)} must match the trailing dims of {x_name} {tuple(x.shape)}")
    return tuple(range(x.dim() - gamma.dim(), x.dim()))


class _RmsNorm(torch.autograd.Function):
    """The forward kernel's values; the backward is the simulator's npu_rms_norm_backward kernel."""

    @staticmethod
    def forward(ctx: Any, sim: Any, x: torch.Tensor, gamma: torch.Tensor, eps: float, dims: tuple[int, ...]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        xf = x.float()
        rstd = torch.rsqrt(xf.square().mean(dim=dims, keepdim=True) + eps)
        y = xf * rstd * gamma.float()
        # aclnnRmsNorm 约束说明 (A2, A3, Ascend 950PR/950DT): "当输入是Inf时，输出为Inf。当输入是NaN时，输出为NaN。"
        # NaN propagates through the formula; an Inf element would give Inf * rstd(= 0) = NaN, so it is set to
        # x * gamma (Inf with gamma's sign). The document says nothing of the finite elements of such a row
        # (here x * 0 = 0).
        y = torch.where(torch.isinf(xf), xf * gamma.float(), y)
        ctx.sim = sim
        ctx.save_for_backward(x, gamma, rstd)
        ctx.mark_non_differentiable(rstd)
        ctx.set_materialize_grads(False)  # as op-plugin's node, which makes no zero gradient for an unused y
        return y.to(x.dtype), rstd

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor, _drstd: Any) -> tuple:
        if dy is None:
            return None, None, None, None, None
        x, gamma, rstd = ctx.saved_tensors
        dx, dgamma = ctx.sim.npu_rms_norm_backward(dy, x, gamma, rstd)
        return None, dx, dgamma, None, None


class _LayerNorm(torch.autograd.Function):
    """The forward kernel's values from float32 math; the backward is the simulator's
    aten_native_layer_norm_backward."""

    @staticmethod
    def forward(ctx: Any, sim: Any, x: torch.Tensor, shape: tuple[int, ...], gamma: torch.Tensor,
                beta: Optional[torch.Tensor], eps: float) -> torch.Tensor:
        y, mean, rstd = torch.ops.aten.native_layer_norm(x.float(), shape, gamma.float(),
                                                         None if beta is None else beta.float(), eps)
        ctx.sim, ctx.shape = sim, shape
        ctx.save_for_backward(x, mean, rstd, gamma, beta)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        x, mean, rstd, gamma, beta = ctx.saved_tensors
        dx, dgamma, dbeta = ctx.sim.aten_native_layer_norm_backward(dy, x, ctx.shape, mean, rstd, gamma, beta)
        return None, dx, None, dgamma, dbeta, None


class NormKernels:
    """npu_rms_norm (differentiable), npu_rms_norm_backward, and torch_npu's LayerNorm forward and backward."""

    @kernel(differentiable=True)
    def aten_native_layer_norm(self, input: torch.Tensor, normalized_shape: Sequence[int],
                               weight: torch.Tensor, bias: Optional[torch.Tensor] = None, eps: float = 1e-5
                               ) -> torch.Tensor:
        """torch's layer_norm(input, normalized_shape, weight, bias, eps) on an NPU tensor: float32 math, the
        output in input's dtype, float32 mean and rstd kept for the backward."""
        # op-plugin LayerNormKernelNpuOpApi.cpp: "auto acc_type = input.scalar_type() == at::kDouble ? at::kDouble :
        # at::kFloat;" for mean_out and rstd_out, the output "apply_tensor_without_format(input)". The simulator
        # takes the weight and bias the library passes (of the input's dtype, or float32 for a zero-centered
        # gamma) and refuses what it does not model.
        check_tensor("input", input, FLOATS)
        check_tensor("weight", weight, (input.dtype, torch.float32))
        if bias is not None:
            check_tensor("bias", bias, (weight.dtype,))
            check_shape("bias", bias, tuple(weight.shape))
        shape = tuple(normalized_shape)
        if tuple(weight.shape) != shape:
            raise NpuValueError(f"weight {tuple(weight.shape)} must have the normalized shape {shape}")
        _check_gamma(weight, input, "input")
        return _LayerNorm.apply(self, input, shape, weight, bias, check_float("eps", eps))

    @kernel
    def aten_native_layer_norm_backward(self, grad_out: torch.Tensor, input: torch.Tensor,
                                        normalized_shape: tuple[int, ...], mean: torch.Tensor, rstd: torch.Tensor,
                                        weight: torch.Tensor, bias: Optional[torch.Tensor] = None
                                        ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """(dx in input's dtype, dweight and dbias (None without a bias) in the weight's dtype) of
        `aten_native_layer_norm`, computed in float32 (op-plugin's backward returns each gradient like its
        tensor)."""
        check_tensor("grad_out", grad_out, (input.dtype,))
        check_shape("grad_out", grad_out, tuple(input.shape))
        check_tensor("mean", mean, (torch.float32,))
        check_tensor("rstd", rstd, (torch.float32,))
        fbias = None if bias is None else bias.float()
        dx, dweight, dbias = torch.ops.aten.native_layer_norm_backward(
            grad_out.float(), input.float(), normalized_shape, mean, rstd, weight.float(), fbias,
            [True, True, bias is not None])
        return dx.to(input.dtype), dweight.to(weight.dtype), None if dbias is None else dbias.to(weight.dtype)

    @kernel(differentiable=True)
    def npu_rms_norm(self, input: torch.Tensor, /, gamma: torch.Tensor, epsilon: float = 1e-6
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """y = input * rstd * gamma over the trailing gamma.dim() dims, in float32, returned in input's dtype;
        rstd = 1 / sqrt(mean(input^2) + epsilon), float32 of shape input.shape[:-gamma.dim()] + (1,) * gamma.dim()."""
        # aclnnRmsNorm.md, "各平台支持数据类型说明" (A2, A3, Ascend 950PR/950DT): x FLOAT16 with gamma FLOAT32 or
        # FLOAT16, x BFLOAT16 with gamma FLOAT32 or BFLOAT16, x FLOAT32 with gamma FLOAT32; y in x's dtype, rstd
        # FLOAT32.
        check_tensor("input", input, FLOATS)
        check_tensor("gamma", gamma, (input.dtype, torch.float32))
        # torch_npu doc: self "shape支持2-8维度"; aclnnRmsNorm: gamma "1-8" dims.
        check_dims("input", input, 2, 8)
        check_dims("gamma", gamma, 1, input.dim())
        dims = _check_gamma(gamma, input, "input")
        return _RmsNorm.apply(self, input, gamma, check_float("epsilon", epsilon), dims)

    @kernel
    def npu_rms_norm_backward(self, dy: torch.Tensor, input: torch.Tensor, /, gamma: torch.Tensor,
                              rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(dx in dy's dtype, dgamma float32) of y = input * rstd * gamma, by the document's formulas in float32
        (op-plugin's schema: "npu_rms_norm_backward(Tensor dy, Tensor self, Tensor gamma, Tensor rstd)"):
        dx = (dy·g - x·rstd·mean(dy·g·x·rstd)) · rstd, dgamma = Σ over the rows of x·rstd·dy."""
        # aclnnRmsNormGrad.md, 约束说明, the table for A2, A3 and Ascend 950PR/950DT: dy and x FLOAT16 with gamma
        # FLOAT32 or FLOAT16, BFLOAT16 with gamma FLOAT32 or BFLOAT16, FLOAT32 with FLOAT32; rstd FLOAT32; dxOut in
        # dy's dtype, dgammaOut FLOAT32.
        check_tensor("dy", dy, FLOATS)
        check_tensor("input", input, (dy.dtype,))
        check_tensor("gamma", gamma, (dy.dtype, torch.float32))
        check_tensor("rstd", rstd, (torch.float32,))
        # dy, x: "2-8" dims, x "shape与入参dy的shape保持一致"; gamma "1-7" dims.
        check_dims("dy", dy, 2, 8)
        check_shape("input", input, tuple(dy.shape))
        check_dims("gamma", gamma, 1, 7)
        dims = _check_gamma(gamma, input, "input")
        # rstd: "shape需要满足rstd_shape = x_shape[0:n]，n < x_shape.dims()，n与gamma的n一致" (npu_rms_norm returns it
        # with the normalized dims kept as 1s, which the simulator takes too).
        rows = tuple(input.shape[: dims[0]])
        check_shape("rstd", rstd, rows, rows + (1,) * len(dims))
        x, g, r = input.float(), gamma.float(), rstd.reshape(rows + (1,) * len(dims))
        dyg = dy.float() * g
        mean = (dyg * x * r).mean(dim=dims, keepdim=True)
        dx = (dyg - x * r * mean) * r
        dgamma = (x * r * dy.float()).sum(dim=tuple(range(dims[0])))
        return dx.to(dy.dtype), dgamma
