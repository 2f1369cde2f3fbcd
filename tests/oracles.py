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
    """MX quantization along the last dim in blocks of 32: (uint8 codes, uint8 E8M0 biased exponents)."""
    m, k = x.shape
    emax = {"E4M3": 8, "E5M2": 15}[fmt]
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
                while 2.0**e * FMT_MAX[fmt] < amax:  # smallest power of two with amax / 2^e <= fmt_max
                    e += 1
            else:
                e = math.frexp(amax)[1] - 1 - emax
            e = max(-127, min(127, e))
            codes[i, j * 32:(j + 1) * 32] = np_cast((block / 2.0**e).astype(np.float32), fmt)
            exps[i, j] = e + 127
    return codes, exps
