"""Non-finite flags: one float32 per quantizer slot, 0 while every tensor quantized there was finite and
NaN once one held NaN/Inf. Where they live, how a step's notes are folded into them, how they are cleared.

The flags of the recipe states live in a few shared 1-D buffers (`take_flags`), so that folding a whole
step's notes, or clearing every flag, is a fixed handful of ops on those buffers whatever the number of
layers: on an NPU a multi-tensor op over per-slot tensors is one launch per 16 to 48 of them, or one per
tensor where torch_npu has no kernel (see `npu_foreach`).
"""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["NonfinitePair", "take_flags", "fold_nonfinite_pairs", "clear_flags"]

# (a quantizer's one-element flag, the decode scales of a tensor it quantized, whether those are block scales
# (any number of them) rather than one per-tensor scale): what quantizers note and `fold_nonfinite_pairs` folds.
# NaN/Inf data gives a NaN decode scale (`scaling.mark_nonfinite`), a non-finite per-tensor scale from the
# NPU's dynamic quantize, or for MX E8M0's NaN byte 0xFF.
NonfinitePair = tuple[torch.Tensor, torch.Tensor, bool]

_CHUNK = 1 << 16  # flags per shared buffer: 256 KiB, more than any model's slots
_chunks: dict[torch.device, list] = {}  # device -> [buffer, flags handed out]
_indices: dict[tuple, torch.Tensor] = {}  # (positions, device) -> index tensor, made once per layout
_heads: dict[tuple, torch.Tensor] = {}  # (dtype, device) -> the one-element 0 of `_head`


def take_flags(n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """n zeroed flags, a slice of the device's current shared buffer (a new buffer when it is full; a buffer
    lives as long as a slice of it does)."""
    device = torch.device(device if device is not None else "cpu")
    entry = _chunks.get(device)
    if entry is None or entry[1] + n > entry[0].numel():
        entry = _chunks[device] = [torch.zeros(max(_CHUNK, n), dtype=torch.float32, device=device), 0]
    start, entry[1] = entry[1], entry[1] + n
    return entry[0][start : start + n]


def _by_buffer(flags: Sequence[torch.Tensor]) -> dict[int, tuple[torch.Tensor, list[int], list[int]]]:
    """The flags grouped by the 1-D buffer they are views of (a flag that is no view is its own buffer):
    id -> (buffer, the positions of the flags' elements in it, the indices in `flags` of its flags)."""
    groups: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
    for i, flag in enumerate(flags):
        buffer = flag if flag._base is None else flag._base
        group = groups.setdefault(id(buffer), (buffer, [], []))
        start = flag.storage_offset() - buffer.storage_offset()
        group[1].extend(range(start, start + flag.numel()))
        group[2].append(i)
    return groups


def _index(positions: Sequence[int], device: torch.device) -> torch.Tensor:
    """`positions` as a device index tensor, made once per layout (a step's layout repeats every step)."""
    key = (tuple(positions), device)
    index = _indices.get(key)
    if index is None:
        if len(_indices) >= 64:
            _indices.clear()
        index = _indices[key] = torch.tensor(key[0], dtype=torch.long, device=device)
    return index


def _head(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A one-element 0 of `dtype`, made once: the finite head of concatenated block scales."""
    key = (dtype, device)
    if key not in _heads:
        _heads[key] = torch.zeros(1, dtype=dtype, device=device)
    return _heads[key]


def _block_values(pairs: Sequence[NonfinitePair], device: torch.device) -> torch.Tensor:
    """Per pair 0 if all its scales are finite, else NaN: per dtype, the scales concatenated behind a finite
    head, their non-finite elements (NaN/Inf; MX: the byte 0xFF) counted by one cumulative sum read before
    and at each tensor's last element (one index_select), and sqrt(count before - count through)."""
    values = None
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, (_, scales, _) in enumerate(pairs):
        by_dtype.setdefault(scales.dtype, []).append(i)
    for dtype, members in by_dtype.items():
        scales = [pairs[i][1].reshape(-1) for i in members]
        flat = torch.cat([_head(dtype, device), *scales])
        # NaN/Inf: x * 0 != 0 (two kernels; isfinite is one on the NPU, but four ops where it is composite)
        bad = torch.eq(flat, 0xFF) if dtype == torch.uint8 else torch.ne(flat.mul(0.0), 0.0)
        counts = torch.cumsum(bad, 0, dtype=torch.int32)
        before, through, position = [], [], 0
        for t in scales:
            before.append(position)
            position += t.numel()
            through.append(position)
        around = counts.index_select(0, _index(before + through, device)).view(2, -1)
        folded = torch.sqrt(torch.sub(around[0], around[1]))
        if len(by_dtype) == 1:
            return folded
        if values is None:
            values = torch.empty(len(pairs), dtype=torch.float32, device=device)
        values.index_copy_(0, _index(members, device), folded)
    return values


def fold_nonfinite_pairs(pairs: Sequence[NonfinitePair]) -> None:
    """Fold decode scales into their flags: flag + 0 * value, NaN where a value is NaN or Inf. No host sync,
    and a fixed number of ops for one pair as for a whole step's: the per-tensor scales concatenated (block
    scales first reduced by `_block_values`), then one indexed add per flag buffer."""
    if not pairs:
        return
    if len(pairs) == 1 and not pairs[0][2]:  # one per-tensor quantize: one op
        flag, scale_inv, _ = pairs[0]  # a reshape costs microseconds of host time: only where shapes differ
        flag.add_(scale_inv if scale_inv.shape == flag.shape else scale_inv.reshape(flag.shape), alpha=0.0)
        return
    device = pairs[0][0].device
    if any(reduce for _, _, reduce in pairs):
        values = _block_values(pairs, device)
    else:
        values = torch.cat([scale_inv.reshape(1) for _, scale_inv, _ in pairs])
    groups = _by_buffer([flag for flag, _, _ in pairs])
    for buffer, positions, members in groups.values():
        mine = values if len(groups) == 1 else values.index_select(0, _index(members, device))
        buffer.index_add_(0, _index(positions, device), mine, alpha=0.0)


def clear_flags(flags: Sequence[torch.Tensor]) -> None:
    """Zero the flags: one indexed fill per buffer they are views of."""
    for buffer, positions, _ in _by_buffer(flags).values():
        buffer.index_fill_(0, _index(positions, buffer.device), 0.0)
