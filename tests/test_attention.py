"""Attention against an explicit float64 softmax(Q Kᵀ · scale + mask) V, Megatron's mask convention, GQA,
dropout through an RNG tracker, and the Megatron-facing TEDotProductAttention."""
import math
import warnings

import pytest
import torch

from mindspeed_te.modules import DotProductAttention

S, B, H, D = 12, 2, 4, 16


def reference(q, k, v, scale, allowed):
    """float64 attention on [s, b, h, d] inputs; `allowed` [b, 1 or h, s_q, s_k] or None."""
    q, k, v = (t.double().permute(1, 2, 0, 3) for t in (q, k, v))
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    logits = q @ k.transpose(-1, -2) * scale
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    out = torch.softmax(logits, dim=-1) @ v
    return out.permute(2, 0, 1, 3).reshape(q.shape[2], q.shape[0], -1)


def _qkv(groups=H, dtype=torch.float32, s_k=S):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(S, B, H, D, generator=g, dtype=dtype)
    k = torch.randn(s_k, B, groups, D, generator=g, dtype=dtype)
    v = torch.randn(s_k, B, groups, D, generator=g, dtype=dtype)
    return q, k, v


def _padding_mask():
    mask = torch.zeros(B, 1, 1, S, dtype=torch.bool)
    mask[0, ..., 9:] = True  # the last 3 keys of sequence 0 are padding
    return mask


@pytest.mark.parametrize("mask_type", ["causal", "padding", "no_mask", "padding_causal"])
@pytest.mark.parametrize("groups", [H, 2, 1])
def test_matches_float64_reference(mask_type, groups):
    q, k, v = _qkv(groups)
    attn = DotProductAttention(H, D, num_gqa_groups=groups, attn_mask_type=mask_type)
    mask = _padding_mask() if "padding" in mask_type else None
    allowed = None
    if "padding" in mask_type:
        allowed = ~mask
    if "causal" in mask_type:
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        allowed = causal if allowed is None else allowed & causal
    out = attn(q, k, v, attention_mask=mask)
    assert out.shape == (S, B, H * D)
    assert torch.allclose(out.double(), reference(q, k, v, 1 / math.sqrt(D), allowed), atol=1e-5)


def test_per_query_padding_mask_and_fully_masked_rows():
    """A [b, 1, s_q, s_k] mask; a query row with no key to attend gets zeros (not NaN) and zero gradients."""
    q, k, v = (t.requires_grad_() for t in _qkv(2))
    mask = torch.rand(B, 1, S, S, generator=torch.Generator().manual_seed(1)) < 0.3
    mask[1, :, 4, :] = True
    attn = DotProductAttention(H, D, num_gqa_groups=2, attn_mask_type="padding")
    out = attn(q, k, v, attention_mask=mask)
    out.sum().backward()
    want = reference(q.detach(), k.detach(), v.detach(), 1 / math.sqrt(D), ~mask)
    masked_row = torch.zeros(S, B, dtype=torch.bool)
    masked_row[4, 1] = True
    assert torch.allclose(out.double()[~masked_row], want[~masked_row], atol=1e-5)
    assert not out[4, 1].any() and not q.grad[4, 1].any()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_softmax_scale_bf16_and_gradients():
    q, k, v = (t.requires_grad_() for t in _qkv(2))
    attn = DotProductAttention(H, D, num_gqa_groups=2, attn_mask_type="causal", softmax_scale=0.3)
    out = attn(q, k, v)
    out.sum().backward()
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    reference(qd, kd, vd, 0.3, causal).sum().backward()
    for got, want in ((q.grad, qd.grad), (k.grad, kd.grad), (v.grad, vd.grad)):
        assert torch.allclose(got.double(), want, atol=1e-5)
    qb, kb, vb = (t.detach().bfloat16() for t in (q, k, v))
    out_bf16 = attn(qb, kb, vb)
    assert out_bf16.dtype == torch.bfloat16
    assert torch.allclose(out_bf16.double(), reference(qb, kb, vb, 0.3, causal), atol=3e-2)


def test_dropout_reproducible_under_tracker_and_off_in_eval():
    from mindspeed_te.megatron.misc import TECudaRNGStatesTracker

    tracker = TECudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 7)
    attn = DotProductAttention(H, D, attention_dropout=0.5, attn_mask_type="no_mask",
                               get_rng_state_tracker=lambda: tracker)
    q, k, v = _qkv()
    states = tracker.get_states()
    a = attn(q, k, v)
    tracker.set_states(states)
    b = attn(q, k, v)
    c = attn(q, k, v)
    assert torch.equal(a, b) and not torch.equal(a, c)
    attn.eval()
    assert torch.allclose(attn(q, k, v).double(), reference(q, k, v, 1 / math.sqrt(D), None), atol=1e-5)


def test_bad_arguments():
    with pytest.raises(ValueError, match="attn_mask_type"):
        DotProductAttention(H, D, attn_mask_type="arbitrary")
    with pytest.raises(ValueError, match="num_gqa_groups"):
        DotProductAttention(H, D, num_gqa_groups=3)
    with pytest.raises(ValueError, match="num_gqa_groups"):
        DotProductAttention(H, D, num_gqa_groups=2, tp_size=4)  # 2 key/value heads cannot split over 4 ranks
    assert DotProductAttention(H, D, num_gqa_groups=2, tp_size=2).num_heads == H // 2
    with pytest.raises(ValueError, match="attention_mask"):
        DotProductAttention(H, D, attn_mask_type="padding")(*_qkv())


def test_megatron_te_dot_product_attention():
    warnings.filterwarnings("ignore")
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mindspeed_te.megatron import TEDotProductAttention

    cfg = TransformerConfig(num_layers=1, hidden_size=H * D, num_attention_heads=H, num_query_groups=2,
                            attention_dropout=0.0)
    attn = TEDotProductAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    q, k, v = _qkv(2)
    out = attn(q, k, v, None, AttnMaskType.causal)
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    assert torch.allclose(out.double(), reference(q, k, v, 1 / math.sqrt(D), causal), atol=1e-5)
    out = attn(q, k, v, _padding_mask(), AttnMaskType.padding)
    assert torch.allclose(out.double(), reference(q, k, v, 1 / math.sqrt(D), ~_padding_mask()), atol=1e-5)
    with pytest.raises(ValueError, match="packed"):
        attn(q, k, v, None, AttnMaskType.causal, packed_seq_params=object())
