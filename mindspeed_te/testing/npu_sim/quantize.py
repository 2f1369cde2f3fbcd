"""The quantize kernels: npu_quantize, npu_dynamic_quant, npu_dynamic_block_quant, npu_dynamic_mx_quant and
npu_dynamic_mx_quant_with_dual_axis."""
from __future__ import annotations

from typing import Any, Optional

import torch

from mindspeed_te.testing.npu_sim.blocks import block_amax, expand_blocks
from mindspeed_te.testing.npu_sim.checks import (
    ceil_div,
    check_axis,
    check_choice,
    check_dims,
    check_dtype,
    check_float,
    check_int,
    check_none,
    check_same_device,
    check_shape,
    check_tensor,
    dtype_arg,
    dtype_name,
    kernel,
)
from mindspeed_te.testing.npu_sim.codecs import encode, format_max
from mindspeed_te.testing.npu_sim.dtypes import (
    FLOAT4_E2M1FN_X2,
    FLOAT8_E4M3FN,
    FLOAT8_E5M2,
    FLOATS,
    FP4,
    FP8_NATIVE,
    HALF_FLOATS,
    HIFLOAT8,
    Dtype,
    DtypeArg,
)
from mindspeed_te.testing.npu_sim.errors import NpuSimNotImplemented, NpuTypeError, NpuValueError
from mindspeed_te.testing.npu_sim.fp4 import E2M1_EMAX, check_fp4_mx_args, fp4_encode_packed

HIF8_DST_MAX = (0.0, 15.0, 56.0, 224.0, 32768.0)  # HiF8 targets of npu_dynamic_block_quant (aclnnDynamicBlockQuantV2)
HIF8_DST_MAX_RANGE = (0.0, 32768.0)  # HiF8 target range of npu_dynamic_quant (aclnnDynamicQuantV4)
BLOCK_ROWS = (1, 128, 256, 512)
BLOCK_COLS = (64, 128, 192, 256)
MAX_EXPERTS = 1024


def decode_scale(amax: torch.Tensor, target: float) -> torch.Tensor:
    """amax / target in one IEEE division, at least 1/FLT_MAX; 1 for an all-zero group, NaN for a group
    holding NaN/Inf (so it decodes to NaN).

    The documents give only the formula -- aclnnDynamicQuantV4 "scaleOut=max_t(abs(x))/DTYPE_MAX,
    yOut=round(x/scaleOut)", aclnnDynamicBlockQuantV2 "scaleOut = min(input_max / (FP8_MAX/HiF8_MAX/DST_TYPE_MAX
    / INT8_MAX), 1/minScale)" -- and are silent on an all-zero group (the formula would give 0 and 0/0 = NaN
    codes) and on NaN/Inf input (neither aclnnDynamicQuantV4.md nor aclnnDynamicBlockQuantV2.md mentions NaN or
    Inf). So the choices below are NOT documented kernel behaviour: scale 1 for an all-zero group (its codes are
    0 either way, and a 0 scale would turn into Inf scale_inv downstream) and a NaN scale for a group holding
    NaN/Inf are the simulator's assumptions, taken from the library's convention (scaling.py:
    current_scale_inv, mark_nonfinite), and the lower bound 1/FLT_MAX keeps the division finite. Tests must not
    present them as the chip's behaviour."""
    finite = torch.nan_to_num(amax, nan=0.0, posinf=0.0)
    scale = torch.div(finite, torch.full_like(finite, target)).clamp(min=1.0 / torch.finfo(torch.float32).max)
    return torch.where(finite > 0, scale, torch.ones_like(scale)) + amax * 0.0


class QuantizeKernels:
    """Quantization kernels (mixed into NpuSimulator)."""

    @kernel
    def npu_quantize(self, input: torch.Tensor, /, scales: torch.Tensor, zero_points: Optional[torch.Tensor],
                     dtype: DtypeArg, axis: int = 1, div_mode: bool = True) -> torch.Tensor:
        """y = input / scales (div_mode), scales 1-D of size 1 or input.shape[axis], broadcast along `axis`.
        FP8 outputs are native float8 tensors (saturating cast, nearest-even); HiF8 codes come back as
        `torch.bits8` (view them as uint8), rounded half away from zero. aclnnQuantize gives only
        "out=round((x/scales)+zeroPoints)" and is silent on overflow: saturation is the simulator's assumption
        (the library's delayed scaling relies on it), not documented kernel behaviour."""
        # div_mode=True runs aclnnQuantize (op-plugin QuantizeKernelNpuOpApi.cpp, npu_quantize_by_kernel); the
        # quotes are from aclnnQuantize.md (it lists the Ascend 950 as supported). x: "FLOAT32、FLOAT16、BFLOAT16",
        # "1-8" dims.
        check_tensor("input", input, FLOATS)
        check_dims("input", input, 1, 8)
        check_tensor("scales", scales)
        # torch_npu: "Param (dtype) must be Int8, UInt8, Int32, HiFloat8, Float8_e4m3fn, Float8_e5m2"
        # (QUANTIZE_SUPPORT_MAP also takes qint8/quint8/qint32); quint4x2 is div_mode=False only. Its keys are
        # ScalarTypes plus HIFLOAT8: torch_npu's FP8 numbers 291/292, which other kernels take for the native
        # float8 dtypes, are not among them.
        if dtype in (FLOAT8_E5M2, FLOAT8_E4M3FN):
            raise NpuTypeError(f"dtype={dtype}: npu_quantize takes torch.float8_e5m2 / torch.float8_e4m3fn, not "
                               "torch_npu's FP8 numbers")
        out = dtype_arg("dtype", dtype, required=True)
        check_dtype("dtype", out, (*FP8_NATIVE, HIFLOAT8, torch.qint8, torch.quint8, torch.qint32,
                                    torch.int8, torch.uint8, torch.int32, torch.quint4x2))
        if out not in (*FP8_NATIVE, HIFLOAT8):
            raise NpuSimNotImplemented(f"dtype={dtype_name(out)}: only float8/HiF8 outputs are simulated")
        # aclnnQuantize: "Atlas A2 ... Atlas A3 ...: 入参`dtype`仅支持取值ACL_INT8、ACL_UINT8、ACL_INT32。"
        self._require_fp8_soc(f"dtype={dtype_name(out)}")
        # torch_npu docstring of npu_quantize: "div_mode为False时, 类型支持torch.qint8、torch.quint4x2."
        if div_mode is not True:
            raise NpuValueError("div_mode must be True for float8/HiF8 outputs (div_mode=False supports only "
                                "torch.qint8 and torch.quint4x2)")
        # axis: "支持范围为小于输入x的维度数且大于等于x维度数的负值。"
        dim = check_axis("axis", axis, input.dim())
        # scales: "FLOAT32、FLOAT16、BFLOAT16", 1 dim; "size需要为1或和输入x中axis轴的size相等。如果`x`的dtype不是
        # FLOAT32，scales的dtype需要和`x`的dtype一致。"
        scale_dtypes = FLOATS if input.dtype == torch.float32 else (input.dtype,)
        check_dtype("scales.dtype", scales.dtype, scale_dtypes)
        check_dims("scales", scales, 1, 1)
        check_shape("scales", scales, (1,), (input.shape[dim],))
        if zero_points is not None:
            raise NpuSimNotImplemented("zero_points with float8/HiF8 outputs are not simulated")
        check_same_device({"input": input, "scales": scales})
        view = [1] * input.dim()
        view[dim] = scales.numel()
        y = encode(input.float() / scales.float().reshape(view), out)
        return y.view(torch.bits8) if out == HIFLOAT8 else y

    @kernel
    def npu_dynamic_quant(self, input: torch.Tensor, /, *, smooth_scales: Optional[torch.Tensor] = None,
                          group_index: Optional[torch.Tensor] = None, dst_type: DtypeArg = None,
                          quant_mode: str = "pertoken", dst_type_max: float = 0.0
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """Symmetric dynamic quantization: scale = amax / dst_max, y = cast(x / scale); `scale` (float32) is
        what y is multiplied by to get x back. amax per row ("pertoken", scale shape input.shape[:-1]), per
        column ("perchannel", input.shape[:-2] + input.shape[-1:]) or of the whole tensor ("pertensor", (1,)).
        dst_max = dst_type_max, or the format's max when 0. The wheel is silent on an all-zero group; the
        simulator gives it scale 1 (and y 0) and keeps scales >= 1/FLT_MAX, see `decode_scale`."""
        # Quotes from aclnnDynamicQuantV4.md (Ascend 950PR/950DT only), which torch_npu calls for a non-zero
        # dst_type_max or a quant_mode other than "pertoken" (DynamicQuantKernelNpuOpApi.cpp).
        # x: "FLOAT16、BFLOAT16", "2-8" dims (torch_npu: "输入x的维度必须大于1").
        check_tensor("input", input, HALF_FLOATS)
        check_dims("input", input, 2, 8)
        out = dtype_arg("dst_type", dst_type) or torch.int8
        # dstType: "{2:INT8, 3:INT32, 29:INT4, 34:HIFLOAT8, 35:FLOAT8_E5M2, 36:FLOAT8_E4M3FN}"
        check_dtype("dst_type", out, (torch.int8, torch.quint4x2, *FP8_NATIVE, HIFLOAT8))
        if out not in (*FP8_NATIVE, HIFLOAT8):
            raise NpuSimNotImplemented(f"dst_type={dtype_name(out)}: only float8/HiF8 outputs are simulated")
        self._require_fp8_soc(f"dst_type={dtype_name(out)}")
        # quantMode: "当前支持"pertoken"、"pertensor"和"perchannel"。"
        check_choice("quant_mode", quant_mode, ("pertoken", "pertensor", "perchannel"))
        target = self._dynamic_quant_target(out, dst_type_max)
        x = input.float()
        if smooth_scales is not None:
            x = x * self._smooth_factor(input, smooth_scales, group_index, quant_mode)
        elif group_index is not None:
            # groupIndexOptional: "groupIndexOptional非nullptr时，smoothScalesOptional必须非nullptr。"
            raise NpuValueError("group_index needs smooth_scales")
        if quant_mode == "pertoken":
            amax = x.abs().amax(dim=-1, keepdim=True)
        elif quant_mode == "perchannel":
            amax = x.abs().amax(dim=-2, keepdim=True)
        else:
            amax = x.abs().amax().reshape([1] * x.dim())
        scale = decode_scale(amax, target)
        y = encode(x / scale, out)
        # scaleOut: "quantMode是pertoken时，shape为x的shape剔除最后一维。quantMode是pertensor时，shape为(1,)。
        # quantMode是perchannel时，shape为x的shape剔除倒数第二维。"
        shape = {"pertoken": input.shape[:-1], "perchannel": input.shape[:-2] + input.shape[-1:],
                 "pertensor": (1,)}[quant_mode]
        return y, scale.reshape(shape)

    @staticmethod
    def _dynamic_quant_target(out: Dtype, dst_type_max: Any) -> float:
        """npu_dynamic_quant's target max: dst_type_max, or the format's max when 0."""
        value = check_float("dst_type_max", dst_type_max)
        # aclnnDynamicQuantV4, dstTypeMax: "当前支持取值0 ~ 32768。仅在dstType为34（hifloat8）场景下生效。"
        if out == HIFLOAT8:
            lo, hi = HIF8_DST_MAX_RANGE
            if not lo <= value <= hi:
                raise NpuValueError(f"dst_type_max must be in [{lo}, {hi}] for HiF8 output, got {value}")
        elif value != 0.0:
            # The document says the value has no effect for FP8 outputs; the simulator refuses a non-zero one
            # (stricter than the document) because a caller passing it expects an effect it will not get.
            raise NpuValueError(f"dst_type_max must be 0 for {dtype_name(out)} output (it only applies to HiF8), "
                                f"got {value}")
        return value or format_max(out)

    @staticmethod
    def _dst_type_max(out: Dtype, dst_type_max: Any) -> float:
        """npu_dynamic_block_quant's target max: dst_type_max, or the format's max when 0."""
        value = check_float("dst_type_max", dst_type_max)
        # aclnnDynamicBlockQuantV2: "dstTypeMax: 当前只支持目标数据类型为HIFLOAT8，且可选取值为0.0，15.0，56.0，
        # 224.0，32768.0; 0.0表示使用数据类型原始的最大值。"
        if out == HIFLOAT8:
            check_choice("dst_type_max", value, HIF8_DST_MAX, "for HiF8 output")
        elif value != 0.0:
            raise NpuValueError(f"dst_type_max must be 0 for {dtype_name(out)} output, got {value}")
        return value or format_max(out)

    @staticmethod
    def _smooth_factor(x: torch.Tensor, smooth: torch.Tensor, group_index: Optional[torch.Tensor],
                       quant_mode: str) -> torch.Tensor:
        """smooth_scales broadcast over x's rows (a (G, n) table applied by group_index row ranges), or over
        its columns' rows in the perchannel mode."""
        # aclnnDynamicQuantV4, smoothScalesOptional dtype: "和x保持一致。"
        check_tensor("smooth_scales", smooth, (x.dtype,))
        n = x.shape[-1]
        if quant_mode == "perchannel":
            # "在perchannel场景下，shape大小是x的倒数第二维的大小。" and quantMode: "当quantMode取"pertensor"或
            # "perchannel"时，groupIndexOptional必须是nullptr。"
            check_none("group_index", group_index, f"with quant_mode {quant_mode!r}")
            check_shape("smooth_scales", smooth, (x.shape[-2],))
            return smooth.float().reshape(-1, 1)
        if group_index is None:
            # "在pertoken/pertensor场景下，当没有groupIndexOptional时，shape维度是x的最后一维。"
            check_shape("smooth_scales", smooth, (n,))
            return smooth.float()
        if quant_mode == "pertensor":
            check_none("group_index", group_index, f"with quant_mode {quant_mode!r}")
        # groupIndexOptional: "INT32", "shape只支持一维，且维度大小等于smoothScalesOptional的第一维。"
        check_tensor("group_index", group_index, (torch.int32,))
        # "当有groupIndexOptional时，shape是两维，第一维的大小对应专家数，其值不能超过1024，第二维的大小等于x的
        # 最后一维的大小。"
        check_dims("smooth_scales", smooth, 2, 2)
        check_shape("smooth_scales", smooth, (smooth.shape[0], n))
        if smooth.shape[0] > MAX_EXPERTS:
            raise NpuValueError(f"smooth_scales may hold at most {MAX_EXPERTS} experts, got {smooth.shape[0]}")
        check_shape("group_index", group_index, (smooth.shape[0],))
        rows = x.numel() // n
        # aclnnDynamicQuantV4 约束说明: "当有groupIndexOptional时，专家数不超过x剔除最后一维的各个维度乘积。"
        if smooth.shape[0] > rows:
            raise NpuValueError(f"smooth_scales holds {smooth.shape[0]} experts, more than the {rows} rows of x")
        ends = group_index.tolist()
        # 约束说明: "groupIndexOptional的值需要是一组不小于零且非递减的数组，且最后一个值和x剔除最后一维的各个维度乘积
        # 相等。若不满足该条件，结果无实际意义。" (the kernel computes garbage; the simulator refuses)
        if any(b < a for a, b in zip([0] + ends, ends)) or ends[-1] != rows:
            raise NpuValueError(f"group_index must be non-decreasing and end at the row count {rows}, got {ends}")
        counts = torch.tensor([b - a for a, b in zip([0] + ends, ends)])
        table = smooth.float().repeat_interleave(counts, dim=0)
        return table.reshape(x.shape)

    @kernel
    def npu_dynamic_block_quant(self, x: torch.Tensor, /, *, min_scale: float = 0.0, round_mode: str = "rint",
                                dst_type: DtypeArg = 1, row_block_size: int = 1, col_block_size: int = 128,
                                dst_type_max: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-tile quantization over the last two dims (x 2-D or 3-D, tiles row_block_size x col_block_size,
        edge tiles partial), the Ascend 950 form (aclnnDynamicBlockQuantV2): scale = amax / dst_max, capped at
        1 / min_scale when min_scale > 0, y = cast(x / scale) (float32 scale of shape (..., ceil(rows /
        row_block_size), ceil(cols / col_block_size)), x = y * scale). All-zero tiles as in `decode_scale`. No
        option yields power-of-2 scales."""
        # "x: FLOAT16、BFLOAT16、FLOAT32 ... 2-3" (aclnnDynamicBlockQuantV2, parameter table); x, yOut and scaleOut:
        # "不支持空Tensor"
        check_tensor("x", x, FLOATS)
        check_dims("x", x, 2, 3)
        if x.numel() == 0:
            raise NpuValueError(f"x must not be empty (shape {tuple(x.shape)})")
        out = dtype_arg("dst_type", dst_type, required=True)
        if not self.supports_fp8:
            raise NpuSimNotImplemented(f"only the Ascend 950 form (float8/HiF8 output) is simulated, "
                                       f"the chip is {self.soc_name}")
        # "dstType ... 支持取值2、34、35、36，分别代表INT8、HIFLOAT8、FLOAT8_E5M2、FLOAT8_E4M3FN" (INT8 not simulated)
        check_dtype("dst_type", out, (*FP8_NATIVE, HIFLOAT8))
        # "当输出yOut的数据类型是HIFLOAT8时，参数roundModeOptional支持设置为round。当输出yOut的数据类型是INT8、
        # FLOAT8_E4M3FN、FLOAT8_E5M2时，参数roundModeOptional支持设置为rint。"
        need = "round" if out == HIFLOAT8 else "rint"
        if round_mode != need:
            raise NpuValueError(f"round_mode must be {need!r} for {dtype_name(out)} output, got {round_mode!r}")
        # "rowBlockSize ... 支持取值1，128，256，512。" / "colBlockSize ... 支持取值64，128，192，256。"
        check_choice("row_block_size", check_int("row_block_size", row_block_size), BLOCK_ROWS)
        check_choice("col_block_size", check_int("col_block_size", col_block_size), BLOCK_COLS)
        # "minScale ... 取值不小于0。"
        floor = check_float("min_scale", min_scale)
        if floor < 0:
            raise NpuValueError(f"min_scale must be >= 0, got {floor}")
        target = self._dst_type_max(out, dst_type_max)
        xf = x.float()
        scale = decode_scale(block_amax(xf, row_block_size, col_block_size), target)
        if floor > 0:
            # "scaleOut = min(input_max / (FP8_MAX/HiF8_MAX/DST_TYPE_MAX / INT8_MAX), 1/minScale)"
            scale = torch.clamp(scale, max=1.0 / floor)
        scale_full = expand_blocks(scale, row_block_size, col_block_size, x.shape[-2], x.shape[-1])
        return encode(xf / scale_full, out), scale

    @kernel
    def npu_dynamic_mx_quant(self, input: torch.Tensor, /, *, axis: int = -1, round_mode: str = "rint",
                             dst_type: DtypeArg = FLOAT4_E2M1FN_X2, block_size: int = 32, scale_alg: int = 0,
                             dst_type_max: float = 0.0, max_low_bound: float = 0.0
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """MX quantization along `axis`: one E8M0 scale per block_size elements, y = cast(x / 2^e) (saturating,
        nearest-even; FP4 E2M1 packed two per byte along the last dim, see fp4.py). scale_alg 0 (OCP): e =
        floor(log2(amax)) - emax (8 for E4M3, 15 for E5M2, 2 for E2M1); scale_alg 1 (FP8 only):
        e = ceil(log2(max(amax, max_low_bound) / fmt_max)). Scale bytes b = e + 127 in [0, 254] (0xFF for a
        non-finite amax), returned as uint8 with `axis` replaced by ceil(blocks / 2) and a trailing dim of 2
        holding blocks (2i, 2i + 1): (m, ceil(k/64), 2) for axis=-1 of (m, k), (ceil(k/64), n, 2) for axis=0.
        The documents give "cast_to_dst_type(V_i/mxscale, round_mode)" and say nothing of overflow (scale_alg 0's
        floor rule can put a block's largest element above the format's max): saturation is the simulator's
        assumption (the OCP MX specification's choice), as in `_mx_scale_bytes`."""
        # torch_npu runs aclnnDynamicMxQuantV3 (V2/V1 on older CANN; DynamicMxQuantKernelNpuOpApi.cpp); quotes from
        # aclnnDynamicMxQuantV3.md / aclnnDynamicMxQuant.md, which list only the Ascend 950PR/950DT as supported.
        self._require_fp8_soc("npu_dynamic_mx_quant")
        # x: "FLOAT16、BFLOAT16、FLOAT", "1-7" dims.
        check_tensor("input", input, FLOATS)
        check_dims("input", input, 1, 7)
        # axis: "取值范围为[-D, D-1]，D为x的shape的维数。"
        dim = check_axis("axis", axis, input.dim())
        out = dtype_arg("dst_type", dst_type, required=True)
        # dstType: "{35:FLOAT8_E5M2, 36:FLOAT8_E4M3FN, 40:FLOAT4_E2M1, 41:FLOAT4_E1M2}"
        check_dtype("dst_type", out, (*FP8_NATIVE, *FP4))
        # blocksize: "仅支持32的倍数，不能为0，且不能超过1024。"
        check_int("block_size", block_size)
        if not (0 < block_size <= 1024 and block_size % 32 == 0):
            raise NpuValueError(f"block_size must be a multiple of 32 in [32, 1024], got {block_size}")
        if out in FP4:
            check_fp4_mx_args(out, input, round_mode, scale_alg, dst_type_max, block_size)
        else:
            # roundModeOptional: "当dstType为36/35时，仅支持{"rint"}。"
            if round_mode != "rint":
                raise NpuValueError(f"round_mode must be 'rint' for FP8 output, got {round_mode!r}")
            # scaleAlg (V3): 0 or 1 for FP8 ("场景2，当scaleAlg为1时，只涉及FP8类型"; "场景3，当scaleAlg为2时，只涉及
            # FP4_E2M1类型").
            check_choice("scale_alg", check_int("scale_alg", scale_alg), (0, 1), "for FP8 output")
            # dstTypeMax: "支持取值0.0和6.0-12.0 ... 仅支持在FP4E2M1和blocksize取32时设置该值"
            if check_float("dst_type_max", dst_type_max) != 0.0:
                raise NpuValueError(f"dst_type_max must be 0 for FP8 output, got {dst_type_max}")
        # maxLowBound: "仅当scaleAlg=1时生效，scaleAlg不为1时必须为0.0。取值为非负数。"
        bound = check_float("max_low_bound", max_low_bound)
        if bound < 0 or (scale_alg != 1 and bound != 0.0):
            raise NpuValueError(f"max_low_bound must be >= 0, and 0 unless scale_alg is 1; got {bound}")
        # x: "x的类型为FLOAT时，仅支持blocksize=32，且量化轴的维度不能小于32。"
        if input.dtype == torch.float32 and (block_size != 32 or input.shape[dim] < 32):
            raise NpuValueError("float32 input needs block_size 32 and at least 32 elements along axis")
        return self._mx_quantize(input, dim, out, block_size, scale_alg, bound)

    @kernel
    def npu_dynamic_mx_quant_with_dual_axis(self, input: torch.Tensor, /, *, round_mode: str = "rint",
                                            dst_type: DtypeArg = FLOAT4_E2M1FN_X2, scale_alg: int = 0,
                                            dst_type_max: Optional[float] = 0.0
                                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """MX quantization along the last and the second-to-last axis at once (blocks of 32, rules as
        npu_dynamic_mx_quant): (y1, mxscale1, y2, mxscale2) with y1/mxscale1 as axis=-1 and y2/mxscale2 as
        axis=-2 would give; mxscale2 is (..., ceil(M/64), N, 2), block pairs (2i, 2i + 1) interleaved."""
        # aclnnDynamicMxQuantWithDualAxis.md, 产品支持情况: "Ascend 950PR/Ascend 950DT：支持", A2/A3 "不支持";
        # op-plugin's binding has no SoC check and its test runs on both (@SupportedDevices(['Ascend950'])).
        # (torch_npu 2.14's page said "该接口仅在Ascend 950DT上支持"; the kernel's own document lists both.)
        self._require_fp8_soc("npu_dynamic_mx_quant_with_dual_axis")
        # "input: ... 维度支持2-7维, ... 数据类型支持float16、bfloat16."
        check_tensor("input", input, HALF_FLOATS)
        check_dims("input", input, 2, 7)
        # "dst_type: ... 支持取值23(torch.float8_e5m2)、24(torch.float8_e4m3fn)、296(...)、297(...)."
        out = dtype_arg("dst_type", dst_type, required=True)
        check_dtype("dst_type", out, (*FP8_NATIVE, *FP4))
        if out in FP4:
            # aclnnDynamicMxQuantWithDualAxisV2 gives FP4 the rules of aclnnDynamicMxQuantV3 (x "最后一维必须是偶数",
            # roundMode {"rint", "floor", "round"}, scaleAlg "仅支持取值为0和2", dstTypeMax 0.0 or 6.0-12.0).
            check_fp4_mx_args(out, input, round_mode, scale_alg, dst_type_max, 32)
        else:
            # "float8_e5m2/float8_e4m3fn支持scale_alg为0、1, round_mode仅支持"rint", 不支持设置dst_type_max"
            if round_mode != "rint":
                raise NpuValueError(f"round_mode must be 'rint' for FP8 output, got {round_mode!r}")
            check_choice("scale_alg", check_int("scale_alg", scale_alg), (0, 1), "for FP8 output")
            if dst_type_max is not None and check_float("dst_type_max", dst_type_max) != 0.0:
                raise NpuValueError(f"dst_type_max cannot be set for FP8 output (must be 0.0), got {dst_type_max}")
        y1, s1 = self._mx_quantize(input, input.dim() - 1, out, 32, scale_alg, 0.0)
        y2, s2 = self._mx_quantize(input, input.dim() - 2, out, 32, scale_alg, 0.0)
        return y1, s1, y2, s2

    def _mx_quantize(self, input: torch.Tensor, dim: int, out: Dtype, block_size: int, scale_alg: int,
                     bound: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(y, E8M0 scale pairs) of MX quantization along `dim` (arguments already checked)."""
        x = input.float().movedim(dim, -1)
        n = x.shape[-1]
        blocks = ceil_div(n, block_size)
        padded = torch.nn.functional.pad(x, (0, blocks * block_size - n))
        amax = padded.abs().reshape(*x.shape[:-1], blocks, block_size).amax(dim=-1)
        code = self._mx_scale_bytes(amax.clamp(min=bound) if scale_alg == 1 else amax, out, scale_alg)
        inv = torch.exp2(127.0 - code.double()).repeat_interleave(block_size, dim=-1)[..., :n]
        y = x.double() * inv  # x * 2^-e is exact in float64: one rounding, at the encode
        # FP4 bytes pack along the stored last dim, whatever the axis ("y_shape[input.dim() - 1] = last_dim_val /
        # FP4_IN_UINT8_NUM", DynamicMxQuantKernelNpuOpApi.cpp)
        y = fp4_encode_packed(y.movedim(-1, dim)) if out in FP4 else encode(y, out).movedim(-1, dim)
        # mxscaleOut: "shape在axis轴上为x对应轴的值除以blocksize向上取整，并对其进行偶数pad，pad填充值为0。当axis
        # 为非尾轴时，mxscaleOut输出需要对每两行数据进行交织处理。"
        code = torch.nn.functional.pad(code, (0, blocks % 2))  # pairs of blocks; the odd one out pads with 0
        pairs = code.to(torch.uint8).reshape(*code.shape[:-1], code.shape[-1] // 2, 2).movedim(-2, dim)
        return y.contiguous(), pairs.contiguous()

    @staticmethod
    def _mx_scale_bytes(amax: torch.Tensor, out: Dtype, scale_alg: int) -> torch.Tensor:
        """E8M0 byte per block (int64): OCP floor rule (0) or round-up rule (1), clamped to [0, 254].

        aclnnDynamicMxQuant: scaleAlg 0 "shared_exp = floor(log_2(max_i(|V_i|))) - emax"; scaleAlg 1
        "S = Amax(D)/Amax(DType)" with the exponent rounded up. The documents are silent on an all-zero block
        (log2(0)), on exponents outside E8M0's range and on NaN/Inf input: byte 0 (2^-127) for a zero block, the
        clamp to [0, 254] and 0xFF (E8M0's NaN) for a non-finite amax are the simulator's assumptions (the OCP MX
        specification's choices), not documented kernel behaviour."""
        a = amax.double()
        if scale_alg == 0:
            # emax: "FLOAT4_E2M1 | 2", "FLOAT8_E4M3FN | 8", "FLOAT8_E5M2 | 15"
            emax = E2M1_EMAX if out in FP4 else 8 if out == torch.float8_e4m3fn else 15
            exp = torch.frexp(a).exponent.to(torch.int64) - 1 - emax  # floor(log2(a)) for a > 0
        else:
            fmt_max = format_max(out)
            k = torch.ceil(torch.log2(a / fmt_max)).nan_to_num(0.0, posinf=0.0, neginf=-127.0).to(torch.int64)
            k = torch.where(fmt_max * torch.exp2((k - 1).double()) >= a, k - 1, k)  # exact fix-ups of log2
            exp = torch.where(fmt_max * torch.exp2(k.double()) < a, k + 1, k)
        code = torch.where(a > 0, exp + 127, torch.zeros_like(exp)).clamp(0, 254)
        return torch.where(torch.isfinite(a), code, torch.full_like(code, 0xFF))

    # GEMMs -----------------------------------------------------------------------------------------------
