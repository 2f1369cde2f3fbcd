"""The NPU backend's grouped GEMM (`NpuGroupedGemm`, mixed into `NpuBackend`): per-tensor FP8/HiF8 groups on
one npu_grouped_matmul (M-split for fprop/dgrad, K-split for wgrad), MXFP8 and blockwise fprop/dgrad on its
M-split MX and G-B modes (`_grouped_block_gemm`, with the per-group arguments of `NpuGemm._quant_matmul_args`),
and the row-joining and stacking of the groups' operands (`_rows_of`, `_stacked`)."""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

from mindspeed_te.formats import FP8Dtype
from mindspeed_te.kernels.npu.common import _MAX_LAST_DIM, _per_row
from mindspeed_te.tensor import Float8BlockwiseQTensorStorage, Float8TensorStorage, MXFP8TensorStorage, joined_rows


def _rows_of(blocks: list[torch.Tensor]) -> torch.Tensor:
    """The groups' row blocks (rows, ...) as one tensor along dim 0: a view when they lie in order in one buffer
    (codes that one npu_quantize made for all experts, and their scales), else their concatenation."""
    if all(t.is_contiguous() for t in blocks):
        joined = joined_rows([t.reshape(t.shape[0], math.prod(t.shape[1:])) for t in blocks])
        if joined is not None:
            return joined.view(-1, *blocks[0].shape[1:])
    return torch.cat(blocks)


def _stacked(parts: list[torch.Tensor]) -> Optional[torch.Tensor]:
    """The groups' 2-D operands (or 3-D E8M0 pairs) stacked along a new dim 0 in the layout each has, contiguous
    or the transposed view of its first two dims (which the grouped GEMM takes for its weight and the weight's
    scales alike); None when their layouts differ. A view when they lie in order in one buffer (the codes and
    scales of experts' weights one quantize made), else a copy (`_rows_of`)."""
    if all(p.is_contiguous() for p in parts):
        return _rows_of([p.unsqueeze(0) for p in parts])
    if all(p.transpose(0, 1).is_contiguous() for p in parts):
        return _rows_of([p.transpose(0, 1).unsqueeze(0) for p in parts]).transpose(1, 2)
    return None


class NpuGroupedGemm:
    """grouped_gemm of the NPU backend (its per-group operands from `NpuGemm._quant_matmul_args`); the
    reference's one GEMM per group otherwise."""

    npu: Any

    def grouped_gemm(self, a, b, *, a_columnwise=False, b_columnwise=False, out_dtype=torch.float32, out=None):
        """Per-tensor FP8/HiF8 groups go to one npu_grouped_matmul: the M-split form for fprop/dgrad (rows of
        all groups concatenated, weights stacked), the K-split form for wgrad (the token dim split). MXFP8 and
        blockwise (1x128 by 128x128 tiles) fprop/dgrad take its M-split MX and G-B modes
        (`_grouped_block_gemm`). Other operands take one GEMM per group."""
        if not a_columnwise:
            y = self._grouped_block_gemm(a, b, b_columnwise, torch.float32 if out is not None else out_dtype)
            if y is not None:
                results = list(torch.split(y, [math.prod(t.shape[:-1]) for t in a]))
                return [o.add_(r) for o, r in zip(out, results)] if out is not None else results
        # The K-split form over fewer than 128 tokens in all reads its scales in other modes ("K小于128 ... x则选择
        # pergroup量化", aclnnGroupedMatmulV4): then one GEMM per group.
        few_tokens = a_columnwise and sum(math.prod(t.shape[:-1]) for t in a) < 128
        if not self._groupable(a, b) or (a_columnwise and not b_columnwise) or few_tokens:
            return super().grouped_gemm(a, b, a_columnwise=a_columnwise, b_columnwise=b_columnwise,
                                        out_dtype=out_dtype, out=out)
        fp8 = a[0].fp8_dtype
        hif8 = {"x_dtype": self.npu.hifloat8, "weight_dtype": self.npu.hifloat8} if fp8 is FP8Dtype.HIF8 else {}
        rows = [t.data.reshape(-1, t.shape[-1]) for t in a]
        mm_dtype = torch.float32 if out is not None else out_dtype
        if not a_columnwise:
            # x (M, K); weight (G, K, N): the stacked weight codes, transposed for fprop (W is (N, K)) and as
            # they are for dgrad (W itself is the (K, N) operand there).
            b_codes = _stacked([t.data.reshape(-1, t.shape[-1]) for t in b])
            b_codes = b_codes if b_columnwise else b_codes.transpose(1, 2)
            sizes = [r.shape[0] for r in rows]
            per_token = _per_row([t.scale_inv for t in a], sizes)
            (y,) = self.npu.npu_grouped_matmul(
                [_rows_of(rows)], [b_codes], scale=[torch.cat([t.scale_inv.reshape(1) for t in b])],
                per_token_scale=[per_token], group_list=self._group_list(sizes, rows[0].device),
                split_item=3, group_type=0, output_dtype=mm_dtype, **hif8)
            results = list(torch.split(y, sizes))
        else:
            # K-split: x = the concatenated (tokens, N) codes transposed, weight the (tokens, K) codes.
            sizes = [r.shape[0] for r in rows]
            x_rows = _rows_of([t.data.reshape(-1, t.shape[-1]) for t in b])
            (y,) = self.npu.npu_grouped_matmul(
                [_rows_of(rows).t()], [x_rows], scale=[torch.cat([t.scale_inv.reshape(1) for t in b])],
                per_token_scale=[torch.cat([t.scale_inv.reshape(1) for t in a])],
                group_list=self._group_list(sizes, rows[0].device),
                split_item=3, group_type=2, output_dtype=mm_dtype, **hif8)
            results = list(y.unbind(0))
        if out is not None:
            return [o.add_(r) for o, r in zip(out, results)]
        return results

    def _grouped_block_gemm(self, a, b, b_columnwise: bool, out_dtype: torch.dtype) -> Optional[torch.Tensor]:
        """a_i · b_iᵀ of every group as one M-split npu_grouped_matmul in the MX or G-B mode, (rows, n), or None
        when the operands do not fit one (other storages, 128x128 tiles on a, groups whose weights differ in
        shape or layout). Each group's x1, x2 and scales are those npu_quant_matmul takes in the same
        mode (`_quant_matmul_args`); the rows of a and their scales are concatenated (a view when one quantize
        made them all) and the weights and their scales stacked, transposed views as they are."""
        if not a or any(type(t) is not type(a[0]) for t in (*a, *b)):
            return None
        if not isinstance(a[0], MXFP8TensorStorage) and not (
                isinstance(a[0], Float8BlockwiseQTensorStorage) and all(t.block_scaling_dim == 1 for t in a)
                and all(t.block_scaling_dim == 2 for t in b)):
            return None
        args = [self._quant_matmul_args(ai, bi, False, b_columnwise) for ai, bi in zip(a, b)]
        if any(arg is None for arg in args) or {arg[1].shape for arg in args} != {args[0][1].shape}:
            return None
        weight, scale = _stacked([x2 for _, x2, _ in args]), _stacked([kw["scale"] for _, _, kw in args])
        if weight is None or scale is None or weight.shape[-1] > _MAX_LAST_DIM or args[0][0].shape[-1] > _MAX_LAST_DIM:
            return None
        kwargs = args[0][2]
        if kwargs.get("group_sizes") == [1, 1, 32]:
            mode = dict(scale_dtype=kwargs["scale_dtype"], per_token_scale_dtype=kwargs["pertoken_scale_dtype"])
        else:
            mode = {name: kwargs[key] for name, key in (("x_dtype", "x1_dtype"), ("weight_dtype", "x2_dtype"))
                    if key in kwargs}
        x = _rows_of([x1 for x1, _, _ in args])
        per_token = _rows_of([kw["pertoken_scale"] for _, _, kw in args])
        sizes = [x1.shape[0] for x1, _, _ in args]
        (y,) = self.npu.npu_grouped_matmul(
            [x], [weight], scale=[scale], per_token_scale=[per_token], group_list=self._group_list(sizes, x.device),
            split_item=3, group_type=0, output_dtype=out_dtype, **mode)
        return y

    @staticmethod
    def _group_list(sizes: list[int], device: torch.device) -> torch.Tensor:
        ends, total = [], 0
        for m in sizes:
            total += m
            ends.append(total)
        return torch.tensor(ends, dtype=torch.int64, device=device)

    @staticmethod
    def _groupable(a, b) -> bool:
        """Per-tensor scaled groups of one 8-bit format (the only grouped FP8 form the kernel has)."""
        tensors = list(a) + list(b)
        if not tensors or not all(isinstance(t, Float8TensorStorage) and t.data is not None for t in tensors):
            return False
        hif8 = [t.fp8_dtype is FP8Dtype.HIF8 for t in tensors]
        return all(hif8) or not any(hif8)
