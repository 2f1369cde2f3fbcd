"""Torch implementations of megatron-core's fused YaRN RoPE for multi-latent attention
(`megatron.core.fusions.fused_mla_yarn_rope_apply`), whose Triton kernels need a CUDA device.

Megatron's MLA calls them with `config.apply_rope_fusion` on and a YaRN rope (`rope_type="yarn"`), passing the
cached tables `cos = cos(freqs) * mscale`, `sin = sin(freqs) * mscale` ([max_s, 1, 1, emb_dim], in the hidden
dtype) instead of the angles. The rotary part of q / k arrives in the checkpoint's interleaved channel order
(pairs (0, 1), (2, 3), ...) and leaves in the half-split order ([evens, odds] rotated as two halves), exactly
as the unfused branch (`apply_rotary_pos_emb` with MLA's de-interleave) produces it.

The rotation is the kernel backend's `rotary` in its "interleave-half" mode. The reference backend's rotation
repeats the unfused branch's arithmetic op for op (the same products and sums in the same dtype), so outputs and
autograd gradients are bitwise those of the unfused path given the same tables; on an Ascend 950 torch_npu's fused
RoPE kernel does the de-interleave and rotation in one launch each way (in float32, rounded once; Atlas A2/A3 have
no such mode and run the reference). Unlike the Triton kernel, the q function works out of place; every caller
uses the returned tensor only.
"""
from __future__ import annotations

from typing import Optional

import torch

from mindspeed_te.kernels import get_backend
from mindspeed_te.modules.rope import thd_positions

__all__ = ["fused_apply_mla_rope_for_q", "fused_apply_mla_rope_for_kv"]


def _check_not_interleaved(rotary_interleaved: bool) -> None:
    # Megatron rejects rotary_interleaved with multi-latent attention (TransformerConfig) and with YaRN, and its
    # fused kernels assert it off: the rotary channels are always de-interleaved then rotated as two halves.
    if rotary_interleaved:
        raise ValueError("fused MLA RoPE supports only rotary_interleaved=False (as Megatron's kernels)")


def _token_tables(cos: torch.Tensor, sin: torch.Tensor, emb_dim: int, shape: torch.Size,
                  cu_seqlens: Optional[torch.Tensor], cp_rank: int, cp_size: int, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin rows for every token, shaped to broadcast over heads: [s, 1, 1, emb_dim] for sbhd (the row is
    the token's index along s; Megatron slices the table per CP rank beforehand, so cp_* do not apply), and
    [t, 1, emb_dim] for thd (the row is the token's position inside its own sequence, for this CP rank's share
    of it)."""
    if emb_dim % 2 or cos.shape[-1] != emb_dim or sin.shape[-1] != emb_dim:
        raise ValueError(f"emb_dim ({emb_dim}) must be even and the last dim of cos / sin "
                         f"({cos.shape[-1]}, {sin.shape[-1]})")
    cos, sin = cos.reshape(-1, emb_dim), sin.reshape(-1, emb_dim)
    if cu_seqlens is None:
        s = shape[0]
        if cos.shape[0] < s:
            raise ValueError(f"cos / sin have {cos.shape[0]} positions, the sequence has {s}")
        rows = [table[:s].view(s, 1, 1, emb_dim) for table in (cos, sin)]
    else:
        positions = thd_positions(cu_seqlens, cp_size, cp_rank)
        if positions.numel() != shape[0]:
            raise ValueError(f"thd: cu_seqlens describe {positions.numel()} tokens on this rank, "
                             f"the tensor has {shape[0]}")
        if positions.numel() and int(positions.max()) >= cos.shape[0]:
            raise ValueError(f"thd: a sequence is longer than cos / sin ({cos.shape[0]} positions)")
        rows = [table[positions].view(positions.numel(), 1, emb_dim) for table in (cos, sin)]
    # The unfused path casts its tables to the input's dtype; Megatron's cached tables are in it already.
    return rows[0].to(dtype), rows[1].to(dtype)


def _rope_deinterleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """MLA's rotation: channels (0, 2, 4, ..) then (1, 3, 5, ..), rotated as two halves. The tables carry YaRN's
    mscale, so their values may pass 1 (no `unit_tables`)."""
    return get_backend(x.device).rotary(x, cos, sin, "interleave-half")


def fused_apply_mla_rope_for_q(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qk_head_dim: int,
                               emb_dim: int, cu_seqlens_q: Optional[torch.Tensor] = None, cp_rank: int = 0,
                               cp_size: int = 1, rotary_interleaved: bool = False) -> torch.Tensor:
    """The query with its last `emb_dim` channels rotated and the first `qk_head_dim` passed through.

    Args:
        t: [s, b, h, qk_head_dim + emb_dim] (sbhd) or [t, h, qk_head_dim + emb_dim] (thd)
        cos, sin: the YaRN tables with mscale applied, [max_s, 1, 1, emb_dim]
        cu_seqlens_q: cumulative lengths of the full sequences (all CP ranks) for thd; None for sbhd
        cp_rank, cp_size: this rank's place in context parallelism (thd only)
        rotary_interleaved: must be False
    Returns: a new tensor shaped as t (Megatron's kernel rotates t in place and returns it).
    """
    _check_not_interleaved(rotary_interleaved)
    if t.shape[-1] != qk_head_dim + emb_dim:
        raise ValueError(f"the head dim of t ({t.shape[-1]}) must be qk_head_dim + emb_dim "
                         f"({qk_head_dim} + {emb_dim})")
    cos, sin = _token_tables(cos, sin, emb_dim, t.shape, cu_seqlens_q, cp_rank, cp_size, t.dtype)
    no_pe, pe = torch.split(t, [qk_head_dim, emb_dim], dim=-1)
    return torch.cat((no_pe, _rope_deinterleaved(pe, cos, sin)), dim=-1)


def fused_apply_mla_rope_for_kv(kv: torch.Tensor, k_pos_emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                emb_dim: int, k_dim: int, v_dim: int, cu_seqlens_kv: Optional[torch.Tensor] = None,
                                cp_rank: int = 0, cp_size: int = 1, rotary_interleaved: bool = False
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA's key and value from the up-projected kv and the shared rotary key part.

    Args:
        kv: [s, b, h, k_dim + v_dim] or [t, h, k_dim + v_dim]
        k_pos_emb: the rotary key channels shared by all heads, [s, b, 1, emb_dim] or [t, 1, emb_dim]
        cos, sin, cu_seqlens_kv, cp_rank, cp_size, rotary_interleaved: as for `fused_apply_mla_rope_for_q`
    Returns: key [.., h, k_dim + emb_dim] (kv's key channels, then the rotated k_pos_emb repeated over heads)
        and value [.., h, v_dim], both contiguous.
    """
    _check_not_interleaved(rotary_interleaved)
    if kv.shape[-1] != k_dim + v_dim:
        raise ValueError(f"the head dim of kv ({kv.shape[-1]}) must be k_dim + v_dim ({k_dim} + {v_dim})")
    cos, sin = _token_tables(cos, sin, emb_dim, kv.shape, cu_seqlens_kv, cp_rank, cp_size, kv.dtype)
    k_no_pe, value = torch.split(kv, [k_dim, v_dim], dim=-1)
    # Rotated once, then broadcast over heads: the heads' gradients sum before the inverse rotation.
    k_pe = _rope_deinterleaved(k_pos_emb.reshape(*kv.shape[:-2], 1, emb_dim), cos, sin)
    key = torch.cat((k_no_pe, k_pe.expand(*k_no_pe.shape[:-1], emb_dim)), dim=-1)
    return key, value.contiguous()
