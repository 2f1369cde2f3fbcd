"""npu_fusion_attention and its backward kernel npu_fusion_attention_grad.

torch_npu gives npu_fusion_attention its backward through op-plugin's derivatives.yaml ("query, key, value, pse,
sink: npu_fusion_attention_grad(...)"): one kernel. The simulator does the same with an autograd Function whose
backward calls its own counted `npu_fusion_attention_grad`, so a launch count of a backward sees that kernel."""
from __future__ import annotations

import functools
import zlib
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
    """A checked call: layout, heads, head dim, scale, "may attend" matrix over all query and key tokens (None: every
    key) and whether rows without keys give zeros (the invalid-row computation)."""
    layout: str
    head: int
    d: int
    scale: float
    allowed: Optional[torch.Tensor]
    zero_empty_rows: bool
    keep: float


def _check_call(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, head_num: int, input_layout: str,
                pse: Any, padding_mask: Any, atten_mask: Optional[torch.Tensor], scale: float, keep_prob: float,
                pre_tockens: int, next_tockens: int, inner_precise: int, prefix: Any, sparse_mode: int,
                actual_seq_qlen: Any, actual_seq_kvlen: Any, softmax_layout: str, sink: Any) -> _Call:
    """The arguments both kernels share, checked against torch_npu-npu_fusion_attention.md."""
    # query/key/value: "数据类型支持`float16`、`bfloat16`、`float32`"; "输入`query`、`key`、`value`、`pse`的数据
    # 类型必须一致。"
    check_tensor("query", query, FLOATS)
    check_tensor("key", key, (query.dtype,))
    check_tensor("value", value, (query.dtype,))
    # input_layout: "支持BSH、SBH、BSND、BNSD、TND"
    check_choice("input_layout", input_layout, ("SBH", "BSH", "BNSD", "BSND", "TND"))
    if input_layout not in ("SBH", "TND"):
        raise NpuSimNotImplemented(f"input_layout={input_layout!r}: only 'SBH' and 'TND' are simulated")
    # sparse_mode: 0 to 8 (表1).
    mode = check_int("sparse_mode", sparse_mode)
    check_choice("sparse_mode", mode, tuple(range(9)))
    if mode not in (0, 2, 3, 4) or pse is not None or padding_mask is not None or prefix is not None:
        raise NpuSimNotImplemented("only sparse_mode 0, 2, 3 and 4, no pse/padding_mask/prefix")
    # keep_prob: "代表Dropout中1的比例，取值范围为(0, 1]"
    keep = check_float("keep_prob", keep_prob)
    if not 0.0 < keep <= 1.0:
        raise NpuValueError(f"keep_prob must be in (0, 1], got {keep}")
    # inner_precise: "当前0、1为保留配置值，2为开启无效行计算，其功能是避免在计算过程中存在整行mask进而导致精度
    # 有损失，但是该配置会导致性能下降。如果算子可判断出存在无效行场景，会自动开启无效行计算，例如sparse_mode为3、
    # Sq > Skv场景。"
    precise = check_int("inner_precise", inner_precise)
    check_choice("inner_precise", precise, (0, 1, 2))
    head = check_int("head_num", head_num)
    # "Nq取值范围1~256"
    if not 1 <= head <= 256:
        raise NpuValueError(f"head_num must be in [1, 256], got {head}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 3:
            raise NpuValueError(f"{name} must be 3-D ([S, B, H] for 'SBH', [T, N, D] for 'TND'), got shape "
                                f"{tuple(t.shape)}")
    # "输入`key`和`value`的shape必须一致。"
    if key.shape != value.shape:
        raise NpuValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must have one shape")
    if input_layout == "TND":
        d, kv_heads = query.shape[2], key.shape[1]
        if query.shape[1] != head:
            raise NpuValueError(f"query's N ({query.shape[1]}) must be head_num ({head}) for input_layout 'TND'")
        if key.shape[2] != d:
            raise NpuValueError(f"key's D ({key.shape[2]}) must be query's ({d}): \"Dq=Dk\"")
    else:
        s_q, b, hidden = query.shape
        # "B：batchsize必须相等"
        if key.shape[1] != b:
            raise NpuValueError(f"batch sizes of query ({b}) and key/value ({key.shape[1]}) differ")
        if hidden % head:
            raise NpuValueError(f"query hidden size {hidden} is not a multiple of head_num {head}")
        d = hidden // head
        if key.shape[2] % d:
            raise NpuValueError(f"key/value hidden sizes {key.shape[2]}/{value.shape[2]} do not fit head_dim {d}")
        kv_heads = key.shape[2] // d
    # "D：Head Dim必须满足Dq=Dk和Dk≥Dv，取值范围1~768。"
    if not 1 <= d <= 768:
        raise NpuValueError(f"head dim {d} must be in [1, 768]")
    if input_layout == "TND":
        # varlen: "要求T（B*S）取值范围1~1M"
        for name, t in (("query", query), ("key", key)):
            if not 1 <= t.shape[0] <= 1 << 20:
                raise NpuValueError(f"{name}'s T ({t.shape[0]}) must be in [1, 1M] in the varlen case")
    else:
        # "非varlen场景B取值范围1~2M"; "S：sequence length，取值范围1~1M"
        if not 1 <= b <= 2 << 20:
            raise NpuValueError(f"batch size {b} must be in [1, 2M]")
        for name, t in (("query", query), ("key", key)):
            if not 1 <= t.shape[0] <= 1 << 20:
                raise NpuValueError(f"{name}'s sequence length {t.shape[0]} must be in [1, 1M]")
    # "支持输入`query`的N和`key`/`value`的N不相等，但必须成比例关系，即Nq/Nkv必须是非0整数"
    if head % kv_heads:
        raise NpuValueError(f"query heads ({head}) must be a multiple of key/value heads ({kv_heads})")
    _check_extras(input_layout, softmax_layout, sink, head)
    pre, nxt = check_int("pre_tockens", pre_tockens), check_int("next_tockens", next_tockens)
    if input_layout == "TND":
        allowed, auto_precise = _varlen(mode, atten_mask, query.shape[0], key.shape[0], actual_seq_qlen,
                                        actual_seq_kvlen)
        return _Call(input_layout, head, d, check_float("scale", scale), allowed, precise == 2 or auto_precise, keep)
    if actual_seq_qlen is not None or actual_seq_kvlen is not None:
        raise NpuValueError("actual_seq_qlen / actual_seq_kvlen are for input_layout 'TND' (the varlen case)")
    s_k = key.shape[0]
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
            _check_compressed(mode, atten_mask)
            allowed, auto_precise = _structured(mode, s_q, s_k, pre, nxt, atten_mask.device)
    return _Call(input_layout, head, d, check_float("scale", scale), allowed, precise == 2 or auto_precise, keep)


def _check_extras(input_layout: str, softmax_layout: str, sink: Any, head: int) -> None:
    """softmax_layout: "当前仅在input_layout=“TND”时进行配置，仅支持传入“TND”"; sink: "每个注意力头的偏置。shape为
    [head_num]，数据类型仅支持float32"."""
    check_choice("softmax_layout", softmax_layout, ("", "TND"))
    if softmax_layout == "TND" and input_layout != "TND":
        raise NpuValueError("softmax_layout='TND' is configured only with input_layout 'TND'")
    if sink is not None:
        check_tensor("sink", sink, (torch.float32,))
        check_shape("sink", sink, (head,))


def _cumulative(name: str, value: Any, total: int) -> list[int]:
    """A varlen argument: "表示`query`每个S的累加和长度" -- cumulative ends, "尾部传入对应个数个0" for batches left
    out at the end, "长度取值范围为1~2K，varlen场景下长度最大支持1K"."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                       for v in value):
        raise NpuValueError(f"{name} must be a list of ints (cumulative lengths) for input_layout 'TND', got "
                            f"{value!r}")
    ends = list(value)
    if not 1 <= len(ends) <= 1024:
        raise NpuValueError(f"{name} must hold 1 to 1024 entries in the varlen case, got {len(ends)}")
    used = len(ends)
    while used > 1 and ends[used - 1] == 0:
        used -= 1
    if ends[0] < 0 or any(b < a for a, b in zip(ends[: used - 1], ends[1:used])):
        raise NpuValueError(f"{name} must be non-decreasing cumulative lengths (then zeros), got {ends}")
    if ends[used - 1] != total:
        raise NpuSimNotImplemented(f"{name} ending at {ends[used - 1]} of {total} tokens: only packings that cover "
                                   "every token are simulated")
    return ends[:used]


def _varlen(mode: int, atten_mask: Optional[torch.Tensor], t_q: int, t_k: int, actual_seq_qlen: Any,
            actual_seq_kvlen: Any) -> tuple[torch.Tensor, bool]:
    """(may-attend matrix [T_q, T_kv], rows without keys get zeros) of the varlen case: each batch's queries see
    only its own keys ("input_layout为TND时即为varlen场景"; actual_seq_qlen / actual_seq_kvlen "varlen场景时需要传入
    此参数"), all of them without a mask, causally from the batch's top-left (sparse_mode 2) or bottom-right (3)
    corner with the compressed mask -- the modes the varlen split modes 8 and 7 start from ("用户需要确保外切前为
    使用sparse_mode=2的场景" / "=3的场景")."""
    q_ends = _cumulative("actual_seq_qlen", actual_seq_qlen, t_q)
    k_ends = _cumulative("actual_seq_kvlen", actual_seq_kvlen, t_k)
    if len(q_ends) != len(k_ends):  # "B：batchsize必须相等"
        raise NpuValueError(f"actual_seq_qlen ({len(q_ends)} batches) and actual_seq_kvlen ({len(k_ends)}) differ")
    device = atten_mask.device if atten_mask is not None else torch.device("cpu")
    if atten_mask is not None:
        if mode not in (2, 3):
            raise NpuSimNotImplemented("varlen with an explicit mask or sparse_mode 4: only no mask, 2 and 3")
        check_tensor("atten_mask", atten_mask, (torch.bool, torch.uint8))
        _check_compressed(mode, atten_mask)
    allowed = torch.zeros(t_q, t_k, dtype=torch.bool, device=device)
    for q0, q1, k0, k1 in zip([0] + q_ends[:-1], q_ends, [0] + k_ends[:-1], k_ends):
        # "varlen场景下 ... atten_mask输入不支持补pad，即atten_mask中不能存在某一行全1的场景": a batch's first query
        # sees no key when the batch has none, or under sparse_mode 3 when it has more queries than keys.
        if q1 > q0 and (k1 == k0 or (atten_mask is not None and mode == 3 and q1 - q0 > k1 - k0)):
            raise NpuValueError(f"varlen: the batch of queries {q0}:{q1} and keys {k0}:{k1} has queries without keys, "
                                "a fully masked row, which the varlen case does not take")
        if atten_mask is None:  # "当atten_mask输入为None时，sparse_mode ... 不生效，固定为全计算"
            allowed[q0:q1, k0:k1] = True
        else:
            allowed[q0:q1, k0:k1] = _structured(mode, q1 - q0, k1 - k0, ALL_TOKENS, ALL_TOKENS, device)[0]
    return allowed, False


def _check_compressed(mode: int, atten_mask: torch.Tensor) -> None:
    """sparse_mode 2: "leftUpCausal模式 ... 传入的atten_mask为优化后的压缩下三角矩阵（2048*2048）"; 3 (rightDownCausal)
    and 4 (band) take it too. "sparse_mode为1、2、3、4、5、6、7、8时，应传入对应正确的atten_mask，否则将导致计算结果
    错误" -- so the simulator refuses any other matrix."""
    check_shape("atten_mask", atten_mask, (COMPRESSED, COMPRESSED))
    if not torch.equal(atten_mask.bool(), compressed_causal_mask(atten_mask.device)):
        raise NpuValueError(f"atten_mask of sparse_mode {mode} must be the compressed causal mask "
                            "(torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1))")


def _structured(mode: int, s_q: int, s_k: int, pre: int, nxt: int, device: torch.device
                ) -> tuple[torch.Tensor, bool]:
    """(may-attend matrix, rows without keys get zeros) of the causal and band modes, from the mode alone."""
    q = torch.arange(s_q, device=device)[:, None]
    k = torch.arange(s_k, device=device)[None, :]
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


def _dropout_keeps(seed: int, offset: int, shape: torch.Size, keep: float, device: torch.device) -> torch.Tensor:
    """Which attention probabilities dropout keeps: the simulator's stand-in for the kernel's Philox mask of
    (seed, offset), the same for the forward and the grad kernel that is given them."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + offset) % (1 << 63))
    return (torch.rand(shape, generator=gen) < keep).to(device)


def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, call: _Call,
            keeps: Optional[torch.Tensor] = None, sink: Optional[torch.Tensor] = None) -> torch.Tensor:
    """softmax(Q Kᵀ · scale) V over the allowed keys, in the call's layout: [s_q, b, h·d] or [t, h, d]
    (differentiable torch ops). A `sink` joins each softmax as one more logit per head whose column is then
    dropped (the document's reference: "append one sink logit, apply softmax, then drop that column before
    multiplying by V"). With dropout (keep_prob < 1) the probabilities `keeps` leaves are divided by keep_prob and
    the others are zero."""
    head, d = call.head, call.d
    if call.layout == "TND":  # one batch of all tokens, the batches kept apart by the mask
        q, k, v = (t.permute(1, 0, 2).unsqueeze(0) for t in (query, key, value))
    else:
        s_q, b, _ = query.shape
        q = query.reshape(s_q, b, head, d).permute(1, 2, 0, 3)
        k, v = (t.reshape(t.shape[0], b, -1, d).permute(1, 2, 0, 3) for t in (key, value))
    k, v = (t.repeat_interleave(head // t.shape[1], 1) for t in (k, v))
    # A query whose keys are all masked (an invalid row): zeros with the invalid-row computation, else NaN -- the
    # simulator's stand-in for the precision loss the document warns of (it does not say what the kernel writes
    # there). Such a row is computed over every key and then overwritten, so that it sends no gradient.
    empty = None if call.allowed is None else ~call.allowed.any(-1, keepdim=True)
    seen = None if call.allowed is None else call.allowed | empty
    if keeps is None and sink is None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=seen, scale=call.scale)
    else:
        logits = (q.float() @ k.float().transpose(-2, -1)) * call.scale
        if seen is not None:
            logits = logits.masked_fill(~seen, float("-inf"))
        if sink is None:
            probs = torch.softmax(logits, dim=-1)
        else:
            column = sink.reshape(1, head, 1, 1).expand(*logits.shape[:-1], 1)
            probs = torch.softmax(torch.cat((logits, column), dim=-1), dim=-1)[..., :-1]
        if keeps is not None:
            probs = probs * keeps / call.keep
        out = (probs @ v.float()).to(q.dtype)
    if empty is not None:
        out = out.masked_fill(empty, 0.0 if call.zero_empty_rows else float("nan"))
    if call.layout == "TND":
        return out[0].permute(1, 0, 2).contiguous()  # the kernel writes [t, n, d] as it lies
    return out.permute(2, 0, 1, 3).reshape(query.shape)


def _probs_shape(query: torch.Tensor, key: torch.Tensor, call: _Call) -> torch.Size:
    """[b, n, s_q, s_k] of the attention probabilities (one batch of all tokens for TND)."""
    if call.layout == "TND":
        return torch.Size((1, call.head, query.shape[0], key.shape[0]))
    return torch.Size((query.shape[1], call.head, query.shape[0], key.shape[0]))


class _FusionAttention(torch.autograd.Function):
    """The forward kernel's output; the backward is the simulator's npu_fusion_attention_grad kernel."""

    @staticmethod
    def forward(ctx: Any, sim: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                sink: Optional[torch.Tensor], call: _Call, grad_kwargs: dict) -> torch.Tensor:
        ctx.sim, ctx.grad_kwargs = sim, grad_kwargs
        ctx.save_for_backward(query, key, value, sink)
        keeps = None
        if call.keep < 1.0:
            keeps = _dropout_keeps(grad_kwargs["seed"], grad_kwargs["offset"], _probs_shape(query, key, call),
                                   call.keep, query.device)
        return _attend(query, key, value, call, keeps, sink)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        query, key, value, sink = ctx.saved_tensors
        dq, dk, dv, _, dsink = ctx.sim.npu_fusion_attention_grad(query, key, value, dy, sink=sink, **ctx.grad_kwargs)
        return None, dq, dk, dv, (dsink if sink is not None else None), None, None


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
        bottom-right diagonal), those three with the compressed 2048x2048 mask; input_layout "TND" ([t, n, d], the
        varlen case: packed batches by actual_seq_qlen / actual_seq_kvlen) with no mask or sparse_mode 2 or 3; and
        dropout (keep_prob < 1) with the simulator's own mask of the seed it draws; a sink. Returns
        (attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, numels) like the kernel; only
        attention_out is computed."""
        call = _check_call(query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, scale,
                           keep_prob, pre_tockens, next_tockens, inner_precise, prefix, sparse_mode, actual_seq_qlen,
                           actual_seq_kvlen, softmax_layout, sink)
        if dropout_mask is not None:
            raise NpuSimNotImplemented("an external dropout_mask is not simulated")
        numels = 0
        if call.keep < 1.0:
            # The kernel draws its Philox seed and offset from the device's default generator (so Megatron's RNG
            # tracker, which swaps that generator's state, decides the mask) and returns them with the mask's
            # size for the backward. The simulator reads the state of torch's default generator on the host and
            # advances it.
            seed, offset = zlib.crc32(torch.default_generator.get_state().numpy().tobytes()), 0
            torch.rand(1)
            numels = _probs_shape(query, key, call).numel()
        grad_kwargs = dict(head_num=head_num, input_layout=input_layout, atten_mask=atten_mask, scale_value=scale,
                           keep_prob=keep_prob, pre_tockens=pre_tockens, next_tockens=next_tockens,
                           inner_precise=inner_precise, sparse_mode=sparse_mode, actual_seq_qlen=actual_seq_qlen,
                           actual_seq_kvlen=actual_seq_kvlen, seed=seed, offset=offset, numels=numels)
        out = _FusionAttention.apply(self, query, key, value, sink, call, grad_kwargs)
        stats = torch.zeros(1 if call.layout == "TND" else query.shape[1], call.head, query.shape[0], 8)
        return out, stats, stats.clone(), query.new_empty(0), seed, offset, numels

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
        """(dq, dk, dv, dpse, dsink) of npu_fusion_attention called with the same arguments (dpse empty: pse is not
        simulated; dsink float32 [head_num], empty without a sink). The forward's softmax statistics are not read:
        the simulator recomputes."""
        call = _check_call(query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, scale_value,
                           keep_prob, pre_tockens, next_tockens, inner_precise, prefix, sparse_mode, actual_seq_qlen,
                           actual_seq_kvlen, softmax_layout, sink)
        check_tensor("dy", dy, (query.dtype,))
        check_shape("dy", dy, tuple(query.shape))
        keeps = None
        if call.keep < 1.0:  # the forward's mask, from the seed and offset it returned
            shape = _probs_shape(query, key, call)
            if numels != shape.numel():
                raise NpuValueError(f"numels ({numels}) must be the forward's dropout mask size ({shape.numel()})")
            keeps = _dropout_keeps(seed, offset, shape, call.keep, query.device)
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (query, key, value)]
            if sink is not None:
                leaves.append(sink.detach().requires_grad_())
            grads = torch.autograd.grad(_attend(*leaves[:3], call, keeps, leaves[3] if sink is not None else None),
                                        leaves, dy)
        empty = query.new_empty(0)
        return grads[0], grads[1], grads[2], empty, grads[3] if sink is not None else empty.clone()
