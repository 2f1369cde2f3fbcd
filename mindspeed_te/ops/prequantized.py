"""A linear's input quantized ahead of `fp8_linear`, by a kernel that fuses the op in front of the linear (a norm,
an activation) with the quantize of its output (`KernelBackend.fuses_norm_quantize` / `fuses_activation_quantize`).

The fused kernel makes the quantized form only; the op's output then is a stand-in (its shape and dtype, no
values) that carries the op's gradient in autograd. So it serves only a linear that never reads its input's
high-precision values: fp8_linear keeps them for backward when the weight gradient runs in high precision or with
`save_original_input`, and an operand observer (the numerics report) reads them (`fused_input_quantizer`).
fp8_linear then takes the made form through `PrequantizedQuantizer` in place of its input quantizer."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from mindspeed_te.ops.linear import LinearQuantizers
from mindspeed_te.quantizers import Quantizer
from mindspeed_te.state import FP8GlobalStateManager
from mindspeed_te.tensor import QuantizedTensorStorage

__all__ = ["PrequantizedQuantizer", "fused_input_quantizer", "with_prequantized_input"]


class PrequantizedQuantizer(Quantizer):
    """Stands for `quantizer` once a fused kernel has quantized the tensor (`storage`, its non-finite flag already
    noted): `quantize` returns that storage. fp8_linear asks it for the usage the storage was made with (any
    other usage would need a form the kernel did not make: an error, never a silent requantize)."""

    def __init__(self, quantizer: Quantizer, storage: QuantizedTensorStorage) -> None:
        super().__init__(quantizer.fp8_dtype, rowwise=quantizer.rowwise_usage, columnwise=quantizer.columnwise_usage)
        self.quantizer = quantizer
        self.storage: Optional[QuantizedTensorStorage] = storage

    def set_usage(self, *, rowwise: Optional[bool] = None, columnwise: Optional[bool] = None) -> None:
        if rowwise not in (None, self.rowwise_usage) or columnwise not in (None, self.columnwise_usage):
            raise RuntimeError(f"a fused kernel quantized this input for rowwise={self.rowwise_usage}, columnwise="
                               f"{self.columnwise_usage}; fp8_linear asked rowwise={rowwise}, columnwise={columnwise}")

    def quantize(self, x: torch.Tensor) -> QuantizedTensorStorage:
        storage = self.storage
        if storage is None or tuple(storage.shape) != tuple(x.shape):
            raise RuntimeError("PrequantizedQuantizer: its storage was taken already, or x is not the tensor it "
                               "stands for")
        self.storage = None  # one use: the storage is the linear's from now on
        return storage


def fused_input_quantizer(quantizers: Optional[LinearQuantizers], weight: torch.Tensor, fp8_wgrad: bool,
                          save_original_input: bool = False) -> Optional[Quantizer]:
    """The input quantizer of `fp8_linear(x, weight, quantizers=quantizers, fp8_wgrad=..., save_original_input=...)`
    with the usage fp8_linear gives it (rowwise; columnwise for an FP8 weight gradient), when a fused kernel may make
    x's quantized form: quantized GEMMs, no high-precision input kept for backward (a weight that needs a gradient
    with a high-precision wgrad or save_original_input keeps it), no operand observer. None otherwise."""
    if quantizers is None or FP8GlobalStateManager.get_operand_observer() is not None:
        return None
    needs_wgrad = weight.requires_grad
    if needs_wgrad and (not fp8_wgrad or save_original_input):
        return None
    quantizers.input.set_usage(rowwise=True, columnwise=fp8_wgrad and needs_wgrad)
    return quantizers.input


def with_prequantized_input(quantizers: LinearQuantizers, storage: QuantizedTensorStorage) -> LinearQuantizers:
    """`quantizers` with the input's taken from `storage` (made by a fused kernel)."""
    return dataclasses.replace(quantizers, input=PrequantizedQuantizer(quantizers.input, storage))
