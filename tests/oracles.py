"""Independent reference implementations used as test oracles.

Written element by element in numpy / plain Python from the documented semantics (the OCP 8-bit floating point
spec for E4M3/E5M2, the paper "Ascend HiFloat8 Format for Deep Learning" for HiF8, TransformerEngine's scaling
recipes), with ml_dtypes (E4M3/E5M2) and en_dtypes (HiF8) doing the element casts. Slow on purpose: clarity over
speed.
"""
from __future__ import annotations

import math

import en_dtypes
import ml_dtypes
import numpy as np

NP_DTYPES = {"E4M3": ml_dtypes.float8_e4m3fn, "E5M2": ml_dtypes.float8_e5m2, "HIF8": en_dtypes.hifloat8}
FMT_MAX = {"E4M3": 448.0, "E5M2": 57344.0, "HIF8": 32768.0}
FLT_MAX = float(np.finfo(np.float32).max)


def np_cast(x: np.ndarray, fmt: str, saturate: bool = True) -> np.ndarray:
    """Cast of float32 values to the format, returned as raw uint8 codes; saturating = clipped to +-max first
    (NaN stays NaN), else overflow follows the library's rule (E4M3 NaN, E5M2/HiF8 Inf)."""
    x = np.asarray(x, dtype=np.float32)
    if saturate:
        x = np.where(np.isnan(x), x, np.clip(x, -FMT_MAX[fmt], FMT_MAX[fmt])).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        return x.astype(NP_DTYPES[fmt]).view(np.uint8)


def np_decode(codes: np.ndarray, fmt: str) -> np.ndarray:
    return np.asarray(codes, dtype=np.uint8).view(NP_DTYPES[fmt]).astype(np.float32)


def current_scale(amax: float, target: float, eps: float = 0.0, pow2: bool = False) -> np.float32:
    """Current-scaling rule: float32 target / max(amax, eps); 1 for 0/Inf/NaN; FLT_MAX on overflow."""
    amax = np.float32(amax)
    if eps > 0:
        amax = max(amax, np.float32(eps))
    if not math.isfinite(amax) or amax == 0:
        return np.float32(1.0)
    with np.errstate(over="ignore", divide="ignore"):
        scale = np.float32(target) / amax
    if math.isinf(scale):
        scale = np.float32(FLT_MAX)
    if pow2:
        scale = np.float32(2.0 ** math.floor(math.log2(scale)))
    return np.float32(scale)


def current_scale_inv(amax: float, target: float, eps: float = 0.0, pow2: bool = False) -> np.float32:
    """Decode scale as the NPU's dynamic-quant kernels define it: max(amax, eps) / target in float32 (at least
    1/FLT_MAX); 1 for 0/Inf/NaN; the exact inverse of the power-of-two scale with pow2."""
    if pow2:
        return np.float32(1.0) / current_scale(amax, target, eps, True)
    amax = np.float32(amax)
    if eps > 0:
        amax = max(amax, np.float32(eps))
    if not math.isfinite(amax) or amax == 0:
        return np.float32(1.0)
    return max(np.float32(amax / np.float32(target)), np.float32(1.0) / np.float32(FLT_MAX))


class DelayedReference:
    """Delayed scaling for one tensor, in Python floats: history list, scale, update()."""

    def __init__(self, history_len: int, target: float, margin: float = 0.0, algo: str = "max") -> None:
        self.history = [0.0] * history_len
        self.scale = 1.0
        self.target = target
        self.margin = margin
        self.algo = algo

    def observe(self, amax: float) -> None:
        """What the quantize kernel does: max-accumulate into slot 0 (NaN propagates)."""
        if math.isnan(amax) or math.isnan(self.history[0]):
            self.history[0] = math.nan
        else:
            self.history[0] = max(self.history[0], amax)

    def update(self) -> None:
        """TransformerEngine's fused update: a step without a positive finite amax (tensor not seen, or
        NaN/Inf data) changes neither the window nor the scale."""
        newest = self.history[0]
        self.history[0] = 0.0
        if not (newest > 0 and math.isfinite(newest)):
            return
        window = [newest] + self.history[1:]
        amax = max(window) if self.algo == "max" else newest
        if amax > 0 and math.isfinite(amax):
            with np.errstate(over="ignore"):
                scale = float(np.float32(np.float32(self.target) / np.float32(amax)) / np.float32(2.0**self.margin))
            self.scale = FLT_MAX if math.isinf(scale) else scale
        if newest > 0 and math.isfinite(newest):
            self.history = self.history[1:] + [newest]
        self.history[0] = 0.0


def tiles_reference(x: np.ndarray, rows: int, cols: int, fmt: str, target: float, pow2: bool
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Blockwise quantization of a 2-D float32 array, tile by tile: (uint8 codes, float32 scale_inv)."""
    m, k = x.shape
    nr, nc = -(-m // rows), -(-k // cols)
    codes = np.zeros((m, k), np.uint8)
    scale_inv = np.zeros((nr, nc), np.float32)
    for i in range(nr):
        for j in range(nc):
            tile = x[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols]
            s_inv = current_scale_inv(float(np.abs(tile).max()), target, 0.0, pow2)
            codes[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols] = np_cast(tile / s_inv, fmt)
            scale_inv[i, j] = s_inv
    return codes, scale_inv


def mx_reference(x: np.ndarray, fmt: str, rounding: str) -> tuple[np.ndarray, np.ndarray]:
    """MX quantization along the last dim in blocks of 32, the last one short where 32 does not divide it: (uint8
    codes, uint8 E8M0 biased exponents)."""
    m, k = x.shape
    emax = {"E4M3": 8, "E5M2": 15}[fmt]
    codes = np.zeros((m, k), np.uint8)
    exps = np.zeros((m, -(-k // 32)), np.uint8)
    for i in range(m):
        for j in range(-(-k // 32)):
            block = x[i, j * 32:(j + 1) * 32].astype(np.float64)
            amax = float(np.abs(block).max())
            if amax == 0:
                e = -127
            elif rounding == "ceil":
                e = -127
                while 2.0**e * FMT_MAX[fmt] < amax:  # smallest power of two with amax / 2^e <= fmt_max
                    e += 1
            else:
                e = math.frexp(amax)[1] - 1 - emax
            e = max(-127, min(127, e))
            codes[i, j * 32:(j + 1) * 32] = np_cast((block / 2.0**e).astype(np.float32), fmt)
            exps[i, j] = e + 127
    return codes, exps


# FP4 (E2M1) and the FP4 recipes ----------------------------------------------------------------------------
# Ported from the rules of TransformerEngine's NVFP4 recipe (its Python reference quantizer
# transformer_engine/pytorch/custom_recipes/reference_nvfp4.py and the cast kernels under
# transformer_engine/common/cast/nvfp4/), which cannot run here (TE imports its compiled library), and from the
# OCP MX spec for MXFP4. Element casts by ml_dtypes; everything else block by block in numpy float32.
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
TE_RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)  # TE's get_wgrad_sign_vector()


def e2m1_codes(x: np.ndarray) -> np.ndarray:
    """E2M1 codes (0-15, one per uint8) of float32 values by ml_dtypes' cast (nearest even, saturating to +-6);
    NaN -> 0x7 (TE's satfinite: positive max; ml_dtypes would give +-0)."""
    x = np.asarray(x, np.float32)
    with np.errstate(invalid="ignore"):
        codes = x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0x0F
    return np.where(np.isnan(x), 0x7, codes).astype(np.uint8)


def e2m1_values(codes: np.ndarray) -> np.ndarray:
    return np.asarray(codes, np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)


def e2m1_stochastic_codes(x: np.ndarray, rbits: np.ndarray) -> np.ndarray:
    """TE's stochastic rounding element by element: t = float32(|x| + rbits / 256 * spacing(|x|)), the result the
    largest grid value <= t (at most 6), with x's sign; NaN -> 0x7."""
    x = np.asarray(x, np.float32)
    out = np.zeros(x.shape, np.uint8)
    for idx in np.ndindex(x.shape):
        v = float(x[idx])
        if math.isnan(v):
            out[idx] = 0x7
            continue
        a = abs(v)
        spacing = 0.5 if a < 2 else (1.0 if a < 4 else 2.0)
        t = float(np.float32(a) + np.float32(int(rbits[idx]) / 256.0 * spacing))
        magnitude = max(i for i, g in enumerate(E2M1_GRID) if g <= t)
        out[idx] = magnitude | (8 if math.copysign(1.0, v) < 0 else 0)
    return out


def hadamard_reference(x: np.ndarray, signs=TE_RHT_SIGNS) -> np.ndarray:
    """TE's random Hadamard transform of each 16-run along the last dim, y = (x * signs) · H / 4, by the fast
    Walsh-Hadamard butterfly in float64 (float32 out; round to bfloat16 where the input was)."""
    v = np.asarray(x, np.float64).reshape(-1, 16) * np.asarray(signs, np.float64)
    h = 1
    while h < 16:
        for start in range(0, 16, 2 * h):
            a = v[:, start:start + h].copy()
            b = v[:, start + h:start + 2 * h].copy()
            v[:, start:start + h], v[:, start + h:start + 2 * h] = a + b, a - b
        h *= 2
    return (v / 4.0).reshape(np.shape(x))


def nvfp4_reference(x: np.ndarray, tile_rows: int = 1, rbits: np.ndarray | None = None,
                    amax: float | None = None) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """NVFP4 quantization of a 2-D float32 array, block by block: (codes (m, k), E4M3 scale bytes (m, k / 16),
    the amax used). Per tensor S_enc = float32(448 * 6) / amax (FLT_MAX on overflow, 1 for amax 0 or a zero
    quotient), S_dec = 1 / S_enc; per block of 16 (or 16x16 with tile_rows=16) the E4M3 scale is
    block_amax * (S_enc * float32(1/6)), clamped to 448, cast by ml_dtypes; the encode multiplier
    1 / (scale * S_dec) (at most FLT_MAX); the codes those of x * multiplier."""
    f32 = np.float32
    x = np.asarray(x, f32)
    m, k = x.shape
    amax = f32(np.abs(x).max()) if amax is None else f32(amax)
    with np.errstate(divide="ignore", over="ignore"):
        s_enc = f32(f32(448.0 * 6.0) / amax)
    if math.isinf(s_enc):
        s_enc = f32(FLT_MAX)
    if amax == 0 or s_enc == 0:
        s_enc = f32(1.0)
    s_dec = f32(f32(1.0) / s_enc)
    multiplier = f32(s_enc * f32(1.0 / 6.0))
    codes = np.zeros((m, k), np.uint8)
    scales = np.zeros((m, k // 16), np.uint8)
    for i in range(0, m, tile_rows):
        for j in range(k // 16):
            block = x[i:i + tile_rows, j * 16:(j + 1) * 16]
            decode = f32(min(f32(f32(np.abs(block).max()) * multiplier), f32(FLT_MAX)))
            scale = np.array([min(decode, f32(448.0))], f32).astype(ml_dtypes.float8_e4m3fn)
            with np.errstate(divide="ignore"):
                encode = f32(f32(1.0) / f32(f32(scale.astype(f32)[0]) * s_dec))
            encode = min(encode, f32(FLT_MAX))
            scaled = (block * encode).astype(f32)
            part = (e2m1_codes(scaled) if rbits is None
                    else e2m1_stochastic_codes(scaled, rbits[i:i + tile_rows, j * 16:(j + 1) * 16]))
            codes[i:i + tile_rows, j * 16:(j + 1) * 16] = part
            scales[i:i + tile_rows, j] = scale.view(np.uint8)[0]
    return codes, scales, amax


def nvfp4_dequantize_reference(codes: np.ndarray, scales: np.ndarray, amax: float) -> np.ndarray:
    """TE's NVFP4 dequantize: code * ((scale * amax) * float32(1 / (6 * 448))), each product in float32."""
    f32 = np.float32
    scale = np.repeat(np.asarray(scales, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(f32), 16, axis=1)
    return e2m1_values(codes) * ((scale * f32(amax)).astype(f32) * f32(1.0 / (6.0 * 448.0)))


def mxfp4_reference(x: np.ndarray, rounding: str = "floor") -> tuple[np.ndarray, np.ndarray]:
    """MXFP4 along the last dim in blocks of 32 (OCP MX): (codes, E8M0 biased exponents). "floor": the spec's
    X = 2^(floor(log2(amax)) - emax), emax = 2 for E2M1; "ceil": the smallest power of two with amax / X <= 6."""
    m, k = x.shape
    codes = np.zeros((m, k), np.uint8)
    exps = np.zeros((m, k // 32), np.uint8)
    for i in range(m):
        for j in range(k // 32):
            block = x[i, j * 32:(j + 1) * 32].astype(np.float64)
            amax = float(np.abs(block).max())
            if amax == 0:
                e = -127
            elif rounding == "ceil":
                e = -127
                while 2.0**e * 6.0 < amax:
                    e += 1
            else:
                e = math.frexp(amax)[1] - 1 - 2
            e = max(-127, min(127, e))
            codes[i, j * 32:(j + 1) * 32] = e2m1_codes((block / 2.0**e).astype(np.float32))
            exps[i, j] = e + 127
    return codes, exps
