"""Megatron-facing norms: `TENorm` and `TELayerNormColumnParallelLinear` (megatron-core 0.16.1 keywords)."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from mindspeed_te.megatron.common import megatron_device, parallel_init_method
from mindspeed_te.megatron.compat import tp_group_or_default
from mindspeed_te.megatron.linear import TEModuleMixin
from mindspeed_te.modules.layernorm_linear import LayerNormLinear
from mindspeed_te.modules.norm import LayerNorm, RMSNorm

__all__ = ["TENorm", "TELayerNormColumnParallelLinear"]


class TENorm:
    """LayerNorm or RMSNorm, as `config.normalization` says (a factory, like Megatron's). `has_residual`
    (megatron-core 0.17 on) marks a norm followed by a residual add, which TE fuses under
    `config.fused_residual_rmsnorm`; that fusion is refused with a clear error (the plain norm serves otherwise)."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, has_residual: bool = False):
        if has_residual and getattr(config, "fused_residual_rmsnorm", False):
            raise ValueError("TENorm: config.fused_residual_rmsnorm (TE's fused residual RMSNorm) is not supported "
                             "by mindspeed_te; leave it False")
        norms = {"LayerNorm": LayerNorm, "RMSNorm": RMSNorm}
        if config.normalization not in norms:
            raise ValueError(f"TENorm: config.normalization must be 'LayerNorm' or 'RMSNorm', "
                             f"got {config.normalization!r}")
        return norms[config.normalization](
            hidden_size, eps=eps, sequence_parallel=config.sequence_parallel,
            params_dtype=config.params_dtype, zero_centered_gamma=config.layernorm_zero_centered_gamma,
            device=megatron_device(config),
        )


class TELayerNormColumnParallelLinear(TEModuleMixin, LayerNormLinear):
    """Megatron's `TELayerNormColumnParallelLinear`: the norm fused in front of a column-parallel linear,
    with TE's parameter names (`layer_norm_weight`, `layer_norm_bias`, `weight`, `bias`).

    Args:
        config: Megatron's config: the norm kind, eps and zero-centered gamma, sequence parallelism,
            gradient-accumulation fusion, params dtype, device
        gather_output, stride: as in TEColumnParallelLinear
        input_size, output_size, init_method, bias, skip_bias_add, is_expert, skip_weight_param_allocation,
        tp_comm_buffer_name, tp_group, pg_collection, name: as in TELinear
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: TransformerConfig,
        init_method: Callable,
        gather_output: bool,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        skip_weight_param_allocation: bool = False,
        tp_comm_buffer_name: Optional[str] = None,
        tp_group: Optional[torch.distributed.ProcessGroup] = None,
        stride: int = 1,
        pg_collection: Optional[object] = None,
        name: Optional[str] = None,
    ) -> None:
        if gather_output:
            raise ValueError("TELayerNormColumnParallelLinear does not support gather_output=True")
        if is_expert:
            raise ValueError("TELayerNormColumnParallelLinear does not support is_expert=True (as in Megatron)")
        if skip_weight_param_allocation:
            raise ValueError("TELayerNormColumnParallelLinear does not support skip_weight_param_allocation=True")
        if tp_group is None and pg_collection is not None:
            tp_group = getattr(pg_collection, "tp", None)
        tp_group = tp_group_or_default(tp_group)
        return_bias = self._init_megatron(config, bias, skip_bias_add, name)
        self.stride = stride
        super().__init__(
            input_size, output_size,
            eps=config.layernorm_epsilon,
            sequence_parallel=config.sequence_parallel,
            fuse_wgrad_accumulation=config.gradient_accumulation_fusion,
            tp_group=tp_group,
            init_method=parallel_init_method(config, init_method, partition_dim=0, tp_group=tp_group, stride=stride),
            bias=bias,
            normalization=config.normalization,
            return_bias=return_bias,
            params_dtype=config.params_dtype,
            parallel_mode="column",
            zero_centered_gamma=config.layernorm_zero_centered_gamma,
            device=megatron_device(config),
            delay_wgrad_compute=getattr(config, "delay_wgrad_compute", False),
        )
        for name in ("weight", "bias"):
            param = getattr(self, name)
            if param is not None:
                param.partition_stride = stride
        self._tp_group = tp_group

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Linear weight and bias sharded along dim 0; the norm's parameters replicated."""
        return self._sharded(prefix, {"weight": 0, "bias": 0}, sharded_offsets, metadata)
