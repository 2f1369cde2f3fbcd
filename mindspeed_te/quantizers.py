"""One quantizer per recipe: each turns a high-precision tensor into a quantized tensor.

A quantizer owns only what its recipe needs between calls: the delayed-scaling quantizer holds views into
the shared amax history and scale (owned by `DelayedScalingRecipeState` in `recipe_state.py`); the others are
stateless apart from their configuration.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from mindspeed_te import fused_cast
from mindspeed_te.formats import FP8Dtype, quantize_table, scaled_cast
from mindspeed_te.fp4 import (
    RHT_SIGN_MASK,
    FP4Dtype,
    e2m1_encode,
    nvfp4_block_factors,
    nvfp4_block_scales,
    nvfp4_global_encode_scale,
    pack_fp4,
    random_hadamard_transform,
    stochastic_rounding_bits,
)
from mindspeed_te.nonfinite import NonfinitePair, PendingPairs, fold_nonfinite_pairs
from mindspeed_te.scaling import (
    current_scale_inv,
    e8m0_encode,
    mark_nonfinite,
    mx_scale_exponent,
    pad_to_multiple,
    tensor_amax,
    tile_view,
)
from mindspeed_te.tensor import (
    Float8BlockwiseQTensorStorage,
    Float8TensorStorage,
    MXFP4TensorStorage,
    MXFP8TensorStorage,
    NVFP4TensorStorage,
    QuantizedTensorStorage,
)

__all__ = [
    "record_nonfinite",
    "record_nonfinite_many",
    "Quantizer",
    "Float8Quantizer",
    "Float8CurrentScalingQuantizer",
    "Float8WarmupQuantizer",
    "Float8RepeatQuantizer",
    "Float8BlockQuantizer",
    "MXFP8Quantizer",
    "NVFP4Quantizer",
    "MXFP4Quantizer",
]

# The largest exponent of a normal element, used by the OCP MX rule (floor(log2 amax) - emax).
_EMAX = {FP8Dtype.E4M3: 8, FP8Dtype.E5M2: 15}


def _check_input(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"quantize expects a floating-point torch.Tensor, got {type(x).__name__}"
                        + (f" of dtype {x.dtype}" if isinstance(x, torch.Tensor) else ""))
    if x.dim() == 0:
        raise ValueError("quantize expects a tensor with at least one dimension, got a 0-d tensor")


def _flatten_2d(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


class Quantizer:
    """Base class. `rowwise_usage` / `columnwise_usage` say which layouts `quantize` must produce."""

    def __init__(self, fp8_dtype: FP8Dtype, *, rowwise: bool = True, columnwise: bool = True) -> None:
        if not isinstance(fp8_dtype, (FP8Dtype, FP4Dtype)):
            raise TypeError(f"fp8_dtype must be an FP8Dtype (or FP4Dtype), got {fp8_dtype!r}")
        self.fp8_dtype = fp8_dtype
        self.rowwise_usage = rowwise
        self.columnwise_usage = columnwise
        # A one-element float32 flag (set by the module's recipe state, see `nonfinite`) that becomes NaN once
        # a tensor holding NaN/Inf was quantized here; FP8GlobalStateManager.
        # check_nonfinite reports and clears it. `nonfinite_pending` (set with the flag for a watched module):
        # where record_nonfinite_many notes the flag's updates until the state manager folds the step's at
        # once; None: each quantize folds its own.
        self.nonfinite: Optional[torch.Tensor] = None
        self.nonfinite_pending: Optional[PendingPairs] = None

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles (a saved FP8 parameter keeps its quantizer) leave out the pending notes: they are
        the step's bookkeeping, holding other layers' tensors; a copy folds its own, into a flag of its own
        (the flag is a view into a buffer shared by every module's flags)."""
        flag = self.nonfinite
        return {**self.__dict__, "nonfinite_pending": None, "nonfinite": None if flag is None else flag.clone()}

    def set_usage(self, *, rowwise: Optional[bool] = None, columnwise: Optional[bool] = None) -> None:
        if rowwise is not None:
            self.rowwise_usage = rowwise
        if columnwise is not None:
            self.columnwise_usage = columnwise

    def quantize(self, x: torch.Tensor) -> QuantizedTensorStorage:
        raise NotImplementedError

    def calibrate(self, x: torch.Tensor) -> None:
        """Update the quantizer's state as quantizing `x` would, without quantizing (TransformerEngine's
        calibration). Only delayed scaling has state; the others do nothing."""

    def __call__(self, x: torch.Tensor) -> QuantizedTensorStorage:
        return self.quantize(x)

    def _tensor(self, x: torch.Tensor, codes: torch.Tensor, scale_inv: torch.Tensor) -> Float8TensorStorage:
        """A per-tensor quantized tensor from the codes of x and their scale_inv."""
        return Float8TensorStorage(self.fp8_dtype, x.shape, x.dtype, data=codes, scale_inv=scale_inv)


def _state_slot(state_slot: tuple[Any, int], name: str) -> torch.Tensor:
    """Slot i of the state's tensor `name` as the state holds it now: a state's tensors move into its key's
    shared buffers at an update (`DelayedScalingBuffers`), and a quantizer made before, such as a backward
    quantizer made in the forward, must follow them."""
    state, i = state_slot
    return state.slots(getattr(state, name))[i]


def _amax_slot(state_slot: tuple[Any, int]) -> torch.Tensor:
    """The amax slot, for whatever use: it no longer counts as fresh (see `Float8Quantizer.fresh_amax`)."""
    state, i = state_slot
    state.fresh[i] = False
    return _state_slot(state_slot, "amax_history")


class Float8Quantizer(Quantizer):
    """Delayed scaling: cast with the scale computed at the last update, and max-accumulate this tensor's
    amax into `amax` (slot 0 of its history column) for the next update.

    The divisor convention, the same on every backend: a bfloat16 input is divided by 1/scale rounded to
    bfloat16 (the NPU quantize kernel takes its scale in the input's dtype; the rounding is done once, at the
    per-step update), and that rounded value, exact in float32, is the scale_inv stored with the codes, so
    dequantizing stays exact. The quotient is float32(x) / float32(divisor), rounded once to the format.
    Other inputs are divided by the float32 1/scale."""

    def __init__(self, scale: Optional[torch.Tensor], amax: Optional[torch.Tensor], fp8_dtype: FP8Dtype, *,
                 state: Optional[tuple[Any, int]] = None, **usage: bool) -> None:
        """`state`: (the delayed-scaling state, this quantizer's slot) in place of `scale` and `amax`, which
        are then the state's as it holds them at each use, and 1/scale comes prepared by its per-step update
        instead of one reciprocal per quantize."""
        super().__init__(fp8_dtype, **usage)
        self._scale, self._amax, self._state = scale, amax, state

    @property
    def scale(self) -> torch.Tensor:
        return self._scale if self._state is None else _state_slot(self._state, "scale")

    @property
    def amax(self) -> torch.Tensor:
        return self._amax if self._state is None else _amax_slot(self._state)

    def fresh_amax(self) -> Optional[torch.Tensor]:
        """The amax slot when it is zero and unwritten since the state's last update or reset: the caller
        writes its amax there (it is then the slot's max) instead of max-accumulating, then calls
        `amax_written`. None otherwise, and for a quantizer without a state."""
        if self._state is None:
            return None
        state, i = self._state
        return state.fresh_amax_slot(i)

    @property
    def slot_id(self) -> Optional[tuple[int, int]]:
        """Which state's amax slot this quantizer writes ((id of the state, column), or None without one)."""
        return None if self._state is None else (id(self._state[0]), self._state[1])

    def amax_written(self) -> None:
        """Note that the caller has just written this quantizer's amax slot, so that its state does not take
        the write for one from outside (see `fresh_amax`)."""
        if self._state is not None:
            self._state[0].amax_written()

    def scale_inverse(self) -> torch.Tensor:
        """1 / scale, a one-element float32 tensor."""
        return self.divisor(torch.float32)[0]

    def divisor(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(what an input of `dtype` is divided by, its exact float32 value: the scale_inv stored with the
        codes), one-element tensors; see the class docstring."""
        if self._state is None:
            value = self._scale.reciprocal()
            if dtype != torch.bfloat16:
                return value, value
            rounded = value.to(dtype)
            return rounded, rounded.float()
        state, i = self._state
        return state.scale_inv.slot(i, dtype)

    def calibrate(self, x: torch.Tensor) -> None:
        """Max-accumulate x's amax into the history slot, as `quantize` does (NaN kept, see scaling)."""
        _check_input(x)
        torch.maximum(self.amax, tensor_amax(x.detach()).reshape(self.amax.shape), out=self.amax)

    def quantize(self, x: torch.Tensor) -> Float8TensorStorage:
        _check_input(x)
        scale_inv = self.divisor(x.dtype)[1]
        fused = fused_cast.quantize_delayed(x, self.fp8_dtype.value, quantize_table(self.fp8_dtype, x.device),
                                            self.amax, scale_inv)
        if fused is not None:
            return self._tensor(x, *fused)
        amax = tensor_amax(x.detach()).reshape(self.amax.shape)
        torch.maximum(self.amax, amax, out=self.amax)
        data = scaled_cast(x.detach(), scale_inv, self.fp8_dtype)
        return Float8TensorStorage(self.fp8_dtype, x.shape, x.dtype, data=data,
                                   scale_inv=mark_nonfinite(scale_inv, amax))


class Float8CurrentScalingQuantizer(Quantizer):
    """Current ("tensorwise") scaling: the scale comes from this tensor's own amax. With an
    `amax_reduction_group`, the amax is MAX-reduced over the group first (sequence-parallel inputs)."""

    def __init__(
        self,
        fp8_dtype: FP8Dtype,
        target_max: float,
        *,
        amax_epsilon: float = 0.0,
        power_2_scale: bool = False,
        amax_reduction_group: Optional[object] = None,
        **usage: bool,
    ) -> None:
        super().__init__(fp8_dtype, **usage)
        self.target_max = float(target_max)
        self.amax_epsilon = amax_epsilon
        self.power_2_scale = power_2_scale
        self.amax_reduction_group = amax_reduction_group

    def quantize(self, x: torch.Tensor) -> Float8TensorStorage:
        _check_input(x)
        if self.amax_reduction_group is None:
            fused = fused_cast.quantize_current(x, self.fp8_dtype.value, quantize_table(self.fp8_dtype, x.device),
                                                self.target_max, self.amax_epsilon, self.power_2_scale)
            if fused is not None:
                return self._tensor(x, *fused)
        amax = tensor_amax(x.detach()).reshape(1)
        if self.amax_reduction_group is not None:
            torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=self.amax_reduction_group)
        scale_inv = current_scale_inv(amax, self.target_max, self.amax_epsilon, self.power_2_scale)
        data = scaled_cast(x.detach(), scale_inv, self.fp8_dtype)
        return Float8TensorStorage(self.fp8_dtype, x.shape, x.dtype, data=data,
                                   scale_inv=mark_nonfinite(scale_inv, amax))


class Float8RepeatQuantizer(Quantizer):
    """Repeats a per-tensor quantize already made: x divided by that quantize's stored scale_inv (a tensor of its
    own, which later per-step updates leave alone), no amax taken or recorded. For a linear's input quantized
    again in backward (`save_original_input`, an activation output rebuilt by ops/rebuild.py): the same values
    give the forward's codes in one cast. A non-finite forward amax left that scale_inv NaN: so are these
    codes."""

    def __init__(self, scale_inv: torch.Tensor, fp8_dtype: FP8Dtype, **usage: bool) -> None:
        super().__init__(fp8_dtype, **usage)
        self.scale_inv = scale_inv

    def divisor(self, dtype: torch.dtype) -> torch.Tensor:
        """What an input of `dtype` is divided by: scale_inv, in bfloat16 for a bfloat16 input (exact: delayed
        scaling's scale_inv for such inputs is a bfloat16 value, see Float8Quantizer)."""
        return self.scale_inv.to(dtype) if dtype == torch.bfloat16 else self.scale_inv

    def quantize(self, x: torch.Tensor) -> Float8TensorStorage:
        _check_input(x)
        return self._tensor(x, scaled_cast(x.detach(), self.scale_inv, self.fp8_dtype), self.scale_inv)


class Float8WarmupQuantizer(Quantizer):
    """Current scaling that also max-accumulates each tensor's amax into a delayed-scaling history slot:
    the warm-up of HIF8DelayedScaling, which fills the history before its delayed scales are trusted."""

    def __init__(self, state: tuple[Any, int], fp8_dtype: FP8Dtype, target_max: float, **usage: bool) -> None:
        """`state`: (the HIF8DelayedScaling state, this quantizer's slot), whose history slot 0 it writes."""
        super().__init__(fp8_dtype, **usage)
        self._state = state
        self.target_max = float(target_max)

    @property
    def amax(self) -> torch.Tensor:
        return _amax_slot(self._state)

    def calibrate(self, x: torch.Tensor) -> None:
        _check_input(x)
        torch.maximum(self.amax, tensor_amax(x.detach()).reshape(self.amax.shape), out=self.amax)

    def quantize(self, x: torch.Tensor) -> Float8TensorStorage:
        _check_input(x)
        amax = tensor_amax(x.detach()).reshape(self.amax.shape)
        torch.maximum(self.amax, amax, out=self.amax)
        scale_inv = current_scale_inv(amax, self.target_max)
        data = scaled_cast(x.detach(), scale_inv, self.fp8_dtype)
        return Float8TensorStorage(self.fp8_dtype, x.shape, x.dtype, data=data,
                                   scale_inv=mark_nonfinite(scale_inv, amax))


def _quantize_tiles(
    x2d: torch.Tensor, rows: int, cols: int, fp8_dtype: FP8Dtype, scale_fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D tensor per rows x cols tile (zero-padded to whole tiles, padding dropped after).

    `scale_fn(tile_amax) -> (scale_inv, scale_inv_to_store)`. Returns (data (M, K), stored scale_inv).
    """
    m, k = x2d.shape
    tiles = tile_view(pad_to_multiple(x2d.float(), rows, cols), rows, cols)
    amax = tiles.abs().amax(dim=(1, 3))
    scale_inv, stored_scale_inv = scale_fn(amax)
    data = scaled_cast(tiles, scale_inv[:, None, :, None], fp8_dtype)
    data = data.reshape(tiles.shape[0] * rows, tiles.shape[2] * cols)[:m, :k]
    return data.contiguous(), stored_scale_inv


class Float8BlockQuantizer(Quantizer):
    """Blockwise scaling: 1x128 tiles (block_scaling_dim=1: activations, gradients) or 128x128 tiles
    (block_scaling_dim=2: weights). The columnwise copy of 1x128 data is re-quantized from the
    high-precision tensor; for 128x128 tiles it is the exact transpose."""

    def __init__(
        self,
        fp8_dtype: FP8Dtype,
        target_max: float,
        *,
        block_scaling_dim: int = 1,
        amax_epsilon: float = 0.0,
        power_2_scale: bool = True,
        block_len: int = 128,
        **usage: bool,
    ) -> None:
        super().__init__(fp8_dtype, **usage)
        if block_scaling_dim not in (1, 2):
            raise ValueError(f"block_scaling_dim must be 1 or 2, got {block_scaling_dim!r}")
        self.target_max = float(target_max)
        self.block_scaling_dim = block_scaling_dim
        self.amax_epsilon = amax_epsilon
        self.power_2_scale = power_2_scale
        self.block_len = block_len

    def _scales(self, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale_inv = current_scale_inv(amax, self.target_max, self.amax_epsilon, self.power_2_scale)
        return scale_inv, mark_nonfinite(scale_inv, amax)  # a tile holding NaN/Inf dequantizes to NaN

    def quantize(self, x: torch.Tensor) -> Float8BlockwiseQTensorStorage:
        _check_input(x)
        x2d = _flatten_2d(x.detach())
        rows = 1 if self.block_scaling_dim == 1 else self.block_len
        out = Float8BlockwiseQTensorStorage(
            self.fp8_dtype, x.shape, x.dtype, block_scaling_dim=self.block_scaling_dim, block_len=self.block_len,
            power_2_scale=self.power_2_scale)
        fused = fused_cast.quantize_tiles(
            x2d, self.fp8_dtype.value, quantize_table(self.fp8_dtype, x.device), mode="block", tile_rows=rows,
            block=self.block_len, rowwise=self.rowwise_usage or self.block_scaling_dim == 2,
            columnwise=self.columnwise_usage and self.block_scaling_dim == 1, fp8_max=self.target_max,
            amax_epsilon=self.amax_epsilon, power_2_scale=self.power_2_scale)
        if fused is not None:
            data, out.rowwise_scale_inv, out.columnwise_data, out.columnwise_scale_inv = fused
            out.rowwise_data = None if data is None else data.reshape(x.shape)
            return out
        if self.rowwise_usage or self.block_scaling_dim == 2:  # 128x128: one copy serves both layouts
            data, scale_inv = _quantize_tiles(x2d, rows, self.block_len, self.fp8_dtype, self._scales)
            out.rowwise_data, out.rowwise_scale_inv = data.reshape(x.shape), scale_inv
        if self.columnwise_usage and self.block_scaling_dim == 1:
            out.columnwise_data, out.columnwise_scale_inv = _quantize_tiles(
                x2d.t(), 1, self.block_len, self.fp8_dtype, self._scales
            )
        return out


class MXFP8Quantizer(Quantizer):
    """MXFP8: blocks of 32 consecutive elements, E8M0 power-of-two scales, E4M3/E5M2 elements.
    Rowwise blocks run along the last dim, columnwise blocks along the first (flattened) dim, whose last block
    may be short (any number of tokens: experts need no padding where the kernels take such blocks)."""

    def __init__(self, fp8_dtype: FP8Dtype, *, rounding: str = "ceil", block_len: int = 32, **usage: bool) -> None:
        super().__init__(fp8_dtype, **usage)
        if fp8_dtype not in _EMAX:
            raise ValueError(f"MXFP8 elements must be E4M3 or E5M2, got {fp8_dtype.name}")
        if rounding not in ("ceil", "floor"):
            raise ValueError(f"rounding must be 'ceil' or 'floor', got {rounding!r}")
        self.rounding = rounding
        self.block_len = block_len

    def _scales(self, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        exponent = mx_scale_exponent(amax, self.fp8_dtype.max, _EMAX[self.fp8_dtype], self.rounding)
        # A block holding NaN/Inf gets E8M0's NaN code 0xFF, so it dequantizes to NaN.
        code = torch.where(torch.isfinite(amax), e8m0_encode(exponent), 0xFF)
        return torch.ldexp(torch.ones_like(amax), exponent), code

    def quantize(self, x: torch.Tensor) -> MXFP8TensorStorage:
        _check_input(x)
        x2d = _flatten_2d(x.detach())
        # Any row count (TE wants 32 | rows): the columnwise form's last block along the rows may be short, its
        # scale from its own rows (as zero rows would pad it: they change no amax).
        if x2d.shape[1] % self.block_len:
            raise ValueError(
                f"MXFP8 needs the last dim of the 2-D flattened tensor divisible by {self.block_len}, got shape "
                f"{tuple(x.shape)} -> {tuple(x2d.shape)}; pad the hidden size"
            )
        out = MXFP8TensorStorage(self.fp8_dtype, x.shape, x.dtype, block_len=self.block_len)
        fused = fused_cast.quantize_tiles(
            x2d, self.fp8_dtype.value, None, mode=self.rounding, tile_rows=1, block=self.block_len,
            rowwise=self.rowwise_usage, columnwise=self.columnwise_usage, fp8_max=self.fp8_dtype.max,
            emax=_EMAX[self.fp8_dtype])
        if fused is not None:
            data, out.rowwise_scale_inv, out.columnwise_data, out.columnwise_scale_inv = fused
            out.rowwise_data = None if data is None else data.reshape(x.shape)
            return out
        if self.rowwise_usage:
            data, out.rowwise_scale_inv = _quantize_tiles(x2d, 1, self.block_len, self.fp8_dtype, self._scales)
            out.rowwise_data = data.reshape(x.shape)
        if self.columnwise_usage:
            out.columnwise_data, out.columnwise_scale_inv = _quantize_tiles(
                x2d.t(), 1, self.block_len, self.fp8_dtype, self._scales
            )
        return out


def _fp4_2d(x: torch.Tensor, block: int, name: str) -> torch.Tensor:
    """x flattened to 2-D over its leading dims, both dims checked divisible by `block`."""
    _check_input(x)
    x2d = _flatten_2d(x.detach())
    if x2d.shape[0] % block or x2d.shape[1] % block:
        raise ValueError(f"{name} needs both dims of the 2-D flattened tensor divisible by {block}, got shape "
                         f"{tuple(x.shape)} -> {tuple(x2d.shape)}; pad the token dimension or the hidden size")
    return x2d


def _fp4_amax(x2d: torch.Tensor) -> torch.Tensor:
    """max |x| as a one-element float32 tensor (NaN when x holds one; 0 for an empty x)."""
    if not x2d.numel():
        return torch.zeros(1, dtype=torch.float32, device=x2d.device)
    return tensor_amax(x2d).reshape(1)


class _FP4Quantizer(Quantizer):
    """Options the FP4 quantizers share: `with_rht` (the columnwise form is quantized from the transpose after
    TE's random Hadamard transform along its rows, with TE's signs unless `with_random_sign_mask=False`),
    `stochastic_rounding` (its bits from `generator`, else mindspeed_te.fp4's hook, else the device's default
    generator; the rowwise form draws first, one byte per element in row-major order, then the columnwise)."""

    def __init__(self, fp4_dtype: FP4Dtype, *, with_rht: bool, stochastic_rounding: bool,
                 with_random_sign_mask: bool, generator: Optional[torch.Generator], **usage: bool) -> None:
        if fp4_dtype is not FP4Dtype.E2M1:
            raise TypeError(f"fp4_dtype must be FP4Dtype.E2M1, got {fp4_dtype!r}")
        super().__init__(fp4_dtype, **usage)
        self.with_rht = bool(with_rht)
        self.stochastic_rounding = bool(stochastic_rounding)
        self.rht_sign_mask = RHT_SIGN_MASK if with_random_sign_mask else 0
        self.generator = generator

    def _random_bits(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """Stochastic rounding's random bytes for the elements of t (drawn now), or None: round to nearest."""
        return (stochastic_rounding_bits(tuple(t.shape), t.device, self.generator)
                if self.stochastic_rounding else None)

    def _encode(self, scaled: torch.Tensor, rbits: Optional[torch.Tensor]) -> torch.Tensor:
        """Packed E2M1 codes of float32 (rows, cols) values, rounded with `rbits` (`_random_bits`)."""
        return pack_fp4(e2m1_encode(scaled, rbits))

    def _columnwise_source(self, x2d: torch.Tensor) -> torch.Tensor:
        """The (K, M) tensor the columnwise form quantizes: the transpose, Hadamard-transformed with `with_rht`."""
        col = x2d.t()
        return random_hadamard_transform(col, self.rht_sign_mask) if self.with_rht else col


class NVFP4Quantizer(_FP4Quantizer):
    """TransformerEngine's NVFP4 quantizer (same name and options): E2M1 codes, an E4M3 scale per 16 elements
    (`with_2d_quantization`: per 16x16 tile) under the per-tensor scale from the amax, by TE's rules bit for bit
    (mindspeed_te/fp4.py). Each requested form is quantized from the high-precision tensor: rowwise from x,
    columnwise from xᵀ, Hadamard-transformed with `with_rht` (its amax then taken after the transform,
    `with_post_rht_amax`, the only mode TE implements). `amax_reduction_group` (or TE's `with_amax_reduction`
    with a group): the amaxes are MAX-reduced over the group first. Both dims of the 2-D form must be
    divisible by 16."""

    def __init__(self, fp4_dtype: FP4Dtype = FP4Dtype.E2M1, *, rowwise: bool = True, columnwise: bool = True,
                 with_amax_reduction: bool = False, amax_reduction_group: Optional[object] = None,
                 with_rht: bool = False, with_post_rht_amax: Optional[bool] = None,
                 with_2d_quantization: bool = False, stochastic_rounding: bool = False,
                 with_random_sign_mask: bool = True, generator: Optional[torch.Generator] = None) -> None:
        super().__init__(fp4_dtype, with_rht=with_rht, stochastic_rounding=stochastic_rounding,
                         with_random_sign_mask=with_random_sign_mask, generator=generator, rowwise=rowwise,
                         columnwise=columnwise)
        if with_rht and with_post_rht_amax is False:
            raise ValueError("NVFP4Quantizer: with_rht takes the amax after the transform (with_post_rht_amax); "
                             "TransformerEngine implements no other mode")
        if with_amax_reduction and amax_reduction_group is None:
            raise ValueError("NVFP4Quantizer: with_amax_reduction needs an amax_reduction_group")
        self.with_post_rht_amax = bool(with_rht)
        self.with_2d_quantization = bool(with_2d_quantization)
        self.amax_reduction_group = amax_reduction_group

    def _quantize_2d(self, t: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed codes (rows, cols / 2), E4M3 scales (rows, cols / 16)) of a 2-D tensor under global amax."""
        rows, cols = t.shape
        tile = 16 if self.with_2d_quantization else 1
        s_enc, rbits = nvfp4_global_encode_scale(amax), self._random_bits(t)
        fused = fused_cast.quantize_nvfp4(t.contiguous(), nvfp4_block_factors(s_enc).reshape(2), rbits, tile)
        if fused is not None:
            return fused
        blocks = t.float().reshape(rows // tile, tile, cols // 16, 16)
        scale, encode = nvfp4_block_scales(blocks.abs().amax(dim=(1, 3)), s_enc)
        data = self._encode((blocks * encode[:, None, :, None]).reshape(rows, cols), rbits)
        return data, (scale.repeat_interleave(tile, dim=0) if tile > 1 else scale)

    def _sources(self, x2d: torch.Tensor) -> tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
        """(the columnwise source or None, x2d's amax, the columnwise amax): one amax pass where no transform
        makes the two differ, none at all where the fused transform takes both amaxes from its own read."""
        if self.columnwise_usage and self.with_rht:
            fused = fused_cast.hadamard_columns(x2d, self.rht_sign_mask)
            if fused is not None:
                col, amax_col, amax = fused
                return col, amax, amax_col
            col = self._columnwise_source(x2d)
            return col, _fp4_amax(x2d), _fp4_amax(col)
        amax = _fp4_amax(x2d)
        return (x2d.t() if self.columnwise_usage else None), amax, amax

    def _tiles_both_layouts(self, x2d: torch.Tensor, amax: torch.Tensor) -> Optional[tuple[torch.Tensor, ...]]:
        """(rowwise data, scales, columnwise data, scales) of 16x16 tiles from one fused pass: without a transform
        or stochastic rounding the columnwise form is the transpose of the rowwise one (a tile's scale and codes
        do not depend on the way it is read). None where that does not hold or the extension does not apply."""
        if not self.with_2d_quantization or self.with_rht or self.stochastic_rounding:
            return None
        factors = nvfp4_block_factors(nvfp4_global_encode_scale(amax)).reshape(2)
        return fused_cast.quantize_nvfp4(x2d.contiguous(), factors, None, 16, columnwise=True)

    def quantize(self, x: torch.Tensor) -> NVFP4TensorStorage:
        x2d = _fp4_2d(x, 16, "NVFP4")
        out = NVFP4TensorStorage(self.fp8_dtype, x.shape, x.dtype, with_2d_quantization=self.with_2d_quantization)
        col, amax, amax_col = self._sources(x2d)
        if self.amax_reduction_group is not None:
            both = torch.cat([amax, amax_col])
            torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX, group=self.amax_reduction_group)
            amax, amax_col = both[:1], both[1:]
        out.amax_rowwise, out.amax_columnwise = amax, amax_col
        tiles = self._tiles_both_layouts(x2d, amax) if self.rowwise_usage and col is not None else None
        if tiles is not None:
            data, out.rowwise_scale_inv, out.columnwise_data, out.columnwise_scale_inv = tiles
        elif self.rowwise_usage:
            data, out.rowwise_scale_inv = self._quantize_2d(x2d, amax)
        if self.rowwise_usage:
            out.rowwise_data = data.reshape(*x.shape[:-1], x.shape[-1] // 2)
        if col is not None and tiles is None:
            out.columnwise_data, out.columnwise_scale_inv = self._quantize_2d(col, amax_col)
            out.columnwise_rht_sign_mask = self.rht_sign_mask if self.with_rht else None
        return out


class MXFP4Quantizer(_FP4Quantizer):
    """MXFP4: E2M1 codes with an E8M0 (power-of-2) scale per 32 elements along the last stored dim. `rounding`
    "floor" (the OCP MX rule: 2^(floor(log2(amax)) - 2), 2 being E2M1's emax; elements saturate to +-6) or
    "ceil" (2^ceil(log2(amax / 6))). A block holding NaN/Inf stores the NaN scale 0xFF. Rowwise blocks run
    along the last dim, columnwise blocks along the first (flattened) one, Hadamard-transformed first with
    `with_rht`. Both dims of the 2-D form must be divisible by 32."""

    def __init__(self, fp4_dtype: FP4Dtype = FP4Dtype.E2M1, *, rowwise: bool = True, columnwise: bool = True,
                 rounding: str = "floor", block_len: int = 32, with_rht: bool = False,
                 stochastic_rounding: bool = False, with_random_sign_mask: bool = True,
                 generator: Optional[torch.Generator] = None) -> None:
        super().__init__(fp4_dtype, with_rht=with_rht, stochastic_rounding=stochastic_rounding,
                         with_random_sign_mask=with_random_sign_mask, generator=generator, rowwise=rowwise,
                         columnwise=columnwise)
        if rounding not in ("floor", "ceil"):
            raise ValueError(f"rounding must be 'floor' or 'ceil', got {rounding!r}")
        if block_len % 16:
            raise ValueError(f"block_len must be a multiple of 16, got {block_len!r}")
        self.rounding = rounding
        self.block_len = block_len

    def _quantize_2d(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed codes (rows, cols / 2), E8M0 scales (rows, cols / block_len)) of a 2-D tensor."""
        rows, cols = t.shape
        blocks = t.float().reshape(rows, cols // self.block_len, self.block_len)
        amax = blocks.abs().amax(dim=-1)
        exponent = mx_scale_exponent(amax, FP4Dtype.E2M1.max, FP4Dtype.E2M1.emax, self.rounding)
        code = torch.where(torch.isfinite(amax), e8m0_encode(exponent), 0xFF)
        scale = torch.ldexp(torch.ones_like(amax), exponent)
        scaled = (blocks / scale[:, :, None]).reshape(rows, cols)
        return self._encode(scaled, self._random_bits(scaled)), code

    def _fused(self, t: torch.Tensor, rowwise: bool, columnwise: bool) -> Optional[list[Optional[torch.Tensor]]]:
        """[rowwise data, scales, columnwise data, scales] of a 2-D tensor from the fused kernel (the same bits as
        `_quantize_2d`, its codes packed here; the forms not asked for None), or None where it does not apply:
        stochastic rounding, nothing asked, or an input the kernel does not take."""
        if self.stochastic_rounding or not (rowwise or columnwise):
            return None
        fused = fused_cast.quantize_tiles(t, "e2m1", None, mode=self.rounding, tile_rows=1, block=self.block_len,
                                          rowwise=rowwise, columnwise=columnwise, fp8_max=FP4Dtype.E2M1.max,
                                          emax=FP4Dtype.E2M1.emax)
        return None if fused is None else [f if i % 2 or f is None else pack_fp4(f) for i, f in enumerate(fused)]

    def quantize(self, x: torch.Tensor) -> MXFP4TensorStorage:
        x2d = _fp4_2d(x, self.block_len, "MXFP4")
        out = MXFP4TensorStorage(self.fp8_dtype, x.shape, x.dtype, block_len=self.block_len)
        transformed = self.columnwise_usage and self.with_rht
        fused = self._fused(x2d, self.rowwise_usage, self.columnwise_usage and not transformed)
        if fused is not None:
            data, out.rowwise_scale_inv, out.columnwise_data, out.columnwise_scale_inv = fused
            out.rowwise_data = None if data is None else data.reshape(*x.shape[:-1], x.shape[-1] // 2)
        else:
            if self.rowwise_usage:
                data, out.rowwise_scale_inv = self._quantize_2d(x2d)
                out.rowwise_data = data.reshape(*x.shape[:-1], x.shape[-1] // 2)
            if self.columnwise_usage and not transformed:
                out.columnwise_data, out.columnwise_scale_inv = self._quantize_2d(x2d.t())
        if transformed:
            col = self._columnwise_source(x2d)
            fused = self._fused(col, True, False)
            out.columnwise_data, out.columnwise_scale_inv = fused[:2] if fused is not None else self._quantize_2d(col)
            out.columnwise_rht_sign_mask = self.rht_sign_mask
        return out


def record_nonfinite(quantizer: Quantizer, out: QuantizedTensorStorage) -> QuantizedTensorStorage:
    """`record_nonfinite_many` of one quantized tensor."""
    return record_nonfinite_many([quantizer], [out])[0]


def record_nonfinite_many(quantizers: Sequence[Quantizer], outs: Sequence[QuantizedTensorStorage]
                          ) -> Sequence[QuantizedTensorStorage]:
    """Note each quantized tensor's decode scales for its quantizer's non-finite flag (those that have one)
    and return `outs`. A quantizer with a `nonfinite_pending` list (a watched module's: the state manager's
    list for the whole step) only notes (flag, scales) there, no device op; the state manager folds the
    step's pairs at once (`FP8GlobalStateManager.fold_nonfinite`) before it reads the flags, the list itself
    sooner in a large step (`PendingPairs`). Without one the pairs are folded now."""
    now: list[NonfinitePair] = []
    for q, out in zip(quantizers, outs):
        if q.nonfinite is None:
            continue
        if isinstance(out, Float8TensorStorage):
            pair = (q.nonfinite, out.scale_inv, False)
        else:
            scales = out.nonfinite_scales()
            if not scales.numel():  # an empty tensor (an expert without tokens) has none
                continue
            pair = (q.nonfinite, scales, True)
        if q.nonfinite_pending is None:
            now.append(pair)
        else:
            q.nonfinite_pending.note(pair)
    if now:
        fold_nonfinite_pairs(now)
    return outs
