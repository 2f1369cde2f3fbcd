"""Megatron-facing `TEDotProductAttention` (megatron-core 0.16.1 keywords) on DotProductAttention."""
from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from mindspeed_te.distributed import group_size
from mindspeed_te.modules.attention import DotProductAttention

__all__ = ["TEDotProductAttention"]


def _rng_tracker():
    """Megatron's model-parallel RNG tracker when it has been set up (dropout must fork it)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    return get_cuda_rng_tracker if getattr(tracker, "is_initialized", lambda: True)() else None


class TEDotProductAttention(DotProductAttention):
    """Core attention for Megatron's SelfAttention/CrossAttention: sbhd in, [s, b, h * d] out."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
        num_splits: Optional[int] = None,
        cp_comm_type: Optional[str] = "p2p",
        pg_collection: Optional[object] = None,
    ) -> None:
        if getattr(config, "context_parallel_size", 1) > 1:
            raise ValueError("TEDotProductAttention: context parallelism (--context-parallel-size > 1) is not "
                             "supported by mindspeed_te yet")
        self.config = config
        tp_group = getattr(pg_collection, "tp", None) if pg_collection is not None else None
        tp_size = group_size(tp_group) if tp_group is not None else config.tensor_model_parallel_size
        super().__init__(
            num_attention_heads=config.num_attention_heads,
            kv_channels=k_channels or config.kv_channels,
            num_gqa_groups=config.num_query_groups,
            attention_dropout=config.attention_dropout if attention_dropout is None else attention_dropout,
            attn_mask_type=attn_mask_type.name,
            softmax_scale=softmax_scale,
            get_rng_state_tracker=_rng_tracker(),
            tp_size=tp_size,
            tp_group=tp_group,
            layer_number=layer_number,
            attention_type=attention_type,
        )

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: AttnMaskType,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params: Optional[object] = None,
                num_splits: Optional[int] = None) -> torch.Tensor:
        if packed_seq_params is not None:
            raise ValueError("TEDotProductAttention: packed sequences (thd format) are not supported yet")
        mask = attn_mask_type.name if attn_mask_type is not None else None
        return super().forward(query, key, value, attention_mask, mask, attention_bias)
