"""Attention masks made only of where the queries and keys sit, handed to the backends as a pattern rather than a
matrix: a kernel with modes for them (the NPU's fused attention: causal and band modes on one fixed 2048x2048 mask,
skipping the masked blocks; packed sequences by their lengths) takes the pattern as it is, and the others build its
matrix (a causal pattern's once per shape, within a byte budget)."""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, TypeVar, Union

import torch

T = TypeVar("T")


def window_band(q_pos: torch.Tensor, k_pos: torch.Tensor, window: tuple[int, int]) -> torch.Tensor:
    """Keys within (left, right) of the query's position; -1 leaves that side unbounded."""
    left, right = window
    band = torch.ones(q_pos.numel(), k_pos.numel(), dtype=torch.bool, device=q_pos.device)
    if left >= 0:
        band &= k_pos[None, :] >= q_pos[:, None] - left
    if right >= 0:
        band &= k_pos[None, :] <= q_pos[:, None] + right
    return band


@dataclass(frozen=True)
class CausalMask:
    """Keys after the query masked (`causal`), the query at position i aligned with key i (top-left) or the last
    query with the last key (`bottom_right`), and/or only keys within `window` = (left, right) of the query's
    bottom-right aligned position (-1 = unbounded)."""

    causal: bool
    bottom_right: bool
    window: Optional[tuple[int, int]] = None

    def allowed(self, s_q: int, s_k: int, device: torch.device) -> torch.Tensor:
        """The boolean "may attend" matrix [s_q, s_k], kept for reuse within `MASK_CACHE_BYTES` (do not modify
        it); one made under inference mode serves only there, as autograd cannot save it."""
        return _allowed(self, s_q, s_k, torch.device(device), torch.is_inference_mode_enabled())


# The bytes of mask matrices kept for reuse, all shapes and devices together. Every layer of a micro-batch asks for
# the same matrix, so keeping the last few makes it once per shape; a matrix is s_q * s_k bytes (1 GiB at 32k
# tokens), so the matrices kept are bounded by their size, not their count: 64 MiB keeps one 8k x 8k matrix or
# many small ones; a larger one is made on every call and not kept (a kernel without a mode for the pattern
# then spends far more on its [b, h, s_q, s_k] scores than on the mask).
MASK_CACHE_BYTES = 64 << 20
_MASKS: OrderedDict[tuple, torch.Tensor] = OrderedDict()  # least recently used first
_MASKS_LOCK = threading.Lock()


def _allowed(mask: CausalMask, s_q: int, s_k: int, device: torch.device, inference: bool) -> torch.Tensor:
    """The matrix from the cache, else made and kept, the least recently used ones dropped to fit the budget."""
    key = (mask, s_q, s_k, device, inference)
    with _MASKS_LOCK:
        kept = _MASKS.get(key)
        if kept is not None:
            _MASKS.move_to_end(key)
            return kept
    made = _make_allowed(mask, s_q, s_k, device)
    budget = MASK_CACHE_BYTES
    if made.nbytes > budget:
        return made
    with _MASKS_LOCK:
        _MASKS[key] = made
        _MASKS.move_to_end(key)
        held = sum(m.nbytes for m in _MASKS.values())
        while held > budget:
            _, dropped = _MASKS.popitem(last=False)
            held -= dropped.nbytes
    return made


def _make_allowed(mask: CausalMask, s_q: int, s_k: int, device: torch.device) -> torch.Tensor:
    q_pos = torch.arange(s_q, device=device)
    k_pos = torch.arange(s_k, device=device)
    shift = s_k - s_q
    structure = torch.ones(s_q, s_k, dtype=torch.bool, device=device)
    if mask.causal:
        structure &= k_pos[None, :] <= (q_pos + shift if mask.bottom_right else q_pos)[:, None]
    if mask.window is not None:
        structure &= window_band(q_pos + shift, k_pos, mask.window)
    return structure


def kept_per_tensors(cache: dict, tensors: Sequence[Optional[torch.Tensor]], extra: tuple, make: Callable[[], T],
                     bound: int = 64) -> T:
    """make(), made once per `tensors` (by identity and version: an in-place change makes it again) and `extra`,
    and kept in `cache` (cleared past `bound` entries). Megatron hands every layer of a micro-batch the same
    cu_seqlens, so what is derived from them on the host is made once per micro-batch, not once per layer."""
    key = (tuple((id(t), None if t is None else t._version) for t in tensors), extra)
    entry = cache.get(key)
    if entry is not None and all((ref is None) if t is None else (ref is not None and ref() is t)
                                 for ref, t in zip(entry[0], tensors)):
        return entry[1]
    value = make()
    if len(cache) >= bound:
        cache.clear()
    cache[key] = (tuple(None if t is None else weakref.ref(t) for t in tensors), value)
    return value


_HOST_ENDS: dict = {}


def host_ends(cu_seqlens: torch.Tensor) -> list[int]:
    """cu_seqlens[1:] as a host list, read from the device once per tensor and version (`kept_per_tensors`)."""
    return kept_per_tensors(_HOST_ENDS, (cu_seqlens,), (),
                            lambda: [int(v) for v in cu_seqlens[1:].tolist()])


def host_lengths(cu_seqlens: torch.Tensor) -> list[int]:
    """The lengths cumulative sums from 0 describe, from `host_ends`."""
    ends = host_ends(cu_seqlens)
    return [end - start for start, end in zip([0] + ends[:-1], ends)]


@dataclass(frozen=True, eq=False)
class PackedMask:
    """Packed sequences (thd): a query sees only the keys of its own sequence (`cu_seqlens_q` / `cu_seqlens_kv`:
    cumulative lengths from 0), all of them or (`causal`) those up to its own position from the sequence's start.
    Without `cu_seqlens_q_padded` / `cu_seqlens_kv_padded` the sequences cover every token; with them sequence i
    starts at their entry i and the tokens after its length up to the next start are padding, which sees no key
    and no query sees. `bottom_right` aligns a causal sequence's last query with its last key (a sequence may then
    have more keys than queries). A kernel with a varlen mode takes the lengths; others call `dense` for the
    matrix."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_kv: torch.Tensor
    causal: bool
    dense: Callable[[], torch.Tensor]
    cu_seqlens_q_padded: Optional[torch.Tensor] = None
    cu_seqlens_kv_padded: Optional[torch.Tensor] = None
    bottom_right: bool = False


def as_matrix(mask: Optional[Union[torch.Tensor, CausalMask, PackedMask]], s_q: int, s_k: int,
              device: torch.device) -> Optional[torch.Tensor]:
    """A pattern's boolean "may attend" matrix [s_q, s_k]; a tensor or None as it is."""
    if isinstance(mask, CausalMask):
        return mask.allowed(s_q, s_k, device)
    if isinstance(mask, PackedMask):
        return mask.dense()
    return mask


def additive(allowed: Optional[torch.Tensor], s_q: int, s_k: int, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
    """A float mask [1, 1, s_q, s_k] (or `allowed`'s batch), 0 where `allowed` (None: everywhere), -inf elsewhere."""
    mask = torch.zeros(1, 1, s_q, s_k, dtype=dtype, device=device)
    return mask if allowed is None else mask.masked_fill(~allowed, float("-inf"))
