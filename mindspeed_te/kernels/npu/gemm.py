"""The NPU backend's GEMM (`NpuGemm`, mixed into `NpuBackend`): gemm on npu_quant_matmul in its per-tensor,
[1, 128, 128] blockwise and [1, 1, 32] MX modes (`_quant_matmul_args`, which the grouped GEMM reuses), the
1x128 x 1x128 power-of-2 wgrad as MX (`_pow2_tiles_as_mx`), a k past the kernel's limit summed over k-parts,
gemm_bias and gemm_operand (HiF8 tiles decoded by npu_dtype_cast for the dequantize + matmul fallback)."""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch

from mindspeed_te.formats import FP8Dtype
from mindspeed_te.kernels.base import Operand
from mindspeed_te.kernels.npu.common import _MAX_LAST_DIM, _mx_pair, _tiled_pair
from mindspeed_te.kernels.reference import check_accumulate
from mindspeed_te.tensor import Float8BlockwiseQTensorStorage, Float8TensorStorage, MXFP8TensorStorage, _TiledTensor


def _tiled_data(t: _TiledTensor, columnwise: bool) -> torch.Tensor:
    """The (rows, k) data of the requested form of a tiled tensor, its scales left unread."""
    t._require(columnwise)
    return t.columnwise_data if columnwise else t.rowwise_data.reshape(-1, t.shape[-1])


@functools.lru_cache(maxsize=64)
def _tile_of_block(blocks: int, device: torch.device) -> torch.Tensor:
    """The 128-tile of each of `blocks` 32-blocks (j // 4), a device index made once per width: one
    index_select then repeats a tile's E8M0 byte for its 32-blocks, contiguous, whatever the last tile holds."""
    return torch.arange(blocks, device=device) // 4


def mx_pairs_of_tiles(tiles: torch.Tensor) -> torch.Tensor:
    """MX pairs of 32-block bytes (2 * h * q, n, 2) from 128-tile bytes (q, n, h), h tiles a row (a quantize
    kernel's pairs, tiles (2i, 2i + 1) interleaved: h = 2): 32-block pair p holds tile p // 2's byte twice (one
    copy of a broadcast view; contiguous, as the GEMM takes it, also where one tile's is a view)."""
    q, n, h = tiles.shape
    return tiles.permute(0, 2, 1)[:, :, None, :, None].expand(q, h, 2, n, 2).reshape(2 * h * q, n, 2).contiguous()


# The k-parts of a k past `_MAX_LAST_DIM` (`_gemm_over_k_parts`): whole 128-tiles and E8M0 pairs of 32-blocks.
_K_PART = 511 * 128


def _narrowed(t: torch.Tensor, dim: int, start: int, stop: int) -> torch.Tensor:
    """t[start:stop] along `dim` in a layout npu_quant_matmul takes, the one t had: contiguous, or the transposed
    view (of the last two dims of a matrix, the first two of E8M0 pairs) of a contiguous tensor; a copy unless
    the part is one already (narrowing along k mostly breaks it)."""
    part = t.narrow(dim, start, stop - start)
    if t.is_contiguous():
        return part.contiguous()
    dims = (-2, -1) if t.dim() == 2 else (0, 1)
    return part.transpose(*dims).contiguous().transpose(*dims)


class NpuGemm:
    """gemm, gemm_bias and gemm_operand of the NPU backend; the reference (next in the MRO) where no
    npu_quant_matmul mode fits. A high-precision wgrad added into main_grad is the grouped one's with one group
    (`NpuGroupedGemm._grouped_float_wgrad_into`)."""

    npu: Any
    _grouped_float_wgrad_into: Callable[..., Optional[list[torch.Tensor]]]

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
        if out is not None and isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            # a high-precision wgrad added into main_grad: the grouped GEMM + accumulate with one group
            added = self._grouped_float_wgrad_into([a], [b], a_columnwise, b_columnwise, [out])
            if added is not None:
                return out
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
        if out is not None and self._adds_in_kernel(x1, x2, kwargs, out):
            # aclnnQuantBatchMatmulInplaceAdd's MX mode: the float32 product added into main_grad in the GEMM.
            e8m0 = kwargs["scale_dtype"]
            return self.npu.npu_add_quant_matmul_(out, x1, x2, kwargs["scale"], x1_scale=kwargs["pertoken_scale"],
                                                  group_sizes=[1, 1, 32], x1_scale_dtype=e8m0, x2_scale_dtype=e8m0)
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

    def _adds_in_kernel(self, x1: torch.Tensor, x2: torch.Tensor, kwargs: dict, out: torch.Tensor) -> bool:
        """Whether npu_add_quant_matmul_ (op-plugin 26.0.0 and later) adds this GEMM into `out` with the
        reference's rounding: the MX mode ("mx量化": float8_e4m3fn/e5m2 operands, E8M0 scales, self float32), whose
        kernel sums each output over all of k in float32 and adds that into out once (a float32 atomic add),
        as the unfused npu_quant_matmul + add does; x1 the transposed view of a contiguous (k, m) and x2 a
        contiguous (k, n) ("当前仅支持transposeX1=true且transposeX2=false"): the wgrad of columnwise forms that the MX
        kernels quantized along the tokens (MXFP8, and power-of-2 1x128 tiles of bfloat16/float16). Its HiF8
        T-T mode is not used: the kernel multiplies the sum by x1Scale * x2Scale cut to their top 19 bits
        ("float deqScale = x1Scale.GetValue(0) * x2Scale.GetValue(0); ... & DEQ_SCALE_MUL; // fixpipe只能取高19位",
        ops-nn kernel_qbmm_cube.h), where the reference multiplies by each float32 scale in turn."""
        return (hasattr(self.npu, "npu_add_quant_matmul_") and kwargs.get("group_sizes") == [1, 1, 32]
                and out.dtype == torch.float32 and out.shape == (x1.shape[0], x2.shape[1]) and x1.dim() == 2
                and x1.t().is_contiguous() and not x1.is_contiguous() and x2.is_contiguous())

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
            # Each 128-tile's E8M0 byte repeated for its 32-blocks as (ceil(k / 64), rows, 2) pairs, laid out as
            # the operand's codes are: from the quantize kernel's tile pairs (`mx_pairs_of_tiles`), or from the
            # float32 scales (a power-of-2 float32, 2^-127 included, a subnormal, has its E8M0 byte in bits
            # 23..30; NaN -> 0xFF) as (rows, ceil(k / 64), 2), transposed.
            tiles = t.columnwise_scale_pairs if columnwise else None
            if tiles is not None:
                return mx_pairs_of_tiles(tiles)[:blocks // 2]
            scale_inv = t.columnwise_scale_inv if columnwise else t.rowwise_scale_inv
            codes = torch.bitwise_right_shift(scale_inv.view(torch.int32), 23).to(torch.uint8)
            pairs = codes.index_select(1, _tile_of_block(blocks, codes.device))
            return pairs.reshape(pairs.shape[0], -1, 2).transpose(0, 1)

        e8m0 = self.npu.float8_e8m0fnu
        return x1, b2d.t(), dict(
            scale=e8m0_pairs(b, b_col), pertoken_scale=e8m0_pairs(a, a_col).transpose(0, 1),
            scale_dtype=e8m0, pertoken_scale_dtype=e8m0, group_sizes=[1, 1, 32],
        )
