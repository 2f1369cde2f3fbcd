"""npu_quant_matmul: per-tensor/per-channel, blockwise ([1, 128, 128] / [128, 128, 128]) and MX ([1, 1, 32])
FP8 and HiF8 GEMMs."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from mindspeed_te.testing.npu_sim.blocks import expand_blocks
from mindspeed_te.testing.npu_sim.checks import (
    ceil_div,
    check_dims,
    check_dtype,
    check_int,
    check_layout,
    check_none,
    check_same_device,
    check_scale_layout,
    check_shape,
    check_tensor,
    dtype_arg,
    dtype_name,
    kernel,
)
from mindspeed_te.testing.npu_sim.codecs import decode, e8m0_values
from mindspeed_te.testing.npu_sim.cube import cube_matmul, cube_matmul_rounded
from mindspeed_te.testing.npu_sim.dtypes import (
    E8M0_CARRIERS,
    FLOAT4_E2M1FN_X2,
    FLOAT8_E8M0FNU,
    FP4,
    FP8_NATIVE,
    GEMM_OUT,
    HIF8_CARRIERS,
    HIFLOAT8,
    Dtype,
    DtypeArg,
)
from mindspeed_te.testing.npu_sim.errors import NpuSimNotImplemented, NpuTypeError, NpuValueError
from mindspeed_te.testing.npu_sim.fp4 import fp4_decode_packed, fp4_logical_shape


class QuantMatmulKernels:
    """npu_quant_matmul (mixed into NpuSimulator)."""

    @kernel
    def npu_quant_matmul(self, x1: torch.Tensor, x2: torch.Tensor, scale: torch.Tensor, *,
                         offset: Optional[torch.Tensor] = None, pertoken_scale: Optional[torch.Tensor] = None,
                         bias: Optional[torch.Tensor] = None, output_dtype: DtypeArg = None,
                         x1_dtype: DtypeArg = None, x2_dtype: DtypeArg = None, pertoken_scale_dtype: DtypeArg = None,
                         scale_dtype: DtypeArg = None, group_sizes: Optional[Sequence[int]] = None,
                         y_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """out = x1 @ x2 with x1 (..., m, k) and x2 (..., k, n) (x2 contiguous or the transposed view of a
        contiguous (..., n, k)); `scale` dequantizes x2, `pertoken_scale` x1 (multipliers: x = data * scale):

        * group_sizes None / [0, 0, 0]: scale float32 (1,) or (n,); pertoken_scale None, (1,) or (m,);
          out = (x1 @ x2) * scale * pertoken_scale.
        * [1, 128, 128] / [128, 128, 128] (blockwise, 2-D only): pertoken_scale (ceil(m/g0), ceil(k/128)) and
          scale (ceil(k/128), ceil(n/128)), float32.
        * [1, 1, 32] (MX, 2-D only): scale_dtype = pertoken_scale_dtype = torch_npu.float8_e8m0fnu, uint8
          pertoken_scale (m, ceil(k/64), 2) and scale (ceil(k/64), n, 2).
        In the grouped modes a scale tensor is a transposed view exactly when its data tensor is.
        HiF8 operands are uint8 with x1_dtype = x2_dtype = torch_npu.hifloat8; output_dtype (float16, bfloat16
        or float32) is required; bias float32 (n,), (1, n) for a 2-D or (batch, 1, n) for a 3-D output, added after
        dequantization (MX and the per-tensor/channel/token modes only)."""
        check_tensor("x1", x1)
        check_tensor("x2", x2)
        check_tensor("scale", scale)
        check_same_device({"x1": x1, "x2": x2, "scale": scale, "pertoken_scale": pertoken_scale, "bias": bias})
        fmt1 = self._operand_dtype("x1", x1, x1_dtype, "x1_dtype")
        fmt2 = self._operand_dtype("x2", x2, x2_dtype, "x2_dtype")
        # aclnnQuantMatmulV5, Ascend 950 tables: rows pair "FLOAT8_E4M3FN/FLOAT8_E5M2" with
        # "FLOAT8_E4M3FN/FLOAT8_E5M2", and "HIFLOAT8" with "HIFLOAT8" (no HiF8 x FP8 row).
        if (fmt1 == HIFLOAT8) != (fmt2 == HIFLOAT8):
            raise NpuTypeError(f"x1 ({dtype_name(fmt1)}) and x2 ({dtype_name(fmt2)}) must both be HiF8 or "
                               "both be float8_e4m3fn/float8_e5m2")
        # MX table, FP4 rows: "MX全量化| FLOAT4_E2M1 | FLOAT4_E2M1" and "MX伪量化| FLOAT8_E4M3FN | FLOAT4_E2M1":
        # an FP4 x1 pairs with an FP4 x2 only, an FP4 x2 with an FP4 or E4M3 x1.
        pseudo = fmt1 == torch.float8_e4m3fn and fmt2 in FP4
        if (fmt1 in FP4 or fmt2 in FP4) and not (pseudo or (fmt1 in FP4 and fmt2 in FP4)):
            raise NpuTypeError(f"x1 ({dtype_name(fmt1)}) x x2 ({dtype_name(fmt2)}): FP4 GEMMs pair FP4 x FP4 or "
                               "float8_e4m3fn x FP4")
        out_dtype = dtype_arg("output_dtype", output_dtype)
        # Same tables, out column of the FP8/HiF8 rows: "FLOAT16/BFLOAT16/FLOAT32". torch_npu's output_dtype None
        # means int8 output (torch_npu doc: "默认值为`None`，代表输出Tensor数据类型为`int8`。").
        if out_dtype is None:
            raise NpuTypeError("output_dtype is required for float8/HiF8 inputs (None means int8 output)")
        check_dtype("output_dtype", out_dtype, GEMM_OUT)
        # aclnnQuantMatmulV5, Ascend 950, 公共约束: "x2Offset仅当x1，x2数据类型为INT8，且out数据类型为INT8时支持，
        # 其他输入类型需要传入nullptr。" (the x2 offset exists for int8 only)
        check_none("offset", offset, "for float8/HiF8 inputs (offset is for int8 inputs only)")
        # "yScale仅当x1为FLOAT8_E4M3FN，x2为FLOAT4_E2M1时支持，其他场景暂不支持。" (y_scale: FP8 x FP4 only)
        check_none("y_scale", y_scale, "unless x1 is float8_e4m3fn and x2 FP4 (the only y_scale mode)")
        # x1 / x2 parameter table: "2-6" dims (ND).
        check_dims("x1", x1, 2, 6)
        check_dims("x2", x2, 2, 6)
        shape1, shape2 = (fp4_logical_shape(t) if f in FP4 else t.shape for t, f in ((x1, fmt1), (x2, fmt2)))
        m, k = shape1[-2:]
        # "transposeX2为false时x2的shape：(batch, k, n)。... k与x1的shape中的k一致。" (same k)
        if shape2[-2] != k:
            raise NpuValueError(f"k of x1 {tuple(x1.shape)} and x2 {tuple(x2.shape)} differ")
        n = shape2[-1]
        # torch_npu, npu_quant_matmul 约束说明: "当x1的数据类型为float8_e4m3fn, x2_dtype为torch_npu.float4_e2m1或
        # torch_npu.float4_e1m2的情况下, ... 其他情况, x1与x2最后一维的shape大小不能超过65535." (the shapes as
        # passed: x1's k, and x2's n for a (k, n) x2 or its transposed view)
        if pseudo and (k % 64 or k > 65535 or n > 65535):
            # "x1、x2的k值必须是64的倍数并且大小不能超过65535, x2的n值大小不能超过65535."
            raise NpuValueError(f"float8_e4m3fn x FP4 needs k a multiple of 64 and k, n at most 65535; got k={k}, "
                                f"n={n}")
        if x1.shape[-1] > 65535 or x2.shape[-1] > 65535:
            raise NpuValueError(f"the last dims of x1 {tuple(x1.shape)} and x2 {tuple(x2.shape)} may not exceed 65535")
        # x1, x2, x1Scale, x2Scale: "不支持空Tensor", except on the Ascend 950: "x2为ND格式时，当输入参数x1为m=0的空
        # tensor或x2为n=0的空tensor时，输出为空tensor" -- an empty k or batch is refused.
        if k == 0 or 0 in x1.shape[:-2] or 0 in x2.shape[:-2]:
            raise NpuValueError(f"x1 {tuple(x1.shape)} and x2 {tuple(x2.shape)} may be empty only in m or n")
        # x1: "仅最后m和k轴转置情况下支持非连续的Tensor"; x2: "ND格式下支持最后两根轴转置情况下的非连续tensor，其他场景
        # 的非连续的Tensor不支持。" (contiguous, or the transposed view over the last two dims)
        lay1 = check_layout("x1", x1)
        lay2 = check_layout("x2", x2)
        groups = self._group_sizes(group_sizes)
        sdt = dtype_arg("scale_dtype", scale_dtype)
        pdt = dtype_arg("pertoken_scale_dtype", pertoken_scale_dtype)
        for name, d in (("scale_dtype", sdt), ("pertoken_scale_dtype", pdt)):
            if d is not None:
                check_dtype(name, d, (FLOAT8_E8M0FNU,))
        if groups == (1, 1, 32):
            # MX全量化 table: x1/x2 "FLOAT8_E4M3FN/FLOAT8_E5M2" (or FLOAT4_E2M1) -- no HIFLOAT8 row.
            if fmt1 == HIFLOAT8:
                raise NpuTypeError("MX (group_sizes [1, 1, 32]) needs float8_e4m3fn/float8_e5m2 operands, not HiF8")
            # MX table: x1Scale / x2Scale "FLOAT8_E8M0".
            if sdt is None or pdt is None:
                raise NpuTypeError("MX (group_sizes [1, 1, 32]) needs scale_dtype and pertoken_scale_dtype "
                                   "= torch_npu.float8_e8m0fnu")
        elif sdt is not None or pdt is not None:
            # FLOAT8_E8M0 scales appear in the MX table only (the other modes' x1Scale/x2Scale are FLOAT32).
            raise NpuValueError("scale_dtype/pertoken_scale_dtype (E8M0) need group_sizes [1, 1, 32]")
        if fmt2 in FP4:
            self._check_fp4_mode(groups, pseudo, k, lay1, lay2, out_dtype, bias, n)
        if groups == (0, 0, 0):
            a, b = decode(x1, fmt1), decode(x2, fmt2)
            # 公共约束: "out的shape支持2~6维，(batch, m, n)，batch可不存在，支持x1与x2的batch维度broadcast".
            try:
                batch = torch.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
            except RuntimeError:
                raise NpuValueError(f"batch dims of x1 {tuple(x1.shape)} and x2 {tuple(x2.shape)} do not "
                                    "broadcast") from None
            self._validate_plain_scales(scale, pertoken_scale, out_dtype, m, n)
            if pertoken_scale is None:
                # torch_npu (QuantMatmulKernelNpuOpApi.cpp) hands a float32 scale without pertoken_scale to
                # npu_trans_quant_param first, and aclnnTransQuantParamV2 keeps its top 19 bits: "scale按bit位取
                # 高19位截断".
                scale = (scale.view(torch.int32) & -0x2000).view(torch.float32)
            acc = cube_matmul(a, b) * scale.float()
            if pertoken_scale is not None:
                acc = acc * pertoken_scale.float().reshape(-1, 1)
        else:
            # The documents allow a batch in the grouped modes; the simulator models 2-D operands only there.
            if x1.dim() != 2 or x2.dim() != 2:
                raise NpuSimNotImplemented(f"group_sizes {list(groups)} with batched operands is not simulated")
            batch = torch.Size()
            # G-B/B-B and MX tables: x1Scale is FLOAT32 / FLOAT8_E8M0, never null.
            if pertoken_scale is None:
                raise NpuValueError(f"pertoken_scale is required with group_sizes {list(groups)}")
            # aclnnQuantMatmulV5, Ascend 950PR/950DT, "G-B && B-B && mx量化模式": "仅mx量化模式下包含bias。"
            if bias is not None and groups != (1, 1, 32):
                raise NpuValueError(f"bias must be None with group_sizes {list(groups)} (blockwise G-B/B-B modes "
                                    "take no bias; of the grouped modes only mx, [1, 1, 32], has one)")
            if groups == (1, 1, 32):
                a, b = self._mx_operands(x1, x2, fmt1, fmt2, scale, pertoken_scale, lay1, lay2)
            else:
                a, b = self._block_operands(x1, x2, fmt1, fmt2, scale, pertoken_scale, lay1, lay2, groups)
            if bias is None:  # the scales are inside the operands: the sum, rounded once, is the output
                return cube_matmul_rounded(a, b, out_dtype)
            if pseudo:  # its bias is in the output's dtype (checked above), added to the float32 sum
                return (cube_matmul(a, b) + bias.float().reshape(1, n)).to(out_dtype)
            acc = cube_matmul(a, b)
        if bias is not None:
            acc = acc + self._quant_matmul_bias(bias, batch, n).float()
        return acc.to(out_dtype)

    def _operand_dtype(self, name: str, t: torch.Tensor, value: DtypeArg, arg_name: str) -> Dtype:
        """The 8-bit format of a GEMM operand: its native float8 dtype, or HiF8 named by `arg_name`."""
        given = dtype_arg(arg_name, value)
        # The carrier rule (HiF8 codes in uint8 named by x1_dtype/x2_dtype) is torch_npu 2.14's binding: its meta
        # registration takes the 8-bit format from the dtype argument when the tensor dtype cannot say it.
        if given is None:
            if t.dtype in FP8_NATIVE:
                self._require_fp8_soc(f"{name} of dtype {t.dtype}")
                return t.dtype
            if t.dtype in HIF8_CARRIERS:
                raise NpuTypeError(f"{name} holds 1-byte codes ({t.dtype}); pass {arg_name}=torch_npu.hifloat8")
            if t.dtype in (torch.int8, torch.int32):
                raise NpuSimNotImplemented(f"{name} of dtype {t.dtype}: integer GEMMs are not simulated")
            raise NpuTypeError(f"{name}.dtype must be float8_e4m3fn, float8_e5m2, or uint8 with {arg_name}, "
                               f"got {t.dtype}")
        if given not in (HIFLOAT8, *FP4):
            raise NpuTypeError(f"pass {arg_name} only when {name} is not a native torch dtype "
                               f"(torch_npu.hifloat8, torch_npu.float4_*); got {dtype_name(given)}")
        if given in FP4:
            if given != FLOAT4_E2M1FN_X2:
                raise NpuSimNotImplemented(f"{arg_name}={dtype_name(given)} is not simulated")
            # torch_npu's FP4 bytes: uint8, two codes per byte ("FP4_IN_UINT8_NUM", the quantize kernels' output).
            check_dtype(f"{name}.dtype", t.dtype, (torch.uint8,))
            self._require_fp8_soc(f"{arg_name}=torch_npu.float4_e2m1fn_x2")
            return given
        if t.dtype not in HIF8_CARRIERS:
            raise NpuTypeError(f"{name} must hold HiF8 codes as torch.uint8 when {arg_name} is "
                               f"torch_npu.hifloat8, got {t.dtype}")
        self._require_fp8_soc(f"{arg_name}=torch_npu.hifloat8")
        return HIFLOAT8

    @staticmethod
    def _group_sizes(group_sizes: Optional[Sequence[int]]) -> tuple[int, int, int]:
        if group_sizes is None:
            return (0, 0, 0)
        if not isinstance(group_sizes, (list, tuple)) or len(group_sizes) != 3:
            raise NpuValueError(f"group_sizes must be a list of 3 ints, got {group_sizes!r}")
        groups = tuple(check_int("group_sizes", g) for g in group_sizes)
        # aclnnQuantMatmulV5: "对于G-B，B-B和mx量化模式，[groupSizeM，groupSizeN，groupSizeK]取值组合仅分别支持
        # [1，128，128]，[128，128，128]和[1，1，32]。"
        allowed = [(0, 0, 0), (1, 128, 128), (128, 128, 128), (1, 1, 32)]
        if groups not in allowed:
            raise NpuValueError(f"group_sizes must be one of {[list(a) for a in allowed]}, got {list(groups)}")
        return groups

    @staticmethod
    def _validate_plain_scales(scale: torch.Tensor, pertoken: Optional[torch.Tensor], out_dtype: Dtype,
                            m: int, n: int) -> None:
        """Per-tensor / per-channel scale of x2, per-tensor / per-token scale of x1 (T-T, T-C, K-T, K-C)."""
        # aclnnQuantMatmulV5, Ascend 950, T-C/T-T and K-C/K-T tables, FLOAT8_E4M3FN/FLOAT8_E5M2 and HIFLOAT8 rows:
        # x1Scale "null" or "FLOAT32", x2Scale "FLOAT32" (UINT64/INT64 is the static form, not simulated);
        # BFLOAT16 scales appear in the INT8 rows only. out "FLOAT16/BFLOAT16/FLOAT32" whatever the scale.
        if scale.dtype in (torch.int64,):
            raise NpuSimNotImplemented("int64 (static, aclnnTransQuantParamV2) scales are not simulated")
        check_dtype("scale.dtype", scale.dtype, (torch.float32,))
        # "T-T量化场景下，x1Scale的shape为(1,)或nullptr，x2Scale的shape为(1,)。" / "T-C量化场景下，... x2Scale的shape为
        # (n,)"; "K-C量化场景下，x1Scale的shape为(m,)，x2Scale的shape为(n,)" / "K-T量化场景下，x1Scale的shape为(m,)，
        # x2Scale的shape为(1,)".
        check_dims("scale", scale, 1, 1)
        check_shape("scale", scale, (1,), (n,))
        if pertoken is not None:
            check_dtype("pertoken_scale.dtype", pertoken.dtype, (torch.float32,))
            check_dims("pertoken_scale", pertoken, 1, 1)
            check_shape("pertoken_scale", pertoken, (1,), (m,))

    @staticmethod
    def _block_operands(x1, x2, fmt1, fmt2, scale, pertoken, lay1, lay2, groups):
        """Dequantized (m, k), (k, n) operands of the blockwise modes."""
        gm, gn, gk = groups
        (m, k), n = x1.shape, x2.shape[1]
        # aclnnQuantMatmulV5, Ascend 950, G-B/B-B table (FP8 and HiF8 rows): x1Scale "FLOAT32", x2Scale "FLOAT32".
        check_dtype("pertoken_scale.dtype", pertoken.dtype, (torch.float32,))
        check_dtype("scale.dtype", scale.dtype, (torch.float32,))
        # B-B: x1Scale "(batch, ceil(m / 128), ceil(k / 128))"; G-B: x1Scale "(batch, m, ceil(k / 128))"; both:
        # x2Scale "(batch, ceil(k / 128), ceil(n / 128))" (the transposed forms are the .t() views, checked below).
        check_shape("pertoken_scale", pertoken, (ceil_div(m, gm), ceil_div(k, gk)))
        check_shape("scale", scale, (ceil_div(k, gk), ceil_div(n, gn)))
        # "G-B量化和B-B量化场景下，x1和x1Scale的转置属性需要保持一致，x2和x2Scale的转置属性需要保持一致(当shape轴里
        # 有1，...，x和scale的转置属性可以不一致)。"
        check_scale_layout("pertoken_scale", pertoken, lay1)
        check_scale_layout("scale", scale, lay2)
        a = decode(x1, fmt1) * expand_blocks(pertoken.float(), gm, gk, m, k)
        b = decode(x2, fmt2) * expand_blocks(scale.float(), gk, gn, k, n)
        return a, b

    @staticmethod
    def _mx_operands(x1, x2, fmt1, fmt2, scale, pertoken, lay1, lay2):
        """Dequantized (m, k), (k, n) operands of the MX mode (E8M0 scale pairs along k)."""
        (m, k), n = (fp4_logical_shape(x1) if fmt1 in FP4 else x1.shape), x2.shape[1]
        n = fp4_logical_shape(x2)[1] if fmt2 in FP4 else n
        kp = ceil_div(k, 64)
        # aclnnQuantMatmulV5, Ascend 950, MX table: x1Scale / x2Scale "FLOAT8_E8M0" (uint8 bytes in torch_npu).
        check_dtype("pertoken_scale.dtype", pertoken.dtype, E8M0_CARRIERS)
        check_dtype("scale.dtype", scale.dtype, E8M0_CARRIERS)
        # MX全量化: x1Scale "非转置：(batch, m, ceil(k / 64), 2) / 转置：(batch, ceil(k / 64), m, 2)", x2Scale
        # "非转置：(batch, ceil(k / 64), n, 2) / 转置：(batch, n, ceil(k / 64), 2)" (transposed = the .transpose(0, 1)
        # view here).
        check_shape("pertoken_scale", pertoken, (m, kp, 2))
        check_shape("scale", scale, (kp, n, 2))
        # "MX全量化场景下，当x2数据类型为FLOAT8_E4M3FN/FLOAT8_E5M2时，x1和x1Scale的转置属性需要保持一致，x2和x2Scale的
        # 转置属性需要保持一致".
        check_scale_layout("pertoken_scale", pertoken, lay1, dims=(0, 1))
        check_scale_layout("scale", scale, lay2, dims=(0, 1))
        s1 = e8m0_values(pertoken).reshape(m, 2 * kp).repeat_interleave(32, dim=1)[:, :k]
        s2 = e8m0_values(scale).permute(0, 2, 1).reshape(2 * kp, n).repeat_interleave(32, dim=0)[:k]
        a, b = ((fp4_decode_packed(t) if f in FP4 else decode(t, f)) for t, f in ((x1, fmt1), (x2, fmt2)))
        return a * s1, b * s2

    @staticmethod
    def _check_fp4_mode(groups: tuple[int, int, int], pseudo: bool, k: int, lay1: set, lay2: set,
                        out_dtype: Dtype, bias: Optional[torch.Tensor], n: int) -> None:
        """The FP4 rows' constraints (aclnnQuantMatmulV5, Ascend 950, MX量化场景约束)."""
        # FP4 operands appear in the MX table (and T-CG, E4M3 x FP4 with BFLOAT16/FLOAT16 x2Scale, not simulated).
        if groups != (1, 1, 32):
            raise NpuTypeError(f"FP4 operands need the MX mode (group_sizes [1, 1, 32]), got {list(groups)}")
        if not pseudo:
            # "MX全量化场景下，当x2数据类型为FLOAT4_E2M1时，x1和x2的内轴必须为偶数，且k必须大于2。" (the packed inner
            # dims are even by construction)
            if k <= 2:
                raise NpuValueError(f"FP4 x FP4 needs k > 2, got {k}")
            return
        # "MX伪量化场景下，当x2数据类型为FLOAT4_E2M1时，transposeX1为false且transposeX2为true，不支持batch轴。"
        if "row" not in lay1 or "col" not in lay2:
            raise NpuValueError("float8_e4m3fn x FP4 needs x1 contiguous (m, k) and x2 the transposed view of a "
                                "contiguous (n, k)")
        # MX伪量化 row: out "BFLOAT16/FLOAT16", bias "null/BFLOAT16/FLOAT16"; "bias ... 数据类型要求与输出类型保持一致
        # ... shape支持2维，shape表示(1，n)".
        check_dtype("output_dtype", out_dtype, (torch.bfloat16, torch.float16))
        if bias is not None:
            check_dtype("bias.dtype", bias.dtype, (out_dtype,))
            check_shape("bias", bias, (1, n))

    @staticmethod
    def _quant_matmul_bias(bias: torch.Tensor, batch: torch.Size, n: int) -> torch.Tensor:
        check_tensor("bias", bias)
        # aclnnQuantMatmulV5, Ascend 950: every FLOAT8_E4M3FN/FLOAT8_E5M2/HIFLOAT8 row of the T-C/T-T, K-C/K-T and
        # MX全量化 tables has bias "null/FLOAT32" (BFLOAT16/FLOAT16 biases appear in the INT8 rows only).
        check_dtype("bias.dtype", bias.dtype, (torch.float32,))
        # "当out的shape为2维时，bias的shape支持1维(n,)或2维(1, n)。当out的shape为4、5、6维时，bias的shape支持1维(n,)。
        # 当out的shape为3维时，bias的shape支持1维(n,)或3维(batch, 1, n)。"
        out_dims = len(batch) + 2
        if out_dims == 2:
            check_shape("bias", bias, (n,), (1, n))
        elif out_dims == 3:
            check_shape("bias", bias, (n,), (batch[0], 1, n))
        else:
            check_shape("bias", bias, (n,))
        return bias

