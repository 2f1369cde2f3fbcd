"""Communication fused with the GEMM (`--use-ascend-mc2`): torch_npu's all-gather+matmul and
matmul+reduce-scatter / all-reduce kernels for tensor-parallel linears in high precision.

Column parallel with sequence parallelism: y = all_gather(x) · Wᵀ forward, and the reverse pair backward
(dgrad = reduce_scatter(dy · W), wgrad from the gathered input the forward kernel returned). Row parallel:
y = reduce_scatter(x · Wᵀ) with sequence parallelism, all_reduce(x · Wᵀ) without.
"""
from __future__ import annotations

from typing import Any

import torch

from mindspeed_te.distributed import group_size
from mindspeed_te.ops.linear import _finish_fused_wgrad, _main_grad


def _wgrad(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, fuse: bool):
    if fuse:
        _main_grad(weight).addmm_(dy.t().float(), x.float())
        return _finish_fused_wgrad(weight)
    return (dy.t().float() @ x.float()).to(weight.dtype)


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
        return dx, _wgrad(dy, gathered, weight, ctx.fuse), None, None, None, None


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
        return dx, _wgrad(dy_full, x, weight, ctx.fuse), None, None, None, None


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
        return dx, _wgrad(dy, x, weight, ctx.fuse), None, None, None, None


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
