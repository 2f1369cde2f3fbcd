"""The fused CPU quantize kernels (the optional C extension `mindspeed_te._fused_cast`), behind tensor APIs.

Quantizing with torch ops costs one pass over memory per op (divide, clamp, cast) and a few microseconds of
dispatch each; the extension reads every element once and also serves small tensors in one call. It covers
the per-tensor hot path (contiguous float32/bfloat16 CPU tensors, one float32 scale) and the block-scaled
ones (blockwise tiles, MX blocks, both layouts in one pass; NVFP4 blocks, one layout a call, and the Hadamard
transform of the columnwise one). Every function returns None when its input is outside that, and the caller
then uses the torch ops, which give the same bits.

The kernels take raw addresses and trust them: before every call this module checks what they will read or
write beyond the data it allocates itself (the tables' dtypes and sizes, a caller's output buffer, the format,
mode and tile arguments) and raises a ValueError or TypeError naming the argument, rather than letting a
kernel read or write past a buffer; a table or buffer that is right but strided is declined (None) like an input.

`MINDSPEED_TE_FUSED_CAST=0` in the environment at import switches the extension off (the torch path is then
used everywhere); `enabled` is the switch at run time.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

try:
    from mindspeed_te import _fused_cast as _ext
except ImportError:  # not built (no compiler at install time, or a source tree without `pip install -e .`)
    _ext = None

__all__ = ["available", "amax", "current_scale_inv", "decode", "dequantize_nvfp4", "dequantize_tiles", "gemm_bf16",
           "gemm_bf16_applies", "gemm_epilogue", "hadamard_columns", "nibbles", "quantize_current", "quantize_nvfp4",
           "quantize_delayed", "quantize_tiles", "scaled_cast", "set_simd", "simd_level"]

enabled: bool = _ext is not None and os.environ.get("MINDSPEED_TE_FUSED_CAST", "1") != "0"
_IN_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# format -> (the kernels' format code, the storage dtype of the codes)
# "e2m1": FP4 codes one per byte (uint8 in [0, 16)), quantize_tiles' MX modes only; the caller packs them.
_OUT_FORMATS = {"e4m3": (0, torch.float8_e4m3fn), "e5m2": (1, torch.float8_e5m2), "hif8": (2, torch.uint8),
                "e2m1": (3, torch.uint8)}


# Below this many elements a kernel runs on the calling thread only. Built with OpenMP (`_ext.openmp`), the
# kernels run on torch's own OpenMP workers, still spinning after the last torch op, and two threads pay
# from the kernels' own granularity on (2 x 64 Ki elements: after a torch.mm on 2 cores, a 2^17-element
# cast took 74 us on two threads and 84 us on one, 2^20 codes of MX tiles 0.51 ms and 0.71 ms; in the GPT
# bench a threshold of 2^17 beat 2^18 and 2^19, and splitting from 2^15 or 2^16 gained nothing). Built with
# pthreads, a thread started by the extension competes for a core with those spinning workers, and the two
# threads break even only near 2^23 (decoding 2^20 codes took 0.5 ms on one thread and 1 ms on two).
SPLIT_MIN_ELEMENTS = 1 << 17 if getattr(_ext, "openmp", 0) else 1 << 22


def _threads(numel: int) -> int:
    return torch.get_num_threads() if numel >= SPLIT_MIN_ELEMENTS else 1


SIMD_LEVELS = {"scalar": 0, "avx2": 1, "avx512": 2}
_simd_limit = "avx512"


def set_simd(limit: str) -> str:
    """Caps the vector code of the kernels at `limit` ("scalar", "avx2" or "avx512"; the default is the widest)
    and returns the level now in effect (lower when the CPU lacks `limit`). Every level gives the same bits;
    the cap lets one machine run the paths that CPUs without AVX-512 or AVX2 take."""
    if limit not in SIMD_LEVELS:
        raise ValueError(f"limit must be one of {sorted(SIMD_LEVELS)}, got {limit!r}")
    global _simd_limit
    _simd_limit = limit
    if _ext is None:
        return "scalar"
    level = _ext.set_simd(SIMD_LEVELS[limit])
    return next(name for name, value in SIMD_LEVELS.items() if value == level)


def simd_level() -> str:
    """The vector level the kernels use now (the widest the CPU has, up to the `set_simd` cap)."""
    return set_simd(_simd_limit)


def available() -> bool:
    """Whether the extension is built and switched on."""
    return enabled and _ext is not None


def _applies(x: torch.Tensor) -> bool:
    return available() and x.is_cpu and x.dtype in _IN_DTYPES and x.is_contiguous()


# The sizes of the tables the kernels index: HiF8's encode table by a 16-bit key, a format's values by its code.
HIF8_TABLE_ENTRIES = 1 << 16
VALUES_ENTRIES = 256


def _buffer_ptr(t: object, arg: str, dtype: torch.dtype, numel: int, what: str) -> Optional[int]:
    """The address of `t`, a CPU tensor of `dtype` with `numel` elements (what a kernel reads or writes there),
    else a TypeError or ValueError naming `arg`; None when it is strided (the kernel takes it dense: the torch
    ops take over)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{arg} must be {what} (a {dtype} tensor), got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{arg} must be {what} of dtype {dtype}, got {t.dtype}")
    if not t.is_cpu:
        raise ValueError(f"{arg} must be a CPU tensor, got one on {t.device}")
    if t.numel() != numel:
        raise ValueError(f"{arg} must have {numel} elements ({what}), got {t.numel()}")
    return t.data_ptr() if t.is_contiguous() else None


def _format_table(fmt: str, table: Optional[torch.Tensor],
                  arg: str = "table") -> Optional[tuple[int, torch.dtype, int]]:
    """(the kernels' format code, the codes' storage dtype, the address of the encode table): HiF8's checked
    table (None when strided), 0 for E4M3 and E5M2 (rounded arithmetically: the kernels never read a table)."""
    formats = _OUT_FORMATS.get(fmt) if isinstance(fmt, str) else None
    if formats is None:
        raise ValueError(f"fmt must be one of {sorted(_OUT_FORMATS)}, got {fmt!r}")
    if fmt != "hif8":
        return (*formats, 0)
    ptr = _buffer_ptr(table, arg, torch.uint8, HIF8_TABLE_ENTRIES, "HiF8's 65536-entry encode table")
    return None if ptr is None else (*formats, ptr)


def _values_ptr(values: object, arg: str) -> Optional[int]:
    """The address of a format's 256 float32 code values, checked (None when strided)."""
    return _buffer_ptr(values, arg, torch.float32, VALUES_ENTRIES, "the format's 256 code values")


def amax(x: torch.Tensor) -> Optional[torch.Tensor]:
    """max |x| as a float32 0-d tensor (NaN if x holds one), or None when the extension does not apply."""
    if not _applies(x):
        return None
    out = torch.empty((), dtype=torch.float32)
    _ext.amax(x.data_ptr(), _IN_DTYPES[x.dtype], x.numel(), out.data_ptr(), _threads(x.numel()))
    return out


def scaled_cast(x: torch.Tensor, scale_inv: torch.Tensor, fmt: str,
                hif8_table: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Codes of sat(x / scale_inv) in format `fmt` ("e4m3", "e5m2" or "hif8" with its 65536-entry uint8
    saturating or plain encode table) in x's shape and the format's storage dtype (float8, or uint8 for
    HiF8), or None when the extension does not apply."""
    if not (_applies(x) and _one_element_f32(scale_inv)):
        return None
    checked = _format_table(fmt, hif8_table, "hif8_table")
    if checked is None:
        return None
    code, storage, table = checked
    out = torch.empty_like(x, dtype=storage)
    _ext.scaled_cast(x.data_ptr(), _IN_DTYPES[x.dtype], x.numel(), scale_inv.data_ptr(), out.data_ptr(),
                     code, table, _threads(x.numel()))
    return out


def nibbles(t: torch.Tensor, pack: bool) -> Optional[torch.Tensor]:
    """FP4 codes (uint8 in [0, 16), an even last dim) two per byte along the last dim, element 2i in the low
    nibble (`pack`), or such bytes back to their codes, the last dim twice as long; None when the extension does
    not apply (a non-uint8, strided or non-CPU tensor, or an old build without the kernel)."""
    if not (available() and hasattr(_ext, "nibbles") and t.is_cpu and t.dtype == torch.uint8 and t.is_contiguous()
            and t.dim() >= 1 and not (pack and t.shape[-1] % 2)):
        return None
    shape = (*t.shape[:-1], t.shape[-1] // 2 if pack else t.shape[-1] * 2)
    out = torch.empty(shape, dtype=torch.uint8)
    n = out.numel() if pack else t.numel()
    if n:
        _ext.nibbles(t.data_ptr(), out.data_ptr(), n, pack, _threads(2 * n))
    return out


NVFP4_BLOCK = 16


def quantize_nvfp4(x2d: torch.Tensor, factors: torch.Tensor, rbits: Optional[torch.Tensor], tile_rows: int,
                   columnwise: bool = False) -> Optional[tuple[torch.Tensor, ...]]:
    """NVFP4's quantize of a 2-D tensor along its rows in one call: (E2M1 codes packed two a byte (M, K / 2),
    E4M3 scales (M, K / 16) as torch.float8_e4m3fn) of 1x16 blocks (tile_rows 1) or 16x16 tiles (16, the scale
    repeated on each of the tile's rows). `factors`: the float32 S_enc * float32(1/6) and 1 / S_enc
    (mindspeed_te.fp4.nvfp4_block_factors); `rbits`: None (round to nearest even) or x2d's shape in uint8 random
    bytes (stochastic rounding). `columnwise` (16x16 tiles rounded to nearest even only): the same of x2dᵀ too,
    (K, M / 2) and (K, M / 16) after the rowwise pair, from the same codes (a tile's scale and codes do not depend
    on the way it is read). None when the extension does not apply; the torch ops then give the same bits."""
    if tile_rows not in (1, NVFP4_BLOCK):
        raise ValueError(f"tile_rows must be 1 or {NVFP4_BLOCK}, got {tile_rows!r}")
    if columnwise and (tile_rows != NVFP4_BLOCK or rbits is not None):
        raise ValueError("the columnwise form comes with the rowwise one only for 16x16 tiles rounded to nearest even")
    if not (_applies(x2d) and x2d.dim() == 2 and hasattr(_ext, "quantize_nvfp4")):
        return None
    m, k = x2d.shape
    if m % tile_rows or k % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 needs rows divisible by {tile_rows} and columns by {NVFP4_BLOCK}, got {(m, k)}")
    factors_ptr = _buffer_ptr(factors, "factors", torch.float32, 2, "S_enc / 6 and 1 / S_enc")
    rbits_ptr = 0 if rbits is None else _buffer_ptr(rbits, "rbits", torch.uint8, m * k, "one random byte per element")
    if factors_ptr is None or rbits_ptr is None:
        return None
    layouts = ((m, k), (k, m)) if columnwise else ((m, k),)
    out = [torch.empty((rows, cols // per), dtype=dtype) for rows, cols in layouts
           for per, dtype in ((2, torch.uint8), (NVFP4_BLOCK, torch.float8_e4m3fn))]
    if x2d.numel():
        _ext.quantize_nvfp4(x2d.data_ptr(), _IN_DTYPES[x2d.dtype], m, k, tile_rows, factors_ptr, rbits_ptr,
                            *(t.data_ptr() for t in out), *((0, 0) if not columnwise else ()), _threads(m * k))
    return tuple(out)


def hadamard_columns(x2d: torch.Tensor, sign_mask: int) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The random Hadamard transform of x2dᵀ's rows (`mindspeed_te.fp4.random_hadamard_transform(x2d.t())`, the
    same bits) in one pass over a 2-D (M, K) tensor: (the transform (K, M) in x2d's dtype, max |transform| and
    max |x2d| as one-element float32 tensors, NaN where there is one). The amaxes come free with the read, so
    NVFP4 needs no amax pass of its own. None when the extension does not apply."""
    if not (_applies(x2d) and x2d.dim() == 2 and hasattr(_ext, "hadamard_columns")):
        return None
    m, k = x2d.shape
    if m % NVFP4_BLOCK:
        raise ValueError(f"the Hadamard transform runs along the {m} rows in runs of {NVFP4_BLOCK}: not divisible")
    if not isinstance(sign_mask, int) or not 0 <= sign_mask < 1 << NVFP4_BLOCK:
        raise ValueError(f"sign_mask must be a 16-bit mask, got {sign_mask!r}")
    out = torch.empty((k, m), dtype=x2d.dtype)
    out_amax, in_amax = torch.zeros(1, dtype=torch.float32), torch.zeros(1, dtype=torch.float32)
    if out.numel():
        _ext.hadamard_columns(x2d.data_ptr(), _IN_DTYPES[x2d.dtype], m, k, sign_mask, out.data_ptr(),
                              out_amax.data_ptr(), in_amax.data_ptr(), _threads(out.numel()))
    return out, out_amax, in_amax


def dequantize_nvfp4(data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, values: torch.Tensor,
                     factor: float, out_dtype: torch.dtype = torch.float32) -> Optional[torch.Tensor]:
    """The float32 (M, K) values of NVFP4 codes packed two a byte (M, K / 2) with E4M3 scales (M, K / 16) in one
    pass: values[code] * ((float(scale) * amax) * factor), `values` the 256-entry E2M1 table
    (mindspeed_te.fp4.e2m1_decode_table), `amax` a one-element float32 tensor, `factor` float32(1 / 2688) (or, with
    amax 1, 1: code * scale). With out_dtype bfloat16, those products cast to bfloat16 (exact for code * scale).
    None when the extension does not apply (then the torch ops give the same products)."""
    if not (available() and hasattr(_ext, "dequantize_nvfp4") and data.is_cpu and data.dtype == torch.uint8
            and data.dim() == 2 and data.is_contiguous() and scale.is_cpu and scale.dtype == torch.float8_e4m3fn
            and scale.is_contiguous() and _one_element_f32(amax) and out_dtype in (torch.float32, torch.bfloat16)):
        return None
    m, k = data.shape[0], 2 * data.shape[1]
    if k % NVFP4_BLOCK or scale.shape != (m, k // NVFP4_BLOCK):
        raise ValueError(f"NVFP4 scales must be (M, K / {NVFP4_BLOCK}) = {(m, k // NVFP4_BLOCK)} for codes of shape "
                         f"{tuple(data.shape)}, got {tuple(scale.shape)}")
    table = _values_ptr(values, "values")
    if table is None:
        return None
    out = torch.empty((m, k), dtype=out_dtype)
    if out.numel():
        _ext.dequantize_nvfp4(data.data_ptr(), scale.data_ptr(), m, k, table, amax.data_ptr(), factor,
                              out.data_ptr(), _threads(out.numel()), int(out_dtype == torch.bfloat16))
    return out


def decode(codes: torch.Tensor, values: torch.Tensor) -> Optional[torch.Tensor]:
    """values[codes] as float32 in codes' shape (`values`: the 256 float32 values of a format's codes), or
    None when the extension does not apply. `codes` may be uint8 or a float8 dtype."""
    if not (available() and codes.is_cpu and codes.element_size() == 1 and codes.is_contiguous()):
        return None
    table = _values_ptr(values, "values")
    if table is None:
        return None
    out = torch.empty_like(codes, dtype=torch.float32)
    _ext.decode(codes.data_ptr(), codes.numel(), table, out.data_ptr(), _threads(codes.numel()))
    return out


def dequantize_tiles(codes: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, rows: int,
                     cols: int, out_dtype: torch.dtype = torch.float32) -> Optional[torch.Tensor]:
    """values[codes] * scales[r // rows, c // cols] as float32 (M, K) in one pass, for 2-D (M, K) codes and
    (ceil(M / rows), ceil(K / cols)) scales, float32 or E8M0 bytes (uint8 or float8_e8m0fnu; `values`: the
    256 float32 values of the format's codes), or None when the extension does not apply (then decode and
    multiply with torch ops: the same products). With out_dtype bfloat16, those products cast to bfloat16."""
    for arg, size in (("rows", rows), ("cols", cols)):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{arg} (the tile's size) must be an integer >= 1, got {size!r}")
    e8m0 = scales.dtype in (torch.uint8, torch.float8_e8m0fnu)
    if not (available() and codes.is_cpu and codes.dim() == 2 and codes.element_size() == 1 and codes.is_contiguous()
            and (e8m0 or scales.dtype == torch.float32) and scales.is_cpu and scales.dim() == 2
            and scales.is_contiguous()):
        return None
    m, k = codes.shape
    if scales.shape != (-(-m // rows), -(-k // cols)) or out_dtype not in (torch.float32, torch.bfloat16):
        return None
    table = _values_ptr(values, "values")
    if table is None:
        return None
    out = torch.empty((m, k), dtype=out_dtype)
    if out.numel() == 0:  # an expert without tokens: nothing to read (and no buffer to point at)
        return out
    _ext.dequantize_tiles(codes.data_ptr(), m, k, table, scales.data_ptr(), scales.shape[1], rows, cols,
                          out.data_ptr(), _threads(out.numel()), int(e8m0), int(out_dtype == torch.bfloat16))
    return out


_EPILOGUE_OUT = {torch.float32: 0, torch.bfloat16: 1}
_EPILOGUE_ACCUMULATE = 2


def gemm_epilogue(acc: torch.Tensor, scale_b: Optional[torch.Tensor], scale_a: Optional[torch.Tensor],
                  bias: Optional[torch.Tensor], out_dtype: torch.dtype,
                  out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """(acc * scale_b) * scale_a + bias in float32, returned as `out_dtype` (float32: written over `acc`; or
    bfloat16), or, with `out`, added into that float32 tensor (no bias then), in one pass over a 2-D float32
    GEMM sum. Scales are one-element float32 tensors or None (1); `bias` is float32 (N,). None when the
    extension does not apply (then the torch ops give the same values)."""
    if not (available() and acc.is_cpu and acc.dtype == torch.float32 and acc.dim() == 2 and acc.is_contiguous()
            and (scale_b is None or _one_element_f32(scale_b)) and (scale_a is None or _one_element_f32(scale_a))):
        return None
    m, n = acc.shape
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.shape != acc.shape:
            raise ValueError(f"out must have acc's shape {tuple(acc.shape)} (the sum is added into it), got "
                             f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}")
        if bias is not None or not (out.is_cpu and out.dtype == torch.float32 and out.is_contiguous()):
            return None  # a bfloat16/float16 or strided out, or a bias (refused there): the torch ops
        kind, target = _EPILOGUE_ACCUMULATE, out
    else:
        if out_dtype not in _EPILOGUE_OUT or (bias is not None and not (
                bias.is_cpu and bias.dtype == torch.float32 and bias.shape == (n,) and bias.is_contiguous())):
            return None
        kind = _EPILOGUE_OUT[out_dtype]
        target = acc if out_dtype == torch.float32 else torch.empty_like(acc, dtype=out_dtype)
    if acc.numel():
        _ext.gemm_epilogue(acc.data_ptr(), m, n, 0 if scale_b is None else scale_b.data_ptr(),
                           0 if scale_a is None else scale_a.data_ptr(), 0 if bias is None else bias.data_ptr(),
                           target.data_ptr(), kind, _threads(acc.numel()))
    return target


# Below this many rows of a or b, gemm_bf16 declines (2 threads, K = N = 1024: 1 row 0.21 ms against 0.10 ms for
# torch's float32 GEMV; 4 rows 0.22 ms against 0.40 ms).
GEMM_BF16_MIN_ROWS = 4
_GEMM_KINDS = {torch.bfloat16: 0, torch.float32: 1}
_GEMM_CODES = 2
_gemm_bf16_cpu: Optional[bool] = None


def gemm_bf16_applies() -> bool:
    """Whether `gemm_bf16` runs here: the extension is on, `set_simd` allows AVX-512, and the CPU has AVX-512
    BF16 but no AMX (where oneDNN's AMX kernel is the faster way to the same class of sums, the caller keeps
    it)."""
    global _gemm_bf16_cpu
    if not available() or _simd_limit != "avx512":
        return False
    if _gemm_bf16_cpu is None:
        _gemm_bf16_cpu = bool(_ext.gemm_bf16_supported()) and not torch.cpu._is_amx_tile_supported()
    return _gemm_bf16_cpu


def _gemm_operand(t: torch.Tensor, values: Optional[torch.Tensor],
                  arg: str) -> Optional[tuple[int, int, int, int, int]]:
    if not t.is_cpu:
        return None
    if values is not None:
        if t.element_size() != 1:
            raise TypeError(f"{arg} must hold 1-byte codes when {arg}_values is given, got {t.dtype}")
        table = _values_ptr(values, f"{arg}_values")
        return None if table is None else (t.data_ptr(), t.stride(0), t.stride(1), _GEMM_CODES, table)
    kind = _GEMM_KINDS.get(t.dtype)
    return None if kind is None else (t.data_ptr(), t.stride(0), t.stride(1), kind, 0)


def gemm_bf16(a: torch.Tensor, b: torch.Tensor, a_values: Optional[torch.Tensor] = None,
              b_values: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """a · bᵀ as a float32 (M, N) tensor, for 2-D a (M, K) and b (N, K) of any strides whose values are all
    bfloat16 values: bfloat16 tensors, float32 tensors holding bfloat16 values, or FP8/HiF8 codes (1-byte
    dtypes) with `*_values` their format's 256 float32 values (then read straight from the codes). Each output
    is a float32 sum of exact products in a fixed order (csrc/gemm_bf16.c: for k = 0, 2, ..., the product of
    k + 1, then that of k), values below float32's normal range counting as zero. None where
    `gemm_bf16_applies` is False, an operand is none of those, or a or b has fewer than GEMM_BF16_MIN_ROWS rows
    (a matrix-vector product, where torch's float32 GEMM is the faster)."""
    if not (gemm_bf16_applies() and a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[1]
            and min(a.shape[0], b.shape[0]) >= GEMM_BF16_MIN_ROWS):
        return None
    a_op, b_op = _gemm_operand(a, a_values, "a"), _gemm_operand(b, b_values, "b")
    if a_op is None or b_op is None:
        return None
    (m, k), n = a.shape, b.shape[0]
    out = torch.empty((m, n), dtype=torch.float32)
    if out.numel():
        _ext.gemm_bf16(a_op, b_op, out.data_ptr(), m, n, k, torch.get_num_threads())
    return out


def current_scale_inv(amax: torch.Tensor, fp8_max: float, amax_epsilon: float,
                      power_2_scale: bool) -> Optional[torch.Tensor]:
    """`mindspeed_te.scaling.current_scale_inv` of a one-element float32 CPU amax in one call, or None."""
    if not (available() and _one_element_f32(amax)):
        return None
    out = torch.empty_like(amax)
    _ext.current_scale_inv(amax.data_ptr(), out.data_ptr(), fp8_max, amax_epsilon, power_2_scale)
    return out


def _one_element_f32(t: torch.Tensor) -> bool:
    return t.is_cpu and t.numel() == 1 and t.dtype == torch.float32


def _quantize(x: torch.Tensor, fmt: str, table: Optional[torch.Tensor], amax: Optional[torch.Tensor],
              divisor: Optional[torch.Tensor], fp8_max: float, amax_epsilon: float,
              power_2_scale: bool) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    checked = _format_table(fmt, table)
    if checked is None:
        return None
    code, storage, table_ptr = checked
    data = torch.empty_like(x, dtype=storage)
    scale_inv = torch.empty(1, dtype=torch.float32)
    _ext.quantize(x.data_ptr(), _IN_DTYPES[x.dtype], x.numel(), data.data_ptr(), code, table_ptr, _threads(x.numel()),
                  amax.data_ptr() if amax is not None else 0, divisor.data_ptr() if divisor is not None else 0,
                  scale_inv.data_ptr(), fp8_max, amax_epsilon, power_2_scale)
    return data, scale_inv


def quantize_current(x: torch.Tensor, fmt: str, table: Optional[torch.Tensor], fp8_max: float,
                     amax_epsilon: float, power_2_scale: bool) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """Current scaling in one call: (codes, scale_inv of shape (1,)) with scale_inv = `current_scale_inv` of
    x's amax and codes = sat(x / scale_inv) (as in `scaled_cast`); `table` is HiF8's saturating encode table.
    None when the extension does not apply."""
    if not _applies(x):
        return None
    return _quantize(x, fmt, table, None, None, fp8_max, amax_epsilon, power_2_scale)


def quantize_delayed(x: torch.Tensor, fmt: str, table: Optional[torch.Tensor], amax: torch.Tensor,
                     divisor: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """Delayed scaling in one call: max-accumulates x's amax into the one-element `amax` (in place, NaN
    propagating) and returns (codes of sat(x / divisor), scale_inv = divisor, NaN when x holds NaN/Inf);
    `divisor` is the float32 value the quantizer divides by (`Float8Quantizer.divisor`). None when the
    extension does not apply."""
    if not (_applies(x) and _one_element_f32(amax) and _one_element_f32(divisor)):
        return None
    return _quantize(x, fmt, table, amax, divisor, 0.0, 0.0, False)


_TILE_MODES = {"block": 0, "ceil": 1, "floor": 2}


def quantize_tiles(x2d: torch.Tensor, fmt: str, table: Optional[torch.Tensor], *, mode: str, tile_rows: int,
                   block: int, rowwise: bool, columnwise: bool, fp8_max: float, amax_epsilon: float = 0.0,
                   power_2_scale: bool = True, emax: int = 0) -> Optional[tuple[Optional[torch.Tensor], ...]]:
    """Block-scaled quantize of a 2-D tensor in one call: (rowwise data (M, K), rowwise scales, columnwise data
    (K, M), columnwise scales), the layouts not asked for None. mode "block": tiles of tile_rows x block with
    float32 scale_inv = `scaling.current_scale_inv` of the tile amax (NaN for a tile holding NaN/Inf);
    "ceil" / "floor": MX blocks of `block` with E8M0 codes (uint8, 0xFF for NaN/Inf) by
    `scaling.mx_scale_exponent`. None when the extension does not apply."""
    if mode not in _TILE_MODES:
        raise ValueError(f"mode must be one of {sorted(_TILE_MODES)}, got {mode!r}")
    if not isinstance(block, int) or block < 1 or tile_rows not in (1, block):
        raise ValueError(f"block must be an integer >= 1 and tile_rows 1 or block, got block={block!r}, "
                         f"tile_rows={tile_rows!r}")
    mx = mode != "block"
    if not (_applies(x2d) and x2d.dim() == 2 and block <= 128) or (mx and fmt == "hif8") or (not mx and fmt == "e2m1"):
        return None
    m, k = x2d.shape
    checked = _format_table(fmt, table)
    if checked is None:
        return None
    code, storage, table_ptr = checked
    scale_dtype = torch.float32 if mode == "block" else torch.uint8
    row_data = row_scale = col_data = col_scale = None
    if rowwise:
        row_data = torch.empty((m, k), dtype=storage)
        row_scale = torch.empty((-(-m // tile_rows), -(-k // block)), dtype=scale_dtype)
    if columnwise:
        col_data = torch.empty((k, m), dtype=storage)
        col_scale = torch.empty((k, -(-m // block)), dtype=scale_dtype)

    def ptr(t: Optional[torch.Tensor]) -> int:
        return 0 if t is None else t.data_ptr()

    _ext.quantize_tiles(x2d.data_ptr(), _IN_DTYPES[x2d.dtype], m, k, code, table_ptr, _TILE_MODES[mode], tile_rows,
                        block, emax, fp8_max, amax_epsilon, power_2_scale, ptr(row_data), ptr(row_scale),
                        ptr(col_data), ptr(col_scale), _threads(x2d.numel()))
    return row_data, row_scale, col_data, col_scale
