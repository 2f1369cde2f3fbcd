"""Small helpers shared by the Megatron-facing modules: device, init and recipe from a Megatron config."""
from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from mindspeed_te.recipe import Format, Recipe, recipe_from_name


def megatron_device(config) -> Union[str, torch.device]:
    """Where Megatron wants parameters: CPU with --use-cpu-initialization, meta for meta-device init,
    otherwise the current accelerator (CPU when there is none)."""
    if getattr(config, "use_cpu_initialization", False):
        return "cpu"
    if getattr(config, "init_model_with_meta_device", False):
        return "meta"
    accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    return accelerator if accelerator is not None else "cpu"


def condition_init_method(config, init_method: Optional[Callable]) -> Callable:
    """Megatron skips initialization when `perform_initialization` is off (e.g. before loading a checkpoint)."""
    if init_method is None or not getattr(config, "perform_initialization", True):
        return lambda weight: None
    return init_method


def recipe_from_config(config) -> Recipe:
    """The recipe Megatron's --fp8-format / --fp8-recipe / --fp8-* flags describe."""
    fp8_format = Format.from_name(config.fp8)
    raw = getattr(config, "fp8_recipe", None) or "delayed"
    name = getattr(raw, "value", raw)  # megatron.core.enums.Fp8Recipe or a plain string
    wgrad_override = (False, False, not getattr(config, "fp8_wgrad", True))
    kwargs: dict = {"override_linear_precision": wgrad_override}
    if name == "delayed":
        kwargs.update(margin=config.fp8_margin, amax_history_len=config.fp8_amax_history_len,
                      amax_compute_algo=config.fp8_amax_compute_algo,
                      fp8_dpa=getattr(config, "fp8_dot_product_attention", False),
                      fp8_mha=getattr(config, "fp8_multi_head_attention", False))
    if fp8_format is Format.HIF8 and name != "mxfp8":
        for field, attr in (("fwd_target_max", "hif8_fwd_max"), ("bwd_target_max", "hif8_bwd_max")):
            if getattr(config, attr, None) is not None:
                kwargs[field] = getattr(config, attr)
    return recipe_from_name(name, fp8_format, **kwargs)
