"""The simulator's own FP4 (E2M1) codec, the packed layout of torch_npu.float4_e2m1fn_x2, and the FP4 argument
rules of the MX quantize kernels.

Built from the bit layout alone (1 sign, 2 exponent bits with bias 1, 1 mantissa bit; exponent 0 subnormal), apart
from `mindspeed_te.fp4`, so that the NPU path equals the reference backend because two codecs agree.

- Encoding rounds to the nearest value, ties to the even code, and saturates to +-6. The MX quantize documents
  give only "cast_to_dst_type(V_i/mxscale, round_mode)"; CANN's golden model of the kernel
  (ops-nn quant/dynamic_mx_quant/tests/assets/golden.py) rounds with `np.rint` and clips to the format's max
  ("np.clip(ret, a_min=-max_norm, a_max=max_norm, out=ret)"), and writes NaN elements as 0
  ("np.nan_to_num(ele_array, nan=0.0)"). The simulator follows that golden model.
- Packing: two codes per byte along the last dim as the tensor is stored. torch_npu sizes the output so ("y_shape[
  input.dim() - 1] = last_dim_val / FP4_IN_UINT8_NUM", DynamicMxQuantKernelNpuOpApi.cpp). No document line gives
  the nibble order: the simulator puts element 2i in the low nibble and 2i + 1 in the high one, the OCP / PyTorch
  float4_e2m1fn_x2 order. This is the simulator's assumption, not documented kernel behaviour.
"""
from __future__ import annotations

from typing import Any

import torch

from mindspeed_te.testing.npu_sim.checks import check_choice, check_float, check_int
from mindspeed_te.testing.npu_sim.dtypes import FLOAT4_E1M2FN_X2, Dtype
from mindspeed_te.testing.npu_sim.errors import NpuSimNotImplemented, NpuValueError

__all__ = ["E2M1_EMAX", "e2m1_values", "fp4_encode_packed", "fp4_decode_packed", "fp4_logical_shape",
           "check_fp4_mx_args"]

# aclnnDynamicMxQuantV3, emax table: "FLOAT4_E2M1 | 2"
E2M1_EMAX = 2


def _e2m1_value(code: int) -> float:
    sign = -1.0 if code & 0x8 else 1.0
    e, m = (code >> 1) & 0x3, code & 0x1
    return sign * (m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1))


_VALUES = torch.tensor([_e2m1_value(c) for c in range(16)], dtype=torch.float64)
_LADDER = _VALUES[:8]  # the non-negative values, ascending with their codes 0..7


def e2m1_values() -> torch.Tensor:
    """float64[16]: the value of each E2M1 code."""
    return _VALUES


def _encode(x: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (int64, one per element) of float values: nearest, ties to the even code, saturating; NaN -> 0."""
    xd = x.detach().to(torch.float64)
    a = xd.abs().clamp(max=float(_LADDER[-1]))
    hi = torch.searchsorted(_LADDER, a).clamp(max=7)
    lo = (hi - 1).clamp(min=0)
    below, above = a - _LADDER[lo], _LADDER[hi] - a
    take_hi = (above < below) | ((above == below) & (hi % 2 == 0))
    code = torch.where(take_hi, hi, lo)
    code = torch.where(torch.signbit(xd), code | 0x8, code)
    return torch.where(torch.isnan(xd), torch.zeros_like(code), code)


def fp4_encode_packed(x: torch.Tensor) -> torch.Tensor:
    """uint8 bytes of the E2M1 codes of x, two per byte along the last dim (element 2i in the low nibble)."""
    code = _encode(x)
    return (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8).contiguous()


def fp4_decode_packed(data: torch.Tensor) -> torch.Tensor:
    """float32 values of packed E2M1 bytes, the stored last dim twice as long. A transposed view of a contiguous
    tensor (the layout npu_quant_matmul takes for a transposed operand) is decoded as stored and transposed back:
    its packed dim is then the second-to-last one."""
    if data.dim() >= 2 and not data.is_contiguous() and data.transpose(-1, -2).is_contiguous():
        return fp4_decode_packed(data.transpose(-1, -2)).transpose(-1, -2)
    b = data.view(torch.uint8).contiguous().to(torch.int64)
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).reshape(*b.shape[:-1], 2 * b.shape[-1])
    return _VALUES.to(torch.float32)[codes]


def fp4_logical_shape(data: torch.Tensor) -> torch.Size:
    """The element shape of packed FP4 bytes: the stored last dim doubled (the second-to-last for a transposed
    view), as torch_npu infers the GEMM's m and n ("real_m = !trans_x1 ? x1_size_last_second :
    x1_size_last_second * FP4_IN_INT8", QuantMatmulKernelNpuOpApi.cpp)."""
    shape = list(data.shape)
    transposed = data.dim() >= 2 and not data.is_contiguous() and data.transpose(-1, -2).is_contiguous()
    shape[-2 if transposed else -1] *= 2
    return torch.Size(shape)


def check_fp4_mx_args(out: Dtype, input: torch.Tensor, round_mode: Any, scale_alg: Any, dst_type_max: Any,
                      block_size: int) -> None:
    """The FP4 arguments of npu_dynamic_mx_quant / npu_dynamic_mx_quant_with_dual_axis (aclnnDynamicMxQuantV3,
    aclnnDynamicMxQuantWithDualAxisV2). Only what the library calls is simulated: E2M1, "rint", scale_alg 0."""
    if out == FLOAT4_E1M2FN_X2:
        raise NpuSimNotImplemented("dst_type=torch_npu.float4_e1m2fn_x2 is not simulated")
    # x: "目的类型为FLOAT4_E2M1、FLOAT4_E1M2时，x的最后一维必须是偶数。"
    if input.shape[-1] % 2:
        raise NpuValueError(f"FP4 output needs an even last dim of input, got shape {tuple(input.shape)}")
    # roundModeOptional: "当dstType为40/41时，支持{"rint", "floor", "round"}。"
    check_choice("round_mode", round_mode, ("rint", "floor", "round"), "for FP4 output")
    if round_mode != "rint":
        raise NpuSimNotImplemented(f"round_mode={round_mode!r} for FP4 output is not simulated (only 'rint')")
    # scaleAlg: "当dstType为FLOAT4_E2M1时仅支持取值为0和2。"
    check_choice("scale_alg", check_int("scale_alg", scale_alg), (0, 2), "for FP4_E2M1 output")
    if scale_alg == 2:
        # Scene 3 rounds the exponent up "如果尾数位的高比特前一/两位为1，且尾数不全为0": which bits count is not
        # stated, so it is not modelled.
        raise NpuSimNotImplemented("scale_alg=2 (FP4 scene 3) is not simulated")
    # dstTypeMax: "支持取值0.0和6.0-12.0 ... 仅支持在FP4E2M1和blocksize取32时设置该值"; its effect is described
    # for scaleAlg 2 only ("当dstTypeMax != 0.0/6.0/7.0时").
    value = 0.0 if dst_type_max is None else check_float("dst_type_max", dst_type_max)
    if value != 0.0 and not (6.0 <= value <= 12.0 and block_size == 32):
        raise NpuValueError(f"dst_type_max must be 0.0, or in [6.0, 12.0] with block_size 32; got {value}")
    if value != 0.0:
        raise NpuSimNotImplemented("dst_type_max with scale_alg 0 is not simulated (the documents give its effect "
                                   "for scale_alg 2 only)")
