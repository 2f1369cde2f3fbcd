"""Fused matmul + communication kernels (mc2) over the torch.distributed group that `hcom` names."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from mindspeed_te.testing.npu_sim.checks import (
    ceil_div,
    check_choice,
    check_dims,
    check_dtype,
    check_int,
    check_layout,
    check_none,
    check_scale_layout,
    check_shape,
    check_tensor,
    dtype_arg,
    kernel,
)
from mindspeed_te.testing.npu_sim.cube import cube_matmul_rounded
from mindspeed_te.testing.npu_sim.dtypes import (
    E8M0_CARRIERS,
    FLOAT8_E8M0FNU,
    FP8_NATIVE,
    GEMM_OUT,
    HALF_FLOATS,
    DtypeArg,
)
from mindspeed_te.testing.npu_sim.errors import NpuSimNotImplemented, NpuValueError

MC2_K_RANGE = (256, 65535)  # k in [256, 65535)
# The torch_npu bindings check the world size themselves: npu_all_gather_base_mm / npu_mm_reduce_scatter_base
# (AllGatherBaseMatmulKernelNpuOpApi.cpp, MatmulReduceScatterBaseKernelNpuOpApi.cpp) "world_size should be in
# [2, 4, 8, 16, 32]"; npu_all_gather_quant_mm / npu_quant_mm_reduce_scatter "world_size should be in [2, 4, 8,
# 16, 32, 64]" (the 950 documents: "支持2、4、8、16、32、64卡").
MC2_BASE_WORLD_SIZES = (2, 4, 8, 16, 32)
MC2_QUANT_WORLD_SIZES = (2, 4, 8, 16, 32, 64)
MX_GROUP_SIZES = [1, 1, 32]


class Mc2Kernels:
    """Fused matmul + communication kernels (`--use-ascend-mc2`), run over the torch.distributed group that
    `hcom` names: npu_all_gather_base_mm / npu_mm_reduce_scatter_base / npu_mm_all_reduce_base in high precision
    (fp16/bf16), npu_all_gather_quant_mm / npu_quant_mm_reduce_scatter in MXFP8 (E8M0 x1_scale (m, ceil(k/64),
    2) and x2_scale (ceil(k/64), n, 2) as in npu_quant_matmul's [1, 1, 32] mode).

    torch_npu runs aclnnAllGatherMatmulV2 / aclnnMatmulReduceScatterV2 for all four on the Ascend 950; the quotes
    are from those documents' Ascend 950 sections (ops-transformer mc2/*_v2/docs), from the torch_npu docs
    (torch_npu-npu_all_gather_base_mm.md, torch_npu-npu_mm_reduce_scatter_base.md) and from the bindings
    (op-plugin op_plugin/ops/opapi/*MatmulKernelNpuOpApi.cpp), which fix some arguments themselves."""

    @staticmethod
    def _mc2_checks(kernel: str, x1: torch.Tensor, x2: torch.Tensor, world_size: Any,
                    world_sizes: tuple[int, ...], bias: Any) -> None:
        """The checks every fused kernel shares."""
        if world_size is not None:
            check_choice("world_size", check_int("world_size", world_size), world_sizes, f"(the {kernel} binding)")
        check_tensor("self", x1)
        check_tensor("x2", x2)
        # "输入x1为2维，其维度为(m, k)。x2必须是2维，其维度为(k, n)，轴满足mm算子入参要求，k轴相等，且k轴取值范围为
        # [256, 65535)。" (both V2 documents, Ascend 950; the torch_npu docs say the same of x1/x2)
        check_dims("self", x1, 2, 2)
        check_dims("x2", x2, 2, 2)
        if x1.shape[1] != x2.shape[0]:
            raise NpuValueError(f"k of self {tuple(x1.shape)} and x2 {tuple(x2.shape)} differ")
        lo, hi = MC2_K_RANGE
        if kernel != "npu_mm_all_reduce_base" and not lo <= x1.shape[1] < hi:  # aclnnMatmulAllReduce has no range
            raise NpuValueError(f"k (self.shape[1] = {x1.shape[1]}) must be in [{lo}, {hi})")
        # "x2矩阵支持转置/不转置场景，x1矩阵只支持不转置场景。"
        check_layout("self", x1, ("row",))
        check_layout("x2", x2)
        # torch_npu docs, bias: "当前版本暂不支持bias输入为非0的场景。" (the 950 aclnn documents take a bias; the
        # torch_npu binding documents none, so the simulator refuses one)
        check_none("bias", bias, f"for {kernel} (it takes no bias)")

    def _mc2_group(self, hcom: Any, world_size: Optional[int]) -> Any:
        """The process group `hcom` names, which must have `world_size` ranks (when given)."""
        import torch.distributed as dist

        if not isinstance(hcom, str) or hcom not in self._groups:
            raise NpuValueError(f"hcom must be the HCCL communicator name of the group, got {hcom!r}")
        group = self._groups[hcom]
        size = dist.get_world_size(group)
        if world_size is not None and world_size != size:
            raise NpuValueError(f"world_size={world_size} but the hcom group has {size} ranks")
        return group

    def _mc2_base(self, kernel: str, x1: torch.Tensor, x2: torch.Tensor, hcom: Any, world_size: Any, bias: Any,
                  x1_scale: Any, x2_scale: Any, comm_mode: Optional[str]) -> Any:
        """The group of a high-precision npu_*_base_mm call, after its contract checks."""
        if x1_scale is not None or x2_scale is not None:
            # The bindings call aclnn*MatmulV2 with "int64_t group_size = 0;", and the 950 documents take E8M0
            # scales only with another groupSize: "当x1Scale/x2Scale输入都是3维，且数据类型都为FLOAT8_E8M0时，
            # [groupSizeM, groupSizeN, groupSizeK]取值组合仅支持[1, 1, 32]".
            if any(isinstance(s, torch.Tensor) and s.dim() == 3 for s in (x1_scale, x2_scale)):
                raise NpuValueError(f"{kernel} passes groupSize 0, which MX (E8M0) scales cannot take; the quant "
                                    "kernels (npu_all_gather_quant_mm, npu_quant_mm_reduce_scatter) take "
                                    "group_sizes [1, 1, 32]")
            raise NpuSimNotImplemented(f"{kernel}: quantized forms are not simulated")
        self._mc2_checks(kernel, x1, x2, world_size, MC2_BASE_WORLD_SIZES, bias)
        if self.supports_fp8:
            # Ascend 950, commMode: "当前仅支持集合通信单元ccu完成通信任务。当前版本仅支持输入“ccu”" (the base bindings
            # pass comm_mode on, defaulting to "ai_cpu" or "").
            check_choice("comm_mode", comm_mode, ("ccu",), "on the Ascend 950")
        self._check_high_precision("self", x1, x2)
        return self._mc2_group(hcom, world_size)

    @staticmethod
    def _check_high_precision(x1_name: str, x1: torch.Tensor, x2: torch.Tensor) -> None:
        # "当x1、x2的数据类型为FLOAT16/BFLOAT16/HIFLOAT8/FLOAT4_E2M1时，x1和x2数据类型需要保持一致。" and output:
        # "如果x1类型为FLOAT16、BFLOAT16，则output类型与x1保持一致。"
        check_dtype(f"{x1_name}.dtype", x1.dtype, HALF_FLOATS)
        check_dtype("x2.dtype", x2.dtype, (x1.dtype,))

    def _mc2_mx(self, kernel: str, x1: torch.Tensor, x2: torch.Tensor, hcom: Any, world_size: Any, bias: Any,
                x1_scale: Any, x2_scale: Any, quant_scale: Any, block_size: Any, comm_turn: Any, group_sizes: Any,
                amax_output: Any, y_dtype: DtypeArg, x1_dtype: DtypeArg, x2_dtype: DtypeArg,
                x1_scale_dtype: DtypeArg, x2_scale_dtype: DtypeArg) -> tuple[Any, torch.Tensor]:
        """(group, output dtype) of an MXFP8 npu_*_quant_* call, after its contract checks. Other quantized forms
        (per-tensor, per-block, HiF8) and high precision through these kernels are not simulated."""
        self._mc2_checks(kernel, x1, x2, world_size, MC2_QUANT_WORLD_SIZES, bias)
        self._require_fp8_soc(kernel)
        if x1_scale is None or x2_scale is None or x1_dtype is not None or x2_dtype is not None:
            raise NpuSimNotImplemented(f"{kernel}: only MXFP8 (E4M3/E5M2 with both E8M0 scales) is simulated")
        # "当x1、x2数据类型为FLOAT8_E4M3FN/FLOAT8_E5M2时，x1和x2数据类型可以为其中一种。"
        check_dtype("self.dtype", x1.dtype, FP8_NATIVE)
        check_dtype("x2.dtype", x2.dtype, FP8_NATIVE)
        # quantScale: "当前版本仅支持nullptr"; blockSize: "mm输出矩阵不涉及K轴，blockSizeK固定为0。当前版本只支持
        # blockSizeM=blockSizeN=0"; commTurn: "当前版本仅支持输入0"; amaxOut: "当前版本仅支持nullptr或空tensor" (the
        # binding allocates a (1,) amaxOut for amax_output=True).
        check_none("quant_scale", quant_scale, "(quantScale: only nullptr in this version)")
        check_choice("block_size", block_size, (0,))
        check_choice("comm_turn", comm_turn, (0,))
        check_choice("amax_output", amax_output, (False,))
        # groupSize: "当x1Scale/x2Scale输入都是3维，且数据类型都为FLOAT8_E8M0时，[groupSizeM, groupSizeN,
        # groupSizeK]取值组合仅支持[1, 1, 32]"
        if group_sizes is None or list(group_sizes) != MX_GROUP_SIZES:
            raise NpuValueError(f"group_sizes must be {MX_GROUP_SIZES} with E8M0 scales, got {group_sizes!r}")
        # x1Scale / x2Scale: "mx场景下，数据类型为FLOAT8_E8M0" -- the binding hands the kernel x1_scale_dtype /
        # x2_scale_dtype when given, else the tensor's own dtype.
        for name, scale, given in (("x1_scale", x1_scale, x1_scale_dtype), ("x2_scale", x2_scale, x2_scale_dtype)):
            check_tensor(name, scale, E8M0_CARRIERS)
            acl = dtype_arg(f"{name}_dtype", given) if given is not None else scale.dtype
            check_dtype(f"{name} (as the kernel reads it)", acl, (FLOAT8_E8M0FNU, torch.float8_e8m0fnu))
        # The binding: "input dtype is not bf16 or fp16, but no input y_dtype"; output: "如果x1类型为FLOAT8_E4M3FN、
        # FLOAT8_E5M2、HIFLOAT8，则数据类型支持FLOAT16、BFLOAT16、FLOAT。"
        out_dtype = dtype_arg("y_dtype", y_dtype, required=True)
        check_dtype("y_dtype", out_dtype, GEMM_OUT)
        # x1Scale: "mx场景下，数据类型为FLOAT8_E8M0，shape为(m, CeilDiv(k, 64), 2)。"
        check_shape("x1_scale", x1_scale, (x1.shape[0], ceil_div(x1.shape[1], 64), 2))
        # aclnnMatmulReduceScatterV2, Ascend 950: "mx量化场景下，x2/x2Scale仅支持转置输入。"; aclnnAllGatherMatmulV2
        # describes its mx case with the same layouts: "情形4：如果x1和x2数据类型为FLOAT8_E4M3FN/FLOAT8_E5M2，...
        # x1不转置，x2转置，x1Scale不转置， x2Scale转置".
        check_layout("x2", x2, ("col",))
        check_scale_layout("x2_scale", x2_scale, {"col"}, dims=(0, 1))
        return self._mc2_group(hcom, world_size), out_dtype

    def _mc2_matmul(self, x1, x2, x1_scale, x2_scale, mx: bool, out_dtype: torch.dtype = torch.float32
                    ) -> torch.Tensor:
        """The local GEMM, its float32 sum rounded once to out_dtype."""
        if not mx:
            return (x1.float() @ x2.float()).to(out_dtype)
        a, b = self._mx_operands(x1, x2, x1.dtype, x2.dtype, x2_scale, x1_scale,
                                 check_layout("self", x1, ("row",)), check_layout("x2", x2))
        return cube_matmul_rounded(a, b, out_dtype)

    def _gather_rows(self, t: torch.Tensor, group: Any, world_size: int) -> torch.Tensor:
        """all_gather along dim 0 (1-byte dtypes travel as their bytes)."""
        import torch.distributed as dist

        raw = t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous()
        out = raw.new_empty(world_size * raw.shape[0], *raw.shape[1:])
        dist.all_gather_into_tensor(out, raw, group=group)
        return out.view(t.dtype)

    def _reduce_scatter_rows(self, full: torch.Tensor, group: Any, world_size: int) -> torch.Tensor:
        """reduce_scatter (sum) of a float32 product along dim 0."""
        import torch.distributed as dist

        out = torch.empty(full.shape[0] // world_size, full.shape[1], dtype=torch.float32)
        dist.reduce_scatter_tensor(out, full.contiguous(), group=group)
        return out

    @staticmethod
    def _check_reduce_scatter(x1: torch.Tensor, world_size: int, reduce_op: Any) -> None:
        # torch_npu doc: "reduce_op ... 当前仅支持'sum'"
        check_choice("reduce_op", reduce_op, ("sum",))
        # "输入x1为2维，其shape为(m, k)，m须为卡数rank_size的整数倍。"
        if x1.shape[0] % world_size:
            raise NpuValueError(f"self's dim 0 ({x1.shape[0]}) must be divisible by world_size ({world_size})")

    @kernel
    def npu_all_gather_base_mm(self, input: torch.Tensor, /, x2: torch.Tensor, hcom: str, world_size: int,
                               bias: Optional[torch.Tensor] = None, x1_scale: Optional[torch.Tensor] = None,
                               x2_scale: Optional[torch.Tensor] = None, gather_index: int = 0,
                               gather_output: bool = True, comm_turn: int = 0, output_dtype: DtypeArg = None,
                               comm_mode: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(all_gather(input) @ x2, all_gather(input)) in high precision: input gathered along dim 0, then the
        GEMM with fp32 accumulation."""
        group = self._mc2_base("npu_all_gather_base_mm", input, x2, hcom, world_size, bias, x1_scale, x2_scale,
                               comm_mode)
        # aclnnAllGatherMatmulV2, gatherIndex: "0表示目标为x1，1表示目标为x2。当前版本仅支持输入0。"
        check_choice("gather_index", gather_index, (0,), "(only x1 is gathered)")
        gathered = self._gather_rows(input, group, world_size)
        out = self._mc2_matmul(gathered, x2, None, None, False, input.dtype)
        return out, (gathered if gather_output else gathered.new_empty(0))

    @kernel
    def npu_mm_reduce_scatter_base(self, input: torch.Tensor, /, x2: torch.Tensor, hcom: str, world_size: int,
                                   reduce_op: str = "sum", bias: Optional[torch.Tensor] = None,
                                   x1_scale: Optional[torch.Tensor] = None, x2_scale: Optional[torch.Tensor] = None,
                                   comm_turn: int = 0, output_dtype: DtypeArg = None,
                                   comm_mode: Optional[str] = None) -> torch.Tensor:
        """reduce_scatter(input @ x2) along dim 0 (fp32 GEMM and reduction) in high precision."""
        group = self._mc2_base("npu_mm_reduce_scatter_base", input, x2, hcom, world_size, bias, x1_scale, x2_scale,
                               comm_mode)
        self._check_reduce_scatter(input, world_size, reduce_op)
        full = self._mc2_matmul(input, x2, None, None, False)
        return self._reduce_scatter_rows(full, group, world_size).to(input.dtype)

    @kernel
    def npu_all_gather_quant_mm(self, input: torch.Tensor, /, x2: torch.Tensor, hcom: str, world_size: int,
                                bias: Optional[torch.Tensor] = None, x1_scale: Optional[torch.Tensor] = None,
                                x2_scale: Optional[torch.Tensor] = None, quant_scale: Optional[torch.Tensor] = None,
                                block_size: int = 0, gather_index: int = 0, gather_output: bool = True,
                                comm_turn: int = 0, group_sizes: Optional[Sequence[int]] = None,
                                amax_output: bool = False, y_dtype: DtypeArg = None, x1_dtype: DtypeArg = None,
                                x2_dtype: DtypeArg = None, x1_scale_dtype: DtypeArg = None,
                                x2_scale_dtype: DtypeArg = None) -> tuple[torch.Tensor, torch.Tensor, None]:
        """(all_gather(input) @ x2 dequantized, all_gather(input), no amax) in MXFP8: input and x1_scale gathered
        along dim 0, then the [1, 1, 32] GEMM with fp32 accumulation."""
        group, out_dtype = self._mc2_mx("npu_all_gather_quant_mm", input, x2, hcom, world_size, bias, x1_scale,
                                        x2_scale, quant_scale, block_size, comm_turn, group_sizes, amax_output,
                                        y_dtype, x1_dtype, x2_dtype, x1_scale_dtype, x2_scale_dtype)
        # gatherIndex: "0表示目标为x1，1表示目标为x2。当前版本仅支持输入0。"
        check_choice("gather_index", gather_index, (0,), "(only x1 is gathered)")
        gathered = self._gather_rows(input, group, world_size)
        scale = self._gather_rows(x1_scale, group, world_size)
        out = self._mc2_matmul(gathered, x2, scale, x2_scale, True, out_dtype)
        return out, (gathered if gather_output else gathered.new_empty(0)), None

    @kernel
    def npu_quant_mm_reduce_scatter(self, input: torch.Tensor, /, x2: torch.Tensor, hcom: str, world_size: int,
                                    reduce_op: str = "sum", bias: Optional[torch.Tensor] = None,
                                    x1_scale: Optional[torch.Tensor] = None, x2_scale: Optional[torch.Tensor] = None,
                                    quant_scale: Optional[torch.Tensor] = None, block_size: int = 0,
                                    comm_turn: int = 0, group_sizes: Optional[Sequence[int]] = None,
                                    amax_output: bool = False, y_dtype: DtypeArg = None, x1_dtype: DtypeArg = None,
                                    x2_dtype: DtypeArg = None, x1_scale_dtype: DtypeArg = None,
                                    x2_scale_dtype: DtypeArg = None) -> tuple[torch.Tensor, None]:
        """(reduce_scatter(input @ x2 dequantized), no amax) in MXFP8: fp32 GEMM and reduction, then the output
        dtype."""
        group, out_dtype = self._mc2_mx("npu_quant_mm_reduce_scatter", input, x2, hcom, world_size, bias, x1_scale,
                                        x2_scale, quant_scale, block_size, comm_turn, group_sizes, amax_output,
                                        y_dtype, x1_dtype, x2_dtype, x1_scale_dtype, x2_scale_dtype)
        self._check_reduce_scatter(input, world_size, reduce_op)
        full = self._mc2_matmul(input, x2, x1_scale, x2_scale, True)
        return self._reduce_scatter_rows(full, group, world_size).to(out_dtype), None

    @kernel
    def npu_mm_all_reduce_base(self, x1: torch.Tensor, x2: torch.Tensor, hcom: str, reduce_op: str = "sum",
                               bias: Optional[torch.Tensor] = None, **quantized: Any) -> torch.Tensor:
        """all_reduce(x1 @ x2) (fp32 GEMM and reduction, output in x1's dtype). High precision only here."""
        import torch.distributed as dist

        if any(isinstance(v, torch.Tensor) for v in quantized.values()):
            raise NpuSimNotImplemented("npu_mm_all_reduce_base: quantized forms are not simulated")
        self._mc2_checks("npu_mm_all_reduce_base", x1, x2, None, MC2_BASE_WORLD_SIZES, bias)
        self._check_high_precision("x1", x1, x2)
        check_choice("reduce_op", reduce_op, ("sum",))
        group = self._mc2_group(hcom, None)
        full = (x1.float() @ x2.float()).contiguous()
        dist.all_reduce(full, group=group)
        return full.to(x1.dtype)
