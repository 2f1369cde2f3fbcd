"""What the tests adapt to the megatron-core release under test, detected from it (not from its version): the
plugin's megatron-core tests run against every supported release (tests/megatron_matrix.py)."""
from __future__ import annotations

import dataclasses
import functools
import importlib

import pytest

# TransformerConfig fields by their newest name -> their name in older releases
RENAMED_FIELDS = {"moe_router_padding_for_quantization": "moe_router_padding_for_fp8"}


@functools.cache
def _fields() -> frozenset[str]:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return frozenset(f.name for f in dataclasses.fields(TransformerConfig))


@functools.cache
def moe_bias_supported() -> bool:
    """Whether the release lets MoE layers have biases (before 0.15 its config asserts they do not)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    try:
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, num_moe_experts=2, add_bias_linear=True)
    except AssertionError:
        return False
    return True


def has_config_field(name: str) -> bool:
    """Whether this release's TransformerConfig has field `name` (under its newest or an older name)."""
    return name in _fields() or RENAMED_FIELDS.get(name) in _fields()


def config_kwargs(**kwargs) -> dict:
    """`kwargs` for this release's TransformerConfig: renamed fields under their old names (a field the release
    has under no name is left out when off, else the test is skipped), and MoE layers without the linear biases
    a release before 0.15 refuses (layers built with bias=True still get them)."""
    fields = _fields()
    adapted = {}
    for name, value in kwargs.items():
        if name in RENAMED_FIELDS and name not in fields:
            if RENAMED_FIELDS[name] in fields:
                adapted[RENAMED_FIELDS[name]] = value
            elif value:
                pytest.skip(f"this megatron-core has no {name}")
        else:
            adapted[name] = value
    if adapted.get("num_moe_experts") and not moe_bias_supported():
        adapted["add_bias_linear"] = False
    return adapted


def te_extension_has(name: str) -> bool:
    """Whether Megatron's own TE extension defines `name` (False where it cannot import without TE: 0.12)."""
    try:
        return hasattr(importlib.import_module("megatron.core.extensions.transformer_engine"), name)
    except ModuleNotFoundError:
        return False
