"""The NPU backend's grouped GEMM (`NpuGroupedGemm`, mixed into `NpuBackend`): high-precision (bfloat16/float16)
groups on one npu_grouped_matmul in its non-quantized mode (`_grouped_float_gemm`), per-tensor FP8/HiF8 groups on
one npu_grouped_matmul (M-split for fprop/dgrad, K-split for wgrad), MXFP8 and blockwise fprop/dgrad on its
M-split MX and G-B modes (`_grouped_block_gemm`, with the per-group arguments of `NpuGemm._quant_matmul_args`),
the MXFP8 and power-of-2 blockwise wgrad on its K-split MX mode (`_grouped_mx_wgrad`; npu_add_quant_gmm_ where it
adds into main_grads), the experts' MX columnwise forms from one npu_grouped_dynamic_mx_quant
(`quantize_row_blocks`), and the row-joining and stacking of the groups' operands and scales (`_rows_of`,
`_stacked`, `_grouped_pairs`, `_grouped_tile_pairs`)."""
from __future__ import annotations

import itertools
import math
from typing import Any, Optional

import torch

from mindspeed_te.formats import FP8Dtype
from mindspeed_te.kernels.npu.common import _HALF, _MAX_LAST_DIM, chip_family
from mindspeed_te.kernels.reference import mm_float32
from mindspeed_te.quantizers import MXFP8Quantizer, Quantizer, record_nonfinite_many
from mindspeed_te.tensor import (
    Float8BlockwiseQTensorStorage,
    Float8TensorStorage,
    MXFP8TensorStorage,
    QuantizedTensorStorage,
    joined_rows,
)


def _rows_of(blocks: list[torch.Tensor]) -> torch.Tensor:
    """The groups' row blocks (rows, ...) as one tensor along dim 0: a view when they lie in order in one buffer
    (codes that one npu_quantize made for all experts, and their scales), else their concatenation."""
    if all(t.is_contiguous() for t in blocks):
        joined = joined_rows([t.reshape(t.shape[0], math.prod(t.shape[1:])) for t in blocks])
        if joined is not None:
            return joined.view(-1, *blocks[0].shape[1:])
    return torch.cat(blocks)


def _scale_invs(ts: list) -> torch.Tensor:
    """The groups' per-tensor scale_invs as one (g,) vector: a view where they lie joined (`_join_per_tensor`)."""
    return _rows_of([t.scale_inv.reshape(1) for t in ts])


def _stacked(parts: list[torch.Tensor]) -> Optional[torch.Tensor]:
    """The groups' 2-D operands (or 3-D E8M0 pairs) stacked along a new dim 0 in the layout each has, contiguous
    or the transposed view of its first two dims (which the grouped GEMM takes for its weight and the weight's
    scales alike); None when their layouts differ. A view when they lie in order in one buffer (the codes and
    scales of experts' weights one quantize made), else a copy (`_rows_of`)."""
    if all(p.is_contiguous() for p in parts):
        return _rows_of([p.unsqueeze(0) for p in parts])
    if all(p.transpose(0, 1).is_contiguous() for p in parts):
        return _rows_of([p.transpose(0, 1).unsqueeze(0) for p in parts]).transpose(1, 2)
    return None


def _tokens_major(t: MXFP8TensorStorage | Float8BlockwiseQTensorStorage
                  ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(codes (tokens, m) contiguous, scale pairs (ceil(blocks / 2), m, 2)) of a columnwise form that an MX
    quantize kernel made along the tokens (`columnwise_scale_pairs`; `columnwise_data` its transposed view): MX
    32-blocks, or power-of-2 1x128 tiles. None for other forms."""
    pairs, data = t.columnwise_scale_pairs, t.columnwise_data
    if pairs is None or data is None or data.dim() != 2 or not data.t().is_contiguous():
        return None
    return data.t(), pairs


def _group_pair_rows(sizes: list[int]) -> list[int]:
    """The first row of each group's scale pairs in the K-split grouped layout, K_0..i-1 // 64 + i, and then the
    layout's row count, K // 64 + g (aclnnGroupedMatmulV4: "scale_i起始地址偏移为((K_0 + K_1 + ...+ K_{i-1})/ 64 +
    g_i)")."""
    starts, total = [], 0
    for i, k in enumerate(sizes):
        starts.append(total // 64 + i)
        total += k
    return starts + [total // 64 + len(sizes)]


def _grouped_pairs(pairs: list[torch.Tensor], sizes: list[int]) -> torch.Tensor:
    """The groups' scale pairs in the K-split grouped layout (`_group_pair_rows`): the tensor they lie in when
    they are its rows there (npu_grouped_dynamic_mx_quant's output), else one concatenation whose rows between
    groups repeat the group before (read by no group)."""
    bounds = _group_pair_rows(sizes)
    rows, first = bounds[-1], pairs[0]
    row = math.prod(first.shape[1:])
    if all(p.is_contiguous() and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
           and p.storage_offset() == first.storage_offset() + start * row for p, start in zip(pairs, bounds)):
        if first.storage_offset() + rows * row <= first.untyped_storage().nbytes() // first.element_size():
            return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())
    pieces = []
    for p, start, end in zip(pairs, bounds, bounds[1:]):
        pieces.append(p)
        if end > start + p.shape[0]:
            pieces.append(p[-1:].expand(end - start - p.shape[0], *p.shape[1:]))
    return torch.cat(pieces)


def _grouped_tile_pairs(tiles: list[torch.Tensor], sizes: list[int]) -> torch.Tensor:
    """The groups' 128-tile E8M0 bytes, (q_i, m, h) with h tiles a row (a quantize kernel's pairs: tiles (2j, 2j + 1)
    in a row), in the K-split MX grouped layout of 32-block pairs (`_group_pair_rows`): one row per tile holding its
    byte twice (one concatenation of broadcast views), then each pair row the row of its tile, pair j of a group
    its tile j // 2 (one index_select; rows between groups repeat the group's last tile, read by no group)."""
    h = tiles[0].shape[2]
    rows = torch.cat([t.permute(0, 2, 1)[..., None].expand(t.shape[0], h, t.shape[1], 2) for t in tiles])
    bounds, index, first_tile = _group_pair_rows(sizes), [], 0
    for t, start, end in zip(tiles, bounds, bounds[1:]):
        index += [first_tile + min((r - start) // 2, h * t.shape[0] - 1) for r in range(start, end)]
        first_tile += h * t.shape[0]
    flat = rows.view(-1, *rows.shape[2:])
    return flat.index_select(0, torch.tensor(index, dtype=torch.int64, device=flat.device))


def _group_stack(out) -> Optional[torch.Tensor]:
    """The groups' outputs (each (m, n)) as one (g, m, n) tensor when they are its slices in order (main_grads
    that lie so in one buffer), else None (never a copy: the kernel adds into it)."""
    if not all(o.dim() == 2 and o.is_contiguous() for o in out):
        return None
    joined = joined_rows([o.reshape(1, -1) for o in out])
    return None if joined is None else joined.view(len(out), *out[0].shape)


def _added_into(out, results: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each result added into its output (the float32 sum rounded once to the output's dtype): one multi-tensor
    add where all are float32 (torch_npu's fused _foreach_add_, 24 tensors a launch), else one add each."""
    if all(o.dtype == r.dtype == torch.float32 for o, r in zip(out, results)):
        torch._foreach_add_(list(out), results)
        return list(out)
    return [o.add_(r) for o, r in zip(out, results)]


def _join_per_tensor(outs: list) -> None:
    """Several per-tensor FP8/HiF8 storages (a grouped linear's experts' inputs, grad_outputs or weights) whose
    codes or scale_invs do not lie in one buffer in order: moved into one (rows, k) tensor of codes and one vector
    of scale_invs, each storage then holding its views of them (the values unchanged). Two concatenations once,
    where each grouped GEMM over them would make them again (the fprop and the wgrad over the inputs, and every
    micro-batch's fprop and dgrad over the step's cached weights)."""
    if len(outs) < 2 or not all(type(o) is Float8TensorStorage and o.data is not None for o in outs):
        return
    rows = [o.data.reshape(-1, o.shape[-1]) for o in outs]
    if len({(r.shape[1], r.dtype) for r in rows}) != 1:
        return
    if joined_rows(rows) is None:
        codes, start = torch.cat(rows), 0
        for o, r in zip(outs, rows):
            o.data = codes[start:start + r.shape[0]].view(o.data.shape)
            start += r.shape[0]
    if joined_rows([o.scale_inv.reshape(1, 1) for o in outs]) is None:
        scales = torch.cat([o.scale_inv.reshape(1) for o in outs])
        for i, o in enumerate(outs):
            o.scale_inv = scales[i:i + 1].view(o.scale_inv.shape)


def _rowwise_only(q: Quantizer) -> Quantizer:
    """A shallow copy of `q` that makes only the rowwise form (its non-finite flag and pending list shared, so
    that what the copy's quantize notes is noted against `q`)."""
    other = object.__new__(type(q))
    other.__dict__.update(vars(q))
    other.set_usage(rowwise=True, columnwise=False)
    return other


class NpuGroupedGemm:
    """grouped_gemm and quantize_row_blocks of the NPU backend (its per-group operands from
    `NpuGemm._quant_matmul_args`); the reference's one GEMM per group, and `quantize_many`, otherwise."""

    npu: Any
    device_name: str

    def quantize_row_blocks(self, quantizers, tensors, blocks: int):
        """`quantize_many`, except the MX columnwise forms of the first `blocks` tensors (a grouped linear's
        experts' inputs or grad_outputs, row blocks of one tensor), which one npu_grouped_dynamic_mx_quant
        (op-plugin 26.0.0 and later) makes for all of them: each expert's 32-token blocks start at its first
        token, its last one short where 32 does not divide its tokens, as in its own npu_dynamic_mx_quant(axis=-2)
        (aclnnGroupedDynamicMxQuant: "将输入x在第0维上先按照groupIndex进行分组，每个group内按k = blocksize个数分组";
        the same scale rules, scaleAlg 0 / 1), and the scales come in the K-split grouped GEMM's layout, which the
        wgrad (`_grouped_mx_wgrad`) then reads as they lie. Their rowwise forms, and the other tensors, go through
        `quantize_many` (one quantize of the joined rows). Taken for bfloat16/float16 experts ("FLOAT16、BFLOAT16")
        with tokens, except where a dual-axis call makes both forms of the joined rows (all experts but the last
        of whole 64-token pairs)."""
        qs, xs = list(quantizers), list(tensors)
        joined = self._grouped_mx_rows(qs[:blocks], xs[:blocks])
        if joined is None:
            outs = self.quantize_many(qs, xs)
            _join_per_tensor(outs[:blocks])
            _join_per_tensor(outs[blocks:])
            return outs
        rowwise = [i for i in range(blocks) if qs[i].rowwise_usage]
        others = rowwise + list(range(blocks, len(qs)))
        made = self.quantize_many([_rowwise_only(qs[i]) if i < blocks else qs[i] for i in others],
                                  [xs[i] for i in others])
        outs: list = [None] * len(qs)
        for i, out in zip(others, made):
            outs[i] = out
        q = qs[0]
        ends, total = [], 0
        for x in xs[:blocks]:
            total += math.prod(x.shape[:-1])
            ends.append(total)
        y, mxscale = self.npu.npu_grouped_dynamic_mx_quant(
            joined, torch.tensor(ends, dtype=torch.int32, device=joined.device),
            dst_type=self._npu_dtype(q.fp8_dtype), scale_alg=1 if q.rounding == "ceil" else 0)
        start, fresh = 0, []
        for i, end in enumerate(ends):
            out = outs[i]
            if out is None:  # no rowwise form asked for
                out = outs[i] = MXFP8TensorStorage(q.fp8_dtype, xs[i].shape, xs[i].dtype)
                fresh.append(i)
            first = start // 64 + i  # the group's pairs (aclnnGroupedMatmulV4's K-split MX layout)
            out.columnwise_data = y[start:end].t()
            out.columnwise_scale_pairs = mxscale[first: first + math.ceil((end - start) / 64)]
            start = end
        record_nonfinite_many([qs[i] for i in fresh], [outs[i] for i in fresh])
        return outs

    def _grouped_mx_rows(self, qs: list, xs: list) -> Optional[torch.Tensor]:
        """The joined (rows, k) tensor of row blocks `xs` whose MX columnwise forms npu_grouped_dynamic_mx_quant
        makes (see `quantize_row_blocks`), or None."""
        if not qs or not hasattr(self.npu, "npu_grouped_dynamic_mx_quant"):
            return None
        q = qs[0]
        if any(type(p) is not MXFP8Quantizer or not p.columnwise_usage or p.block_len != 32
               or (p.fp8_dtype, p.rounding) != (q.fp8_dtype, q.rounding) for p in qs):
            return None
        x2ds = [x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x for x in xs]
        if any(t.dtype not in _HALF or not t.shape[0] or t.shape[1] % 32 for t in x2ds):
            return None
        joined = joined_rows(x2ds)
        if joined is None:
            return None
        if (any(p.rowwise_usage for p in qs) and self._dual_axis_mx(joined)
                and all(t.shape[0] % 64 == 0 for t in x2ds[:-1])):
            return None  # one dual-axis call makes both forms of all the rows
        return joined

    def grouped_gemm(self, a, b, *, a_columnwise=False, b_columnwise=False, out_dtype=torch.float32, out=None):
        """High-precision groups go to one npu_grouped_matmul in its non-quantized mode (`_grouped_float_gemm`).
        Per-tensor FP8/HiF8 groups go to one npu_grouped_matmul: the M-split form for fprop/dgrad (rows of
        all groups concatenated, weights stacked), the K-split form for wgrad (the token dim split). MXFP8 and
        blockwise (1x128 by 128x128 tiles) fprop/dgrad take its M-split MX and G-B modes
        (`_grouped_block_gemm`), the MXFP8 and power-of-2 1x128 wgrads its K-split MX mode (`_grouped_mx_wgrad`).
        Other operands take one GEMM per group. With `out`, the float32 results are added into it (`_added_into`)."""
        results = (self._grouped_float_gemm(a, b, a_columnwise, b_columnwise, out_dtype) if out is None
                   else self._grouped_float_wgrad_into(a, b, a_columnwise, b_columnwise, out))
        if results is not None:
            return results
        if not a_columnwise:
            y = self._grouped_block_gemm(a, b, b_columnwise, torch.float32 if out is not None else out_dtype)
            if y is not None:
                results = list(torch.split(y, [math.prod(t.shape[:-1]) for t in a]))
                return _added_into(out, results) if out is not None else results
        if a_columnwise and b_columnwise:
            results = self._grouped_mx_wgrad(a, b, out_dtype, out)
            if results is not None:
                return results
        # The K-split form over fewer than 128 tokens in all reads its scales in other modes ("K小于128 ... x则选择
        # pergroup量化", aclnnGroupedMatmulV4): then one GEMM per group.
        few_tokens = a_columnwise and sum(math.prod(t.shape[:-1]) for t in a) < 128
        if not self._groupable(a, b) or (a_columnwise and not b_columnwise) or few_tokens:
            return super().grouped_gemm(a, b, a_columnwise=a_columnwise, b_columnwise=b_columnwise,
                                        out_dtype=out_dtype, out=out)
        fp8 = a[0].fp8_dtype
        hif8 = {"x_dtype": self.npu.hifloat8, "weight_dtype": self.npu.hifloat8} if fp8 is FP8Dtype.HIF8 else {}
        rows = [t.data.reshape(-1, t.shape[-1]) for t in a]
        mm_dtype = torch.float32 if out is not None else out_dtype
        if not a_columnwise:
            # x (M, K); weight (G, K, N): the stacked weight codes, transposed for fprop (W is (N, K)) and as
            # they are for dgrad (W itself is the (K, N) operand there).
            b_codes = _stacked([t.data.reshape(-1, t.shape[-1]) for t in b])
            b_codes = b_codes if b_columnwise else b_codes.transpose(1, 2)
            # x's scales one per group, (g, 1): the kernel's pertensor form ("pertensor场景：每个tensor 2维或1维，
            # shape为（g, 1）或（g,）"; 2-D, so that g = M cannot read as pertoken), a view of the joined scale_invs.
            sizes = [r.shape[0] for r in rows]
            per_group = _scale_invs(a).reshape(-1, 1)
            (y,) = self.npu.npu_grouped_matmul(
                [_rows_of(rows)], [b_codes], scale=[_scale_invs(b)],
                per_token_scale=[per_group], group_list=self._group_list(sizes, rows[0].device),
                split_item=3, group_type=0, output_dtype=mm_dtype, **hif8)
            results = list(torch.split(y, sizes))
        else:
            # K-split: x = the concatenated (tokens, N) codes transposed, weight the (tokens, K) codes.
            sizes = [r.shape[0] for r in rows]
            x_rows = _rows_of([t.data.reshape(-1, t.shape[-1]) for t in b])
            (y,) = self.npu.npu_grouped_matmul(
                [_rows_of(rows).t()], [x_rows], scale=[_scale_invs(b)],
                per_token_scale=[_scale_invs(a)],
                group_list=self._group_list(sizes, rows[0].device),
                split_item=3, group_type=2, output_dtype=mm_dtype, **hif8)
            results = list(y.unbind(0))
        return _added_into(out, results) if out is not None else results

    def _grouped_float_gemm(self, a, b, a_columnwise: bool, b_columnwise: bool, out_dtype: torch.dtype
                            ) -> Optional[list[torch.Tensor]]:
        """Every group's a_i · b_iᵀ of bfloat16 or float16 tensors (the experts' GEMMs outside FP8, and Megatron's
        --no-use-gmm-fp8) as one npu_grouped_matmul in its non-quantized mode: fprop and dgrad split the rows
        (group_type 0: the groups' rows joined, their weights stacked, transposed for fprop), the wgrad the tokens
        (group_type 2: the grad_outputs' joined rows, transposed, times the inputs' joined rows; (g, m, n) unbound
        per group). The kernel sums each product in float32 and rounds it once to x's dtype (aclnnGroupedMatmulV4,
        非量化场景: x and weight "BFLOAT16"/"FLOAT16", out of the same dtype), as the reference's GEMM with that
        output. None where that does not fit: quantized or 3-D operands, dtypes that differ, another out_dtype
        (a float32 one, which the mode has not: the fprop with biases, the wgrad added into main_grad), groups
        whose weights differ in shape or layout, a last dim the A2/A3 document limits ("x和weight中每一组tensor的
        最后一维大小都应小于65536"), a chip without the kernel."""
        tensors = [*a, *b]
        if not a or len(a) != len(b) or (a_columnwise and not b_columnwise) or chip_family(self.device_name) == "":
            return None
        if any(isinstance(t, QuantizedTensorStorage) or t.dim() != 2 or t.dtype != out_dtype for t in tensors):
            return None
        if out_dtype not in _HALF or max(t.shape[1] for t in tensors) > _MAX_LAST_DIM:
            return None
        sizes = [t.shape[0] for t in a]
        if a_columnwise:  # dW_i = dY_iᵀ · X_i: K-split over the tokens, x the transposed view of the (M, n) rows
            if [t.shape[0] for t in b] != sizes or len({t.shape[1] for t in a}) > 1 or len({t.shape[1] for t in b}) > 1:
                return None
            (y,) = self.npu.npu_grouped_matmul([_rows_of(list(a)).t()], [_rows_of(list(b))],
                                               group_list=self._group_list(sizes, a[0].device), split_item=3,
                                               group_type=2)
            return list(y.unbind(0))
        # x (M, k); weight (g, k, n): the stacked (n, k) weights transposed for fprop, as they are for dgrad.
        weight = _stacked(list(b)) if len({t.shape for t in b}) == 1 else None
        if weight is None or len({t.shape[1] for t in a}) > 1:
            return None
        weight = weight if b_columnwise else weight.transpose(1, 2)
        if weight.shape[1] != a[0].shape[1]:
            return None
        (y,) = self.npu.npu_grouped_matmul([_rows_of(list(a))], [weight],
                                           group_list=self._group_list(sizes, a[0].device), split_item=3,
                                           group_type=0)
        return list(torch.split(y, sizes))

    def _grouped_float_wgrad_into(self, a, b, a_columnwise: bool, b_columnwise: bool, out
                                  ) -> Optional[list[torch.Tensor]]:
        """Every group's dY_iᵀ · X_i of bfloat16 or float16 tensors added into its float32 `main_grad` (Megatron's
        gradient-accumulation fusion outside FP8) by one npu_grouped_matmul_add_: each group's float32 sum added
        once, as the reference's GEMM + add. In place where the main_grads are one buffer's slices in expert
        order; else into zeros, then one multi-tensor add (Megatron's grad buffer holds the experts in reverse).
        Where the installed binding's kernel is not the chip's: the joined rows cast to float32 once, a float32
        GEMM per group, one multi-tensor add. None where that does not fit.

        The binding calls aclnnGroupedMatmulAdd (Atlas A2/A3 only: its 产品支持情况 marks the 950 "×") up to
        op-plugin 7.3.0, and from 26.0.0 aclnnGroupedMatmulAddV2 on the 950 (GroupedMatmulAddNpuOpApi.cpp), which
        writes y as (g, m, n) where the first writes (g * m, n). torch_npu names no binding's version;
        npu_add_quant_gmm_ came in the same release (26.0.0), so its presence marks the newer binding."""
        family = chip_family(self.device_name)
        if not a or not (a_columnwise and b_columnwise) or family == "":
            return None
        tensors = [*a, *b]
        if any(isinstance(t, QuantizedTensorStorage) or t.dim() != 2 for t in tensors):
            return None
        if a[0].dtype not in _HALF or any(t.dtype != a[0].dtype for t in tensors):
            return None
        sizes = [t.shape[0] for t in a]
        if [t.shape[0] for t in b] != sizes or sum(sizes) == 0:
            return None
        shape = (a[0].shape[1], b[0].shape[1])
        if any((ai.shape[1], bi.shape[1]) != shape for ai, bi in zip(a, b)):
            return None
        if any(o.dtype != torch.float32 or tuple(o.shape) != shape for o in out):
            return None
        v2 = family == "950"
        if v2 and not hasattr(self.npu, "npu_add_quant_gmm_"):
            dy, x = _rows_of(list(a)).float(), _rows_of(list(b)).float()
            bf16 = a[0].dtype == torch.bfloat16
            return _added_into(out, [mm_float32(dy[e - k:e].t(), x[e - k:e], bf16_values=bf16)
                                     for e, k in zip(itertools.accumulate(sizes), sizes)])
        stacked = _group_stack(out)
        y = stacked if stacked is not None else torch.zeros(len(out), *shape, dtype=torch.float32, device=out[0].device)
        self.npu.npu_grouped_matmul_add_(y if v2 else y.view(-1, shape[1]), _rows_of(list(a)), _rows_of(list(b)),
                                         self._group_list(sizes, a[0].device), transpose_x=True,
                                         transpose_weight=False, group_type=2)
        return list(out) if stacked is not None else _added_into(out, list(y.unbind(0)))

    def _grouped_mx_wgrad(self, a, b, out_dtype: torch.dtype, out) -> Optional[list[torch.Tensor]]:
        """Every group's a_i · b_iᵀ of MXFP8 columnwise forms, or of power-of-2 1x128 ones (E4M3/E5M2), (the
        experts' wgrad dW_i = dY_iᵀ·X_i, the tokens split) as one K-split npu_grouped_matmul in the MX mode,
        (g, m, n) unbound per group; with `out`, added into it: by npu_add_quant_gmm_ (op-plugin 26.0.0 and later)
        where out is one float32 (g, m, n) tensor in group order, else by one multi-tensor add (`_added_into`).
        None where the operands do not fit: other storages, forms the quantize kernels did not make along the
        tokens (their codes a transposed view of the tokens-major (k, m) codes, their scales in the kernels'
        pairs), an empty group. A group's last block may be short ("kLoops=ceil(K_i / gsK)，支持最后的切片长度
        不足gsK": experts need no padding). A 128-tile is four 32-blocks of its E8M0 byte (`_grouped_tile_pairs`),
        so the MX mode's sum of block products is the blockwise one, as in `NpuGemm._pow2_tiles_as_mx`.

        The kernel reads each operand's tokens-major codes of all groups as one (K, m) tensor (a view where one
        quantize made them, else one concatenation) and their scales in the grouped layout: group i's
        ceil(K_i / 64) pairs at row K_0..i-1 // 64 + i of a (K // 64 + g, m, 2) tensor (aclnnGroupedMatmulV4, MX,
        groupType 2: "scale_i起始地址偏移为((K_0 + K_1 + ...+ K_{i-1})/ 64 + g_i)*N* 2"). That is the layout
        npu_grouped_dynamic_mx_quant writes (`quantize_row_blocks`): its groups' pairs are then taken as they lie;
        other pairs (one call per expert, or per run of whole 64-token pairs) are laid out so by one
        concatenation, whose rows between groups repeat a neighbour (the kernel reads none of them). Each group's
        sum is the single MX npu_quant_matmul's over its tokens, so the results are those of one GEMM per
        expert."""
        storage = type(a[0]) if a else None
        if storage not in (MXFP8TensorStorage, Float8BlockwiseQTensorStorage) or any(
                type(t) is not storage for t in (*a, *b)):
            return None
        forms = [(_tokens_major(ai), _tokens_major(bi)) for ai, bi in zip(a, b)]
        if any(fa is None or fb is None for fa, fb in forms):
            return None
        sizes = [fa[0].shape[0] for fa, _ in forms]
        if 0 in sizes or any(fb[0].shape[0] != k for (_, fb), k in zip(forms, sizes)):
            return None
        if len({fa[0].shape[1] for fa, _ in forms}) != 1 or len({fb[0].shape[1] for _, fb in forms}) != 1:
            return None
        x_codes, w_codes = _rows_of([fa[0] for fa, _ in forms]), _rows_of([fb[0] for _, fb in forms])
        grouped = _grouped_pairs if storage is MXFP8TensorStorage else _grouped_tile_pairs
        x_scale, w_scale = (grouped([f[j][1] for f in forms], sizes) for j in (0, 1))
        e8m0 = self.npu.float8_e8m0fnu
        group_list = self._group_list(sizes, x_codes.device)
        y = _group_stack(out) if out is not None else None
        if y is not None and y.dtype == torch.float32 and hasattr(self.npu, "npu_add_quant_gmm_"):
            self.npu.npu_add_quant_gmm_(y, x_codes.t(), w_codes, w_scale, group_list, x1_scale=x_scale,
                                        x1_scale_dtype=e8m0, x2_scale_dtype=e8m0)
            return list(out)
        (y,) = self.npu.npu_grouped_matmul(
            [x_codes.t()], [w_codes], scale=[w_scale], per_token_scale=[x_scale], group_list=group_list,
            split_item=3, group_type=2, output_dtype=torch.float32 if out is not None else out_dtype,
            scale_dtype=e8m0, per_token_scale_dtype=e8m0)
        results = list(y.unbind(0))
        return _added_into(out, results) if out is not None else results

    def _grouped_block_gemm(self, a, b, b_columnwise: bool, out_dtype: torch.dtype) -> Optional[torch.Tensor]:
        """a_i · b_iᵀ of every group as one M-split npu_grouped_matmul in the MX or G-B mode, (rows, n), or None
        when the operands do not fit one (other storages, 128x128 tiles on a, groups whose weights differ in
        shape or layout). Each group's x1, x2 and scales are those npu_quant_matmul takes in the same
        mode (`_quant_matmul_args`); the rows of a and their scales are concatenated (a view when one quantize
        made them all) and the weights and their scales stacked, transposed views as they are."""
        if not a or any(type(t) is not type(a[0]) for t in (*a, *b)):
            return None
        if not isinstance(a[0], MXFP8TensorStorage) and not (
                isinstance(a[0], Float8BlockwiseQTensorStorage) and all(t.block_scaling_dim == 1 for t in a)
                and all(t.block_scaling_dim == 2 for t in b)):
            return None
        args = [self._quant_matmul_args(ai, bi, False, b_columnwise) for ai, bi in zip(a, b)]
        if any(arg is None for arg in args) or {arg[1].shape for arg in args} != {args[0][1].shape}:
            return None
        weight, scale = _stacked([x2 for _, x2, _ in args]), _stacked([kw["scale"] for _, _, kw in args])
        if weight is None or scale is None or weight.shape[-1] > _MAX_LAST_DIM or args[0][0].shape[-1] > _MAX_LAST_DIM:
            return None
        kwargs = args[0][2]
        if kwargs.get("group_sizes") == [1, 1, 32]:
            mode = dict(scale_dtype=kwargs["scale_dtype"], per_token_scale_dtype=kwargs["pertoken_scale_dtype"])
        else:
            mode = {name: kwargs[key] for name, key in (("x_dtype", "x1_dtype"), ("weight_dtype", "x2_dtype"))
                    if key in kwargs}
        x = _rows_of([x1 for x1, _, _ in args])
        per_token = _rows_of([kw["pertoken_scale"] for _, _, kw in args])
        sizes = [x1.shape[0] for x1, _, _ in args]
        (y,) = self.npu.npu_grouped_matmul(
            [x], [weight], scale=[scale], per_token_scale=[per_token], group_list=self._group_list(sizes, x.device),
            split_item=3, group_type=0, output_dtype=out_dtype, **mode)
        return y

    @staticmethod
    def _group_list(sizes: list[int], device: torch.device) -> torch.Tensor:
        ends, total = [], 0
        for m in sizes:
            total += m
            ends.append(total)
        return torch.tensor(ends, dtype=torch.int64, device=device)

    @staticmethod
    def _groupable(a, b) -> bool:
        """Per-tensor scaled groups of one 8-bit format (the only grouped FP8 form the kernel has)."""
        tensors = list(a) + list(b)
        if not tensors or not all(isinstance(t, Float8TensorStorage) and t.data is not None for t in tensors):
            return False
        hif8 = [t.fp8_dtype is FP8Dtype.HIF8 for t in tensors]
        return all(hif8) or not any(hif8)
