"""Grouped (MoE) FP8 linear: expert i computes x_i · W_iᵀ + b_i on its rows x_i of the input.

Each expert's three GEMMs are the FP8 linear function's, with that expert's quantizers. The backward amax
reduction, when this is the step's first FP8 module, waits for every expert's backward: it hangs off an
identity node in front of the split, whose backward runs once all expert gradients have reached the input.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from mindspeed_te.ops.linear import LinearQuantizers, WeightCache, fp8_linear
from mindspeed_te.state import FP8GlobalStateManager


class _ReduceAmaxAfterBackward(torch.autograd.Function):
    """Identity; its backward (the last of the grouped module's) reduces the backward amaxes."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=False)
        return grad


def check_m_splits(inp: torch.Tensor, m_splits: Sequence[int], num_gemms: int) -> list[int]:
    splits = [int(m) for m in m_splits]
    if len(splits) != num_gemms or any(m < 0 for m in splits) or sum(splits) != inp.shape[0]:
        raise ValueError(f"m_splits must be {num_gemms} non-negative row counts summing to the input's "
                         f"{inp.shape[0]} rows, got {list(m_splits)}")
    return splits


def grouped_linear(
    inp: torch.Tensor,
    m_splits: Sequence[int],
    weights: Sequence[torch.Tensor],
    biases: Optional[Sequence[Optional[torch.Tensor]]] = None,
    *,
    quantizers: Optional[Sequence[LinearQuantizers]] = None,
    fp8_wgrad: bool = True,
    weight_caches: Optional[Sequence[WeightCache]] = None,
    is_first_microbatch: Optional[bool] = None,
    fuse_wgrad_accumulation: bool = False,
    reduce_amax_in_backward: bool = False,
) -> torch.Tensor:
    """Rows of `inp` (sum(m_splits), K) split along dim 0, one GEMM per expert; high precision when
    `quantizers` is None (Megatron's --no-use-gmm-fp8 path). Experts with no rows cost nothing."""
    splits = check_m_splits(inp, m_splits, len(weights))
    if reduce_amax_in_backward and inp.requires_grad:
        inp = _ReduceAmaxAfterBackward.apply(inp)
    outs = []
    for i, (x, w) in enumerate(zip(torch.split(inp, splits), weights)):
        b = biases[i] if biases is not None else None
        if x.shape[0] == 0:
            outs.append(x.new_zeros(0, w.shape[0]))
            continue
        outs.append(fp8_linear(
            x, w, b,
            quantizers=quantizers[i] if quantizers is not None else None,
            fp8_wgrad=fp8_wgrad,
            weight_cache=weight_caches[i] if weight_caches is not None else None,
            is_first_microbatch=is_first_microbatch,
            fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            # Without an input gradient there is no identity node: the last expert's backward reduces.
            reduce_amax_in_backward=reduce_amax_in_backward and not inp.requires_grad and i == len(weights) - 1,
        ))
    return torch.cat(outs, dim=0)
