"""Megatron-facing TE* classes, built from a Megatron `TransformerConfig` with megatron-core's constructor
keywords. Importing this package imports megatron.core (and nothing from megatron.training)."""
from mindspeed_te.megatron.linear import TEColumnParallelLinear, TEDelayedScaling, TELinear, TERowParallelLinear

__all__ = ["TELinear", "TEColumnParallelLinear", "TERowParallelLinear", "TEDelayedScaling"]
