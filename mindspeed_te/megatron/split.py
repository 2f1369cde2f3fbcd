"""TE's `SplitAlongDim`, the autograd split Megatron's attention uses to cut the fused QKV projection into
query / key / value (`SplitAlongDim(mixed_qkv, 3, split_arg_list)`, with `torch.split` as its fallback).

Forward returns `torch.split`'s views. Backward joins the pieces' gradients along the same dim: when they
already tile one buffer in order (as the slices a `torch.cat` backward hands out do), that buffer is returned
as one view with no copy; otherwise they are concatenated, with zeros for pieces that got no gradient.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

__all__ = ["SplitAlongDim", "split_along_dim"]


def _tiled_view(grads: Sequence[torch.Tensor], dim: int, sizes: Sequence[int]) -> Optional[torch.Tensor]:
    """The whole gradient as a view of the pieces' shared storage, when piece i starts where piece i-1 ends
    along `dim` with all other strides equal; None otherwise."""
    first = grads[0]
    stride = first.stride()
    step = stride[dim]
    if step == 0:  # a broadcast gradient: its pieces overlap, leave them to torch.cat
        return None
    offset = first.storage_offset()
    start = 0
    for grad, size in zip(grads, sizes):
        if (grad.dtype != first.dtype or grad.device != first.device or grad.stride() != stride
                or grad.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or grad.storage_offset() != offset + start * step):
            return None
        start += size
    shape = list(first.shape)
    shape[dim] = start
    return first.as_strided(shape, stride, offset)


class _SplitAlongDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, dim: int, split_size_or_sections: Union[int, Sequence[int]],
                squeeze: bool = False) -> tuple[torch.Tensor, ...]:
        dim = dim % tensor.dim()
        pieces = torch.split(tensor, split_size_or_sections, dim=dim)
        ctx.dim = dim
        ctx.sizes = [piece.shape[dim] for piece in pieces]
        ctx.shape, ctx.dtype, ctx.device = tensor.shape, tensor.dtype, tensor.device
        ctx.set_materialize_grads(False)  # missing gradients are filled below, at the pieces' own sizes
        if squeeze:
            pieces = tuple(piece.squeeze(dim) for piece in pieces)
        return tuple(pieces)

    @staticmethod
    def backward(ctx, *grad_outputs: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], None, None, None]:
        if all(grad is None for grad in grad_outputs):
            return None, None, None, None
        grads = []
        for grad, size in zip(grad_outputs, ctx.sizes):
            if grad is None:
                shape = list(ctx.shape)
                shape[ctx.dim] = size
                grad = torch.zeros(shape, dtype=ctx.dtype, device=ctx.device)
            elif grad.dim() < len(ctx.shape):  # the piece was squeezed
                grad = grad.unsqueeze(ctx.dim)
            grads.append(grad)
        joined = _tiled_view(grads, ctx.dim, ctx.sizes)
        if joined is None:
            joined = torch.cat(grads, dim=ctx.dim)
        return joined, None, None, None


def split_along_dim(tensor: torch.Tensor, dim: int, split_size_or_sections: Union[int, Sequence[int]],
                    squeeze: bool = False) -> tuple[torch.Tensor, ...]:
    """`torch.split(tensor, split_size_or_sections, dim)` (each piece squeezed along `dim` when `squeeze`)
    whose backward produces one gradient for `tensor` without a copy where the pieces' gradients allow."""
    return _SplitAlongDim.apply(tensor, dim, split_size_or_sections, squeeze)


# The name Megatron imports from its TE extension (there bound to TE's `_SplitAlongDim.apply`).
SplitAlongDim = split_along_dim
