"""Non-finite flags: one float32 per quantizer slot, 0 while every tensor quantized there was finite and
NaN once one held NaN/Inf. Where they live, how a step's notes are folded into them, how they are copied to
the host without waiting for the device (`HostCopy`), how they are cleared.

The flags of the recipe states live in a few shared 1-D buffers (`take_flags`), so that folding a whole
step's notes, or clearing every flag, is a fixed handful of ops on those buffers whatever the number of
layers: on an NPU a multi-tensor op over per-slot tensors is one launch per 16 to 48 of them, or one per
tensor where torch_npu has no kernel (see `npu_foreach`).
"""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["NonfinitePair", "PendingPairs", "HostCopy", "take_flags", "fold_nonfinite_pairs", "clear_flags",
           "zero_nonfinite"]

# (a quantizer's one-element flag, the decode scales of a tensor it quantized, whether those are block scales
# (any number of them) rather than one per-tensor scale): what quantizers note and `fold_nonfinite_pairs` folds.
# NaN/Inf data gives a NaN decode scale (`scaling.mark_nonfinite`), a non-finite per-tensor scale from the
# NPU's dynamic quantize, or for MX E8M0's NaN byte 0xFF.
NonfinitePair = tuple[torch.Tensor, torch.Tensor, bool]

_CHUNK = 1 << 16  # flags per shared buffer: 256 KiB, more than any model's slots
_chunks: dict[torch.device, list] = {}  # device -> [buffer, flags handed out]
_indices: dict[tuple, torch.Tensor] = {}  # (positions, device) -> index tensor, made once per layout


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


def _as_values(scales: torch.Tensor) -> torch.Tensor:
    """Decode scales as float32 values whose NaN/Inf mark a non-finite tensor: float32 as they are, MX E8M0
    bytes as their values (0xFF is E8M0's NaN; the others are finite powers of 2), one cast."""
    return scales.view(torch.float8_e8m0fnu).float() if scales.dtype == torch.uint8 else scales


def _fold_blocks(buffer: torch.Tensor, positions: list[int], scales: list[torch.Tensor]) -> None:
    """Fold block scales (scales[j] for the flag at buffer position positions[j]) into one flag buffer:
    per dtype, the scales concatenated in the order of their flags' positions, each element's position made by
    one repeat of the segment lengths (a segment per position between the first flag and the last, empty where
    no scale is noted), then one indexed add of 0 * value into that range of the buffer: NaN where a value is
    NaN or Inf. Three launches for float32 scales (cat, repeat, add), four for E8M0 bytes (and their cast)."""
    device = buffer.device
    by_dtype: dict[torch.dtype, list[int]] = {}
    for j in sorted(range(len(scales)), key=positions.__getitem__):
        by_dtype.setdefault(scales[j].dtype, []).append(j)
    for members in by_dtype.values():
        first, last = positions[members[0]], positions[members[-1]]
        lengths = [0] * (last - first + 1)
        for j in members:
            lengths[positions[j] - first] += scales[j].numel()
        flat = [scales[j].reshape(-1) for j in members]
        values = _as_values(torch.cat(flat) if len(flat) > 1 else flat[0])
        where = torch.repeat_interleave(_index(lengths, device), output_size=values.numel())
        buffer.narrow(0, first, len(lengths)).index_add_(0, where, values, alpha=0.0)


def fold_nonfinite_pairs(pairs: Sequence[NonfinitePair]) -> None:
    """Fold decode scales into their flags: flag + 0 * value, NaN where a value is NaN or Inf. No host sync,
    and a fixed number of ops for one pair as for a whole step's: per flag buffer, the per-tensor scales
    concatenated and one indexed add, the block scales `_fold_blocks`."""
    if not pairs:
        return
    if len(pairs) == 1 and not pairs[0][2]:  # one per-tensor quantize: one op
        flag, scale_inv, _ = pairs[0]  # a reshape costs microseconds of host time: only where shapes differ
        flag.add_(scale_inv if scale_inv.shape == flag.shape else scale_inv.reshape(flag.shape), alpha=0.0)
        return
    device = pairs[0][0].device
    for buffer, positions, members in _by_buffer([flag for flag, _, _ in pairs]).values():
        blocks = [j for j, i in enumerate(members) if pairs[i][2]]
        if blocks:
            _fold_blocks(buffer, [positions[j] for j in blocks], [pairs[members[j]][1] for j in blocks])
        tensors = [j for j, i in enumerate(members) if not pairs[i][2]]
        if tensors:
            values = torch.cat([pairs[members[j]][1].reshape(1) for j in tensors])
            buffer.index_add_(0, _index([positions[j] for j in tensors], device), values, alpha=0.0)


class PendingPairs(list):
    """The pairs a step's quantizes noted, for one fold at the step's end (`fold`). Once they hold `FOLD_AT`
    scale elements they are folded at once, so that neither the scales a long step (many micro-batches of a
    large model) keeps alive for its fold nor the fold's own buffers, a few times their size, grow with it."""

    FOLD_AT = 1 << 23
    elements = 0

    def note(self, pair: NonfinitePair) -> None:
        self.append(pair)
        self.elements += pair[1].numel()
        if self.elements >= self.FOLD_AT:
            self.fold()

    def fold(self) -> None:
        """Fold every pair noted so far. The pairs are taken first: a failure cannot leave them behind."""
        pairs = list(self)
        self.clear()
        self.elements = 0
        fold_nonfinite_pairs(pairs)


def clear_flags(flags: Sequence[torch.Tensor]) -> None:
    """Zero the flags: one indexed fill per buffer they are views of."""
    for buffer, positions, _ in _by_buffer(flags).values():
        buffer.index_fill_(0, _index(positions, buffer.device), 0.0)


def zero_nonfinite(tensors: Sequence[torch.Tensor]) -> None:
    """Set the NaN/Inf elements of `tensors` (contiguous views, e.g. amax slots) to 0, whatever they hold: per
    buffer they are views of, one gather, one nan_to_num and one scatter, not an op per tensor."""
    for buffer, positions, _ in _by_buffer(tensors).values():
        flat, index = buffer.view(-1), _index(positions, buffer.device)
        flat.index_copy_(0, index, flat.index_select(0, index).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0))


class HostCopy:
    """The values of some flags, copied to host memory without waiting for the device: one concatenation, one
    non-blocking copy into pinned memory, and an event recorded after it on the device's stream (through the
    device's own module, `getattr(torch, device.type)`: torch.npu, torch.cuda; no backend is imported here).
    The flags may be cleared as soon as this returns: the copy runs before, in stream order.

    `ready()` says, never waiting, whether the copy is known to be done: only an event can say so. On the CPU
    there is none (the copy is done at once, but a read of it inside a step is a host read all the same, which
    the step must not make), and neither on a device whose module has no events, where the copy is made
    blocking; either is read where the host reads anyway (`values`)."""

    def __init__(self, flags: Sequence[torch.Tensor]) -> None:
        values = flags[0] if len(flags) == 1 else torch.cat(list(flags))
        device = values.device
        module = getattr(torch, device.type, None) if device.type != "cpu" else None
        event_type = getattr(module, "Event", None)
        self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=event_type is not None)
        self.host.copy_(values, non_blocking=event_type is not None)
        self.event = None
        if event_type is not None:
            self.event = event_type()
            self.event.record(module.current_stream(device))

    def ready(self) -> bool:
        return self.event is not None and self.event.query()

    def values(self) -> list[float]:
        """The copied values, waiting for the copy where it is not done."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()
