"""NPU backend: the torch_npu 2.14 quantization and GEMM kernels, called as their schemas define them.

torch_npu is imported here and only here, lazily: importing it needs the CANN libraries. Without an NPU,
`MINDSPEED_TE_NPU_SIMULATOR=1` puts the simulator (mindspeed_te.testing.npu_sim) in its place, which enforces the
kernels' contract on CPU tensors and computes their reference results.

What goes to a kernel and what stays on torch ops (which run on the NPU too):
  delayed      npu_quantize(x, 1/scale, div_mode=True)     1/scale prepared at the update (bfloat16-rounded for
                                                            bfloat16 x); one multi-tensor amax, history max and
                                                            NaN mark for a linear's input and weight together
  tensorwise   npu_dynamic_quant(pertensor, dst_type_max)   bfloat16/float16 x; float32 x (not a dtype that
               or amax + 2 small ops + npu_quantize         kernel takes): see _quantize_current. Power-of-2
                                                            scales, amax_epsilon, an amax reduction group or a
                                                            non-kernel target use torch ops
  blockwise    power-of-2 scales (TE's default): npu_dynamic_mx_quant(scale_alg=1) (E4M3/E5M2; partial
               float32 / 128x128 tiles use torch ops; float32 1x128 rows cast by one npu_quantize); columnwise
               1x128 scales kept as the kernel's E8M0 bytes for the wgrad GEMM; HiF8 (whole tiles, bf16/fp32):
               tile amaxes of all the pass's layouts into one buffer, its scales in one chain of torch ops, the
               cast one npu_quantize per layout; other scales (HiF8's default): npu_dynamic_block_quant
               (fp16/bf16/fp32, not with amax_epsilon; HiF8 dst_type_max 15, 56, 224, 32768)
  mxfp8        npu_dynamic_mx_quant(scale_alg 1=ceil, 0=floor); both layouts of a bf16/fp16 tensor on the
               Ascend 950DT: one npu_dynamic_mx_quant_with_dual_axis (its columnwise scales kept as it lays
               them out, which the GEMM takes)
  flags        a quantize pass only notes its non-finite flag updates (quantizers.record_nonfinite_many); the
               state manager folds the whole step's once (FP8GlobalStateManager.fold_nonfinite)
  GEMMs        npu_quant_matmul (per-tensor, [1,128,128] blockwise, [1,1,32] MX, and the 1x128 x 1x128
               blockwise wgrad in the MX mode when its scales are powers of 2; a k past the kernel's 65535,
               a wgrad over more tokens, summed over parts); shapes the kernels cannot
               take (high-precision operands, other 1x128 x 1x128) use
               dequantize + matmul (HiF8 tiles decoded by one npu_dtype_cast, scaled by one broadcast
               multiply). The power-of-2 fprop and dgrad stay in [1,128,128] (an MX-mode fprop
               measured 2 more forward launches for bf16, 1 for float32): MX wants each operand's bytes
               repeated per 32-block (one op each), a float32 bias (one cast of a bf16 bias, as the late add
               is one op), and the float32 scales are made anyway (the non-finite flags read them, the dgrad
               takes the weight's).
  MoE, RoPE    npu_moe_token_permute / npu_moe_token_unpermute (dropless routing, bfloat16) and npu_rotary_mul, each
               with torch_npu's one backward kernel: kernels/npu_moe_rope.py
"""
from __future__ import annotations

import copy
import functools
import math
import os
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence, Union

import torch

from mindspeed_te import fused_cast
from mindspeed_te.distributed import group_size
from mindspeed_te.formats import FP8Dtype
from mindspeed_te.kernels import SIMULATOR_ENV
from mindspeed_te.kernels.base import Capabilities, Operand
from mindspeed_te.kernels.masks import CausalMask, PackedMask, host_ends, host_lengths, kept_per_tensors
from mindspeed_te.kernels.npu_moe_rope import MoeRopeKernels
from mindspeed_te.kernels.reference import ReferenceBackend, check_accumulate
from mindspeed_te.quantizers import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
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
    _TiledTensor,
    joined_rows,
    rows_follow,
)

_HIF8_DST_MAX = (15.0, 56.0, 224.0, 32768.0)
_HALF = (torch.float16, torch.bfloat16)


def load_torch_npu() -> Any:
    """torch_npu, or the simulator when MINDSPEED_TE_NPU_SIMULATOR is 1 (an Ascend 950PR) or a chip name
    starting with "Ascend" (that chip, e.g. Ascend950DT)."""
    simulator = os.environ.get(SIMULATOR_ENV, "0")
    if simulator == "1" or simulator.startswith("Ascend"):
        from mindspeed_te.testing.npu_sim import make_simulator

        return make_simulator() if simulator == "1" else make_simulator(simulator)
    try:
        import torch_npu  # noqa: F401  (the one place the real module is imported)
    except ImportError as err:
        raise RuntimeError(
            f"MINDSPEED_TE_BACKEND=npu needs torch_npu (pip install 'mindspeed_te[npu]', with the CANN "
            f"libraries), or {SIMULATOR_ENV}=1 to run the NPU path on the torch_npu simulator: {err}"
        ) from err
    return torch_npu


@functools.lru_cache(maxsize=2)
def _npu_backend(simulator: str) -> NpuBackend:
    return NpuBackend(load_torch_npu())


def get_npu_backend() -> NpuBackend:
    """The NPU backend, one per value of MINDSPEED_TE_NPU_SIMULATOR (the real torch_npu or a simulated chip)."""
    return _npu_backend(os.environ.get(SIMULATOR_ENV, "0"))


get_npu_backend.cache_clear = _npu_backend.cache_clear  # type: ignore[attr-defined]


def _tiled_pair(t: _TiledTensor, columnwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(data (rows, k), scale_inv) of the requested form of a tiled tensor."""
    if columnwise:
        return t.columnwise_pair()
    t._require(False)
    return t.rowwise_data.reshape(-1, t.shape[-1]), t.rowwise_scale_inv


def _tiled_data(t: _TiledTensor, columnwise: bool) -> torch.Tensor:
    """The (rows, k) data of the requested form of a tiled tensor, its scales left unread."""
    t._require(columnwise)
    return t.columnwise_data if columnwise else t.rowwise_data.reshape(-1, t.shape[-1])


@functools.lru_cache(maxsize=64)
def _tile_of_block(blocks: int, device: torch.device) -> torch.Tensor:
    """The 128-tile of each of `blocks` 32-blocks (j // 4), a device index made once per width: one
    index_select then repeats a tile's E8M0 byte for its 32-blocks, contiguous, whatever the last tile holds."""
    return torch.arange(blocks, device=device) // 4


# torch_npu, npu_quant_matmul 约束说明: "其他情况, x1与x2最后一维的shape大小不能超过65535"; a longer k is summed in
# parts of whole 128-tiles (and E8M0 pairs of 32-blocks).
_MAX_LAST_DIM = 65535
# npu_fusion_attention: pre_tockens / next_tockens "默认值为2147483647" (no band limit on that side).
_ALL_TOKENS = 2147483647
_K_PART = 511 * 128


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


def _narrowed(t: torch.Tensor, dim: int, start: int, stop: int) -> torch.Tensor:
    """t[start:stop] along `dim` in a layout npu_quant_matmul takes, the one t had: contiguous, or the transposed
    view (of the last two dims of a matrix, the first two of E8M0 pairs) of a contiguous tensor; a copy unless
    the part is one already (narrowing along k mostly breaks it)."""
    part = t.narrow(dim, start, stop - start)
    if t.is_contiguous():
        return part.contiguous()
    dims = (-2, -1) if t.dim() == 2 else (0, 1)
    return part.transpose(*dims).contiguous().transpose(*dims)


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


def _per_row(values: Sequence[torch.Tensor], rows: Sequence[int]) -> torch.Tensor:
    """Each group's one-element value repeated over its rows, as one 1-D tensor (one concatenation)."""
    return torch.cat([v.reshape(1).expand(m) for v, m in zip(values, rows)])


def _rows_of(blocks: list[torch.Tensor]) -> torch.Tensor:
    """The groups' row blocks (rows, ...) as one tensor along dim 0: a view when they lie in order in one buffer
    (codes that one npu_quantize made for all experts, and their scales), else their concatenation."""
    if all(t.is_contiguous() for t in blocks):
        joined = joined_rows([t.reshape(t.shape[0], math.prod(t.shape[1:])) for t in blocks])
        if joined is not None:
            return joined.view(-1, *blocks[0].shape[1:])
    return torch.cat(blocks)


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


def _mx_pair(t: MXFP8TensorStorage, columnwise: bool, as_x2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(data (rows, k), E8M0 scales in the layout npu_quant_matmul wants) of an MXFP8 operand form: pairs of
    32-block bytes along k, as x1 (rows, ceil(k/64), 2); as x2, which the GEMM takes transposed,
    (ceil(k/64), rows, 2). An odd number of blocks (k an odd multiple of 32: a grouped linear's expert or a
    micro-batch of 32 * odd tokens in the wgrad) pads its last pair with a 0 byte, as the quantize kernels pad
    theirs (aclnnDynamicMxQuant mxscaleOut: "并对其进行偶数pad，pad填充值为0"). A columnwise form the kernels
    made (`_quantize_mx`: along the rows) is a transposed view whose scales are already the kernel's
    (ceil(M/64), K, 2) pairs: the layout the GEMM wants for that view as x2 (its (M, K) self, contiguous),
    permuted as x1."""
    pairs = t.columnwise_scale_pairs if columnwise else None
    if pairs is not None:
        t._require(True)
        return t.columnwise_data, pairs if as_x2 else pairs.permute(1, 0, 2)
    data, scale_inv = _tiled_pair(t, columnwise)
    if scale_inv.shape[1] % 2:
        scale_inv = torch.nn.functional.pad(scale_inv, (0, 1))
    pairs = scale_inv.reshape(scale_inv.shape[0], scale_inv.shape[1] // 2, 2)
    return data, pairs.transpose(0, 1) if as_x2 else pairs


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


class NpuBackend(MoeRopeKernels, ReferenceBackend):
    """Dispatches quantize, GEMM, norm, attention, MoE permutation and RoPE to torch_npu kernels where they apply;
    everything else is the reference emulation."""

    name = "npu"
    # aclnnAllGatherMatmulV2 / aclnnMatmulReduceScatterV2 (Ascend 950): "k轴取值范围为[256, 65535)"; the bindings of
    # the base (high-precision) kernels: "world_size should be in [2, 4, 8, 16, 32]" (the quant ones add 64)
    capabilities = Capabilities(fused_communication_gemm=True, fused_communication_k_range=(256, 65535),
                                fused_communication_world_sizes=(2, 4, 8, 16, 32), native_mx_gemm=True)
    bf16_output_gemm = False  # the dequantize fallback runs as the device would run it

    def __init__(self, torch_npu: Any) -> None:
        super().__init__()
        self.npu = torch_npu
        device_name = torch_npu.npu.get_device_name()
        self.device_name = device_name
        self.supports_fp8 = str(device_name).startswith("Ascend950")
        if getattr(torch_npu, "is_simulator", False):  # its cube sums as the reference backend's GEMM does
            torch_npu.set_bf16_matmul(fused_cast.gemm_bf16)

    def available(self) -> tuple[bool, str]:
        """FP8, HiF8 and MX kernels exist on the Ascend 950 series only."""
        if self.supports_fp8:
            return True, ""
        return False, (f"the NPU is {self.device_name}; FP8/HiF8/MXFP8 matmuls need an Ascend 950 series chip "
                       "(A2/A3 chips have int8/int4 quantized matmuls only)")

    # Fused communication GEMMs (--use-ascend-mc2) -------------------------------------------------------------
    # High precision runs on the base kernels, with the 950's only communication mode (aclnnAllGatherMatmulV2 /
    # aclnnMatmulReduceScatterV2, Ascend 950, commMode: "当前版本仅支持输入“ccu”"). MXFP8 runs on the quant
    # kernels: the base kernels' bindings pass groupSize 0, and E8M0 scales need [1, 1, 32] ("当x1Scale/x2Scale
    # 输入都是3维，且数据类型都为FLOAT8_E8M0时，[groupSizeM, groupSizeN, groupSizeK]取值组合仅支持[1, 1, 32]").
    def all_gather_matmul(self, x1, x2, group):
        return self.npu.npu_all_gather_base_mm(x1, x2, self.hcom(group), group_size(group), comm_mode="ccu")

    def matmul_reduce_scatter(self, x1, x2, group):
        return self.npu.npu_mm_reduce_scatter_base(x1, x2, self.hcom(group), group_size(group), comm_mode="ccu")

    def all_gather_matmul_mx(self, a, b, group, *, b_columnwise, out_dtype):
        x1, x2, kwargs = self._mc2_mx_args(a, b, b_columnwise)
        return self.npu.npu_all_gather_quant_mm(x1, x2, self.hcom(group), group_size(group), gather_output=False,
                                                y_dtype=out_dtype, **kwargs)[0]

    def matmul_reduce_scatter_mx(self, a, b, group, *, b_columnwise, out_dtype):
        x1, x2, kwargs = self._mc2_mx_args(a, b, b_columnwise)
        return self.npu.npu_quant_mm_reduce_scatter(x1, x2, self.hcom(group), group_size(group), y_dtype=out_dtype,
                                                    **kwargs)[0]

    def _mc2_mx_args(self, a: MXFP8TensorStorage, b: MXFP8TensorStorage, b_columnwise: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(x1, x2, scale arguments) of a quant mc2 kernel for a · bᵀ. The kernels take x2 and its scales only as
        transposed views (aclnnMatmulReduceScatterV2, Ascend 950: "mx量化场景下，x2/x2Scale仅支持转置输入"; the
        mx case of aclnnAllGatherMatmulV2: "x1不转置，x2转置，x1Scale不转置， x2Scale转置"); the columnwise form the
        quantize kernels make (along the rows, `_quantize_mx`) lies the other way, so its data and scales are
        copied."""
        (x1, s1), (b2d, s2) = _mx_pair(a, False, as_x2=False), _mx_pair(b, b_columnwise, as_x2=True)
        x2 = b2d.t()
        if x2.is_contiguous():
            x2, s2 = b2d.contiguous().t(), s2.transpose(0, 1).contiguous().transpose(0, 1)
        e8m0 = self.npu.float8_e8m0fnu
        return x1, x2, dict(x1_scale=s1, x2_scale=s2, x1_scale_dtype=e8m0, x2_scale_dtype=e8m0,
                            group_sizes=[1, 1, 32])

    def matmul_all_reduce(self, x1, x2, group):
        return self.npu.npu_mm_all_reduce_base(x1, x2, self.hcom(group))

    def hcom(self, group: Any) -> str:
        """The HCCL communicator name of a process group, which the fused matmul+communication kernels take."""
        if hasattr(self.npu, "hcom_of"):  # the simulator
            return self.npu.hcom_of(group)
        rank = torch.distributed.get_rank(group)
        return group._get_backend(torch.device("npu")).get_hccl_comm_name(rank)

    # Quantize ------------------------------------------------------------------------------------------------
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
        On the 950DT the dual-axis kernel makes both MX forms of each part in one call."""
        for run in _row_runs(qs, x2ds, outs):
            q = qs[run[0]]
            joined = joined_rows([x2ds[i] for i in run])
            mx_columnwise = isinstance(q, MXFP8Quantizer) and q.columnwise_usage
            if joined is None or not (q.rowwise_usage or mx_columnwise):
                continue
            kernel = _QUANTIZE_KERNELS[type(q)]
            parts = [(part, joined_rows([x2ds[i] for i in part])) for part in _pair_parts(x2ds, run)
                     ] if mx_columnwise else []
            if parts and self._dual_axis_mx(joined):  # each part's forms in one call (dual-axis when both)
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
        update (bfloat16 inputs: 1/scale rounded to bfloat16, see Float8Quantizer). Several tensors of one
        dtype, two of them float32: one multi-tensor norm (`_amaxes`) and one multi-tensor maximum. Otherwise
        one vector norm each, which writes the amax straight into a slot still fresh since the update (the
        step's first quantize into it: nothing to accumulate), and one maximum for the others."""
        dtypes, slot_ids = {x.dtype for x in x2ds}, [q.slot_id for q in qs]
        if len(dtypes) == 1 and (len(x2ds) > 2 or (len(x2ds) == 2 and torch.float32 in dtypes)):
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
        scale_invs = torch._foreach_add([exact for _, exact in divisors], amaxes, alpha=0.0)
        return self._npu_quantize_all(qs, xs, x2ds, [div for div, _ in divisors], scale_invs)

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
            out.rowwise_data = self._pow2_cast(q, x2d, out.rowwise_scale_inv, 128).reshape(x.shape)
            return out
        if q.rowwise_usage:
            y, codes = self._pow2_block_codes(q, x2d)
            out.rowwise_scale_inv = e8m0_decode(codes)  # the [1, 128, 128] GEMMs take float32 scales
            if y is None:  # float32: the kernel's codes are of 32-blocks; cast again with the 128-tile scales
                y = self._quantize_tile_rows(q, x2d, out.rowwise_scale_inv)
            out.rowwise_data = y.reshape(x.shape)
        if q.columnwise_usage:
            # Kept as E8M0 bytes: the one GEMM that reads this form (wgrad, in the MX mode) takes them so.
            y, out.columnwise_scale_e8m0 = self._pow2_block_codes(q, x2d.t())
            if y is None:
                out.columnwise_scale_inv = e8m0_decode(out.columnwise_scale_e8m0)
                y = self._pow2_cast(q, x2d.t(), out.columnwise_scale_inv, 1)
            out.columnwise_data = y
        return out

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
    def _pow2_cast(q: Float8BlockQuantizer, t: torch.Tensor, scale_inv: torch.Tensor, rows: int) -> torch.Tensor:
        """t / scale_inv per rows x 128 tile, cast to the format: exact (a power-of-2 division), and within the
        format's range by the round-up rule, so the plain cast needs no clamp. k and m are whole tiles. The
        quotient is written row-major whatever t's layout (a transposed view gives the columnwise codes)."""
        m, k = t.shape
        tiles = t.reshape(m // rows, rows, k // 128, 128)
        scaled = torch.empty(tiles.shape, dtype=t.dtype, device=t.device)
        torch.div(tiles, scale_inv.reshape(m // rows, 1, k // 128, 1), out=scaled)
        return scaled.to(q.fp8_dtype.storage_dtype).reshape(m, k)

    def _quantize_mx(self, q: MXFP8Quantizer, x: torch.Tensor, x2d: torch.Tensor) -> Optional[MXFP8TensorStorage]:
        if q.block_len != 32 or x2d.shape[0] % 32 or x2d.shape[1] % 32:
            return None  # the quantizer raises its own error about the shape
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
        """Whether npu_dynamic_mx_quant_with_dual_axis can make both MX layouts: torch_npu's document says
        "该接口仅在Ascend 950DT上支持" and its input is float16/bfloat16 only (aclnnDynamicMxQuantWithDualAxis)."""
        return str(self.device_name).startswith("Ascend950DT") and x2d.dtype in _HALF

    def layer_norm(self, x: torch.Tensor, gamma: torch.Tensor, beta: Optional[torch.Tensor], eps: float
                   ) -> torch.Tensor:
        """torch_npu's LayerNorm kernel on x, gamma and beta as they are (gamma and beta of x's dtype, or float32
        as zero-centered gamma makes them): op-plugin's native_layer_norm (LayerNormKernelNpuOpApi.cpp,
        aclnnLayerNorm) keeps mean and rstd in float32 whatever x's dtype ("acc_type ... at::kFloat") and returns
        x's dtype, which is TE's float32 math without casting x, y and the parameters (4 casts each way) or
        keeping a float32 copy of x for the backward. On NPU tensors torch's layer_norm dispatches to it; the
        simulator models it as `aten_native_layer_norm`. float64 stays on the reference."""
        if x.dtype not in (*_HALF, torch.float32) or gamma.dtype not in (x.dtype, torch.float32) or x.dim() < 2:
            return super().layer_norm(x, gamma, beta, eps)
        if beta is not None and beta.dtype != gamma.dtype:
            beta = beta.to(gamma.dtype)  # beside a float32 zero-centered gamma
        kernel = getattr(self.npu, "aten_native_layer_norm", torch.nn.functional.layer_norm)
        return kernel(x, gamma.shape, gamma, beta, eps)

    def rms_norm(self, x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
        """The fused npu_rms_norm; float64 stays on torch ops. gamma goes in float32 or x's dtype, the pairs
        aclnnRmsNorm takes (x FLOAT16/BFLOAT16 with gamma of its dtype or FLOAT32, x FLOAT32 with FLOAT32): a
        float32 gamma (the zero-centred one, whose small deviations from 1 bfloat16 would round away) as it is."""
        if x.dtype == torch.float64 or x.dim() < 2:
            return super().rms_norm(x, gamma, eps)
        return self.npu.npu_rms_norm(x, gamma if gamma.dtype in (x.dtype, torch.float32) else gamma.float(), eps)[0]

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

    # GEMM ----------------------------------------------------------------------------------------------------
    def _hif8_kwargs(self, fp8_dtype: FP8Dtype, names: tuple[str, str]) -> dict:
        return {name: self.npu.hifloat8 for name in names} if fp8_dtype is FP8Dtype.HIF8 else {}

    def gemm_bias(self, bias: torch.Tensor, weight: Operand) -> torch.Tensor:
        """float32, the quantized GEMMs' only bias dtype (aclnnQuantMatmulV5's FP8/HiF8/MX tables; the same sum
        in the reference fallback), except with a blockwise weight, whose GEMM adds the bias afterwards."""
        return bias if isinstance(weight, Float8BlockwiseQTensorStorage) else bias.float()

    def gemm_operand(self, t: Operand, columnwise: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A HiF8 tiled operand of the dequantize + matmul fallback (the 1x128 x 1x128 blockwise wgrad: no
        npu_quant_matmul mode takes 1x128 tiles on x2, and the MX mode has no HiF8 row) decoded by one
        npu_dtype_cast from torch_npu.hifloat8 and multiplied by its tile scales; other operands as the
        reference."""
        if isinstance(t, Float8BlockwiseQTensorStorage) and t.fp8_dtype is FP8Dtype.HIF8:
            data, scale_inv = _tiled_pair(t, columnwise)
            values = t.scale_tiles(self.npu.npu_dtype_cast(data, torch.float32, input_dtype=self.npu.hifloat8),
                                   scale_inv)
            return values if dtype == torch.float32 else values.to(dtype)
        return super().gemm_operand(t, columnwise, dtype)

    def gemm(self, a: Operand, b: Operand, *, a_columnwise: bool = False, b_columnwise: bool = False,
             out_dtype: torch.dtype = torch.float32, bias: Optional[torch.Tensor] = None,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
        check_accumulate(out, bias)
        args = self._quant_matmul_args(a, b, a_columnwise, b_columnwise)
        if args is None:
            return super().gemm(a, b, a_columnwise=a_columnwise, b_columnwise=b_columnwise, out_dtype=out_dtype,
                                bias=bias, out=out)
        x1, x2, kwargs = args
        if x1.shape[-1] == 0:
            # aclnnQuantMatmulV5 takes empty operands only in m or n ("当输入参数x1为m=0的空tensor或x2为n=0的空tensor
            # 时，输出为空tensor"): a sum over nothing (the wgrad of a rank without tokens) is the reference's zeros.
            return super().gemm(a, b, a_columnwise=a_columnwise, b_columnwise=b_columnwise, out_dtype=out_dtype,
                                bias=bias, out=out)
        if x2.shape[-1] > _MAX_LAST_DIM:  # n past the kernel's limit: no FP8 layer is that wide per rank
            return super().gemm(a, b, a_columnwise=a_columnwise, b_columnwise=b_columnwise, out_dtype=out_dtype,
                                bias=bias, out=out)
        if x1.shape[-1] > _MAX_LAST_DIM:
            return self._gemm_over_k_parts(x1, x2, kwargs, out_dtype, bias, out)
        # aclnnQuantMatmulV5 (Ascend 950, "G-B && B-B && mx 量化模式"): "仅mx量化模式下包含bias" -- of the block
        # modes only mx takes a bias, so blockwise adds it after a float32 product (one rounding, as the
        # reference does). The MX mode's bias is float32 only ("MX全量化 ... bias null/FLOAT32").
        late_bias = bias is not None and kwargs.get("group_sizes") == [1, 128, 128]
        mm_dtype = torch.float32 if out is not None or late_bias else out_dtype
        result = self.npu.npu_quant_matmul(x1, x2, kwargs.pop("scale"), output_dtype=mm_dtype,
                                           bias=None if bias is None or late_bias else bias.float(),
                                           **kwargs)
        if late_bias:  # one add into the output dtype: float32 sum, rounded once
            return torch.add(result, bias, out=torch.empty_like(result, dtype=out_dtype))
        return out.add_(result) if out is not None else result

    def _gemm_over_k_parts(self, x1: torch.Tensor, x2: torch.Tensor, kwargs: dict, out_dtype: torch.dtype,
                           bias: Optional[torch.Tensor], out: Optional[torch.Tensor]) -> torch.Tensor:
        """A GEMM whose k passes the kernel's limit (a wgrad over more tokens than that), as float32 products
        of k-parts of whole 128-tiles and E8M0 pairs, summed, then the bias and the output dtype: float32 sums of
        the same products in another order than one GEMM's (and the reference's), so an output can differ from
        theirs by the rounding of those sums, relative to the size of its terms (many ulps where they cancel)."""
        k = x1.shape[-1]
        groups = kwargs.get("group_sizes")
        block = {None: 0, (1, 1, 32): 64, (1, 128, 128): 128}[None if groups is None else tuple(groups)]
        total: Optional[torch.Tensor] = None
        for lo in range(0, k, _K_PART):
            hi = min(k, lo + _K_PART)
            part = dict(kwargs)
            if block:  # the scales' k dim: x1's (m, k / block, ...) and x2's (k / block, n, ...)
                first, last = lo // block, -(-hi // block)
                part["pertoken_scale"] = _narrowed(kwargs["pertoken_scale"], 1, first, last)
                part["scale"] = _narrowed(kwargs["scale"], 0, first, last)
            y = self.npu.npu_quant_matmul(_narrowed(x1, x1.dim() - 1, lo, hi), _narrowed(x2, x2.dim() - 2, lo, hi),
                                          part.pop("scale"), output_dtype=torch.float32, **part)
            total = y if total is None else total.add_(y)
        if out is not None:
            return out.add_(total)
        if bias is not None:
            total.add_(bias)
        return total if out_dtype == torch.float32 else total.to(out_dtype)

    def grouped_gemm(self, a, b, *, a_columnwise=False, b_columnwise=False, out_dtype=torch.float32, out=None):
        """Per-tensor FP8/HiF8 groups go to one npu_grouped_matmul: the M-split form for fprop/dgrad (rows of
        all groups concatenated, weights stacked), the K-split form for wgrad (the token dim split). MXFP8 and
        blockwise (1x128 by 128x128 tiles) fprop/dgrad take its M-split MX and G-B modes
        (`_grouped_block_gemm`). Other operands take one GEMM per group."""
        if not a_columnwise:
            y = self._grouped_block_gemm(a, b, b_columnwise, torch.float32 if out is not None else out_dtype)
            if y is not None:
                results = list(torch.split(y, [math.prod(t.shape[:-1]) for t in a]))
                return [o.add_(r) for o, r in zip(out, results)] if out is not None else results
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
            sizes = [r.shape[0] for r in rows]
            per_token = _per_row([t.scale_inv for t in a], sizes)
            (y,) = self.npu.npu_grouped_matmul(
                [_rows_of(rows)], [b_codes], scale=[torch.cat([t.scale_inv.reshape(1) for t in b])],
                per_token_scale=[per_token], group_list=self._group_list(sizes, rows[0].device),
                split_item=3, group_type=0, output_dtype=mm_dtype, **hif8)
            results = list(torch.split(y, sizes))
        else:
            # K-split: x = the concatenated (tokens, N) codes transposed, weight the (tokens, K) codes.
            sizes = [r.shape[0] for r in rows]
            x_rows = _rows_of([t.data.reshape(-1, t.shape[-1]) for t in b])
            (y,) = self.npu.npu_grouped_matmul(
                [_rows_of(rows).t()], [x_rows], scale=[torch.cat([t.scale_inv.reshape(1) for t in b])],
                per_token_scale=[torch.cat([t.scale_inv.reshape(1) for t in a])],
                group_list=self._group_list(sizes, rows[0].device),
                split_item=3, group_type=2, output_dtype=mm_dtype, **hif8)
            results = list(y.unbind(0))
        if out is not None:
            return [o.add_(r) for o, r in zip(out, results)]
        return results

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

    def _quant_matmul_args(self, a: Operand, b: Operand, a_col: bool, b_col: bool
                           ) -> Optional[tuple[torch.Tensor, torch.Tensor, dict]]:
        """(x1, x2, keyword arguments) of npu_quant_matmul for a · bᵀ, or None when no mode fits."""
        storages = (Float8TensorStorage, Float8BlockwiseQTensorStorage, MXFP8TensorStorage)
        if type(a) is not type(b) or not isinstance(a, storages):
            return None
        if (a.fp8_dtype is FP8Dtype.HIF8) != (b.fp8_dtype is FP8Dtype.HIF8):
            return None
        hif8 = self._hif8_kwargs(a.fp8_dtype, ("x1_dtype", "x2_dtype"))
        if isinstance(a, Float8TensorStorage):
            x1 = a.columnwise_data if a_col else a.data.reshape(-1, a.shape[-1])
            b2d = b.columnwise_data if b_col else b.data.reshape(-1, b.shape[-1])
            return x1, b2d.t(), dict(scale=b.scale_inv, pertoken_scale=a.scale_inv, **hif8)
        if isinstance(a, MXFP8TensorStorage):
            (x1, s1), (b2d, s2) = _mx_pair(a, a_col, as_x2=False), _mx_pair(b, b_col, as_x2=True)
            e8m0 = self.npu.float8_e8m0fnu
            return x1, b2d.t(), dict(scale=s2, pertoken_scale=s1, scale_dtype=e8m0, pertoken_scale_dtype=e8m0,
                                     group_sizes=[1, 1, 32])
        if a.block_scaling_dim == b.block_scaling_dim == 1:
            return self._pow2_tiles_as_mx(a, b, a_col, b_col)
        if a.block_scaling_dim != 1:
            return None  # the kernel wants 1x128 tiles on x1 and 128x128 tiles on x2
        (x1, s1), (b2d, s2) = _tiled_pair(a, a_col), _tiled_pair(b, b_col)
        return x1, b2d.t(), dict(scale=s2.t(), pertoken_scale=s1, group_sizes=[1, 128, 128], **hif8)

    def _pow2_tiles_as_mx(self, a: Float8BlockwiseQTensorStorage, b: Float8BlockwiseQTensorStorage, a_col: bool,
                          b_col: bool) -> Optional[tuple[torch.Tensor, torch.Tensor, dict]]:
        """1x128 x 1x128 tiles (the blockwise wgrad), which no blockwise mode takes ([1, 128, 128] wants
        128x128 tiles on x2), in the MX mode when every scale is a power of two: a 128-tile is four 32-blocks
        with the same E8M0 exponent, so the kernel's sum of per-block products is the blockwise product. k must
        be whole 32-blocks; an odd number of them fills its last pair with the byte of the tile it ends."""
        x1, b2d = _tiled_data(a, a_col), _tiled_data(b, b_col)
        k = x1.shape[1]
        if not (a.power_2_scale and b.power_2_scale) or a.fp8_dtype is FP8Dtype.HIF8 or k % 32:
            return None
        blocks = 2 * -(-k // 64)  # whole pairs: a 128-tile's four bytes cover them

        def e8m0_pairs(t: Float8BlockwiseQTensorStorage, columnwise: bool) -> torch.Tensor:
            # Each 128-tile's E8M0 byte repeated for its 32-blocks as (rows, ceil(k / 64), 2) pairs: the bytes the
            # quantize kernel made, or those of the float32 scales (a power-of-2 float32, 2^-127 included, a
            # subnormal, has its E8M0 byte in bits 23..30; NaN -> 0xFF).
            codes = t.columnwise_scale_e8m0 if columnwise else None
            if codes is None:
                scale_inv = t.columnwise_scale_inv if columnwise else t.rowwise_scale_inv
                codes = torch.bitwise_right_shift(scale_inv.view(torch.int32), 23).to(torch.uint8)
            pairs = codes.index_select(1, _tile_of_block(blocks, codes.device))
            return pairs.reshape(pairs.shape[0], -1, 2)

        e8m0 = self.npu.float8_e8m0fnu
        return x1, b2d.t(), dict(
            scale=e8m0_pairs(b, b_col).transpose(0, 1), pertoken_scale=e8m0_pairs(a, a_col),
            scale_dtype=e8m0, pertoken_scale_dtype=e8m0, group_sizes=[1, 1, 32],
        )


# Quantize dispatch of the block-scaled quantizers (per-tensor ones go through quantize_many's batched forms):
# the quantizer's type -> the NpuBackend method that runs it on a kernel (None from the method, or a type not
# listed, means the quantizer's own torch-op path).
_QUANTIZE_KERNELS = {
    Float8BlockQuantizer: NpuBackend._quantize_blocks,
    MXFP8Quantizer: NpuBackend._quantize_mx,
}
