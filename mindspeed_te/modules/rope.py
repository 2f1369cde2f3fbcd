"""Rotary position embedding with TransformerEngine's `apply_rotary_pos_emb` contract: `sbhd` / `bshd`
tensors, or packed `thd` sequences described by cumulative lengths (optionally one context-parallel
rank's share of them). The rotation covers the first `freqs.shape[-1]` channels; the rest pass through.
cos/sin are taken in fp32 and cast to the input dtype before the multiply, as TE's unfused path does; the
rotation itself is the kernel backend's `rotary` (TE's unfused arithmetic in the reference, torch_npu's fused
RoPE kernel on an NPU)."""
from __future__ import annotations

from typing import Optional

import torch

from mindspeed_te.kernels import get_backend

TENSOR_FORMATS = ("sbhd", "bshd", "thd")


def _rotate(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool) -> torch.Tensor:
    rot_dim = freqs.shape[-1]
    if rot_dim > t.shape[-1] or rot_dim % 2:
        raise ValueError(f"rotary dims (freqs.shape[-1] = {rot_dim}) must be even and at most the head dim "
                         f"({t.shape[-1]})")
    head, tail = t[..., :rot_dim], t[..., rot_dim:]
    cos, sin = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
    # cos and sin of angles lie in [-1, 1] (also once rounded to t's dtype): `unit_tables`
    out = get_backend(t.device).rotary(head, cos, sin, "interleave" if interleaved else "half", unit_tables=True)
    return torch.cat((out, tail), dim=-1) if tail.shape[-1] else out


def thd_positions(cu_seqlens: torch.Tensor, cp_size: int = 1, cp_rank: int = 0) -> torch.Tensor:
    """Position in its own sequence of every token this rank holds. Under context parallelism each
    sequence of length L is cut into 2·cp_size chunks and rank r holds chunks r and 2·cp_size-1-r (the
    load-balanced split Megatron uses), so the rank's tokens are L / cp_size per sequence."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    if cp_size > 1 and bool((lengths % (2 * cp_size)).any()):
        raise ValueError(f"thd with context parallelism: every sequence length must be divisible by "
                         f"2 * cp_size ({2 * cp_size}), got {lengths.tolist()}")
    local = lengths // cp_size
    starts = torch.repeat_interleave(torch.cumsum(local, 0) - local, local)
    index = torch.arange(int(local.sum()), device=cu_seqlens.device) - starts  # index inside the local share
    if cp_size == 1:
        return index
    chunk = torch.repeat_interleave(local // 2, local)
    first = index < chunk
    full = torch.repeat_interleave(lengths, local)
    return torch.where(first, cp_rank * chunk + index, full - (cp_rank + 1) * chunk + (index - chunk))


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, tensor_format: str = "sbhd",
                         interleaved: bool = False, fused: bool = False, cu_seqlens: Optional[torch.Tensor] = None,
                         cp_size: int = 1, cp_rank: int = 0) -> torch.Tensor:
    """t rotated by the angles `freqs` ([s, 1, 1, d_rot], fp32). For "thd", `cu_seqlens` are the cumulative
    lengths of the full sequences (all CP ranks) and t holds this rank's tokens. `fused` is accepted for
    TE compatibility; every path computes the same values."""
    if tensor_format not in TENSOR_FORMATS:
        raise ValueError(f"tensor_format must be one of {', '.join(TENSOR_FORMATS)}, got {tensor_format!r}")
    if tensor_format == "thd":
        if cu_seqlens is None:
            raise ValueError("tensor_format='thd' needs cu_seqlens")
        positions = thd_positions(cu_seqlens, cp_size, cp_rank)
        if positions.numel() != t.shape[0]:
            raise ValueError(f"thd: cu_seqlens describe {positions.numel()} tokens on this rank, t has {t.shape[0]}")
        if positions.numel() and int(positions.max()) >= freqs.shape[0]:
            raise ValueError(f"thd: a sequence is longer than freqs ({freqs.shape[0]} positions)")
        return _rotate(t, freqs[positions].reshape(t.shape[0], 1, freqs.shape[-1]), interleaved)
    seq_dim = 0 if tensor_format == "sbhd" else 1
    s = t.shape[seq_dim]
    if freqs.shape[0] < s:
        raise ValueError(f"freqs has {freqs.shape[0]} positions, the sequence has {s}")
    freqs = freqs[:s]
    if tensor_format == "bshd":
        freqs = freqs.transpose(0, 1)
    return _rotate(t, freqs, interleaved)
