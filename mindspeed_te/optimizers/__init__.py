"""Optimizers: FusedAdam, TransformerEngine's precision-aware Adam (low-precision moments and master weights),
which Megatron's --use-precision-aware-optimizer takes."""
from mindspeed_te.optimizers.fused_adam import FusedAdam, FusedAdamConfigError

__all__ = ["FusedAdam", "FusedAdamConfigError"]
