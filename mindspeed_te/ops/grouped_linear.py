"""Grouped (MoE) FP8 linear: expert i computes x_i · W_iᵀ + b_i on its rows x_i of the input.

One autograd function for all experts, so each of the three GEMM kinds is one grouped GEMM call (one
`npu_grouped_matmul` on an NPU): fprop and dgrad split the rows (M), wgrad splits the contraction (the
tokens, K). Each expert keeps its own quantizers, as in TransformerEngine's GroupedLinear. As in
`fp8_linear`, backward keeps only the columnwise quantized operands it reads, never high-precision copies
(except the input when wgrad stays in high precision).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from mindspeed_te.kernels import get_backend
from mindspeed_te.ops.cpu_offload import stash, unstash
from mindspeed_te.ops.linear import (
    LinearQuantizers,
    WeightCache,
    _finish_fused_wgrad,
    _main_grad,
    quantize_inputs_and_weights,
    saved_input_quantizers,
)
from mindspeed_te.ops.wgrad_store import WeightGradStore, WgradResult
from mindspeed_te.quantized_tensor import dequantize_if_quantized
from mindspeed_te.quantizers import Quantizer
from mindspeed_te.state import FP8GlobalStateManager
from mindspeed_te.tensor import QuantizedTensorStorage, joined_rows

__all__ = ["check_m_splits", "grouped_linear"]

Operand = Union[torch.Tensor, QuantizedTensorStorage]


def check_m_splits(inp: torch.Tensor, m_splits: Sequence[int], num_gemms: int) -> list[int]:
    """m_splits as ints, after checking there is one non-negative count per GEMM and they cover every row."""
    splits = [int(m) for m in m_splits]
    if len(splits) != num_gemms or any(m < 0 for m in splits) or sum(splits) != inp.shape[0]:
        raise ValueError(f"m_splits must be {num_gemms} non-negative row counts summing to the input's "
                         f"{inp.shape[0]} rows, got {list(m_splits)}")
    return splits


def _concat_rows(pieces: list[torch.Tensor], cols: int, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The experts' row blocks stacked back in order (experts without rows contribute none): the grouped GEMM's
    own output when the blocks tile it in order, else a concatenation. Never a view: an autograd function's
    output that is a view made inside it cannot be modified in place (a router's scaling, a residual add)."""
    if not pieces:
        return like.new_zeros(0, cols, dtype=dtype)
    joined = joined_rows(pieces)
    return (joined if joined is not None and joined._base is None else torch.cat(pieces)).to(dtype)


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
    wgrad_store: Optional[WeightGradStore] = None
    save_original_input: bool = False


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp: torch.Tensor, args: _GroupedArgs, *params: torch.Tensor) -> torch.Tensor:
        n = len(args.splits)
        weights, biases = params[:n], params[n:]
        backend = get_backend(inp.device)
        active = [i for i, m in enumerate(args.splits) if m > 0]
        xs = torch.split(inp, args.splits)
        needs_wgrad = any(w.requires_grad for w in weights)
        q = args.quantizers
        fp8_wgrad = q is not None and args.fp8_wgrad and needs_wgrad
        if q is None:
            a_ops: list[Operand] = [xs[i] for i in active]
            b_ops: list[Operand] = [dequantize_if_quantized(weights[i]) for i in active]
        else:
            for i in active:
                q[i].input.set_usage(rowwise=True, columnwise=fp8_wgrad and not args.save_original_input)
                q[i].weight.set_usage(rowwise=True, columnwise=inp.requires_grad)
            caches = [args.weight_caches[i] if args.weight_caches is not None else None for i in active]
            a_ops, b_ops = quantize_inputs_and_weights([xs[i] for i in active], [weights[i] for i in active],
                                                       [q[i] for i in active], caches, args.is_first_microbatch,
                                                       backend, row_blocks=True)
            observe = FP8GlobalStateManager.get_operand_observer()  # e.g. the numerics report; off: one check
            if observe is not None:
                for i, qx, qw in zip(active, a_ops, b_ops):
                    observe(weights[i], "input", xs[i], qx)
                    observe(weights[i], "weight", dequantize_if_quantized(weights[i]), qw)
        # Without biases the output's dtype straight from the GEMM (its float32 sum, scaled, rounded once, as the
        # float32 output's cast below would), which the grouped GEMM kernels write themselves.
        gemm_dtype = inp.dtype if not biases else torch.float32
        outs = backend.grouped_gemm(a_ops, b_ops, out_dtype=gemm_dtype)
        if biases:
            outs = [piece + biases[i].float() for i, piece in zip(active, outs)]  # in fp32, as in fp8_linear
        out = _concat_rows(outs, weights[0].shape[0], inp, inp.dtype)

        saved_x_quantizers: Optional[list[Quantizer]] = None  # save_original_input: quantize the inputs in backward
        if fp8_wgrad and not args.save_original_input:
            saved_x = [x.columnwise_only() for x in a_ops]
        else:  # the experts' inputs themselves: high-precision wgrad, or quantized in backward as in the forward
            saved_x = [xs[i] for i in active] if needs_wgrad else None
            if fp8_wgrad:
                saved_x_quantizers = saved_input_quantizers([q[i].input for i in active], a_ops)
        saved_w = None
        if inp.requires_grad:
            saved_w = b_ops if q is None else [w.columnwise_only() for w in b_ops]
        if saved_x is not None:  # the activations may go to host memory (cpu_offload)
            saved_x = [stash(x) for x in saved_x]
        ctx.args, ctx.active, ctx.saved = args, active, (saved_x, saved_w)
        ctx.saved_x_quantizers = saved_x_quantizers
        if q is not None and args.reduce_amax_in_backward:
            FP8GlobalStateManager.expect_backward_reduction(ctx)
        ctx.weights, ctx.input_dtype, ctx.fp8_wgrad = weights, inp.dtype, fp8_wgrad
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        args: _GroupedArgs = ctx.args
        active, (saved_x, saved_w), weights = ctx.active, ctx.saved, ctx.weights
        saved_x = [unstash(x) for x in saved_x] if saved_x is not None else None
        backend = get_backend(grad_out.device)
        n = len(args.splits)
        need_dx = ctx.needs_input_grad[0]
        need_dw = any(ctx.needs_input_grad[2: 2 + n])
        dys = torch.split(grad_out, args.splits)
        q = args.quantizers
        if q is None or not (need_dx or ctx.fp8_wgrad):
            grads: list[Operand] = [dys[i] for i in active]
        else:
            for i in active:
                q[i].grad_output.set_usage(rowwise=need_dx, columnwise=ctx.fp8_wgrad)
            grads = backend.quantize_row_blocks([q[i].grad_output for i in active], [dys[i] for i in active],
                                                len(active))
            observe = FP8GlobalStateManager.get_operand_observer()
            if observe is not None:
                for i, dy in zip(active, grads):
                    observe(weights[i], "grad_output", dys[i], dy)

        dx = None
        if need_dx:
            pieces = backend.grouped_gemm(grads, saved_w, b_columnwise=True, out_dtype=ctx.input_dtype)
            dx = _concat_rows(pieces, weights[0].shape[1], grad_out, ctx.input_dtype)

        dws: list[Optional[torch.Tensor]] = [None] * n
        if need_dw:
            if ctx.saved_x_quantizers is not None:
                for quantizer in ctx.saved_x_quantizers:
                    quantizer.set_usage(rowwise=False, columnwise=True)
                saved_x = backend.quantize_row_blocks(ctx.saved_x_quantizers, saved_x, len(saved_x))
            wgrad_a = grads if q is None or ctx.fp8_wgrad else [dys[i] for i in active]
            store = args.wgrad_store
            if store is not None and store.delay_wgrad_compute():
                # backward_dw() runs the wgrad grouped GEMM later on the same operands.
                store.put((wgrad_a, saved_x), functools.partial(_grouped_wgrad, weights, active,
                                                                args.fuse_wgrad_accumulation, backend))
            else:
                dws = [dw for _, dw in _grouped_wgrad(weights, active, args.fuse_wgrad_accumulation, backend,
                                                      wgrad_a, saved_x)]
        dbs = [dys[i].sum(dim=0).to(weights[i].dtype) for i in range(args.num_biases)]
        if q is not None and args.reduce_amax_in_backward:
            # The step's first FP8 module runs backward last: every expert's amax is recorded by now.
            FP8GlobalStateManager.reduce_backward_amaxes(ctx)
        ctx.saved = ctx.saved_x_quantizers = None
        return (dx, None, *dws, *dbs)


def _grouped_wgrad(weights: Sequence[torch.Tensor], active: list[int], fused: bool, backend,
                   wgrad_a: list[Operand], saved_x: list[Operand]) -> WgradResult:
    """Every expert's dW = dYᵀ·X as one grouped GEMM (K split by the experts' rows); with fused accumulation
    added into each `main_grad` (an expert that received no rows adds nothing), every weight then finished as
    `_finish_fused_wgrad` says. Without it, experts that received no rows get an explicit zero."""
    main_grads = [_main_grad(weights[i]) for i in active] if fused else None
    results = backend.grouped_gemm(wgrad_a, saved_x, a_columnwise=True, b_columnwise=True,
                                   out_dtype=weights[0].dtype, out=main_grads)
    if fused:
        return [(w, _finish_fused_wgrad(w)) for w in weights]
    dws: list[Optional[torch.Tensor]] = [None] * len(weights)
    for i, dw in zip(active, results):
        dws[i] = dw.to(weights[i].dtype)
    return [(w, torch.zeros_like(w) if dw is None else dw) for w, dw in zip(weights, dws)]


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
    wgrad_store: Optional[WeightGradStore] = None,
    save_original_input: bool = False,
) -> torch.Tensor:
    """Rows of `inp` (sum(m_splits), K) split along dim 0, expert i's GEMMs on its rows; high precision when
    `quantizers` (one LinearQuantizers per expert) is None, Megatron's --no-use-gmm-fp8 path. Experts with no
    rows are skipped. The keywords mean what they mean in `fp8_linear`, per expert."""
    if not weights:
        raise ValueError("grouped_linear needs at least one weight")
    if inp.dim() != 2 or any(w.shape[-1] != inp.shape[-1] for w in weights):
        raise ValueError(f"grouped_linear: input must be (rows, {weights[0].shape[-1]}) to match the weights' "
                         f"in_features, got {tuple(inp.shape)}")
    splits = check_m_splits(inp, m_splits, len(weights))
    args = _GroupedArgs(splits, quantizers, fp8_wgrad, weight_caches, is_first_microbatch,
                        fuse_wgrad_accumulation, reduce_amax_in_backward, len(biases) if biases else 0,
                        wgrad_store, save_original_input)
    return _GroupedLinear.apply(inp, args, *weights, *(biases or ()))
