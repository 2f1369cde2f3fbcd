"""Megatron-facing linear layers: megatron-core 0.16.1's TE* constructor keywords and return values, built
on `mindspeed_te.Linear`."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from megatron.core.model_parallel_config import ModelParallelConfig

from mindspeed_te.distributed import group_size
from mindspeed_te.megatron.common import megatron_device, parallel_init_method
from mindspeed_te.megatron.compat import ensure_dp_cp_group, make_sharded_tensors, tp_group_or_default
from mindspeed_te.megatron.te_methods import MegatronTEMethods
from mindspeed_te.modules.linear import Linear, divide
from mindspeed_te.recipe import DelayedScaling, Format

__all__ = ["TELinear", "TEColumnParallelLinear", "TERowParallelLinear", "TEDelayedScaling"]


class TEModuleMixin(MegatronTEMethods):
    """Megatron's calling convention on top of a mindspeed_te linear: forward(x) -> (output, bias or None),
    weights quantized once per step (Megatron sets `is_first_microbatch` at each step's first micro-batch),
    the per-module quantization override, delayed wgrad, and sharded checkpoints."""

    def _init_megatron(self, config: ModelParallelConfig, bias: bool, skip_bias_add: bool,
                       name: Optional[str] = None) -> bool:
        """Record what forward reads from Megatron's arguments; returns whether forward returns the bias.
        `name` (megatron-core 0.18 on passes the module's path) names the module in non-finite reports."""
        self.config = config
        if name:
            self.name = name
        self.te_return_bias = skip_bias_add and bias
        self.is_first_microbatch = True
        self.disable_parameter_transpose_cache = getattr(config, "disable_parameter_transpose_cache", False)
        return self.te_return_bias

    def forward(self, x: torch.Tensor, *args: Any) -> tuple[torch.Tensor, Any]:
        """(output, bias or None); grouped layers take `m_splits` after x."""
        first = None if self.disable_parameter_transpose_cache else self.is_first_microbatch
        with self.quantization_override_context():
            out = super().forward(x, *args, is_first_microbatch=first)
        self.is_first_microbatch = False
        if self.te_return_bias:
            return out
        return out, None

    def _sharded(self, prefix: str, axis_map: Optional[dict], sharded_offsets: tuple, metadata: Optional[dict]):
        """Replicas counted over TP and data parallelism: without a `dp_cp_group` in `metadata` (a module
        saved on its own, outside a MegatronModule), Megatron's data-parallel group, recorded in `metadata`
        as Megatron's TE layers do, so that every DP rank does not claim replica 0."""
        metadata = ensure_dp_cp_group(metadata)
        state_dict = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors(state_dict, prefix, axis_map, sharded_offsets, tp_group=self._tp_group,
                                    dp_cp_group=metadata.get("dp_cp_group"))


class TELinear(TEModuleMixin, Linear):
    """Megatron's `TELinear`. parallel_mode "column" / "row" / "duplicated" (no TP, weight replicated).
    Expert layers under TP or expert parallelism do their own communication (the token dispatcher does it),
    so the layer runs on its local shard without collectives. forward(x) returns (output, bias or None).

    Args:
        input_size, output_size: sizes of the whole (unsplit) layer
        parallel_mode: "column", "row", "duplicated" (see above) or None
        config: Megatron's config: sequence parallelism, gradient-accumulation fusion, params dtype, device, CPU
            initialization
        init_method: Megatron's init method, applied to the master weight before it is split (weights do not depend on
            the TP size)
        bias: whether the layer has a bias
        skip_bias_add: forward returns the bias instead of adding it
        skip_weight_param_allocation: only False is supported (a clear error otherwise)
        tp_comm_buffer_name: TE userbuffer name for comm overlap; accepted and unused (no userbuffers here)
        is_expert: an MoE expert layer: uses the expert TP group; communication is left to the token dispatcher
        symmetric_ar_type: TE's symmetric all-reduce kind; accepted and unused
        tp_group: tensor-parallel group (None: from pg_collection, else Megatron's parallel_state)
        pg_collection: Megatron's process-group collection; its tp (expt_tp for experts) group is used when `tp_group`
            is None
        name: the module's path in the model (megatron-core 0.18 on), used in non-finite reports
        gtp_remat_group: megatron-core 0.19's group for re-materialized output sharding; only None or a group of
            one rank is supported (a clear error otherwise)
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        parallel_mode: Optional[str],
        config: ModelParallelConfig,
        init_method: Callable,
        bias: bool,
        skip_bias_add: bool,
        skip_weight_param_allocation: bool,
        tp_comm_buffer_name: Optional[str] = None,
        is_expert: bool = False,
        symmetric_ar_type: Optional[str] = None,
        tp_group: Optional[torch.distributed.ProcessGroup] = None,
        pg_collection: Optional[object] = None,
        name: Optional[str] = None,
        gtp_remat_group: Optional[torch.distributed.ProcessGroup] = None,
    ) -> None:
        if skip_weight_param_allocation:
            raise ValueError("TELinear does not support skip_weight_param_allocation=True")
        if gtp_remat_group is not None and group_size(gtp_remat_group) > 1:
            raise ValueError("TELinear does not support gtp_remat_group with more than one rank")
        if parallel_mode not in ("column", "row", "duplicated", None):
            raise ValueError(f"parallel_mode must be 'column', 'row', 'duplicated' or None, got {parallel_mode!r}")
        return_bias = self._init_megatron(config, bias, skip_bias_add, name)
        if tp_group is None and pg_collection is not None:
            tp_group = getattr(pg_collection, "expt_tp" if is_expert else "tp", None)
        elif tp_group is None and parallel_mode != "duplicated":
            tp_group = tp_group_or_default(None, is_expert=is_expert)
        expert_parallel = getattr(config, "expert_model_parallel_size", 1) > 1
        local_mode, local_group = parallel_mode, tp_group
        if parallel_mode == "duplicated":
            local_mode, local_group = None, None
        elif is_expert and (group_size(tp_group) > 1 or expert_parallel):
            # Expert communication happens in the token dispatcher: build the local shard only.
            size = group_size(tp_group)
            if parallel_mode == "column":
                output_size = divide(output_size, size, "output_size")
            elif parallel_mode == "row":
                input_size = divide(input_size, size, "input_size")
            local_mode, local_group = None, None
        super().__init__(
            input_size, output_size,
            sequence_parallel=config.sequence_parallel,
            fuse_wgrad_accumulation=config.gradient_accumulation_fusion,
            tp_group=local_group,
            init_method=parallel_init_method(
                config, init_method, partition_dim={"column": 0, "row": 1}.get(parallel_mode),
                tp_group=tp_group, stride=getattr(self, "stride", 1), is_expert=is_expert,
                duplicated=parallel_mode == "duplicated"),
            bias=bias,
            return_bias=return_bias,
            params_dtype=config.params_dtype,
            parallel_mode=local_mode,
            device=megatron_device(config),
            use_ascend_mc2=getattr(config, "use_ascend_mc2", False),
            delay_wgrad_compute=getattr(config, "delay_wgrad_compute", False),
        )
        for param in self.parameters():
            if is_expert:
                param.allreduce = not expert_parallel
            else:
                param.allreduce = True
                if parallel_mode == "duplicated":
                    param.sequence_parallel = config.sequence_parallel
        self._tp_group = tp_group_or_default(tp_group, is_expert=is_expert)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Replicated across TP (only valid for the duplicated mode, as in Megatron)."""
        return self._sharded(prefix, None, sharded_offsets, metadata)


class TEColumnParallelLinear(TELinear):
    """Megatron's `TEColumnParallelLinear`: weight split along the output dimension.

    Args:
        gather_output: only False is supported, as in Megatron's TE path (a clear error otherwise)
        stride: chunks per partition when splitting the master weight (e.g. interleaved fused projections)
        input_size, output_size, config, init_method, bias, skip_bias_add, is_expert, skip_weight_param_allocation,
        tp_comm_buffer_name, tp_group, pg_collection, name: as in TELinear
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: ModelParallelConfig,
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
            raise ValueError("TEColumnParallelLinear does not support gather_output=True (as in Megatron's TE path)")
        self.stride = stride  # read by TELinear's initialisation (the master weight is split in stride chunks)
        super().__init__(
            input_size, output_size, parallel_mode="column", config=config, init_method=init_method, bias=bias,
            skip_bias_add=skip_bias_add, skip_weight_param_allocation=skip_weight_param_allocation,
            tp_comm_buffer_name=tp_comm_buffer_name, is_expert=is_expert, tp_group=tp_group,
            pg_collection=pg_collection, name=name,
        )
        for param in self.parameters():
            param.partition_stride = stride

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Weight and bias sharded along dim 0."""
        return self._sharded(prefix, {"weight": 0, "bias": 0}, sharded_offsets, metadata)


class TERowParallelLinear(TELinear):
    """Megatron's `TERowParallelLinear`: weight split along the input dimension, output reduced.

    Args:
        input_is_parallel: only True (the input already split along its last dimension), as in Megatron's TE path
        input_size, output_size, config, init_method, bias, skip_bias_add, is_expert, tp_comm_buffer_name,
        tp_group, pg_collection, name: as in TELinear
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: ModelParallelConfig,
        init_method: Callable,
        bias: bool,
        input_is_parallel: bool,
        skip_bias_add: bool,
        is_expert: bool,
        tp_comm_buffer_name: Optional[str] = None,
        tp_group: Optional[torch.distributed.ProcessGroup] = None,
        pg_collection: Optional[object] = None,
        name: Optional[str] = None,
    ) -> None:
        if not input_is_parallel:
            raise ValueError("TERowParallelLinear needs input_is_parallel=True (as in Megatron's TE path)")
        super().__init__(
            input_size, output_size, parallel_mode="row", config=config, init_method=init_method, bias=bias,
            skip_bias_add=skip_bias_add, skip_weight_param_allocation=False,
            tp_comm_buffer_name=tp_comm_buffer_name, is_expert=is_expert, tp_group=tp_group,
            pg_collection=pg_collection, name=name,
        )

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Weight sharded along dim 1, bias replicated."""
        return self._sharded(prefix, {"weight": 1}, sharded_offsets, metadata)


class TEDelayedScaling(DelayedScaling):
    """Megatron's `TEDelayedScaling`: a DelayedScaling recipe from the config's --fp8-* values.

    Args:
        config: Megatron's config: --fp8-margin, --fp8-amax-history-len, --fp8-amax-compute-algo, and whether attention
            runs in FP8
        fp8_format: a Format or its --fp8-format name
        override_linear_precision: (fprop, dgrad, wgrad): which GEMMs run in high precision instead
    """

    def __init__(self, config: ModelParallelConfig, fp8_format: Format | str,
                 override_linear_precision: tuple = (False, False, False)) -> None:
        super().__init__(
            margin=config.fp8_margin,
            fp8_format=fp8_format if isinstance(fp8_format, Format) else Format.from_name(fp8_format),
            amax_history_len=config.fp8_amax_history_len,
            amax_compute_algo=config.fp8_amax_compute_algo,
            override_linear_precision=override_linear_precision,
            fp8_dpa=getattr(config, "fp8_dot_product_attention", False),
            fp8_mha=getattr(config, "fp8_multi_head_attention", False),
        )
