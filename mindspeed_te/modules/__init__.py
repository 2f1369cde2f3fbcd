"""Generic TransformerEngine-style modules usable in any torch model."""
from mindspeed_te.modules.attention import DotProductAttention
from mindspeed_te.modules.base import set_extra_state_format
from mindspeed_te.modules.convert import convert_linears
from mindspeed_te.modules.grouped_linear import GroupedLinear
from mindspeed_te.modules.layernorm_linear import LayerNormLinear
from mindspeed_te.modules.layernorm_mlp import LayerNormMLP
from mindspeed_te.modules.linear import Linear
from mindspeed_te.modules.norm import LayerNorm, RMSNorm

__all__ = [
    "DotProductAttention", "GroupedLinear", "LayerNorm", "LayerNormLinear", "LayerNormMLP", "Linear", "RMSNorm",
    "convert_linears", "set_extra_state_format",
]
