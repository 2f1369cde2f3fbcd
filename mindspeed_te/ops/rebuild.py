"""Linear inputs that backward can rebuild instead of keeping: the output of an activation whose own backward keeps
the activation's input (GeLU, SiLU, Megatron's fused bias-GeLU). In a GPT MLP that is fc2's input.

Such an output is a pure function of tensors autograd keeps anyway. So fc2 keeps no quantized copy of it (2 of a
GPT layer's 8 bytes per token and hidden unit, once attention is FP8): its wgrad recomputes the activation (one
elementwise op) and quantizes it with the forward's scale, as `save_original_input` does, reading the same codes.
TransformerEngine keeps the quantized copy; this costs an activation and a quantize in backward and saves the
bytes (docs/differences-from-te.md).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

__all__ = ["RebuiltInput", "producer_drops_output", "rebuildable_input"]

# Pure views that may sit between the activation and the linear (a reshape to 2-D).
_VIEWS = frozenset({"ViewBackward0", "ReshapeAliasBackward0", "UnsafeViewBackward0"})
# Megatron's autograd functions that keep exactly their tensor arguments, in order, and whose forward is a pure
# elementwise function of them.
_FUNCTIONS = frozenset({"megatron.core.fusions.fused_bias_gelu.GeLUFunction"})


@dataclass
class RebuiltInput:
    """The recipe for a linear's input: `fn(*args)` laid out as `shape`. The args are tensors the activation's
    own backward keeps: holding them here keeps no extra bytes (the linear's backward runs before the
    activation's)."""

    fn: Callable[..., torch.Tensor]
    args: tuple[torch.Tensor, ...]
    shape: torch.Size
    versions: tuple[int, ...]

    def __call__(self) -> torch.Tensor:
        if tuple(a._version for a in self.args) != self.versions:
            raise RuntimeError("mindspeed_te: an activation's saved input was modified in place after the forward; "
                               "the next linear cannot rebuild its input")
        with torch.no_grad():
            return self.fn(*self.args).reshape(self.shape)


def _producer(t: torch.Tensor):
    """The autograd node that made `t`, past pure views."""
    node = t.grad_fn
    while node is not None and type(node).__name__ in _VIEWS:
        node = node.next_functions[0][0]
    return node


def producer_drops_output(t: torch.Tensor) -> bool:
    """Whether `t` comes from an autograd function that keeps nothing of its output (a class attribute
    `keeps_output = False`: FP8 attention). Megatron makes a linear keep its original input when that input is
    attention's output (`save_original_input`), since TE's attention keeps it anyway; after ours it would be the
    only copy, and the quantized one is smaller."""
    forward_cls = getattr(_producer(t), "_forward_cls", None)
    return getattr(forward_cls, "keeps_output", True) is False


def _recipe(node) -> Optional[tuple[Callable[..., torch.Tensor], tuple[torch.Tensor, ...]]]:
    name = type(node).__name__
    if name == "GeluBackward0":
        return functools.partial(F.gelu, approximate=node._saved_approximate), (node._saved_self,)
    if name == "SiluBackward0":
        return F.silu, (node._saved_self,)
    forward_cls = getattr(node, "_forward_cls", None)
    if forward_cls is not None and f"{forward_cls.__module__}.{forward_cls.__qualname__}" in _FUNCTIONS:
        saved = node.saved_tensors
        if all(isinstance(t, torch.Tensor) for t in saved):
            return forward_cls.apply, tuple(saved)
    return None


def rebuildable_input(inp: torch.Tensor, x2d: torch.Tensor) -> Optional[RebuiltInput]:
    """How to rebuild `x2d` (`inp`, or its 2-D view) in backward, when `inp` is a known activation's output (or a
    view of one with its numel); else None. Also None under saved-tensor hooks (activation offload, torch's
    checkpoint): reading the activation's saved input would unpack it there."""
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        return None
    node = _producer(inp)
    if node is None:
        return None
    recipe = _recipe(node)
    if recipe is None:
        return None
    fn, args = recipe
    source = args[0]
    if source.numel() != x2d.numel() or source.dtype != x2d.dtype or source.device != x2d.device:
        return None
    return RebuiltInput(fn, args, x2d.shape, tuple(a._version for a in args))
