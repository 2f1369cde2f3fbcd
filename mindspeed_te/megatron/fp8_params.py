"""Megatron's `--fp8-param-gather` hooks (`megatron.core.fp8_utils`) for mindspeed_te's quantized parameters.

Megatron's DDP keeps FP8 parameters in a uint8 buffer (`modify_underlying_storage` points each parameter's
codes into it), and its distributed optimizer keeps fp32 main parameters of its shard only: after each step
`quantize_param_shard` writes the new codes of that shard into the buffer, and the parameter all-gather then
moves 1 byte per element. Every rank must end with the same scale as one quantization of the whole tensor
would give, so the shard's amax (per tensor, or per 128x128 tile) is MAX-reduced over the data-parallel group
first; then each rank's codes are exactly the whole-tensor codes of its elements. FP4 parameters
(--fp4-param-gather, NVFP4 with 16x16 weight tiles) take the same path, their tensor amax and tile amaxes
reduced alike: megatron-core 0.15 and 0.16 keep one code per byte in the buffer, 0.17 on two (TE's
`quantize_master_weights` path, `fp4_utils.quantize_nvfp4_param_shard`, which is this function too).

Megatron's own `post_all_gather_processing` and `correct_amax_history_if_needed` stay as they are (no-ops
without TE): the weights accepted here read their columnwise form as a view of the gathered codes, and the
amax history is never polluted by parameter copies.
"""
from __future__ import annotations

import weakref
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from mindspeed_te.fp4 import e2m1_encode, nvfp4_block_scales, nvfp4_global_encode_scale
from mindspeed_te.megatron.common import quantization_align_size
from mindspeed_te.quantized_tensor import (
    Float8BlockwiseQTensor,
    Float8Tensor,
    FP4Tensor,
    MXFP8Tensor,
    QuantizedTensor,
    gatherable_fp4,
)
from mindspeed_te.quantizers import _quantize_tiles
from mindspeed_te.state import FP8GlobalStateManager

__all__ = ["is_float8tensor", "is_mxfp8tensor", "modify_underlying_storage", "quantize_param_shard",
           "prepare_model_for_fp8_inference", "_fp8_inference_wrapped_modules", "_wrap_te_linear_for_padding"]


def is_float8tensor(tensor: torch.Tensor) -> bool:
    """Megatron's test for "a quantized (FP8) parameter"."""
    return isinstance(tensor, QuantizedTensor)


def is_mxfp8tensor(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, MXFP8Tensor)


def modify_underlying_storage(tensor: QuantizedTensor, new_raw_data: torch.Tensor) -> None:
    """Move the parameter's codes into `new_raw_data` (a uint8 slice of Megatron's parameter buffer)."""
    new_raw_data.detach().copy_(tensor._data)
    tensor._data = new_raw_data


def _max_over(amax: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """MAX over the group; NaN travels as +Inf (MAX is not NaN-consistent across ranks), which every rank's
    scale computation then treats the same way."""
    amax = torch.nan_to_num(amax.float(), nan=float("inf"))
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def _check_gatherable(param: QuantizedTensor) -> None:
    if isinstance(param, Float8Tensor):
        return
    if isinstance(param, FP4Tensor):
        if gatherable_fp4(param._storage):
            return
        raise NotImplementedError(
            f"--fp4-param-gather with --use-distributed-optimizer: {type(param).__name__} weights keep a separate "
            "columnwise copy that cannot be rebuilt from the gathered codes; use --fp4-recipe nvfp4 with its 16x16 "
            "weight tiles (NVTE_NVFP4_DISABLE_2D_QUANTIZATION unset)")
    if isinstance(param, Float8BlockwiseQTensor) and param._storage.block_scaling_dim == 2:
        return
    raise NotImplementedError(
        f"--fp8-param-gather: {type(param).__name__} weights keep a separate columnwise copy that cannot be "
        "rebuilt from the gathered codes; use --fp8-recipe delayed, tensorwise or blockwise (128x128 weight "
        "tiles) with --fp8-param-gather")


def _shard_codes_per_tensor(param: Float8Tensor, shard: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes of the shard, scale_inv) as the quantizer would give for the whole tensor: the shard is quantized
    together with one extra element equal to the whole tensor's amax, so the quantizer's own scale rule sees
    the global amax (and a delayed-scaling quantizer records it)."""
    local = shard.abs().max() if shard.numel() else shard.new_zeros(())
    amax = _max_over(local.reshape(1), group).to(shard.dtype)
    quantized = param._quantizer.quantize(torch.cat([shard, amax]))
    return quantized.data[:-1], quantized.scale_inv


def _shard_codes_tiled(param: Float8BlockwiseQTensor, shard: torch.Tensor, start: int,
                       group) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes of the shard, scale_inv) for 128x128 tiles: the shard in place inside a zero tensor of the
    parameter's shape, tile amaxes MAX-reduced over the group before the scales are made."""
    quantizer = param._quantizer
    whole = torch.zeros(param.numel(), dtype=shard.dtype, device=shard.device)
    whole[start:start + shard.numel()] = shard
    rows = quantizer.block_len
    data, scale_inv = _quantize_tiles(whole.view(-1, param.shape[-1]), rows, quantizer.block_len,
                                      quantizer.fp8_dtype, lambda amax: quantizer._scales(_max_over(amax, group)))
    return data.reshape(-1)[start:start + shard.numel()], scale_inv


def _shard_codes_nvfp4(param: FP4Tensor, shard: torch.Tensor, start: int,
                       group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes of the shard one per byte, rowwise scale_inv, amax) of 16x16-tile NVFP4: the shard in place inside a
    zero tensor of the parameter's shape, the tensor amax and the tile amaxes MAX-reduced over the group before
    the scales are made (zeros raise no amax), so every code is the whole tensor's."""
    whole = torch.zeros(param.numel(), dtype=shard.dtype, device=shard.device)
    whole[start:start + shard.numel()] = shard
    x = whole.view(-1, param.shape[-1]).float()
    rows, cols = x.shape
    amax = _max_over(x.abs().amax().reshape(1), group)
    tiles = _max_over(x.reshape(rows // 16, 16, cols // 16, 16).abs().amax(dim=(1, 3)), group)
    scale, encode = nvfp4_block_scales(tiles, nvfp4_global_encode_scale(amax))
    codes = e2m1_encode(x * encode.repeat_interleave(16, dim=0).repeat_interleave(16, dim=1))
    return codes.reshape(-1)[start:start + shard.numel()], scale.repeat_interleave(16, dim=0), amax


@torch.no_grad()
def quantize_param_shard(model_params: Sequence[QuantizedTensor], main_params: Sequence[Optional[torch.Tensor]],
                         start_offsets: Sequence[Optional[int]], data_parallel_group: dist.ProcessGroup,
                         fsdp_shard_model_params: Optional[Sequence[torch.Tensor]] = None) -> None:
    """Write each rank's updated fp32 shard into its FP8 parameter's codes (ready for the all-gather) and set
    the scale every rank shares. Every rank of the group calls this with all FP8 parameters, owning a shard of
    some of them (main param None elsewhere)."""
    if fsdp_shard_model_params is not None:
        raise NotImplementedError("--fp8-param-gather with Megatron FSDP is not supported; use the distributed "
                                  "optimizer (--use-distributed-optimizer)")
    for param, main, start in zip(model_params, main_params, start_offsets):
        _check_gatherable(param)
        # Megatron casts the main parameter to the model dtype first, as the bf16 path does.
        shard = main.reshape(-1).to(param.dtype) if main is not None else param.new_zeros(0, dtype=param.dtype)
        start = start or 0
        if isinstance(param, FP4Tensor):
            codes, scale_inv, amax = _shard_codes_nvfp4(param, shard, start, data_parallel_group)
            param._storage.amax_rowwise.copy_(amax)
        elif isinstance(param, Float8Tensor):
            codes, scale_inv = _shard_codes_per_tensor(param, shard, data_parallel_group)
        else:
            codes, scale_inv = _shard_codes_tiled(param, shard, start, data_parallel_group)
        # scales first: writing an FP4 parameter's codes marks its other forms to be made again (with them)
        param._scale_inv.copy_(scale_inv.reshape(param._scale_inv.shape))
        param._write_codes(start, codes)


# FP8 inference: pad the token dimension to what the FP8 GEMMs need ------------------------------------------
_fp8_inference_wrapped_modules: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def _token_alignment() -> int:
    return quantization_align_size(FP8GlobalStateManager.get_fp8_recipe())


def _wrap_te_linear_for_padding(module: torch.nn.Module) -> None:
    """Megatron's name: make `module`'s forward pad the token dimension when it will run quantized."""
    if module in _fp8_inference_wrapped_modules:
        return
    forward = module.forward

    def padded_forward(inp: torch.Tensor, *args, **kwargs):
        enabled = FP8GlobalStateManager.is_fp8_enabled()
        quantized = module.will_execute_quantized(enabled) if hasattr(module, "will_execute_quantized") else enabled
        if not quantized:
            return forward(inp, *args, **kwargs)
        if getattr(module, "sequence_parallel", False):
            raise NotImplementedError("FP8 inference padding with sequence parallelism is not supported; run "
                                      "inference without --sequence-parallel")
        tokens = inp.shape[0]
        pad = -tokens % _token_alignment()
        padded = torch.nn.functional.pad(inp, (0, 0) * (inp.dim() - 1) + (0, pad)) if pad else inp
        out = forward(padded, *args, **kwargs)
        if isinstance(out, tuple):
            return (out[0][:tokens], *out[1:])
        return out[:tokens]

    module.forward = padded_forward
    _fp8_inference_wrapped_modules.add(module)


def prepare_model_for_fp8_inference(model: torch.nn.Module) -> torch.nn.Module:
    """Make every TE linear of `model` (Megatron's `fp8_utils.TE_LINEAR_TYPES`, which the patches set to ours)
    pad its token (first) dimension to the quantized GEMM alignment (`quantization_align_size`) and drop the
    padding from its output, so inference runs on any sequence length."""
    from megatron.core import fp8_utils

    for module in model.modules():
        if isinstance(module, fp8_utils.TE_LINEAR_TYPES):
            _wrap_te_linear_for_padding(module)
    return model
