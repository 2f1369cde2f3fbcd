"""The torch stand-ins for megatron-core's GPU-only fused paths against megatron-core's unfused code:
MLA's fused YaRN RoPE (`fused_apply_mla_rope_for_q` / `_for_kv`, on the releases that have them: megatron-core
0.13 and later) and TE's `SplitAlongDim` (against `torch.split`, on every release).

The MLA reference is the unfused branch of `MLASelfAttention.get_query_key_value_tensors` rebuilt from the
installed release's own pieces: YaRN angles and mscale from its `YarnRotaryEmbedding`, the rotation from its
`rope_utils.apply_rotary_pos_emb`, then the split / cat / expand of the q and kv parts as that branch does.
The fused functions get the tables `get_cached_cos_sin` returns, as the fused branch passes them. Both paths
round the same ops in the same dtype, so outputs and gradients must be bitwise equal."""
from __future__ import annotations

import importlib.util
import inspect
import warnings
from types import SimpleNamespace
from typing import Optional
from unittest import mock

import pytest
import torch

from mindspeed_te.megatron.mla_rope import fused_apply_mla_rope_for_kv, fused_apply_mla_rope_for_q
from mindspeed_te.megatron.split import SplitAlongDim
from tests.test_rope import _Group

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

FUSED_MODULE = "megatron.core.fusions.fused_mla_yarn_rope_apply"


def _missing_mla_fusion() -> Optional[str]:
    """Why this release cannot be compared (None when it can): it must have the fused MLA functions and a
    YaRN embedding that hands out the cached cos / sin tables they take."""
    if importlib.util.find_spec(FUSED_MODULE) is None:
        return f"this megatron-core has no {FUSED_MODULE} (fused MLA RoPE came with 0.13)"
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    if not hasattr(YarnRotaryEmbedding, "get_cached_cos_sin"):
        return "this megatron-core's YarnRotaryEmbedding has no get_cached_cos_sin"
    return None


needs_mla_fusion = pytest.mark.skipif(_missing_mla_fusion() is not None, reason=str(_missing_mla_fusion()))

QK, EMB, V, HEADS = 6, 8, 5, 3  # qk_head_dim, qk_pos_emb_head_dim, v_head_dim, heads per partition


def _yarn(seq_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, float, torch.Tensor, torch.Tensor]:
    """(angles, mscale) as the unfused branch gets them and (cos, sin) as the fused branch does, from the
    release's YarnRotaryEmbedding (scaled enough that the YaRN ramp and mscale != 1 both matter)."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    # It places its frequencies on torch.cuda.current_device(); these tests run on the CPU.
    with mock.patch.object(torch.cuda, "current_device", lambda: "cpu"):
        rope = YarnRotaryEmbedding(EMB, scaling_factor=40.0, original_max_position_embeddings=4,
                                   mscale=1.0, mscale_all_dim=0.5)
        freqs, mscale = rope(seq_len)
        cos, sin = rope.get_cached_cos_sin(seq_len, dtype=dtype)
    assert mscale != 1.0
    return freqs, mscale, cos, sin


def _unfused_rope(x: torch.Tensor, freqs: torch.Tensor, mscale: float, cu_seqlens: Optional[torch.Tensor],
                  cp: _Group) -> torch.Tensor:
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    config = SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=True,
                             mrope_section=None)
    kwargs = {}
    if "mla_rotary_interleaved" in inspect.signature(apply_rotary_pos_emb).parameters:
        kwargs["mla_rotary_interleaved"] = True  # the MLA branch asks for it by name in newer releases
    return apply_rotary_pos_emb(x, freqs, config=config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp,
                                **kwargs)


def _unfused_mla(q: torch.Tensor, kv: torch.Tensor, k_pos_emb: torch.Tensor, freqs: torch.Tensor, mscale: float,
                 cu_seqlens: Optional[torch.Tensor], cp: _Group) -> tuple[torch.Tensor, ...]:
    """query, key, value of MLA's unfused branch (k_pos_emb already has its head axis of 1)."""
    if cu_seqlens is None or cp.size() == 1:
        freqs = freqs[: q.shape[0]]  # the branch shortens the angles except for packed sequences under CP
    q_no_pe, q_pe = torch.split(q, [QK, EMB], dim=-1)
    k_no_pe, value = torch.split(kv, [QK, V], dim=-1)
    q_pe = _unfused_rope(q_pe, freqs, mscale, cu_seqlens, cp)
    k_pe = _unfused_rope(k_pos_emb, freqs, mscale, cu_seqlens, cp)
    query = torch.cat([q_no_pe, q_pe], dim=-1)
    key = torch.cat([k_no_pe, k_pe.expand(*k_no_pe.shape[:-1], EMB)], dim=-1)
    return query.contiguous(), key.contiguous(), value.contiguous()


def _fused_mla(q: torch.Tensor, kv: torch.Tensor, k_pos_emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               cu_seqlens: Optional[torch.Tensor], cp: _Group) -> tuple[torch.Tensor, ...]:
    """The fused branch's two calls, with its positional arguments."""
    query = fused_apply_mla_rope_for_q(q, cos, sin, QK, EMB, cu_seqlens, cp.rank(), cp.size())
    key, value = fused_apply_mla_rope_for_kv(kv, k_pos_emb, cos, sin, EMB, QK, V, cu_seqlens, cp.rank(), cp.size())
    return query, key, value


def _inputs(tokens: tuple[int, ...], dtype: torch.dtype, heads: int = HEADS) -> list[torch.Tensor]:
    """q, kv and k_pos_emb (with its head axis of 1) for `tokens` = (s, b) or (t,)."""
    gen = torch.Generator().manual_seed(7)
    shapes = [(*tokens, heads, QK + EMB), (*tokens, heads, QK + V), (*tokens, 1, EMB)]
    return [torch.randn(shape, generator=gen).to(dtype).requires_grad_() for shape in shapes]


def _outputs_and_grads(fn, inputs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    outputs = fn(*inputs)
    gen = torch.Generator().manual_seed(11)
    grads_out = [torch.randn(out.shape, generator=gen).to(out.dtype) for out in outputs]
    grads = torch.autograd.grad(outputs, inputs, grads_out)
    return [out.detach() for out in outputs], list(grads)


def _assert_matches(inputs: list[torch.Tensor], freqs: torch.Tensor, mscale: float, cos: torch.Tensor,
                    sin: torch.Tensor, cu_seqlens: Optional[torch.Tensor], cp: _Group) -> None:
    ref_out, ref_grads = _outputs_and_grads(
        lambda q, kv, k: _unfused_mla(q, kv, k, freqs, mscale, cu_seqlens, cp), inputs)
    out, grads = _outputs_and_grads(lambda q, kv, k: _fused_mla(q, kv, k, cos, sin, cu_seqlens, cp), inputs)
    for name, got, want in zip(("query", "key", "value", "d q", "d kv", "d k_pos_emb"),
                               out + grads, ref_out + ref_grads):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert torch.equal(got, want), f"{name}: max |diff| {(got.float() - want.float()).abs().max().item()}"
    assert all(t.is_contiguous() for t in out)


@needs_mla_fusion
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads", [HEADS, 1])  # 1: absorbed MLA rotates the latent kv with the q function
def test_mla_rope_sbhd_matches_unfused(dtype: torch.dtype, heads: int) -> None:
    s, b = 10, 2
    freqs, mscale, cos, sin = _yarn(s + 3, dtype)  # tables longer than the sequence, as when s shrinks
    _assert_matches(_inputs((s, b), dtype, heads), freqs, mscale, cos, sin, None, _Group(1, 0))


@needs_mla_fusion
@pytest.mark.parametrize("cp_rank", [0, 1])
def test_mla_rope_sbhd_under_context_parallelism_uses_the_rank_slice(cp_rank: int) -> None:
    """sbhd under CP: Megatron hands both branches the angles of this rank's two chunks (s / cp_size local
    positions); the fused functions index them by local position and leave cp_rank / cp_size to thd."""
    cp_size, s, b, dtype = 2, 8, 2, torch.bfloat16
    freqs, mscale, cos, sin = _yarn(s * cp_size, dtype)
    chunks = torch.tensor([cp_rank, 2 * cp_size - 1 - cp_rank])
    local = [table.view(2 * cp_size, -1, *table.shape[1:])[chunks].flatten(0, 1) for table in (freqs, cos, sin)]
    _assert_matches(_inputs((s, b), dtype), local[0], mscale, local[1], local[2], None, _Group(cp_size, cp_rank))


@needs_mla_fusion
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mla_rope_thd_matches_unfused(dtype: torch.dtype) -> None:
    cu_seqlens = torch.tensor([0, 3, 10, 15], dtype=torch.int32)  # every sequence restarts at position 0
    freqs, mscale, cos, sin = _yarn(7, dtype)  # the longest sequence (max_seqlen), not the packed total
    _assert_matches(_inputs((15,), dtype), freqs, mscale, cos, sin, cu_seqlens, _Group(1, 0))


@needs_mla_fusion
@pytest.mark.parametrize("cp_rank", [0, 1])
def test_mla_rope_thd_under_context_parallelism_matches_unfused(cp_rank: int) -> None:
    """Packed sequences under CP: cu_seqlens count whole sequences, this rank holds chunks r and 2·cp-1-r of
    each, and both branches take the full (unsliced) tables."""
    cp_size, dtype = 2, torch.bfloat16
    cu_seqlens = torch.tensor([0, 8, 20, 24], dtype=torch.int32)
    freqs, mscale, cos, sin = _yarn(12, dtype)
    _assert_matches(_inputs((12,), dtype), freqs, mscale, cos, sin, cu_seqlens, _Group(cp_size, cp_rank))


@needs_mla_fusion
def test_signatures_take_megatrons_arguments() -> None:
    """Each release's parameters, in its order, lead ours (0.13 had no cp_rank / cp_size: its callers pass
    six positional arguments), and rotary_interleaved keeps its keyword and default."""
    fused = importlib.import_module(FUSED_MODULE)
    for theirs, ours in ((fused.fused_apply_mla_rope_for_q, fused_apply_mla_rope_for_q),
                         (fused.fused_apply_mla_rope_for_kv, fused_apply_mla_rope_for_kv)):
        their_params = [p for p in inspect.signature(theirs).parameters.values() if p.name != "rotary_interleaved"]
        our_params = list(inspect.signature(ours).parameters.values())
        assert [(p.name, p.default) for p in their_params] == [(p.name, p.default) for p in our_params][
            : len(their_params)]
        assert inspect.signature(ours).parameters["rotary_interleaved"].default is False


def test_interleaved_rotary_is_refused_as_megatron_does() -> None:
    q, kv, k = _inputs((4, 1), torch.float32)
    cos = sin = torch.ones(4, 1, 1, EMB)
    with pytest.raises(ValueError, match="rotary_interleaved"):
        fused_apply_mla_rope_for_q(q, cos, sin, QK, EMB, rotary_interleaved=True)
    with pytest.raises(ValueError, match="rotary_interleaved"):
        fused_apply_mla_rope_for_kv(kv, k, cos, sin, EMB, QK, V, rotary_interleaved=True)


def test_mla_rope_rejects_inconsistent_shapes() -> None:
    q, kv, k = _inputs((4, 1), torch.float32)
    cos = sin = torch.ones(4, 1, 1, EMB)
    with pytest.raises(ValueError, match="qk_head_dim"):
        fused_apply_mla_rope_for_q(q, cos, sin, QK + 1, EMB)
    with pytest.raises(ValueError, match="positions"):
        fused_apply_mla_rope_for_q(q, cos[:3], sin[:3], QK, EMB)
    with pytest.raises(ValueError, match="tokens"):
        fused_apply_mla_rope_for_kv(kv[:, 0], k[:, 0], cos, sin, EMB, QK, V, torch.tensor([0, 3]))


# SplitAlongDim ---------------------------------------------------------------------------------------------


def _split_case() -> tuple[torch.Tensor, list[int]]:
    """Megatron's call: the fused QKV [sq, b, ng, (np/ng + 2) * hn] split along dim 3."""
    return torch.randn(5, 2, 3, 4 * 6, generator=torch.Generator().manual_seed(3)), [2 * 6, 6, 6]


def test_split_along_dim_returns_torch_splits_views() -> None:
    x, sizes = _split_case()
    pieces = SplitAlongDim(x, 3, sizes)
    expected = torch.split(x, sizes, dim=3)
    assert len(pieces) == len(expected)
    for piece, want in zip(pieces, expected):
        assert torch.equal(piece, want) and piece.stride() == want.stride()
        assert piece.data_ptr() == want.data_ptr()  # a view of x, no copy


@pytest.mark.parametrize("used", [(0, 1, 2), (0, 2), (1,)])
def test_split_along_dim_gradients_match_torch_split(used: tuple[int, ...]) -> None:
    """Unused pieces get zero gradient; the pieces' gradients here are separate tensors (concatenated)."""
    x, sizes = _split_case()
    weights = [torch.randn(5, 2, 3, size) for size in sizes]

    def grad_of(split) -> torch.Tensor:
        leaf = x.clone().requires_grad_()
        pieces = split(leaf)
        sum((pieces[i] * weights[i]).sum() for i in used).backward()
        return leaf.grad

    assert torch.equal(grad_of(lambda t: SplitAlongDim(t, 3, sizes)), grad_of(lambda t: torch.split(t, sizes, 3)))


def test_split_along_dim_joins_adjacent_gradient_slices_without_a_copy() -> None:
    x, sizes = _split_case()
    leaf = x.clone().requires_grad_()
    grad_out = torch.randn(x.shape)
    seen = {}

    def keep(grad: torch.Tensor) -> None:
        seen["grad"] = grad

    leaf.register_hook(keep)
    torch.cat(SplitAlongDim(leaf, -1, sizes), dim=-1).backward(grad_out)  # cat's backward: slices of grad_out
    assert torch.equal(leaf.grad, grad_out)
    assert seen["grad"].data_ptr() == grad_out.data_ptr()


def test_split_along_dim_with_equal_chunks_and_squeeze() -> None:
    x = torch.randn(4, 3, 5, requires_grad=True)
    pieces = SplitAlongDim(x, 1, 1, True)
    assert [p.shape for p in pieces] == [torch.Size([4, 5])] * 3
    assert all(torch.equal(p, x[:, i]) for i, p in enumerate(pieces))
    (pieces[0] * 2 + pieces[2]).sum().backward()
    expected = torch.zeros(4, 3, 5)
    expected[:, 0], expected[:, 2] = 2.0, 1.0
    assert torch.equal(x.grad, expected)
