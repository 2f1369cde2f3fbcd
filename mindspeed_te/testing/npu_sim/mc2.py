"""Fused matmul + communication kernels (mc2) over the torch.distributed group that `hcom` names."""
from __future__ import annotations

from typing import Any, Optional

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
from mindspeed_te.testing.npu_sim.dtypes import E8M0_CARRIERS, FP8_NATIVE, GEMM_OUT, HALF_FLOATS, DtypeArg
from mindspeed_te.testing.npu_sim.errors import NpuSimNotImplemented, NpuValueError

MC2_K_RANGE = (256, 65535)  # k in [256, 65535)
MC2_WORLD_SIZES = (2, 4, 8, 16, 32, 64)


class Mc2Kernels:
    """Fused matmul + communication kernels (`--use-ascend-mc2`), run over the torch.distributed group that
    `hcom` names: high precision (fp16/bf16), or MXFP8 with E8M0 x1_scale (m, ceil(k/64), 2) and x2_scale
    (ceil(k/64), n, 2) as in npu_quant_matmul's [1, 1, 32] mode (output_dtype then required).

    torch_npu runs aclnnAllGatherMatmulV2 / aclnnMatmulReduceScatterV2 for these; the quotes are from their
    Ascend 950PR/950DT sections (ops-transformer mc2/*_v2/docs) and from the torch_npu docs
    (torch_npu-npu_all_gather_base_mm.md, torch_npu-npu_mm_reduce_scatter_base.md)."""

    def _mc2_operands(self, kernel: str, x1: torch.Tensor, x2: torch.Tensor, hcom: Any, world_size: Any,
                      bias: Any, x1_scale: Any, x2_scale: Any, output_dtype: DtypeArg) -> tuple:
        """(group, output dtype, whether MX) after the contract checks."""
        import torch.distributed as dist

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
        mx = x1_scale is not None or x2_scale is not None
        if mx:
            if x1_scale is None or x2_scale is None:
                raise NpuValueError("MX needs both x1_scale and x2_scale")
            # "当x1、x2数据类型为FLOAT8_E4M3FN/FLOAT8_E5M2时，x1和x2数据类型可以为其中一种。" (HiF8 / FP4 not simulated)
            check_dtype("self.dtype", x1.dtype, FP8_NATIVE)
            check_dtype("x2.dtype", x2.dtype, FP8_NATIVE)
            self._require_fp8_soc(kernel)
            # output: "如果x1类型为FLOAT8_E4M3FN、FLOAT8_E5M2、HIFLOAT8、FLOAT4_E2M1，则数据类型支持FLOAT16、
            # BFLOAT16、FLOAT。"
            out_dtype = dtype_arg("output_dtype", output_dtype, required=True)
            check_dtype("output_dtype", out_dtype, GEMM_OUT)
            # x1Scale: "在mx量化场景下，数据类型为FLOAT8_E8M0，shape为(m, ceilDiv(k, 64), 2)。"
            check_tensor("x1_scale", x1_scale, E8M0_CARRIERS)
            check_shape("x1_scale", x1_scale, (x1.shape[0], ceil_div(x1.shape[1], 64), 2))
            if kernel == "npu_mm_reduce_scatter_base":
                # aclnnMatmulReduceScatterV2, Ascend 950: "mx量化场景下，x2/x2Scale仅支持转置输入。"
                check_layout("x2", x2, ("col",))
                check_tensor("x2_scale", x2_scale)
                check_scale_layout("x2_scale", x2_scale, {"col"}, dims=(0, 1))
        else:
            # "当x1、x2的数据类型为FLOAT16/BFLOAT16/HIFLOAT8/FLOAT4_E2M1时，x1和x2数据类型需要保持一致。" and output:
            # "如果x1类型为FLOAT16、BFLOAT16，则output类型与x1保持一致。"
            check_dtype("self.dtype", x1.dtype, HALF_FLOATS)
            check_dtype("x2.dtype", x2.dtype, (x1.dtype,))
            out_dtype = x1.dtype
        if not isinstance(hcom, str) or hcom not in self._groups:
            raise NpuValueError(f"hcom must be the HCCL communicator name of the group, got {hcom!r}")
        group = self._groups[hcom]
        size = dist.get_world_size(group)
        if world_size is not None:
            # Ascend 950: "支持2、4、8、16、32、64卡" (torch_npu doc: A2 2/4/8, A3 2/4/8/16/32).
            check_choice("world_size", check_int("world_size", world_size), MC2_WORLD_SIZES)
            if world_size != size:
                raise NpuValueError(f"world_size={world_size} but the hcom group has {size} ranks")
        return group, out_dtype, mx

    def _mc2_matmul(self, x1, x2, x1_scale, x2_scale, mx: bool, out_dtype: torch.dtype = torch.float32
                    ) -> torch.Tensor:
        """The local GEMM, its float32 sum rounded once to out_dtype."""
        if not mx:
            return (x1.float() @ x2.float()).to(out_dtype)
        a, b = self._mx_operands(x1, x2, x1.dtype, x2.dtype, x2_scale, x1_scale,
                                 check_layout("self", x1, ("row",)), check_layout("x2", x2))
        return cube_matmul_rounded(a, b, out_dtype)

    @kernel
    def npu_all_gather_base_mm(self, input: torch.Tensor, /, x2: torch.Tensor, hcom: str, world_size: int,
                               bias: Optional[torch.Tensor] = None, x1_scale: Optional[torch.Tensor] = None,
                               x2_scale: Optional[torch.Tensor] = None, gather_index: int = 0,
                               gather_output: bool = True, comm_turn: int = 0, output_dtype: DtypeArg = None,
                               comm_mode: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(all_gather(input) @ x2, all_gather(input)): input (and its x1_scale) gathered along dim 0, then the
        GEMM with fp32 accumulation."""
        import torch.distributed as dist

        group, out_dtype, mx = self._mc2_operands("npu_all_gather_base_mm", input, x2, hcom, world_size, bias,
                                                  x1_scale, x2_scale, output_dtype)
        # aclnnAllGatherMatmulV2, gatherIndex: "0表示目标为x1，1表示目标为x2。当前版本仅支持输入0。"
        check_choice("gather_index", gather_index, (0,), "(only x1 is gathered)")

        def gather(t: torch.Tensor) -> torch.Tensor:
            raw = t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous()
            out = raw.new_empty(world_size * raw.shape[0], *raw.shape[1:])
            dist.all_gather_into_tensor(out, raw, group=group)
            return out.view(t.dtype)

        gathered = gather(input)
        scale = gather(x1_scale) if mx else None
        out = self._mc2_matmul(gathered, x2, scale, x2_scale, mx, out_dtype)
        return out, (gathered if gather_output else gathered.new_empty(0))

    @kernel
    def npu_mm_reduce_scatter_base(self, input: torch.Tensor, /, x2: torch.Tensor, hcom: str, world_size: int,
                                   reduce_op: str = "sum", bias: Optional[torch.Tensor] = None,
                                   x1_scale: Optional[torch.Tensor] = None, x2_scale: Optional[torch.Tensor] = None,
                                   comm_turn: int = 0, output_dtype: DtypeArg = None,
                                   comm_mode: Optional[str] = None) -> torch.Tensor:
        """reduce_scatter(input @ x2) along dim 0 (fp32 GEMM and reduction)."""
        import torch.distributed as dist

        group, out_dtype, mx = self._mc2_operands("npu_mm_reduce_scatter_base", input, x2, hcom, world_size, bias,
                                                  x1_scale, x2_scale, output_dtype)
        # torch_npu doc: "reduce_op ... 当前仅支持'sum'"
        check_choice("reduce_op", reduce_op, ("sum",))
        # "输入x1为2维，其shape为(m, k)，m须为卡数rank_size的整数倍。"
        if input.shape[0] % world_size:
            raise NpuValueError(f"self's dim 0 ({input.shape[0]}) must be divisible by world_size ({world_size})")
        full = self._mc2_matmul(input, x2, x1_scale, x2_scale, mx).contiguous()
        out = torch.empty(input.shape[0] // world_size, x2.shape[1], dtype=torch.float32)
        dist.reduce_scatter_tensor(out, full, group=group)
        return out.to(out_dtype)

    @kernel
    def npu_mm_all_reduce_base(self, x1: torch.Tensor, x2: torch.Tensor, hcom: str, reduce_op: str = "sum",
                               bias: Optional[torch.Tensor] = None, **quantized: Any) -> torch.Tensor:
        """all_reduce(x1 @ x2) (fp32 GEMM and reduction, output in x1's dtype). High precision only here."""
        import torch.distributed as dist

        if any(isinstance(v, torch.Tensor) for v in quantized.values()):
            raise NpuSimNotImplemented("npu_mm_all_reduce_base: quantized forms are not simulated")
        group, out_dtype, _ = self._mc2_operands("npu_mm_all_reduce_base", x1, x2, hcom, None, bias, None, None,
                                                 None)
        check_choice("reduce_op", reduce_op, ("sum",))
        full = (x1.float() @ x2.float()).contiguous()
        dist.all_reduce(full, group=group)
        return full.to(out_dtype)

