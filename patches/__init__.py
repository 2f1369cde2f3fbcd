"""Megatron integration, applied at import time: the patch registry, argument hooks and the CPU device
adaptor live here (being built; see the README's Megatron section)."""
