"""The NPU backend's fused communication GEMMs of --use-ascend-mc2 (`NpuMc2`, mixed into `NpuBackend`):
all_gather_matmul, matmul_reduce_scatter and matmul_all_reduce on torch_npu's base (high-precision) kernels,
all_gather_matmul_mx and matmul_reduce_scatter_mx on its quant kernels, and hcom (a process group's HCCL
communicator name)."""
from __future__ import annotations

from typing import Any

import torch

from mindspeed_te.distributed import group_size
from mindspeed_te.kernels.npu.common import _mx_pair
from mindspeed_te.tensor import MXFP8TensorStorage


class NpuMc2:
    """The fused matmul + communication kernels of the NPU backend."""

    npu: Any

    # High precision runs on the base kernels, with the 950's only communication mode (aclnnAllGatherMatmulV2 /
    # aclnnMatmulReduceScatterV2, Ascend 950, commMode: "当前版本仅支持输入“ccu”"). MXFP8 runs on the quant
    # kernels: the base kernels' bindings pass groupSize 0, and E8M0 scales need [1, 1, 32] ("当x1Scale/x2Scale
    # 输入都是3维，且数据类型都为FLOAT8_E8M0时，[groupSizeM, groupSizeN, groupSizeK]取值组合仅支持[1, 1, 32]").
    def all_gather_matmul(self, x1, x2, group):
        return self.npu.npu_all_gather_base_mm(x1, x2, self.hcom(group), group_size(group), comm_mode="ccu")

    def matmul_reduce_scatter(self, x1, x2, group):
        return self.npu.npu_mm_reduce_scatter_base(x1, x2, self.hcom(group), group_size(group), comm_mode="ccu")

    def all_gather_matmul_mx(self, a, b, group, *, b_columnwise, out_dtype):
        x1, x2, kwargs = self._mc2_mx_args(a, b, b_columnwise)
        return self.npu.npu_all_gather_quant_mm(x1, x2, self.hcom(group), group_size(group), gather_output=False,
                                                y_dtype=out_dtype, **kwargs)[0]

    def matmul_reduce_scatter_mx(self, a, b, group, *, b_columnwise, out_dtype):
        x1, x2, kwargs = self._mc2_mx_args(a, b, b_columnwise)
        return self.npu.npu_quant_mm_reduce_scatter(x1, x2, self.hcom(group), group_size(group), y_dtype=out_dtype,
                                                    **kwargs)[0]

    def _mc2_mx_args(self, a: MXFP8TensorStorage, b: MXFP8TensorStorage, b_columnwise: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(x1, x2, scale arguments) of a quant mc2 kernel for a · bᵀ. The kernels take x2 and its scales only as
        transposed views (aclnnMatmulReduceScatterV2, Ascend 950: "mx量化场景下，x2/x2Scale仅支持转置输入"; the
        mx case of aclnnAllGatherMatmulV2: "x1不转置，x2转置，x1Scale不转置， x2Scale转置"); the columnwise form the
        quantize kernels make (along the rows, `_quantize_mx`) lies the other way, so its data and scales are
        copied."""
        (x1, s1), (b2d, s2) = _mx_pair(a, False, as_x2=False), _mx_pair(b, b_columnwise, as_x2=True)
        x2 = b2d.t()
        if x2.is_contiguous():
            x2, s2 = b2d.contiguous().t(), s2.transpose(0, 1).contiguous().transpose(0, 1)
        e8m0 = self.npu.float8_e8m0fnu
        return x1, x2, dict(x1_scale=s1, x2_scale=s2, x1_scale_dtype=e8m0, x2_scale_dtype=e8m0,
                            group_sizes=[1, 1, 32])

    def matmul_all_reduce(self, x1, x2, group):
        return self.npu.npu_mm_all_reduce_base(x1, x2, self.hcom(group))

    def hcom(self, group: Any) -> str:
        """The HCCL communicator name of a process group, which the fused matmul+communication kernels take."""
        if hasattr(self.npu, "hcom_of"):  # the simulator
            return self.npu.hcom_of(group)
        rank = torch.distributed.get_rank(group)
        return group._get_backend(torch.device("npu")).get_hccl_comm_name(rank)
