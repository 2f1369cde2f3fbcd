"""`LayerNorm` and `RMSNorm` with TransformerEngine semantics: float32 math whatever the input dtype, output in
the input dtype, optional zero-centered gamma, and the `sequence_parallel` parameter flag Megatron reads."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, Union

import torch

from mindspeed_te.kernels import get_backend
from mindspeed_te.quantizers import Quantizer
from mindspeed_te.tensor import QuantizedTensorStorage

__all__ = ["NORMALIZATIONS", "LayerNorm", "RMSNorm", "layer_norm", "norm_parameters", "normalize",
           "normalize_and_quantize", "rms_norm"]

NORMALIZATIONS = ("LayerNorm", "RMSNorm")

ShapeLike = Union[int, Sequence[int]]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 for bf16/fp16/fp32 inputs (as TE's kernels); float64 inputs keep their precision."""
    return torch.promote_types(x.dtype, torch.float32)


def _gamma(weight: torch.Tensor, zero_centered_gamma: bool, dtype: torch.dtype) -> torch.Tensor:
    """The applied scale: the weight itself (the backends compute with its values in float32, which a kernel does
    without a cast launch), or with zero-centered gamma, where the stored weight is gamma - 1, 1 + weight in the
    compute dtype: adding the 1 in bf16 would round away the small deviations the weight stores."""
    return weight.to(dtype) + 1 if zero_centered_gamma else weight


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
               zero_centered_gamma: bool = False) -> torch.Tensor:
    """LayerNorm over the trailing `weight.shape` dims, computed in float32, returned in x's dtype, through the
    kernel backend (an NPU's kernel takes x, gamma and beta without casts)."""
    return get_backend(x.device).layer_norm(x, _gamma(weight, zero_centered_gamma, _compute_dtype(x)), bias, eps)


def _rms_norm(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x², trailing gamma.shape dims) + eps) · gamma, computed in float32, in x's dtype.

    The single place RMSNorm is computed, so that an NPU can run it as `torch_npu.npu_rms_norm(x, gamma, eps)`
    (through the kernel backend). `gamma` is the applied scale, already 1 + weight for zero-centered gamma."""
    return get_backend(x.device).rms_norm(x, gamma, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool = False) -> torch.Tensor:
    """RMSNorm over the trailing `weight.shape` dims, computed in float32, returned in x's dtype."""
    return _rms_norm(x, _gamma(weight, zero_centered_gamma, _compute_dtype(x)), eps)


def normalize(x: torch.Tensor, normalization: str, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
              zero_centered_gamma: bool = False) -> torch.Tensor:
    """`layer_norm` or `rms_norm` by name (the fused norm-then-GEMM modules' front end)."""
    if normalization == "RMSNorm":
        return rms_norm(x, weight, eps, zero_centered_gamma)
    return layer_norm(x, weight, bias, eps, zero_centered_gamma)


def normalize_and_quantize(x: torch.Tensor, normalization: str, weight: torch.Tensor, bias: Optional[torch.Tensor],
                           eps: float, zero_centered_gamma: bool, quantizer: Optional[Quantizer]
                           ) -> tuple[torch.Tensor, Optional[QuantizedTensorStorage]]:
    """`normalize`, and where the backend runs the norm and `quantizer` (its usage as set) as one kernel
    (`fuses_norm_quantize`), the quantized form it makes: (a stand-in for the norm's output, carrying its gradient,
    no values; the quantized form). Otherwise (the norm's output, None)."""
    backend = get_backend(x.device)
    gamma = _gamma(weight, zero_centered_gamma, _compute_dtype(x))
    if quantizer is not None and x.dim() >= 1:
        x2d = x.reshape(-1, x.shape[-1])
        if backend.fuses_norm_quantize(normalization, x2d, gamma, quantizer):
            stand_in, quantized = backend.norm_quantize(normalization, x2d, gamma, bias, eps, quantizer)
            return stand_in.reshape(x.shape), quantized
    if normalization == "RMSNorm":
        return backend.rms_norm(x, gamma, eps), None
    return backend.layer_norm(x, gamma, bias, eps), None


def norm_parameters(
    shape: ShapeLike,
    *,
    bias: bool,
    zero_centered_gamma: bool,
    sequence_parallel: bool,
    dtype: Optional[torch.dtype],
    device: Union[torch.device, str, None],
) -> tuple[torch.nn.Parameter, Optional[torch.nn.Parameter]]:
    """A norm's (weight, bias or None), initialised to the identity transform. Each carries
    `sequence_parallel`: under sequence parallelism every rank normalizes its own slice of the sequence, so
    their gradients are partial sums that Megatron all-reduces over the tensor-parallel group."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    dtype = dtype or torch.get_default_dtype()
    gamma_init = 0.0 if zero_centered_gamma else 1.0
    weight = torch.nn.Parameter(torch.full(shape, gamma_init, dtype=dtype, device=device))
    beta = torch.nn.Parameter(torch.zeros(shape, dtype=dtype, device=device)) if bias else None
    for param in (weight, beta):
        if param is not None:
            param.sequence_parallel = sequence_parallel
    return weight, beta


class _Norm(torch.nn.Module):
    """What LayerNorm and RMSNorm share: TE's constructor arguments and parameters."""

    def __init__(self, normalized_shape: ShapeLike, eps: float, sequence_parallel: bool,
                 params_dtype: Optional[torch.dtype], zero_centered_gamma: bool,
                 device: Union[torch.device, str, None], bias: bool) -> None:
        super().__init__()
        self.eps = eps
        self.sequence_parallel = sequence_parallel
        self.zero_centered_gamma = zero_centered_gamma
        weight, beta = norm_parameters(normalized_shape, bias=bias, zero_centered_gamma=zero_centered_gamma,
                                       sequence_parallel=sequence_parallel, dtype=params_dtype, device=device)
        self.weight = weight
        if beta is not None:
            self.bias = beta
        self.normalized_shape = tuple(weight.shape)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, sequence_parallel={self.sequence_parallel}, "
                f"zero_centered_gamma={self.zero_centered_gamma}")


class LayerNorm(_Norm):
    """TransformerEngine's LayerNorm: y = (x - mean) / sqrt(var + eps) · gamma + bias, where gamma is `weight`,
    or 1 + `weight` with `zero_centered_gamma` (weight then starts at 0, which keeps weight decay from
    pulling gamma towards 0).

    Args:
        normalized_shape: size(s) of the trailing dimension(s) normalized
        eps: added to the variance (mean square for RMSNorm) before the square root
        sequence_parallel: marks the parameters for Megatron's sequence-parallel gradient all-reduce
        params_dtype: parameter dtype (None: torch's default dtype)
        zero_centered_gamma: gamma = 1 + weight (see LayerNorm)
        device: where the parameters are created (None: torch's default device)
    """

    def __init__(self, normalized_shape: ShapeLike, eps: float = 1e-5, sequence_parallel: bool = False,
                 params_dtype: Optional[torch.dtype] = None, zero_centered_gamma: bool = False,
                 device: Union[torch.device, str, None] = None) -> None:
        super().__init__(normalized_shape, eps, sequence_parallel, params_dtype, zero_centered_gamma, device,
                         bias=True)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        return layer_norm(inp, self.weight, self.bias, self.eps, self.zero_centered_gamma)


class RMSNorm(_Norm):
    """TransformerEngine's RMSNorm: y = x / sqrt(mean(x²) + eps) · gamma, gamma as in `LayerNorm`; no bias.

    Args:
        normalized_shape, eps, sequence_parallel, params_dtype, zero_centered_gamma, device: as in LayerNorm
            (eps is added to the mean square)
    """

    def __init__(self, normalized_shape: ShapeLike, eps: float = 1e-5, sequence_parallel: bool = False,
                 params_dtype: Optional[torch.dtype] = None, zero_centered_gamma: bool = False,
                 device: Union[torch.device, str, None] = None) -> None:
        super().__init__(normalized_shape, eps, sequence_parallel, params_dtype, zero_centered_gamma, device,
                         bias=False)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        return rms_norm(inp, self.weight, self.eps, self.zero_centered_gamma)
