"""Quantized parameters: torch.Tensor subclasses whose values live only in quantized form.

`fp8_model_init` makes modules store their weights as these tensors. Each one wraps a
`QuantizedTensorStorage` (the codes and their `scale_inv`, see tensor.py) and the quantizer that made it.
The forward GEMMs read the storage directly. Everywhere else the tensor behaves like a tensor of its
nominal dtype: any op sees the dequantized values, an in-place op (an optimizer step, `copy_`,
`load_state_dict`) writes back by quantizing again with the tensor's own quantizer.

The attributes Megatron's `fp8_utils` and distributed optimizer read from TransformerEngine's tensors are
here under TE's names: `_data` (the rowwise codes as 1-byte storage, what the parameter all-gather moves),
`_scale_inv`, `_fp8_dtype`, `_quantizer`, `dequantize()` and `quantize_(src)`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch.utils._pytree import tree_map

from mindspeed_te.formats import FP8Dtype
from mindspeed_te.fp4 import pack_fp4, unpack_fp4
from mindspeed_te.quantizers import Quantizer
from mindspeed_te.tensor import (
    Float8BlockwiseQTensorStorage,
    Float8TensorStorage,
    MXFP4TensorStorage,
    MXFP8TensorStorage,
    NVFP4TensorStorage,
    QuantizedTensorStorage,
)

__all__ = ["QuantizedTensor", "Float8Tensor", "Float8BlockwiseQTensor", "MXFP8Tensor", "FP4Tensor", "NVFP4Tensor",
           "MXFP4Tensor", "dequantize_if_quantized"]

_aten = torch.ops.aten
# Ops that return the same tensor under another name: the result shares the storage (and so sees updates).
_ALIASES = (_aten.detach.default, _aten.alias.default)
_VIEWS = (_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default)


def _tensor_fields(storage: QuantizedTensorStorage) -> list[str]:
    return [f.name for f in dataclasses.fields(storage) if isinstance(getattr(storage, f.name), torch.Tensor)]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-byte view of an 8-bit tensor (gloo and Megatron's buffers do not take float8 dtypes)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


class QuantizedTensor(torch.Tensor):
    """A tensor of nominal shape and dtype whose values are `storage.dequantize()`."""

    _storage: QuantizedTensorStorage
    _quantizer: Quantizer

    @staticmethod
    def __new__(cls, storage: QuantizedTensorStorage, quantizer: Quantizer, requires_grad: bool = False):
        device = getattr(storage, _tensor_fields(storage)[0]).device
        tensor = torch.Tensor._make_wrapper_subclass(
            cls, storage.shape, dtype=storage.dtype, device=device, requires_grad=requires_grad)
        tensor._storage = storage
        tensor._quantizer = quantizer
        return tensor

    @staticmethod
    def from_storage(storage: QuantizedTensorStorage, quantizer: Quantizer,
                     requires_grad: bool = False) -> QuantizedTensor:
        """The subclass that matches the storage's scaling layout."""
        return _CLASS_OF[type(storage)](storage, quantizer, requires_grad)

    # TE's attributes -------------------------------------------------------------------------------
    @property
    def _fp8_dtype(self) -> FP8Dtype:
        return self._storage.fp8_dtype

    @property
    def _data(self) -> torch.Tensor:
        """The rowwise codes as uint8, in the parameter's shape."""
        return _bytes(self._rowwise_codes())

    @_data.setter
    def _data(self, new: torch.Tensor) -> None:
        """Point the codes at `new` (uint8, same shape), e.g. a slice of Megatron's parameter buffer."""
        old = self._rowwise_codes()
        if new.dtype != torch.uint8 or new.numel() != old.numel():
            raise ValueError(f"_data must be a uint8 tensor of {old.numel()} elements, got {new.dtype} "
                             f"with {new.numel()}")
        self._set_rowwise_codes(new.view(old.shape).view(old.dtype))

    @property
    def _scale_inv(self) -> torch.Tensor:
        raise NotImplementedError

    def _rowwise_codes(self) -> torch.Tensor:
        raise NotImplementedError

    def _set_rowwise_codes(self, codes: torch.Tensor) -> None:
        raise NotImplementedError

    def _write_codes(self, start: int, codes: torch.Tensor) -> None:
        """Set the rowwise codes of flat elements [start, start + len(codes)) (one byte each) where they are kept
        (a shard of Megatron's parameter buffer, see megatron/fp8_params.py)."""
        self._data.view(-1)[start:start + codes.numel()] = codes.view(torch.uint8)

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The real values as a plain tensor (nominal dtype unless `dtype`)."""
        return self._storage.dequantize(dtype or self.dtype)

    @torch.no_grad()
    def quantize_(self, src: torch.Tensor) -> QuantizedTensor:
        """Store `src` in place: quantized with this tensor's quantizer into the existing buffers (which may be
        views into Megatron's parameter buffer). A delayed-scaling quantizer also records src's amax."""
        if tuple(src.shape) != tuple(self.shape):
            raise ValueError(f"quantize_: source shape {tuple(src.shape)} != tensor shape {tuple(self.shape)}")
        src = dequantize_if_quantized(src).to(device=self.device, dtype=self.dtype)
        self._copy_storage(self._quantizer.quantize(src))
        return self

    def _copy_storage(self, new: QuantizedTensorStorage) -> None:
        """Copy another storage of the same layout into this one's tensors, in place."""
        for name in _tensor_fields(new):
            mine, theirs = getattr(self._storage, name), getattr(new, name)
            if mine is not None and mine.shape == theirs.shape and mine.dtype == theirs.dtype:
                mine.copy_(theirs)
            else:
                setattr(self._storage, name, theirs)

    def _alias(self) -> QuantizedTensor:
        """The same tensor under another name (detach, `.data`): the same storage."""
        return type(self)(self._storage, self._quantizer)

    def _same_layout(self, other: QuantizedTensor) -> bool:
        return type(other) is type(self) and other._storage.fp8_dtype == self._storage.fp8_dtype and \
            _tensor_fields(other._storage) == _tensor_fields(self._storage)

    # Tensor behaviour ------------------------------------------------------------------------------
    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return (f"{type(self).__name__}(fp8_dtype={self._fp8_dtype.name}, shape={tuple(self.shape)}, "
                f"dtype={self.dtype}, values={self.dequantize()})")

    def __reduce_ex__(self, protocol: int):
        return _rebuild, (self._storage, self._quantizer, self.requires_grad)

    def clone_storage(self) -> QuantizedTensorStorage:
        copy = dataclasses.replace(self._storage)
        for name in _tensor_fields(copy):
            setattr(copy, name, getattr(copy, name).clone())
        return copy

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ALIASES or (func in _VIEWS and list(args[1]) == list(args[0].shape)):
            return args[0]._alias()
        if func is _aten.clone.default:
            t = args[0]
            return type(t)(t.clone_storage(), t._quantizer)
        if func is _aten.copy_.default and isinstance(args[0], QuantizedTensor):
            dst, src = args[0], args[1]
            if isinstance(src, QuantizedTensor) and dst._same_layout(src):
                dst._copy_storage(src._storage)  # exact: codes and scales, no re-quantization
            else:
                dst.quantize_(src)
            return dst
        if func.namespace == "c10d":
            return _collective(func, args, kwargs)
        unwrapped = tree_map(dequantize_if_quantized, (args, kwargs))
        out = func(*unwrapped[0], **unwrapped[1])
        if func._schema.is_mutable and args and isinstance(args[0], QuantizedTensor):
            # an in-place op ran on the dequantized copy: store its result back in quantized form
            args[0].quantize_(unwrapped[0][0])
            return args[0]
        return out


class Float8Tensor(QuantizedTensor):
    """Per-tensor scaling (delayed and current; E4M3, E5M2, HiF8): one scale_inv for the whole tensor."""

    @property
    def _scale_inv(self) -> torch.Tensor:
        return self._storage.scale_inv

    def _rowwise_codes(self) -> torch.Tensor:
        return self._storage.data

    def _set_rowwise_codes(self, codes: torch.Tensor) -> None:
        self._storage.data = codes


class _TiledQuantizedTensor(QuantizedTensor):
    @property
    def _scale_inv(self) -> torch.Tensor:
        return self._storage.rowwise_scale_inv

    def _rowwise_codes(self) -> torch.Tensor:
        return self._storage.rowwise_data

    def _set_rowwise_codes(self, codes: torch.Tensor) -> None:
        self._storage.rowwise_data = codes


class Float8BlockwiseQTensor(_TiledQuantizedTensor):
    """Blockwise scaling: a scale_inv per 128x128 tile (weights) or 1x128 tile."""


class MXFP8Tensor(_TiledQuantizedTensor):
    """MXFP8: an E8M0 scale_inv per 32 elements, rowwise and columnwise copies."""


@dataclasses.dataclass
class _GatherCodes:
    """Where an FP4 parameter's rowwise codes sit in Megatron's uint8 parameter buffer (one per byte, or packed
    two per byte), and the buffer's version counter when the other forms were last made from them."""

    codes: torch.Tensor
    version: int
    packed: bool


class FP4Tensor(_TiledQuantizedTensor):
    """FP4 weights (--fp4-param-gather): E2M1 codes packed two per byte in the storage (TE's NVFP4Tensor calls
    them `_rowwise_data`). Megatron's distributed optimizer keeps them in its uint8 parameter buffer: megatron-core
    0.15 and 0.16 one code per byte (`_data` is pointed there: its buffer is sharded by element), 0.17 on packed
    (`_rowwise_data` is pointed there, as TE's). Once in that buffer, the codes are written there (a shard written
    by `quantize_param_shard`, the all-gather) and the other forms are made again from them whenever the buffer
    has changed. Only a form that follows from the rowwise codes can be: NVFP4 with 16x16 weight tiles, whose
    columnwise form is their transpose."""

    _gather: Optional[_GatherCodes] = None

    def _alias(self) -> FP4Tensor:
        alias = super()._alias()
        alias._gather = self._gather
        return alias

    @property
    def _storage(self) -> QuantizedTensorStorage:
        storage = self.__dict__["_fp4_storage"]
        gather = self._gather
        if gather is not None and gather.codes._version != gather.version:
            if not gather.packed:
                storage.rowwise_data = pack_fp4(gather.codes).view(storage.rowwise_data.shape)
            _follow_rowwise(storage)
            gather.version = gather.codes._version
        return storage

    @_storage.setter
    def _storage(self, storage: QuantizedTensorStorage) -> None:
        self.__dict__["_fp4_storage"] = storage

    @property
    def _rowwise_data(self) -> torch.Tensor:
        """The rowwise codes packed two per byte (element 2i in the low nibble), uint8."""
        return self._storage.rowwise_data

    @_rowwise_data.setter
    def _rowwise_data(self, new: torch.Tensor) -> None:
        """Keep the packed codes in `new` (uint8, half an element per byte, e.g. a slice of megatron-core 0.17's
        packed parameter buffer)."""
        self._keep_codes_in(new, packed=True)

    @property
    def _data(self) -> torch.Tensor:
        """The rowwise codes one per byte, uint8 in the parameter's shape."""
        if self._gather is not None and not self._gather.packed:
            return self._gather.codes
        return unpack_fp4(self._storage.rowwise_data).view(self.shape)

    @_data.setter
    def _data(self, new: torch.Tensor) -> None:
        """Keep the codes in `new` (uint8, one per element, e.g. a slice of megatron-core 0.16's buffer)."""
        self._keep_codes_in(new, packed=False)

    def _keep_codes_in(self, new: torch.Tensor, packed: bool) -> None:
        numel = self.numel() // 2 if packed else self.numel()
        what = "two FP4 codes per byte" if packed else "one FP4 code per byte"
        if new.dtype != torch.uint8 or new.numel() != numel:
            raise ValueError(f"{'_rowwise_data' if packed else '_data'} must be a uint8 tensor of {numel} elements "
                             f"({what}), got {new.dtype} with {new.numel()}")
        if not gatherable_fp4(self._storage):
            raise NotImplementedError(f"{type(self).__name__} weights of this recipe keep a columnwise form that "
                                      "cannot be made from gathered rowwise codes; only NVFP4 with 16x16 weight "
                                      "tiles (the default) can be gathered")
        storage = self._storage
        codes = new.view(storage.rowwise_data.shape if packed else self.shape)
        codes.copy_(storage.rowwise_data if packed else self._data)
        if packed:
            storage.rowwise_data = codes
        self._gather = _GatherCodes(codes, codes._version, packed)

    def _write_codes(self, start: int, codes: torch.Tensor) -> None:
        """As QuantizedTensor's where `_data` is kept in a buffer; packed codes nibble by nibble, the neighbours'
        nibbles kept."""
        if self._gather is not None and not self._gather.packed:
            super()._write_codes(start, codes)
            return
        packed = self._storage.rowwise_data.view(-1)
        first, end = start // 2, (start + codes.numel() + 1) // 2
        row = unpack_fp4(packed[first:end])
        row[start - 2 * first:start - 2 * first + codes.numel()] = codes
        packed[first:end] = pack_fp4(row)

    def _copy_storage(self, new: QuantizedTensorStorage) -> None:
        super()._copy_storage(new)
        gather = self._gather
        if gather is not None:  # the buffer follows a copy_ / quantize_ (a checkpoint load)
            storage = self.__dict__["_fp4_storage"]
            if not gather.packed:
                gather.codes.copy_(unpack_fp4(storage.rowwise_data).view(self.shape))
            elif storage.rowwise_data is not gather.codes:
                gather.codes.copy_(storage.rowwise_data)
                storage.rowwise_data = gather.codes
            gather.version = gather.codes._version


def gatherable_fp4(storage: QuantizedTensorStorage) -> bool:
    """Whether the whole FP4 storage follows from its rowwise codes and scales (see FP4Tensor)."""
    return isinstance(storage, NVFP4TensorStorage) and storage.with_2d_quantization


def _follow_rowwise(storage: NVFP4TensorStorage) -> None:
    """The columnwise form of 16x16-tile NVFP4 from its rowwise codes (the scales and amax are already the whole
    tensor's): the exact transpose, codes and tile scales alike."""
    if storage.columnwise_data is None:
        return
    codes = unpack_fp4(storage.rowwise_data)
    storage.columnwise_data = pack_fp4(codes.reshape(-1, codes.shape[-1]).t())
    tiles = storage.rowwise_scale_inv[::16]  # every row of a 16-row tile holds its scale
    storage.columnwise_scale_inv = tiles.t().repeat_interleave(16, dim=0)
    storage.amax_columnwise = storage.amax_rowwise


class NVFP4Tensor(FP4Tensor):
    """NVFP4: an E4M3 scale per 16 elements (16x16 tiles for weights) under a per-tensor fp32 amax."""


class MXFP4Tensor(FP4Tensor):
    """MXFP4: an E8M0 scale per 32 elements, rowwise and columnwise copies."""


_CLASS_OF = {
    Float8TensorStorage: Float8Tensor,
    Float8BlockwiseQTensorStorage: Float8BlockwiseQTensor,
    MXFP8TensorStorage: MXFP8Tensor,
    NVFP4TensorStorage: NVFP4Tensor,
    MXFP4TensorStorage: MXFP4Tensor,
}


def _rebuild(storage: QuantizedTensorStorage, quantizer: Quantizer, requires_grad: bool) -> QuantizedTensor:
    return QuantizedTensor.from_storage(storage, quantizer, requires_grad)


def dequantize_if_quantized(t: Any) -> Any:
    """`t.dequantize()` for a QuantizedTensor, `t` itself for anything else."""
    return t.dequantize() if isinstance(t, QuantizedTensor) else t


def _collective(func, args: tuple, kwargs: dict):
    """A c10d collective on quantized tensors (e.g. a parameter broadcast) moves each of their buffers as
    bytes: codes and scales travel exactly, with no dequantize."""
    tensors, rest = args[0], args[1:]
    if not isinstance(tensors, (list, tuple)) or not all(isinstance(t, QuantizedTensor) for t in tensors):
        raise NotImplementedError(f"{func}: quantized tensors must be passed alone to a collective "
                                  "(in-place collectives such as broadcast are supported)")
    result = None
    for t in tensors:
        for name in _tensor_fields(t._storage):
            result = func([_bytes(getattr(t._storage, name))], *rest, **kwargs)
            work = result[-1] if isinstance(result, tuple) else None
            if work is not None and hasattr(work, "wait"):
                work.wait()
    if isinstance(result, tuple) and len(result) == 2:
        return list(tensors), result[1]
    return result
