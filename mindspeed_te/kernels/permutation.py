"""The reference MoE token permutation (TE's moe_permute / moe_unpermute with a mask routing map) in torch ops,
which any device runs: what `ReferenceBackend.moe_permute` / `moe_unpermute` compute.

Like TE's kernels it keeps index work on the device (no host sync when the output size is known), accumulates
permutation sums in float32 (Megatron's unfused code sums 16-bit rows in 16 bits) and saves index maps for
backward (plus the permuted rows where merging probs need a gradient).

The row map (Megatron's `sorted_indices` / `row_id_map`) is only read back by `moe_unpermute`; it is a
[2, num_out_tokens] int64 tensor: per permuted row, its token and its flat index token * num_experts + expert
into the probs. A row no (token, expert) pair fills (only when num_out_tokens exceeds the routed pairs, which
Megatron never asks for) holds token = num_tokens and index = num_tokens * num_experts: its content is
unspecified (as in TE) and it never reaches a real token.
"""
from __future__ import annotations

import functools
from typing import Optional, Union

import torch

__all__ = ["EXPERTS_PER_TOKEN", "TOPK_EXPERTS", "TOPK_PROBS", "accumulation_dtype", "constant", "row_map",
           "gather_probs", "permute", "unpermute"]

# The attribute of a routing map whose maker knows that every row holds exactly this many experts (Megatron's
# dropless routing, marked by mindspeed_te.megatron.moe_fused): a backend whose permute kernel needs it need not
# check the map.
EXPERTS_PER_TOKEN = "_mindspeed_te_experts_per_token"
# The attribute of a routing map holding the [tokens, k] experts it was made from (the fused router's top-k), in
# any order within a token.
TOPK_EXPERTS = "_mindspeed_te_topk_experts"
# The attribute of routing probs [tokens, experts] holding (the [tokens, k] probs they were scattered from, in the
# order of the map's TOPK_EXPERTS, the probs' version counter then): a permute that takes those experts may place
# these probs directly (their gradient then skips the dense probs), unless the probs were written since.
TOPK_PROBS = "_mindspeed_te_topk_probs"


def constant(value: Union[bool, float], shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
    """A tensor filled with `value`, made once per shape and kept (unit merging probs; the zeros the router and
    the permute's gradients scatter into: an out-of-place scatter writes its own output, "aclnnScatter：需新建一个
    输出张量对象存储计算结果", so one launch with a kept base; the zero rows expert padding takes views of). Never
    write into it. Kept apart under inference mode, whose tensors autograd cannot save."""
    return _constant(value, shape, dtype, device, torch.is_inference_mode_enabled())


@functools.lru_cache(maxsize=64)  # a MoE layer keeps about ten (shapes and dtypes of its probs, maps, rows)
def _constant(value: Union[bool, float], shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
              inference: bool) -> torch.Tensor:
    return torch.full(shape, value, dtype=dtype, device=device)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Sums of 16-bit rows are accumulated in float32 (as TE's kernels do); wider types in themselves."""
    return torch.promote_types(dtype, torch.float32)


def row_map(routing_map: torch.Tensor, num_out_tokens: Optional[Union[int, torch.Tensor]]) -> torch.Tensor:
    """The [2, num_out] map of the module docstring. Rows are grouped by expert, tokens ascending within an
    expert (the order of Megatron's unfused permute); pairs beyond num_out are dropped. num_out_tokens None or
    <= 0 counts the routed pairs (a host sync)."""
    num_tokens, num_experts = routing_map.shape
    routed = routing_map.bool().t().reshape(-1)  # expert-major: pair e * num_tokens + t
    if num_tokens == 0:
        num_out = 0
    elif num_out_tokens is None or int(num_out_tokens) <= 0:
        num_out = int(routed.sum())  # TE's "-1": every routed pair (a host sync)
    else:
        num_out = int(num_out_tokens)
    row = routed.cumsum(0) - 1
    row = torch.where(routed & (row < num_out), row, num_out)  # everything else lands in a discarded slot
    none = routed.numel()
    pair = torch.full((num_out + 1,), none, dtype=torch.long, device=routed.device)
    pair = pair.scatter_(0, row, torch.arange(none, device=routed.device))[:num_out]
    filled = pair < none
    expert = torch.div(pair, max(num_tokens, 1), rounding_mode="floor")
    token = pair - expert * num_tokens
    return torch.stack([torch.where(filled, token, num_tokens),
                        torch.where(filled, token * num_experts + expert, none)])


def gather_probs(probs: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """probs[token, expert] for each permuted row (0 for an unfilled row); differentiable."""
    values = probs.reshape(-1)
    picked = values.index_select(0, flat.clamp(max=max(values.numel() - 1, 0)))
    return torch.where(flat < values.numel(), picked, picked.new_zeros(()))


class _Permute(torch.autograd.Function):
    """Row gather whose backward sums each token's rows (float32 for 16-bit grads); unfilled rows' gradient
    goes to a discarded row."""

    @staticmethod
    def forward(ctx, inp: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(token)
        ctx.num_tokens = inp.shape[0]
        return inp.index_select(0, token.clamp(max=max(inp.shape[0] - 1, 0)))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (token,) = ctx.saved_tensors
        acc = grad.new_zeros((ctx.num_tokens + 1, *grad.shape[1:]), dtype=accumulation_dtype(grad.dtype))
        return acc.index_add_(0, token, grad.to(acc.dtype))[:-1].to(grad.dtype), None


def permute(tokens: torch.Tensor, routing_map: torch.Tensor, num_out_tokens: Optional[Union[int, torch.Tensor]],
            probs: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """(rows of `tokens` grouped by expert, each row's prob when `probs` is given, the row map)."""
    rows = row_map(routing_map, num_out_tokens)
    return _Permute.apply(tokens, rows[0]), None if probs is None else gather_probs(probs, rows[1]), rows


class _Unpermute(torch.autograd.Function):
    """Sum of each token's rows, weighted by merging_probs when given, in float32 for 16-bit inputs (TE's
    precision; Megatron's unfused path sums in the promoted dtype); saves the permuted rows only when their
    probs need a gradient."""

    @staticmethod
    def forward(ctx, inp: torch.Tensor, probs: Optional[torch.Tensor], rows_map: torch.Tensor,
                num_tokens: int) -> torch.Tensor:
        token, flat = rows_map
        rows = inp.to(accumulation_dtype(inp.dtype))
        weight = None
        if probs is not None:
            weight = gather_probs(probs.detach(), flat).to(rows.dtype)
            rows = rows * weight.unsqueeze(1)
        out = rows.new_zeros((num_tokens + 1, *inp.shape[1:])).index_add_(0, token, rows)[:-1]
        probs_need_grad = probs is not None and ctx.needs_input_grad[1]
        ctx.save_for_backward(rows_map, weight, inp if probs_need_grad else None)
        ctx.probs_meta = (probs.shape, probs.dtype) if probs is not None else None
        return out.to(inp.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        rows_map, weight, inp = ctx.saved_tensors
        token, flat = rows_map
        grad_rows = grad.index_select(0, token.clamp(max=max(grad.shape[0] - 1, 0)))
        grad_inp = grad_probs = None
        if weight is None:
            grad_inp = grad_rows
        else:
            grad_rows = grad_rows.to(weight.dtype)
            if ctx.needs_input_grad[0]:
                grad_inp = (grad_rows * weight.unsqueeze(1)).to(grad.dtype)
            if inp is not None:
                shape, dtype = ctx.probs_meta
                per_row = (grad_rows * inp.to(weight.dtype)).sum(dim=-1)
                grad_probs = per_row.new_zeros(shape.numel() + 1).index_add_(0, flat, per_row)[:-1]
                grad_probs = grad_probs.view(shape).to(dtype)
        return grad_inp, grad_probs, None, None


def unpermute(rows: torch.Tensor, rows_map: torch.Tensor, merging_probs: Optional[torch.Tensor],
              num_tokens: int) -> torch.Tensor:
    """The permuted `rows` summed back per token, each weighted by its merging_probs [num_tokens, num_experts]
    entry when given -> [num_tokens, hidden]."""
    return _Unpermute.apply(rows, merging_probs, rows_map, num_tokens)
