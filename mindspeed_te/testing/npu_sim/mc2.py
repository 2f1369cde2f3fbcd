"""Fused matmul + communication kernels (mc2) over the torch.distributed group that `hcom` names."""
from __future__ import annotations

from typing import Any, Optional

import torch

from mindspeed_te.testing.npu_sim.checks import (
    check_choice,
    check_dims,
    check_dtype,
    check_int,
    check_layout,
    check_none,
    check_tensor,
    dtype_arg,
    kernel,
)
from mindspeed_te.testing.npu_sim.dtypes import FP8_NATIVE, GEMM_OUT, HALF_FLOATS, DtypeArg
from mindspeed_te.testing.npu_sim.errors import NpuSimNotImplemented, NpuValueError


class Mc2Kernels:
    """Fused matmul + communication kernels (`--use-ascend-mc2`), run over the torch.distributed group that
    `hcom` names: high precision (fp16/bf16), or MXFP8 with E8M0 x1_scale (m, ceil(k/64), 2) and x2_scale
    (ceil(k/64), n, 2) as in npu_quant_matmul's [1, 1, 32] mode (output_dtype then required)."""

    def _mc2_operands(self, kernel: str, x1: torch.Tensor, x2: torch.Tensor, hcom: Any, world_size: Any,
                      bias: Any, x1_scale: Any, x2_scale: Any, output_dtype: DtypeArg) -> tuple:
        """(group, output dtype, whether MX) after the contract checks."""
        import torch.distributed as dist

        check_tensor("self", x1)
        check_tensor("x2", x2)
        check_dims("self", x1, 2, 2)
        check_dims("x2", x2, 2, 2)
        if x1.shape[1] != x2.shape[0]:
            raise NpuValueError(f"k of self {tuple(x1.shape)} and x2 {tuple(x2.shape)} differ")
        check_none("bias", bias, f"for {kernel} (it takes no bias)")
        mx = x1_scale is not None or x2_scale is not None
        if mx:
            if x1_scale is None or x2_scale is None:
                raise NpuValueError("MX needs both x1_scale and x2_scale")
            check_dtype("self.dtype", x1.dtype, FP8_NATIVE)
            check_dtype("x2.dtype", x2.dtype, FP8_NATIVE)
            self._require_fp8_soc(kernel)
            out_dtype = dtype_arg("output_dtype", output_dtype, required=True)
            check_dtype("output_dtype", out_dtype, GEMM_OUT)
        else:
            check_dtype("self.dtype", x1.dtype, HALF_FLOATS)
            check_dtype("x2.dtype", x2.dtype, (x1.dtype,))
            out_dtype = x1.dtype
        if not isinstance(hcom, str) or hcom not in self._groups:
            raise NpuValueError(f"hcom must be the HCCL communicator name of the group, got {hcom!r}")
        group = self._groups[hcom]
        size = dist.get_world_size(group)
        if world_size is not None:
            check_choice("world_size", check_int("world_size", world_size), (2, 4, 8, 16, 32))
            if world_size != size:
                raise NpuValueError(f"world_size={world_size} but the hcom group has {size} ranks")
        return group, out_dtype, mx

    def _mc2_matmul(self, x1, x2, x1_scale, x2_scale, mx: bool) -> torch.Tensor:
        if not mx:
            return x1.float() @ x2.float()
        a, b = self._mx_operands(x1, x2, x1.dtype, x2.dtype, x2_scale, x1_scale,
                                 check_layout("self", x1, ("row",)), check_layout("x2", x2))
        return a @ b

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
        check_choice("gather_index", gather_index, (0,), "(gathering x2 is not simulated)")

        def gather(t: torch.Tensor) -> torch.Tensor:
            raw = t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous()
            out = raw.new_empty(world_size * raw.shape[0], *raw.shape[1:])
            dist.all_gather_into_tensor(out, raw, group=group)
            return out.view(t.dtype)

        gathered = gather(input)
        scale = gather(x1_scale) if mx else None
        out = self._mc2_matmul(gathered, x2, scale, x2_scale, mx).to(out_dtype)
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
        check_choice("reduce_op", reduce_op, ("sum",))
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

