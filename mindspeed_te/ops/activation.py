"""TransformerEngine's MLP activations (the `activation=` names of LayerNormMLP), computed in (at least)
float32 and returned in the input's dtype, as TE's kernels do; torch's autograd differentiates them.

Gated variants split the last dimension in two halves a, b and return act(a) · b: TE gates the *first*
half (PyTorch's `glu` gates the second).
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.nn.functional as F

__all__ = ["ACTIVATIONS", "GATED_ACTIVATIONS", "activation_function"]

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
