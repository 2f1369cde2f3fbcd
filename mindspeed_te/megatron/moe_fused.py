"""Torch versions of the fused MoE kernels Megatron takes from TransformerEngine: token permutation
(--moe-permute-fusion), router top-k / aux-loss scores / aux loss (--moe-router-fusion) and the router's
float32-output GEMM. Each has the call signature and return values of the TE function Megatron binds
(megatron.core.extensions.transformer_engine) and gives the outputs and gradients of Megatron's own unfused
path.

The token permutation goes through the kernel backend of the tokens' device (`moe_permute` / `moe_unpermute`:
torch index ops in the reference, torch_npu's permute kernels on an NPU); the map `fused_permute` returns
(Megatron's `sorted_indices` / `row_id_map`) is that backend's and only `fused_unpermute` reads it back. The rest
are plain torch ops, which any device runs: like TE's kernels they keep index work on the device (no host sync
when the output size is known) and compute router scores in float32.

What Megatron's alltoall dispatcher knows on the host at init is marked on its tensors (the patches call the two
`mark_*` functions): its chunk orders, the identity with one rank, which the chunk sort then skips; and the
routing maps of a dropless config, every row exactly top-k, which the NPU permute kernel's contract needs (then
taken without checking the map, a host read). The fused router's map carries the top-k experts it was made from
(`TOPK_EXPERTS`), which that kernel can take as they are, and its probs the top-k probs (`TOPK_PROBS`), which the
permute can then place without gathering them from the dense probs.
"""
from __future__ import annotations

from typing import Any, Optional, Union

import torch

from mindspeed_te.kernels import get_backend
from mindspeed_te.kernels.permutation import EXPERTS_PER_TOKEN, TOPK_EXPERTS, TOPK_PROBS, accumulation_dtype, constant

__all__ = [
    "fused_permute", "fused_permute_with_probs", "fused_unpermute", "fused_sort_chunks_by_index",
    "fused_sort_chunks_by_index_with_probs", "fused_topk_with_score_function",
    "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "te_general_gemm",
]

_EPS = 1e-20  # the sigmoid normalizer's guard, as in Megatron's unfused router
_IDENTITY_ORDER = "_mindspeed_te_identity_order"  # the attribute of a chunk order known to be the identity


# ---------------------------------------------------------------------------------------- the dispatcher's marks


def mark_identity_chunk_orders(dispatcher: Any) -> None:
    """Mark the alltoall dispatcher's chunk orders (`sort_input_by_local_experts`, `restore_output_by_local_experts`,
    made at its init) as the identity where they are: with one rank (tp_size * ep_size == 1) it receives one chunk
    per local expert, already in local-expert order. Decided from those sizes, without reading the orders (device
    tensors under --moe-permute-fusion)."""
    if dispatcher.tp_size * dispatcher.ep_size != 1:
        return
    for name in ("sort_input_by_local_experts", "restore_output_by_local_experts"):
        order = getattr(dispatcher, name, None)
        if isinstance(order, torch.Tensor):
            setattr(order, _IDENTITY_ORDER, True)


def mark_dropless_routing(dispatcher: Any, routing_map: torch.Tensor) -> None:
    """Mark `routing_map` with the k experts every token has where the dispatcher's config routes dropless: Megatron's
    router then gives each token exactly moe_router_topk experts (its top-k), unless the config drops tokens
    (moe_expert_capacity_factor) or pads the map (moe_router_padding_for_quantization)."""
    config = dispatcher.config
    if config.moe_expert_capacity_factor is None and not getattr(config, "moe_router_padding_for_quantization", False):
        setattr(routing_map, EXPERTS_PER_TOKEN, config.moe_router_topk)


# ----------------------------------------------------------------------------------------------- permutation


def fused_permute(inp: torch.Tensor, routing_map: torch.Tensor, num_out_tokens: Optional[int] = -1,
                  max_token_num: int = -1, map_type: str = "mask") -> tuple[torch.Tensor, torch.Tensor]:
    """TE's moe_permute (mask map): the rows of `inp` [num_tokens, hidden] grouped by expert as
    `routing_map` [num_tokens, num_experts] routes them -> (permuted [num_out_tokens, hidden], row map).
    num_out_tokens None or <= 0 counts the routed pairs (a host sync)."""
    if map_type != "mask":
        raise NotImplementedError("only the mask routing map (the one Megatron uses) is supported")
    permuted, _, row_map = get_backend(inp.device).moe_permute(inp, routing_map, num_out_tokens)
    return permuted, row_map


def fused_permute_with_probs(inp: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                             num_out_tokens: Optional[int] = -1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TE's moe_permute_with_probs: fused_permute plus each row's prob [num_out_tokens]
    -> (permuted, permuted_probs, row map)."""
    return get_backend(inp.device).moe_permute(inp, routing_map, num_out_tokens, probs)


def fused_unpermute(inp: torch.Tensor, row_id_map: torch.Tensor, merging_probs: Optional[torch.Tensor] = None,
                    restore_shape: Optional[torch.Size] = None, map_type: str = "mask",
                    probs: Optional[torch.Tensor] = None, pad_offsets: Optional[torch.Tensor] = None) -> torch.Tensor:
    """TE's moe_unpermute (mask map): the permuted rows `inp` summed back per token, each weighted by its
    merging_probs [num_tokens, num_experts] entry when given -> [num_tokens, hidden] (restore_shape)."""
    if map_type != "mask":
        raise NotImplementedError("only the mask routing map (the one Megatron uses) is supported")
    if pad_offsets is not None:
        raise NotImplementedError("pad_offsets come from fused_permute_and_pad_with_probs, which is not provided")
    if probs is not None:  # TE's deprecated spelling
        if merging_probs is not None:
            raise ValueError("both merging_probs and probs given")
        merging_probs = probs
    num_tokens = (restore_shape if restore_shape is not None else inp.shape)[0]
    return get_backend(inp.device).moe_unpermute(inp, row_id_map, merging_probs, num_tokens)


class _RowShuffle(torch.autograd.Function):
    """x[src] for a bijection of rows; the backward gathers with the inverse, `dest` (no accumulation)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, src: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(dest)
        return x.index_select(0, src)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (dest,) = ctx.saved_tensors
        return grad.index_select(0, dest), None, None


def _chunk_shuffle(split_sizes: torch.Tensor, sorted_index: torch.Tensor, num_rows: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(src, dest) row indices that put the chunks of sizes `split_sizes` in the order `sorted_index`,
    computed on `device` without reading the sizes on the host."""
    sizes = torch.as_tensor(split_sizes, device=device).long()
    order = torch.as_tensor(sorted_index, device=device).long()
    rows = torch.arange(num_rows, device=device)
    chunk = torch.repeat_interleave(torch.arange(sizes.numel(), device=device), sizes, output_size=num_rows)
    out_sizes = sizes.index_select(0, order)
    out_start = torch.empty_like(sizes).scatter_(0, order, out_sizes.cumsum(0) - out_sizes)
    dest = rows + (out_start - (sizes.cumsum(0) - sizes)).index_select(0, chunk)
    return torch.empty_like(dest).scatter_(0, dest, rows), dest


def fused_sort_chunks_by_index(inp: torch.Tensor, split_sizes: torch.Tensor,
                               sorted_index: torch.Tensor) -> torch.Tensor:
    """TE's moe_sort_chunks_by_index: `inp` split along dim 0 into chunks of `split_sizes`, concatenated
    in the order `sorted_index` (`inp` itself where that order is marked the identity)."""
    if getattr(sorted_index, _IDENTITY_ORDER, False):
        return inp
    src, dest = _chunk_shuffle(split_sizes, sorted_index, inp.shape[0], inp.device)
    return _RowShuffle.apply(inp, src, dest)


def fused_sort_chunks_by_index_with_probs(inp: torch.Tensor, probs: torch.Tensor, split_sizes: torch.Tensor,
                                          sorted_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """TE's moe_sort_chunks_by_index_with_probs: the same reordering of `inp` and of its per-row `probs`."""
    if getattr(sorted_index, _IDENTITY_ORDER, False):
        return inp, probs
    src, dest = _chunk_shuffle(split_sizes, sorted_index, inp.shape[0], inp.device)
    return _RowShuffle.apply(inp, src, dest), _RowShuffle.apply(probs, src, dest)


# ---------------------------------------------------------------------------------------------------- router


def _scores(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """sigmoid or sqrt(softplus) of the float32 logits (softmax is applied by the callers)."""
    if score_function == "sigmoid":
        return torch.sigmoid(logits.float())
    if score_function == "sqrtsoftplus":
        return torch.nn.functional.softplus(logits.float()).sqrt()
    raise ValueError(f"Invalid score_function: {score_function}")


def _select(scores: torch.Tensor, topk: int, num_groups: Optional[int],
            group_topk: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k over the experts; with group_topk, only over the group_topk groups (of num_groups) whose best
    topk // group_topk scores sum highest."""
    if group_topk:
        num_tokens, num_experts = scores.shape
        grouped = scores.reshape(num_tokens, num_groups, num_experts // num_groups)
        group_score = grouped.topk(topk // group_topk, dim=-1).values.sum(dim=-1)
        chosen = group_score.topk(group_topk, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter(1, chosen, True)
        keep = keep.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
        scores = scores.masked_fill(~keep, float("-inf"))
    return _TopK.apply(scores, topk)


class _TopK(torch.autograd.Function):
    """scores.topk(k) along the last dim. The backward scatters the values' gradient onto kept zeros (one launch;
    torch's makes zeros, then scatters)."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        values, index = scores.topk(k, dim=-1)
        ctx.save_for_backward(index)
        ctx.shape = tuple(scores.shape)
        ctx.mark_non_differentiable(index)
        ctx.set_materialize_grads(False)  # (no zeros made for the index's gradient)
        return values, index

    @staticmethod
    def backward(ctx, grad: Optional[torch.Tensor], _: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], None]:
        if grad is None:
            return None, None
        (index,) = ctx.saved_tensors
        return constant(0.0, ctx.shape, grad.dtype, grad.device).scatter(-1, index, grad), None


def fused_topk_with_score_function(logits: torch.Tensor, topk: int, use_pre_softmax: bool = False,
                                   num_groups: Optional[int] = None, group_topk: Optional[int] = None,
                                   scaling_factor: Optional[float] = None, score_function: str = "softmax",
                                   expert_bias: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """TE's fused_topk_with_score_function: (routing probs [num_tokens, num_experts] in the logits' dtype,
    zero off the top-k, bool routing map). Scores and probs are computed in float32; expert_bias (sigmoid /
    sqrtsoftplus) shifts only the selection."""
    shape = logits.shape
    logits2d = logits.reshape(-1, shape[-1])
    if score_function == "softmax":
        if use_pre_softmax:
            probs, index = _select(torch.softmax(logits2d, dim=-1, dtype=torch.float32), topk, num_groups, group_topk)
        else:
            top, index = _select(logits2d, topk, num_groups, group_topk)
            probs = torch.softmax(top, dim=-1, dtype=torch.float32)
    else:
        scores = _scores(logits2d, score_function)
        if expert_bias is not None:
            index = _select(scores + expert_bias.float(), topk, num_groups, group_topk)[1]
            top = scores.gather(1, index)
        else:
            top, index = _select(scores, topk, num_groups, group_topk)
        probs = top / (top.sum(dim=-1, keepdim=True) + _EPS) if topk > 1 else top
    if scaling_factor:
        probs = probs * scaling_factor
    # Scattered into kept zeros: one launch each (see `constant`)
    zeros = constant(0.0, tuple(logits2d.shape), logits.dtype, logits.device)
    top = probs.to(logits.dtype)
    routing_probs = zeros.scatter(1, index, top).view(shape)
    routing_map = constant(False, tuple(logits2d.shape), torch.bool, logits.device).scatter(1, index, True).view(shape)
    setattr(routing_map, TOPK_EXPERTS, index)
    setattr(routing_probs, TOPK_PROBS, (top, routing_probs._version))
    return routing_probs, routing_map


def fused_compute_score_for_moe_aux_loss(logits: torch.Tensor, topk: int,
                                         score_function: str) -> tuple[torch.Tensor, torch.Tensor]:
    """TE's fused_compute_score_for_moe_aux_loss: (bool top-k routing map, float32 scores normalized over
    all experts) for the load-balancing loss."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = _scores(logits, score_function)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + _EPS)
    index = scores.topk(topk, dim=-1).indices
    return constant(False, tuple(logits.shape), torch.bool, logits.device).scatter(-1, index, True), scores


def fused_moe_aux_loss(probs: torch.Tensor, tokens_per_expert: torch.Tensor,
                       total_num_tokens: Union[int, torch.Tensor], num_experts: int, topk: int,
                       coeff: float) -> torch.Tensor:
    """TE's fused_moe_aux_loss, the switch load-balancing loss
    sum_e(sum_t probs[t, e] * tokens_per_expert[e]) * num_experts * coeff / (topk * total_num_tokens ** 2),
    computed in float32 and returned in the probs' dtype."""
    acc = accumulation_dtype(probs.dtype)
    loss = torch.sum(probs.to(acc).sum(dim=0) * tokens_per_expert.to(acc))
    return (loss * (num_experts * coeff / (topk * total_num_tokens * total_num_tokens))).to(probs.dtype)


# ------------------------------------------------------------------------------------------------------ GEMM


def te_general_gemm(A: torch.Tensor, B: torch.Tensor, out_dtype: Optional[torch.dtype] = None,
                    layout: str = "TN", out: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                    grad: bool = False) -> tuple[torch.Tensor, None, None, None]:
    """Megatron's te_general_gemm wrapper of TE's general_gemm: D = op(B) @ op(A) (+ bias), op transposing
    where `layout` (A's letter, then B's) says "T"; computed in the widest of the inputs' and out_dtype
    (so 16-bit inputs give the float32 router logits exactly as Megatron's unfused .to(router_dtype) path).
    Returns (D, bias_grad, gelu_input, extra_output) like TE; only D is produced. `out` receives D."""
    if layout not in ("TN", "NN", "NT"):
        raise ValueError(f"GEMM layout {layout} not supported")
    if grad and bias is not None:
        raise NotImplementedError("the bias gradient epilogue (grad=True with bias) is not provided")
    dtype = out_dtype if out_dtype is not None else out.dtype if out is not None else A.dtype
    compute = torch.promote_types(torch.promote_types(A.dtype, B.dtype), dtype)
    a = (A.t() if layout[0] == "T" else A).to(compute)
    b = (B.t() if layout[1] == "T" else B).to(compute)
    result = torch.mm(b, a) if bias is None else torch.addmm(bias.to(compute), b, a)
    result = result.to(dtype)
    if out is not None:
        result = out.copy_(result)
    return result, None, None, None
