"""The NPU backend's MoE token permutation and RoPE (mixed into `NpuBackend`): torch_npu's fused kernels where
their documents' constraints hold, the reference's torch ops otherwise. The torch_npu module (or the simulator)
is the backend's `npu`; nothing here imports it.

MoE permutation: npu_moe_token_permute(tokens, indices [tokens, topK]) / npu_moe_token_unpermute, whose backward
kernels torch_npu's autograd runs (npu_moe_token_permute_grad_v2 / npu_moe_token_unpermute_grad_v2). These are
the kernels of the Ascend 950 as of Atlas A2/A3 (ops-transformer: aclnnMoeTokenPermute / Unpermute and their Grad
list "Ascend 950PR/Ascend 950DT √"; the routing-map variants list Atlas A2/A3 only). Their contract needs every
token routed to exactly topK experts ("num_tokens*topK" rows, sortedIndices "取值范围是[0, tokens_num *
topK_num - 1]，且没有重复索引"): Megatron's dropless routing, with num_out_tokens = tokens * topK. Capacity-dropped
or padded maps have other row counts and take the reference. Whether every row of the map holds exactly k experts
is read once on the host (one 1-byte read per permute), unless the map's maker marks it (`EXPERTS_PER_TOKEN`:
Megatron's alltoall dispatcher where its config routes dropless, mindspeed_te.megatron.moe_fused); an integer
num_out_tokens alone cannot tell (Megatron's drop-and-pad and flex dispatchers pass integers with uneven rows).
  forward: the map's experts per token by one stable sort of its rows (ascending, so that each token's rows sum
      in the reference's order; none for a dropless top-1 or top-2 map that holds the fused router's top-k: two
      rows sum alike in either order), the rows check (not for a marked map), the permute kernel; with probs,
      their placement (one index_add onto kept zeros at the kernel's int32 rows), after a gather from the dense
      probs unless they carry the fused router's own top-k probs for those experts (`TOPK_PROBS`). unpermute: the
      kernel (with the topK probs it sums by: ones, cached per shape, when Megatron merges no probs).
  row map: the kernel's sorted_indices (int32, the row of each (token, k) pair); the routing map and the [tokens, k]
      experts of its pairs ride along as attributes (merging probs are gathered by those). A reference map (2-D)
      stays with the reference.
  dtypes: torch_npu's document takes bfloat16 tokens and probs only (CANN also float16 / float32): others, and a
      topK above 512, take the reference.

RoPE: npu_rotary_mul(x, cos, sin, rotary_mode), backward npu_rotary_mul_backward (op-plugin's derivatives.yaml),
one kernel each way, computing in float32 and rounding once (the reference rounds each product and the sum in x's
dtype, as TE's unfused path: bit-equal for float32, within a rounding of each term for 16-bit x). 3-D x takes a
head dim of 1 ([t, 1, h, d], the SBND layout). On the 950: 4-D, last dim <= 1024 and even, tables broadcasting to x,
modes half / interleave / interleave-half (MLA's de-interleave, "mode等于3"). On Atlas A2/A3: half and interleave
only, last dim < 896, tables S11D (sbhd) or 1S1D (bshd) with B, N < 1000 (interleave: B * N < 1000), and only tables
the caller knows to lie in [-1, 1] (the document's data range for r1 / r2). Tables that need a gradient take the
reference.
"""
from __future__ import annotations

from typing import Any, Optional, Union

import torch

from mindspeed_te.kernels.npu.common import chip_family
from mindspeed_te.kernels.permutation import EXPERTS_PER_TOKEN, TOPK_EXPERTS, TOPK_PROBS, constant
from mindspeed_te.kernels.reference import ROTARY_MODES

# aclnnMoeTokenPermute: indices "要求元素个数小于16777215，值大于等于0小于16777215"
_INDEX_LIMIT = 16777215
# torch_npu doc (npu_moe_token_permute): "topK小于等于512"
_MAX_TOPK = 512
_ROUTING_MAP = "_mindspeed_te_routing_map"  # the attribute of a kernel row map holding its routing map
_EXPERTS = "_mindspeed_te_experts"  # and the [tokens, k] experts its pairs are (the permute kernel's indices)


def _expert_order(routing_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's 0/1 entries descending, the experts in that order: routed ones first, ascending): one stable
    sort of the boolean map viewed as int8 (aclnnSort's 950 output takes no BOOL)."""
    return torch.sort(routing_map.view(torch.int8), dim=1, descending=True, stable=True)


def _unordered_topk(routing_map: torch.Tensor, k: int) -> Optional[torch.Tensor]:
    """The router's own [tokens, k] experts for a dropless map of k <= 2 experts per token, in its order (no sort):
    a token's two rows sum alike in either order (one addition commutes), and the permuted rows are the same. None
    for other maps (a token's k > 2 rows must sum in the reference's order: ascending experts)."""
    experts = getattr(routing_map, TOPK_EXPERTS, None)
    if k > 2 or getattr(routing_map, EXPERTS_PER_TOKEN, None) != k or experts is None:
        return None
    return experts if tuple(experts.shape) == (routing_map.shape[0], k) else None


def _router_probs(probs: torch.Tensor, routing_map: torch.Tensor, experts: torch.Tensor) -> Optional[torch.Tensor]:
    """The fused router's [tokens, k] probs that `probs` were scattered from, in the order of `experts` (the map's
    own top-k, which the permute takes unsorted), or None: other experts, other probs, probs written since."""
    made = getattr(probs, TOPK_PROBS, None)
    if made is None or experts is not getattr(routing_map, TOPK_EXPERTS, None):
        return None
    top, version = made
    return top if probs._version == version and top.shape == experts.shape else None


def _routes_k(hits: torch.Tensor, k: int) -> bool:
    """Whether every row of the sorted map holds exactly k ones (a host read)."""
    ok = hits[:, k - 1] > hits[:, k] if k < hits.shape[1] else hits[:, k - 1] > 0
    return bool(ok.all())


def _reference_map(sorted_indices: torch.Tensor, k: int, experts: Optional[torch.Tensor],
                   num_experts: int) -> torch.Tensor:
    """The reference's [2, rows] map (token, token * num_experts + expert per row) of a kernel row map."""
    pair = torch.arange(sorted_indices.numel(), device=sorted_indices.device)
    token = torch.div(pair, k, rounding_mode="floor")
    flat = token * num_experts + experts.reshape(-1) if experts is not None else token
    pairs = torch.stack([token, flat])
    return torch.empty_like(pairs).index_copy_(1, sorted_indices.long(), pairs)


def _at_rows(pair_probs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[pairs] probs placed at their permuted rows: added onto kept zeros at the kernel's int32 row index
    (aclnnIndexAdd: index "INT64、INT32"; each row once, and 0 + p is p for the probs, which are never -0), where
    index_copy would take int64 only and a cast."""
    zeros = constant(0.0, tuple(pair_probs.shape), pair_probs.dtype, pair_probs.device)
    return zeros.index_add(0, rows, pair_probs)


class _PlaceProbs(torch.autograd.Function):
    """Each (token, expert) pair's prob gathered from the dense probs and placed at its permuted row (`_at_rows`).
    The backward gathers the rows' gradients back to the pairs and scatters them onto kept zeros (each pair once:
    a plain scatter, one launch; torch's gather backward makes zeros, then adds)."""

    @staticmethod
    def forward(ctx, probs: torch.Tensor, experts: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(experts, rows)
        ctx.num_experts = probs.shape[1]
        return _at_rows(probs.gather(1, experts).reshape(-1), rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        experts, rows = ctx.saved_tensors
        zeros = constant(0.0, (experts.shape[0], ctx.num_experts), grad.dtype, grad.device)
        return zeros.scatter(1, experts, grad.index_select(0, rows).view(experts.shape)), None, None


class _PlaceRouterProbs(torch.autograd.Function):
    """The fused router's [tokens, k] probs placed at their permuted rows as they are (`_at_rows`): no gather from
    the dense probs, and the backward's one index_select is their gradient, which reaches the router's softmax
    without the dense probs' scatter and gather."""

    @staticmethod
    def forward(ctx, top: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows)
        ctx.shape = top.shape
        return _at_rows(top.reshape(-1), rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (rows,) = ctx.saved_tensors
        return grad.index_select(0, rows).view(ctx.shape), None


class MoeRopeKernels:
    """moe_permute, moe_unpermute and rotary of the NPU backend; the reference (next in the MRO) otherwise."""

    npu: Any
    device_name: str

    # MoE permutation ------------------------------------------------------------------------------------------
    def _permute_topk(self, tokens: torch.Tensor, routing_map: torch.Tensor,
                      num_out_tokens: Optional[Union[int, torch.Tensor]], probs: Optional[torch.Tensor]
                      ) -> Optional[int]:
        """The topK the permute kernel would take (num_out_tokens / tokens), or None where it cannot apply."""
        if chip_family(self.device_name) == "" or num_out_tokens is None or isinstance(num_out_tokens, bool):
            return None
        if tokens.dim() != 2 or tokens.dtype != torch.bfloat16 or routing_map.dtype != torch.bool:
            return None
        if routing_map.dim() != 2 or routing_map.shape[0] != tokens.shape[0] or tokens.numel() == 0:
            return None
        if probs is not None and probs.shape != routing_map.shape:
            return None
        num_tokens, num_experts = routing_map.shape
        num_out = int(num_out_tokens)  # a device tensor is read here, as the reference reads it
        k = num_out // num_tokens
        if num_out <= 0 or num_out % num_tokens or not 1 <= k <= min(num_experts, _MAX_TOPK):
            return None
        return k if num_out < _INDEX_LIMIT and num_experts < _INDEX_LIMIT else None

    def moe_permute(self, tokens: torch.Tensor, routing_map: torch.Tensor,
                    num_out_tokens: Optional[Union[int, torch.Tensor]], probs: Optional[torch.Tensor] = None
                    ) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
        """npu_moe_token_permute when every token routes to exactly num_out_tokens / tokens experts (as the map's
        `EXPERTS_PER_TOKEN` says, or the rows check finds)."""
        k = self._permute_topk(tokens, routing_map, num_out_tokens, probs)
        if k is not None:
            experts = _unordered_topk(routing_map, k)
            if experts is None:
                hits, ordered = _expert_order(routing_map)
                routed = getattr(routing_map, EXPERTS_PER_TOKEN, None) == k or _routes_k(hits, k)
                experts = ordered[:, :k] if routed else None
            if experts is not None:
                permuted, sorted_indices = self.npu.npu_moe_token_permute(tokens, experts,
                                                                          num_out_tokens=experts.numel())
                setattr(sorted_indices, _ROUTING_MAP, routing_map)
                setattr(sorted_indices, _EXPERTS, experts)
                permuted_probs = None
                if probs is not None:
                    top = _router_probs(probs, routing_map, experts)
                    permuted_probs = (_PlaceRouterProbs.apply(top, sorted_indices) if top is not None
                                      else _PlaceProbs.apply(probs, experts, sorted_indices))
                return permuted, permuted_probs, sorted_indices
        return super().moe_permute(tokens, routing_map, num_out_tokens, probs)  # type: ignore[misc]

    def moe_unpermute(self, rows: torch.Tensor, row_map: torch.Tensor, merging_probs: Optional[torch.Tensor],
                      num_tokens: int) -> torch.Tensor:
        """npu_moe_token_unpermute on a kernel row map (bfloat16 rows and probs); the reference otherwise."""
        if row_map.dim() != 1:
            return super().moe_unpermute(rows, row_map, merging_probs, num_tokens)  # type: ignore[misc]
        routing_map = getattr(row_map, _ROUTING_MAP, None)
        if routing_map is None or routing_map.shape[0] != num_tokens:
            raise ValueError(f"moe_unpermute: this row map ({tuple(row_map.shape)}, {row_map.dtype}) is not one the "
                             f"NPU backend's moe_permute made for {num_tokens} tokens")
        k = row_map.numel() // num_tokens
        experts = None if merging_probs is None else getattr(row_map, _EXPERTS)
        takes = rows.dim() == 2 and rows.dtype == torch.bfloat16 and rows.shape[0] == row_map.numel()
        if takes and (merging_probs is None or (merging_probs.dtype == torch.bfloat16
                                                and merging_probs.shape == routing_map.shape)):
            if merging_probs is not None:
                probs = merging_probs.gather(1, experts)
            else:  # sum a token's k rows: unit probs (without probs the kernel takes topK = 1)
                probs = None if k == 1 else constant(1.0, (num_tokens, k), rows.dtype, rows.device)
            return self.npu.npu_moe_token_unpermute(rows, row_map, probs=probs)
        num_experts = routing_map.shape[1]
        return super().moe_unpermute(rows, _reference_map(row_map, k, experts, num_experts),  # type: ignore[misc]
                                     merging_probs, num_tokens)

    # RoPE -----------------------------------------------------------------------------------------------------
    def _rotary_applies(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str,
                        unit_tables: bool) -> bool:
        """Whether npu_rotary_mul takes these operands (as 4-D: a 3-D x gains a head dim of 1 at dim 1)."""
        family = chip_family(self.device_name)
        if family == "" or mode not in ROTARY_MODES or x.dim() not in (3, 4) or cos.dim() != x.dim():
            return False
        if x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or {cos.dtype, sin.dtype} != {x.dtype}:
            return False
        if cos.shape != sin.shape or cos.requires_grad or sin.requires_grad or x.numel() == 0:
            return False
        d = x.shape[-1]
        if cos.shape[-1] != d or d % 2:
            return False
        x_dims, table_dims = (x.shape[:-1], cos.shape[:-1])
        if x.dim() == 3:
            x_dims, table_dims = (x_dims[0], 1, *x_dims[1:]), (table_dims[0], 1, *table_dims[1:])
        if family == "950":  # "最后一维...小于等于1024"; tables broadcasting to x
            return d <= 1024 and all(c in (1, s) for c, s in zip(table_dims, x_dims))
        if mode == "interleave-half" or not unit_tables or d >= 896:  # A2/A3: "D < 896"; r1, r2 in [-1, 1]
            return False
        a, b, c = x_dims
        if tuple(table_dims) == (a, 1, 1):  # SBND, cos S11D
            batch, heads = b, c
        elif tuple(table_dims) == (1, b, 1):  # BSND, cos 1S1D
            batch, heads = a, c
        else:
            return False
        return batch < 1000 and heads < 1000 if mode == "half" else batch * heads < 1000

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str, *,
               unit_tables: bool = False) -> torch.Tensor:
        """npu_rotary_mul where it takes the operands (float32 math, one rounding), the reference otherwise."""
        if not self._rotary_applies(x, cos, sin, mode, unit_tables):
            return super().rotary(x, cos, sin, mode, unit_tables=unit_tables)  # type: ignore[misc]
        if x.dim() == 3:
            return self.npu.npu_rotary_mul(x.unsqueeze(1), cos.unsqueeze(1), sin.unsqueeze(1),
                                           rotary_mode=mode).squeeze(1)
        return self.npu.npu_rotary_mul(x, cos, sin, rotary_mode=mode)
