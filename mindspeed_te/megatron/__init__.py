"""Megatron-facing TE* classes, built from a Megatron `TransformerConfig` with megatron-core's constructor
keywords. Importing this package imports megatron.core (and nothing from megatron.training)."""
from mindspeed_te.megatron.attention import TEDotProductAttention
from mindspeed_te.megatron.grouped_linear import (
    TEColumnParallelGroupedLinear,
    TEGroupedLinear,
    TERowParallelGroupedLinear,
)
from mindspeed_te.megatron.linear import TEColumnParallelLinear, TEDelayedScaling, TELinear, TERowParallelLinear
from mindspeed_te.megatron.misc import (
    Fp8Padding,
    Fp8Unpadding,
    TECudaRNGStatesTracker,
    fused_apply_rotary_pos_emb,
    fused_apply_rotary_pos_emb_thd,
    get_cpu_offload_context,
    set_save_original_input,
    te_checkpoint,
    te_parallel_cross_entropy,
)
from mindspeed_te.megatron.mlp import TEFusedMLP
from mindspeed_te.megatron.norm import TELayerNormColumnParallelLinear, TENorm
from mindspeed_te.megatron.split import SplitAlongDim

__all__ = [
    "TELinear", "TEColumnParallelLinear", "TERowParallelLinear", "TELayerNormColumnParallelLinear", "TENorm",
    "TEDelayedScaling", "Fp8Padding", "Fp8Unpadding", "TECudaRNGStatesTracker", "get_cpu_offload_context",
    "te_checkpoint", "TEDotProductAttention", "TEGroupedLinear", "TEColumnParallelGroupedLinear",
    "TERowParallelGroupedLinear", "TEFusedMLP",
    "fused_apply_rotary_pos_emb", "fused_apply_rotary_pos_emb_thd", "te_parallel_cross_entropy",
    "set_save_original_input", "SplitAlongDim",
]
