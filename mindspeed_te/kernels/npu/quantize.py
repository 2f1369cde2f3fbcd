"""The NPU backend's quantize (`NpuQuantize`, mixed into `NpuBackend`): quantize and quantize_many, with
per-tensor delayed and current scaling batched over a pass's tensors, block scales on npu_dynamic_block_quant,
power-of-2 block scales on npu_dynamic_mx_quant, HiF8 power-of-2 tiles in one chain of small ops and one
npu_quantize per layout, MXFP8 on npu_dynamic_mx_quant (both layouts: dual-axis), and row blocks of one buffer
(a grouped linear's experts) joined into one kernel pass; the run-finding helpers and `_QUANTIZE_KERNELS`, the
dispatch of the block-scaled quantizers."""
from __future__ import annotations

import copy
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence, Union

import torch

from mindspeed_te.formats import FP8Dtype
from mindspeed_te.kernels.npu.common import _HALF
from mindspeed_te.kernels.npu.fp4 import NpuFP4
from mindspeed_te.kernels.npu.fused_quantize import NpuFusedQuantize
from mindspeed_te.quantizers import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    Float8RepeatQuantizer,
    MXFP4Quantizer,
    MXFP8Quantizer,
    Quantizer,
    record_nonfinite_many,
)
from mindspeed_te.scaling import FLT_MAX, e8m0_decode, mark_nonfinite
from mindspeed_te.tensor import (
    Float8BlockwiseQTensorStorage,
    Float8TensorStorage,
    MXFP8TensorStorage,
    QuantizedTensorStorage,
    joined_rows,
    rows_follow,
)

_HIF8_DST_MAX = (15.0, 56.0, 224.0, 32768.0)


def _per_row(values: Sequence[torch.Tensor], rows: Sequence[int]) -> torch.Tensor:
    """Each group's one-element value repeated over its rows, as one 1-D tensor (one concatenation): npu_quantize
    takes one divisor, or one per row, none per group."""
    return torch.cat([v.reshape(1).expand(m) for v, m in zip(values, rows)])


def _row_local_config(q: Quantizer) -> Optional[tuple]:
    """What the output of a quantizer whose rowwise form is row-local (1x128 tiles, MX blocks; 128x128 tiles
    for row blocks of whole tiles, see `_tile_rows`) depends on, or None for other quantizers."""
    if isinstance(q, MXFP8Quantizer):
        return type(q), q.fp8_dtype, q.rowwise_usage, q.columnwise_usage, q.block_len, q.rounding
    if isinstance(q, Float8BlockQuantizer):
        return (type(q), q.fp8_dtype, q.rowwise_usage, q.columnwise_usage, q.block_len, q.target_max,
                q.amax_epsilon, q.power_2_scale, q.block_scaling_dim)
    return None


def _tile_rows(q: Quantizer) -> int:
    """The rows of one tile of a row-local quantizer's rowwise form: 128 for 128x128 tiles (a block of rows
    joins others only in whole tiles), else 1."""
    return q.block_len if isinstance(q, Float8BlockQuantizer) and q.block_scaling_dim == 2 else 1


def _memory_order(x2ds: Sequence[torch.Tensor]) -> list[int]:
    """The indices of `x2ds` by where their data lies (buffer, then offset; ties keep their order), so that
    row blocks of one buffer are neighbours in the order they lie: a grouped linear's expert inputs as given,
    its weights in Megatron's contiguous parameter buffer (--use-distributed-optimizer) in reverse."""
    return sorted(range(len(x2ds)), key=lambda i: (x2ds[i].untyped_storage().data_ptr(), x2ds[i].storage_offset()))


def _runs(order: Sequence[int], joins: Callable[[int, int, int], bool]) -> Iterator[list[int]]:
    """`order` cut into maximal runs of neighbours, index i joining the run that starts at index s and ends
    at index p when `joins(s, p, i)`."""
    run: list[int] = []
    for i in order:
        if run and not joins(run[0], run[-1], i):
            yield run
            run = []
        run.append(i)
    if run:
        yield run


def _row_spans(x2ds: Sequence[torch.Tensor], run: Sequence[int]) -> Iterator[tuple[int, slice]]:
    """(i, its rows in the joined tensor) for each row block i of `run`."""
    row = 0
    for i in run:
        yield i, slice(row, row + x2ds[i].shape[0])
        row += x2ds[i].shape[0]


def _row_runs(qs: Sequence[Quantizer], x2ds: Sequence[torch.Tensor],
              outs: Sequence[Optional[QuantizedTensorStorage]]) -> Iterator[list[int]]:
    """Runs of two or more tensors not quantized yet that are row blocks of one buffer (`rows_follow`, in
    `_memory_order`) with row-local quantizers of one configuration (`_row_local_config`)."""
    configs = [_row_local_config(q) for q in qs]

    def joins(start: int, prev: int, i: int) -> bool:
        tile = _tile_rows(qs[start])
        return (configs[start] is not None and configs[i] == configs[start] and outs[i] is None
                and outs[start] is None and x2ds[start].shape[0] % tile == 0 and x2ds[i].shape[0] % tile == 0
                and rows_follow(x2ds[prev], x2ds[i]))

    return (run for run in _runs(_memory_order(x2ds), joins) if len(run) > 1)


def _pair_parts(x2ds: Sequence[torch.Tensor], run: list[int]) -> Iterator[list[int]]:
    """`run` cut after each block that is not whole 64-row pairs of 32-row MX blocks, so that every block of a
    part starts at a whole pair of the part's columnwise scales."""
    return _runs(run, lambda start, prev, i: x2ds[prev].shape[0] % 64 == 0)


def _with_usage(q: Quantizer, **usage: bool) -> Quantizer:
    """A shallow copy of `q` making only the forms `usage` leaves on (copy.copy would clone its non-finite
    flag, a launch; the copy's quantizes are noted against `q` by the caller)."""
    other = object.__new__(type(q))
    other.__dict__.update(vars(q))
    other.set_usage(**usage)
    return other


class _TileLayout(NamedTuple):
    """One layout in NpuBackend._quantize_hif8_tiles: `data` (rows, k) is cast one tile per row, `tiles` is the
    view whose `dims` reduce to the tile amaxes; `targets` are the storages it fills with their rows of data
    (several for the rowwise form of row blocks of one buffer)."""

    targets: list[tuple[Float8BlockwiseQTensorStorage, slice]]
    quantizer: Float8BlockQuantizer
    kind: str  # "tiles" (128x128, rowwise), "rowwise" or "columnwise" (1x128)
    data: torch.Tensor
    tiles: torch.Tensor
    dims: Union[int, tuple[int, int]]

    @property
    def scales_shape(self) -> torch.Size:
        """(tile rows, tile cols) of the scales: the tiles view without its reduced dims."""
        return self.tiles.shape[:2] if self.dims == -1 else self.tiles.shape[0:3:2]


class NpuQuantize(NpuFusedQuantize):
    """quantize and quantize_many of the NPU backend on torch_npu's quantize kernels; the quantizers' own torch
    ops (the reference) where none applies. The fused norm / activation + quantize kernels come from
    `NpuFusedQuantize`."""

    npu: Any
    device_name: str

    def _npu_dtype(self, fp8_dtype: FP8Dtype) -> Any:
        return {FP8Dtype.E4M3: torch.float8_e4m3fn, FP8Dtype.E5M2: torch.float8_e5m2,
                FP8Dtype.HIF8: self.npu.hifloat8}[fp8_dtype]

    def _dst_type_max(self, fp8_dtype: FP8Dtype, target: float) -> Optional[float]:
        """The kernels' dst_type_max for a target max, or None when no kernel takes that target."""
        if fp8_dtype is FP8Dtype.HIF8:
            return target if target in _HIF8_DST_MAX else None
        return 0.0 if target == fp8_dtype.max else None

    def quantize(self, quantizer: Quantizer, x: torch.Tensor) -> QuantizedTensorStorage:
        return self.quantize_many([quantizer], [x])[0]

    def quantize_many(self, quantizers: Sequence[Quantizer], tensors: Sequence[torch.Tensor]
                      ) -> list[QuantizedTensorStorage]:
        """Per-tensor delayed and current scaling of several tensors share their small ops (one multi-tensor
        amax, one history update, one non-finite mark for all), and so do the HiF8 power-of-2 tiles of the
        pass (`_quantize_hif8_tiles`); the rest one by one."""
        if not quantizers:
            return []  # a rank whose experts all received no tokens
        x2ds = [x.detach().reshape(-1, x.shape[-1]) for x in tensors]
        kind = type(quantizers[0])
        if all(type(q) is kind for q in quantizers) and all(t.numel() for t in x2ds):
            if kind is Float8Quantizer:
                return self._quantize_delayed(quantizers, tensors, x2ds)
            if kind is Float8CurrentScalingQuantizer:
                out = self._quantize_current(quantizers, tensors, x2ds)
                if out is not None:
                    return out
            if kind is Float8RepeatQuantizer:  # npu_quantize by the earlier quantize's divisor, nothing else
                return self._npu_quantize_all(quantizers, tensors, x2ds, [q.divisor(x.dtype) for q, x in
                                                                          zip(quantizers, x2ds)],
                                              [q.scale_inv for q in quantizers])
        outs: list = self._quantize_hif8_tiles(quantizers, tensors, x2ds)  # all the pass's HiF8 tiles at once
        self._quantize_joined_rows(quantizers, tensors, x2ds, outs)
        for i, (q, x, x2d) in enumerate(zip(quantizers, tensors, x2ds)):
            if outs[i] is None:
                kernel = _QUANTIZE_KERNELS.get(type(q))
                out = kernel(self, q, x, x2d) if kernel is not None else None
                outs[i] = out if out is not None else q.quantize(x)
        return list(record_nonfinite_many(quantizers, outs))

    def _quantize_joined_rows(self, qs: Sequence[Quantizer], xs: Sequence[torch.Tensor],
                              x2ds: Sequence[torch.Tensor], outs: list[Optional[QuantizedTensorStorage]]) -> None:
        """Fill `outs` for runs of row blocks of one buffer (`rows_follow`: a grouped linear's experts' inputs or
        grad_outputs, or its weights in Megatron's parameter buffer) that block-scaled quantizers of one
        configuration take along the rows (1x128 tiles, MX blocks, 128x128 tiles of blocks of whole tiles): the
        rowwise form is row-local, so one kernel pass over the joined rows makes every block's (its rows of that
        output, views; for 128x128 tiles that form serves both directions); each block's columnwise form, whose
        tiles start at the block's first row, is made on its own, except MX: its columnwise form is quantized
        along the rows (`_quantize_mx`), so one call makes those of several blocks too (also when they need no
        rowwise form: inputs quantized again in backward, `save_original_input`), its scales in
        (ceil(M / 64), K, 2) pairs: one call per part of the run (`_pair_parts`: cut after each block that is not
        whole pairs, whose last pair is then padded with 0, as the kernel pads the last of a tensor of its own).
        A run of one part takes the dual-axis kernel where both forms are needed: one call. A run of several parts
        keeps its rowwise form in one call of the joined rows: one dual-axis call per part would cost as many calls
        and scatter the rowwise forms, which the grouped GEMM then joins (one concatenation each of codes and
        scales)."""
        for run in _row_runs(qs, x2ds, outs):
            q = qs[run[0]]
            joined = joined_rows([x2ds[i] for i in run])
            mx_columnwise = isinstance(q, MXFP8Quantizer) and q.columnwise_usage
            if joined is None or not (q.rowwise_usage or mx_columnwise):
                continue
            kernel = _QUANTIZE_KERNELS[type(q)]
            parts = [(part, joined_rows([x2ds[i] for i in part])) for part in _pair_parts(x2ds, run)
                     ] if mx_columnwise else []
            if len(parts) == 1 and self._dual_axis_mx(joined):  # the run's forms in one call (dual-axis when both)
                wholes = [(part, kernel(self, q, rows, rows)) for part, rows in parts]
            else:
                rowwise = _with_usage(q, columnwise=False)
                wholes = [(run, kernel(self, rowwise, joined, joined))] if q.rowwise_usage else []
                wholes += [(part, kernel(self, _with_usage(q, rowwise=False), rows, rows)) for part, rows in parts]
            if any(whole is None for _, whole in wholes):
                continue
            if q.columnwise_usage and not mx_columnwise and _tile_rows(q) == 1:
                for i in run:  # 1x128 columnwise tiles start at the block's first row
                    columnwise = _with_usage(qs[i], rowwise=False)
                    out = kernel(self, columnwise, xs[i], x2ds[i])
                    outs[i] = out if out is not None else columnwise.quantize(xs[i])
            for part, whole in wholes:
                self._give_rows(whole, q, xs, x2ds, part, outs)

    @staticmethod
    def _give_rows(whole: QuantizedTensorStorage, q: Quantizer, xs: Sequence[torch.Tensor],
                   x2ds: Sequence[torch.Tensor], part: list[int], outs: list[Optional[QuantizedTensorStorage]]
                   ) -> None:
        """Give each row block i of `part` its rows of the forms `whole` (made for the blocks' joined rows) has:
        views of the rowwise data and scales (a scale per `_tile_rows(q)` rows) and of the MX columnwise data
        and scale pairs (a pair per 64 rows; the part's blocks start at whole pairs)."""
        tile = _tile_rows(q)
        for i, rows in _row_spans(x2ds, part):
            out = outs[i]
            if out is None:  # its fields are all given below (the forms whole lacks are None in it too)
                out = outs[i] = copy.copy(whole)
                out.shape = xs[i].shape
            if whole.rowwise_data is not None:
                out.rowwise_data = whole.rowwise_data[rows].reshape(xs[i].shape)
                out.rowwise_scale_inv = whole.rowwise_scale_inv[rows.start // tile : rows.stop // tile]
            if isinstance(whole, MXFP8TensorStorage) and whole.columnwise_scale_pairs is not None:
                out.columnwise_data = whole.columnwise_data[:, rows]
                out.columnwise_scale_pairs = whole.columnwise_scale_pairs[rows.start // 64 : -(-rows.stop // 64)]

    def _npu_quantize(self, q: Quantizer, x2d: torch.Tensor, divisor: torch.Tensor) -> torch.Tensor:
        """The codes of npu_quantize(x2d, divisor) (x / divisor, saturated): one divisor, or one per row."""
        src = x2d if x2d.dtype == divisor.dtype else x2d.float()  # float16/float64: divide in float32
        y = self.npu.npu_quantize(src, divisor, None, self._npu_dtype(q.fp8_dtype), 0 if divisor.numel() > 1 else -1,
                                  True)
        return y.view(torch.uint8) if q.fp8_dtype is FP8Dtype.HIF8 else y

    def _npu_quantize_all(self, qs: Sequence[Quantizer], xs: Sequence[torch.Tensor], x2ds: Sequence[torch.Tensor],
                          divisors: Sequence[torch.Tensor], scale_invs: Sequence[torch.Tensor]
                          ) -> list[Float8TensorStorage]:
        """Each tensor's codes (`_npu_quantize`), stored with its `scale_inv`. Tensors that are row blocks of
        one buffer (`rows_follow`, in `_memory_order`: a grouped linear's experts' inputs, or its weights in
        Megatron's contiguous parameter buffer) with one format and divisor dtype take one npu_quantize with a
        divisor per row (their divisors expanded over their rows in one concatenation): two launches for all
        the experts instead of one each."""
        def joins(start: int, prev: int, i: int) -> bool:
            return (rows_follow(x2ds[prev], x2ds[i]) and qs[i].fp8_dtype is qs[start].fp8_dtype
                    and divisors[i].dtype == divisors[start].dtype)

        outs: list[Optional[Float8TensorStorage]] = [None] * len(qs)
        for run in _runs(_memory_order(x2ds), joins):
            start = run[0]
            if len(run) == 1:
                codes = self._npu_quantize(qs[start], x2ds[start], divisors[start])
            else:
                per_row = _per_row([divisors[i] for i in run], [x2ds[i].shape[0] for i in run])
                codes = self._npu_quantize(qs[start], joined_rows([x2ds[i] for i in run]), per_row)
            for i, rows in _row_spans(x2ds, run):
                outs[i] = Float8TensorStorage(qs[i].fp8_dtype, xs[i].shape, xs[i].dtype,
                                              data=codes[rows].reshape(xs[i].shape), scale_inv=scale_invs[i])
        return outs

    def _quantize_current(self, qs: Sequence[Float8CurrentScalingQuantizer], xs: Sequence[torch.Tensor],
                          x2ds: Sequence[torch.Tensor]) -> Optional[list[Float8TensorStorage]]:
        """bfloat16/float16: one npu_dynamic_quant per tensor (its pertensor scale is NaN for NaN/Inf data).
        float32, which that kernel does not take ("x: 数据类型支持float16、bfloat16"): the amaxes (`_amaxes`)
        stacked, scale_inv = amax / target (one IEEE division; 1 for amax 0, at least 1/FLT_MAX; it stays non-finite
        for NaN/Inf data, so those codes and the stored scale are non-finite) in three ops, npu_quantize.
        Then one flag update for all. None (the quantizer's torch ops) for what neither form covers."""
        q0 = qs[0]
        dst_max = self._dst_type_max(q0.fp8_dtype, q0.target_max)
        same = all((q.fp8_dtype, q.target_max, q.amax_epsilon, q.power_2_scale) ==
                   (q0.fp8_dtype, q0.target_max, q0.amax_epsilon, q0.power_2_scale) for q in qs)
        if (not same or q0.power_2_scale or q0.amax_epsilon != 0 or any(q.amax_reduction_group is not None for q in qs)
                or len({x.dtype for x in xs}) != 1):
            return None
        if xs[0].dtype in _HALF and dst_max is not None:
            outs = []
            for q, x, x2d in zip(qs, xs, x2ds):
                y, scale = self.npu.npu_dynamic_quant(x2d, dst_type=self._npu_dtype(q.fp8_dtype),
                                                      quant_mode="pertensor", dst_type_max=dst_max)
                outs.append(Float8TensorStorage(q.fp8_dtype, x.shape, x.dtype, data=y.reshape(x.shape),
                                                scale_inv=scale))
        elif xs[0].dtype == torch.float32:
            amaxes = self._amaxes(x2ds)
            amax = torch.stack(amaxes) if len(amaxes) > 1 else amaxes[0].reshape(1)
            # [amax == 0] + amax / target: addcdiv divides (value 1: exactly amax / target) and adds 1 only
            # where amax is 0 (0 / target = 0), so an all-zero tensor gets scale_inv 1, as the reference.
            zero = torch.eq(amax, 0, out=torch.empty_like(amax))
            scale_inv = torch.addcdiv(zero, amax, self._constant(q0.target_max, amax.device))
            scale_inv.clamp_(min=1.0 / FLT_MAX)
            per_tensor = [scale_inv[i : i + 1] for i in range(len(qs))]
            outs = self._npu_quantize_all(qs, xs, x2ds, per_tensor, per_tensor)
        else:
            return None
        return list(record_nonfinite_many(qs, outs))

    def _quantize_delayed(self, qs: Sequence[Float8Quantizer], xs: Sequence[torch.Tensor],
                          x2ds: Sequence[torch.Tensor]) -> list[Float8TensorStorage]:
        """The amaxes max-accumulated into the history slots, one op marking the stored scale_invs NaN where
        the data held NaN/Inf, then npu_quantize per tensor with the divisor prepared at the last per-step
        update (bfloat16 inputs: 1/scale rounded to bfloat16, see Float8Quantizer). More than two 16-bit tensors
        whose slots lie side by side (a grouped linear's experts): one multi-tensor norm, one stack and one
        maximum into the slots. Several tensors of one dtype, two of them float32: one multi-tensor norm
        (`_amaxes`) and one multi-tensor maximum. Otherwise
        one vector norm each, which writes the amax straight into a slot still fresh since the update (the
        step's first quantize into it: nothing to accumulate), and one maximum for the others.
        torch_npu's npu_quant_max (cast and amax in one launch) is not used: its y = cast(x * scale) rounds the
        format's ties otherwise than x / (1/scale) does (the reference's rule) unless 1/scale is a power of 2."""
        dtypes, slot_ids = {x.dtype for x in x2ds}, [q.slot_id for q in qs]
        slots = _side_by_side([q.amax for q in qs]) if len(set(slot_ids)) == len(qs) > 2 else None
        if slots is not None and torch.float32 not in dtypes and len(dtypes) == 1:
            # A grouped linear's experts (their slots side by side): the amaxes stacked in their own dtype, max-ed
            # into the float32 slots by one maximum, which promotes them (exact: max |x| is one of x's values).
            stacked = torch.stack(torch._foreach_norm(list(x2ds), float("inf")))
            torch.maximum(slots, stacked, out=slots)
            amaxes = list(stacked.view(-1, 1).unbind(0))
        elif len(dtypes) == 1 and (len(x2ds) > 2 or (len(x2ds) == 2 and torch.float32 in dtypes)):
            amaxes = [a.reshape(1) for a in self._amaxes(x2ds)]
            torch._foreach_maximum_([q.amax for q in qs], amaxes)
        else:
            amaxes, accumulate = [], []
            for q, x, slot_id in zip(qs, x2ds, slot_ids):
                # A slot taken twice in one call is accumulated both times: each NaN mark needs its own amax.
                slot = q.fresh_amax() if slot_ids.count(slot_id) == 1 else None
                if slot is None:
                    amaxes.append(torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32).reshape(1))
                    accumulate.append((q.amax, amaxes[-1]))
                else:
                    torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32, out=slot.view(()))
                    q.amax_written()
                    amaxes.append(slot)
            if accumulate:
                torch._foreach_maximum_(*map(list, zip(*accumulate)))
        if None not in slot_ids:  # a stateless quantizer's write (to whatever history) stays unnoted
            for q in qs:
                q.amax_written()
        divisors = [q.divisor(x.dtype) for q, x in zip(qs, xs)]
        exacts = [exact for _, exact in divisors]
        return self._npu_quantize_all(qs, xs, x2ds, [div for div, _ in divisors], _marked(exacts, amaxes))

    @staticmethod
    def _amaxes(x2ds: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """max |x| of each tensor (one dtype) as a float32 0-d tensor, NaN kept. Float32: one multi-tensor norm.
        Others (a grouped linear's experts): one multi-tensor norm in their own dtype (max |x| is one of
        their values, so exact), stacked and cast to float32 (3 launches; the NPU's multi-tensor norm to
        float32 would cast each input first, see `npu_foreach`)."""
        if x2ds[0].dtype == torch.float32:
            return torch._foreach_norm(list(x2ds), float("inf"))
        return list(torch.stack(torch._foreach_norm(list(x2ds), float("inf"))).float().unbind(0))

    def _constant(self, value: float, device: torch.device) -> torch.Tensor:
        """A float32 0-d device tensor of `value`, made once (a Python scalar in a tensor op is a launch)."""
        cache = self.__dict__.setdefault("_constants", {})
        key = (value, device)
        if key not in cache:
            cache[key] = torch.tensor(value, dtype=torch.float32, device=device)
        return cache[key]

    def _quantize_blocks(self, q: Float8BlockQuantizer, x: torch.Tensor, x2d: torch.Tensor
                         ) -> Optional[Float8BlockwiseQTensorStorage]:
        dst_max = self._dst_type_max(q.fp8_dtype, q.target_max)
        if dst_max is None or q.amax_epsilon != 0 or q.block_len != 128:
            return None
        if q.power_2_scale:
            return self._quantize_blocks_pow2(q, x, x2d)
        if x.dtype not in (*_HALF, torch.float32) or not x2d.numel():
            return None  # aclnnDynamicBlockQuantV2, x: "FLOAT16、BFLOAT16、FLOAT32", "不支持空Tensor"
        rows = 1 if q.block_scaling_dim == 1 else 128
        kwargs = dict(round_mode="round" if q.fp8_dtype is FP8Dtype.HIF8 else "rint",
                      dst_type=self._npu_dtype(q.fp8_dtype), row_block_size=rows, col_block_size=128,
                      dst_type_max=dst_max)
        out = Float8BlockwiseQTensorStorage(q.fp8_dtype, x.shape, x.dtype, block_scaling_dim=q.block_scaling_dim)
        if q.rowwise_usage or q.block_scaling_dim == 2:
            y, scale = self.npu.npu_dynamic_block_quant(x2d, **kwargs)
            out.rowwise_data, out.rowwise_scale_inv = y.reshape(x.shape), scale
        if q.columnwise_usage and q.block_scaling_dim == 1:
            out.columnwise_data, out.columnwise_scale_inv = self.npu.npu_dynamic_block_quant(x2d.t(), **kwargs)
        return out

    # Power-of-2 block scales (TE's default). npu_dynamic_block_quant has no power-of-2 option (its scale is
    # amax / dst_max), but npu_dynamic_mx_quant with scale_alg=1 computes, per block along one axis, the E8M0
    # scale 2^ceil(log2(amax / fmt_max)) -- the decode scale of TE's power-of-2 rule -- and casts x / scale
    # (aclnnDynamicMxQuantV3: "为保证量化时不溢出，对指数进行向上取整"). Its blocks may be 128 long for float16 /
    # bfloat16 ("仅支持32的倍数，不能为0，且不能超过1024"), only 32 for float32 ("当x的类型为FLOAT时，blocksize必须
    # 为32"); a 128-tile's exponent is then the largest of its 32-blocks' (ceil o log2 is monotone), and the
    # data is cast again with it. 128x128 tiles take the largest exponent of their 128 row tiles likewise.
    def _quantize_blocks_pow2(self, q: Float8BlockQuantizer, x: torch.Tensor, x2d: torch.Tensor
                              ) -> Optional[Float8BlockwiseQTensorStorage]:
        m, k = x2d.shape
        if m == 0 or k == 0:
            return None
        if q.fp8_dtype is FP8Dtype.HIF8:
            return None  # the MX kernel has no HiF8 output; quantize_many took the tiles _quantize_hif8_tiles can
        if x.dtype not in _HALF and (k % 128 or (q.columnwise_usage and m % 128)):
            return None  # float32 takes 32-blocks: whole 128-tiles only
        if q.block_scaling_dim == 2 and (m % 128 or k % 128):
            return None  # the 128x128 cast below takes whole tiles
        out = Float8BlockwiseQTensorStorage(q.fp8_dtype, x.shape, x.dtype, block_scaling_dim=q.block_scaling_dim,
                                            power_2_scale=True)
        if q.block_scaling_dim == 2:
            out.rowwise_scale_inv = e8m0_decode(self._pow2_block_codes(q, x2d, rows=128)[1])
            out.rowwise_data = self._pow2_cast(q, x2d, out.rowwise_scale_inv).reshape(x.shape)
            return out
        if q.rowwise_usage:
            y, codes = self._pow2_block_codes(q, x2d)
            out.rowwise_scale_inv = e8m0_decode(codes)  # the [1, 128, 128] GEMMs take float32 scales
            if y is None:  # float32: the kernel's codes are of 32-blocks; cast again with the 128-tile scales
                y = self._quantize_tile_rows(q, x2d, out.rowwise_scale_inv)
            out.rowwise_data = y.reshape(x.shape)
        if q.columnwise_usage and x.dtype in _HALF:
            # Along the rows as x lies, in 128-blocks: the (M, K) codes (the storage keeps their transposed view)
            # and the E8M0 bytes in the kernel's pairs, which the one GEMM that reads this form (the wgrad, in the
            # MX mode) takes so, tokens-major as its transposed x1 and its x2 are.
            y, out.columnwise_scale_pairs = self.npu.npu_dynamic_mx_quant(
                x2d, axis=-2, dst_type=self._npu_dtype(q.fp8_dtype), block_size=128, scale_alg=1)
            out.columnwise_data = y.t()
        elif q.columnwise_usage:
            self._pow2_columnwise_float32(q, x2d, out)
        return out

    def _pow2_columnwise_float32(self, q: Float8BlockQuantizer, x2d: torch.Tensor,
                                 out: Float8BlockwiseQTensorStorage) -> None:
        """The power-of-2 1x128 columnwise form of float32 x (M, K), M whole 128-tiles, its codes laid out as the
        kernel lays out 128-blocks of bfloat16 (`_quantize_blocks_pow2`): float32 takes 32-blocks only, so a tile's
        E8M0 byte is the largest of its four blocks' (one max over the kernel's pairs), kept one tile per row
        ((tiles, K, 1): no pad to whole pairs), and x is divided by the tile scales (exact: powers of 2) and
        cast."""
        m, k = x2d.shape
        _, blocks = self.npu.npu_dynamic_mx_quant(x2d, axis=-2, dst_type=self._npu_dtype(q.fp8_dtype), block_size=32,
                                                  scale_alg=1)
        tiles = blocks.view(m // 128, 2, k, 2).amax(dim=(1, 3))  # (tiles, K)
        scale_inv = e8m0_decode(tiles)
        scaled = torch.empty(m // 128, 128, k, dtype=x2d.dtype, device=x2d.device)
        torch.div(x2d.reshape(m // 128, 128, k), scale_inv.view(m // 128, 1, k), out=scaled)  # row-major (M, K)
        out.columnwise_data = scaled.to(q.fp8_dtype.storage_dtype).view(m, k).t()
        out.columnwise_scale_inv = scale_inv.t()
        out.columnwise_scale_pairs = tiles.unsqueeze(-1)

    @staticmethod
    def _hif8_tiles_apply(q: Quantizer, x2d: torch.Tensor) -> bool:
        """Whether `_quantize_hif8_tiles` takes this quantizer and tensor: HiF8 power-of-2 128-tiles without
        amax_epsilon, bfloat16 or float32 (a float16 divisor could underflow), whole tiles along k and, for
        128x128 tiles, along m (1x128 columnwise tiles may end short: an expert's tokens)."""
        if not (isinstance(q, Float8BlockQuantizer) and q.fp8_dtype is FP8Dtype.HIF8 and q.power_2_scale
                and q.amax_epsilon == 0 and q.block_len == 128 and x2d.dtype in (torch.bfloat16, torch.float32)):
            return False
        m, k = x2d.shape
        return m > 0 and k > 0 and k % 128 == 0 and not (m % 128 and q.block_scaling_dim == 2)

    def _quantize_hif8_tiles(self, qs: Sequence[Quantizer], xs: Sequence[torch.Tensor],
                             x2ds: Sequence[torch.Tensor]) -> list[Optional[Float8BlockwiseQTensorStorage]]:
        """HiF8 with power-of-2 tile scales, which no kernel makes (the MX kernels have no HiF8 output, the block
        kernel's scale is amax / dst_max). Every layout of every tensor of the pass shares the small ops: each
        layout's tile amaxes come from one vector norm written into one float32 buffer per target, whose scales
        take the reference rule in 7 ops (`_pow2_tile_scales`) and, for bfloat16 inputs, one cast of the
        divisors; then each layout is one npu_quantize (the 128x128 weight + its divisors repeated per row, a
        1x128 columnwise layout + its transposed copy). The rowwise form of row blocks of one buffer (`_row_runs`:
        a grouped linear's experts' inputs, its weights) is one layout. None for the tensors
        `_hif8_tiles_apply` refuses."""
        outs: list[Optional[Float8BlockwiseQTensorStorage]] = [None] * len(qs)
        taken = [self._hif8_tiles_apply(q, x2d) for q, x2d in zip(qs, x2ds)]
        if not any(taken):  # every other recipe's pass: no run search on the host
            return outs
        runs = [run for run in _row_runs(qs, x2ds, outs) if all(taken[i] for i in run)]
        joined = {i for run in runs for i in run}
        for i, (q, x) in enumerate(zip(qs, xs)):
            if taken[i]:
                outs[i] = Float8BlockwiseQTensorStorage(q.fp8_dtype, x.shape, x.dtype, power_2_scale=True,
                                                        block_scaling_dim=q.block_scaling_dim)
        groups: dict[float, list[_TileLayout]] = {}  # by target
        for run in runs + [[i] for i in range(len(qs)) if taken[i] and i not in joined]:
            # Row blocks of one buffer (a grouped linear's experts) share their rowwise layout: it is row-local.
            q = qs[run[0]]
            data = x2ds[run[0]] if len(run) == 1 else joined_rows([x2ds[i] for i in run])
            m, k = data.shape
            targets = [(outs[i], rows) for i, rows in _row_spans(x2ds, run)]
            layouts = groups.setdefault(q.target_max, [])
            if q.block_scaling_dim == 2:
                layouts.append(_TileLayout(targets, q, "tiles", data, data.reshape(m // 128, 128, k // 128, 128),
                                           (1, 3)))
                continue
            if q.rowwise_usage:
                layouts.append(_TileLayout(targets, q, "rowwise", data, data.reshape(m, k // 128, 128), -1))
            if q.columnwise_usage:
                for i in run:  # 1x128 columnwise tiles start at each block's first row
                    rows, x2dt = x2ds[i].shape[0], x2ds[i].t()
                    # The transposed copy, its rows zero-padded to whole tiles (one op either way): a cut-short
                    # tile's amax and codes are those of its own values.
                    t = torch.nn.functional.pad(x2dt, (0, -rows % 128)) if rows % 128 else x2dt.contiguous()
                    layouts.append(_TileLayout([(outs[i], slice(0, rows))], q, "columnwise", t,
                                               t.reshape(k, t.shape[1] // 128, 128), -1))
        for target, layouts in groups.items():
            bounds = [0]
            for layout in layouts:
                bounds.append(bounds[-1] + layout.scales_shape.numel())
            amax = torch.empty(bounds[-1], dtype=torch.float32, device=layouts[0].data.device)
            for layout, start, stop in zip(layouts, bounds, bounds[1:]):
                torch.linalg.vector_norm(layout.tiles, float("inf"), dim=layout.dims, dtype=torch.float32,
                                         out=amax[start:stop].view(layout.scales_shape))
            divisor, stored = self._pow2_tile_scales(target, amax)
            divisors = {torch.float32: divisor}
            if any(layout.data.dtype == torch.bfloat16 for layout in layouts):
                divisors[torch.bfloat16] = divisor.to(torch.bfloat16)  # exact: powers of 2 in bfloat16's range
            for layout, start, stop in zip(layouts, bounds, bounds[1:]):
                div = divisors[layout.data.dtype][start:stop].view(layout.scales_shape)
                scale_inv = stored[start:stop].view(layout.scales_shape)
                if layout.kind == "tiles":
                    div = div.repeat_interleave(128, dim=0)
                codes = self._quantize_tile_rows(layout.quantizer, layout.data, div)
                tile = 128 if layout.kind == "tiles" else 1
                for out, rows in layout.targets:
                    if layout.kind == "columnwise":
                        out.columnwise_scale_inv = scale_inv
                        out.columnwise_data = codes if codes.shape[1] == rows.stop else codes[:, rows].contiguous()
                    else:
                        out.rowwise_data = codes[rows].reshape(out.shape)
                        out.rowwise_scale_inv = scale_inv[rows.start // tile : rows.stop // tile]
        return outs

    def _pow2_tile_scales(self, target: float, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(divisor, stored scale_inv) of power-of-2 tiles from their amaxes, the reference rule
        (scaling.current_scale_inv with power_2_scale, then mark_nonfinite) in 7 ops: tiles whose amax is NaN,
        Inf or 0 take amax = target (nan_to_num, threshold), so their scale is target / target = 1; scale =
        target / amax (one IEEE division, at most FLT_MAX) rounded down to a power of 2 (its exponent bits),
        divisor 1 / scale (exact); the stored copy is NaN for NaN/Inf."""
        finite = torch.nan_to_num(amax, nan=target, posinf=target)
        finite = torch.threshold_(finite, 0.0, target)  # amax <= 0 (an all-zero tile) -> target
        scale = torch.div(self._constant(target, amax.device), finite).clamp_(max=FLT_MAX)
        divisor = torch.bitwise_and(scale.view(torch.int32), 0x7F800000).view(torch.float32).reciprocal_()
        return divisor, mark_nonfinite(divisor, amax)

    def _quantize_tile_rows(self, q: Float8BlockQuantizer, t: torch.Tensor, divisor: torch.Tensor) -> torch.Tensor:
        """t / divisor per 1x128 tile, cast: one npu_quantize along axis 0 of the (rows * k / 128, 128) view,
        each tile a row and its divisor (rows, k / 128) that row's scale ("如果x的dtype不是FLOAT32，scales的
        dtype需要和x的dtype一致": a bfloat16 input takes its powers of two in bfloat16, exactly)."""
        y = self.npu.npu_quantize(t.reshape(-1, 128), divisor.reshape(-1).to(t.dtype), None,
                                  self._npu_dtype(q.fp8_dtype), 0, True)
        return y.view(torch.uint8).reshape(t.shape) if q.fp8_dtype is FP8Dtype.HIF8 else y.reshape(t.shape)

    def _pow2_block_codes(self, q: Float8BlockQuantizer, t: torch.Tensor, rows: int = 1
                          ) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        """(codes cast with the tile scales or None, E8M0 exponent bytes (m / rows, ceil(k / 128))) of
        rows x 128 tiles of a 2-D tensor: the kernel's blocks along the last dim (128 long for float16/bfloat16,
        32 for float32), whose exponents one max folds into a tile's (over its rows and its 32-blocks at once);
        the kernel's codes are the tiles' only for 1x128 tiles of 128-blocks."""
        m, k = t.shape
        block = 128 if t.dtype in _HALF else 32
        y, pairs = self.npu.npu_dynamic_mx_quant(t, axis=-1, dst_type=self._npu_dtype(q.fp8_dtype),
                                                 block_size=block, scale_alg=1)
        codes = pairs.reshape(m, -1)[:, : -(-k // block)]
        if rows == 1 and block == 128:
            return y, codes
        return None, codes.reshape(m // rows, rows, k // 128, 128 // block).amax(dim=(1, 3))

    @staticmethod
    def _pow2_cast(q: Float8BlockQuantizer, t: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
        """t / scale_inv per 128x128 tile, cast to the format: exact (a power-of-2 division), and within the
        format's range by the round-up rule, so the plain cast needs no clamp. k and m are whole tiles. The
        quotient is written row-major whatever t's layout."""
        m, k = t.shape
        tiles = t.reshape(m // 128, 128, k // 128, 128)
        scaled = torch.empty(tiles.shape, dtype=t.dtype, device=t.device)
        torch.div(tiles, scale_inv.reshape(m // 128, 1, k // 128, 1), out=scaled)
        return scaled.to(q.fp8_dtype.storage_dtype).reshape(m, k)

    def _quantize_mx(self, q: MXFP8Quantizer, x: torch.Tensor, x2d: torch.Tensor) -> Optional[MXFP8TensorStorage]:
        if q.block_len != 32 or x2d.shape[1] % 32:
            return None  # the quantizer raises its own error about the shape
        if q.columnwise_usage and x2d.dtype not in _HALF and x2d.shape[0] < 32:
            return None  # aclnnDynamicMxQuant: "x的类型为FLOAT时，仅支持blocksize=32，且量化轴的维度不能小于32。"
        if not x2d.numel():
            return None  # no tokens: nothing for a kernel to read (the quantizer's ops make the empty forms)
        out = MXFP8TensorStorage(q.fp8_dtype, x.shape, x.dtype)
        kwargs = dict(dst_type=self._npu_dtype(q.fp8_dtype), scale_alg=1 if q.rounding == "ceil" else 0)

        # The columnwise form is quantized along the rows of x, in x's (M, K) layout, its scales (ceil(M/64), K, 2)
        # with block pairs interleaved ("当axis为非尾轴时，mxscaleOut输出需要对每两行数据进行交织处理"); the storage
        # keeps it as the (K, M) transposed view and the scales in the kernel's layout, which the GEMM takes (their
        # (K, M/32) form is made on demand). x is read as it lies, never through a transposed view.
        m, k = x2d.shape
        if q.rowwise_usage and q.columnwise_usage and self._dual_axis_mx(x2d):
            # Both layouts from one read of x.
            y1, s1, y2, s2 = self.npu.npu_dynamic_mx_quant_with_dual_axis(x2d, **kwargs)
            out.rowwise_data, out.rowwise_scale_inv = y1.reshape(x.shape), s1.reshape(m, -1)[:, : k // 32]
            out.columnwise_data, out.columnwise_scale_pairs = y2.t(), s2
            return out
        if q.rowwise_usage:
            y, pairs = self.npu.npu_dynamic_mx_quant(x2d, axis=-1, **kwargs)
            out.rowwise_data, out.rowwise_scale_inv = y.reshape(x.shape), pairs.reshape(m, -1)[:, : k // 32]
        if q.columnwise_usage:
            y2, out.columnwise_scale_pairs = self.npu.npu_dynamic_mx_quant(x2d, axis=-2, **kwargs)
            out.columnwise_data = y2.t()
        return out

    def _dual_axis_mx(self, x2d: torch.Tensor) -> bool:
        """Whether npu_dynamic_mx_quant_with_dual_axis can make both MX layouts: torch_npu has it, the kernel's
        document lists the chip ("Ascend 950PR/Ascend 950DT：支持", aclnnDynamicMxQuantWithDualAxis; the FP8
        chips) and its input is float16/bfloat16 only."""
        return (self.supports_fp8 and hasattr(self.npu, "npu_dynamic_mx_quant_with_dual_axis")
                and x2d.dtype in _HALF)


def _marked(scale_invs: list[torch.Tensor], amaxes: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each scale_inv + 0 * its amax (NaN where the amax is NaN/Inf, see `mark_nonfinite`): one add of the two
    vectors where each list lies in order in one buffer (a grouped linear's experts: their state slots side by
    side, their amaxes stacked), whose result's elements are then one vector too (the grouped GEMM reads the
    experts' scales as it), else one multi-tensor add."""
    if len(scale_invs) > 1:
        exact, amax = _side_by_side(scale_invs), _side_by_side(amaxes)
        if exact is not None and amax is not None and torch.promote_types(exact.dtype, amax.dtype) == exact.dtype:
            return list(torch.add(exact, amax, alpha=0.0).view(-1, 1).unbind(0))
    return torch._foreach_add(scale_invs, amaxes, alpha=0.0)


def _side_by_side(values: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """One-element tensors as the 1-D view of the buffer they lie in, in order (a grouped linear's experts' state
    slots, or their stacked amaxes), or None."""
    joined = joined_rows([t.reshape(1, 1) for t in values])
    return None if joined is None else joined.view(-1)


# Quantize dispatch of the block-scaled quantizers (per-tensor ones go through quantize_many's batched forms):
# the quantizer's type -> the NpuQuantize method that runs it on a kernel (None from the method, or a type not
# listed, means the quantizer's own torch-op path).
_QUANTIZE_KERNELS = {
    Float8BlockQuantizer: NpuQuantize._quantize_blocks,
    MXFP8Quantizer: NpuQuantize._quantize_mx,
    MXFP4Quantizer: NpuFP4._quantize_mxfp4,
}
