"""The weight-gradient kernels of newer torch_npu releases: npu_grouped_dynamic_mx_quant (the MX quantize of a
grouped linear's experts along their tokens, in one call), npu_add_quant_matmul_ and npu_add_quant_gmm_ (the
quantized GEMM, and the K-split grouped one, added into a float32 tensor in place: Megatron's gradient-accumulation
fusion into main_grad), and the 26.0.0 binding of npu_grouped_matmul_add_ (the bf16/fp16 K-split added likewise),
which calls aclnnGroupedMatmulAddV2 on the 950 where 2.14's called the first kernel, which the 950 lacks.

The first three are not kernels of the default simulator: they are in op-plugin 26.0.0 and later
(op_plugin_functions.yaml of the 7.3.0 branch has none of them; torch_npu-npu_add_quant_matmul_.md of
26.1.0: "此接口为本版本新增功能"), and the default simulator's kernels are the ones the self-check asks
an installed torch_npu for (`selfcheck.missing_kernels`). The NPU backend calls them only where
`hasattr(torch_npu, name)`; a torch_npu that has them is `make_simulator_with_fused_wgrad()`.

Sources: the schemas in op-plugin's op_plugin_functions.yaml (master), the bindings
(GroupedDynamicMxQuantKernelNpuOpApi.cpp, QuantBatchMatmulInplaceAddNpuOpApi.cpp,
QuantGroupedMatmulInplaceAddNpuOpApi.cpp, GroupedMatmulAddNpuOpApi.cpp) and meta registrations,
torch_npu-npu_add_quant_matmul_.md, and CANN's aclnnGroupedDynamicMxQuantV2.md / README.md (ops-nn
quant/grouped_dynamic_mx_quant), aclnnQuantBatchMatmulInplaceAdd.md and its op_api source (ops-nn
matmul/quant_batch_matmul_inplace_add), aclnnQuantGroupedMatmulInplaceAdd.md (ops-transformer
gmm/quant_grouped_matmul_inplace_add), aclnnGroupedMatmulAdd.md and aclnnGroupedMatmulAddV2.md
(ops-transformer gmm/grouped_matmul_add).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from mindspeed_te.testing.npu_sim.checks import (
    ceil_div,
    check_choice,
    check_dims,
    check_dtype,
    check_float,
    check_int,
    check_layout,
    check_none,
    check_same_device,
    check_shape,
    check_tensor,
    dtype_arg,
    dtype_name,
    kernel,
    layouts,
)
from mindspeed_te.testing.npu_sim.cube import cube_matmul
from mindspeed_te.testing.npu_sim.dtypes import (
    E8M0_CARRIERS,
    FLOAT8_E8M0FNU,
    FP4,
    FP8_NATIVE,
    HALF_FLOATS,
    HIFLOAT8,
    DtypeArg,
)
from mindspeed_te.testing.npu_sim.errors import NpuSimNotImplemented, NpuTypeError, NpuValueError
from mindspeed_te.testing.npu_sim.grouped_gemm import MAX_GROUP_LIST
from mindspeed_te.testing.npu_sim.simulator import NpuSimulator

# aclnnQuantGroupedMatmulInplaceAdd: "x1和x2的每一维大小在32字节对齐后都应小于int32的最大值2147483647，且内轴大小需小于
# 2097152。"
INNER_AXIS_LIMIT = 2097152


class FusedWgradKernels:
    """npu_grouped_dynamic_mx_quant, npu_add_quant_matmul_, npu_add_quant_gmm_ (mixed into
    `NpuSimulatorWithFusedWgrad`)."""

    @kernel
    def npu_grouped_dynamic_mx_quant(self, x: torch.Tensor, /, group_index: torch.Tensor, *, round_mode: str = "rint",
                                     dst_type: DtypeArg = 23, blocksize: int = 32, scale_alg: Optional[int] = 0,
                                     dst_type_max: Optional[float] = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """(y, mxscale): x (m, n) cut along its rows into the groups that `group_index` (int32 cumulative ends)
        gives, each group MX-quantized along its rows in 32-row blocks that start at the group's first row (as
        npu_dynamic_mx_quant(axis=0) of that group alone: same scale rules, same codes). mxscale (uint8 E8M0
        bytes) is (m // 64 + g, n, 2): group i's ceil(m_i / 64) block pairs at rows m_0..i-1 // 64 + i on (the layout
        the K-split MX grouped GEMMs read, `GroupedMatmulKernels._mx_k_split`), its odd last block paired with a 0
        byte (the simulator's assumption, after aclnnDynamicMxQuant's "pad填充值为0": this kernel's documents say
        only "分组内第一个维度pad为偶数"). The rows between groups are written by no group (the binding allocates
        mxscale uninitialised, apply_tensor_without_format): the simulator fills them with 0xFF (E8M0 NaN), so
        that a reader of them shows."""
        # README 产品支持情况: "Ascend 950PR/Ascend 950DT √", "Atlas A3 ... ×", "Atlas A2 ... ×".
        self._require_fp8_soc("npu_grouped_dynamic_mx_quant")
        # x: "shape仅支持2维", "FLOAT16、BFLOAT16" (tiling: "The dtype of x must be DT_FLOAT16 or DT_BF16").
        check_tensor("x", x, HALF_FLOATS)
        check_dims("x", x, 2, 2)
        # groupIndex: "shape仅支持1维", "INT32" (tiling: GROUPIDX_SUPPORT_DTYPE_SET = {ge::DT_INT32}).
        check_tensor("group_index", group_index, (torch.int32,))
        check_dims("group_index", group_index, 1, 1)
        check_same_device({"x": x, "group_index": group_index})
        out = dtype_arg("dst_type", dst_type, required=True)
        # dstType: "输入范围为{35, 36, 40, 41}，分别对应输出y的数据类型为{35: FLOAT8_E5M2, 36: FLOAT8_E4M3FN, 40:
        # FLOAT4_E2M1, 41: FLOAT4_E1M2}".
        check_dtype("dst_type", out, (*FP8_NATIVE, *FP4))
        if out in FP4:
            raise NpuSimNotImplemented(f"dst_type={dtype_name(out)}: only FP8 outputs are simulated")
        # roundMode: "对于FLOAT8，仅支持"rint""
        if round_mode != "rint":
            raise NpuValueError(f"round_mode must be 'rint' for FP8 output, got {round_mode!r}")
        # blocksize: "仅支持32" (binding: "Parameter blocksize must be 32").
        if check_int("blocksize", blocksize) != 32:
            raise NpuValueError(f"blocksize must be 32, got {blocksize}")
        # scaleAlg: "支持0, 1和2"; tiling: "If the dtype of output y is FLOAT8_E4M3FN/FLOAT8_E5M2, parameter scale_alg
        # must be 0 or 1".
        alg = 0 if scale_alg is None else check_int("scale_alg", scale_alg)
        check_choice("scale_alg", alg, (0, 1), "for FP8 output")
        # dstTypeMax: "在scale_alg=2时生效" (FP4 only): the simulator wants the default for FP8.
        if dst_type_max is not None and check_float("dst_type_max", dst_type_max) != 0.0:
            raise NpuValueError(f"dst_type_max applies to scale_alg 2 (FP4) only; got {dst_type_max}")
        # "groupIndex中的值必须非递减，且不能小于0，最后一个元素必须为x第一个维度的长度。"
        ends = group_index.tolist()
        m, n = x.shape
        if not ends or any(e < 0 for e in ends) or any(b < a for a, b in zip(ends, ends[1:])) or ends[-1] != m:
            raise NpuValueError(f"group_index must be non-decreasing, non-negative and end at x's {m} rows, "
                                f"got {ends}")
        g = len(ends)
        # "mxscale的shape为 [(m/(blocksize * 2)+g), n, 2]" (binding: "mxscale_shape[0] / blocksize / NUM_TWO +
        # group_index.sizes()[0]", int64).
        mxscale = torch.full((m // 64 + g, n, 2), 0xFF, dtype=torch.uint8)
        y = torch.empty(m, n, dtype=out)
        start = 0
        for i, end in enumerate(ends):
            if end > start:
                codes, pairs = self._mx_quantize(x[start:end], 0, out, 32, alg, 0.0)
                y[start:end] = codes
                first = start // 64 + i  # grouped_dynamic_mx_quant_combine.h: "(groupStart / 64 + groupIdx + ...)"
                mxscale[first:first + pairs.shape[0]] = pairs
            start = end
        return y, mxscale

    @kernel
    def npu_add_quant_matmul_(self, y: torch.Tensor, /, x1: torch.Tensor, x2: torch.Tensor, x2_scale: torch.Tensor,
                              *, x1_scale: Optional[torch.Tensor] = None, group_sizes: Optional[Sequence[int]] = None,
                              x1_dtype: DtypeArg = None, x2_dtype: DtypeArg = None, x1_scale_dtype: DtypeArg = None,
                              x2_scale_dtype: DtypeArg = None) -> torch.Tensor:
        """y += x1 @ x2 in place, y float32 (m, n), in the MX mode (group_sizes [1, 1, 32]): x1 (m, k) the
        transposed view of a contiguous (k, m), x2 (k, n) contiguous, x1_scale the (ceil(k/64), m, 2) E8M0 pairs
        (or their (m, ceil(k/64), 2) transposed view), x2_scale (ceil(k/64), n, 2). The product is the MX
        npu_quant_matmul's float32 sum (exact products of the block-scaled operands, float32 sums), added into
        y with one rounding: the kernel accumulates each output tile over all of k in its float32 L0C and writes
        it with a float32 atomic add (kernel_qbmm_mx.h: "AscendC::SetAtomicAdd<float>()"), no split of k. Returns
        y. The HiF8 T-T mode is not simulated (the backend does not call it, see its `gemm`)."""
        # torch_npu-npu_add_quant_matmul_.md 产品支持情况: "Ascend 950PR/Ascend 950DT √";
        # aclnnQuantBatchMatmulInplaceAdd: Atlas A2/A3 "不支持".
        self._require_fp8_soc("npu_add_quant_matmul_")
        for name, t in (("self", y), ("x1", x1), ("x2", x2), ("x2_scale", x2_scale)):
            check_tensor(name, t)
        check_same_device({"self": y, "x1": x1, "x2": x2, "x2_scale": x2_scale, "x1_scale": x1_scale})
        # self: "数据类型支持`float32`，tensor支持2维，shape为(M, N)".
        check_tensor("self", y, (torch.float32,))
        check_dims("self", y, 2, 2)
        fmt1 = self._operand_dtype("x1", x1, x1_dtype, "x1_dtype")
        fmt2 = self._operand_dtype("x2", x2, x2_dtype, "x2_dtype")
        # 数据类型约束: mx量化 "float8_e4m3fn/float8_e5m2" x1 and x2; T-T量化 "hifloat8" both.
        if (fmt1 == HIFLOAT8) != (fmt2 == HIFLOAT8):
            raise NpuTypeError("x1 and x2 must both be HiF8 or both float8_e4m3fn/float8_e5m2")
        if fmt1 == HIFLOAT8:
            raise NpuSimNotImplemented("the HiF8 T-T mode is not simulated (the library does not call it)")
        # x1, x2: "tensor支持2维"; aclnnQuantBatchMatmulInplaceAdd: "当前仅支持transposeX1=true且transposeX2=false" (the
        # op_api reads the transposition from the strides: QBMMIAGetTransposeAttrValue), so x1 is the (M, K) transposed
        # view of its (K, M) storage, as in the document's example ("x1 = ... (K, M) ... .transpose(0,1)").
        check_dims("x1", x1, 2, 2)
        check_dims("x2", x2, 2, 2)
        check_layout("x1", x1, ("col",))
        check_layout("x2", x2, ("row",))
        (m, k), (k2, n) = x1.shape, x2.shape
        if k2 != k:
            raise NpuValueError(f"k of x1 {tuple(x1.shape)} and x2 {tuple(x2.shape)} differ")
        # op_api CheckMKN: "the K dimension of x1 and x2 must be positive" (M and N may be 0).
        if k == 0:
            raise NpuValueError("the K dimension of x1 and x2 must be positive")
        # op_api CheckShapeInfoMatch: "the M dimension of x1 and yRef must be equal", "the N dimension of x2 and yRef".
        check_shape("self", y, (m, n))
        # group_sizes: "目前[group_m, group_n, group_k]mx量化支持的取值仅为[1,1,32]，T-T量化仅支持取值[0,0,0]".
        if group_sizes is None or list(group_sizes) != [1, 1, 32]:
            raise NpuValueError(f"group_sizes must be [1, 1, 32] in the MX mode, got {group_sizes}")
        # x1_scale_dtype / x2_scale_dtype: "当前仅支持`float8_e8m0fnu`"; the scales themselves "仍需保证...为8bit
        # 位的数据类型".
        for name, d in (("x1_scale_dtype", x1_scale_dtype), ("x2_scale_dtype", x2_scale_dtype)):
            check_dtype(name, dtype_arg(name, d, required=True), (FLOAT8_E8M0FNU,))
        if x1_scale is None:  # 数据类型约束 mx量化: x1_scale "float8_e8m0fnu" (never absent)
            raise NpuValueError("x1_scale is required in the MX mode")
        check_tensor("x1_scale", x1_scale, E8M0_CARRIERS)
        check_tensor("x2_scale", x2_scale, E8M0_CARRIERS)
        kp = ceil_div(k, 64)
        # shape约束 mx量化: x2_scale "(ceil(K/64),N,2)", x1_scale "(ceil(K/64),M, 2)"; the example passes x1_scale's
        # (M, ceil(K/64), 2) transposed view (op_api MxScaleContiguousProcess swaps it back).
        if tuple(x1_scale.shape) == (kp, m, 2) and x1_scale.is_contiguous():
            x1_scale = x1_scale.transpose(0, 1)
        a, b = self._mx_operands(x1, x2, fmt1, fmt2, x2_scale, x1_scale, layouts(x1), layouts(x2))
        return y.add_(cube_matmul(a, b))

    @kernel
    def npu_add_quant_gmm_(self, y: torch.Tensor, /, x1: torch.Tensor, x2: torch.Tensor, x2_scale: torch.Tensor,
                           group_list: torch.Tensor, *, x1_scale: Optional[torch.Tensor] = None,
                           group_list_type: Optional[int] = 0, group_sizes: Optional[Sequence[int]] = None,
                           x1_dtype: DtypeArg = None, x2_dtype: DtypeArg = None, x1_scale_dtype: DtypeArg = None,
                           x2_scale_dtype: DtypeArg = None) -> torch.Tensor:
        """y[i] += x1[:, K_i] @ x2[K_i] in place for each group i of the token dim k, y float32 (g, m, n), in the
        MX mode: x1 (m, k) the transposed view of a contiguous (k, m), x2 (k, n) contiguous, x1_scale
        (k // 64 + g, m, 2) and x2_scale (k // 64 + g, n, 2) E8M0 pairs in the grouped layout (the rows
        npu_grouped_dynamic_mx_quant writes). Each group's float32 product is the K-split MX grouped GEMM's
        (`GroupedMatmulKernels._mx_k_split`), added into y[i] with one rounding. Returns y. The HiF8 T-C mode is
        not simulated (the backend does not call it)."""
        # aclnnQuantGroupedMatmulInplaceAdd 产品支持情况: "Ascend 950PR/Ascend 950DT AI处理器 √", A2/A3 "×".
        self._require_fp8_soc("npu_add_quant_gmm_")
        for name, t in (("self", y), ("x1", x1), ("x2", x2), ("x2_scale", x2_scale), ("group_list", group_list)):
            check_tensor(name, t)
        check_same_device({"self": y, "x1": x1, "x2": x2, "x2_scale": x2_scale, "x1_scale": x1_scale,
                           "group_list": group_list})
        # binding: "group_sizes is not supported currently."
        check_none("group_sizes", group_sizes, "(the binding: \"group_sizes is not supported currently.\")")
        # groupListType: "只支持0和1两个取值"
        list_type = check_int("group_list_type", 0 if group_list_type is None else group_list_type)
        check_choice("group_list_type", list_type, (0, 1))
        fmt1 = self._operand_dtype("x1", x1, x1_dtype, "x1_dtype")
        fmt2 = self._operand_dtype("x2", x2, x2_dtype, "x2_dtype")
        # "仅支持x1、x2是FLOAT8_E5M2、FLOAT8_E4M3FN、HIFLOAT8的输入": mx FLOAT8 pairs, T-C HIFLOAT8 pairs.
        if (fmt1 == HIFLOAT8) != (fmt2 == HIFLOAT8):
            raise NpuTypeError("x1 and x2 must both be HiF8 or both float8_e4m3fn/float8_e5m2")
        if fmt1 == HIFLOAT8:
            raise NpuSimNotImplemented("the HiF8 T-C mode is not simulated (the library does not call it)")
        # x1 "2(K，M)", x2 "2(K，N)", both "非连续的Tensor √"; the meta registration reads m = x1.shape[0] and k =
        # x2.shape[0]: x1 is the (M, K) transposed view, as aclnnGroupedMatmulV4's K-split ("仅支持x转置且weight不
        # 转置").
        check_dims("x1", x1, 2, 2)
        check_dims("x2", x2, 2, 2)
        m, n = x1.shape[0], x2.shape[1]
        # "内轴大小需小于2097152": the inner axes of x1 (K, M) and x2 (K, N).
        if m >= INNER_AXIS_LIMIT or n >= INNER_AXIS_LIMIT:
            raise NpuValueError(f"the inner axes of x1 and x2 (m={m}, n={n}) must be below {INNER_AXIS_LIMIT}")
        # yRef: "FLOAT32", "3(g，M，N)".
        check_tensor("self", y, (torch.float32,))
        check_dims("self", y, 3, 3)
        # groupList: "INT64", "1(g，)"; "groupList第1维最大支持1024".
        check_tensor("group_list", group_list, (torch.int64,))
        if not 0 < group_list.numel() <= MAX_GROUP_LIST:
            raise NpuValueError(f"group_list must hold 1 to {MAX_GROUP_LIST} groups, got {group_list.numel()}")
        check_shape("self", y, (group_list.numel(), m, n))
        # mx量化 table: scale2 "FLOAT8_E8M0", scale1Optional "FLOAT8_E8M0" (never absent).
        for name, d in (("x1_scale_dtype", x1_scale_dtype), ("x2_scale_dtype", x2_scale_dtype)):
            check_dtype(name, dtype_arg(name, d, required=True), (FLOAT8_E8M0FNU,))
        if x1_scale is None:
            raise NpuValueError("x1_scale is required in the MX mode")
        # scale1Optional: "3维tensor，shape为((K / 64) + g, M, 2)，scale_i起始地址偏移为((K_0 + K_1 + ...+
        # K_{i-1})/ 64 + g_i) * M * 2"; scale2: "3维tensor，shape为((K / 64) + g, N, 2), 起始地址偏移与scale1Optional
        # 同理"; groupList: "groupList中的最后一个值约束了输出数据的有效部分，groupList中未指定的部分将不会参与更新"
        # (tokens past its total are read by no group).
        self._mx_k_split(x1, x2, fmt1, fmt2, x2_scale, x1_scale, group_list, list_type, torch.float32, accumulate=y)
        return y

    @kernel
    def npu_grouped_matmul_add_(self, y: torch.Tensor, /, x: torch.Tensor, weight: torch.Tensor,
                                group_list: torch.Tensor, *, transpose_x: bool = True, transpose_weight: bool = False,
                                group_type: int = 2, group_list_type: Optional[int] = 0) -> torch.Tensor:
        """y_i += x_iᵀ @ weight_i in place, as the 2.14 binding, with the 26.0.0 binding's choice of kernel: "if
        (!has_grouped_matmul_add_v2 || !checkSoc) { EXEC_NPU_CMD(aclnnGroupedMatmulAdd, ...) }", else
        aclnnGroupedMatmulAddV2 with group_list_type (GroupedMatmulAddNpuOpApi.cpp; checkSoc is IsAclnnOnly(), the
        950). So on the 950 y is (g, m, n); on Atlas A2/A3, (g * m, n)."""
        list_type = 0 if group_list_type is None else group_list_type
        return self._grouped_matmul_add(y, x, weight, group_list, transpose_x, transpose_weight, group_type,
                                        list_type, v2=self.supports_fp8)


class NpuSimulatorWithFusedWgrad(FusedWgradKernels, NpuSimulator):
    """A simulated torch_npu that has npu_grouped_dynamic_mx_quant, npu_add_quant_matmul_ and npu_add_quant_gmm_
    (op-plugin 26.0.0 and later, with CANN's aclnnGroupedDynamicMxQuant(V2), aclnnQuantBatchMatmulInplaceAdd and
    aclnnQuantGroupedMatmulInplaceAdd)."""


def make_simulator_with_fused_wgrad(soc_name: str = "Ascend950PR") -> NpuSimulatorWithFusedWgrad:
    """A fresh simulator of a chip named `soc_name` whose torch_npu has the fused weight-gradient kernels."""
    return NpuSimulatorWithFusedWgrad(soc_name)
