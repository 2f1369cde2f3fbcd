"""Megatron's FP8 entry points (`megatron.core.fp8_utils.get_fp8_recipe` / `get_fp8_context`) on our state
manager: the recipe from the --fp8-* flags (HiF8 included) and the autocast or model-init context."""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

from mindspeed_te.megatron.common import recipe_from_config
from mindspeed_te.megatron.compat import is_first_last_bf16_layer
from mindspeed_te.recipe import Recipe
from mindspeed_te.state import fp8_autocast, fp8_model_init


def get_fp8_recipe(config) -> Recipe:
    """The recipe of `config` (--fp8-format, --fp8-recipe, --fp8-margin, ..., --no-fp8-wgrad)."""
    return recipe_from_config(config)


def _amax_reduction_group(config):
    """Megatron's amax reduction group (data, tensor and context parallel ranks, or TP only with
    --tp-only-amax-red), or None before model parallelism is initialized."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_amax_reduction_group(with_context_parallel=True,
                                                   tp_only_amax_red=getattr(config, "tp_only_amax_red", False))


def get_fp8_context(config, layer_no: int = -1, is_init: bool = False) -> AbstractContextManager:
    """fp8_autocast (or, with `is_init`, fp8_model_init for --fp8-param-gather) for layer `layer_no`; a null
    context when FP8 is off or the layer is one of the --first-last-layers-bf16 layers."""
    enabled = config.fp8 if not is_init else getattr(config, "fp8_param", False)
    if not enabled or is_first_last_bf16_layer(config, layer_no):
        return nullcontext()
    recipe = get_fp8_recipe(config)  # (TransformerConfig rejects --first-last-layers-bf16 with delayed)
    if is_init:
        return fp8_model_init(enabled=True, recipe=recipe, preserve_high_precision_init_val=torch.is_grad_enabled())
    return fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=_amax_reduction_group(config))
