"""Small helpers shared by the Megatron-facing modules: device, init and recipe from a Megatron config."""
from __future__ import annotations

import functools
from typing import Callable, Optional, Union

import torch

from mindspeed_te.distributed import group_rank, group_size
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


def parallel_init_method(config, init_method: Optional[Callable], *, partition_dim: Optional[int],
                         tp_group: Optional[torch.distributed.ProcessGroup], stride: int = 1,
                         is_expert: bool = False, duplicated: bool = False) -> Callable[[torch.Tensor], None]:
    """The weight initialisation Megatron's parallel linears perform, for a weight that holds this rank's
    shard (`partition_dim` 0 column, 1 row, None not split; `duplicated`: replicated across TP):
    - with --use-cpu-initialization, the full weight is drawn on the default generator and split across
      `tp_group` in `stride` chunks (so the weights do not depend on the TP size);
    - otherwise the shard is drawn inside Megatron's RNG tracker fork (the model-parallel stream, which
      differs per TP rank; the expert stream for experts; the data-parallel stream for replicated weights),
      or on the default generator when the tracker is not set up.
    A no-op when `perform_initialization` is off."""
    init_method = condition_init_method(config, init_method)
    if getattr(config, "use_cpu_initialization", False) and partition_dim is not None:
        return functools.partial(_init_from_master_weight, init_method=init_method, partition_dim=partition_dim,
                                 tp_group=tp_group, stride=stride)
    from megatron.core.tensor_parallel.random import (
        get_cuda_rng_tracker,
        get_data_parallel_rng_tracker_name,
        get_expert_parallel_rng_tracker_name,
    )

    tracker = get_cuda_rng_tracker()
    if not tracker.is_initialized():
        return init_method
    if is_expert:
        fork = functools.partial(tracker.fork, get_expert_parallel_rng_tracker_name())
    elif duplicated:
        fork = functools.partial(tracker.fork, get_data_parallel_rng_tracker_name())
    else:
        fork = tracker.fork

    def init_in_fork(weight: torch.Tensor) -> None:
        with fork():
            init_method(weight)

    return init_in_fork


def _init_from_master_weight(weight: torch.Tensor, *, init_method: Callable, partition_dim: int,
                             tp_group: Optional[torch.distributed.ProcessGroup], stride: int) -> None:
    world, rank = (group_size(tp_group), group_rank(tp_group)) if tp_group is not None else (1, 0)
    shape = list(weight.shape)
    shape[partition_dim] *= world
    master = torch.empty(shape, dtype=torch.float32)
    init_method(master)
    chunks = torch.split(master.to(weight.dtype), weight.shape[partition_dim] // stride, dim=partition_dim)
    with torch.no_grad():
        weight.copy_(torch.cat(chunks[rank::world], dim=partition_dim))


def quantization_align_size(recipe: Optional[Recipe]) -> int:
    """Rows a quantized grouped GEMM needs per expert under `recipe` (TE's get_align_size_for_quantization):
    one MX block (32) for MXFP8 and MXFP4, TE's 128 for NVFP4 (its grouped quantize with the Hadamard
    transform), 16 otherwise."""
    if recipe is not None and (recipe.mxfp8() or recipe.mxfp4()):
        return 32
    if recipe is not None and recipe.nvfp4():
        return 128
    return 16


# HIF8DelayedScaling field -> default; each comes from the config attribute (and flag) hif8_<field without hif8_>
_HIF8_DELAYED = {"hif8_input_margin": 11, "hif8_weight_margin": 12, "hif8_grad_margin": 11,
                 "amax_collect_interval": 5, "scale_update_interval": 10, "amax_history_len": 128}


def recipe_name(config) -> str:
    """The --fp8-recipe of `config`: "hif8_delayed" either as Megatron sees it after our parse_args hook
    (fp8_recipe "delayed" plus `config.hif8_delayed`, see patches/arguments.py) or as a megatron-core user may
    write it (fp8_recipe="hif8_delayed"; Megatron then treats the run as not delayed)."""
    raw = getattr(config, "fp8_recipe", None) or "delayed"
    name = getattr(raw, "value", raw)  # megatron.core.enums.Fp8Recipe or a plain string
    if getattr(config, "hif8_delayed", False) and name != "hif8_delayed":
        if name != "delayed":
            raise ValueError(f"config.hif8_delayed (--fp8-recipe hif8_delayed) is delayed scaling and needs "
                             f"config.fp8_recipe 'delayed', got {name!r}")
        return "hif8_delayed"
    return name


def recipe_from_config(config) -> Recipe:
    """The recipe Megatron's --fp8-format / --fp8-recipe / --fp8-* flags describe."""
    fp8_format = Format.from_name(config.fp8)
    name = recipe_name(config)
    wgrad_override = (False, False, not getattr(config, "fp8_wgrad", True))
    kwargs: dict = {"override_linear_precision": wgrad_override}
    # FP8 attention as Megatron asks TE for it: both flags for delayed scaling, fp8_dpa for tensorwise and (as
    # megatron-core 0.18 on does) mxfp8, whose attention NVTE_DPA_FP8_RECIPE then chooses
    dpa = {"fp8_dpa": getattr(config, "fp8_dot_product_attention", False)}
    if name in ("delayed", "hif8_delayed"):
        kwargs.update(dpa, fp8_mha=getattr(config, "fp8_multi_head_attention", False))
    elif name in ("tensorwise", "mxfp8"):
        kwargs.update(dpa)
    if name == "delayed":
        kwargs.update(margin=config.fp8_margin, amax_history_len=config.fp8_amax_history_len,
                      amax_compute_algo=config.fp8_amax_compute_algo)
    if name == "hif8_delayed":
        kwargs.update(amax_compute_algo=config.fp8_amax_compute_algo,
                      **{field: getattr(config, f"hif8_{field.removeprefix('hif8_')}", default)
                         for field, default in _HIF8_DELAYED.items()})
    elif fp8_format is Format.HIF8 and name != "mxfp8":
        for field, attr in (("fwd_target_max", "hif8_fwd_max"), ("bwd_target_max", "hif8_bwd_max")):
            if getattr(config, attr, None) is not None:
                kwargs[field] = getattr(config, attr)
    return recipe_from_name(name, fp8_format, **kwargs)
