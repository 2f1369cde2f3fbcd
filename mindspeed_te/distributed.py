"""Tensor- and sequence-parallel communication as autograd functions over an explicit process group.

Sequence-parallel tensors are split along dim 0 (Megatron's [s, b, h] layout puts the sequence first);
tensor-parallel activations are split along the last dim.
"""
from __future__ import annotations

import zlib
from typing import Callable, Optional

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


def _identity(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return x


def _all_reduce_copy(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return _all_reduce(x.clone(), group)


Collective = Callable[[torch.Tensor, ProcessGroup], torch.Tensor]


class _Collective(torch.autograd.Function):
    """`forward_op(x, group)` forward and `backward_op(grad, group)` backward: each region function below is
    one pair of collectives that are each other's adjoint."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, forward_op: Collective, backward_op: Collective):
        ctx.group, ctx.backward_op = group, backward_op
        return forward_op(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.backward_op(grad, ctx.group), None, None, None


def _region(x: torch.Tensor, group: ProcessGroup, forward_op: Collective, backward_op: Collective) -> torch.Tensor:
    return _Collective.apply(x, group, forward_op, backward_op) if group_size(group) > 1 else x


def copy_to_tensor_parallel_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Identity forward, all-reduce of the gradient backward (input of a column-parallel linear)."""
    return _region(x, group, _identity, _all_reduce)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """All-reduce forward, identity backward (output of a row-parallel linear)."""
    return _region(x, group, _all_reduce_copy, _identity)


def gather_from_sequence_parallel_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """All-gather along dim 0 forward, reduce-scatter backward (sequence-parallel input of a column linear)."""
    return _region(x, group, _all_gather_dim0, _reduce_scatter_dim0)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Reduce-scatter along dim 0 forward, all-gather backward (sequence-parallel output of a row linear)."""
    return _region(x, group, _reduce_scatter_dim0, _all_gather_dim0)


def gather_from_tensor_parallel_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """All-gather along the last dim forward, keep this rank's slice backward (gather_output)."""
    return _region(x, group, _gather_last, _split_last)


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

