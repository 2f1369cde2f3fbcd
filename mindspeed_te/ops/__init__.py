"""Autograd functions built on the kernel interface."""
from mindspeed_te.ops.linear import LinearQuantizers, WeightCache, fp8_linear

__all__ = ["LinearQuantizers", "WeightCache", "fp8_linear"]
