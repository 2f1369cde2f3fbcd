"""npu_fusion_attention (the forward; autograd gives the backward)."""
from __future__ import annotations

from typing import Any, Optional

import torch

from mindspeed_te.testing.npu_sim.checks import check_choice, check_float, check_int, check_shape, check_tensor, kernel
from mindspeed_te.testing.npu_sim.dtypes import FLOATS
from mindspeed_te.testing.npu_sim.errors import NpuSimNotImplemented, NpuValueError


class AttentionKernels:
    """npu_fusion_attention, the fused attention kernel (forward here; autograd gives the backward)."""

    @kernel(differentiable=True)
    def npu_fusion_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, head_num: int,
                             input_layout: str, pse: Optional[torch.Tensor] = None,
                             padding_mask: Optional[torch.Tensor] = None, atten_mask: Optional[torch.Tensor] = None,
                             scale: float = 1.0, keep_prob: float = 1.0, pre_tockens: int = 2147483647,
                             next_tockens: int = 2147483647, inner_precise: int = 0, prefix: Any = None,
                             actual_seq_qlen: Any = None, actual_seq_kvlen: Any = None, sparse_mode: int = 0,
                             gen_mask_parallel: bool = True, sync: bool = False, softmax_layout: str = "",
                             sink: Any = None, dropout_mask: Any = None, seed: int = 0, offset: int = 0) -> tuple:
        """softmax(Q Kᵀ · scale, masked where atten_mask is True) V. Simulated: input_layout "SBH" ([s, b, h·d],
        key/value may carry fewer heads: GQA), sparse_mode 0 (explicit boolean mask, [s_q, s_k] or
        [b, 1, s_q, s_k]) and keep_prob 1. Returns (attention_out, softmax_max, softmax_sum, softmax_out,
        seed, offset, numels) like the kernel; only attention_out is computed."""
        # Quotes from torch_npu-npu_fusion_attention.md (op-plugin docs; its product table lists the Ascend 950DT
        # and the A2 training series -- the simulator does not refuse other chip names).
        # query/key/value: "数据类型支持`float16`、`bfloat16`、`float32`"; "输入`query`、`key`、`value`、`pse`的数据
        # 类型必须一致。"
        check_tensor("query", query, FLOATS)
        check_tensor("key", key, (query.dtype,))
        check_tensor("value", value, (query.dtype,))
        # input_layout: "支持BSH、SBH、BSND、BNSD、TND"
        check_choice("input_layout", input_layout, ("SBH", "BSH", "BNSD", "BSND", "TND"))
        if input_layout != "SBH":
            raise NpuSimNotImplemented(f"input_layout={input_layout!r}: only 'SBH' is simulated")
        # sparse_mode: 0 to 8 (表1).
        check_choice("sparse_mode", check_int("sparse_mode", sparse_mode), tuple(range(9)))
        if sparse_mode != 0 or pse is not None or padding_mask is not None or prefix is not None:
            raise NpuSimNotImplemented("only sparse_mode=0 with an explicit atten_mask, no pse/padding_mask/prefix")
        # keep_prob: "代表Dropout中1的比例，取值范围为(0, 1]"
        keep = check_float("keep_prob", keep_prob)
        if not 0.0 < keep <= 1.0:
            raise NpuValueError(f"keep_prob must be in (0, 1], got {keep}")
        if keep != 1.0:
            raise NpuSimNotImplemented("keep_prob < 1 (dropout) is not simulated")
        # inner_precise: "当前0、1为保留配置值，2为开启无效行计算，其功能是避免在计算过程中存在整行mask进而导致精度
        # 有损失，但是该配置会导致性能下降。如果算子可判断出存在无效行场景，会自动开启无效行计算，例如sparse_mode为3、
        # Sq > Skv场景。"
        precise = check_int("inner_precise", inner_precise)
        check_choice("inner_precise", precise, (0, 1, 2))
        head = check_int("head_num", head_num)
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.dim() != 3:
                raise NpuValueError(f"{name} must be [S, B, H] for input_layout 'SBH', got shape {tuple(t.shape)}")
        # "输入`key`和`value`的shape必须一致。"; "B：batchsize必须相等"
        if key.shape != value.shape:
            raise NpuValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must have one shape")
        s_q, b, hidden = query.shape
        if key.shape[1] != b:
            raise NpuValueError(f"batch sizes of query ({b}) and key/value ({key.shape[1]}) differ")
        # "Nq取值范围1~256"
        if not 1 <= head <= 256:
            raise NpuValueError(f"head_num must be in [1, 256], got {head}")
        if hidden % head:
            raise NpuValueError(f"query hidden size {hidden} is not a multiple of head_num {head}")
        d = hidden // head
        # "D：Head Dim必须满足Dq=Dk和Dk≥Dv，取值范围1~768。"
        if d > 768:
            raise NpuValueError(f"head dim {d} (query hidden size / head_num) must be in [1, 768]")
        # "支持输入`query`的N和`key`/`value`的N不相等，但必须成比例关系，即Nq/Nkv必须是非0整数"
        if key.shape[2] % d or head % (key.shape[2] // d):
            raise NpuValueError(f"key/value hidden sizes {key.shape[2]}/{value.shape[2]} do not fit head_dim {d}")
        q = query.reshape(s_q, b, head, d).permute(1, 2, 0, 3)
        kv_heads = key.shape[2] // d
        k = key.reshape(key.shape[0], b, kv_heads, d).permute(1, 2, 0, 3).repeat_interleave(head // kv_heads, 1)
        v = value.reshape(value.shape[0], b, kv_heads, d).permute(1, 2, 0, 3).repeat_interleave(head // kv_heads, 1)
        allowed = None
        if atten_mask is not None:
            # atten_mask: "取值为1代表该位不参与计算（不生效），为0代表该位参与计算，数据类型支持`bool`、`uint8`，...
            # 输入shape类型支持BNSS格式、B1SS格式、11SS格式、SS格式。"
            check_tensor("atten_mask", atten_mask, (torch.bool, torch.uint8))
            s_k = key.shape[0]
            check_shape("atten_mask", atten_mask, (s_q, s_k), (1, 1, s_q, s_k), (b, 1, s_q, s_k), (b, head, s_q, s_k))
            allowed = ~atten_mask.bool()
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=check_float(
            "scale", scale))
        if allowed is not None:
            # A query whose keys are all masked (an invalid row, which an explicit sparse_mode 0 mask does not let
            # the kernel detect): zeros with the invalid-row computation, else NaN -- the simulator's stand-in for
            # the precision loss the document warns of (it does not say what the kernel writes there).
            empty = ~allowed.any(-1, keepdim=True)
            out = out.masked_fill(empty, 0.0 if precise == 2 else float("nan"))
        out = out.permute(2, 0, 1, 3).reshape(s_q, b, hidden)
        stats = torch.zeros(b, head, s_q, 8)
        return out, stats, stats.clone(), query.new_empty(0), seed, offset, 0

