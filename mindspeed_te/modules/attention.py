"""`DotProductAttention`: softmax(Q Kᵀ · scale + mask) V on [s, b, h, d] (sbhd) tensors, with GQA and dropout
drawn from an RNG tracker. Attention is not quantized by these recipes; it runs in the input precision
through torch's scaled_dot_product_attention."""
from __future__ import annotations

import contextlib
import math
from typing import Callable, Optional

import torch

from mindspeed_te.distributed import ProcessGroup
from mindspeed_te.kernels import get_backend
from mindspeed_te.modules.linear import divide, resolve_tp_size

MASK_TYPES = ("causal", "padding", "no_mask", "padding_causal")


class DotProductAttention(torch.nn.Module):
    """TransformerEngine's core attention. Masks follow Megatron: a boolean `attention_mask` is True where
    attention is NOT allowed, shaped [b, 1, 1, s_k] or [b, 1, s_q, s_k]; "causal" masks keys after the query
    position (top-left aligned)."""

    def __init__(
        self,
        num_attention_heads: int,
        kv_channels: int,
        num_gqa_groups: Optional[int] = None,
        attention_dropout: float = 0.0,
        attn_mask_type: str = "causal",
        qkv_format: str = "sbhd",
        softmax_scale: Optional[float] = None,
        get_rng_state_tracker: Optional[Callable] = None,
        tp_size: int = 1,
        tp_group: ProcessGroup = None,
        layer_number: Optional[int] = None,
        attention_type: str = "self",
    ) -> None:
        super().__init__()
        if attn_mask_type not in MASK_TYPES:
            raise ValueError(f"attn_mask_type must be one of {', '.join(MASK_TYPES)}, got {attn_mask_type!r}")
        if qkv_format != "sbhd":
            raise ValueError(f"qkv_format must be 'sbhd' (Megatron's layout), got {qkv_format!r}")
        groups = num_gqa_groups or num_attention_heads
        if num_attention_heads % groups:
            raise ValueError(f"num_attention_heads ({num_attention_heads}) must be a multiple of "
                             f"num_gqa_groups ({groups})")
        tp_size = resolve_tp_size(tp_group, tp_size)
        self.num_heads = divide(num_attention_heads, tp_size, "num_attention_heads")
        self.num_groups = divide(groups, tp_size, "num_gqa_groups")
        self.kv_channels = kv_channels
        self.attention_dropout = attention_dropout
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(kv_channels)
        self.get_rng_state_tracker = get_rng_state_tracker
        self.layer_number = layer_number
        self.attention_type = attention_type

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor] = None, attn_mask_type: Optional[str] = None,
                attention_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        mask_type = attn_mask_type or self.attn_mask_type
        if mask_type not in MASK_TYPES:
            raise ValueError(f"attn_mask_type must be one of {', '.join(MASK_TYPES)}, got {mask_type!r}")
        s_q, b, h, d = query.shape
        if h % key.shape[2]:
            raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({key.shape[2]})")
        allowed = self._allowed(mask_type, attention_mask, s_q, key.shape[0], query.device)
        if attention_bias is not None:
            bias = attention_bias.to(query.dtype)
            allowed = bias if allowed is None else bias.masked_fill(~allowed, float("-inf"))
        dropout = self.attention_dropout if self.training else 0.0
        rng = self.get_rng_state_tracker().fork() if dropout > 0 and self.get_rng_state_tracker else None
        with rng or contextlib.nullcontext():
            return get_backend(query.device).attention(query, key, value, allowed, self.softmax_scale, dropout)

    @staticmethod
    def _allowed(mask_type: str, attention_mask: Optional[torch.Tensor], s_q: int, s_k: int,
                 device: torch.device) -> Optional[torch.Tensor]:
        """Boolean "may attend" mask for SDPA (True = attend), or None for no mask."""
        allowed = None
        if "padding" in mask_type:
            if attention_mask is None:
                raise ValueError(f"attn_mask_type {mask_type!r} needs an attention_mask")
            allowed = ~attention_mask.bool()
        if "causal" in mask_type:
            causal = torch.ones(s_q, s_k, dtype=torch.bool, device=device).tril()
            allowed = causal if allowed is None else allowed & causal
        return allowed
