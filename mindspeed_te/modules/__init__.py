"""Generic TransformerEngine-style modules usable in any torch model."""
from mindspeed_te.modules.convert import convert_linears
from mindspeed_te.modules.linear import Linear

__all__ = ["Linear", "convert_linears"]
