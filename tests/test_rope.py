"""Rotary position embedding (TE's apply_rotary_pos_emb contract and Megatron's fused RoPE names) against
closed-form rotations and megatron-core's own unfused implementation."""
from __future__ import annotations

import math
import warnings

import pytest
import torch

from mindspeed_te.modules.rope import apply_rotary_pos_emb, thd_positions

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")


def _freqs(s: int, d: int, interleaved: bool = False) -> torch.Tensor:
    """Megatron's RotaryEmbedding layout: [s, 1, 1, d], halves (or pairs, interleaved) share an angle."""
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = torch.outer(torch.arange(s, dtype=torch.float32), inv)
    emb = torch.stack((angles, angles), -1).flatten(-2) if interleaved else torch.cat((angles, angles), -1)
    return emb[:, None, None, :]


def test_a_unit_vector_turns_by_its_angle():
    d, pos = 8, 3
    freqs = _freqs(5, d)
    t = torch.zeros(5, 1, 1, d)
    t[:, :, :, 1] = 1.0  # the first half's channel 1 pairs with channel 1 + d/2
    out = apply_rotary_pos_emb(t, freqs)
    angle = pos / 10000 ** (2 / d)
    assert out[pos, 0, 0, 1].item() == pytest.approx(math.cos(angle), abs=1e-6)
    assert out[pos, 0, 0, 1 + d // 2].item() == pytest.approx(math.sin(angle), abs=1e-6)
    assert torch.allclose(out.norm(dim=-1), torch.ones(5, 1, 1))


def test_channels_beyond_the_rotary_dims_pass_through():
    t = torch.randn(6, 2, 3, 16)
    out = apply_rotary_pos_emb(t, _freqs(6, 8))
    assert torch.equal(out[..., 8:], t[..., 8:]) and not torch.equal(out[..., :8], t[..., :8])


mcore_rope = pytest.importorskip("megatron.core.models.common.embeddings.rope_utils")


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sbhd_and_bshd_equal_megatrons_unfused_rope(interleaved, dtype):
    t = torch.randn(12, 2, 4, 16, dtype=dtype)
    freqs = _freqs(16, 8, interleaved)
    expected = mcore_rope._apply_rotary_pos_emb_bshd(t, freqs[:12], rotary_interleaved=interleaved)
    assert torch.equal(apply_rotary_pos_emb(t, freqs, "sbhd", interleaved=interleaved), expected)
    bshd = apply_rotary_pos_emb(t.transpose(0, 1), freqs, "bshd", interleaved=interleaved)
    assert torch.equal(bshd.transpose(0, 1), expected)


class _Group:
    """What Megatron's thd RoPE reads from a context-parallel group."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_thd_equals_megatrons_unfused_rope_on_every_cp_rank(cp_size):
    cu_seqlens = torch.tensor([0, 8, 24, 40], dtype=torch.int32)
    freqs = _freqs(32, 16)
    for cp_rank in range(cp_size):
        t = torch.randn(int(cu_seqlens[-1]) // cp_size, 3, 16)
        expected = mcore_rope._apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, cp_group=_Group(cp_size, cp_rank))
        ours = apply_rotary_pos_emb(t, freqs, "thd", cu_seqlens=cu_seqlens, cp_size=cp_size, cp_rank=cp_rank)
        assert torch.equal(ours, expected)


def test_thd_positions_follow_the_load_balanced_cp_split():
    # one sequence of 8 split over 2 ranks in 4 chunks of 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    cu = torch.tensor([0, 8])
    assert thd_positions(cu, 2, 0).tolist() == [0, 1, 6, 7]
    assert thd_positions(cu, 2, 1).tolist() == [2, 3, 4, 5]
    assert thd_positions(torch.tensor([0, 3, 5])).tolist() == [0, 1, 2, 0, 1]
    with pytest.raises(ValueError, match="divisible by 2 \\* cp_size"):
        thd_positions(torch.tensor([0, 6]), 2, 0)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="tensor_format"):
        apply_rotary_pos_emb(torch.zeros(2, 1, 1, 4), _freqs(2, 4), "hbsd")
    with pytest.raises(ValueError, match="cu_seqlens"):
        apply_rotary_pos_emb(torch.zeros(2, 1, 4), _freqs(2, 4), "thd")
    with pytest.raises(ValueError, match="freqs has 2 positions"):
        apply_rotary_pos_emb(torch.zeros(3, 1, 1, 4), _freqs(2, 4))


def test_megatrons_apply_rope_fusion_runs_on_ours():
    """With the patches, Megatron's RoPE dispatcher takes the fused branch (its default with RoPE) and
    gets what its unfused branch computes."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mindspeed_te.patches.megatron_te import register_megatron_te
    from mindspeed_te.patches.registry import PatchRegistry

    registry = PatchRegistry()
    register_megatron_te(registry)
    registry.apply()
    try:
        fused = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, apply_rope_fusion=True)
        plain = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4)
        t, freqs = torch.randn(8, 2, 4, 16), _freqs(8, 16)
        cp = _Group(1, 0)
        assert torch.equal(mcore_rope.apply_rotary_pos_emb(t, freqs, fused, cp_group=cp),
                           mcore_rope.apply_rotary_pos_emb(t, freqs, plain, cp_group=cp))
        cu = torch.tensor([0, 3, 8], dtype=torch.int32)
        packed, freqs = t[:, 0], _freqs(6, 16)  # max sequence length (a length of cu[-1] means other positions)
        assert torch.equal(mcore_rope.apply_rotary_pos_emb(packed, freqs, fused, cu_seqlens=cu, cp_group=cp),
                           mcore_rope.apply_rotary_pos_emb(packed, freqs, plain, cu_seqlens=cu, cp_group=cp))
    finally:
        registry.revert()
    assert mcore_rope.fused_apply_rotary_pos_emb is None
