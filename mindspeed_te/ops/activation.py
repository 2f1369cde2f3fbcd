"""TransformerEngine's MLP activations (the `activation=` names of LayerNormMLP), computed in (at least)
float32 and returned in the input's dtype, as TE's kernels do; torch's autograd differentiates them.

Gated variants split the last dimension in two halves a, b and return act(a) · b: TE gates the *first*
half (PyTorch's `glu` gates the second).

`fused_activation_input`: where the backend runs an activation and the next linear's input quantize as one kernel
(NPU: SwiGLU into MXFP8), that kernel makes the quantized input and the activation's backward recomputes its float32
graph from the saved input, so the gradient is autograd's on the unfused path, bit for bit.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from mindspeed_te.kernels import get_backend
from mindspeed_te.ops.linear import LinearQuantizers
from mindspeed_te.ops.prequantized import fused_input_quantizer, with_prequantized_input

__all__ = ["ACTIVATIONS", "GATED_ACTIVATIONS", "activation_function", "fused_activation_input"]

Activation = Callable[[torch.Tensor], torch.Tensor]


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")  # TE's GELU is the tanh approximation


def _qgelu(x: torch.Tensor, alpha: float = 1.702) -> torch.Tensor:
    return x * torch.sigmoid(alpha * x)


def _srelu(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


_UNARY: dict[str, Activation] = {"gelu": _gelu, "qgelu": _qgelu, "relu": F.relu, "srelu": _srelu, "silu": F.silu}
# gated name -> activation applied to the first half
_GATES: dict[str, Activation] = {"geglu": _gelu, "glu": torch.sigmoid, "qgeglu": _qgelu, "reglu": F.relu,
                                 "sreglu": _srelu, "swiglu": F.silu}
_CLAMPED_SWIGLU_DEFAULTS = {"limit": 7.0, "alpha": 1.702, "glu_linear_offset": 1.0}

GATED_ACTIVATIONS = (*_GATES, "clamped_swiglu")
ACTIVATIONS = (*_UNARY, *GATED_ACTIVATIONS)


def _gated(gate: Activation, x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return gate(a) * b


def _clamped_swiglu(x: torch.Tensor, limit: float, alpha: float, glu_linear_offset: float) -> torch.Tensor:
    """GPT-OSS's SwiGLU as TE computes it: the gated half clamped from above at `limit` and passed through
    x·sigmoid(alpha·x); the linear half clamped to [-limit, limit] plus `glu_linear_offset`."""
    a, b = x.chunk(2, dim=-1)
    return _qgelu(a.clamp(max=limit), alpha) * (b.clamp(-limit, limit) + glu_linear_offset)


def _in_float32(fn: Activation, x: torch.Tensor) -> torch.Tensor:
    """At least float32 (float64 stays float64), result in x's dtype."""
    return fn(x.to(torch.promote_types(x.dtype, torch.float32))).to(x.dtype)


def activation_function(name: str, params: Optional[dict] = None) -> Activation:
    """The activation `name` (one of ACTIVATIONS). `params` only for "clamped_swiglu": limit (7.0), alpha
    (1.702), glu_linear_offset (1.0)."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}; got {name!r}")
    params = dict(params or {})
    if name == "clamped_swiglu":
        unknown = set(params) - set(_CLAMPED_SWIGLU_DEFAULTS)
        if unknown:
            raise ValueError(f"activation_params for 'clamped_swiglu' take {', '.join(_CLAMPED_SWIGLU_DEFAULTS)}; "
                             f"got {', '.join(sorted(unknown))}")
        fn: Activation = functools.partial(_clamped_swiglu, **{**_CLAMPED_SWIGLU_DEFAULTS, **params})
    elif params:
        raise ValueError(f"activation_params apply to 'clamped_swiglu' only, not {name!r}")
    elif name in _GATES:
        fn = functools.partial(_gated, _GATES[name])
    else:
        fn = _UNARY[name]
    return functools.partial(_in_float32, fn)


class _FusedActivationQuantize(torch.autograd.Function):
    """x's activation and the next linear's input quantize as one kernel (`KernelBackend.activation_quantize` where
    `fuses_activation_quantize` holds): the quantized form goes out through `made`, the output is a stand-in (its
    shape and dtype, no values). Backward recomputes the activation's float32 graph from the saved x and
    differentiates it as autograd differentiates `activation_function(name)`: the same ops on the same values, so
    the same gradient. Only x is kept, in its own dtype (the unfused graph keeps float32 copies)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, name: str, fn: Activation, quantizer: Any, backend: Any,
                made: list) -> torch.Tensor:
        made.append(backend.activation_quantize(name, x, quantizer, fn))
        ctx.fn = fn
        ctx.save_for_backward(x)
        ctx.set_materialize_grads(False)
        return x.new_empty(1).expand(made[0].shape)

    @staticmethod
    def backward(ctx: Any, dy: Optional[torch.Tensor]) -> tuple:
        if dy is None:
            return None, None, None, None, None, None
        (x,) = ctx.saved_tensors
        inner = ctx.fn.args[0]  # activation_function's functools.partial(_in_float32, inner)
        with torch.enable_grad():
            xd = x.detach().requires_grad_()
            y = inner(xd.to(torch.promote_types(x.dtype, torch.float32)))
        # _in_float32's last cast to x's dtype differentiates to dy cast to y's dtype.
        (dx,) = torch.autograd.grad(y, xd, dy.to(y.dtype))
        return dx, None, None, None, None, None


def fused_activation_input(name: str, fn: Activation, x: torch.Tensor, quantizers: Optional[LinearQuantizers],
                           weight: torch.Tensor, fp8_wgrad: bool) -> Optional[tuple[torch.Tensor, LinearQuantizers]]:
    """For `fp8_linear(fn(x), weight, quantizers=quantizers, fp8_wgrad=fp8_wgrad)`, fn = `activation_function(name,
    ...)`: where the backend runs the activation and that linear's input quantize as one kernel, (a stand-in for
    fn(x), `quantizers` with the input's form made: pass both to fp8_linear); None otherwise (compute fn(x))."""
    quantizer = fused_input_quantizer(quantizers, weight, fp8_wgrad)
    if quantizer is None:
        return None
    backend = get_backend(x.device)
    x2d = x.reshape(-1, x.shape[-1])
    if not backend.fuses_activation_quantize(name, x2d, quantizer):
        return None
    made: list = []
    out = _FusedActivationQuantize.apply(x2d, name, fn, quantizer, backend, made)
    return out.reshape(*x.shape[:-1], out.shape[-1]), with_prequantized_input(quantizers, made[0])
