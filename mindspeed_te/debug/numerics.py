"""Per-layer FP8 / FP4 numerics: how each quantized operand of each linear fares in its format, and how it would
fare in the other formats (the counterfactual: "this layer in HiF8 vs E4M3 vs MXFP8 vs NVFP4 vs MXFP4").

An active report registers its recorder's `record` as the state manager's operand observer, which the linear
autograd functions call with each quantized operand; a disabled report registers nothing, which costs one
check per GEMM and computes nothing.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from mindspeed_te.formats import FP8Dtype
from mindspeed_te.fp4 import random_hadamard_transform
from mindspeed_te.quantizers import (
    Float8CurrentScalingQuantizer,
    MXFP4Quantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    Quantizer,
)
from mindspeed_te.tensor import Float8TensorStorage, QuantizedTensorStorage, _FP4TensorStorage, _TiledTensor

__all__ = ["TensorStats", "tensor_stats", "element_scale_inv", "COUNTERFACTUALS", "BLOCK", "NumericsRecorder"]

def _counterfactual(fwd_dtype: FP8Dtype, fwd_max: float, bwd_dtype: FP8Dtype, bwd_max: float
                    ) -> Callable[[str], Quantizer]:
    def make(tensor: str) -> Quantizer:
        dtype, target = (bwd_dtype, bwd_max) if tensor == "grad_output" else (fwd_dtype, fwd_max)
        return Float8CurrentScalingQuantizer(dtype, target, rowwise=True, columnwise=False)
    return make


# The formats every operand is also quantized in, with current (per-tensor), MX (per-32) or NVFP4 (per-16
# under a per-tensor scale) scaling; targets are the recipes' defaults (HiF8 15 / 224, E4M3 448). FP4 rounds
# to nearest, with no Hadamard transform (it acts on the wgrad forms, not on these rowwise ones): stochastic
# rounding would draw from the generator training uses. NVFP4 weights take TE's default 16x16 tiles.
COUNTERFACTUALS: dict[str, Callable[[str], Quantizer]] = {
    "hif8": _counterfactual(FP8Dtype.HIF8, 15.0, FP8Dtype.HIF8, 224.0),
    "e4m3": _counterfactual(FP8Dtype.E4M3, 448.0, FP8Dtype.E4M3, 448.0),
    "mxfp8": lambda tensor: MXFP8Quantizer(FP8Dtype.E4M3, rowwise=True, columnwise=False),
    "nvfp4": lambda tensor: NVFP4Quantizer(rowwise=True, columnwise=False, with_2d_quantization=tensor == "weight"),
    "mxfp4": lambda tensor: MXFP4Quantizer(rowwise=True, columnwise=False),
}
# Both dims of the 2-D operand must be multiples of the block for these; other operands skip the format.
BLOCK = {"mxfp8": 32, "nvfp4": 16, "mxfp4": 32}


@dataclass
class TensorStats:
    """Statistics of one quantized tensor against its high-precision original."""

    amax: float
    scale: float  # per-tensor scale; for block-scaled tensors the smallest block scale (the largest block)
    saturated_pct: float  # elements beyond the largest value their scale can represent
    flushed_pct: float  # nonzero elements that quantize to zero
    rel_error: float  # ||q - x|| / ||x||
    sqnr_db: float  # 10 log10(sum x^2 / sum (q - x)^2); inf when exact


def element_scale_inv(q: QuantizedTensorStorage) -> torch.Tensor:
    """The scale_inv of every element in the 2-D (rows, last dim) logical layout, broadcastable to it."""
    if isinstance(q, Float8TensorStorage):
        return q.scale_inv.float().reshape(1, 1)
    if isinstance(q, _TiledTensor):
        columnwise = not q.has_data(False)
        data, scale_inv = q.columnwise_pair() if columnwise else (q.rowwise_data.reshape(-1, q.shape[-1]),
                                                                  q.rowwise_scale_inv)
        rows, cols = q._tile()
        scales = q._scale_inv_values(scale_inv).float()
        m, k = data.shape
        scales = scales.repeat_interleave(rows, dim=0)[:m].repeat_interleave(cols, dim=1)[:, :k]
        return scales.t() if columnwise else scales
    if isinstance(q, _FP4TensorStorage):
        columnwise = not q.has_data(False)
        scales = q._multipliers(columnwise).repeat_interleave(q.block_len, dim=1)
        # a Hadamard-transformed form is compared as stored, (K, M): see tensor_stats
        return scales.t() if columnwise and q.columnwise_rht_sign_mask is None else scales
    raise TypeError(f"no element scales for {type(q).__name__}")


def tensor_stats(x: torch.Tensor, q: QuantizedTensorStorage) -> TensorStats:
    """Compare `q` (the quantized form of `x`) with `x`: its rowwise form, else its columnwise one."""
    columnwise = not q.has_data(False)
    sign_mask = getattr(q, "columnwise_rht_sign_mask", None) if columnwise else None
    if sign_mask is not None:  # an FP4 wgrad form alone: compared where it was cast, after the Hadamard transform
        x2d = random_hadamard_transform(x.detach().reshape(-1, x.shape[-1]).t().contiguous(), sign_mask).float()
        dq = q.columnwise_hadamard_values()
    else:
        x2d = x.detach().float().reshape(-1, x.shape[-1])
        dq = q.dequantize(torch.float32, columnwise=columnwise).reshape(x2d.shape)
    scale_inv = element_scale_inv(q)
    ax = x2d.abs()
    n = max(x2d.numel(), 1)
    saturated = (ax > q.fp8_dtype.max * scale_inv).sum().item()
    flushed = ((x2d != 0) & (dq == 0)).sum().item()
    signal = x2d.double().square().sum().item()
    noise = (dq - x2d).double().square().sum().item()
    return TensorStats(
        amax=ax.max().item() if x2d.numel() else 0.0,
        scale=1.0 / scale_inv.max().item(),
        saturated_pct=100.0 * saturated / n,
        flushed_pct=100.0 * flushed / n,
        rel_error=math.sqrt(noise / signal) if signal > 0 else 0.0,
        sqnr_db=10.0 * math.log10(signal / noise) if noise > 0 and signal > 0 else math.inf,
    )


class NumericsRecorder:
    """Collects one row per (step, layer, tensor, format): the format the recipe used ("recipe") and each
    counterfactual format. Layer names come from `watch(model)` (the weight's parameter name)."""

    def __init__(self, counterfactuals: bool = True) -> None:
        self.counterfactuals = counterfactuals
        self.rows: list[dict] = []
        self.step = 0
        self._names: dict[int, str] = {}

    def watch(self, model: torch.nn.Module) -> None:
        for name, param in model.named_parameters():
            self._names[id(param)] = name.removesuffix(".weight")

    def layer_name(self, weight: torch.Tensor) -> str:
        return self._names.setdefault(id(weight), f"linear{len(self._names)}")

    def record(self, weight: torch.Tensor, tensor: str, x: torch.Tensor, q: QuantizedTensorStorage) -> None:
        """Called by the linear autograd for each quantized operand (tensor: input, weight, grad_output)."""
        layer = self.layer_name(weight)
        self._add(layer, tensor, "recipe:" + q.fp8_dtype.name.lower(), tensor_stats(x, q))
        if self.counterfactuals:
            x2d = x.detach().reshape(-1, x.shape[-1])
            for fmt, make in COUNTERFACTUALS.items():
                if x2d.shape[0] % BLOCK.get(fmt, 1) or x2d.shape[1] % BLOCK.get(fmt, 1):
                    continue
                self._add(layer, tensor, fmt, tensor_stats(x2d, make(tensor).quantize(x2d)))

    def _add(self, layer: str, tensor: str, fmt: str, stats: TensorStats) -> None:
        self.rows.append({"step": self.step, "layer": layer, "tensor": tensor, "format": fmt, **asdict(stats)})
