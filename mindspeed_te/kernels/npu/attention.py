"""The NPU backend's attention (`NpuAttention`, mixed into `NpuBackend`): npu_fusion_attention in the SBH
layout, packed sequences in its varlen layout TND (`_varlen`: the host segments, the padding rows to zero),
causal and sliding-window patterns in its sparse modes on the compressed 2048x2048 mask (`_sparse_mode`), and
boolean masks as they are."""
from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from mindspeed_te.kernels.masks import CausalMask, PackedMask, host_ends, host_lengths, kept_per_tensors

# npu_fusion_attention: pre_tockens / next_tockens "默认值为2147483647" (no band limit on that side).
_ALL_TOKENS = 2147483647


def _segments(cu_seqlens: torch.Tensor, cu_seqlens_padded: Optional[torch.Tensor]
              ) -> Optional[list[tuple[int, bool]]]:
    """(cumulative end, is padding) of each stretch of packed tokens, host values (`host_ends`): the sequences,
    and with padded offsets the padding after each sequence that has some; None when a sequence overruns its
    padded slot."""
    if cu_seqlens_padded is None:
        return [(end, False) for end in host_ends(cu_seqlens)]
    lengths, slots = host_lengths(cu_seqlens), host_ends(cu_seqlens_padded)
    if len(slots) != len(lengths):
        return None
    stretches: list[tuple[int, bool]] = []
    for start, stop, length in zip([0] + slots[:-1], slots, lengths):
        if length < 0 or start + length > stop:
            return None
        stretches.append((start + length, False))
        if start + length < stop:
            stretches.append((stop, True))
    return stretches


_PAD_ROWS: dict = {}


def _padding_rows(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, stretches: list[tuple[int, bool]],
                  device: torch.device) -> torch.Tensor:
    """A boolean [tokens, 1] device tensor, True on the padding rows, made once per tensors and versions
    (`kept_per_tensors`: one host-to-device copy per micro-batch), apart under inference mode (autograd saves
    the rows, and cannot save an inference tensor)."""
    def make() -> torch.Tensor:
        rows = torch.zeros(stretches[-1][0], 1, dtype=torch.bool)
        for (start, _), (stop, pad) in zip([(0, False)] + stretches[:-1], stretches):
            if pad:
                rows[start:stop] = True
        return rows.to(device)

    return kept_per_tensors(_PAD_ROWS, (cu_seqlens, cu_seqlens_padded), (device, torch.is_inference_mode_enabled()),
                            make)


def _compressed_mask(device: torch.device) -> torch.Tensor:
    """The 2048x2048 causal mask of npu_fusion_attention's sparse modes, True above the diagonal, made once per
    device (one made under inference mode serves only there, as autograd cannot save it)."""
    return _compressed_mask_made(device, torch.is_inference_mode_enabled())


@functools.lru_cache(maxsize=4)
def _compressed_mask_made(device: torch.device, inference: bool) -> torch.Tensor:
    return torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=device), diagonal=1)


class NpuAttention:
    """attention of the NPU backend; the reference (next in the MRO) for what the kernel does not take."""

    npu: Any

    def attention(self, query, key, value, mask, scale, dropout, *, empty_rows=False, softmax_offset=None):
        """npu_fusion_attention in the SBH layout, dropout as its keep_prob (the kernel draws its mask from the
        device's default generator, the state Megatron's RNG tracker forks). A `PackedMask` takes its varlen layout TND
        (`_varlen`), a `CausalMask` its causal or band mode (`_sparse_mode`); a boolean mask (True = masked for
        the kernel) is broadcast to one of the shapes it takes ("BNSS格式、B1SS格式、11SS格式、SS格式"). With
        `empty_rows` the invalid-row computation is switched on ("inner_precise ... 2为开启无效行计算，其功能是避免
        在计算过程中存在整行mask进而导致精度有损失"; the kernel cannot see such rows in an explicit mask). A softmax
        offset is its sink ("每个注意力头的偏置。shape为[head_num]，数据类型仅支持float32"). Other
        cases (additive masks, value heads narrower than the key heads: "输入key和value的shape必须一致", no tokens)
        run the reference."""
        s_q, b, h, d = query.shape
        s_k = key.shape[0]
        if (value.shape[-1] != key.shape[-1] or 0 in (s_q, s_k, b)  # "S：... 取值范围1~1M", "B取值范围1~2M"
                or (isinstance(mask, torch.Tensor) and (mask.dtype != torch.bool or mask.dim() not in (2, 4)))):
            return super().attention(query, key, value, mask, scale, dropout, empty_rows=empty_rows,
                                     softmax_offset=softmax_offset)
        sink = {} if softmax_offset is None else dict(sink=softmax_offset.float())
        kwargs: dict = {}
        if isinstance(mask, PackedMask):
            varlen = self._varlen(mask, s_q, s_k, b, query.device)
            if varlen is not None:
                out = self.npu.npu_fusion_attention(
                    query.reshape(s_q, h, d), key.reshape(s_k, -1, d), value.reshape(s_k, -1, d), h, "TND",
                    scale=scale, keep_prob=1.0 - dropout, **varlen[0], **sink)[0].reshape(s_q, h * d)
                if varlen[1] is not None:
                    out = out.masked_fill(varlen[1], 0.0)
                return out.reshape(s_q, b, h * d)
            mask = mask.dense()
        if isinstance(mask, CausalMask):
            kwargs = self._sparse_mode(mask, s_q, s_k, query.device) or {}
            if not kwargs:
                mask = mask.allowed(s_q, s_k, query.device)
            # The sparse modes keep a key for every query unless (modes 3 and 4) there are more queries than keys;
            # a pattern's explicit matrix is not searched for rows without keys.
            empty_rows = empty_rows or not kwargs or (kwargs["sparse_mode"] != 2 and s_q > s_k)
        if isinstance(mask, torch.Tensor):
            if mask.dim() == 4 and mask.shape[2:] != (s_q, s_k):
                mask = mask.expand(*mask.shape[:2], s_q, s_k).contiguous()  # e.g. a key-padding mask [b, 1, 1, s_k]
            kwargs = dict(atten_mask=~mask)
        out = self.npu.npu_fusion_attention(
            query.reshape(s_q, b, h * d), key.reshape(s_k, b, -1), value.reshape(s_k, b, -1),
            h, "SBH", scale=scale, keep_prob=1.0 - dropout, inner_precise=2 if empty_rows else 0, **kwargs, **sink)[0]
        return out

    @staticmethod
    def _varlen(mask: PackedMask, s_q: int, s_k: int, b: int, device: torch.device
                ) -> Optional[tuple[dict, Optional[torch.Tensor]]]:
        """(npu_fusion_attention's varlen arguments, the padding rows to zero or None) for packed sequences, or
        None for the explicit matrix. Input_layout "TND" with the cumulative lengths "actual_seq_qlen" /
        "actual_seq_kvlen" (host lists: one device-to-host read per cu_seqlens tensor, `host_ends`), causal by
        sparse_mode 2 ("leftUpCausal") or, aligned at each sequence's last key, 3 ("rightDownCausal") on the
        compressed mask. With padded offsets the padding after a sequence is a sequence of
        its own for the kernel, the same in queries and keys, so no real query sees it; its rows' outputs are
        then zeroed (as rows without keys are), which also keeps their gradients from reaching any key. The
        explicit matrix is kept for stretches that do not cover every token, more of them than the kernel takes
        ("varlen场景下长度最大支持1K"), queries without keys ("varlen场景下 ... atten_mask中不能存在某一行全1的场景"),
        and padding that differs between queries and keys."""
        q = _segments(mask.cu_seqlens_q, mask.cu_seqlens_q_padded)
        k = _segments(mask.cu_seqlens_kv, mask.cu_seqlens_kv_padded)
        if (b != 1 or not q or not k or len(q) != len(k) or len(q) > 1024 or q[-1][0] != s_q or k[-1][0] != s_k
                or any(pq != pk for (_, pq), (_, pk) in zip(q, k))):
            return None
        q_ends, k_ends = [end for end, _ in q], [end for end, _ in k]
        starts = [0] + k_ends[:-1]
        if any(q1 > q0 and k1 == k0 for q0, q1, k0, k1 in zip([0] + q_ends[:-1], q_ends, starts, k_ends)):
            return None
        kwargs = dict(actual_seq_qlen=q_ends, actual_seq_kvlen=k_ends)
        if mask.causal:
            kwargs.update(atten_mask=_compressed_mask(device), sparse_mode=3 if mask.bottom_right else 2)
        padding = None
        if any(pad for _, pad in q):
            padding = _padding_rows(mask.cu_seqlens_q, mask.cu_seqlens_q_padded, q, device)
        return kwargs, padding

    @staticmethod
    def _sparse_mode(mask: CausalMask, s_q: int, s_k: int, device: torch.device) -> Optional[dict]:
        """npu_fusion_attention's arguments for a causal or sliding-window pattern, or None for the explicit
        matrix. sparse_mode 2 is "leftUpCausal" (causal from the top-left corner), 3 "rightDownCausal" (from the
        bottom-right one), 4 "band场景，即计算pre_tockens和next_tockens之间的部分，参数起点为右下角": each takes the
        compressed mask, "优化后的压缩下三角矩阵（2048*2048）", made once per device, and the kernel skips the masked
        blocks. A top-left causal window over s_q != s_k keys is no band of the bottom-right diagonal."""
        if mask.window is None:
            if not mask.causal:
                return None  # no mask at all: the all-True matrix
            mode, pre, nxt = (3 if mask.bottom_right else 2), _ALL_TOKENS, _ALL_TOKENS
        elif mask.causal and not mask.bottom_right and s_q != s_k:
            return None
        else:
            left, right = mask.window
            mode, pre = 4, left if left >= 0 else _ALL_TOKENS
            nxt = 0 if mask.causal else (right if right >= 0 else _ALL_TOKENS)
        return dict(atten_mask=_compressed_mask(device), sparse_mode=mode, pre_tockens=pre, next_tockens=nxt)
