"""A CPU stand-in for `torch_npu` (2.14.0): the quantization and GEMM kernels the NPU backend calls.

No NPU exists in CI, so the NPU backend is tested against this simulator. `make_simulator()` returns a fresh
module object that can be put where `torch_npu` would be (`sys.modules["torch_npu"] = sim`). Each kernel

* checks its arguments the way the real kernel's contract does (the op-plugin meta registrations and docs of
  torch_npu 2.14.0, and the CANN docs of the Ascend 950 series) and raises on any violation. The errors are
  `RuntimeError`s, as torch_npu's are, and also `TypeError` (dtypes) or `ValueError` (shapes, values); the
  message starts with the kernel's name and names the offending argument;
* computes the reference result on CPU with the project's exact format casts (`mindspeed_te.formats`);
* counts itself in `sim.launch_counts` once its arguments passed the checks (a rejected call launches nothing).

Keyword names follow torch_npu 2.14. The first tensor of the single-input kernels is positional-only here: the
real ops are `torch.ops.npu` overloads whose schema calls it `self` or `x` while the docs say `input`, so the
library must pass it positionally.

Calls the real kernel accepts but that the library never makes (int8/int4/FP4 data, pseudo-quantization,
activations fused into grouped GEMMs, ...) raise `NpuSimNotImplemented` instead of being guessed at.

dtype arguments take what torch_npu's Python binding takes: a `torch.dtype`, a torch ScalarType number, or one
of torch_npu's own dtype numbers (ACL enum + 256): `hifloat8` 290, `float8_e5m2` 291, `float8_e4m3fn` 292,
`float8_e8m0fnu` 293, `float4_e2m1fn_x2` 296. 291/292 mean the same as the native `torch.float8_e5m2` /
`torch.float8_e4m3fn`; HiF8 has no torch dtype, so HiF8 codes travel in `torch.uint8` tensors and the kernel is
told what they are through its dtype argument (`x1_dtype=sim.hifloat8`, ...).
"""
from __future__ import annotations

import collections
import functools
import math
import types
from collections.abc import Sequence
from typing import Any, Callable, Optional, Union

import torch

__all__ = [
    "NpuSimulator",
    "make_simulator",
    "NpuContractError",
    "NpuTypeError",
    "NpuValueError",
    "NpuSocError",
    "NpuSimNotImplemented",
    "HIFLOAT8",
    "FLOAT8_E5M2",
    "FLOAT8_E4M3FN",
    "FLOAT8_E8M0FNU",
    "FLOAT4_E2M1FN_X2",
]

# torch_npu dtype numbers (ACL dtype enum + 256), as in torch_npu 2.14's meta registrations.
INT4 = 285
HIFLOAT8 = 290
FLOAT8_E5M2 = 291
FLOAT8_E4M3FN = 292
FLOAT8_E8M0FNU = 293
FLOAT4_E2M1FN_X2 = 296
FLOAT4_E1M2FN_X2 = 297

DtypeArg = Union[torch.dtype, int, None]
Dtype = Union[torch.dtype, int]  # canonical form: a torch.dtype, or an NPU-only number (285, 290, 293, 296, 297)

# Numbers the binding turns into native dtypes: torch ScalarType values, plus torch_npu's FP8 aliases.
_NUMBER_TO_NATIVE = {
    0: torch.uint8, 1: torch.int8, 2: torch.int16, 3: torch.int32, 4: torch.int64, 5: torch.float16,
    6: torch.float32, 7: torch.float64, 11: torch.bool, 12: torch.qint8, 13: torch.quint8, 14: torch.qint32,
    15: torch.bfloat16, 16: torch.quint4x2, 21: torch.bits8, 23: torch.float8_e5m2, 24: torch.float8_e4m3fn,
    FLOAT8_E5M2: torch.float8_e5m2, FLOAT8_E4M3FN: torch.float8_e4m3fn,
}
_NPU_ONLY_NAMES = {
    INT4: "torch_npu.int4",
    HIFLOAT8: "torch_npu.hifloat8",
    FLOAT8_E8M0FNU: "torch_npu.float8_e8m0fnu",
    FLOAT4_E2M1FN_X2: "torch_npu.float4_e2m1fn_x2",
    FLOAT4_E1M2FN_X2: "torch_npu.float4_e1m2fn_x2",
}
_FP8_NATIVE = (torch.float8_e4m3fn, torch.float8_e5m2)
_FP4 = (FLOAT4_E2M1FN_X2, FLOAT4_E1M2FN_X2)
_HALF_FLOATS = (torch.float16, torch.bfloat16)
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_GEMM_OUT = (torch.float16, torch.bfloat16, torch.float32)
_HIF8_CARRIERS = (torch.uint8, torch.bits8)  # HiF8 codes arrive as uint8; npu_quantize returns torch.bits8
_E8M0_CARRIERS = (torch.uint8, torch.float8_e8m0fnu)
_HIF8_DST_MAX = (0.0, 15.0, 56.0, 224.0, 32768.0)  # targets the HiF8 quantizers accept (CANN, Ascend 950)
_BLOCK_ROWS = (1, 128, 256, 512)
_BLOCK_COLS = (64, 128, 192, 256)
_FP8_SOC_PREFIX = "Ascend950"
_MAX_GROUPS = 128


# Errors ---------------------------------------------------------------------------------------------------
class NpuContractError(RuntimeError):
    """A call the real kernel rejects. A RuntimeError, like the errors torch_npu raises."""


class NpuTypeError(NpuContractError, TypeError):
    """Wrong dtype or argument type."""


class NpuValueError(NpuContractError, ValueError):
    """Wrong shape, layout or option value."""


class NpuSocError(NpuContractError):
    """The simulated chip cannot run this (FP8/HiF8/MX need the Ascend 950 series)."""


class NpuSimNotImplemented(NotImplementedError):
    """A call the real kernel may accept but that this simulator does not model."""


# Small checkers (one concern each; messages name the argument) ----------------------------------------------
def _dtype_name(d: Any) -> str:
    if isinstance(d, torch.dtype):
        return str(d)
    return _NPU_ONLY_NAMES.get(d, repr(d))


def _names(allowed: Sequence[Any]) -> str:
    return ", ".join(_dtype_name(a) for a in allowed)


def _dtype_arg(name: str, value: DtypeArg, *, required: bool = False) -> Optional[Dtype]:
    """Canonical form of a dtype argument (None stays None unless `required`)."""
    if value is None:
        if required:
            raise NpuTypeError(f"{name} is required")
        return None
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        if value in _NPU_ONLY_NAMES:
            return value
        if value in _NUMBER_TO_NATIVE:
            return _NUMBER_TO_NATIVE[value]
    raise NpuTypeError(f"{name}={value!r} is not a dtype (a torch.dtype or a torch_npu dtype number)")


def _check_dtype(name: str, value: Any, allowed: Sequence[Any]) -> None:
    if value not in allowed:
        raise NpuTypeError(f"{name} must be one of [{_names(allowed)}], got {_dtype_name(value)}")


def _check_tensor(name: str, t: Any, dtypes: Optional[Sequence[torch.dtype]] = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise NpuTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None:
        _check_dtype(f"{name}.dtype", t.dtype, dtypes)
    return t


def _check_dims(name: str, t: torch.Tensor, lo: int, hi: int) -> None:
    if not lo <= t.dim() <= hi:
        want = f"{lo}" if lo == hi else f"{lo} to {hi}"
        raise NpuValueError(f"{name} must have {want} dims, got shape {tuple(t.shape)}")


def _check_shape(name: str, t: torch.Tensor, *expected: tuple[int, ...]) -> None:
    if tuple(t.shape) not in expected:
        want = " or ".join(str(e) for e in expected)
        raise NpuValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")


def _check_choice(name: str, value: Any, allowed: Sequence[Any], why: str = "") -> None:
    if value not in allowed or isinstance(value, bool) != any(isinstance(a, bool) for a in allowed):
        suffix = f" {why}" if why else ""
        raise NpuValueError(f"{name} must be one of {list(allowed)}{suffix}, got {value!r}")


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise NpuTypeError(f"{name} must be an int, got {value!r}")
    return value


def _check_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise NpuTypeError(f"{name} must be a finite float, got {value!r}")
    return float(value)


def _check_none(name: str, value: Any, why: str) -> None:
    if value is not None:
        raise NpuValueError(f"{name} must be None {why}")


def _check_axis(name: str, axis: Any, ndim: int) -> int:
    _check_int(name, axis)
    if not -ndim <= axis < ndim:
        raise NpuValueError(f"{name}={axis} is out of range [{-ndim}, {ndim - 1}]")
    return axis % ndim


def _layouts(t: torch.Tensor, dims: tuple[int, int] = (-2, -1)) -> set[str]:
    """Which of "row" (contiguous) and "col" (transposed view of a contiguous tensor over `dims`) fit `t`;
    both when a size-1 dim makes them indistinguishable."""
    found = set()
    if t.is_contiguous():
        found.add("row")
    if t.transpose(*dims).is_contiguous():
        found.add("col")
    return found


def _check_layout(name: str, t: torch.Tensor, allowed: Sequence[str] = ("row", "col"),
                  dims: tuple[int, int] = (-2, -1)) -> set[str]:
    found = _layouts(t, dims) & set(allowed)
    if not found:
        want = {"row": "contiguous", "col": "the transposed view of a contiguous tensor"}
        raise NpuValueError(f"{name} must be " + " or ".join(want[a] for a in allowed)
                            + f" (shape {tuple(t.shape)}, strides {t.stride()})")
    return found


def _check_scale_layout(name: str, scale: torch.Tensor, data_layouts: set[str],
                        dims: tuple[int, int] = (-2, -1)) -> None:
    """A scale tensor is a transposed view exactly when its data tensor is."""
    if not _layouts(scale, dims) & data_layouts:
        kind = "a transposed view" if data_layouts == {"col"} else "contiguous"
        raise NpuValueError(f"{name} must be {kind}, as its data tensor is (strides {scale.stride()})")


def _check_same_device(tensors: dict[str, Optional[torch.Tensor]]) -> None:
    devices = {n: t.device for n, t in tensors.items() if isinstance(t, torch.Tensor)}
    if len(set(devices.values())) > 1:
        raise NpuValueError(f"all tensors must be on one device, got {devices}")


def _check_list(name: str, value: Any, length: Optional[int] = None) -> list:
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in value):
        raise NpuTypeError(f"{name} must be a list of tensors, got {type(value).__name__}")
    if length is not None and len(value) != length:
        raise NpuValueError(f"{name} must hold {length} tensor(s), got {len(value)}")
    return list(value)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# Formats ---------------------------------------------------------------------------------------------------
def _formats():
    from mindspeed_te import formats  # imported lazily: importing torch_npu's stand-in stays cheap

    return formats


def _fp8_format(dtype: Dtype):
    """formats.FP8Dtype of a canonical 8-bit float dtype."""
    fp8 = _formats().FP8Dtype
    return {torch.float8_e4m3fn: fp8.E4M3, torch.float8_e5m2: fp8.E5M2, HIFLOAT8: fp8.HIF8}[dtype]


def _encode(x: torch.Tensor, dtype: Dtype, saturate: bool = True) -> torch.Tensor:
    """float32 values -> data of `dtype` (native fp8 tensor, or uint8 HiF8 codes). E4M3/E5M2 round to nearest
    even, HiF8 half away from zero (formats.cast_to_fp8)."""
    return _formats().cast_to_fp8(x, _fp8_format(dtype), saturate=saturate)


def _decode(t: torch.Tensor, dtype: Dtype) -> torch.Tensor:
    if t.dtype == torch.bits8:
        t = t.view(torch.uint8)
    return _formats().cast_from_fp8(t, _fp8_format(dtype))


def _format_max(dtype: Dtype) -> float:
    return _fp8_format(dtype).max


def _e8m0_values(scale: torch.Tensor) -> torch.Tensor:
    """float32 values 2^(b - 127) of E8M0 bytes (0xFF is NaN)."""
    b = scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale
    values = torch.exp2(b.to(torch.float32) - 127.0)
    return values.masked_fill(b == 0xFF, float("nan"))


def _block_amax(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """max |x| over (rows x cols) tiles of the last two dims (edge tiles partial) -> (..., ceil(m/r), ceil(n/c))."""
    *batch, m, n = x.shape
    mp, np_ = _ceil_div(m, rows) * rows, _ceil_div(n, cols) * cols
    padded = torch.nn.functional.pad(x.abs(), (0, np_ - n, 0, mp - m))
    tiles = padded.reshape(*batch, mp // rows, rows, np_ // cols, cols)
    return tiles.amax(dim=(-3, -1))


def _decode_scale(amax: torch.Tensor, target: float) -> torch.Tensor:
    """amax / target in one IEEE division, at least 1/FLT_MAX; 1 for an all-zero group, NaN for a group
    holding NaN/Inf (so it decodes to NaN). The wheel does not say what such groups get; this is the
    library's convention (scaling.py: current_scale_inv, mark_nonfinite)."""
    finite = torch.nan_to_num(amax, nan=0.0, posinf=0.0)
    scale = torch.div(finite, torch.full_like(finite, target)).clamp(min=1.0 / torch.finfo(torch.float32).max)
    return torch.where(finite > 0, scale, torch.ones_like(scale)) + amax * 0.0


def _expand_blocks(s: torch.Tensor, rows: int, cols: int, m: int, n: int) -> torch.Tensor:
    """Per-tile values (..., ceil(m/r), ceil(n/c)) broadcast back to (..., m, n)."""
    return s.repeat_interleave(rows, dim=-2)[..., :m, :].repeat_interleave(cols, dim=-1)[..., :n]


# The simulator ----------------------------------------------------------------------------------------------
def _kernel(fn: Optional[Callable] = None, *, differentiable: bool = False) -> Callable:
    """Count a call once its checks passed; prefix contract errors with the kernel name. Kernels torch_npu
    gives no backward (the quantizers, the quantized GEMM) run under no_grad, as their outputs carry no graph."""
    if fn is None:
        return functools.partial(_kernel, differentiable=differentiable)
    name = fn.__name__

    @functools.wraps(fn)
    def wrapper(self: NpuSimulator, *args: Any, **kwargs: Any) -> Any:
        try:
            if differentiable:
                result = fn(self, *args, **kwargs)
            else:
                with torch.no_grad():
                    result = fn(self, *args, **kwargs)
        except (NpuContractError, NpuSimNotImplemented) as err:
            raise type(err)(f"{name}: {err}") from None
        self.launch_counts[name] += 1
        return result

    return wrapper


class _Mc2Mixin:
    """Fused matmul + communication kernels (`--use-ascend-mc2`), run over the torch.distributed group that
    `hcom` names: high precision (fp16/bf16), or MXFP8 with E8M0 x1_scale (m, ceil(k/64), 2) and x2_scale
    (ceil(k/64), n, 2) as in npu_quant_matmul's [1, 1, 32] mode (output_dtype then required)."""

    def _mc2_operands(self, kernel: str, x1: torch.Tensor, x2: torch.Tensor, hcom: Any, world_size: Any,
                      bias: Any, x1_scale: Any, x2_scale: Any, output_dtype: DtypeArg) -> tuple:
        """(group, output dtype, whether MX) after the contract checks."""
        import torch.distributed as dist

        _check_tensor("self", x1)
        _check_tensor("x2", x2)
        _check_dims("self", x1, 2, 2)
        _check_dims("x2", x2, 2, 2)
        if x1.shape[1] != x2.shape[0]:
            raise NpuValueError(f"k of self {tuple(x1.shape)} and x2 {tuple(x2.shape)} differ")
        _check_none("bias", bias, f"for {kernel} (it takes no bias)")
        mx = x1_scale is not None or x2_scale is not None
        if mx:
            if x1_scale is None or x2_scale is None:
                raise NpuValueError("MX needs both x1_scale and x2_scale")
            _check_dtype("self.dtype", x1.dtype, _FP8_NATIVE)
            _check_dtype("x2.dtype", x2.dtype, _FP8_NATIVE)
            self._require_fp8_soc(kernel)
            out_dtype = _dtype_arg("output_dtype", output_dtype, required=True)
            _check_dtype("output_dtype", out_dtype, _GEMM_OUT)
        else:
            _check_dtype("self.dtype", x1.dtype, _HALF_FLOATS)
            _check_dtype("x2.dtype", x2.dtype, (x1.dtype,))
            out_dtype = x1.dtype
        if not isinstance(hcom, str) or hcom not in self._groups:
            raise NpuValueError(f"hcom must be the HCCL communicator name of the group, got {hcom!r}")
        group = self._groups[hcom]
        size = dist.get_world_size(group)
        if world_size is not None:
            _check_choice("world_size", _check_int("world_size", world_size), (2, 4, 8, 16, 32))
            if world_size != size:
                raise NpuValueError(f"world_size={world_size} but the hcom group has {size} ranks")
        return group, out_dtype, mx

    def _mc2_matmul(self, x1, x2, x1_scale, x2_scale, mx: bool) -> torch.Tensor:
        if not mx:
            return x1.float() @ x2.float()
        a, b = self._mx_operands(x1, x2, x1.dtype, x2.dtype, x2_scale, x1_scale,
                                 _check_layout("self", x1, ("row",)), _check_layout("x2", x2))
        return a @ b

    @_kernel
    def npu_all_gather_base_mm(self, input: torch.Tensor, /, x2: torch.Tensor, hcom: str, world_size: int,
                               bias: Optional[torch.Tensor] = None, x1_scale: Optional[torch.Tensor] = None,
                               x2_scale: Optional[torch.Tensor] = None, gather_index: int = 0,
                               gather_output: bool = True, comm_turn: int = 0, output_dtype: DtypeArg = None,
                               comm_mode: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(all_gather(input) @ x2, all_gather(input)): input (and its x1_scale) gathered along dim 0, then the
        GEMM with fp32 accumulation."""
        import torch.distributed as dist

        group, out_dtype, mx = self._mc2_operands("npu_all_gather_base_mm", input, x2, hcom, world_size, bias,
                                                  x1_scale, x2_scale, output_dtype)
        _check_choice("gather_index", gather_index, (0,), "(gathering x2 is not simulated)")

        def gather(t: torch.Tensor) -> torch.Tensor:
            raw = t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous()
            out = raw.new_empty(world_size * raw.shape[0], *raw.shape[1:])
            dist.all_gather_into_tensor(out, raw, group=group)
            return out.view(t.dtype)

        gathered = gather(input)
        scale = gather(x1_scale) if mx else None
        out = self._mc2_matmul(gathered, x2, scale, x2_scale, mx).to(out_dtype)
        return out, (gathered if gather_output else gathered.new_empty(0))

    @_kernel
    def npu_mm_reduce_scatter_base(self, input: torch.Tensor, /, x2: torch.Tensor, hcom: str, world_size: int,
                                   reduce_op: str = "sum", bias: Optional[torch.Tensor] = None,
                                   x1_scale: Optional[torch.Tensor] = None, x2_scale: Optional[torch.Tensor] = None,
                                   comm_turn: int = 0, output_dtype: DtypeArg = None,
                                   comm_mode: Optional[str] = None) -> torch.Tensor:
        """reduce_scatter(input @ x2) along dim 0 (fp32 GEMM and reduction)."""
        import torch.distributed as dist

        group, out_dtype, mx = self._mc2_operands("npu_mm_reduce_scatter_base", input, x2, hcom, world_size, bias,
                                                  x1_scale, x2_scale, output_dtype)
        _check_choice("reduce_op", reduce_op, ("sum",))
        if input.shape[0] % world_size:
            raise NpuValueError(f"self's dim 0 ({input.shape[0]}) must be divisible by world_size ({world_size})")
        full = self._mc2_matmul(input, x2, x1_scale, x2_scale, mx).contiguous()
        out = torch.empty(input.shape[0] // world_size, x2.shape[1], dtype=torch.float32)
        dist.reduce_scatter_tensor(out, full, group=group)
        return out.to(out_dtype)

    @_kernel
    def npu_mm_all_reduce_base(self, x1: torch.Tensor, x2: torch.Tensor, hcom: str, reduce_op: str = "sum",
                               bias: Optional[torch.Tensor] = None, **quantized: Any) -> torch.Tensor:
        """all_reduce(x1 @ x2) (fp32 GEMM and reduction, output in x1's dtype). High precision only here."""
        import torch.distributed as dist

        if any(isinstance(v, torch.Tensor) for v in quantized.values()):
            raise NpuSimNotImplemented("npu_mm_all_reduce_base: quantized forms are not simulated")
        group, out_dtype, _ = self._mc2_operands("npu_mm_all_reduce_base", x1, x2, hcom, None, bias, None, None,
                                                 None)
        _check_choice("reduce_op", reduce_op, ("sum",))
        full = (x1.float() @ x2.float()).contiguous()
        dist.all_reduce(full, group=group)
        return full.to(out_dtype)


class _AttentionMixin:
    """npu_fusion_attention, the fused attention kernel (forward here; autograd gives the backward)."""

    @_kernel(differentiable=True)
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
        _check_tensor("query", query, _FLOATS)
        _check_tensor("key", key, (query.dtype,))
        _check_tensor("value", value, (query.dtype,))
        _check_choice("input_layout", input_layout, ("SBH", "BSH", "BNSD", "BSND", "TND"))
        if input_layout != "SBH":
            raise NpuSimNotImplemented(f"input_layout={input_layout!r}: only 'SBH' is simulated")
        _check_choice("sparse_mode", _check_int("sparse_mode", sparse_mode), tuple(range(9)))
        if sparse_mode != 0 or pse is not None or padding_mask is not None or prefix is not None:
            raise NpuSimNotImplemented("only sparse_mode=0 with an explicit atten_mask, no pse/padding_mask/prefix")
        if _check_float("keep_prob", keep_prob) != 1.0:
            raise NpuSimNotImplemented("keep_prob < 1 (dropout) is not simulated")
        head = _check_int("head_num", head_num)
        s_q, b, hidden = query.shape
        if hidden % head:
            raise NpuValueError(f"query hidden size {hidden} is not a multiple of head_num {head}")
        d = hidden // head
        if key.shape[2] % d or head % (key.shape[2] // d) or value.shape[2] != key.shape[2]:
            raise NpuValueError(f"key/value hidden sizes {key.shape[2]}/{value.shape[2]} do not fit head_dim {d}")
        q = query.reshape(s_q, b, head, d).permute(1, 2, 0, 3)
        kv_heads = key.shape[2] // d
        k = key.reshape(key.shape[0], b, kv_heads, d).permute(1, 2, 0, 3).repeat_interleave(head // kv_heads, 1)
        v = value.reshape(value.shape[0], b, kv_heads, d).permute(1, 2, 0, 3).repeat_interleave(head // kv_heads, 1)
        allowed = None
        if atten_mask is not None:
            _check_tensor("atten_mask", atten_mask, (torch.bool, torch.uint8))
            allowed = ~atten_mask.bool()
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=_check_float(
            "scale", scale))
        out = out.permute(2, 0, 1, 3).reshape(s_q, b, hidden)
        stats = torch.zeros(b, head, s_q, 8)
        return out, stats, stats.clone(), query.new_empty(0), seed, offset, 0


class NpuSimulator(_Mc2Mixin, _AttentionMixin, types.ModuleType):
    """Module object usable in place of `torch_npu`; see the module docstring."""

    hifloat8 = HIFLOAT8
    float8_e5m2 = FLOAT8_E5M2
    float8_e4m3fn = FLOAT8_E4M3FN
    float8_e8m0fnu = FLOAT8_E8M0FNU
    float4_e2m1fn_x2 = FLOAT4_E2M1FN_X2
    float4_e1m2fn_x2 = FLOAT4_E1M2FN_X2
    int4 = INT4
    is_simulator = True

    def __init__(self, soc_name: str = "Ascend950PR") -> None:
        super().__init__("torch_npu", "CPU simulator of torch_npu 2.14 kernels (mindspeed_te.kernels.npu_sim)")
        self.__version__ = "2.14.0"
        self.soc_name = soc_name
        self.launch_counts: collections.Counter = collections.Counter()
        npu = types.ModuleType("torch_npu.npu")
        npu.get_device_name = lambda device=None: soc_name
        npu.is_available = lambda: True
        npu.device_count = lambda: 1
        self.npu = npu
        self._groups: dict[str, Any] = {}

    def hcom_of(self, group: Any) -> str:
        """Simulator stand-in for `group._get_backend(npu).get_hccl_comm_name(rank)`: the communicator name
        the fused matmul+communication kernels take as `hcom`."""
        name = f"sim_hccl_{id(group)}"
        self._groups[name] = group
        return name

    # bookkeeping
    def reset_counts(self) -> None:
        self.launch_counts.clear()

    def total_launches(self) -> int:
        return sum(self.launch_counts.values())

    @property
    def supports_fp8(self) -> bool:
        """FP8, HiF8 and MX kernels exist on the Ascend 950 series only."""
        return self.soc_name.startswith(_FP8_SOC_PREFIX)

    def _require_fp8_soc(self, what: str) -> None:
        if not self.supports_fp8:
            raise NpuSocError(f"{what} needs an Ascend 950 series chip; the simulated chip is {self.soc_name}")

    # quantizers ------------------------------------------------------------------------------------------
    @_kernel
    def npu_quantize(self, input: torch.Tensor, /, scales: torch.Tensor, zero_points: Optional[torch.Tensor],
                     dtype: DtypeArg, axis: int = 1, div_mode: bool = True) -> torch.Tensor:
        """y = input / scales (div_mode), scales 1-D of size 1 or input.shape[axis], broadcast along `axis`.
        FP8 outputs are native float8 tensors (saturating cast, nearest-even); HiF8 codes come back as
        `torch.bits8` (view them as uint8), rounded half away from zero."""
        _check_tensor("input", input, _FLOATS)
        _check_tensor("scales", scales)
        out = _dtype_arg("dtype", dtype, required=True)
        _check_dtype("dtype", out, (*_FP8_NATIVE, HIFLOAT8, torch.qint8, torch.quint8, torch.qint32,
                                    torch.int8, torch.uint8, torch.int32, torch.quint4x2))
        if out not in (*_FP8_NATIVE, HIFLOAT8):
            raise NpuSimNotImplemented(f"dtype={_dtype_name(out)}: only float8/HiF8 outputs are simulated")
        self._require_fp8_soc(f"dtype={_dtype_name(out)}")
        if div_mode is not True:
            raise NpuValueError("div_mode must be True for float8/HiF8 outputs (div_mode=False supports only "
                                "torch.qint8 and torch.quint4x2)")
        dim = _check_axis("axis", axis, input.dim())
        scale_dtypes = (torch.float32, torch.bfloat16) if input.dtype == torch.float32 else (input.dtype,)
        _check_dtype("scales.dtype", scales.dtype, scale_dtypes)
        _check_dims("scales", scales, 1, 1)
        _check_shape("scales", scales, (1,), (input.shape[dim],))
        if zero_points is not None:
            raise NpuSimNotImplemented("zero_points with float8/HiF8 outputs are not simulated")
        _check_same_device({"input": input, "scales": scales})
        view = [1] * input.dim()
        view[dim] = scales.numel()
        y = _encode(input.float() / scales.float().reshape(view), out)
        return y.view(torch.bits8) if out == HIFLOAT8 else y

    @_kernel
    def npu_dynamic_quant(self, input: torch.Tensor, /, *, smooth_scales: Optional[torch.Tensor] = None,
                          group_index: Optional[torch.Tensor] = None, dst_type: DtypeArg = None,
                          quant_mode: str = "pertoken", dst_type_max: float = 0.0
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """Symmetric dynamic quantization: scale = amax / dst_max, y = cast(x / scale); `scale` (float32) is
        what y is multiplied by to get x back. amax per row ("pertoken", scale shape input.shape[:-1]), per
        column ("perchannel", input.shape[:-2] + input.shape[-1:]) or of the whole tensor ("pertensor", (1,)).
        dst_max = dst_type_max, or the format's max when 0. The wheel is silent on an all-zero group; the
        simulator gives it scale 1 (and y 0) and keeps scales >= 1/FLT_MAX, see `_decode_scale`."""
        _check_tensor("input", input, _HALF_FLOATS)
        if input.dim() < 2:
            raise NpuValueError(f"input must have more than 1 dim, got shape {tuple(input.shape)}")
        out = _dtype_arg("dst_type", dst_type) or torch.int8
        _check_dtype("dst_type", out, (torch.int8, torch.quint4x2, *_FP8_NATIVE, HIFLOAT8))
        if out not in (*_FP8_NATIVE, HIFLOAT8):
            raise NpuSimNotImplemented(f"dst_type={_dtype_name(out)}: only float8/HiF8 outputs are simulated")
        self._require_fp8_soc(f"dst_type={_dtype_name(out)}")
        _check_choice("quant_mode", quant_mode, ("pertoken", "pertensor", "perchannel"))
        target = self._dst_type_max(out, dst_type_max)
        x = input.float()
        if smooth_scales is not None:
            x = x * self._smooth_factor(input, smooth_scales, group_index)
        elif group_index is not None:
            raise NpuValueError("group_index needs smooth_scales")
        if quant_mode == "pertoken":
            amax = x.abs().amax(dim=-1, keepdim=True)
        elif quant_mode == "perchannel":
            amax = x.abs().amax(dim=-2, keepdim=True)
        else:
            amax = x.abs().amax().reshape([1] * x.dim())
        scale = _decode_scale(amax, target)
        y = _encode(x / scale, out)
        shape = {"pertoken": input.shape[:-1], "perchannel": input.shape[:-2] + input.shape[-1:],
                 "pertensor": (1,)}[quant_mode]
        return y, scale.reshape(shape)

    @staticmethod
    def _dst_type_max(out: Dtype, dst_type_max: Any) -> float:
        """The target max: dst_type_max, or the format's max when 0. Only HiF8 takes other values than 0."""
        value = _check_float("dst_type_max", dst_type_max)
        if out == HIFLOAT8:
            _check_choice("dst_type_max", value, _HIF8_DST_MAX, "for HiF8 output")
        elif value != 0.0:
            raise NpuValueError(f"dst_type_max must be 0 for {_dtype_name(out)} output, got {value}")
        return value or _format_max(out)

    @staticmethod
    def _smooth_factor(x: torch.Tensor, smooth: torch.Tensor, group_index: Optional[torch.Tensor]
                       ) -> torch.Tensor:
        """smooth_scales broadcast over x's rows (a (G, n) table applied by group_index row ranges)."""
        _check_tensor("smooth_scales", smooth, (x.dtype,))
        n = x.shape[-1]
        if group_index is None:
            _check_shape("smooth_scales", smooth, (n,))
            return smooth.float()
        _check_tensor("group_index", group_index, (torch.int32,))
        _check_dims("smooth_scales", smooth, 2, 2)
        _check_shape("smooth_scales", smooth, (smooth.shape[0], n))
        _check_shape("group_index", group_index, (smooth.shape[0],))
        rows = x.numel() // n
        ends = group_index.tolist()
        if any(b < a for a, b in zip([0] + ends, ends)) or ends[-1] != rows:
            raise NpuValueError(f"group_index must be non-decreasing and end at the row count {rows}, got {ends}")
        counts = torch.tensor([b - a for a, b in zip([0] + ends, ends)])
        table = smooth.float().repeat_interleave(counts, dim=0)
        return table.reshape(x.shape)

    @_kernel
    def npu_dynamic_block_quant(self, x: torch.Tensor, /, *, min_scale: float = 0.0, round_mode: str = "rint",
                                dst_type: DtypeArg = 1, row_block_size: int = 1, col_block_size: int = 128,
                                dst_type_max: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-tile quantization over the last two dims (x 2-D or 3-D, tiles row_block_size x col_block_size,
        edge tiles partial): scale = max(amax / dst_max, min_scale), y = cast(x / scale), like
        npu_dynamic_quant's formula (float32 scale of shape (..., ceil(rows / row_block_size),
        ceil(cols / col_block_size)), x = y * scale). All-zero tiles as in `_decode_scale`."""
        _check_tensor("x", x, _HALF_FLOATS)
        _check_dims("x", x, 2, 3)
        out = _dtype_arg("dst_type", dst_type, required=True)
        if self.supports_fp8:
            _check_dtype("dst_type", out, (*_FP8_NATIVE, HIFLOAT8))
        else:
            raise NpuSimNotImplemented(f"only the Ascend 950 form (float8/HiF8 output) is simulated, "
                                       f"the chip is {self.soc_name}")
        need = "round" if out == HIFLOAT8 else "rint"
        if round_mode != need:
            raise NpuValueError(f"round_mode must be {need!r} for {_dtype_name(out)} output, got {round_mode!r}")
        _check_choice("row_block_size", _check_int("row_block_size", row_block_size), _BLOCK_ROWS)
        _check_choice("col_block_size", _check_int("col_block_size", col_block_size), _BLOCK_COLS)
        floor = _check_float("min_scale", min_scale)
        if floor < 0:
            raise NpuValueError(f"min_scale must be >= 0, got {floor}")
        target = self._dst_type_max(out, dst_type_max)
        xf = x.float()
        scale = _decode_scale(_block_amax(xf, row_block_size, col_block_size), target)
        if floor > 0:
            scale = torch.clamp(scale, min=floor)
        scale_full = _expand_blocks(scale, row_block_size, col_block_size, x.shape[-2], x.shape[-1])
        return _encode(xf / scale_full, out), scale

    @_kernel
    def npu_dynamic_mx_quant(self, input: torch.Tensor, /, *, axis: int = -1, round_mode: str = "rint",
                             dst_type: DtypeArg = FLOAT4_E2M1FN_X2, block_size: int = 32, scale_alg: int = 0,
                             dst_type_max: float = 0.0, max_low_bound: float = 0.0
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """MX quantization along `axis`: one E8M0 scale per block_size elements, y = cast(x / 2^e) (saturating,
        nearest-even). scale_alg 0 (OCP): e = floor(log2(amax)) - emax (8 for E4M3, 15 for E5M2); scale_alg 1:
        e = ceil(log2(max(amax, max_low_bound) / fmt_max)). Scale bytes b = e + 127 in [0, 254] (0xFF for a
        non-finite amax), returned as uint8 with `axis` replaced by ceil(blocks / 2) and a trailing dim of 2
        holding blocks (2i, 2i + 1): (m, ceil(k/64), 2) for axis=-1 of (m, k), (ceil(k/64), n, 2) for axis=0."""
        self._require_fp8_soc("npu_dynamic_mx_quant")
        _check_tensor("input", input, _FLOATS)
        _check_dims("input", input, 1, 7)
        dim = _check_axis("axis", axis, input.dim())
        out = _dtype_arg("dst_type", dst_type, required=True)
        _check_dtype("dst_type", out, (*_FP8_NATIVE, *_FP4))
        if out in _FP4:
            raise NpuSimNotImplemented(f"dst_type={_dtype_name(out)}: only FP8 outputs are simulated")
        if round_mode != "rint":
            raise NpuValueError(f"round_mode must be 'rint' for FP8 output, got {round_mode!r}")
        _check_int("block_size", block_size)
        if not (0 < block_size <= 1024 and block_size % 32 == 0):
            raise NpuValueError(f"block_size must be a multiple of 32 in [32, 1024], got {block_size}")
        _check_choice("scale_alg", _check_int("scale_alg", scale_alg), (0, 1), "for FP8 output")
        if _check_float("dst_type_max", dst_type_max) != 0.0:
            raise NpuValueError(f"dst_type_max must be 0 for FP8 output, got {dst_type_max}")
        bound = _check_float("max_low_bound", max_low_bound)
        if bound < 0 or (scale_alg != 1 and bound != 0.0):
            raise NpuValueError(f"max_low_bound must be >= 0, and 0 unless scale_alg is 1; got {bound}")
        if input.dtype == torch.float32 and (block_size != 32 or input.shape[dim] < 32):
            raise NpuValueError("float32 input needs block_size 32 and at least 32 elements along axis")
        x = input.float().movedim(dim, -1)
        n = x.shape[-1]
        blocks = _ceil_div(n, block_size)
        padded = torch.nn.functional.pad(x, (0, blocks * block_size - n))
        amax = padded.abs().reshape(*x.shape[:-1], blocks, block_size).amax(dim=-1)
        code = self._mx_scale_bytes(amax.clamp(min=bound) if scale_alg == 1 else amax, out, scale_alg)
        inv = torch.exp2(127.0 - code.double()).repeat_interleave(block_size, dim=-1)[..., :n]
        y = _encode((x.double() * inv).float(), out).movedim(-1, dim)
        code = torch.nn.functional.pad(code, (0, blocks % 2))  # pairs of blocks; the odd one out pads with 0
        pairs = code.to(torch.uint8).reshape(*code.shape[:-1], -1, 2).movedim(-2, dim)
        return y.contiguous(), pairs.contiguous()

    @staticmethod
    def _mx_scale_bytes(amax: torch.Tensor, out: Dtype, scale_alg: int) -> torch.Tensor:
        """E8M0 byte per block (int64): OCP floor rule (0) or round-up rule (1), clamped to [0, 254]."""
        fmt_max = _format_max(out)
        a = amax.double()
        if scale_alg == 0:
            emax = 8 if out == torch.float8_e4m3fn else 15
            exp = torch.frexp(a).exponent.to(torch.int64) - 1 - emax  # floor(log2(a)) for a > 0
        else:
            k = torch.ceil(torch.log2(a / fmt_max)).nan_to_num(0.0, posinf=0.0, neginf=-127.0).to(torch.int64)
            k = torch.where(fmt_max * torch.exp2((k - 1).double()) >= a, k - 1, k)  # exact fix-ups of log2
            exp = torch.where(fmt_max * torch.exp2(k.double()) < a, k + 1, k)
        code = torch.where(a > 0, exp + 127, torch.zeros_like(exp)).clamp(0, 254)
        return torch.where(torch.isfinite(a), code, torch.full_like(code, 0xFF))

    # GEMMs -----------------------------------------------------------------------------------------------
    @_kernel
    def npu_quant_matmul(self, x1: torch.Tensor, x2: torch.Tensor, scale: torch.Tensor, *,
                         offset: Optional[torch.Tensor] = None, pertoken_scale: Optional[torch.Tensor] = None,
                         bias: Optional[torch.Tensor] = None, output_dtype: DtypeArg = None,
                         x1_dtype: DtypeArg = None, x2_dtype: DtypeArg = None, pertoken_scale_dtype: DtypeArg = None,
                         scale_dtype: DtypeArg = None, group_sizes: Optional[Sequence[int]] = None,
                         y_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """out = x1 @ x2 with x1 (..., m, k) and x2 (..., k, n) (x2 contiguous or the transposed view of a
        contiguous (..., n, k)); `scale` dequantizes x2, `pertoken_scale` x1 (multipliers: x = data * scale):

        * group_sizes None / [0, 0, 0]: scale float32 (1,) or (n,); pertoken_scale None, (1,) or (m,);
          out = (x1 @ x2) * scale * pertoken_scale.
        * [1, 128, 128] / [128, 128, 128] (blockwise, 2-D only): pertoken_scale (ceil(m/g0), ceil(k/128)) and
          scale (ceil(k/128), ceil(n/128)), float32.
        * [1, 1, 32] (MX, 2-D only): scale_dtype = pertoken_scale_dtype = torch_npu.float8_e8m0fnu, uint8
          pertoken_scale (m, ceil(k/64), 2) and scale (ceil(k/64), n, 2).
        In the grouped modes a scale tensor is a transposed view exactly when its data tensor is.
        HiF8 operands are uint8 with x1_dtype = x2_dtype = torch_npu.hifloat8; output_dtype (float16, bfloat16
        or float32) is required; bias float32 (n,) or (batch, 1, n), added after dequantization."""
        _check_tensor("x1", x1)
        _check_tensor("x2", x2)
        _check_tensor("scale", scale)
        _check_same_device({"x1": x1, "x2": x2, "scale": scale, "pertoken_scale": pertoken_scale, "bias": bias})
        fmt1 = self._operand_dtype("x1", x1, x1_dtype, "x1_dtype")
        fmt2 = self._operand_dtype("x2", x2, x2_dtype, "x2_dtype")
        if (fmt1 == HIFLOAT8) != (fmt2 == HIFLOAT8):
            raise NpuTypeError(f"x1 ({_dtype_name(fmt1)}) and x2 ({_dtype_name(fmt2)}) must both be HiF8 or "
                               "both be float8_e4m3fn/float8_e5m2")
        out_dtype = _dtype_arg("output_dtype", output_dtype)
        if out_dtype is None:
            raise NpuTypeError("output_dtype is required for float8/HiF8 inputs (None means int8 output)")
        _check_dtype("output_dtype", out_dtype, _GEMM_OUT)
        _check_none("offset", offset, "for float8/HiF8 inputs (offset is for int8 inputs only)")
        if y_scale is not None:
            raise NpuSimNotImplemented("y_scale (quantized output) is not simulated")
        _check_dims("x1", x1, 2, 6)
        _check_dims("x2", x2, 2, 6)
        m, k = x1.shape[-2:]
        if x2.shape[-2] != k:
            raise NpuValueError(f"k of x1 {tuple(x1.shape)} and x2 {tuple(x2.shape)} differ")
        n = x2.shape[-1]
        lay1 = _check_layout("x1", x1)
        lay2 = _check_layout("x2", x2)
        groups = self._group_sizes(group_sizes)
        sdt = _dtype_arg("scale_dtype", scale_dtype)
        pdt = _dtype_arg("pertoken_scale_dtype", pertoken_scale_dtype)
        for name, d in (("scale_dtype", sdt), ("pertoken_scale_dtype", pdt)):
            if d is not None:
                _check_dtype(name, d, (FLOAT8_E8M0FNU,))
        if groups == (1, 1, 32):
            if fmt1 == HIFLOAT8:
                raise NpuTypeError("MX (group_sizes [1, 1, 32]) needs float8_e4m3fn/float8_e5m2 operands, not HiF8")
            if sdt is None or pdt is None:
                raise NpuTypeError("MX (group_sizes [1, 1, 32]) needs scale_dtype and pertoken_scale_dtype "
                                   "= torch_npu.float8_e8m0fnu")
        elif sdt is not None or pdt is not None:
            raise NpuValueError("scale_dtype/pertoken_scale_dtype (E8M0) need group_sizes [1, 1, 32]")
        if groups == (0, 0, 0):
            a, b = _decode(x1, fmt1), _decode(x2, fmt2)
            try:
                batch = torch.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
            except RuntimeError:
                raise NpuValueError(f"batch dims of x1 {tuple(x1.shape)} and x2 {tuple(x2.shape)} do not "
                                    "broadcast") from None
            self._check_plain_scales(scale, pertoken_scale, out_dtype, m, n)
            acc = torch.matmul(a, b) * scale.float()
            if pertoken_scale is not None:
                acc = acc * pertoken_scale.float().reshape(-1, 1)
        else:
            _check_dims("x1", x1, 2, 2)
            _check_dims("x2", x2, 2, 2)
            batch = torch.Size()
            if pertoken_scale is None:
                raise NpuValueError(f"pertoken_scale is required with group_sizes {list(groups)}")
            if groups == (1, 1, 32):
                a, b = self._mx_operands(x1, x2, fmt1, fmt2, scale, pertoken_scale, lay1, lay2)
            else:
                a, b = self._block_operands(x1, x2, fmt1, fmt2, scale, pertoken_scale, lay1, lay2, groups)
            acc = a @ b
        if bias is not None:
            acc = acc + self._quant_matmul_bias(bias, out_dtype, pertoken_scale, batch, n).float()
        return acc.to(out_dtype)

    def _operand_dtype(self, name: str, t: torch.Tensor, dtype_arg: DtypeArg, arg_name: str) -> Dtype:
        """The 8-bit format of a GEMM operand: its native float8 dtype, or HiF8 named by `arg_name`."""
        given = _dtype_arg(arg_name, dtype_arg)
        if given is None:
            if t.dtype in _FP8_NATIVE:
                self._require_fp8_soc(f"{name} of dtype {t.dtype}")
                return t.dtype
            if t.dtype in _HIF8_CARRIERS:
                raise NpuTypeError(f"{name} holds 1-byte codes ({t.dtype}); pass {arg_name}=torch_npu.hifloat8")
            if t.dtype in (torch.int8, torch.int32):
                raise NpuSimNotImplemented(f"{name} of dtype {t.dtype}: integer GEMMs are not simulated")
            raise NpuTypeError(f"{name}.dtype must be float8_e4m3fn, float8_e5m2, or uint8 with {arg_name}, "
                               f"got {t.dtype}")
        if given not in (HIFLOAT8, *_FP4):
            raise NpuTypeError(f"pass {arg_name} only when {name} is not a native torch dtype "
                               f"(torch_npu.hifloat8, torch_npu.float4_*); got {_dtype_name(given)}")
        if given in _FP4:
            raise NpuSimNotImplemented(f"{arg_name}={_dtype_name(given)}: FP4 is not simulated")
        if t.dtype not in _HIF8_CARRIERS:
            raise NpuTypeError(f"{name} must hold HiF8 codes as torch.uint8 when {arg_name} is "
                               f"torch_npu.hifloat8, got {t.dtype}")
        self._require_fp8_soc(f"{arg_name}=torch_npu.hifloat8")
        return HIFLOAT8

    @staticmethod
    def _group_sizes(group_sizes: Optional[Sequence[int]]) -> tuple[int, int, int]:
        if group_sizes is None:
            return (0, 0, 0)
        if not isinstance(group_sizes, (list, tuple)) or len(group_sizes) != 3:
            raise NpuValueError(f"group_sizes must be a list of 3 ints, got {group_sizes!r}")
        groups = tuple(_check_int("group_sizes", g) for g in group_sizes)
        allowed = [(0, 0, 0), (1, 128, 128), (128, 128, 128), (1, 1, 32)]
        if groups not in allowed:
            raise NpuValueError(f"group_sizes must be one of {[list(a) for a in allowed]}, got {list(groups)}")
        return groups

    @staticmethod
    def _check_plain_scales(scale: torch.Tensor, pertoken: Optional[torch.Tensor], out_dtype: Dtype,
                            m: int, n: int) -> None:
        """Per-tensor / per-channel scale of x2, per-tensor / per-token scale of x1."""
        allowed = (torch.float32, torch.bfloat16) if out_dtype == torch.bfloat16 else (torch.float32,)
        _check_dtype("scale.dtype", scale.dtype, allowed)
        _check_dims("scale", scale, 1, 1)
        _check_shape("scale", scale, (1,), (n,))
        if pertoken is not None:
            _check_dtype("pertoken_scale.dtype", pertoken.dtype, (torch.float32,))
            _check_dims("pertoken_scale", pertoken, 1, 1)
            _check_shape("pertoken_scale", pertoken, (1,), (m,))

    @staticmethod
    def _block_operands(x1, x2, fmt1, fmt2, scale, pertoken, lay1, lay2, groups):
        """Dequantized (m, k), (k, n) operands of the blockwise modes."""
        gm, gn, gk = groups
        (m, k), n = x1.shape, x2.shape[1]
        _check_dtype("pertoken_scale.dtype", pertoken.dtype, (torch.float32,))
        _check_dtype("scale.dtype", scale.dtype, (torch.float32,))
        _check_shape("pertoken_scale", pertoken, (_ceil_div(m, gm), _ceil_div(k, gk)))
        _check_shape("scale", scale, (_ceil_div(k, gk), _ceil_div(n, gn)))
        _check_scale_layout("pertoken_scale", pertoken, lay1)
        _check_scale_layout("scale", scale, lay2)
        a = _decode(x1, fmt1) * _expand_blocks(pertoken.float(), gm, gk, m, k)
        b = _decode(x2, fmt2) * _expand_blocks(scale.float(), gk, gn, k, n)
        return a, b

    @staticmethod
    def _mx_operands(x1, x2, fmt1, fmt2, scale, pertoken, lay1, lay2):
        """Dequantized (m, k), (k, n) operands of the MX mode (E8M0 scale pairs along k)."""
        (m, k), n = x1.shape, x2.shape[1]
        kp = _ceil_div(k, 64)
        _check_dtype("pertoken_scale.dtype", pertoken.dtype, _E8M0_CARRIERS)
        _check_dtype("scale.dtype", scale.dtype, _E8M0_CARRIERS)
        _check_shape("pertoken_scale", pertoken, (m, kp, 2))
        _check_shape("scale", scale, (kp, n, 2))
        _check_scale_layout("pertoken_scale", pertoken, lay1, dims=(0, 1))
        _check_scale_layout("scale", scale, lay2, dims=(0, 1))
        s1 = _e8m0_values(pertoken).reshape(m, 2 * kp).repeat_interleave(32, dim=1)[:, :k]
        s2 = _e8m0_values(scale).permute(0, 2, 1).reshape(2 * kp, n).repeat_interleave(32, dim=0)[:k]
        return _decode(x1, fmt1) * s1, _decode(x2, fmt2) * s2

    @staticmethod
    def _quant_matmul_bias(bias: torch.Tensor, out_dtype: Dtype, pertoken: Optional[torch.Tensor],
                           batch: torch.Size, n: int) -> torch.Tensor:
        _check_tensor("bias", bias)
        _check_dtype("bias.dtype", bias.dtype, (torch.float32, torch.bfloat16, torch.float16))
        if bias.dtype == torch.bfloat16 and out_dtype != torch.bfloat16:
            raise NpuTypeError("a bfloat16 bias needs output_dtype torch.bfloat16")
        if bias.dtype == torch.float16 and (pertoken is None or out_dtype != torch.float16):
            raise NpuTypeError("a float16 bias needs pertoken_scale and output_dtype torch.float16")
        if bias.dim() == 3:
            if len(batch) != 1:
                raise NpuValueError("a 3-dim bias needs a 3-dim output")
            _check_shape("bias", bias, (batch[0], 1, n))
        else:
            _check_shape("bias", bias, (n,))
        return bias

    @_kernel(differentiable=True)
    def npu_grouped_matmul(self, x: Sequence[torch.Tensor], weight: Sequence[torch.Tensor], *,
                           bias: Optional[Sequence[torch.Tensor]] = None,
                           scale: Optional[Sequence[torch.Tensor]] = None,
                           offset: Optional[Sequence[torch.Tensor]] = None,
                           antiquant_scale: Optional[Sequence[torch.Tensor]] = None,
                           antiquant_offset: Optional[Sequence[torch.Tensor]] = None,
                           per_token_scale: Optional[Sequence[torch.Tensor]] = None,
                           group_list: Union[torch.Tensor, Sequence[int], None] = None,
                           activation_input: Optional[Sequence[torch.Tensor]] = None,
                           activation_quant_scale: Optional[Sequence[torch.Tensor]] = None,
                           activation_quant_offset: Optional[Sequence[torch.Tensor]] = None,
                           split_item: int = 0, group_type: Optional[int] = None, group_list_type: int = 0,
                           act_type: int = 0, tuning_config: Optional[Sequence[int]] = None,
                           output_dtype: DtypeArg = None, x_dtype: DtypeArg = None, weight_dtype: DtypeArg = None,
                           scale_dtype: DtypeArg = None, per_token_scale_dtype: DtypeArg = None
                           ) -> list[torch.Tensor]:
        """Grouped GEMM. group_type 0 splits m: x [(m, k)], weight [(g, k, n)] (or g tensors (k, n)), rows of
        group i multiply weight i. group_type 2 splits k: x [(m, k)] the transposed view of a contiguous (k, m),
        weight [(k, n)] contiguous, output (g, m, n). group_list: int64 tensor, cumulative ends
        (group_list_type 0) or sizes (1); rows/columns past its total are not computed (zero rows out).
        split_item 0/1 return one tensor per group, 2/3 a single tensor.

        FP8/HiF8 (x and weight float8_e4m3fn/e5m2, or uint8 with x_dtype = weight_dtype = torch_npu.hifloat8):
        single tensors, split_item 2 or 3, group_type 0 or 2 passed explicitly, a group_list tensor, output_dtype
        (float16/bfloat16/float32) required, no bias. scale = [float32 (g,) per group or (g, n) per channel]
        dequantizes the weight; per_token_scale = [float32 (1,) or (m,)] x (group_type 0), or [(1,) or (g,)]
        for both in the k-split form. Results are (x_g @ w_g) * scale_g * per_token_scale."""
        xs = _check_list("x", x)
        ws = _check_list("weight", weight)
        if not 0 < len(xs) <= _MAX_GROUPS or not 0 < len(ws) <= _MAX_GROUPS:
            raise NpuValueError(f"x and weight must hold 1 to {_MAX_GROUPS} tensors, got {len(xs)}, {len(ws)}")
        _check_choice("split_item", _check_int("split_item", split_item), (0, 1, 2, 3))
        _check_choice("group_list_type", _check_int("group_list_type", group_list_type), (0, 1))
        if group_type is None:
            if not isinstance(group_list, (list, tuple)):
                raise NpuValueError("group_type must be passed explicitly (-1, 0 or 2) unless group_list is a "
                                    "Python list")
        else:
            _check_choice("group_type", _check_int("group_type", group_type), (-1, 0, 2))
        _check_choice("act_type", _check_int("act_type", act_type), (0, 1, 2, 4, 5))
        if act_type != 0:
            raise NpuSimNotImplemented(f"act_type={act_type}: fused activations are not simulated")
        for name, value in (("offset", offset), ("activation_input", activation_input),
                            ("activation_quant_scale", activation_quant_scale),
                            ("activation_quant_offset", activation_quant_offset)):
            _check_none(name, value, "(reserved; only None is supported)")
        if antiquant_scale is not None or antiquant_offset is not None:
            raise NpuSimNotImplemented("antiquant_scale/antiquant_offset (weight-only quantization) are not simulated")
        if tuning_config is not None and not all(isinstance(v, int) for v in tuning_config):
            raise NpuTypeError(f"tuning_config must be a list of ints, got {tuning_config!r}")
        xd = _dtype_arg("x_dtype", x_dtype)
        wd = _dtype_arg("weight_dtype", weight_dtype)
        for name, d in (("x_dtype", xd), ("weight_dtype", wd)):
            if d is not None:
                _check_dtype(name, d, (HIFLOAT8, *_FP4))
                if d in _FP4:
                    raise NpuSimNotImplemented(f"{name}={_dtype_name(d)}: FP4 is not simulated")
        for name, d in (("scale_dtype", _dtype_arg("scale_dtype", scale_dtype)),
                        ("per_token_scale_dtype", _dtype_arg("per_token_scale_dtype", per_token_scale_dtype))):
            if d is not None:
                _check_dtype(name, d, (FLOAT8_E8M0FNU,))
                raise NpuSimNotImplemented(f"{name}: MX grouped GEMMs are not simulated")
        out_dtype = _dtype_arg("output_dtype", output_dtype)
        if out_dtype is not None:
            _check_dtype("output_dtype", out_dtype, (*_GEMM_OUT, torch.int32))
        eight_bit = (*_FP8_NATIVE, *_HIF8_CARRIERS)
        quantized = xd is not None or wd is not None or xs[0].dtype in eight_bit or ws[0].dtype in eight_bit
        if quantized:
            return self._gmm_quantized(xs, ws, xd, wd, bias, scale, per_token_scale, group_list, split_item,
                                       group_type, group_list_type, out_dtype)
        for name, value in (("scale", scale), ("per_token_scale", per_token_scale)):
            if value is not None:
                raise NpuSimNotImplemented(f"{name} with {xs[0].dtype} inputs (integer GEMMs) is not simulated")
        return self._gmm_float(xs, ws, bias, group_list, split_item, group_type, group_list_type, out_dtype)

    @staticmethod
    def _group_sizes_from_list(group_list: Any, list_type: int, total: int, what: str,
                               groups: Optional[int] = None) -> list[int]:
        """Per-group sizes along the split dim from group_list (a tensor, or a Python list of ends)."""
        if isinstance(group_list, torch.Tensor):
            _check_dtype("group_list.dtype", group_list.dtype, (torch.int64,))
            _check_dims("group_list", group_list, 1, 1)
            values = group_list.tolist()
        elif isinstance(group_list, (list, tuple)) and all(isinstance(v, int) for v in group_list):
            values, list_type = list(group_list), 0
        else:
            raise NpuTypeError(f"group_list must be an int64 tensor or a list of ints, got {group_list!r}")
        if groups is not None and len(values) != groups:
            raise NpuValueError(f"group_list must have {groups} entries (one per weight), got {len(values)}")
        if not values or any(v < 0 for v in values):
            raise NpuValueError(f"group_list must be a non-empty list of non-negative values, got {values}")
        if list_type == 0:
            if any(b < a for a, b in zip(values, values[1:])):
                raise NpuValueError(f"group_list (cumulative, group_list_type 0) must be non-decreasing: {values}")
            sizes = [b - a for a, b in zip([0] + values, values)]
        else:
            sizes = values
        if sum(sizes) > total:
            raise NpuValueError(f"group_list covers {sum(sizes)} {what}, more than the {total} there are")
        return sizes

    @torch.no_grad()
    def _gmm_quantized(self, xs, ws, xd, wd, bias, scale, per_token_scale, group_list, split_item, group_type,
                       group_list_type, out_dtype) -> list[torch.Tensor]:
        if len(xs) != 1 or len(ws) != 1:
            raise NpuValueError(f"FP8/HiF8 grouped GEMMs take a single x and weight tensor, got {len(xs)} and "
                                f"{len(ws)}")
        x, w = xs[0], ws[0]
        fx = self._operand_dtype("x[0]", x, xd, "x_dtype")
        fw = self._operand_dtype("weight[0]", w, wd, "weight_dtype")
        if (fx == HIFLOAT8) != (fw == HIFLOAT8):
            raise NpuTypeError("x and weight must both be HiF8 (x_dtype and weight_dtype torch_npu.hifloat8) or "
                               "both float8_e4m3fn/float8_e5m2")
        _check_choice("split_item", split_item, (2, 3), "for FP8/HiF8 grouped GEMMs (single output tensor)")
        _check_choice("group_type", group_type, (0, 2), "for FP8/HiF8 grouped GEMMs")
        if out_dtype is None:
            raise NpuTypeError("output_dtype is required for FP8/HiF8 grouped GEMMs")
        _check_dtype("output_dtype", out_dtype, _GEMM_OUT)
        _check_none("bias", bias, "for FP8/HiF8 grouped GEMMs")
        if not isinstance(group_list, torch.Tensor):
            raise NpuTypeError("group_list must be an int64 tensor for FP8/HiF8 grouped GEMMs")
        if scale is None:
            raise NpuValueError("scale is required for FP8/HiF8 grouped GEMMs")
        s = _check_list("scale", scale, 1)[0]
        p = _check_list("per_token_scale", per_token_scale, 1)[0] if per_token_scale is not None else None
        _check_tensor("scale[0]", s, (torch.float32,))
        if p is not None:
            _check_tensor("per_token_scale[0]", p, (torch.float32,))
        _check_same_device({"x": x, "weight": w, "scale": s, "per_token_scale": p, "group_list": group_list})
        _check_dims("x[0]", x, 2, 2)
        m, k = x.shape
        a = _decode(x, fx)
        if group_type == 0:
            _check_dims("weight[0]", w, 3, 3)
            g, kw, n = w.shape
            if kw != k:
                raise NpuValueError(f"k of x[0] {tuple(x.shape)} and weight[0] {tuple(w.shape)} differ")
            _check_layout("x[0]", x, ("row",))
            _check_layout("weight[0]", w)
            sizes = self._group_sizes_from_list(group_list, group_list_type, m, "rows", groups=g)
            _check_shape("scale[0]", s, (g,), (g, n))
            if p is not None:
                _check_shape("per_token_scale[0]", p, (1,), (m,))
            b = _decode(w, fw)
            out = torch.zeros(m, n, dtype=torch.float32)
            start = 0
            for i, size in enumerate(sizes):
                rows = slice(start, start + size)
                part = (a[rows] @ b[i]) * s[i].float()
                if p is not None:
                    part = part * (p.float() if p.numel() == 1 else p[rows].float().reshape(-1, 1))
                out[rows] = part
                start += size
        else:
            _check_dims("weight[0]", w, 2, 2)
            kw, n = w.shape
            if kw != k:
                raise NpuValueError(f"k of x[0] {tuple(x.shape)} and weight[0] {tuple(w.shape)} differ")
            _check_layout("x[0]", x, ("col",))
            _check_layout("weight[0]", w, ("row",))
            sizes = self._group_sizes_from_list(group_list, group_list_type, k, "columns of k")
            g = len(sizes)
            _check_shape("scale[0]", s, (1,), (g,))
            if p is not None:
                _check_shape("per_token_scale[0]", p, (1,), (g,))
            b = _decode(w, fw)
            out = torch.zeros(g, m, n, dtype=torch.float32)
            start = 0
            for i, size in enumerate(sizes):
                cols = slice(start, start + size)
                part = (a[:, cols] @ b[cols]) * s[i if s.numel() > 1 else 0].float()
                if p is not None:
                    part = part * p[i if p.numel() > 1 else 0].float()
                out[i] = part
                start += size
        return [out.to(out_dtype)]

    def _gmm_float(self, xs, ws, bias, group_list, split_item, group_type, group_list_type, out_dtype
                   ) -> list[torch.Tensor]:
        """float16/bfloat16/float32 grouped GEMM (fp32 accumulation, output in x's dtype)."""
        dtype = xs[0].dtype
        _check_dtype("x[0].dtype", dtype, _FLOATS)
        for i, t in enumerate(xs):
            _check_tensor(f"x[{i}]", t, (dtype,))
        for i, t in enumerate(ws):
            _check_tensor(f"weight[{i}]", t, (dtype,))
            _check_dims(f"weight[{i}]", t, 2, 3 if len(ws) == 1 else 2)
        if out_dtype is not None and out_dtype != dtype:
            raise NpuTypeError(f"output_dtype must be None or {dtype} for {dtype} inputs, got {out_dtype}")
        bias_dtype = torch.float32 if dtype == torch.bfloat16 else dtype
        bs = _check_list("bias", bias, len(ws)) if bias is not None else None
        for i, t in enumerate(bs or []):
            _check_tensor(f"bias[{i}]", t, (bias_dtype,))
        single_w = len(ws) == 1 and ws[0].dim() == 3
        weights = list(ws[0].unbind(0)) if single_w else ws
        biases = (list(bs[0].unbind(0)) if single_w else bs) if bs is not None else [None] * len(weights)
        if single_w and bs is not None:
            _check_shape("bias[0]", bs[0], (ws[0].shape[0], ws[0].shape[2]))

        def mm(a: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], name: str) -> torch.Tensor:
            if a.shape[-1] != w.shape[0]:
                raise NpuValueError(f"k of {name} {tuple(a.shape)} and its weight {tuple(w.shape)} differ")
            r = a.float() @ w.float()
            return (r if b is None else r + b.float()).to(dtype)

        if group_list is None:
            if len(xs) != len(weights):
                raise NpuValueError(f"without group_list, x and weight need as many tensors, got {len(xs)} and "
                                    f"{len(weights)}")
            _check_choice("group_type", group_type, (-1, 0), "without group_list")
            outs = [mm(a, w, b, f"x[{i}]") for i, (a, w, b) in enumerate(zip(xs, weights, biases))]
            return [torch.cat(outs)] if split_item in (2, 3) else outs
        if len(xs) != 1:
            raise NpuValueError(f"with group_list, x must be a single tensor, got {len(xs)}")
        x = xs[0]
        _check_dims("x[0]", x, 2, 2)
        if group_type == 2:
            if len(ws) != 1 or ws[0].dim() != 2:
                raise NpuValueError("the k-split form (group_type 2) takes a single 2-D weight")
            _check_none("bias", bias, "in the k-split form (group_type 2)")
            _check_layout("x[0]", x, ("col",))
            _check_layout("weight[0]", ws[0], ("row",))
            sizes = self._group_sizes_from_list(group_list, group_list_type, x.shape[1], "columns of k")
            bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
            outs = [mm(x[:, bounds[i]:bounds[i + 1]], ws[0][bounds[i]:bounds[i + 1]], None, "x[0]")
                    for i in range(len(sizes))]
            return [torch.stack(outs)] if split_item in (2, 3) else outs
        sizes = self._group_sizes_from_list(group_list, group_list_type, x.shape[0], "rows", groups=len(weights))
        parts = list(torch.split(x[: sum(sizes)], sizes))
        outs = [mm(a, w, b, "x[0]") for a, w, b in zip(parts, weights, biases)]
        if split_item not in (2, 3):
            return outs
        y = torch.zeros(x.shape[0], weights[0].shape[1], dtype=dtype)
        y[: sum(sizes)] = torch.cat(outs)
        return [y]

    # misc ------------------------------------------------------------------------------------------------
    @_kernel(differentiable=True)
    def npu_dtype_cast(self, input: torch.Tensor, /, dtype: DtypeArg, input_dtype: DtypeArg = None) -> torch.Tensor:
        """Element cast. To float8_e4m3fn/e5m2 as torch's own cast (nearest-even, not saturating); to
        torch_npu.hifloat8 (uint8 codes) half away from zero, |x| >= 40960 to +-Inf; from HiF8 with
        input_dtype=torch_npu.hifloat8 on uint8 codes."""
        _check_tensor("input", input)
        out = _dtype_arg("dtype", dtype, required=True)
        src = _dtype_arg("input_dtype", input_dtype)
        for name, d in (("dtype", out), ("input_dtype", src)):
            if d in _NPU_ONLY_NAMES and d != HIFLOAT8:
                raise NpuSimNotImplemented(f"{name}={_dtype_name(d)} is not simulated")
        if src == HIFLOAT8:
            _check_dtype("input.dtype", input.dtype, _HIF8_CARRIERS)
        elif src is not None and src != input.dtype:
            raise NpuTypeError(f"input_dtype={_dtype_name(src)} does not match input.dtype {input.dtype}")
        if HIFLOAT8 in (out, src) or out in _FP8_NATIVE or input.dtype in _FP8_NATIVE:
            self._require_fp8_soc("an 8-bit float cast")
        values = _decode(input, HIFLOAT8) if src == HIFLOAT8 else input
        if out == HIFLOAT8:
            return _encode(values.float(), HIFLOAT8, saturate=False)
        return values.to(out)

    @_kernel(differentiable=True)
    def npu_rms_norm(self, input: torch.Tensor, /, gamma: torch.Tensor, epsilon: float = 1e-6
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """y = input * rstd * gamma over the trailing gamma.dim() dims, in float32, returned in input's dtype;
        rstd = 1 / sqrt(mean(input^2) + epsilon), float32 of shape input.shape[:-gamma.dim()] + (1,) * gamma.dim()."""
        _check_tensor("input", input, _FLOATS)
        _check_tensor("gamma", gamma, (input.dtype,))
        _check_dims("input", input, 2, 8)
        _check_dims("gamma", gamma, 1, input.dim())
        if tuple(gamma.shape) != tuple(input.shape[input.dim() - gamma.dim():]):
            raise NpuValueError(f"gamma {tuple(gamma.shape)} must match the trailing dims of input "
                                f"{tuple(input.shape)}")
        eps = _check_float("epsilon", epsilon)
        dims = tuple(range(input.dim() - gamma.dim(), input.dim()))
        x = input.float()
        rstd = torch.rsqrt(x.square().mean(dim=dims, keepdim=True) + eps)
        return (x * rstd * gamma.float()).to(input.dtype), rstd


def make_simulator(soc_name: str = "Ascend950PR") -> NpuSimulator:
    """A fresh simulator (own launch counters) of a chip named `soc_name`."""
    return NpuSimulator(soc_name)
