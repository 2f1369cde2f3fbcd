"""Quantized tensors: 8-bit data plus the `scale_inv` that turns it back into real values.

These are storage containers (TransformerEngine's "*TensorStorage" idea), not torch.Tensor subclasses: the
autograd functions hold them, the kernels consume them, and `dequantize()` is exact.

Layouts. "Rowwise" data keeps the tensor's own shape and is scaled along its last dimension, which is the
GEMM contraction dim for fprop. "Columnwise" data serves the GEMM that contracts the first (flattened)
dimension instead (wgrad): it is stored as the quantization of the 2-D transpose, shape (K, M), so in
every stored form the scaled dimension is the last one.
"""
from __future__ import annotations

from copy import copy as shallow_copy
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from mindspeed_te import fused_cast
from mindspeed_te.formats import FP8Dtype, cast_from_fp8, decode_table
from mindspeed_te.fp4 import (
    NVFP4_DEQUANT_FACTOR,
    decode_packed_fp4,
    e2m1_decode_table,
    inverse_hadamard_transform,
    nvfp4_decode_scale,
    pack_fp4,
    unpack_fp4,
)
from mindspeed_te.scaling import e8m0_decode

__all__ = ["QuantizedTensorStorage", "Float8TensorStorage", "Float8BlockwiseQTensorStorage", "MXFP8TensorStorage",
           "NVFP4TensorStorage", "MXFP4TensorStorage"]


def _as_2d(shape: torch.Size) -> tuple[int, int]:
    """(M, K) of a tensor flattened to 2-D over its leading dims."""
    k = shape[-1] if len(shape) else 1
    m = 1
    for d in shape[:-1]:
        m *= d
    return m, k


def _to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t.to(dtype)` without the call when nothing changes (host overhead matters on small GEMMs)."""
    return t if t.dtype == dtype else t.to(dtype)


def rows_follow(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether 2-D `b` is the row block right after 2-D `a` in one contiguous buffer (as `torch.split` along
    the rows leaves them): the same columns, dtype and storage, both contiguous, b starting where a ends."""
    return (a.dim() == b.dim() == 2 and a.shape[1] == b.shape[1] and a.dtype == b.dtype and a.device == b.device
            and a.is_contiguous() and b.is_contiguous()
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and b.storage_offset() == a.storage_offset() + a.numel())  # (an empty block's data_ptr is 0)


def joined_rows(blocks: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """The 2-D tensor spanning `blocks` when the first is a contiguous 2-D block and each follows the one
    before (`rows_follow`: the experts' pieces of a grouped linear's input), so that one kernel reads them all
    without a concatenation; else None. Blocks that tile their base tensor exactly (one or several) give that
    base (a tensor a custom autograd function may return); another lone block is itself, other spans an
    as_strided view."""
    if not blocks or blocks[0].dim() != 2 or not blocks[0].is_contiguous():
        return None
    if any(not rows_follow(a, b) for a, b in zip(blocks, blocks[1:])):
        return None
    first = blocks[0]
    rows, k = sum(t.shape[0] for t in blocks), first.shape[1]
    base = first._base
    if (base is not None and base.shape == (rows, k) and base.is_contiguous()
            and base.storage_offset() == first.storage_offset()):
        return base
    return first if len(blocks) == 1 else first.as_strided((rows, k), (k, 1), first.storage_offset())


def _nbytes(*tensors: Optional[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class QuantizedTensorStorage:
    """Common fields: element format, logical (high-precision) shape and dtype."""

    fp8_dtype: FP8Dtype
    shape: torch.Size
    dtype: torch.dtype

    def dequantize(self, dtype: Optional[torch.dtype] = None, columnwise: bool = False) -> torch.Tensor:
        """Real values in the logical shape, from the rowwise copy or (columnwise=True) the columnwise copy."""
        raise NotImplementedError

    def has_data(self, columnwise: bool = False) -> bool:
        raise NotImplementedError

    def columnwise_only(self) -> QuantizedTensorStorage:
        """This tensor without the rowwise form that backward never reads: a shallow copy, so that the
        original (e.g. a weight cached across micro-batches) stays whole; `self` when nothing would go."""
        copy = shallow_copy(self)  # the same fields, read as stored (dataclasses.replace would compute lazy ones)
        copy.update_usage(rowwise=False, columnwise=True)
        return copy

    def update_usage(self, rowwise: Optional[bool] = None, columnwise: Optional[bool] = None) -> None:
        """Drop copies that are no longer needed (e.g. the rowwise input after fprop) to save memory."""
        raise NotImplementedError

    def nbytes(self) -> int:
        raise NotImplementedError

    def _require(self, columnwise: bool) -> None:
        if not self.has_data(columnwise):
            kind = "columnwise" if columnwise else "rowwise"
            raise RuntimeError(f"{type(self).__name__} holds no {kind} data (dropped by update_usage or not requested)")


@dataclass
class Float8TensorStorage(QuantizedTensorStorage):
    """Per-tensor scaling (delayed and current): one scale_inv for the whole tensor. The columnwise form is a
    transposed view of the same data, so it is never stored twice."""

    data: Optional[torch.Tensor] = None
    scale_inv: Optional[torch.Tensor] = None

    def has_data(self, columnwise: bool = False) -> bool:
        return self.data is not None

    @property
    def columnwise_data(self) -> torch.Tensor:
        """The (K, M) transposed view of the data."""
        self._require(True)
        return self.data.reshape(_as_2d(self.shape)).t()

    def dequantize(self, dtype: Optional[torch.dtype] = None, columnwise: bool = False) -> torch.Tensor:
        self._require(columnwise)
        values = cast_from_fp8(self.data, self.fp8_dtype) * self.scale_inv
        return _to(values, dtype or self.dtype)

    def columnwise_only(self) -> Float8TensorStorage:
        return self  # one copy of the data serves both layouts

    def update_usage(self, rowwise: Optional[bool] = None, columnwise: Optional[bool] = None) -> None:
        if rowwise is False and columnwise is False:
            self.data = None

    def nbytes(self) -> int:
        return _nbytes(self.data, self.scale_inv)


class _TwoForms(QuantizedTensorStorage):
    """A storage with a rowwise form and a columnwise one, each data plus scale_inv (tiled FP8, FP4)."""

    rowwise_data: Optional[torch.Tensor]
    rowwise_scale_inv: Optional[torch.Tensor]
    columnwise_data: Optional[torch.Tensor]
    columnwise_scale_inv: Optional[torch.Tensor]

    def has_data(self, columnwise: bool = False) -> bool:
        return (self.columnwise_data if columnwise else self.rowwise_data) is not None

    def update_usage(self, rowwise: Optional[bool] = None, columnwise: Optional[bool] = None) -> None:
        if rowwise is False:
            self.rowwise_data = self.rowwise_scale_inv = None
        if columnwise is False:
            self.columnwise_data = self.columnwise_scale_inv = None

    def nbytes(self) -> int:
        """Every tensor held, as stored (a kernel's own scale form included; nothing is made to count it)."""
        return _nbytes(*(v for v in vars(self).values() if isinstance(v, torch.Tensor)))


@dataclass
class _TiledTensor(_TwoForms):
    """Data scaled per tile along the last stored dim, with an optional columnwise (transposed) copy."""

    rowwise_data: Optional[torch.Tensor] = None
    rowwise_scale_inv: Optional[torch.Tensor] = None
    columnwise_data: Optional[torch.Tensor] = None
    columnwise_scale_inv: Optional[torch.Tensor] = None
    # The columnwise E8M0 scale bytes as an MX quantize kernel lays them out when it quantizes x (M, K) along its
    # rows, (ceil(blocks / 2), K, 2) with blocks (2i, 2i + 1) interleaved (or, made otherwise, one block per row:
    # (blocks, K, 1)); `columnwise_data` is then the transposed view of the (M, K) codes. GEMM kernels take them
    # as they are.
    columnwise_scale_pairs: Optional[torch.Tensor] = None

    def _tile(self) -> tuple[int, int]:
        raise NotImplementedError

    def _columnwise_scale_bytes(self) -> Optional[torch.Tensor]:
        """The (K, blocks) E8M0 bytes of `columnwise_scale_pairs` (one copy), or None without them."""
        pairs = self.columnwise_scale_pairs
        if pairs is None:
            return None
        blocks = -(-_as_2d(self.shape)[0] // self.block_len)
        return pairs.permute(1, 0, 2).contiguous().view(pairs.shape[1], -1)[:, :blocks]

    def _scale_inv_values(self, scale_inv: torch.Tensor) -> torch.Tensor:
        return scale_inv

    def columnwise_pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(data (K, M), scale_inv) of the columnwise form."""
        self._require(True)
        return self.columnwise_data, self.columnwise_scale_inv

    def nonfinite_scales(self) -> Optional[torch.Tensor]:
        """Decode scales that are NaN where the quantized data held NaN/Inf, in the form held: the rowwise ones,
        else the columnwise ones as a kernel made them (E8M0 bytes, which the non-finite fold reads as they are:
        decoding them into the storage's own form would be a launch)."""
        return self.rowwise_scale_inv if self.rowwise_scale_inv is not None else self._columnwise_scale_as_made()

    def _columnwise_scale_as_made(self) -> Optional[torch.Tensor]:
        pairs = self.columnwise_scale_pairs  # padded with 0 bytes: finite scales
        return pairs if pairs is not None else self.columnwise_scale_inv

    def update_usage(self, rowwise: Optional[bool] = None, columnwise: Optional[bool] = None) -> None:
        super().update_usage(rowwise, columnwise)
        if columnwise is False:
            self.columnwise_scale_pairs = None

    def _dequantize_2d(self, data: torch.Tensor, scale_inv: torch.Tensor,
                       dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The dequantized 2-D data as float32, or as bfloat16 when `dtype` is bfloat16: the fused kernel then
        writes the float32 values rounded to bfloat16 itself, as the cast after it would."""
        rows, cols = self._tile()
        table = decode_table(self.fp8_dtype, data.device)
        out_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        # The fused kernel takes the scales as stored (float32 or E8M0 bytes).
        if data.t().is_contiguous() and not data.is_contiguous():  # a transposed view (128x128 columnwise)
            fused = fused_cast.dequantize_tiles(data.t(), table, scale_inv.t(), cols, rows, out_dtype)
            fused = None if fused is None else fused.t()
        else:
            fused = fused_cast.dequantize_tiles(data, table, scale_inv, rows, cols, out_dtype)
        if fused is not None:
            return fused
        return self.scale_tiles(cast_from_fp8(data, self.fp8_dtype), self._scale_inv_values(scale_inv))

    def scale_tiles(self, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Decoded (rows, k) data times its float32 per-tile multipliers (ceil(rows / tile rows), ceil(k / tile
        cols)): the dequantized values."""
        rows, cols = self._tile()
        m, k = values.shape
        # Along each dim whole tiles, or one tile cut short (a dim below the tile: an expert of 32 tokens under
        # 1x128 tiles along them) that counts as whole at its own length.
        r, c = (rows if m % rows == 0 else m), (cols if k % cols == 0 else k)
        if m % r == 0 and k % c == 0 and scales.shape == (m // r, k // c):
            # Each tile's scale broadcast over it in the one multiply, no expanded copy of the scales.
            tiles = values.reshape(m // r, r, k // c, c)
            return (tiles * scales.reshape(m // r, 1, k // c, 1)).reshape(m, k)
        scales = scales.repeat_interleave(rows, dim=0)[:m].repeat_interleave(cols, dim=1)[:, :k]
        return values * scales

    def dequantize(self, dtype: Optional[torch.dtype] = None, columnwise: bool = False) -> torch.Tensor:
        self._require(columnwise)
        dtype = dtype or self.dtype
        if columnwise:
            values = self._dequantize_2d(*self.columnwise_pair(), dtype).t()
        else:
            values = self._dequantize_2d(self.rowwise_data.reshape(_as_2d(self.shape)), self.rowwise_scale_inv, dtype)
        return _to(values.reshape(self.shape), dtype)



class _KernelFormScale:
    """A columnwise field (`columnwise_scale_inv`, or an FP4 storage's `columnwise_data`) of a storage that may hold
    that form as a kernel returned it (another layout, E8M0 bytes), which is what the GEMM kernels take: the
    storage's own form is made from it (`_<field>_from_kernel`, a few small ops) only when something reads it,
    then kept. Written, it is stored as given."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.key, self.make = f"_{name}", f"_{name}_from_kernel"

    def __get__(self, obj: Optional[_TwoForms], owner: type) -> Optional[torch.Tensor]:
        if obj is None:
            return None  # the class attribute: the field's default
        value = obj.__dict__.get(self.key)
        if value is None:
            value = obj.__dict__[self.key] = getattr(obj, self.make)()
        return value

    def __set__(self, obj: _TwoForms, value: Optional[torch.Tensor]) -> None:
        obj.__dict__[self.key] = value


@dataclass
class Float8BlockwiseQTensorStorage(_TiledTensor):
    """Blockwise scaling: float32 scale_inv per 1x128 tile (block_scaling_dim=1) or 128x128 tile (=2).

    Scale shapes: rowwise (ceil(M/r), ceil(K/128)), columnwise (ceil(K/r), ceil(M/128)), r = 1 or 128;
    with 128x128 tiles the columnwise form is a transposed view of the rowwise one. `power_2_scale`: every
    scale_inv is a power of two (so a kernel backend may pass them as E8M0 exponents). Power-of-2 1x128
    columnwise tiles that an MX kernel quantized along the rows (128-blocks) keep its `columnwise_scale_pairs`
    (the wgrad GEMM takes them so); `columnwise_scale_inv` is then decoded from them only when something reads it.
    """

    block_scaling_dim: int = 1
    block_len: int = 128
    power_2_scale: bool = False

    columnwise_scale_inv = _KernelFormScale()  # type: ignore[assignment]

    def _columnwise_scale_inv_from_kernel(self) -> Optional[torch.Tensor]:
        codes = self._columnwise_scale_bytes()
        return None if codes is None else e8m0_decode(codes)

    def _tile(self) -> tuple[int, int]:
        return (1 if self.block_scaling_dim == 1 else self.block_len), self.block_len

    # 128x128 tiles are symmetric: the columnwise form is the transpose of the rowwise one, never a copy.
    def has_data(self, columnwise: bool = False) -> bool:
        if self.block_scaling_dim == 2:
            return self.rowwise_data is not None
        return super().has_data(columnwise)

    def columnwise_pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.block_scaling_dim == 2:
            self._require(True)
            return self.rowwise_data.reshape(_as_2d(self.shape)).t(), self.rowwise_scale_inv.t()
        return super().columnwise_pair()

    def columnwise_only(self) -> Float8BlockwiseQTensorStorage:
        return self if self.block_scaling_dim == 2 else super().columnwise_only()

    def update_usage(self, rowwise: Optional[bool] = None, columnwise: Optional[bool] = None) -> None:
        if self.block_scaling_dim == 2:
            if rowwise is False and columnwise is False:
                self.rowwise_data = self.rowwise_scale_inv = None
            return
        super().update_usage(rowwise, columnwise)


@dataclass
class MXFP8TensorStorage(_TiledTensor):
    """MXFP8: one E8M0 scale_inv (uint8, value 2^(b - 127)) per 32 consecutive elements of the last stored dim.

    Scale shapes: rowwise (M, K / 32), columnwise (K, ceil(M / 32)): the last block along M may be short (an
    expert's tokens, unpadded). `columnwise_scale_pairs`, when a kernel made the columnwise form along the rows,
    (ceil(M / 64), K, 2); `columnwise_scale_inv` is then made from them (one copy) only when something reads it.
    """

    block_len: int = 32

    columnwise_scale_inv = _KernelFormScale()  # type: ignore[assignment]

    def _columnwise_scale_inv_from_kernel(self) -> Optional[torch.Tensor]:
        return self._columnwise_scale_bytes()

    def _tile(self) -> tuple[int, int]:
        return 1, self.block_len

    def _scale_inv_values(self, scale_inv: torch.Tensor) -> torch.Tensor:
        return e8m0_decode(scale_inv)


@dataclass
class _FP4TensorStorage(_TwoForms):
    """FP4 data: E2M1 codes packed two per byte (element 2i of the last stored dim in the low nibble, 2i + 1 in the
    high one) with one scale per `block_len` elements along it. Rowwise data has the tensor's shape with the last
    dim halved, scales (M, K / block_len) for its (M, K) 2-D form; the columnwise form is the quantized transpose,
    data (K, M / 2), scales (K, M / block_len). `columnwise_rht_sign_mask`: None, or the sign mask of the random
    Hadamard transform the columnwise form was quantized after (mindspeed_te/fp4.py): its values are then those
    of the transpose transformed in 16-element runs along M, which `columnwise_hadamard_values` returns exactly
    and `dequantize(columnwise=True)` transforms back (in float32)."""

    rowwise_data: Optional[torch.Tensor] = None
    rowwise_scale_inv: Optional[torch.Tensor] = None
    columnwise_data: Optional[torch.Tensor] = None
    columnwise_scale_inv: Optional[torch.Tensor] = None
    columnwise_rht_sign_mask: Optional[int] = None
    block_len: int = 16

    def _multipliers(self, columnwise: bool) -> torch.Tensor:
        """The float32 multiplier of each block's codes, (rows, k / block_len) of the stored form."""
        raise NotImplementedError

    def _values_2d(self, columnwise: bool) -> torch.Tensor:
        """The exact float32 values of the stored form: (M, K) rowwise, (K, M) columnwise."""
        return self._codes_times(columnwise, self._multipliers(columnwise))

    def _codes_times(self, columnwise: bool, multipliers: torch.Tensor) -> torch.Tensor:
        """The stored form's codes times float32 `multipliers` (one per block), float32 (M, K) or (K, M)."""
        self._require(columnwise)
        m, k = _as_2d(self.shape)
        rows, cols = (k, m) if columnwise else (m, k)
        data = self.columnwise_data if columnwise else self.rowwise_data.reshape(rows, cols // 2)
        fused = fused_cast.dequantize_tiles(unpack_fp4(data), e2m1_decode_table(data.device), multipliers, 1,
                                            self.block_len)
        if fused is not None:  # the same products in one pass
            return fused
        values = decode_packed_fp4(data).reshape(rows, -1, self.block_len)
        return (values * multipliers[:, :, None]).reshape(rows, cols)

    def columnwise_hadamard_values(self) -> torch.Tensor:
        """The columnwise form's exact float32 values as stored, (K, M): for a Hadamard-transformed form, the
        transformed values (two such operands of one GEMM contract to the product: the transform is orthogonal)."""
        return self._values_2d(True)

    def dequantize(self, dtype: Optional[torch.dtype] = None, columnwise: bool = False) -> torch.Tensor:
        dtype = dtype or self.dtype
        values = self._values_2d(columnwise)
        if columnwise:
            if self.columnwise_rht_sign_mask is not None:
                values = inverse_hadamard_transform(values, self.columnwise_rht_sign_mask)
            values = values.t()
        return _to(values.reshape(self.shape), dtype)



@dataclass
class NVFP4TensorStorage(_FP4TensorStorage):
    """NVFP4 (TransformerEngine's name): one E4M3 scale (torch.float8_e4m3fn) per 16 elements and the float32
    amax of the data each form was quantized from (`amax_rowwise`; `amax_columnwise`, which differs only after a
    Hadamard transform), from which the per-tensor scale follows. A value is code * ((float(scale) * amax) *
    float32(1 / 2688)), TE's dequantize kernel. With 16x16 tiles (`with_2d_quantization`, weights) the 16 rows
    of a tile hold the same scale, and the columnwise form is the exact transpose of the rowwise one."""

    amax_rowwise: Optional[torch.Tensor] = None
    amax_columnwise: Optional[torch.Tensor] = None
    with_2d_quantization: bool = False

    def _multipliers(self, columnwise: bool) -> torch.Tensor:
        scale, amax = self._scale_and_amax(columnwise)
        return nvfp4_decode_scale(scale, amax)

    def _scale_and_amax(self, columnwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return ((self.columnwise_scale_inv, self.amax_columnwise) if columnwise
                else (self.rowwise_scale_inv, self.amax_rowwise))

    def _values_2d(self, columnwise: bool) -> torch.Tensor:
        """As every FP4 storage's, in one pass of the fused kernel over the packed codes and E4M3 scales where it
        applies (the same products)."""
        return self._decoded(columnwise, per_tensor=True)

    def block_scaled_values(self, columnwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored form's values (laid out as `_values_2d`'s, a Hadamard-transformed form as stored) split for a
        GEMM that applies the per-tensor factor once to its float32 sum: (code * float(scale) in bfloat16, which
        holds it exactly: a 2-bit E2M1 significand times a 4-bit E4M3 one has at most 6 significant bits, within
        [2^-10, 2688]; amax * float32(1 / 2688), one-element float32)."""
        _, amax = self._scale_and_amax(columnwise)
        return self._decoded(columnwise, per_tensor=False), amax.float() * NVFP4_DEQUANT_FACTOR

    def _decoded(self, columnwise: bool, per_tensor: bool) -> torch.Tensor:
        """code * ((float(scale) * amax) * float32(1 / 2688)) of the stored form in float32, or without the
        per-tensor part, code * float(scale) in bfloat16; in one pass of the fused kernel where it applies (the
        same products)."""
        self._require(columnwise)
        m, k = _as_2d(self.shape)
        data = self.columnwise_data if columnwise else self.rowwise_data.reshape(m, k // 2)
        scale, amax = self._scale_and_amax(columnwise)
        if not per_tensor:  # (float(scale) * 1) * 1: the scale itself
            amax = torch.ones((), dtype=torch.float32, device=data.device)
        fused = fused_cast.dequantize_nvfp4(data, scale, amax, e2m1_decode_table(data.device),
                                            NVFP4_DEQUANT_FACTOR if per_tensor else 1.0,
                                            torch.float32 if per_tensor else torch.bfloat16)
        if fused is not None:
            return fused
        if per_tensor:
            return super()._values_2d(columnwise)
        return self._codes_times(columnwise, scale.float()).to(torch.bfloat16)

    def nonfinite_scales(self) -> torch.Tensor:
        """The amax a form was quantized from: NaN or Inf exactly when the data held NaN/Inf (a transform of such
        data holds them too)."""
        amax = self.amax_rowwise if self.rowwise_data is not None or self.amax_columnwise is None else None
        return amax if amax is not None else self.amax_columnwise


@dataclass
class MXFP4TensorStorage(_FP4TensorStorage):
    """MXFP4: one E8M0 scale (uint8, value 2^(b - 127), 0xFF NaN: a block that held NaN/Inf) per 32 elements.

    `columnwise_kernel_data` / `columnwise_scale_pairs`, when an MX kernel quantized x along its rows as x lies
    (M, K): the columnwise form as that kernel lays it out, codes (M, K / 2) packed along K and scales
    (ceil(M / 64), K, 2) in pairs of 32-row blocks. The GEMM kernels take it as it is; `columnwise_data` and
    `columnwise_scale_inv` are made from it (a repacking, one copy) only when something reads them."""

    block_len: int = 32
    columnwise_kernel_data: Optional[torch.Tensor] = None
    columnwise_scale_pairs: Optional[torch.Tensor] = None

    columnwise_data = _KernelFormScale()  # type: ignore[assignment]
    columnwise_scale_inv = _KernelFormScale()  # type: ignore[assignment]

    def _columnwise_data_from_kernel(self) -> Optional[torch.Tensor]:
        data = self.columnwise_kernel_data
        return None if data is None else pack_fp4(unpack_fp4(data).t())

    def _columnwise_scale_inv_from_kernel(self) -> Optional[torch.Tensor]:
        pairs = self.columnwise_scale_pairs
        if pairs is None:
            return None
        blocks = _as_2d(self.shape)[0] // self.block_len
        return pairs.permute(1, 0, 2).contiguous().view(pairs.shape[1], -1)[:, :blocks]

    def has_data(self, columnwise: bool = False) -> bool:
        if columnwise and self.columnwise_kernel_data is not None:
            return True
        return (self.__dict__.get("_columnwise_data") if columnwise else self.rowwise_data) is not None

    def update_usage(self, rowwise: Optional[bool] = None, columnwise: Optional[bool] = None) -> None:
        super().update_usage(rowwise, columnwise)
        if columnwise is False:
            self.columnwise_kernel_data = self.columnwise_scale_pairs = None

    def _multipliers(self, columnwise: bool) -> torch.Tensor:
        return e8m0_decode(self.columnwise_scale_inv if columnwise else self.rowwise_scale_inv)

    def dequantize(self, dtype: Optional[torch.dtype] = None, columnwise: bool = False) -> torch.Tensor:
        """As every FP4 storage's, in one pass of the fused kernel over the unpacked codes where it applies (bfloat16
        written by it directly: the same float32 products, cast)."""
        dtype = dtype or self.dtype
        if columnwise and self.columnwise_rht_sign_mask is not None:
            return super().dequantize(dtype, columnwise)
        self._require(columnwise)
        m, k = _as_2d(self.shape)
        rows, cols = (k, m) if columnwise else (m, k)
        data = self.columnwise_data if columnwise else self.rowwise_data
        scales = self.columnwise_scale_inv if columnwise else self.rowwise_scale_inv
        values = fused_cast.dequantize_tiles(unpack_fp4(data.reshape(rows, cols // 2)), e2m1_decode_table(data.device),
                                             scales, 1, self.block_len,
                                             torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
        if values is None:
            return super().dequantize(dtype, columnwise)
        return _to((values.t() if columnwise else values).reshape(self.shape), dtype)

    def nonfinite_scales(self) -> torch.Tensor:
        """The rowwise E8M0 bytes, else the columnwise ones as made (kernel pairs padded with 0 bytes, finite)."""
        if self.rowwise_scale_inv is not None:
            return self.rowwise_scale_inv
        pairs = self.columnwise_scale_pairs
        return pairs if pairs is not None else self.columnwise_scale_inv
