"""Attention against an explicit float64 softmax(Q Kᵀ · scale + mask) V, Megatron's mask convention, GQA,
dropout through an RNG tracker, and the Megatron-facing TEDotProductAttention."""
import math
import os
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



def reference_sink(q, k, v, scale, allowed, offset):
    """float64 attention whose softmax denominator also holds exp(offset[h]) (an attention sink)."""
    q, k, v = (t.double().permute(1, 2, 0, 3) for t in (q, k, v))
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    logits = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    weights = logits.exp() / (logits.exp().sum(-1, keepdim=True) + offset.double().exp().reshape(1, -1, 1, 1))
    return (weights @ v).permute(2, 0, 1, 3).reshape(q.shape[2], q.shape[0], -1)


@pytest.mark.parametrize("window", [(3, 0), (2, 1), (-1, 0)])
def test_sliding_window_keeps_keys_within_the_window(window):
    q, k, v = _qkv(2)
    attn = DotProductAttention(H, D, num_gqa_groups=2, attn_mask_type="no_mask", window_size=window)
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    band = (j <= i + window[1]) & ((j >= i - window[0]) if window[0] >= 0 else True)
    assert torch.allclose(attn(q, k, v).double(), reference(q, k, v, 1 / math.sqrt(D), band), atol=1e-5)
    causal = DotProductAttention(H, D, num_gqa_groups=2, attn_mask_type="causal", window_size=window)
    assert torch.allclose(causal(q, k, v).double(), reference(q, k, v, 1 / math.sqrt(D), band & (j <= i)),
                          atol=1e-5)


def test_off_by_one_and_learnable_softmax_add_the_offset_to_the_denominator():
    q, k, v = (t.requires_grad_() for t in _qkv(2))
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    one = DotProductAttention(H, D, num_gqa_groups=2, softmax_type="off-by-one")
    assert torch.allclose(one(q, k, v).double(), reference_sink(q, k, v, 1 / math.sqrt(D), causal, torch.zeros(H)),
                          atol=1e-5)
    learnable = DotProductAttention(H, D, num_gqa_groups=2, softmax_type="learnable")
    assert torch.equal(learnable.softmax_offset.detach(), torch.zeros(H))
    with torch.no_grad():
        learnable.softmax_offset.copy_(torch.tensor([-1.0, 0.5, 2.0, 0.0]))
    out = learnable(q, k, v)
    offset = learnable.softmax_offset.detach().double().requires_grad_()
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = reference_sink(qd, kd, vd, 1 / math.sqrt(D), causal, offset)
    assert torch.allclose(out.double(), want, atol=1e-5)
    out.square().sum().backward()
    want.square().sum().backward()
    assert torch.allclose(learnable.softmax_offset.grad.double(), offset.grad, atol=1e-4)
    assert torch.allclose(q.grad.double(), qd.grad, atol=1e-4)
    with pytest.raises(ValueError, match="softmax_type"):
        DotProductAttention(H, D, softmax_type="sparsemax")


def test_packed_sequences_attend_within_their_own_sequence():
    """thd: three sequences (lengths 5, 3, 4) stored at padded offsets; each equals attention on its own,
    the padding slots give zeros."""
    lengths, padded = [5, 3, 4], [6, 4, 4]
    cu = torch.tensor([0, 5, 8, 12], dtype=torch.int32)
    cu_padded = torch.tensor([0, 6, 10, 14], dtype=torch.int32)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(sum(padded), H, D, generator=g) for _ in range(3))
    attn = DotProductAttention(H, D, attn_mask_type="padding_causal", qkv_format="thd")
    out = attn(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
               cu_seqlens_kv_padded=cu_padded)
    assert out.shape == (sum(padded), H * D)
    start = 0
    for length, slot in zip(lengths, padded):
        piece = slice(start, start + length)
        alone = reference(q[piece, None], k[piece, None], v[piece, None], 1 / math.sqrt(D),
                          torch.ones(length, length, dtype=torch.bool).tril())
        assert torch.allclose(out[piece].double(), alone[:, 0], atol=1e-5)
        assert not out[start + length:start + slot].any()
        start += slot
    with pytest.raises(ValueError, match="cu_seqlens"):
        attn(q, k, v)


def _te_attention_worker(rank: int, world: int, fmt: str, window, softmax_type: str, full: dict,
                         backend: str = "reference") -> dict:
    """Megatron's TEDotProductAttention (ours) with context parallelism `world` over gloo: this rank's
    chunks (r and 2·cp-1-r of each sequence) of the full q, k, v; returns its output and gradients (and, on the
    simulated NPU, the masks its fused attention calls took)."""
    warnings.filterwarnings("ignore")
    calls = []
    if backend == "npu":
        from mindspeed_te.kernels import BACKEND_ENV, SIMULATOR_ENV, get_backend, reset_backend

        os.environ[BACKEND_ENV], os.environ[SIMULATOR_ENV] = "npu", "1"
        reset_backend()
        sim = get_backend().npu
        kernel = sim.npu_fusion_attention
        sim.npu_fusion_attention = lambda *a, **kw: calls.append(
            (kw.get("sparse_mode", 0), tuple(kw["atten_mask"].shape))) or kernel(*a, **kw)
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mindspeed_te.megatron import TEDotProductAttention
    from mindspeed_te.modules.rope import thd_positions

    parallel_state.initialize_model_parallel(context_parallel_size=world)
    cfg = TransformerConfig(num_layers=1, hidden_size=H * D, num_attention_heads=H, num_query_groups=2,
                            attention_dropout=0.0, context_parallel_size=world, window_size=window,
                            softmax_type=softmax_type)
    attn = TEDotProductAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    if softmax_type == "learnable":
        with torch.no_grad():
            attn.softmax_offset.copy_(full["offset"][: attn.num_heads])
    cu, padded = full["cu"], full.get("padded")
    slots = cu if padded is None else padded
    index = thd_positions(slots, world, rank) if fmt == "thd" else thd_positions(torch.tensor([0, S]), world, rank)
    if fmt == "thd":  # tokens of this rank, sequence by sequence, at their offsets
        starts = torch.repeat_interleave(slots[:-1], (slots[1:] - slots[:-1]) // world)
        index = starts + index
    q, k, v = (full[n][index].clone().requires_grad_() for n in ("q", "k", "v"))
    packed = (PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded,
                              cu_seqlens_kv_padded=padded, max_seqlen_q=16, max_seqlen_kv=16)
              if fmt == "thd" else None)
    out = attn(q, k, v, None, AttnMaskType.causal, packed_seq_params=packed)
    (out * full["dout"][index]).sum().backward()
    parallel_state.destroy_model_parallel()
    return {"index": index, "out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "calls": calls}


@pytest.mark.slow
@pytest.mark.parametrize("fmt,window,softmax_type,backend", [
    ("sbhd", None, "vanilla", "reference"), ("sbhd", (3, 0), "off-by-one", "reference"),
    ("thd", None, "learnable", "reference"), ("thd", (2, 0), "vanilla", "reference"),
    ("sbhd", (3, 0), "vanilla", "reference"), ("sbhd", None, "vanilla", "npu"), ("sbhd", (3, 0), "vanilla", "npu"),
    ("sbhd", None, "learnable", "npu"), ("thd", None, "vanilla", "npu"), ("thd", None, "learnable", "npu"),
    ("thd padded", None, "vanilla", "reference"), ("thd padded", None, "vanilla", "npu")])
def test_context_parallel_attention_matches_one_process(fmt, window, softmax_type, backend):
    """CP=2 over gloo (keys and values gathered, their gradients reduce-scattered back): every rank's
    output and q/k/v gradients equal full attention on one process (the reference backend). Causal sbhd
    attention takes each local chunk against the keys up to it, a causal block aligned at its bottom-right
    corner: on the simulated NPU each is the fused kernel's sparse_mode 3 (4 with a window) on the compressed
    mask, never a mask of the sequence's size (a learnable softmax offset is the kernel's sink); causal packed
    sequences (thd) likewise, every local chunk against its sequence's keys up to it in one varlen call."""
    from tests.dist_utils import run_distributed

    g = torch.Generator().manual_seed(11)
    cu = torch.tensor([0, 8, 20, 24], dtype=torch.int32)
    extra = {}
    if fmt == "thd padded":  # sequences of 6, 13 and 3 tokens in slots of 8, 16 and 4 (whole 2·cp chunks)
        fmt, cu = "thd", torch.tensor([0, 6, 19, 22], dtype=torch.int32)
        extra["padded"] = torch.tensor([0, 8, 24, 28], dtype=torch.int32)
    tokens = S if fmt == "sbhd" else int(extra.get("padded", cu)[-1])
    shape = (tokens, B, H, D) if fmt == "sbhd" else (tokens, H, D)
    kv_shape = shape[:-2] + (2, D)
    full = {"q": torch.randn(shape, generator=g), "k": torch.randn(kv_shape, generator=g),
            "v": torch.randn(kv_shape, generator=g), "dout": torch.randn(shape[:-2] + (H * D,), generator=g),
            "offset": torch.tensor([0.3, -0.7, 1.1, 0.0]), "cu": cu, **extra}
    single = run_distributed(_te_attention_worker, 1, fmt, window, softmax_type, full)[0]
    for part in run_distributed(_te_attention_worker, 2, fmt, window, softmax_type, full, backend):
        index = part["index"]
        for name in ("out", "dq", "dk", "dv"):
            assert torch.allclose(part[name], single[name][index], atol=1e-5), name
        if backend == "npu":  # sbhd: each local chunk; thd: all of them in one varlen call
            calls = 2 if fmt == "sbhd" else 1
            assert part["calls"] == [(3 if window is None else 4, (2048, 2048))] * calls, part["calls"]


@pytest.mark.parametrize("recipe", ["MXFP8BlockScaling", "Float8BlockScaling"])
def test_fp8_dpa_under_a_recipe_without_fp8_attention_warns_and_stays_in_high_precision(recipe):
    """fp8_dpa / fp8_mha (Megatron's fp8_dot_product_attention / fp8_multi_head_attention) run attention in FP8
    under the per-tensor recipes (tests/test_fp8_attention.py); under a block-scaled recipe mindspeed_te says,
    naming the recipe, that attention stays in high precision instead of silently ignoring the flag."""
    import mindspeed_te
    from mindspeed_te import DelayedScaling, fp8_autocast

    q, k, v = _qkv(2)
    attn = DotProductAttention(H, D, num_gqa_groups=2, attn_mask_type="causal")
    plain = attn(q, k, v)
    for flag in ("fp8_dpa", "fp8_mha"):
        with pytest.warns(UserWarning, match=f"fp8_dpa / fp8_mha .* under {recipe}: .* stays in high precision"):
            with fp8_autocast(fp8_recipe=getattr(mindspeed_te, recipe)(**{flag: True})):
                out = attn(q, k, v)
        assert torch.equal(out, plain)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with fp8_autocast(fp8_recipe=DelayedScaling()):
            assert torch.equal(attn(q, k, v), plain)  # without fp8_dpa attention is not quantized
        with fp8_autocast(fp8_recipe=DelayedScaling(fp8_dpa=True)):
            assert not torch.equal(attn(q, k, v), plain)


def test_packed_chunk_plans_are_made_once_per_micro_batch_and_apart_under_inference_mode():
    """The keys' index of causal packed sequences under context parallelism is made once per cu_seqlens tensor
    (every layer of a micro-batch shares it), and apart under inference mode, whose tensors autograd cannot save
    (index_select's backward needs the index). Rank 0 of 2: sequences of 8 and 4 tokens in chunks of 2 and 1."""
    from mindspeed_te.modules.attention import _packed_chunks

    cu = torch.tensor([0, 8, 12], dtype=torch.int32)
    plan = _packed_chunks(cu, None, 2, 0, torch.device("cpu"))
    assert _packed_chunks(cu, None, 2, 0, torch.device("cpu")) is plan
    # rank 0 holds chunks 0 and 3 (6 tokens); chunk m of a sequence is on rank m or 3 - m, rank 1's tokens from 6
    assert plan.index.tolist() == [0, 1] + [0, 1, 6, 7, 8, 9, 2, 3] + [4] + [4, 10, 11, 5]
    assert plan.cu_q.tolist() == [0, 2, 4, 5, 6] and plan.cu_kv.tolist() == [0, 2, 10, 11, 15]
    assert plan.padding is None
    with torch.inference_mode():
        inference = _packed_chunks(cu, None, 2, 0, torch.device("cpu"))
    assert inference is not plan and inference.index.is_inference() and not plan.index.is_inference()


def _causal_closed_form(s_q: int, s_k: int, bottom_right: bool, window=None) -> torch.Tensor:
    """Query i (at key position i, or i + s_k - s_q bottom-right aligned) sees key j iff j <= its position, and
    with a window (left, right) iff j also lies within left before and right after the bottom-right position."""
    shift = s_k - s_q
    pos = torch.arange(s_q)[:, None] + (shift if bottom_right else 0)
    j = torch.arange(s_k)[None, :]
    allowed = j <= pos
    if window is not None:
        left, right = window
        br = torch.arange(s_q)[:, None] + shift
        allowed &= (j >= br - left) if left >= 0 else True
        allowed &= (j <= br + right) if right >= 0 else True
    return allowed


def test_causal_masks_kept_for_reuse_stay_within_their_byte_budget():
    """Every layer of a micro-batch asks for the same causal matrix, so it is made once (the same tensor comes
    back); but the matrices kept (s_q * s_k bytes each, 1 GiB at 32k tokens) never hold more than
    MASK_CACHE_BYTES in all, over many shapes, and each matrix is the closed form's. What the cache keeps is what
    stays alive after the caller drops its references."""
    import gc
    import weakref

    from mindspeed_te.kernels import masks

    budget = getattr(masks, "MASK_CACHE_BYTES", 64 << 20)
    mask = masks.CausalMask(causal=True, bottom_right=True)
    first = mask.allowed(300, 301, torch.device("cpu"))
    assert mask.allowed(300, 301, torch.device("cpu")) is first  # one mask per micro-batch, not per layer
    del first
    alive: list[weakref.ref] = []
    for i in range(24):  # 2400 x 2400 up to 4700 x 4700 bytes: 16 of them are far over 64 MiB
        s = 2400 + 100 * i
        made = mask.allowed(s, s + 7, torch.device("cpu"))
        assert torch.equal(made, _causal_closed_form(s, s + 7, bottom_right=True))
        alive.append(weakref.ref(made))
        del made
        gc.collect()
        held = sum(ref().nbytes for ref in alive if ref() is not None)
        assert held <= budget, f"{held} bytes of masks kept after {i + 1} shapes, budget {budget}"


def test_a_causal_mask_over_the_budget_is_made_and_not_kept(monkeypatch):
    import weakref

    from mindspeed_te.kernels import masks

    monkeypatch.setattr(masks, "MASK_CACHE_BYTES", 1 << 16, raising=False)
    mask = masks.CausalMask(causal=True, bottom_right=True, window=(5, 0))
    big = mask.allowed(300, 300, torch.device("cpu"))  # 90000 bytes > 64 KiB
    assert torch.equal(big, _causal_closed_form(300, 300, bottom_right=True, window=(5, 0)))
    ref = weakref.ref(big)
    del big
    assert ref() is None
    small = mask.allowed(100, 120, torch.device("cpu"))  # 12000 bytes: kept
    assert torch.equal(small, _causal_closed_form(100, 120, bottom_right=True, window=(5, 0)))
    assert mask.allowed(100, 120, torch.device("cpu")) is small
