"""npu_rms_norm_dynamic_mx_quant (aclnnRmsNormDynamicMxQuant) and npu_swiglu_mx_quant_with_dual_axis
(aclnnSwigluMxQuantWithDualAxis): a norm, or SwiGLU, and the MX quantize of its output in one launch.

Not kernels of the default simulator: torch_npu has them from op-plugin 26.0.0 (npu_rms_norm_dynamic_mx_quant)
and 26.1.0 (npu_swiglu_mx_quant_with_dual_axis) on, and the library calls them only where `hasattr(torch_npu,
name)`. A torch_npu that has both is `make_simulator_with_fused_quant()`; the default simulator lacks them, so the
self-check (`selfcheck.missing_kernels`) does not ask an installed torch_npu for them.

What makes them usable bit for bit (docs/npu.md, "Fused norm and activation quantize"): both kernels round the
norm's (SwiGLU's) float32 result to the input's dtype (CAST_RINT) before the MX quantize reads it, as the unfused
path (npu_rms_norm or the activation in x's dtype, then npu_dynamic_mx_quant) does, and their MX rules are
npu_dynamic_mx_quant's (scale_alg 0: OCP floor, 1: the round-up "cuBLAS" rule). The simulator computes them so:
the norm as npu_rms_norm does, SwiGLU with the host's silu, then the MX quantize of npu_dynamic_mx_quant.

Sources: op-plugin's schemas (op_plugin_functions.yaml) and bindings (RmsNormDynamicMxQuantKernelNpuOpApi.cpp,
SwigluMxQuantWithDualAxisOpApi.cpp), its meta registrations (_meta_registrations.py), and CANN ops-nn's
documents and kernels (norm/rms_norm_dynamic_mx_quant: aclnnRmsNormDynamicMxQuant.md,
op_kernel/arch35/rms_norm_dynamic_mx_quant_full_load.h and _common.h; quant/swiglu_mx_quant_with_dual_axis:
aclnnSwigluMxQuantWithDualAxis.md, op_kernel/arch35/swiglu_mx_quant_with_dual_axis_regbase.h).
"""
from __future__ import annotations

from typing import Optional

import torch

from mindspeed_te.testing.npu_sim.checks import (
    check_choice,
    check_dims,
    check_dtype,
    check_float,
    check_int,
    check_shape,
    check_tensor,
    dtype_arg,
    dtype_name,
    kernel,
)
from mindspeed_te.testing.npu_sim.dtypes import FLOAT4_E2M1FN_X2, FP4, FP8_NATIVE, HALF_FLOATS, DtypeArg
from mindspeed_te.testing.npu_sim.errors import NpuSimNotImplemented, NpuValueError
from mindspeed_te.testing.npu_sim.simulator import NpuSimulator


def _fp8_out(dst_type: DtypeArg, round_mode: str, scale_alg: int) -> torch.dtype:
    """The FP8 output dtype of an MX kernel (FP4 is not simulated), with round_mode and scale_alg checked."""
    out = dtype_arg("dst_type", dst_type, required=True)
    # aclnnRmsNormDynamicMxQuant dstType: "输入范围为{35, 36, 40, 41}"; aclnnSwigluMxQuantWithDualAxis dstType:
    # "输入范围为 {35, 36, 40, 41}" (FLOAT8_E5M2, FLOAT8_E4M3FN, FLOAT4_E2M1, FLOAT4_E1M2).
    check_dtype("dst_type", out, (*FP8_NATIVE, *FP4))
    if out in FP4:
        raise NpuSimNotImplemented(f"dst_type={dtype_name(out)}: only FP8 outputs are simulated")
    # roundMode: "当dstType为36/35时，仅支持{"rint"}" (both documents).
    if round_mode != "rint":
        raise NpuValueError(f"round_mode must be 'rint' for FP8 output, got {round_mode!r}")
    # scaleAlg: "支持取值0和1" / "取值范围：{1, 0}，1代表cuBLAS实现, 0代表OCP实现".
    check_choice("scale_alg", check_int("scale_alg", scale_alg), (0, 1), "for FP8 output")
    return out  # type: ignore[return-value]


class FusedQuantKernels:
    """npu_rms_norm_dynamic_mx_quant and npu_swiglu_mx_quant_with_dual_axis (mixed into
    `NpuSimulatorWithFusedQuant`)."""

    @kernel
    def npu_rms_norm_dynamic_mx_quant(self, x: torch.Tensor, /, gamma: torch.Tensor, *,
                                      beta: Optional[torch.Tensor] = None, epsilon: float = 1e-6,
                                      scale_alg: int = 0, round_mode: str = "rint",
                                      dst_type: DtypeArg = FLOAT4_E2M1FN_X2
                                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(y, mxscale, rstd): RMSNorm over the last dim, y_hp = x * rstd * gamma (+ beta) in float32 rounded to
        x's dtype, then MX quantized along the last dim as npu_dynamic_mx_quant(axis=-1, block_size=32) would:
        y in dst_type, mxscale uint8 (E8M0 bytes) of shape x.shape[:-1] + (ceil(n / 64), 2), rstd float32 of
        shape x.shape[:-1] + (1,) when x requires grad (op-plugin: "bool output_rstd = x.requires_grad();"),
        else empty."""
        # aclnnRmsNormDynamicMxQuant.md, 产品支持情况: "Ascend 950PR/Ascend 950DT：支持", A2/A3 "不支持".
        self._require_fp8_soc("npu_rms_norm_dynamic_mx_quant")
        # x: "FLOAT16、BFLOAT16", "1-7"; the binding: "The x should be in 1~7D".
        check_tensor("x", x, HALF_FLOATS)
        check_dims("x", x, 1, 7)
        # gamma: "shape只能为一维，需要与x最后一维维度匹配。数据类型默认与输入x一致；若不一致，则显示设为FLOAT32。"
        check_tensor("gamma", gamma, (x.dtype, torch.float32))
        check_shape("gamma", gamma, (x.shape[-1],))
        # beta: "可选参数，支持传入空指针。如果提供，shape和数据类型需要与gamma保持一致。"
        if beta is not None:
            check_tensor("beta", beta, (gamma.dtype,))
            check_shape("beta", beta, (x.shape[-1],))
        out = _fp8_out(dst_type, round_mode, scale_alg)
        eps = check_float("epsilon", epsilon)
        xf = x.float()
        # "y = RmsNorm(x) = x / Rms(x) · gamma + beta, Rms(x) = sqrt(1/n Σ x_i^2 + epsilon)"; the kernel
        # (rms_norm_dynamic_mx_quant_full_load.h, ComputeY): Mul(x, rstd), Mul(gamma), Add(beta) in float32, then
        # "StoreTensorForDtypeT(yLocalUbAddr, ...)": the result cast to x's dtype (castTraitB322B16, CAST_RINT)
        # into the buffer the MX quantize reads. rstd is npu_rms_norm's (the same norm_common square sum and
        # ComputeRstdNewtonRaphson), computed here as the simulator's npu_rms_norm does.
        rstd = torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)
        y_hp = xf * rstd * gamma.float()
        if beta is not None:
            y_hp = y_hp + beta.float()
        y, scale = self._mx_quantize(y_hp.to(x.dtype), x.dim() - 1, out, 32, scale_alg, 0.0)
        # 约束说明, 边界值场景: "当输入是Inf时：1、输出yOut为0；2、输出mxscaleOut为255，偶数pad填充值为0；
        # 3、输出rstdOut为0。当输入是NaN时：1、输出yOut为0；2、输出mxscaleOut为255，偶数pad填充值为0；
        # 3、输出rstdOut为NaN。" Read per row (the norm's unit): every block of such a row, the pad byte staying 0.
        bad = ~torch.isfinite(xf).all(dim=-1)
        if bool(bad.any()):
            nan_row = torch.isnan(xf).any(dim=-1, keepdim=True)
            rstd = torch.where(bad.unsqueeze(-1), torch.where(nan_row, torch.nan, 0.0), rstd)
            y = torch.where(bad.unsqueeze(-1), torch.zeros((), dtype=y.dtype), y)
            blocks = -(-x.shape[-1] // 32)
            marked = torch.full_like(scale, 255).flatten(-2)
            marked[..., blocks:] = 0
            scale = torch.where(bad[..., None, None], marked.view(scale.shape), scale)
        if not x.requires_grad:
            rstd = torch.empty(0, dtype=torch.float32)
        return y, scale, rstd

    @kernel
    def npu_swiglu_mx_quant_with_dual_axis(self, x: torch.Tensor, /, *, group_index: Optional[torch.Tensor] = None,
                                           activate_left: bool = True, round_mode: str = "rint", scale_alg: int = 1,
                                           dst_type: DtypeArg = 24, dst_type_max: float = 0.0
                                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(y1, mxscale1, y2, mxscale2) of SwiGLU(x) = silu(A) * B (A the left half of the last dim with
        activate_left, else the right one) in float32 rounded to x's dtype, MX quantized along -1 and -2 as
        npu_dynamic_mx_quant_with_dual_axis would: y1, y2 (M, N) in dst_type, mxscale1 (M, ceil(N / 64), 2),
        mxscale2 (ceil(M / 64), N, 2) with block pairs interleaved, uint8 E8M0 bytes."""
        # aclnnSwigluMxQuantWithDualAxis.md, 产品支持情况: "Ascend 950PR/Ascend 950DT：支持", A2/A3 "不支持".
        self._require_fp8_soc("npu_swiglu_mx_quant_with_dual_axis")
        # x: "FLOAT16、BFLOAT16", 维度 "2", "shape为[M, 2N]，最后一维必须为偶数", "不支持空Tensor".
        check_tensor("x", x, HALF_FLOATS)
        check_dims("x", x, 2, 2)
        if x.shape[-1] % 2 or x.numel() == 0:
            raise NpuValueError(f"x must be a non-empty [M, 2N], got {tuple(x.shape)}")
        # groupIndexOptional: "shape为[G]，采用cumsum模式" (grouped quantize of MoE rows): the library passes none.
        if group_index is not None:
            raise NpuSimNotImplemented("group_index (grouped MX quantize) is not simulated")
        out = _fp8_out(dst_type, round_mode, scale_alg)
        # maxDtypeValue: "预留参数。maxDtypeValue取值仅支持0。"
        if check_float("dst_type_max", dst_type_max) != 0.0:
            raise NpuValueError(f"dst_type_max must be 0, got {dst_type_max}")
        # "当activateLeft=true时：A_i = x_i的前半部分, B_i = x_i的后半部分"; "swigluOut_i = Swish(A_i) * B_i =
        # A_i / (1 + e^{-A_i}) * B_i". The kernel (ComputeSwiglu): Cast to float32, Muls(-1), Exp, Adds(1),
        # Div(A, .), Mul(B), then "Cast<xDtype, float, CAST_FP32_TO_FP16_BF16>" (CAST_RINT) into the buffer both
        # quantizes read. aclnnSilu (ops-nn activation/swish, "out_i = self_i / (1 + e^{-self_i})", Exp, Adds 1,
        # Div) runs the same steps on the same vector unit; the simulator evaluates Swish with the host's silu, so
        # that the fused and the unfused path share one exponential, as they do on the chip.
        left, right = x.float().chunk(2, dim=-1)
        a, b = (left, right) if activate_left else (right, left)
        swiglu = (torch.nn.functional.silu(a) * b).to(x.dtype)
        # "-1轴量化 ... -2轴量化": the blocks, scales and layouts of npu_dynamic_mx_quant_with_dual_axis
        # ("ComputeAll (scale + quantize) — same as dynamic_mx_quant_with_dual_axis", the kernel's comment).
        y1, s1 = self._mx_quantize(swiglu, 1, out, 32, scale_alg, 0.0)
        y2, s2 = self._mx_quantize(swiglu, 0, out, 32, scale_alg, 0.0)
        return y1, s1, y2, s2


class NpuSimulatorWithFusedQuant(FusedQuantKernels, NpuSimulator):
    """A simulated torch_npu that has npu_rms_norm_dynamic_mx_quant (op-plugin 26.0.0 and later) and
    npu_swiglu_mx_quant_with_dual_axis (26.1.0 and later), with CANN's ops-nn kernels behind them."""


def make_simulator_with_fused_quant(soc_name: str = "Ascend950PR") -> NpuSimulatorWithFusedQuant:
    """A fresh simulator of a chip named `soc_name` whose torch_npu has the fused norm / SwiGLU MX quantize
    kernels."""
    return NpuSimulatorWithFusedQuant(soc_name)
