"""Communication fused with the GEMM (`--use-ascend-mc2`): torch_npu's all-gather+matmul and
matmul+reduce-scatter / all-reduce kernels for tensor-parallel linears, in high precision and MXFP8.

Column parallel with sequence parallelism: y = all_gather(x) · Wᵀ forward, and the reverse pair backward
(dgrad = reduce_scatter(dy · W), wgrad from the gathered input the forward kernel returned). Row parallel:
y = reduce_scatter(x · Wᵀ) with sequence parallelism, all_reduce(x · Wᵀ) without.
"""
from __future__ import annotations

from typing import Any

import torch

from mindspeed_te.distributed import group_size
from mindspeed_te.ops.linear import LinearQuantizers, _finish_fused_wgrad, _main_grad, wgrad_high_precision
from mindspeed_te.tensor import MXFP8TensorStorage


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, npu: Any, hcom: str, world: int, fuse: bool):
        y, gathered = npu.npu_all_gather_base_mm(x, weight.t(), hcom, world)
        ctx.save_for_backward(gathered, weight)
        ctx.npu, ctx.hcom, ctx.world, ctx.fuse = npu, hcom, world, fuse
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        gathered, weight = ctx.saved_tensors
        dy = dy.contiguous()
        dx = ctx.npu.npu_mm_reduce_scatter_base(dy, weight, ctx.hcom, ctx.world)
        return dx, wgrad_high_precision(dy, gathered, weight, ctx.fuse), None, None, None, None


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, npu: Any, hcom: str, world: int, fuse: bool):
        ctx.save_for_backward(x, weight)
        ctx.npu, ctx.hcom, ctx.world, ctx.fuse = npu, hcom, world, fuse
        return npu.npu_mm_reduce_scatter_base(x, weight.t(), hcom, world)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight = ctx.saved_tensors
        dx, dy_full = ctx.npu.npu_all_gather_base_mm(dy.contiguous(), weight, ctx.hcom, ctx.world)
        return dx, wgrad_high_precision(dy_full, x, weight, ctx.fuse), None, None, None, None


class _MatmulAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, npu: Any, hcom: str, world: int, fuse: bool):
        ctx.save_for_backward(x, weight)
        ctx.fuse = fuse
        return npu.npu_mm_all_reduce_base(x, weight.t(), hcom)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight = ctx.saved_tensors
        dx = (dy.float() @ weight.float()).to(x.dtype)
        return dx, wgrad_high_precision(dy, x, weight, ctx.fuse), None, None, None, None


def mc2_linear(x: torch.Tensor, weight: torch.Tensor, backend: Any, group: Any, parallel_mode: str,
               sequence_parallel: bool, fuse_wgrad_accumulation: bool) -> torch.Tensor:
    """The fused-communication linear for `parallel_mode` ("column" needs sequence parallelism). No bias:
    the caller adds it after the communication, once."""
    world = group_size(group)
    x2d = x.reshape(-1, x.shape[-1])
    args = (backend.npu, backend.hcom(group), world, fuse_wgrad_accumulation)
    if parallel_mode == "column":
        out = _AllGatherMatmul.apply(x2d, weight, *args)
        lead = (x.shape[0] * world, *x.shape[1:-1])
    elif sequence_parallel:
        out = _MatmulReduceScatter.apply(x2d, weight, *args)
        lead = (x.shape[0] // world, *x.shape[1:-1])
    else:
        out = _MatmulAllReduce.apply(x2d, weight, *args)
        lead = x.shape[:-1]
    return out.reshape(*lead, weight.shape[0])


# MXFP8 ---------------------------------------------------------------------------------------------------
def _mx_pairs(scale_inv: torch.Tensor) -> torch.Tensor:
    """(rows, k/32) E8M0 bytes -> the kernels' (rows, k/64, 2) pairs."""
    return scale_inv.reshape(scale_inv.shape[0], -1, 2)


def _x2(t: MXFP8TensorStorage, columnwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A GEMM's x2 (k, n) and its scale (k/64, n, 2) from the operand form (n, k) of an MXFP8 tensor."""
    if columnwise:
        data, scale = t.columnwise_data, t.columnwise_scale_inv
    else:
        data, scale = t.rowwise_data.reshape(-1, t.shape[-1]), t.rowwise_scale_inv
    return data.t(), _mx_pairs(scale).transpose(0, 1)


def _gather_columnwise(t: MXFP8TensorStorage, group: Any, world: int) -> MXFP8TensorStorage:
    """All-gather the columnwise (k, tokens) form along the token dim: blocks of 32 tokens never straddle
    ranks when each rank holds a multiple of 32 tokens, so this equals quantizing the gathered tensor."""
    def gather(x: torch.Tensor) -> torch.Tensor:
        raw = x.contiguous().view(torch.uint8)
        parts = [torch.empty_like(raw) for _ in range(world)]
        torch.distributed.all_gather(parts, raw, group=group)
        return torch.cat(parts, dim=1).view(x.dtype)

    shape = torch.Size((t.shape[0] * world, *t.shape[1:]))
    return MXFP8TensorStorage(t.fp8_dtype, shape, t.dtype, columnwise_data=gather(t.columnwise_data),
                       columnwise_scale_inv=gather(t.columnwise_scale_inv))


class _MXAllGatherMatmul(torch.autograd.Function):
    """Column parallel + sequence parallel, MXFP8: fused all-gather+matmul forward, fused matmul+
    reduce-scatter dgrad backward, wgrad from the gathered columnwise input."""

    @staticmethod
    def forward(ctx, x, weight, q: LinearQuantizers, backend, group, hcom, world, fuse):
        q.input.set_usage(rowwise=True, columnwise=True)
        q.weight.set_usage(rowwise=True, columnwise=True)
        qx, qw = backend.quantize(q.input, x), backend.quantize(q.weight, weight)
        x2, x2_scale = _x2(qw, columnwise=False)
        y, _ = backend.npu.npu_all_gather_base_mm(
            qx.rowwise_data, x2, hcom, world, x1_scale=_mx_pairs(qx.rowwise_scale_inv), x2_scale=x2_scale,
            output_dtype=x.dtype)
        ctx.saved = (_gather_columnwise(qx, group, world), qw)
        ctx.args = (q, backend, hcom, world, fuse, weight, x.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        x_cols, qw = ctx.saved
        q, backend, hcom, world, fuse, weight, dtype = ctx.args
        q.grad_output.set_usage(rowwise=True, columnwise=True)
        qdy = backend.quantize(q.grad_output, dy.contiguous())
        x2, x2_scale = _x2(qw, columnwise=True)
        dx = backend.npu.npu_mm_reduce_scatter_base(
            qdy.rowwise_data, x2, hcom, world, x1_scale=_mx_pairs(qdy.rowwise_scale_inv), x2_scale=x2_scale,
            output_dtype=dtype)
        dw = backend.gemm(qdy, x_cols, a_columnwise=True, b_columnwise=True, out_dtype=weight.dtype,
                          out=_main_grad(weight) if fuse else None)
        ctx.saved = ctx.args = None
        return dx, _finish_fused_wgrad(weight) if fuse else dw, None, None, None, None, None, None


class _MXMatmulReduceScatter(torch.autograd.Function):
    """Row parallel + sequence parallel, MXFP8: fused matmul+reduce-scatter forward, fused all-gather+matmul
    dgrad backward, wgrad with the gathered columnwise gradient."""

    @staticmethod
    def forward(ctx, x, weight, q: LinearQuantizers, backend, group, hcom, world, fuse):
        q.input.set_usage(rowwise=True, columnwise=True)
        q.weight.set_usage(rowwise=True, columnwise=True)
        qx, qw = backend.quantize(q.input, x), backend.quantize(q.weight, weight)
        x2, x2_scale = _x2(qw, columnwise=False)
        y = backend.npu.npu_mm_reduce_scatter_base(
            qx.rowwise_data, x2, hcom, world, x1_scale=_mx_pairs(qx.rowwise_scale_inv), x2_scale=x2_scale,
            output_dtype=x.dtype)
        ctx.saved = (qx, qw)
        ctx.args = (q, backend, group, hcom, world, fuse, weight, x.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        qx, qw = ctx.saved
        q, backend, group, hcom, world, fuse, weight, dtype = ctx.args
        q.grad_output.set_usage(rowwise=True, columnwise=True)
        qdy = backend.quantize(q.grad_output, dy.contiguous())
        x2, x2_scale = _x2(qw, columnwise=True)
        dx, _ = backend.npu.npu_all_gather_base_mm(
            qdy.rowwise_data, x2, hcom, world, x1_scale=_mx_pairs(qdy.rowwise_scale_inv), x2_scale=x2_scale,
            output_dtype=dtype)
        dw = backend.gemm(_gather_columnwise(qdy, group, world), qx, a_columnwise=True, b_columnwise=True,
                          out_dtype=weight.dtype, out=_main_grad(weight) if fuse else None)
        ctx.saved = ctx.args = None
        return dx, _finish_fused_wgrad(weight) if fuse else dw, None, None, None, None, None, None


def mc2_mx_linear(x: torch.Tensor, weight: torch.Tensor, quantizers: LinearQuantizers, backend: Any, group: Any,
                  parallel_mode: str, fuse_wgrad_accumulation: bool) -> torch.Tensor:
    """MXFP8 through the fused kernels, for the sequence-parallel column and row linears."""
    world = group_size(group)
    x2d = x.reshape(-1, x.shape[-1])
    fn = _MXAllGatherMatmul if parallel_mode == "column" else _MXMatmulReduceScatter
    out = fn.apply(x2d, weight, quantizers, backend, group, backend.hcom(group), world, fuse_wgrad_accumulation)
    lead = (x.shape[0] * world, *x.shape[1:-1]) if parallel_mode == "column" else (x.shape[0] // world,
                                                                                   *x.shape[1:-1])
    return out.reshape(*lead, weight.shape[0])
