"""Megatron-facing `TEDotProductAttention` (megatron-core 0.16.1 keywords) on DotProductAttention."""
from __future__ import annotations

from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from mindspeed_te.megatron.common import megatron_device
from mindspeed_te.megatron.compat import ensure_dp_cp_group, layer_has_window, make_sharded_tensors
from mindspeed_te.modules.attention import DotProductAttention

__all__ = ["TEDotProductAttention"]


def _rng_tracker():
    """Megatron's model-parallel RNG tracker when it has been set up (dropout must fork it)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    return get_cuda_rng_tracker if getattr(tracker, "is_initialized", lambda: True)() else None


class TEDotProductAttention(DotProductAttention):
    """Core attention for Megatron's SelfAttention/CrossAttention: sbhd in, [s, b, h * d] out (thd with
    `packed_seq_params`: [t, h, d] in, [t, h * d] out). Honours the config's sliding window (per layer, as
    `window_attn_skip_freq` says), `softmax_type`, context parallelism over the CP group, and FP8 attention when
    Megatron's recipe carries fp8_dpa (config.fp8_dot_product_attention).

    Args:
        config: Megatron's config: heads, query groups, kv channels, dropout, window, softmax type, context-parallel
            size, params dtype, device
        layer_number: the layer's 1-based index (decides whether its sliding window applies)
        attn_mask_type: Megatron's AttnMaskType
        attention_type: "self" or "cross"
        attention_dropout: overrides config.attention_dropout when given
        softmax_scale: scale of q·k (None: 1/sqrt(head dim))
        k_channels: head dimension of queries and keys (None: config.kv_channels)
        v_channels: head dimension of values (None: as k_channels)
        num_splits: TE's flash-attention split count; accepted and unused
        cp_comm_type: Megatron's context-parallel communication type (see DotProductAttention)
        pg_collection: Megatron's process-group collection: tp and cp groups (None: Megatron's parallel_state)
        model_comm_pgs: the same collection under its megatron-core 0.13 / 0.14 name
    """

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
        model_comm_pgs: Optional[object] = None,
    ) -> None:
        self.config = config
        pg_collection = pg_collection if pg_collection is not None else model_comm_pgs
        if pg_collection is not None:
            tp_group, cp_group = pg_collection.tp, getattr(pg_collection, "cp", None)
        else:
            tp_group = parallel_state.get_tensor_model_parallel_group(check_initialized=False)
            cp_group = parallel_state.get_context_parallel_group(check_initialized=False)
        if config.context_parallel_size > 1 and cp_group is None:
            raise ValueError("TEDotProductAttention: --context-parallel-size > 1 needs Megatron's context-parallel "
                             "group (parallel_state.initialize_model_parallel(context_parallel_size=...) or "
                             "pg_collection.cp)")
        windowed = layer_has_window(config, layer_number)
        self._tp_group = tp_group
        super().__init__(
            num_attention_heads=config.num_attention_heads,
            kv_channels=k_channels or config.kv_channels,
            num_gqa_groups=config.num_query_groups,
            attention_dropout=config.attention_dropout if attention_dropout is None else attention_dropout,
            attn_mask_type=attn_mask_type.name,
            softmax_scale=softmax_scale,
            get_rng_state_tracker=_rng_tracker(),
            tp_size=config.tensor_model_parallel_size if tp_group is None else 1,
            tp_group=tp_group,
            layer_number=layer_number,
            attention_type=attention_type,
            window_size=config.window_size if windowed else None,
            softmax_type=getattr(config, "softmax_type", "vanilla"),
            cp_group=cp_group if config.context_parallel_size > 1 else None,
            cp_comm_type=cp_comm_type or "p2p",
            params_dtype=config.params_dtype,
            device=megatron_device(config),
        )

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: AttnMaskType,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params: Optional[object] = None,
                num_splits: Optional[int] = None) -> torch.Tensor:
        packed: dict = {}
        if packed_seq_params is not None:
            if getattr(packed_seq_params, "cp_group", None) is not None:
                self.cp_group = packed_seq_params.cp_group
            elif getattr(packed_seq_params, "local_cp_size", None) is not None:
                if packed_seq_params.local_cp_size != 1:
                    raise ValueError("packed_seq_params.local_cp_size must be 1 when no cp_group is given")
                self.cp_group = None
            packed = {name: getattr(packed_seq_params, name) for name in (
                "qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")}
        mask = attn_mask_type.name if attn_mask_type is not None else None
        fmt = packed.get("qkv_format") or self.qkv_format
        if mask == "no_mask" and self.window_size is not None and fmt == "sbhd" and query.shape[0] == 1:
            mask = "causal_bottom_right"  # one new token against a cache, as Megatron asks of TE
        return super().forward(query, key, value, attention_mask, mask, attention_bias, **packed)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """The learnable softmax offset, sharded over TP by head. As Megatron's TE wrapper, not the FP8 metadata
        (`_extra_state`): delayed scaling's attention scales start fresh after a resume."""
        metadata = ensure_dp_cp_group(metadata)
        state_dict = self.state_dict(prefix="", keep_vars=True) if self.softmax_type == "learnable" else {}
        return make_sharded_tensors(state_dict, prefix, {"softmax_offset": 0}, sharded_offsets,
                                    tp_group=self._tp_group, dp_cp_group=metadata.get("dp_cp_group"))
