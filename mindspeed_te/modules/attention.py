"""`DotProductAttention`: softmax(Q Kᵀ · scale + mask) V on [s, b, h, d] (sbhd) or packed [t, h, d] (thd)
tensors, with GQA, sliding windows, softmax with an offset in the denominator (off-by-one or learnable),
context parallelism and dropout drawn from an RNG tracker. It runs in the input precision through the kernel
backend (torch's scaled_dot_product_attention on CPU); with a per-tensor recipe's fp8_dpa / fp8_mha, Q, K and V
go in as FP8 and only their codes are kept for backward (mindspeed_te/ops/fp8_attention.py). As in TE, the recipe
attention runs under may differ from the linear layers' (NVTE_DPA_FP8_RECIPE, `dpa_fp8_recipe`).

Every case reduces to one boolean "may attend" matrix built from where each query and key sits: which
packed sequence (segment), its position inside that sequence, and whether it is padding. Under context
parallelism each rank holds chunks r and 2·cp-1-r of every sequence (Megatron's load-balanced split): the
keys and values of all ranks are gathered (their gradients reduce-scattered back) and the matrix is built
from the gathered tokens' global positions, so every cp_comm_type computes exactly full attention. A causal or
sliding-window mask alone reaches the backend as its pattern (`CausalMask`), and so do packed sequences, padded
or not (`PackedMask`): the NPU's fused attention has modes for those that skip the masked blocks and need no
matrix of the sequence's size. Causal attention under context parallelism needs none either: each local chunk
attends the gathered keys of its sequence up to it, a causal block aligned at its last key (sbhd: a
`CausalMask` per chunk; thd: one `PackedMask` for all of them)."""
from __future__ import annotations

import contextlib
import functools
import math
import os
import warnings
from dataclasses import dataclass
from itertools import accumulate
from typing import Callable, Optional, Union

import torch

from mindspeed_te.distributed import ProcessGroup, gather_from_sequence_parallel_region, group_rank, group_size
from mindspeed_te.kernels import get_backend
from mindspeed_te.kernels.masks import (
    CausalMask,
    PackedMask,
    additive,
    as_matrix,
    host_ends,
    host_lengths,
    kept_per_tensors,
    window_band,
)
from mindspeed_te.modules.base import FP8ModuleBase
from mindspeed_te.modules.linear import divide, resolve_tp_size
from mindspeed_te.modules.rope import thd_positions
from mindspeed_te.ops.fp8_attention import AttentionQuantizers, fp8_attention
from mindspeed_te.quantizers import Float8CurrentScalingQuantizer
from mindspeed_te.recipe import DelayedScaling, Float8CurrentScaling, Format, MXFP8BlockScaling, Recipe
from mindspeed_te.recipe_state import RecipeState
from mindspeed_te.state import FP8GlobalStateManager

MASK_TYPES = ("causal", "padding", "no_mask", "padding_causal", "causal_bottom_right",
              "padding_causal_bottom_right")
QKV_FORMATS = ("sbhd", "thd")
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
# NVTE_DPA_FP8_RECIPE's values ("": unset, attention follows the linear recipe)
DPA_FP8_RECIPES = ("", "F16", "DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling")
# NVTE_DPA_FP8_FORMAT's values: TE's, less E5M2 (no recipe here takes it), plus HiF8
DPA_FP8_FORMATS = {"HYBRID": Format.HYBRID, "E4M3": Format.E4M3, "HIF8": Format.HIF8}


def _env_choice(name: str, default: str, allowed: tuple[str, ...]) -> str:
    """Variable `name` (`default` when unset), refused unless one of `allowed`: TE would fail later, or not at all."""
    value = os.getenv(name, default)
    if value not in allowed:
        shown = ", ".join(repr(a) for a in allowed if a) + (" or unset" if "" in allowed else "")
        raise ValueError(f"{name} must be one of {shown}, got {value!r}")
    return value


@dataclass(frozen=True)
class DPAFP8Settings:
    """TransformerEngine's NVTE_DPA_FP8_* variables: the recipe attention runs under when it is not the linear
    layers' (`recipe`: NVTE_DPA_FP8_RECIPE), the format of one made under FP4 linears (NVTE_DPA_FP8_FORMAT), and
    the amax settings of a delayed-scaling one made here (NVTE_DPA_FP8DS_AMAX_ALGO, _AMAX_HISTLEN, _REDUCE_AMAX).
    TE reads them at import; `from_env` reads them when a DotProductAttention is made."""

    recipe: str = ""
    fp8_format: Format = Format.HYBRID
    amax_compute_algo: str = "most_recent"
    amax_history_len: int = 1
    reduce_amax: bool = True

    @classmethod
    def from_env(cls) -> DPAFP8Settings:
        """The variables as set now (TE's defaults where unset); a bad value raises, naming the variable."""
        fmt = _env_choice("NVTE_DPA_FP8_FORMAT", "HYBRID", tuple(DPA_FP8_FORMATS))
        history = os.getenv("NVTE_DPA_FP8DS_AMAX_HISTLEN", "1")
        if not history.isdigit() or int(history) < 1:
            raise ValueError(f"NVTE_DPA_FP8DS_AMAX_HISTLEN must be an integer >= 1, got {history!r}")
        return cls(recipe=_env_choice("NVTE_DPA_FP8_RECIPE", "", DPA_FP8_RECIPES),
                   fp8_format=DPA_FP8_FORMATS[fmt],
                   amax_compute_algo=_env_choice("NVTE_DPA_FP8DS_AMAX_ALGO", "most_recent", ("most_recent", "max")),
                   amax_history_len=int(history),
                   reduce_amax=_env_choice("NVTE_DPA_FP8DS_REDUCE_AMAX", "1", ("1", "0")) == "1")


def dpa_fp8_recipe(recipe: Recipe, settings: DPAFP8Settings) -> Optional[Recipe]:
    """The recipe attention runs under inside an autocast of `recipe` (TE's `fp8_recipe_dpa`), or None when it
    stays in high precision: without the recipe's fp8_dpa / fp8_mha, or with NVTE_DPA_FP8_RECIPE=F16. The rows of
    TE's table: delayed attention under current-scaling, MXFP8 or FP4 linears; current-scaling attention under
    delayed, MXFP8 or FP4 linears; MXFP8 attention under per-tensor or FP4 linears; otherwise `recipe` itself. A
    recipe made here takes fp8_dpa and fp8_mha from `recipe`, and its format too, except under FP4 linears
    (NVTE_DPA_FP8_FORMAT; TE's NVFP4 rows, which MXFP4 follows here)."""
    flags = dict(fp8_dpa=getattr(recipe, "fp8_dpa", False), fp8_mha=getattr(recipe, "fp8_mha", False))
    if not any(flags.values()) or settings.recipe == "F16":
        return None
    fp4 = recipe.nvfp4() or recipe.mxfp4()
    fmt = settings.fp8_format if fp4 else recipe.fp8_format
    if settings.recipe == "DelayedScaling" and (recipe.float8_current_scaling() or recipe.mxfp8() or fp4):
        return DelayedScaling(fp8_format=fmt, amax_history_len=settings.amax_history_len,
                              amax_compute_algo=settings.amax_compute_algo, reduce_amax=settings.reduce_amax, **flags)
    if settings.recipe == "Float8CurrentScaling" and (recipe.delayed() or recipe.mxfp8() or fp4):
        return Float8CurrentScaling(fp8_format=fmt, **flags)
    if settings.recipe == "MXFP8BlockScaling" and (recipe.float8_per_tensor_scaling() or fp4):
        return MXFP8BlockScaling(fp8_format=fmt, **flags)
    return recipe


@dataclass
class _Layout:
    """Where tokens sit along the attended dim: packed-sequence id, position in it, and not padding."""

    segment: torch.Tensor
    position: torch.Tensor
    valid: torch.Tensor


def _layout(local: int, cu_seqlens: Optional[torch.Tensor], cu_seqlens_padded: Optional[torch.Tensor],
            cp_size: int, cp_rank: int, device: torch.device) -> _Layout:
    """The layout of one rank's `local` tokens: one sequence (sbhd) or the packed ones `cu_seqlens` describe
    (stored at the `cu_seqlens_padded` offsets when given)."""
    if cu_seqlens is None:
        bounds = torch.tensor([0, local * cp_size], device=device)
        lengths = bounds[1:]
    else:
        bounds = (cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens).to(device)
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(device)
    position = thd_positions(bounds, cp_size, cp_rank)
    if position.numel() != local:
        raise ValueError(f"cu_seqlens describe {position.numel()} tokens on this rank, the input has {local}")
    per_rank = (bounds[1:] - bounds[:-1]) // cp_size
    segment = torch.repeat_interleave(torch.arange(per_rank.numel(), device=device), per_rank)
    return _Layout(segment, position, position < lengths[segment])


@dataclass(frozen=True)
class _PackedChunks:
    """Causal packed sequences under context parallelism, one rank's view: sequence i (slot of 2·cp chunks of
    c_i tokens) gives the rank's chunk r and chunk 2·cp-1-r as queries, each against the keys of the sequence's
    chunks up to its own, in sequence order. `index` picks those keys from the gathered ones (ranks' tokens one
    after another), `cu_q` / `cu_kv` (host tensors) delimit the query chunks and their key runs, and `padding`
    marks the rank's padding rows ([tokens, 1, 1], or None)."""

    index: torch.Tensor
    cu_q: torch.Tensor
    cu_kv: torch.Tensor
    padding: Optional[torch.Tensor]


def _chunk_start(m: int, cp_size: int, chunk: int, local: int, offset: int = 0) -> int:
    """Where chunk m (of `chunk` tokens) of a sequence lies among the gathered tokens of all ranks, each rank's
    `local` tokens after the previous rank's, the sequence starting at `offset` in each: Megatron's load-balanced
    split gives rank r chunks r and 2·cp-1-r, in that order."""
    holder = m if m < cp_size else 2 * cp_size - 1 - m
    return holder * local + offset + (0 if m < cp_size else chunk)


_PLANS: dict = {}


def _packed_chunks(cu_seqlens: torch.Tensor, cu_seqlens_padded: Optional[torch.Tensor], cp_size: int, rank: int,
                   device: torch.device) -> Optional[_PackedChunks]:
    """The `_PackedChunks` of these cumulative lengths, made once per tensors and versions (`kept_per_tensors`)
    and apart under inference mode (autograd cannot save an inference-mode index): host values (`host_ends`),
    two host-to-device copies (the index, the padding). None when a slot is not whole 2·cp chunks or a sequence
    overruns it."""
    def make() -> Optional[_PackedChunks]:
        lengths = host_lengths(cu_seqlens)
        slots = host_lengths(cu_seqlens_padded) if cu_seqlens_padded is not None else lengths
        if len(slots) != len(lengths) or any(p % (2 * cp_size) or not 0 <= n <= p for n, p in zip(lengths, slots)):
            return None
        chunks = [p // (2 * cp_size) for p in slots]
        local, last = 2 * sum(chunks), 2 * cp_size - 1 - rank
        picks, q_lens, kv_lens, padding = [], [], [], []
        offset = 0  # where sequence i starts in each rank's tokens
        for c, n in zip(chunks, lengths):
            for mine in (rank, last):
                q_lens.append(c)
                kv_lens.append((mine + 1) * c)
                for m in range(mine + 1):
                    start = _chunk_start(m, cp_size, c, local, offset)
                    picks.append(torch.arange(start, start + c))
                padding.append(torch.arange(mine * c, (mine + 1) * c) >= n)
            offset += 2 * c
        if not picks:
            return None
        pad = torch.cat(padding)
        return _PackedChunks(torch.cat(picks).to(device), torch.tensor(list(accumulate(q_lens, initial=0))),
                             torch.tensor(list(accumulate(kv_lens, initial=0))),
                             pad.reshape(-1, 1, 1).to(device) if bool(pad.any()) else None)

    return kept_per_tensors(_PLANS, (cu_seqlens, cu_seqlens_padded),
                            (cp_size, rank, device, torch.is_inference_mode_enabled()), make, bound=16)


def _bottom_right_packed(cu_q: torch.Tensor, cu_kv: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The "may attend" matrix of packed sequences, causal from each sequence's last key (`PackedMask.dense`)."""
    q_lens, kv_lens = torch.diff(cu_q).to(device), torch.diff(cu_kv).to(device)
    q_seg = torch.repeat_interleave(torch.arange(q_lens.numel(), device=device), q_lens)
    k_seg = torch.repeat_interleave(torch.arange(kv_lens.numel(), device=device), kv_lens)
    q_pos = torch.arange(q_seg.numel(), device=device) - cu_q[:-1].to(device)[q_seg]
    k_pos = torch.arange(k_seg.numel(), device=device) - cu_kv[:-1].to(device)[k_seg]
    # query j of a sequence with q queries and k keys sees keys up to j + k - q
    reach = q_pos + (kv_lens - q_lens)[q_seg]
    return (q_seg[:, None] == k_seg[None, :]) & (k_pos[None, :] <= reach[:, None])


class DotProductAttention(FP8ModuleBase):
    """TransformerEngine's core attention. Masks follow Megatron: a boolean `attention_mask` is True where
    attention is NOT allowed, shaped [b, 1, 1, s_k] or [b, 1, s_q, s_k]; "causal" masks keys after the query
    position (top-left aligned), "causal_bottom_right" aligns the last query with the last key.
    `window_size=(left, right)` keeps keys in [i - left, i + right] of query i (bottom-right aligned, -1 =
    unbounded). `softmax_type` "off-by-one" adds 1 to the softmax denominator, "learnable" adds
    exp(softmax_offset[h]) with a per-head parameter (zeros at start).

    Inside FP8 autocast with the recipe's fp8_dpa or fp8_mha, under DelayedScaling or Float8CurrentScaling (HiF8
    included), attention runs as TE's FP8 attention: Q, K, V enter in the forward format under one per-tensor
    scale, dO in the backward format, and backward keeps only the codes (mindspeed_te/ops/fp8_attention.py). As
    TE's DPA the module keeps that FP8 metadata in `fp8_meta` and `_extra_state`, under the recipe TE's
    NVTE_DPA_FP8_* variables choose (`dpa_fp8_recipe`; read when the module is made, into `dpa_fp8_settings`):
    e.g. NVTE_DPA_FP8_RECIPE=Float8CurrentScaling runs attention in FP8 under MXFP8 linears.

    Args:
        num_attention_heads: query heads of the whole layer (split over the TP group)
        kv_channels: head dimension
        num_gqa_groups: key/value heads for grouped-query attention (None: as many as query heads)
        attention_dropout: dropout probability on the attention weights (training only)
        attn_mask_type: one of MASK_TYPES ("causal", "padding", "no_mask", "padding_causal",
            "causal_bottom_right", "padding_causal_bottom_right")
        qkv_format: "sbhd" or "thd" (packed sequences with cu_seqlens)
        softmax_scale: scale of q·k (None: 1/sqrt(kv_channels))
        get_rng_state_tracker: returns Megatron's RNG tracker; dropout then runs in its model-parallel stream
        tp_size, tp_group: tensor-parallel size or group: each rank holds num_attention_heads / TP heads
        layer_number: the layer's index (for Megatron; recorded)
        attention_type: "self" or "cross"
        window_size: sliding window (see above; None: no window)
        softmax_type: "vanilla", "off-by-one" or "learnable" (see above)
        cp_group, cp_comm_type: context-parallel group (None: no CP) and Megatron's CP communication type (every type
            computes the same: keys/values are gathered)
        params_dtype, device: dtype and device of the `softmax_offset` parameter (learnable softmax)
    """

    def __init__(
        self,
        num_attention_heads: int,
        kv_channels: int,
        num_gqa_groups: Optional[int] = None,
        attention_dropout: float = 0.0,
        attn_mask_type: str = "causal",
        qkv_format: str = "sbhd",
        softmax_scale: Optional[float] = None,
        get_rng_state_tracker: Optional[Callable] = None,
        tp_size: int = 1,
        tp_group: ProcessGroup = None,
        layer_number: Optional[int] = None,
        attention_type: str = "self",
        window_size: Optional[tuple[int, int]] = None,
        softmax_type: str = "vanilla",
        cp_group: ProcessGroup = None,
        cp_comm_type: str = "p2p",
        params_dtype: Optional[torch.dtype] = None,
        device: Optional[torch.device | str] = None,
    ) -> None:
        super().__init__(num_gemms=3)  # TE's DPA keeps the FP8 metadata of 3 GEMMs
        if attn_mask_type not in MASK_TYPES:
            raise ValueError(f"attn_mask_type must be one of {', '.join(MASK_TYPES)}, got {attn_mask_type!r}")
        if qkv_format not in QKV_FORMATS:
            raise ValueError(f"qkv_format must be one of {', '.join(QKV_FORMATS)}, got {qkv_format!r}")
        if softmax_type not in SOFTMAX_TYPES:
            raise ValueError(f"softmax_type must be one of {', '.join(SOFTMAX_TYPES)}, got {softmax_type!r}")
        if cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(f"cp_comm_type must be one of {', '.join(CP_COMM_TYPES)}, got {cp_comm_type!r}")
        if window_size is not None and (len(window_size) != 2 or min(window_size) < -1):
            raise ValueError(f"window_size must be (left, right) with each >= -1 (-1 = unbounded), "
                             f"got {window_size!r}")
        groups = num_gqa_groups or num_attention_heads
        if num_attention_heads % groups:
            raise ValueError(f"num_attention_heads ({num_attention_heads}) must be a multiple of "
                             f"num_gqa_groups ({groups})")
        tp_size = resolve_tp_size(tp_group, tp_size)
        self.num_heads = divide(num_attention_heads, tp_size, "num_attention_heads")
        self.num_groups = divide(groups, tp_size, "num_gqa_groups")
        self.kv_channels = kv_channels
        self.attention_dropout = attention_dropout
        self.attn_mask_type = attn_mask_type
        self.qkv_format = qkv_format
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(kv_channels)
        self.get_rng_state_tracker = get_rng_state_tracker
        self.layer_number = layer_number
        self.attention_type = attention_type
        self.window_size = tuple(window_size) if window_size is not None else None
        self.softmax_type = softmax_type
        self.cp_group = cp_group
        self.cp_comm_type = cp_comm_type
        self.dpa_fp8_settings = DPAFP8Settings.from_env()
        # (the autocast recipe's key, dpa_fp8_recipe of it)
        self._dpa_recipe_of: tuple[Optional[str], Optional[Recipe]] = (None, None)
        if softmax_type == "learnable":
            self.softmax_offset = torch.nn.Parameter(torch.zeros(self.num_heads, dtype=params_dtype, device=device))
        else:
            self.softmax_offset = None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor] = None, attn_mask_type: Optional[str] = None,
                attention_bias: Optional[torch.Tensor] = None, *, qkv_format: Optional[str] = None,
                cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_kv: Optional[torch.Tensor] = None,
                cu_seqlens_q_padded: Optional[torch.Tensor] = None,
                cu_seqlens_kv_padded: Optional[torch.Tensor] = None,
                max_seqlen_q: Optional[int] = None, max_seqlen_kv: Optional[int] = None) -> torch.Tensor:
        """sbhd in, [s, b, h·d] out; thd ([t, h, d], with cu_seqlens_q/kv) in, [t, h·d] out. Under context
        parallelism the inputs are this rank's share and so is the output."""
        mask_type = attn_mask_type or self.attn_mask_type
        if mask_type not in MASK_TYPES:
            raise ValueError(f"attn_mask_type must be one of {', '.join(MASK_TYPES)}, got {mask_type!r}")
        fmt = qkv_format or self.qkv_format
        if fmt not in QKV_FORMATS:
            raise ValueError(f"qkv_format must be one of {', '.join(QKV_FORMATS)}, got {fmt!r}")
        if fmt == "thd":
            if cu_seqlens_q is None or cu_seqlens_kv is None:
                raise ValueError("qkv_format 'thd' needs cu_seqlens_q and cu_seqlens_kv")
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))
        if query.shape[2] % key.shape[2]:
            raise ValueError(f"query heads ({query.shape[2]}) must be a multiple of key/value heads ({key.shape[2]})")
        cp_size = group_size(self.cp_group) if self.cp_group is not None else 1
        if cp_size > 1 and attention_mask is not None and fmt == "sbhd":
            raise ValueError("context parallelism (--context-parallel-size > 1) with an explicit padding "
                             "attention_mask is not supported: pack the sequences (thd) instead")
        dropout = self.attention_dropout if self.training else 0.0
        rng = self.get_rng_state_tracker().fork() if dropout > 0 and self.get_rng_state_tracker else None
        attend = functools.partial(self._attend, mask_type=mask_type, attention_mask=attention_mask, cp_size=cp_size,
                                   packed=(cu_seqlens_q, cu_seqlens_q_padded, cu_seqlens_kv, cu_seqlens_kv_padded)
                                   if fmt == "thd" else None, dropout=dropout)
        extras = (self._softmax_offset(query), attention_bias)
        fp8 = self._fp8_attention(query.device, cp_size)
        if fp8 is None:
            with rng or contextlib.nullcontext():
                out = attend(query, key, value, *extras)
        else:
            quantizers, first = fp8
            out = fp8_attention(attend, query, key, value, extras, quantizers, rng=rng, dropout=dropout > 0,
                                reduce_amax_in_backward=first)
        return out.squeeze(1) if fmt == "thd" else out

    def _fp8_attention(self, device: torch.device, cp_size: int) -> Optional[tuple[AttentionQuantizers, bool]]:
        """The quantizers of FP8 attention and whether this is the step's first FP8 module, or None when
        attention runs in high precision: outside FP8 autocast, without the recipe's fp8_dpa / fp8_mha (TE
        forces fp8_dpa on with fp8_mha), with NVTE_DPA_FP8_RECIPE=F16, or under a recipe TE's FP8 attention has
        no per-tensor form for. As in TE the slots are this module's own (3 GEMMs' worth): Q, K, V at GEMM 1's
        output, O at GEMM 2's input, dO at GEMM 2's grad_input, dQ, dK, dV at GEMM 1's grad_output. Under current
        scaling with context parallelism each amax is reduced over the CP group, as TE does, so every rank uses
        one scale."""
        if not FP8GlobalStateManager.is_fp8_enabled():
            return None
        recipe = self._dpa_recipe()
        if recipe is None:
            return None
        if not recipe.float8_per_tensor_scaling():
            chosen = " (NVTE_DPA_FP8_RECIPE)" if self.dpa_fp8_settings.recipe == "MXFP8BlockScaling" else ""
            warnings.warn(f"fp8_dpa / fp8_mha (Megatron's fp8_dot_product_attention / fp8_multi_head_attention) "
                          f"under {type(recipe).__name__}{chosen}: mindspeed_te runs attention in FP8 under "
                          "DelayedScaling and Float8CurrentScaling only (NVTE_DPA_FP8_RECIPE chooses one of them "
                          "under MXFP8 and FP4 linears); this attention stays in high precision", stacklevel=3)
            return None
        fwd, bwd, first = self.prepare_forward(device)
        delayed = recipe.delayed()
        quantizers = AttentionQuantizers(
            qkv=fwd[self.fp8_meta_index("output", 0)], dout=bwd[self.fp8_meta_index("grad_input", 1)],
            out=fwd[self.fp8_meta_index("input", 1)] if delayed else None,
            dqkv=bwd[self.fp8_meta_index("grad_output", 0)] if delayed else None)
        if cp_size > 1:
            for quantizer in (quantizers.qkv, quantizers.dout):
                if isinstance(quantizer, Float8CurrentScalingQuantizer):
                    quantizer.amax_reduction_group = self.cp_group
        return quantizers, first

    def _dpa_recipe(self) -> Optional[Recipe]:
        """`dpa_fp8_recipe` of the autocast's recipe, made again only when that recipe's configuration changes (a
        recipe made here is then the same object from call to call)."""
        recipe = FP8GlobalStateManager.get_fp8_recipe()
        key = recipe.key()
        if self._dpa_recipe_of[0] != key:
            self._dpa_recipe_of = (key, dpa_fp8_recipe(recipe, self.dpa_fp8_settings))
        return self._dpa_recipe_of[1]

    def _states_for_current_recipe(self, device: torch.device,
                                   recipe: Optional[Recipe] = None) -> tuple[RecipeState, RecipeState]:
        """As TE's DPA: the states follow the recipe attention runs under, which need not be the autocast's. A
        delayed-scaling one made here registers under its own key, so its amaxes are reduced and its scales
        updated with the step's other delayed states (forward at the autocast's exit, backward after the first
        FP8 module's backward)."""
        return super()._states_for_current_recipe(device, recipe or self._dpa_recipe())

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, offset: Optional[torch.Tensor],
                attention_bias: Optional[torch.Tensor], *, mask_type: str, attention_mask: Optional[torch.Tensor],
                cp_size: int, packed: Optional[tuple], dropout: float) -> torch.Tensor:
        """Attention of [s, b, h, d] inputs (thd: b = 1), this rank's keys and values gathered under context
        parallelism: [s, b, h·d]. FP8 attention runs it twice (forward, and again in backward)."""
        if cp_size > 1:
            key = gather_from_sequence_parallel_region(key, self.cp_group)
            value = gather_from_sequence_parallel_region(value, self.cp_group)
        if (cp_size > 1 and packed is None and "causal" in mask_type and attention_bias is None
                and query.shape[0] % 2 == 0 and key.shape[0] == cp_size * query.shape[0]):
            return self._causal_chunks(query, key, value, cp_size, dropout, offset)
        if packed is not None:
            cu_seqlens_q, cu_seqlens_q_padded, cu_seqlens_kv, cu_seqlens_kv_padded = packed
            if (cp_size > 1 and "causal" in mask_type and attention_bias is None and self.window_size is None
                    and (cu_seqlens_q_padded is None) == (cu_seqlens_kv_padded is None)):
                plan = _packed_chunks(cu_seqlens_q, cu_seqlens_q_padded, cp_size, group_rank(self.cp_group),
                                      query.device)
                same = host_ends(cu_seqlens_q) == host_ends(cu_seqlens_kv) and (
                    cu_seqlens_q_padded is None or host_ends(cu_seqlens_q_padded) == host_ends(cu_seqlens_kv_padded))
                if plan is not None and same and key.shape[0] == cp_size * query.shape[0]:
                    return self._packed_causal_chunks(query, key, value, plan, dropout, offset)
        allowed = self._allowed(mask_type, attention_mask, query.shape[0], key.shape[0], query.device, cp_size, packed)
        mask = allowed
        if attention_bias is not None:  # a float mask: 0 / -inf where `allowed` says, plus the bias
            dense = as_matrix(allowed, query.shape[0], key.shape[0], query.device)
            mask = additive(dense, query.shape[0], key.shape[0], query.dtype, query.device)
            mask = mask + attention_bias.to(query.dtype)
        # Queries that may see no key: any padding mask (its content is data), causal bottom-right with more
        # queries than keys, padded packed sequences.
        empty_rows = (attention_mask is not None or (packed is not None and packed[1] is not None)
                      or (mask_type.endswith("bottom_right") and query.shape[0] > key.shape[0]))
        return get_backend(query.device).attention(query, key, value, mask, self.softmax_scale, dropout,
                                                   empty_rows=empty_rows, softmax_offset=offset)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """A checkpoint without `_extra_state` (saved before this module kept FP8 metadata) loads: its FP8
        attention scales start fresh."""
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if prefix + "_extra_state" in missing_keys:
            missing_keys.remove(prefix + "_extra_state")

    def _softmax_offset(self, query: torch.Tensor) -> Optional[torch.Tensor]:
        """The per-head logit the softmax adds to its denominator: none (vanilla), 0 (off-by-one) or the
        learnable `softmax_offset`."""
        if self.softmax_type == "vanilla":
            return None
        if self.softmax_type == "learnable":
            return self.softmax_offset
        return torch.zeros(query.shape[2], dtype=query.dtype, device=query.device)

    def _causal_chunks(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cp_size: int,
                       dropout: float, offset: Optional[torch.Tensor]) -> torch.Tensor:
        """Causal attention under context parallelism: each of this rank's two query chunks (r and 2·cp-1-r of
        the sequence, c tokens each) against the gathered keys and values of the chunks up to its own, laid out
        in sequence order: a causal mask (and window) aligned at the bottom-right corner of that block, so no
        mask of the whole sequence is built and a kernel's causal mode takes each block."""
        rank, c = group_rank(self.cp_group), query.shape[0] // 2
        last = 2 * cp_size - 1 - rank  # the second local chunk's place in the sequence

        def chunk(t: torch.Tensor, j: int) -> torch.Tensor:
            """Chunk j of the sequence in the gathered t (each rank's 2c tokens after the previous rank's)."""
            start = _chunk_start(j, cp_size, c, 2 * c)
            return t[start : start + c]

        keys, values = (torch.cat([chunk(t, j) for j in range(last + 1)]) for t in (key, value))
        pattern = CausalMask(True, True, self.window_size)
        backend = get_backend(query.device)
        return torch.cat([backend.attention(query[i * c : (i + 1) * c], keys[: (j + 1) * c], values[: (j + 1) * c],
                                            pattern, self.softmax_scale, dropout, softmax_offset=offset)
                          for i, j in ((0, rank), (1, last))])

    def _packed_causal_chunks(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              plan: _PackedChunks, dropout: float, offset: Optional[torch.Tensor]) -> torch.Tensor:
        """Causal packed sequences under context parallelism (keys packed as the queries) as one packed
        attention: each local query chunk against its sequence's gathered key chunks up to its own
        (`_packed_chunks`), causal from the last key, so no [local tokens, all tokens] mask is built and a
        kernel's varlen mode takes it (on the NPU: TND with sparse_mode 3). Padding rows (past a sequence's
        length) see keys here; their outputs are zeroed, as rows without keys are, which also keeps their
        gradients from reaching any key."""
        keys, values = key.index_select(0, plan.index), value.index_select(0, plan.index)
        device = query.device
        mask = PackedMask(plan.cu_q, plan.cu_kv, True,
                          functools.partial(_bottom_right_packed, plan.cu_q, plan.cu_kv, device), bottom_right=True)
        out = get_backend(device).attention(query, keys, values, mask, self.softmax_scale, dropout,
                                            softmax_offset=offset)
        return out if plan.padding is None else out.masked_fill(plan.padding, 0.0)

    def _allowed(self, mask_type: str, attention_mask: Optional[torch.Tensor], s_q: int, s_k: int,
                 device: torch.device, cp_size: int, packed: Optional[tuple]
                 ) -> Optional[Union[torch.Tensor, CausalMask, PackedMask]]:
        """Boolean "may attend" mask for SDPA (True = attend), None for no mask, or a pattern a kernel may have a
        mode for: a `CausalMask` for a causal or sliding-window mask alone, a `PackedMask` for packed sequences
        (padded or not) without context parallelism or a window."""
        allowed = None
        if "padding" in mask_type and packed is None:
            if attention_mask is None:
                raise ValueError(f"attn_mask_type {mask_type!r} needs an attention_mask")
            allowed = ~attention_mask.bool()
        if packed is None and cp_size == 1:
            if "causal" not in mask_type and self.window_size is None:
                return allowed
            pattern = CausalMask("causal" in mask_type, mask_type.endswith("bottom_right"), self.window_size)
            return pattern if allowed is None else allowed & pattern.allowed(s_q, s_k, device)
        if (packed is not None and cp_size == 1 and (packed[1] is None) == (packed[3] is None)
                and self.window_size is None):
            return PackedMask(packed[0], packed[2], "causal" in mask_type,
                              functools.partial(self._segments, mask_type, s_q, s_k, device, cp_size, packed),
                              packed[1], packed[3])
        structure = self._segments(mask_type, s_q, s_k, device, cp_size, packed)
        return structure if allowed is None else allowed & structure

    def _segments(self, mask_type: str, s_q: int, s_k: int, device: torch.device, cp_size: int,
                  packed: Optional[tuple]) -> torch.Tensor:
        """The "may attend" matrix of packed sequences and/or context parallelism, from each token's sequence,
        position and validity."""
        cu_q = cu_q_padded = cu_k = cu_k_padded = None
        if packed is not None:
            cu_q, cu_q_padded, cu_k, cu_k_padded = packed
        rank = group_rank(self.cp_group) if cp_size > 1 else 0
        q = _layout(s_q, cu_q, cu_q_padded, cp_size, rank, device)
        keys = [_layout(s_k // cp_size, cu_k, cu_k_padded, cp_size, r, device) for r in range(cp_size)]
        k = _Layout(*(torch.cat([getattr(part, f) for part in keys]) for f in ("segment", "position", "valid")))
        structure = (q.segment[:, None] == k.segment[None, :]) & k.valid[None, :] & q.valid[:, None]
        if "causal" in mask_type:
            structure &= k.position[None, :] <= q.position[:, None]
        if self.window_size is not None:
            structure &= window_band(q.position, k.position, self.window_size)
        return structure
