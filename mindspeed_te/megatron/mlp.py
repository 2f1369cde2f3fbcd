"""Megatron's `TEFusedMLP`, the MLP of the `use_te_op_fuser=True` layer spec."""
from __future__ import annotations

from typing import Optional

from megatron.core.transformer.mlp import MLP, MLPSubmodules

from mindspeed_te.megatron.linear import TERowParallelLinear
from mindspeed_te.megatron.norm import TELayerNormColumnParallelLinear


class TEFusedMLP(MLP):
    """An MLP whose fc1 is a fused norm + linear and fc2 a row-parallel linear, as TE's operation fuser wants.

    TransformerEngine re-expresses these submodules as one fusible op sequence sharing their parameters; the
    result is the unfused MLP's. Here the submodules already run our fused kernels, so the forward is the MLP's
    own, and parameters, state dicts and results are exactly those of Megatron's MLP with the same spec.

    Args:
        config, submodules, **kwargs: Megatron's `MLP` arguments (is_expert, input_size, ...). megatron-core
            0.13 and 0.14 build the fused MLP from the config alone (their spec has no submodules): the TE spec's
            norm + column-parallel fc1 and row-parallel fc2 are then taken, which also gives their state-dict keys.
    """

    def __init__(self, config, submodules: Optional[MLPSubmodules] = None, **kwargs) -> None:
        if submodules is None:
            submodules = MLPSubmodules(linear_fc1=TELayerNormColumnParallelLinear, linear_fc2=TERowParallelLinear)
        super().__init__(config, submodules, **kwargs)
        # TE's fuser accepts only these submodule types (its LayerNormLinear and Linear); say so at build time.
        for name, expected in (("linear_fc1", TELayerNormColumnParallelLinear), ("linear_fc2", TERowParallelLinear)):
            found = getattr(self, name)
            if not isinstance(found, expected):
                raise ValueError(f"TEFusedMLP expects {name} to be {expected.__name__} (the TE layer spec's), "
                                 f"found {type(found).__name__}")
