"""npu_moe_token_permute / npu_moe_token_unpermute (aclnnMoeTokenPermute / aclnnMoeTokenUnpermute) and their
backward kernels npu_moe_token_permute_grad_v2 / npu_moe_token_unpermute_grad_v2 (aclnnMoeTokenPermuteGrad /
aclnnMoeTokenUnpermuteGrad).

torch_npu's autograd runs them as op-plugin's derivatives.yaml says:
  npu_moe_token_permute: "tokens: npu_moe_token_permute_grad_v2(grad, result1, tokens.sym_size(0).expect_int(),
      tokens.scalar_type(), (indices.dim() == 1) ? 1 : indices.sym_size(-1).expect_int(), padded_mode)"
  _npu_moe_token_unpermute (npu_moe_token_unpermute's autograd): "permuted_tokens, probs:
      npu_moe_token_unpermute_grad_v2(grad, sorted_indices, permuted_tokens.sym_size(0).expect_int(),
      permuted_tokens.scalar_type(), probs, padded_mode, restore_shape, permuted_tokens_for_backward)"
one kernel each way; the simulator's autograd Functions call its own counted grad kernels.

Checks take the stricter of torch_npu's document (op-plugin _op_plugin_docs.py, which lists bfloat16 tokens and
probs only) and CANN's (ops-transformer aclnnMoeTokenPermute.md & co., Ascend 950PR/950DT, Atlas A2/A3). The
documents give no accumulation precision: the sums run in float32, in pair order, rounded once to the output's
dtype (TE's precision for these kernels).

The order: op-plugin's test (test_npu_moe_token_permute_and_unpermute.py) checks the kernel against
`sorted_indices = torch.argsort(flatten_indices, stable=True)`, `permuted_tokens = tokens.index_select(0,
sorted_indices // topk)` and the kernel's second output against `torch.argsort(sorted_indices, stable=True)
.to(int32)` ("The fusion operator will perform two torch.argsort operations internally").
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from mindspeed_te.testing.npu_sim.checks import check_dims, check_int, check_none, check_shape, check_tensor, kernel
from mindspeed_te.testing.npu_sim.dtypes import FLOATS
from mindspeed_te.testing.npu_sim.errors import NpuSocError, NpuTypeError, NpuValueError

# aclnnMoeTokenPermute: indices "要求元素个数小于16777215，值大于等于0小于16777215"
INDEX_LIMIT = 16777215
# torch_npu doc (npu_moe_token_permute, 约束说明): "topK小于等于512"; aclnnMoeTokenUnpermute(Grad): "topK_num <= 512"
MAX_TOPK = 512
# torch_npu doc: tokens / permuted_tokens "数据类型torch.bfloat16", probs "支持的数据类型BFLOAT16" (CANN also takes
# FLOAT16 and FLOAT32; the stricter document holds).
TOKEN_DTYPES = (torch.bfloat16,)


def _check_sorted(name: str, sorted_indices: torch.Tensor, count: int) -> None:
    """aclnnMoeTokenUnpermute(Grad) / aclnnMoeTokenPermuteGrad: sortedIndices "shape为（tokens_num * topK_num），
    取值范围是[0, tokens_num * topK_num - 1]，且没有重复索引", INT32."""
    check_tensor(name, sorted_indices, (torch.int32,))
    check_dims(name, sorted_indices, 1, 1)
    check_shape(name, sorted_indices, (count,))
    # (torch.equal: a value check that the host-sync counters do not take for the library's own reads)
    if not torch.equal(sorted_indices.long().sort().values, torch.arange(count, device=sorted_indices.device)):
        raise NpuValueError(f"{name} must hold each of 0 .. {count - 1} once")


def _check_padded(padded_mode: Any, restore_shape: Any = None) -> None:
    # "paddedMode ... 目前仅支持false"; restoreShapeOptional "当前仅支持nullptr".
    if padded_mode is not False:
        raise NpuValueError(f"padded_mode must be False (the only mode the kernels take), got {padded_mode!r}")
    check_none("restore_shape", restore_shape, "(it applies only with padded_mode, which the kernels do not take)")


def _check_grad(name: str, grad: torch.Tensor, dtype_name: str, dtype: torch.dtype) -> None:
    """A grad kernel's incoming gradient: 2-D, a float type, and the dtype the kernel is told its forward's
    tokens had (both grad kernels' documents: the gradient is "数据类型同" those tokens)."""
    check_tensor(name, grad, FLOATS)
    check_dims(name, grad, 2, 2)
    if dtype != grad.dtype:
        raise NpuTypeError(f"{dtype_name} {dtype} must be {name}'s dtype {grad.dtype}")


def _sum_pairs(pairs: torch.Tensor) -> torch.Tensor:
    """[tokens, topK, hidden] float32 -> their sum over topK, added in pair order from zero."""
    acc = pairs.new_zeros(pairs.shape[0], pairs.shape[2])
    for j in range(pairs.shape[1]):
        acc = acc + pairs[:, j]
    return acc


class _Permute(torch.autograd.Function):
    """The forward kernel's rows and map; the backward is the simulator's npu_moe_token_permute_grad_v2."""

    @staticmethod
    def forward(ctx: Any, sim: Any, tokens: torch.Tensor, indices: torch.Tensor, num_out: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        topk = indices.shape[1]
        first = torch.argsort(indices.reshape(-1), stable=True)
        rows = torch.arange(first.numel(), device=first.device)
        sorted_out = torch.empty_like(first).scatter_(0, first, rows).to(torch.int32)  # argsort of `first`
        ctx.sim, ctx.meta = sim, (tokens.shape[0], tokens.dtype, topk)
        ctx.save_for_backward(sorted_out)
        ctx.mark_non_differentiable(sorted_out)
        ctx.set_materialize_grads(False)
        return tokens.index_select(0, torch.div(first[:num_out], topk, rounding_mode="floor")), sorted_out

    @staticmethod
    def backward(ctx: Any, grad: Optional[torch.Tensor], _grad_sorted: Any) -> tuple:
        if grad is None:
            return None, None, None, None
        (sorted_out,) = ctx.saved_tensors
        tokens_size, tokens_dtype, topk = ctx.meta
        grad_tokens = ctx.sim.npu_moe_token_permute_grad_v2(grad, sorted_out, tokens_size, tokens_dtype, topk)
        return None, grad_tokens, None, None


class _Unpermute(torch.autograd.Function):
    """The forward kernel's sums; the backward is the simulator's npu_moe_token_unpermute_grad_v2."""

    @staticmethod
    def forward(ctx: Any, sim: Any, permuted: torch.Tensor, sorted_indices: torch.Tensor,
                probs: Optional[torch.Tensor]) -> torch.Tensor:
        topk = 1 if probs is None else probs.shape[1]
        rows = permuted.index_select(0, sorted_indices.long()).float()
        pairs = rows.reshape(-1, topk, permuted.shape[1])
        if probs is not None:
            pairs = pairs * probs.float().unsqueeze(-1)
        ctx.sim = sim
        ctx.save_for_backward(permuted, sorted_indices, probs)
        ctx.set_materialize_grads(False)
        return _sum_pairs(pairs).to(permuted.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Optional[torch.Tensor]) -> tuple:
        if grad is None:
            return None, None, None, None
        permuted, sorted_indices, probs = ctx.saved_tensors
        grad_rows, grad_probs = ctx.sim.npu_moe_token_unpermute_grad_v2(
            grad, sorted_indices, permuted.shape[0], permuted.dtype, probs,
            permuted_tokens=permuted if probs is not None else None)
        return None, grad_rows, None, grad_probs


class MoeKernels:
    """npu_moe_token_permute, npu_moe_token_unpermute (differentiable) and their grad kernels."""

    def _require_moe_soc(self) -> None:
        # aclnnMoeTokenPermute / Unpermute / their Grad (ops-transformer, 产品支持情况): "Ascend 950PR/Ascend 950DT √",
        # "Atlas A3 训练系列产品 √", "Atlas A2 训练系列产品 √"; the older chips ×.
        if self.soc_family not in ("950", "A2/A3"):
            raise NpuSocError(f"the MoE permute kernels need an Ascend 950 or Atlas A2/A3 chip, not {self.soc_name}")

    @kernel(differentiable=True)
    def npu_moe_token_permute(self, tokens: torch.Tensor, indices: torch.Tensor, num_out_tokens: Optional[int] = None,
                              padded_mode: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens' rows expanded by their topK experts and sorted by expert, stable: [num_out, hidden];
        sorted_indices int32 [num_tokens * topK], the row of each (token, k) pair)."""
        self._require_moe_soc()
        # torch_npu doc: tokens "2维Tensor, shape为(num_tokens，hidden_size），数据类型torch.bfloat16";
        # indices "2维Tensor，shape为（num_tokens，topK），数据类型torch.int64" (op-plugin's meta also takes a 1-D
        # indices, CANN INT32 too).
        check_tensor("tokens", tokens, TOKEN_DTYPES)
        check_dims("tokens", tokens, 2, 2)
        check_tensor("indices", indices, (torch.int64,))
        check_dims("indices", indices, 2, 2)
        if indices.shape[0] != tokens.shape[0]:
            raise NpuValueError(f"indices {tuple(indices.shape)} must have a row per token ({tokens.shape[0]})")
        if indices.shape[1] > MAX_TOPK:
            raise NpuValueError(f"indices: topK must be at most {MAX_TOPK}, got {indices.shape[1]}")
        # "要求元素个数小于16777215，值大于等于0小于16777215"
        if indices.numel() >= INDEX_LIMIT:
            raise NpuValueError(f"indices must have fewer than {INDEX_LIMIT} elements, got {indices.numel()}")
        if not torch.equal(indices.clamp(0, INDEX_LIMIT - 1), indices):
            raise NpuValueError(f"indices values must lie in [0, {INDEX_LIMIT})")
        _check_padded(padded_mode)
        # op-plugin (op_plugin_functions.yaml): "actual_num_out_tokens: '(num_out_tokens_value > 0) ?
        # std::min(num_out_tokens_value, flatten_size) : num_out_tokens_value + flatten_size'", None as 0.
        value = 0 if num_out_tokens is None else check_int("num_out_tokens", num_out_tokens)
        num_out = min(value, indices.numel()) if value > 0 else value + indices.numel()
        if num_out < 0:
            raise NpuValueError(f"num_out_tokens={value} leaves no rows of {indices.numel()}")
        return _Permute.apply(self, tokens, indices, num_out)

    @kernel
    def npu_moe_token_permute_grad_v2(self, grad_permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor,
                                      tokens_size_0: int, tokens_dtype: torch.dtype, num_topK: int,
                                      padded_mode: bool = False) -> torch.Tensor:
        """inputGrad = permutedOutputGrad.indexSelect(0, sortedIndices).reshape(-1, topK, hidden).sum(dim=1)
        (aclnnMoeTokenPermuteGrad's formula), [tokens_size_0, hidden] of tokens_dtype."""
        self._require_moe_soc()
        # aclnnMoeTokenPermuteGrad: permutedOutputGrad "2D ... shape为（tokens_num * topK_num，hidden_size）...
        # BFLOAT16、FLOAT16、FLOAT32"; out "数据类型同permutedOutputGrad" (op-plugin allocates it as tokens_dtype).
        _check_grad("grad_permuted_tokens", grad_permuted_tokens, "tokens_dtype", tokens_dtype)
        topk = check_int("num_topK", num_topK)
        # "numTopk <= 512" (A2/A3; torch_npu's doc: topK at most 512 everywhere)
        if not 1 <= topk <= MAX_TOPK:
            raise NpuValueError(f"num_topK must be in [1, {MAX_TOPK}], got {topk}")
        count = check_int("tokens_size_0", tokens_size_0) * topk
        check_shape("grad_permuted_tokens", grad_permuted_tokens, (count, grad_permuted_tokens.shape[1]))
        _check_sorted("sorted_indices", sorted_indices, count)
        _check_padded(padded_mode)
        rows = grad_permuted_tokens.index_select(0, sorted_indices.long()).float()
        return _sum_pairs(rows.reshape(tokens_size_0, topk, -1)).to(tokens_dtype)

    @kernel(differentiable=True)
    def npu_moe_token_unpermute(self, permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor,
                                probs: Optional[torch.Tensor] = None, padded_mode: bool = False,
                                restore_shape: Optional[Sequence[int]] = None) -> torch.Tensor:
        """O[i] = sum over k of T[S[k]] * P[i][j] for k = i * topK + j (aclnnMoeTokenUnpermute's formula;
        topK = probs.shape[1], or 1 without probs): [sorted_indices.numel() // topK, hidden]."""
        self._require_moe_soc()
        # torch_npu doc: permuted_tokens "2维Tensor, shape为(num_tokens*topK，hidden_size），数据类型torch.bfloat16";
        # sorted_indices "1维Tensor，shape为（num_tokens*topK）" -- its "torch.int64" contradicts its own example
        # (dtype=torch.int32), npu_moe_token_permute's int32 output and CANN's "支持的数据类型int32": int32 here.
        check_tensor("permuted_tokens", permuted_tokens, TOKEN_DTYPES)
        check_dims("permuted_tokens", permuted_tokens, 2, 2)
        count = permuted_tokens.shape[0]
        topk = 1
        if probs is not None:
            # probs: "shape为（num_tokens，topK），支持的数据类型BFLOAT16"
            check_tensor("probs", probs, TOKEN_DTYPES)
            check_dims("probs", probs, 2, 2)
            topk = probs.shape[1]
            if topk > MAX_TOPK or probs.numel() != count:
                raise NpuValueError(f"probs {tuple(probs.shape)} must be (tokens, topK <= {MAX_TOPK}) with tokens * "
                                    f"topK = the {count} permuted rows")
        _check_sorted("sorted_indices", sorted_indices, count)
        _check_padded(padded_mode, restore_shape)
        return _Unpermute.apply(self, permuted_tokens, sorted_indices, probs)

    @kernel
    def npu_moe_token_unpermute_grad_v2(self, grad_unpermuted_tokens: torch.Tensor, sorted_indices: torch.Tensor,
                                        permuted_tokens_size_0: int, permuted_tokens_dtype: torch.dtype,
                                        probs: Optional[torch.Tensor] = None, padded_mode: bool = False,
                                        restore_shape: Optional[Sequence[int]] = None,
                                        permuted_tokens: Optional[torch.Tensor] = None
                                        ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(permutedTokensGrad[S[k]] = grad[i] * P[i][j], probsGrad[i][j] = sum over hidden of grad[i] * T[S[k]]),
        aclnnMoeTokenUnpermuteGrad's formulas; without probs topK = 1 and no probs gradient."""
        self._require_moe_soc()
        # aclnnMoeTokenUnpermuteGrad: unpermutedTokensGrad "shape为（tokens_num，hidden_size），数据类型同
        # permutedTokens"; probsOptional "2D的（tokens_num，topK_num）... BFLOAT16、FLOAT16、FLOAT32";
        # permutedTokensGradOut "数据类型同permutedTokens", probsGradOut "数据类型同probsOptional".
        _check_grad("grad_unpermuted_tokens", grad_unpermuted_tokens, "permuted_tokens_dtype", permuted_tokens_dtype)
        tokens, hidden = grad_unpermuted_tokens.shape
        topk = 1
        if probs is not None:
            check_tensor("probs", probs, FLOATS)
            check_dims("probs", probs, 2, 2)
            topk = probs.shape[1]
            check_shape("probs", probs, (tokens, topk))
            if topk > MAX_TOPK:
                raise NpuValueError(f"probs: topK must be at most {MAX_TOPK}, got {topk}")
            if permuted_tokens is None:
                raise NpuValueError("permuted_tokens is needed for the probs gradient")
        count = check_int("permuted_tokens_size_0", permuted_tokens_size_0)
        if count != tokens * topk:
            raise NpuValueError(f"permuted_tokens_size_0 {count} must be tokens * topK = {tokens * topk}")
        if permuted_tokens is not None:
            check_tensor("permuted_tokens", permuted_tokens, (permuted_tokens_dtype,))
            check_shape("permuted_tokens", permuted_tokens, (count, hidden))
        _check_sorted("sorted_indices", sorted_indices, count)
        _check_padded(padded_mode, restore_shape)
        grad = grad_unpermuted_tokens.float().unsqueeze(1)
        per_pair = grad if probs is None else grad * probs.float().unsqueeze(-1)
        grad_rows = torch.empty(count, hidden, dtype=permuted_tokens_dtype)
        grad_rows[sorted_indices.long()] = per_pair.reshape(count, hidden).to(permuted_tokens_dtype)
        grad_probs = None
        if probs is not None:
            rows = permuted_tokens.index_select(0, sorted_indices.long()).float().reshape(tokens, topk, hidden)
            grad_probs = (grad * rows).sum(dim=-1).to(probs.dtype)
        return grad_rows, grad_probs
