"""Megatron-facing grouped (MoE expert) linears, megatron-core 0.16.1's keywords, built on GroupedLinear."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from megatron.core.model_parallel_config import ModelParallelConfig

from mindspeed_te.distributed import group_size
from mindspeed_te.megatron.common import condition_init_method, megatron_device
from mindspeed_te.megatron.grouped_extra_state import GroupedExtraStateMixin
from mindspeed_te.megatron.linear import TEModuleMixin
from mindspeed_te.modules.grouped_linear import GroupedLinear
from mindspeed_te.modules.linear import divide

__all__ = ["TEGroupedLinear", "TEColumnParallelGroupedLinear", "TERowParallelGroupedLinear"]


def _expert_tp_group(pg_collection: Optional[object],
                     tp_group: Optional[torch.distributed.ProcessGroup]) -> Optional[torch.distributed.ProcessGroup]:
    if tp_group is not None:
        return tp_group
    if pg_collection is not None:
        return getattr(pg_collection, "expt_tp", None)
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_expert_tensor_parallel_group()
    return None


class TEGroupedLinear(TEModuleMixin, GroupedExtraStateMixin, GroupedLinear):
    """Megatron's `TEGroupedLinear`: forward(x, m_splits) -> (output, biases or None). The MoE token
    dispatcher does the expert communication, so under expert TP or EP each rank holds its local shard and
    the layer itself communicates nothing. `config.use_gmm_fp8` (MindSpeed's --no-use-gmm-fp8 turns it off)
    keeps the expert GEMMs in BF16 inside FP8 regions.

    Args:
        num_gemms: number of experts
        input_size, output_size: sizes of one whole (unsplit) expert
        parallel_mode: "column" or "row" under expert TP, or None
        config: Megatron's config: gradient-accumulation fusion, params dtype, device, use_gmm_fp8
        init_method: Megatron's init method, applied to each expert's master weight before it is split
        bias: whether the experts have biases
        skip_bias_add: forward returns the bias instead of adding it
        is_expert: always an expert layer here (Megatron passes it through)
        tp_comm_buffer_name: TE userbuffer name for comm overlap; accepted and unused (no userbuffers here)
        pg_collection: Megatron's process-group collection: expt_tp for the expert TP split, ep for the expert-parallel
            rank (None: Megatron's parallel_state)
        tp_group: the expert tensor-parallel group, as megatron-core 0.13 to 0.15 pass it (None: from pg_collection
            or parallel_state)
        name: the module's path in the model (megatron-core 0.18 on), used in non-finite reports
    """

    def __init__(
        self,
        num_gemms: int,
        input_size: int,
        output_size: int,
        *,
        parallel_mode: Optional[str],
        config: ModelParallelConfig,
        init_method: Callable,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool = False,
        tp_comm_buffer_name: Optional[str] = None,
        pg_collection: Optional[object] = None,
        tp_group: Optional[torch.distributed.ProcessGroup] = None,
        name: Optional[str] = None,
    ) -> None:
        if not is_expert:
            raise ValueError("TEGroupedLinear only supports expert layers (is_expert=True), as in Megatron")
        return_bias = self._init_megatron(config, bias, skip_bias_add, name)
        self._pg_collection = pg_collection
        self._tp_group = _expert_tp_group(pg_collection, tp_group)
        expert_parallel = getattr(config, "expert_model_parallel_size", 1) > 1
        size = group_size(self._tp_group)
        layer_group = self._tp_group
        if size > 1 or expert_parallel:
            if parallel_mode == "column":
                output_size = divide(output_size, size, "output_size")
            elif parallel_mode == "row":
                input_size = divide(input_size, size, "input_size")
            parallel_mode, layer_group, size = None, None, 1
        super().__init__(
            num_gemms, input_size, output_size,
            # Without expert TP or EP the parallel mode stays (it marks the weights as TE's are marked), over the
            # expert TP group of one rank, as megatron-core passes it to TE: with no group the layer's collectives
            # would span the default group, i.e. its data-parallel or pipeline peers.
            tp_group=layer_group, tp_size=size,
            sequence_parallel=config.sequence_parallel,
            fuse_wgrad_accumulation=config.gradient_accumulation_fusion,
            init_method=condition_init_method(config, init_method),
            bias=bias,
            return_bias=return_bias,
            params_dtype=config.params_dtype,
            parallel_mode=parallel_mode,
            device=megatron_device(config),
            use_fp8_gemm=getattr(config, "use_gmm_fp8", True),
            delay_wgrad_compute=getattr(config, "delay_wgrad_compute", False),
        )
        for param in self.parameters():
            param.allreduce = not expert_parallel



class _ExpertParallelGroupedLinear(TEGroupedLinear):
    """The column and row forms: megatron-core's keywords without parallel_mode, which the subclass fixes."""

    _tp_split: str
    _sharded_axes: tuple[int, Optional[int]]  # (weight, bias or None for replicated) under expert TP

    def __init__(self, num_gemms: int, input_size: int, output_size: int, *, config: ModelParallelConfig,
                 init_method: Callable, bias: bool, skip_bias_add: bool, is_expert: bool,
                 tp_comm_buffer_name: Optional[str] = None, pg_collection: Optional[object] = None,
                 tp_group: Optional[torch.distributed.ProcessGroup] = None, name: Optional[str] = None) -> None:
        super().__init__(num_gemms, input_size, output_size, parallel_mode=self._tp_split, config=config,
                         init_method=init_method, bias=bias, skip_bias_add=skip_bias_add, is_expert=is_expert,
                         tp_comm_buffer_name=tp_comm_buffer_name, pg_collection=pg_collection, tp_group=tp_group,
                         name=name)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Per expert: the weight (and a split bias) sharded along its expert-TP axis."""
        weight_axis, bias_axis = self._sharded_axes
        tp_axis_map = {f"{i}.weight": weight_axis for i in range(self.num_gemms)}
        if bias_axis is not None:
            tp_axis_map.update({f"{i}.bias": bias_axis for i in range(self.num_gemms)})
        return self._sharded_state_dict_grouped(tp_axis_map, prefix, sharded_offsets, metadata)


class TEColumnParallelGroupedLinear(_ExpertParallelGroupedLinear):
    """Experts' first linear (FC1): split along the output dimension under expert TP; per expert, weight and
    bias sharded along dim 0 in checkpoints.

    Args:
        num_gemms, input_size, output_size, config, init_method, bias, skip_bias_add, is_expert,
        tp_comm_buffer_name, pg_collection, tp_group, name: as in TEGroupedLinear
    """

    _tp_split = "column"
    _sharded_axes = (0, 0)


class TERowParallelGroupedLinear(_ExpertParallelGroupedLinear):
    """Experts' second linear (FC2): split along the input dimension under expert TP; per expert, weight
    sharded along dim 1 and bias replicated in checkpoints.

    Args:
        num_gemms, input_size, output_size, config, init_method, bias, skip_bias_add, is_expert,
        tp_comm_buffer_name, pg_collection, tp_group, name: as in TEGroupedLinear
    """

    _tp_split = "row"
    _sharded_axes = (1, None)
