"""Megatron's FP4 entry points (`megatron.core.fp4_utils`) on our state manager, answering as they do with
TransformerEngine >= 2.7: the recipe of --fp4-format / --fp4-recipe, its autocast or model-init context (the
same `fp8_autocast` / `fp8_model_init` as FP8: TE runs FP4 through them too), the rows per expert its grouped
GEMMs need, and the FP4 parameter test."""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

from mindspeed_te.megatron.common import quantization_align_size
from mindspeed_te.megatron.compat import is_first_last_bf16_layer
from mindspeed_te.megatron.fp8 import _amax_reduction_group
from mindspeed_te.megatron.fp8_params import quantize_param_shard
from mindspeed_te.quantized_tensor import FP4Tensor
from mindspeed_te.recipe import NVFP4_DISABLE_SWITCHES, MXFP4BlockScaling, NVFP4BlockScaling, Recipe
from mindspeed_te.state import fp8_autocast, fp8_model_init

__all__ = ["FP4_RECIPES", "MXFP4_OPTIONS", "mxfp4_flags", "make_fp4_recipe", "get_fp4_recipe",
           "get_fp4_context", "get_fp4_align_size", "is_nvfp4tensor", "dequantize_fp4_tensor",
           "quantize_nvfp4_param_shard"]

# --fp4-recipe -> recipe class: Megatron's nvfp4 and our mxfp4 (the Ascend 950's MX layout)
FP4_RECIPES: dict[str, type[Recipe]] = {"nvfp4": NVFP4BlockScaling, "mxfp4": MXFP4BlockScaling}
# --mxfp4-* flag dest (also the config field) -> the MXFP4BlockScaling option it turns on. NVFP4 has its
# stabilisers on by default; TE turns them off with its NVTE_NVFP4_DISABLE_* variables, and so do we.
MXFP4_OPTIONS: dict[str, str] = {"mxfp4_random_hadamard_transform": "random_hadamard_transform",
                                 "mxfp4_stochastic_rounding": "stochastic_rounding",
                                 "mxfp4_fp8_activations": "fp8_activations"}


def _recipe_name(fp4_recipe) -> str:
    """Megatron's Fp4Recipe enum or a plain string, as a string."""
    return getattr(fp4_recipe, "value", fp4_recipe)


def mxfp4_flags(source) -> list[str]:
    """The --mxfp4-* flags `source` (Megatron's args or config) turns on."""
    return ["--" + dest.replace("_", "-") for dest in MXFP4_OPTIONS if getattr(source, dest, False)]


def make_fp4_recipe(name: str, source) -> Recipe:
    """The recipe `name` (an --fp4-recipe value) with the --mxfp4-* options `source` (Megatron's args or
    config) turns on. TE's NVFP4BlockScaling reads its environment switches here, and refuses the options it
    has but we do not implement; the --mxfp4-* flags are refused with NVFP4, naming TE's switches instead."""
    if name not in FP4_RECIPES:
        raise ValueError(f"--fp4-recipe {name} is not supported by mindspeed_te; allowed: {', '.join(FP4_RECIPES)}")
    chosen = [dest for dest in MXFP4_OPTIONS if getattr(source, dest, False)]
    flags = " ".join(mxfp4_flags(source))
    if name != "mxfp4":
        if flags:
            raise ValueError(f"{flags}: only with --fp4-recipe mxfp4 (got --fp4-recipe {name}); NVFP4 has its "
                             f"stabilisers on by default, and TE's {', '.join(NVFP4_DISABLE_SWITCHES)}=1 turn them off")
        return FP4_RECIPES[name]()
    try:
        return MXFP4BlockScaling(**{MXFP4_OPTIONS[dest]: True for dest in chosen})
    except ValueError as error:
        raise ValueError(f"{flags}: {error}") from error


def get_fp4_recipe(config) -> Recipe:
    """The recipe of `config.fp4_recipe` with TE's defaults and the --mxfp4-* options on the config."""
    return make_fp4_recipe(_recipe_name(config.fp4_recipe), config)


def get_fp4_context(config, layer_no: int = -1, is_init: bool = False) -> AbstractContextManager:
    """fp8_autocast with the FP4 recipe (or, with `is_init`, fp8_model_init for --fp4-param-gather) for layer
    `layer_no`; a null context when FP4 is off or the layer is one of the --first-last-layers-bf16 layers."""
    enabled = config.fp4 if not is_init else getattr(config, "fp4_param", False)
    if not enabled or is_first_last_bf16_layer(config, layer_no):
        return nullcontext()
    recipe = get_fp4_recipe(config)
    if is_init:
        return fp8_model_init(enabled=True, recipe=recipe, preserve_high_precision_init_val=torch.is_grad_enabled())
    return fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=_amax_reduction_group(config))


def get_fp4_align_size(fp4_recipe) -> int:
    """Rows per expert the FP4 grouped GEMMs need (Megatron's MoE padding): TE's 128 for NVFP4, 32 (one MX
    block) for MXFP4."""
    name = _recipe_name(fp4_recipe)
    if name not in FP4_RECIPES:
        raise ValueError(f"--fp4-recipe {name} is not supported by mindspeed_te; allowed: {', '.join(FP4_RECIPES)}")
    return quantization_align_size(FP4_RECIPES[name]())


def is_nvfp4tensor(tensor: torch.Tensor) -> bool:
    """Megatron's test for "an FP4 parameter" (TE's NVFP4Tensor; here any FP4 parameter, NVFP4 or MXFP4)."""
    return isinstance(tensor, FP4Tensor)


def dequantize_fp4_tensor(fp4_tensor: torch.Tensor) -> torch.Tensor:
    """The FP4 parameter's values in its nominal dtype."""
    return fp4_tensor.dequantize()


# megatron-core 0.17 on: the distributed optimizer's shard cast of packed FP4 weights (TE's quantize_master_weights
# there), with the same arguments and rule as the FP8 one; FP4Tensor writes the codes where the buffer keeps them.
quantize_nvfp4_param_shard = quantize_param_shard
