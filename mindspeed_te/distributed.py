"""Tensor- and sequence-parallel communication as autograd functions over an explicit process group.

Sequence-parallel tensors are split along dim 0 (Megatron's [s, b, h] layout puts the sequence first);
tensor-parallel activations are split along the last dim.
"""
from __future__ import annotations

import zlib
from typing import Optional

import torch
import torch.distributed as dist

ProcessGroup = Optional[dist.ProcessGroup]

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group: ProcessGroup) -> int:
    """World size of `group` (1 when torch.distributed is not initialized)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def group_rank(group: ProcessGroup) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def _all_reduce(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _all_gather_dim0(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    x = x.contiguous()
    out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x, group=group)
    return out


def _reduce_scatter_dim0(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    if x.shape[0] % world:
        raise ValueError(f"sequence parallel: dim 0 ({x.shape[0]}) must be divisible by the TP size ({world})")
    x = x.contiguous()
    out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, x, group=group)
    return out


def _split_last(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    return x.chunk(world, dim=-1)[group_rank(group)].contiguous()


def _gather_last(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    gathered = _all_gather_dim0(x.movedim(-1, 0), group)
    return gathered.movedim(0, -1).contiguous()


class _CopyToTP(torch.autograd.Function):
    """Identity forward, all-reduce of the gradient backward (input of a column-parallel linear)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward, identity backward (output of a row-parallel linear)."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSP(torch.autograd.Function):
    """All-gather along dim 0 forward, reduce-scatter backward (sequence-parallel input of a column linear)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_dim0(grad, ctx.group), None


class _ReduceScatterToSP(torch.autograd.Function):
    """Reduce-scatter along dim 0 forward, all-gather backward (sequence-parallel output of a row linear)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim0(grad, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    """All-gather along the last dim forward, keep this rank's slice backward (gather_output)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


def copy_to_tensor_parallel_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return _CopyToTP.apply(x, group) if group_size(group) > 1 else x


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group) if group_size(group) > 1 else x


def gather_from_sequence_parallel_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return _GatherFromSP.apply(x, group) if group_size(group) > 1 else x


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return _ReduceScatterToSP.apply(x, group) if group_size(group) > 1 else x


def gather_from_tensor_parallel_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return _GatherFromTP.apply(x, group) if group_size(group) > 1 else x


_IDENTITY_BYTES = 1024  # room for a recipe's configuration string; longer ones are compared by prefix + hash


def check_same_on_all_ranks(what: str, identity: str, group: ProcessGroup) -> None:
    """Compare `identity` (e.g. a recipe's configuration) across the ranks of `group` with one all-gather of
    a fixed-size byte buffer, and raise on every rank, naming both values, if any rank differs. Every rank
    must call it at the same point; they then fail together instead of deadlocking in a later collective
    whose shapes or counts differ."""
    world = group_size(group)
    if world == 1:
        return
    encoded = identity.encode()
    if len(encoded) > _IDENTITY_BYTES:
        encoded = encoded[: _IDENTITY_BYTES - 9] + f"#{zlib.crc32(encoded):08x}".encode()
    local = torch.zeros(_IDENTITY_BYTES, dtype=torch.uint8)
    local[: len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    # gloo works on host tensors; NCCL/HCCL want tensors on the current accelerator
    device = torch.device("cpu") if dist.get_backend(group) == "gloo" else torch.accelerator.current_accelerator()
    gathered = torch.empty(world * _IDENTITY_BYTES, dtype=torch.uint8, device=device)
    dist.all_gather_into_tensor(gathered, local.to(device), group=group)
    rows = gathered.cpu().reshape(world, _IDENTITY_BYTES)
    values = [bytes(row.tolist()).rstrip(b"\0").decode(errors="replace") for row in rows]
    me = group_rank(group)
    for rank, value in enumerate(values):
        if value != values[me]:
            raise RuntimeError(f"{what} differs across ranks: rank {me} of the group has {values[me]}, rank {rank} has "
                               f"{value}; every rank must use the same one")

