"""npu_fusion_attention and its backward kernel npu_fusion_attention_grad.

torch_npu gives npu_fusion_attention its backward through op-plugin's derivatives.yaml ("query, key, value, pse,
sink: npu_fusion_attention_grad(...)"): one kernel. The simulator does the same with an autograd Function whose
backward calls its own counted `npu_fusion_attention_grad`, so a launch count of a backward sees that kernel."""
from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional

import torch

from mindspeed_te.testing.npu_sim.checks import check_choice, check_float, check_int, check_shape, check_tensor, kernel
from mindspeed_te.testing.npu_sim.dtypes import FLOATS
from mindspeed_te.testing.npu_sim.errors import NpuSimNotImplemented, NpuValueError

ALL_TOKENS = 2147483647  # pre_tockens / next_tockens default: no band limit
COMPRESSED = 2048  # side of the compressed causal mask the causal and band modes take


@functools.lru_cache(maxsize=4)
def compressed_causal_mask(device: torch.device) -> torch.Tensor:
    """The mask sparse_modes 2, 3 and 4 take: "优化后的压缩下三角矩阵（2048*2048）", True (masked) above the
    diagonal (the document's example builds it as torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1))."""
    return torch.triu(torch.ones(COMPRESSED, COMPRESSED, dtype=torch.bool, device=device), diagonal=1)


class _Call(NamedTuple):
    """A checked call: heads, head dim, scale, "may attend" matrix (None: every key) and whether rows without
    keys give zeros (the invalid-row computation)."""
    head: int
    d: int
    scale: float
    allowed: Optional[torch.Tensor]
    zero_empty_rows: bool


def _check_call(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, head_num: int, input_layout: str,
                pse: Any, padding_mask: Any, atten_mask: Optional[torch.Tensor], scale: float, keep_prob: float,
                pre_tockens: int, next_tockens: int, inner_precise: int, prefix: Any, sparse_mode: int) -> _Call:
    """The arguments both kernels share, checked against torch_npu-npu_fusion_attention.md."""
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
    mode = check_int("sparse_mode", sparse_mode)
    check_choice("sparse_mode", mode, tuple(range(9)))
    if mode not in (0, 2, 3, 4) or pse is not None or padding_mask is not None or prefix is not None:
        raise NpuSimNotImplemented("only sparse_mode 0, 2, 3 and 4, no pse/padding_mask/prefix")
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
    s_k = key.shape[0]
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
    pre, nxt = check_int("pre_tockens", pre_tockens), check_int("next_tockens", next_tockens)
    allowed, auto_precise = None, False
    # "当atten_mask输入为None时，sparse_mode、pre_tockens、next_tockens参数不生效，固定为全计算。"
    if atten_mask is not None:
        # atten_mask: "取值为1代表该位不参与计算（不生效），为0代表该位参与计算，数据类型支持`bool`、`uint8`"
        check_tensor("atten_mask", atten_mask, (torch.bool, torch.uint8))
        if mode == 0:
            # "输入shape类型支持BNSS格式、B1SS格式、11SS格式、SS格式。"
            check_shape("atten_mask", atten_mask, (s_q, s_k), (1, 1, s_q, s_k), (b, 1, s_q, s_k), (b, head, s_q, s_k))
            # "sparse_mode配置为0、4时，需保证atten_mask与pre_tockens、next_tockens的范围一致": the simulator takes
            # the band only from the mask.
            if (pre, nxt) != (ALL_TOKENS, ALL_TOKENS):
                raise NpuSimNotImplemented("sparse_mode 0 with pre_tockens/next_tockens set")
            allowed = ~atten_mask.bool()
        else:
            allowed, auto_precise = _structured(mode, atten_mask, s_q, s_k, pre, nxt)
    return _Call(head, d, check_float("scale", scale), allowed, precise == 2 or auto_precise)


def _structured(mode: int, atten_mask: torch.Tensor, s_q: int, s_k: int, pre: int, nxt: int
                ) -> tuple[torch.Tensor, bool]:
    """(may-attend matrix, rows without keys get zeros) of the causal and band modes, from the mode alone."""
    # sparse_mode 2: "leftUpCausal模式 ... 传入的atten_mask为优化后的压缩下三角矩阵（2048*2048）"; 3 (rightDownCausal)
    # and 4 (band) take it too. "sparse_mode为1、2、3、4、5、6、7、8时，应传入对应正确的atten_mask，否则将导致计算结果
    # 错误" -- so the simulator refuses any other matrix.
    check_shape("atten_mask", atten_mask, (COMPRESSED, COMPRESSED))
    if not torch.equal(atten_mask.bool(), compressed_causal_mask(atten_mask.device)):
        raise NpuValueError(f"atten_mask of sparse_mode {mode} must be the compressed causal mask "
                            "(torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1))")
    q = torch.arange(s_q, device=atten_mask.device)[:, None]
    k = torch.arange(s_k, device=atten_mask.device)[None, :]
    if mode == 2:  # "对应以左上顶点划分的下三角场景（参数起点为左上角）"; pre/next "不会生效"
        return k <= q, False
    offset = k - q - (s_k - s_q)  # the diagonal through the bottom-right corner: 0
    if mode == 3:  # "对应以右下顶点划分的下三角场景（参数起点为右下角）"; with Sq > Skv the kernel turns on the
        return offset <= 0, s_q > s_k  # invalid-row computation itself ("例如sparse_mode为3，Sq > Skv场景")
    # sparse_mode 4: "代表band场景，即计算pre_tockens和next_tockens之间的部分，参数起点为右下角，pre_tockens和
    # next_tockens之间需要有交集。"
    if -pre > nxt:
        raise NpuValueError(f"pre_tockens ({pre}) and next_tockens ({nxt}) of sparse_mode 4 must overlap "
                            "(-pre_tockens <= next_tockens)")
    return (offset >= -pre) & (offset <= nxt), False


def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, call: _Call) -> torch.Tensor:
    """softmax(Q Kᵀ · scale) V over the allowed keys, [s_q, b, h·d] (differentiable torch ops)."""
    s_q, b, hidden = query.shape
    head, d = call.head, call.d
    q = query.reshape(s_q, b, head, d).permute(1, 2, 0, 3)
    kv_heads = key.shape[2] // d
    k = key.reshape(key.shape[0], b, kv_heads, d).permute(1, 2, 0, 3).repeat_interleave(head // kv_heads, 1)
    v = value.reshape(value.shape[0], b, kv_heads, d).permute(1, 2, 0, 3).repeat_interleave(head // kv_heads, 1)
    if call.allowed is None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=call.scale)
    else:
        # A query whose keys are all masked (an invalid row): zeros with the invalid-row computation, else NaN --
        # the simulator's stand-in for the precision loss the document warns of (it does not say what the kernel
        # writes there). Such a row is computed over every key and then overwritten, so that it sends no gradient.
        empty = ~call.allowed.any(-1, keepdim=True)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=call.allowed | empty,
                                                               scale=call.scale)
        out = out.masked_fill(empty, 0.0 if call.zero_empty_rows else float("nan"))
    return out.permute(2, 0, 1, 3).reshape(s_q, b, hidden)


class _FusionAttention(torch.autograd.Function):
    """The forward kernel's output; the backward is the simulator's npu_fusion_attention_grad kernel."""

    @staticmethod
    def forward(ctx: Any, sim: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, call: _Call,
                grad_kwargs: dict) -> torch.Tensor:
        ctx.sim, ctx.grad_kwargs = sim, grad_kwargs
        ctx.save_for_backward(query, key, value)
        return _attend(query, key, value, call)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        query, key, value = ctx.saved_tensors
        dq, dk, dv, _, _ = ctx.sim.npu_fusion_attention_grad(query, key, value, dy, **ctx.grad_kwargs)
        return None, dq, dk, dv, None, None


class AttentionKernels:
    """npu_fusion_attention (differentiable) and npu_fusion_attention_grad."""

    @kernel(differentiable=True)
    def npu_fusion_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, head_num: int,
                             input_layout: str, pse: Optional[torch.Tensor] = None,
                             padding_mask: Optional[torch.Tensor] = None, atten_mask: Optional[torch.Tensor] = None,
                             scale: float = 1.0, keep_prob: float = 1.0, pre_tockens: int = ALL_TOKENS,
                             next_tockens: int = ALL_TOKENS, inner_precise: int = 0, prefix: Any = None,
                             actual_seq_qlen: Any = None, actual_seq_kvlen: Any = None, sparse_mode: int = 0,
                             gen_mask_parallel: bool = True, sync: bool = False, softmax_layout: str = "",
                             sink: Any = None, dropout_mask: Any = None, seed: int = 0, offset: int = 0) -> tuple:
        """softmax(Q Kᵀ · scale, masked where atten_mask is True) V. Simulated: input_layout "SBH" ([s, b, h·d],
        key/value may carry fewer heads: GQA), sparse_mode 0 (an explicit boolean mask, [s_q, s_k] or
        [b, 1, s_q, s_k]), 2 and 3 (causal from the top-left / bottom-right corner) and 4 (a band around the
        bottom-right diagonal), those three with the compressed 2048x2048 mask, and keep_prob 1. Returns
        (attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, numels) like the kernel; only
        attention_out is computed."""
        call = _check_call(query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, scale,
                           keep_prob, pre_tockens, next_tockens, inner_precise, prefix, sparse_mode)
        grad_kwargs = dict(head_num=head_num, input_layout=input_layout, atten_mask=atten_mask, scale_value=scale,
                           keep_prob=keep_prob, pre_tockens=pre_tockens, next_tockens=next_tockens,
                           inner_precise=inner_precise, sparse_mode=sparse_mode)
        out = _FusionAttention.apply(self, query, key, value, call, grad_kwargs)
        stats = torch.zeros(query.shape[1], call.head, query.shape[0], 8)
        return out, stats, stats.clone(), query.new_empty(0), seed, offset, 0

    @kernel
    def npu_fusion_attention_grad(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                  dy: torch.Tensor, head_num: int, input_layout: str, *,
                                  pse: Optional[torch.Tensor] = None, padding_mask: Optional[torch.Tensor] = None,
                                  atten_mask: Optional[torch.Tensor] = None, softmax_max: Any = None,
                                  softmax_sum: Any = None, softmax_in: Any = None, attention_in: Any = None,
                                  scale_value: float = 1.0, keep_prob: float = 1.0, pre_tockens: int = ALL_TOKENS,
                                  next_tockens: int = ALL_TOKENS, inner_precise: int = 0, seed: int = 0,
                                  offset: int = 0, numels: int = 0, prefix: Any = None, actual_seq_qlen: Any = None,
                                  actual_seq_kvlen: Any = None, sparse_mode: int = 0, gen_mask_parallel: bool = True,
                                  sync: bool = False, softmax_layout: str = "", sink: Any = None) -> tuple:
        """(dq, dk, dv, dpse, dsink) of npu_fusion_attention called with the same arguments (dpse and dsink empty:
        neither is simulated). The forward's softmax statistics are not read: the simulator recomputes."""
        call = _check_call(query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, scale_value,
                           keep_prob, pre_tockens, next_tockens, inner_precise, prefix, sparse_mode)
        check_tensor("dy", dy, (query.dtype,))
        check_shape("dy", dy, tuple(query.shape))
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_() for t in (query, key, value))
            dq, dk, dv = torch.autograd.grad(_attend(q, k, v, call), (q, k, v), dy)
        empty = query.new_empty(0)
        return dq, dk, dv, empty, empty.clone()
