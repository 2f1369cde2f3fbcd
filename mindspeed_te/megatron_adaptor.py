"""`import mindspeed_te.megatron_adaptor` before Megatron's training script runs: it applies every patch,
so that `--transformer-impl transformer_engine --fp8-format ...` trains with mindspeed_te's modules.
(Importing `mindspeed_te` itself changes nothing; this module is the one with side effects.)"""
from mindspeed_te.patches import build_registry

REGISTRY = build_registry()
REGISTRY.apply()
