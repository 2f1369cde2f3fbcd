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
from mindspeed_te.kernels.base import KernelBackend
from mindspeed_te.ops.cpu_offload import stash, unstash
from mindspeed_te.ops.linear import LinearQuantizers, _finish_fused_wgrad, _main_grad, wgrad_high_precision
from mindspeed_te.tensor import MXFP8TensorStorage


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, backend: KernelBackend, group: Any, fuse: bool):
        y, gathered = backend.all_gather_matmul(x, weight.t(), group)
        ctx.save_for_backward(gathered, weight)
        ctx.backend, ctx.group, ctx.fuse = backend, group, fuse
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        gathered, weight = ctx.saved_tensors
        dy = dy.contiguous()
        dx = ctx.backend.matmul_reduce_scatter(dy, weight, ctx.group)
        return dx, wgrad_high_precision(dy, gathered, weight, ctx.fuse), None, None, None


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, backend: KernelBackend, group: Any, fuse: bool):
        ctx.save_for_backward(x, weight)
        ctx.backend, ctx.group, ctx.fuse = backend, group, fuse
        return backend.matmul_reduce_scatter(x, weight.t(), group)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight = ctx.saved_tensors
        dx, dy_full = ctx.backend.all_gather_matmul(dy.contiguous(), weight, ctx.group)
        return dx, wgrad_high_precision(dy_full, x, weight, ctx.fuse), None, None, None


class _MatmulAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, backend: KernelBackend, group: Any, fuse: bool):
        ctx.save_for_backward(x, weight)
        ctx.fuse = fuse
        return backend.matmul_all_reduce(x, weight.t(), group)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight = ctx.saved_tensors
        dx = (dy.float() @ weight.float()).to(x.dtype)
        return dx, wgrad_high_precision(dy, x, weight, ctx.fuse), None, None, None


def mc2_linear(x: torch.Tensor, weight: torch.Tensor, backend: KernelBackend, group: Any, parallel_mode: str,
               sequence_parallel: bool, fuse_wgrad_accumulation: bool) -> torch.Tensor:
    """The fused-communication linear for `parallel_mode` ("column" needs sequence parallelism). No bias:
    the caller adds it after the communication, once."""
    world = group_size(group)
    x2d = x.reshape(-1, x.shape[-1])
    args = (backend, group, fuse_wgrad_accumulation)
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


class _MXFusedLinear(torch.autograd.Function):
    """MXFP8 through the fused kernels. Column parallel: all-gather+matmul forward, matmul+reduce-scatter dgrad,
    wgrad from the gathered columnwise input. Row parallel: matmul+reduce-scatter forward, all-gather+matmul
    dgrad, wgrad with the gathered columnwise gradient."""

    @staticmethod
    def forward(ctx, x, weight, q: LinearQuantizers, backend: KernelBackend, group, column: bool, fuse: bool):
        q.input.set_usage(rowwise=True, columnwise=True)
        q.weight.set_usage(rowwise=True, columnwise=True)
        qx, qw = backend.quantize(q.input, x), backend.quantize(q.weight, weight)
        if column:
            y = backend.all_gather_matmul_mx(qx, qw, group, b_columnwise=False, out_dtype=x.dtype)
            qx = _gather_columnwise(qx, group, group_size(group))
        else:
            y = backend.matmul_reduce_scatter_mx(qx, qw, group, b_columnwise=False, out_dtype=x.dtype)
        ctx.saved = (stash(qx), qw)  # the activation may go to host memory (cpu_offload)
        ctx.args = (q, backend, group, column, fuse, weight, x.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        qx, qw = ctx.saved
        qx = unstash(qx)
        q, backend, group, column, fuse, weight, dtype = ctx.args
        q.grad_output.set_usage(rowwise=True, columnwise=True)
        qdy = backend.quantize(q.grad_output, dy.contiguous())
        if column:
            dx = backend.matmul_reduce_scatter_mx(qdy, qw, group, b_columnwise=True, out_dtype=dtype)
        else:
            dx = backend.all_gather_matmul_mx(qdy, qw, group, b_columnwise=True, out_dtype=dtype)
            qdy = _gather_columnwise(qdy, group, group_size(group))
        dw = backend.gemm(qdy, qx, a_columnwise=True, b_columnwise=True, out_dtype=weight.dtype,
                          out=_main_grad(weight) if fuse else None)
        ctx.saved = ctx.args = None
        return dx, _finish_fused_wgrad(weight) if fuse else dw, None, None, None, None, None


def mc2_mx_linear(x: torch.Tensor, weight: torch.Tensor, quantizers: LinearQuantizers, backend: KernelBackend,
                  group: Any, parallel_mode: str, fuse_wgrad_accumulation: bool) -> torch.Tensor:
    """MXFP8 through the fused kernels, for the sequence-parallel column and row linears."""
    world = group_size(group)
    x2d = x.reshape(-1, x.shape[-1])
    column = parallel_mode == "column"
    out = _MXFusedLinear.apply(x2d, weight, quantizers, backend, group, column, fuse_wgrad_accumulation)
    lead = (x.shape[0] * world, *x.shape[1:-1]) if column else (x.shape[0] // world, *x.shape[1:-1])
    return out.reshape(*lead, weight.shape[0])
