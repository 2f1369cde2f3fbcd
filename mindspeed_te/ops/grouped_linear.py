"""Grouped (MoE) FP8 linear: expert i computes x_i · W_iᵀ + b_i on its rows x_i of the input.

One autograd function for all experts, so each of the three GEMM kinds is one grouped GEMM call (one
`npu_grouped_matmul` on an NPU): fprop and dgrad split the rows (M), wgrad splits the contraction (the
tokens, K). Each expert keeps its own quantizers, as in TransformerEngine's GroupedLinear.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from mindspeed_te.kernels import get_backend
from mindspeed_te.ops.linear import LinearQuantizers, WeightCache, _finish_fused_wgrad, _main_grad
from mindspeed_te.state import FP8GlobalStateManager


def check_m_splits(inp: torch.Tensor, m_splits: Sequence[int], num_gemms: int) -> list[int]:
    splits = [int(m) for m in m_splits]
    if len(splits) != num_gemms or any(m < 0 for m in splits) or sum(splits) != inp.shape[0]:
        raise ValueError(f"m_splits must be {num_gemms} non-negative row counts summing to the input's "
                         f"{inp.shape[0]} rows, got {list(m_splits)}")
    return splits


@dataclass
class _GroupedArgs:
    splits: list[int]
    quantizers: Optional[Sequence[LinearQuantizers]]
    fp8_wgrad: bool
    weight_caches: Optional[Sequence[WeightCache]]
    is_first_microbatch: Optional[bool]
    fuse_wgrad_accumulation: bool
    reduce_amax_in_backward: bool
    num_biases: int


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp: torch.Tensor, args: _GroupedArgs, *params: torch.Tensor) -> torch.Tensor:
        n = len(args.splits)
        weights, biases = params[:n], params[n:]
        backend = get_backend(inp.device)
        active = [i for i, m in enumerate(args.splits) if m > 0]
        xs = torch.split(inp, args.splits)
        q = args.quantizers
        fp8_wgrad = q is not None and args.fp8_wgrad and any(w.requires_grad for w in weights)
        if q is None:
            saved_x, saved_w = [xs[i] for i in active], [weights[i] for i in active]
            outs = backend.grouped_gemm(saved_x, saved_w, out_dtype=torch.float32)
        else:
            saved_x, saved_w = [], []
            for i in active:
                q[i].input.set_usage(rowwise=True, columnwise=fp8_wgrad)
                q[i].weight.set_usage(rowwise=True, columnwise=inp.requires_grad)
                saved_x.append(backend.quantize(q[i].input, xs[i]))
                cache = args.weight_caches[i] if args.weight_caches is not None else None
                saved_w.append(cache.get(weights[i], q[i].weight, args.is_first_microbatch, backend)
                               if cache is not None else backend.quantize(q[i].weight, weights[i]))
            outs = backend.grouped_gemm(saved_x, saved_w, out_dtype=torch.float32)
            if not fp8_wgrad:
                saved_x = [xs[i] for i in active]
        out = inp.new_zeros(inp.shape[0], weights[0].shape[0])
        for i, piece in zip(active, outs):
            rows = out[sum(args.splits[:i]): sum(args.splits[: i + 1])]
            rows.copy_(piece if not biases else piece + biases[i].float())  # bias added in fp32, as in fp8_linear
        ctx.args, ctx.active, ctx.saved = args, active, (saved_x, saved_w)
        ctx.weights, ctx.input_dtype, ctx.fp8_wgrad = weights, inp.dtype, fp8_wgrad
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        args: _GroupedArgs = ctx.args
        active, (saved_x, saved_w), weights = ctx.active, ctx.saved, ctx.weights
        backend = get_backend(grad_out.device)
        need_dx = ctx.needs_input_grad[0]
        n = len(args.splits)
        dys = torch.split(grad_out, args.splits)
        q = args.quantizers
        if q is None:
            grads = [dys[i] for i in active]
        else:
            grads = []
            for i in active:
                q[i].grad_output.set_usage(rowwise=need_dx, columnwise=ctx.fp8_wgrad)
                grads.append(backend.quantize(q[i].grad_output, dys[i]))
        dx = None
        if need_dx:
            dx = grad_out.new_zeros(grad_out.shape[0], weights[0].shape[1], dtype=ctx.input_dtype)
            pieces = backend.grouped_gemm(grads, saved_w, b_columnwise=True, out_dtype=ctx.input_dtype)
            for i, piece in zip(active, pieces):
                dx[sum(args.splits[:i]): sum(args.splits[: i + 1])] = piece
        dws: list[Optional[torch.Tensor]] = [None] * n
        if any(ctx.needs_input_grad[2: 2 + n]):
            wgrad_a = grads if ctx.fp8_wgrad or q is None else [dys[i] for i in active]
            fused = args.fuse_wgrad_accumulation
            outs = [_main_grad(weights[i]) for i in active] if fused else None
            results = backend.grouped_gemm(wgrad_a, saved_x, a_columnwise=True, b_columnwise=True,
                                           out_dtype=weights[0].dtype, out=outs)
            for i, dw in zip(active, results):
                dws[i] = _finish_fused_wgrad(weights[i]) if fused else dw.to(weights[i].dtype)
            if not fused:
                for i in range(n):
                    if dws[i] is None:
                        dws[i] = torch.zeros_like(weights[i])
        dbs = [dy.sum(dim=0).to(weights[0].dtype) for dy in dys][: args.num_biases]
        if q is not None and args.reduce_amax_in_backward:
            FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=False)
        ctx.saved = None
        return (dx, None, *dws, *dbs)


def grouped_linear(
    inp: torch.Tensor,
    m_splits: Sequence[int],
    weights: Sequence[torch.Tensor],
    biases: Optional[Sequence[torch.Tensor]] = None,
    *,
    quantizers: Optional[Sequence[LinearQuantizers]] = None,
    fp8_wgrad: bool = True,
    weight_caches: Optional[Sequence[WeightCache]] = None,
    is_first_microbatch: Optional[bool] = None,
    fuse_wgrad_accumulation: bool = False,
    reduce_amax_in_backward: bool = False,
) -> torch.Tensor:
    """Rows of `inp` (sum(m_splits), K) split along dim 0, expert i's GEMMs on its rows; high precision when
    `quantizers` is None (Megatron's --no-use-gmm-fp8 path). Experts with no rows are skipped."""
    splits = check_m_splits(inp, m_splits, len(weights))
    args = _GroupedArgs(splits, quantizers, fp8_wgrad, weight_caches, is_first_microbatch,
                        fuse_wgrad_accumulation, reduce_amax_in_backward, len(biases) if biases else 0)
    return _GroupedLinear.apply(inp, args, *weights, *(biases or ()))
