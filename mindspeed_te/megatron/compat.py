"""What differs between the megatron-core releases the plugin supports, detected from the installed Megatron
(names and signatures), never from its version string. The Megatron-facing modules call these helpers instead
of the Megatron functions that only some releases have. The release lines themselves are listed once, in
patches/registry.py (`SUPPORTED_MEGATRON_CORE`)."""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional

import torch


@functools.cache
def accepts(function: Callable, keyword: str) -> bool:
    """Whether `function` takes `keyword` (named, or through **kwargs)."""
    parameters = inspect.signature(function).parameters
    return keyword in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def tp_group_or_default(tp_group: Optional[torch.distributed.ProcessGroup],
                        is_expert: bool = False) -> Optional[torch.distributed.ProcessGroup]:
    """`tp_group`, else Megatron's (expert) tensor-parallel group: `get_tensor_model_parallel_group_if_none`
    where the release has it (0.13 on), else parallel_state's getters (0.12)."""
    from megatron.core import parallel_state, utils

    if hasattr(utils, "get_tensor_model_parallel_group_if_none"):
        return utils.get_tensor_model_parallel_group_if_none(tp_group, is_expert=is_expert)
    if tp_group is not None:
        return tp_group
    if not parallel_state.model_parallel_is_initialized():
        return None
    if is_expert:
        return parallel_state.get_expert_tensor_parallel_group(check_initialized=False)
    return parallel_state.get_tensor_model_parallel_group(check_initialized=False)


def ensure_dp_cp_group(metadata: Optional[dict]) -> dict:
    """`metadata` with Megatron's data-parallel (with context parallel) group as `dp_cp_group`, as 0.15's
    `ensure_metadata_has_dp_cp_group` gives it. 0.12 to 0.14 read the group from parallel_state themselves and
    keep the caller's metadata in the checkpoint, where a process group cannot be pickled: their metadata is
    left as it is (`make_sharded_tensors` passes the group only where Megatron takes it)."""
    from megatron.core.transformer import utils

    if hasattr(utils, "ensure_metadata_has_dp_cp_group"):
        return utils.ensure_metadata_has_dp_cp_group(metadata)
    return {} if metadata is None else metadata


def make_sharded_tensors(state_dict: dict, prefix: str, axis_map: Optional[dict], sharded_offsets: tuple,
                         tp_group: Optional[torch.distributed.ProcessGroup] = None,
                         dp_cp_group: Optional[torch.distributed.ProcessGroup] = None) -> dict:
    """Megatron's `make_sharded_tensors_for_checkpoint`, passing the groups where the release takes them
    (0.15 on; earlier releases take the groups from parallel_state)."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint as make

    groups = {name: group for name, group in (("tp_group", tp_group), ("dp_cp_group", dp_cp_group))
              if accepts(make, name)}
    return make(state_dict, prefix, axis_map, sharded_offsets, **groups)



def layer_has_window(config: Any, layer_number: int) -> bool:
    """Whether layer `layer_number` (1-based) attends through `config.window_size`: as
    `window_attn_skip_freq` says where the release has it (0.15 on), else every layer when a window is set."""
    from megatron.core.transformer import utils

    window = getattr(config, "window_size", None)
    if not hasattr(utils, "is_layer_window_attention"):
        return bool(window)
    return utils.is_layer_window_attention(window, getattr(config, "window_attn_skip_freq", None), layer_number)


def is_first_last_bf16_layer(config: Any, layer_no: int) -> bool:
    """Whether global layer `layer_no` (0-based; -1: not one layer) runs in bf16 under --first-last-layers-bf16:
    Megatron's own test where the release has it (0.15 on), else the same rule on the config's counts."""
    from megatron.core import fp8_utils

    if hasattr(fp8_utils, "is_first_last_bf16_layer"):
        return fp8_utils.is_first_last_bf16_layer(config, layer_no)
    if layer_no < 0 or not getattr(config, "first_last_layers_bf16", False):
        return False
    return (layer_no < config.num_layers_at_start_in_bf16
            or layer_no >= config.num_layers - config.num_layers_at_end_in_bf16)

