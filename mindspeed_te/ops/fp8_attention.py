"""FP8 attention (TransformerEngine's `fp8_dpa`) as an exact emulation, flash-attention style.

TE's fused FP8 attention takes Q, K and V as FP8 codes with one per-tensor scale for the three of them (its QKV
quantizer), and takes dO quantized in the backward format. Under delayed scaling its kernels also write O and
dQ, dK, dV in FP8 (the O and dQKV quantizers), which TE then dequantizes; under current scaling those stay in
high precision. Here the same tensors are quantized the same way, and attention itself runs on their
dequantized values through the caller's high-precision path:

    forward   codes = quantize(Q, K, V); O = attend(dequantize(codes)), keeping nothing of it; O quantized
              under delayed scaling
    saved     the codes and their scale (1 byte an element), the RNG state when there is dropout
    backward  dO quantized; attend(dequantize(codes)) run again with autograd, from the saved RNG state (the
              same dropout mask), and differentiated with the quantized dO; dQ, dK, dV quantized together
              under delayed scaling

Nothing of the high-precision Q, K, V or of the attention's own intermediates is kept between forward and
backward: that is the point, activations at 1 byte an element. The price is a second attention forward in
backward. The softmax's own FP8 tensors in TE's kernels (S and dP) are not emulated: the caller's path
computes them in high precision.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from mindspeed_te.kernels import get_backend
from mindspeed_te.ops.cpu_offload import stash, unstash
from mindspeed_te.quantizers import Quantizer
from mindspeed_te.state import FP8GlobalStateManager
from mindspeed_te.tensor import QuantizedTensorStorage

__all__ = ["AttentionQuantizers", "fp8_attention"]

# attend(query, key, value, *extras) -> output: the caller's high-precision attention
Attend = Callable[..., torch.Tensor]


@dataclass
class AttentionQuantizers:
    """The quantizers of TE's DPA for the tensors at its kernel's boundary (TE's names): `qkv` (Q, K, V
    together), `dout` (dO); `out` (O) and `dqkv` (dQ, dK, dV together) only where TE's kernel writes them in
    FP8 (delayed scaling), else None."""

    qkv: Quantizer
    dout: Quantizer
    out: Optional[Quantizer] = None
    dqkv: Optional[Quantizer] = None


@dataclass
class _Args:
    attend: Attend
    quantizers: AttentionQuantizers
    rng: Optional[contextlib.AbstractContextManager]
    dropout: bool
    reduce_amax_in_backward: bool
    graph: bool  # autograd records this call


def _quantize_together(quantizer: Quantizer, tensors: Sequence[torch.Tensor]) -> QuantizedTensorStorage:
    """One per-tensor quantize of the tensors' elements one after another (TE quantizes Q, K, V as one)."""
    quantizer.set_usage(rowwise=True, columnwise=False)
    flat = tensors[0].reshape(-1) if len(tensors) == 1 else torch.cat([t.reshape(-1) for t in tensors])
    return get_backend(flat.device).quantize(quantizer, flat)


def _dequantize_apart(codes: QuantizedTensorStorage, shapes: Sequence[torch.Size],
                      dtype: torch.dtype) -> list[torch.Tensor]:
    """The tensors `_quantize_together` took, dequantized to `dtype`."""
    values = codes.dequantize(dtype)
    return [part.view(shape) for part, shape in zip(values.split([s.numel() for s in shapes]), shapes)]


def _fake_quantize(quantizer: Quantizer, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors as their codes under one scale give them back."""
    codes = _quantize_together(quantizer, tensors)
    return _dequantize_apart(codes, [t.shape for t in tensors], tensors[0].dtype)


def _rng_state(device: torch.device) -> torch.Tensor:
    """The state of the generator that draws dropout masks of tensors on `device`."""
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device).get_rng_state(device)


def _set_rng_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device).set_rng_state(state, device)


@contextlib.contextmanager
def _drawing_from(device: torch.device, state: Optional[torch.Tensor]) -> Iterator[None]:
    """Dropout in the block draws from `state` (the forward's), and the generator is left as it was."""
    if state is None:
        yield
        return
    saved = _rng_state(device)
    _set_rng_state(device, state)
    try:
        yield
    finally:
        _set_rng_state(device, saved)


def _dropped(_: torch.Tensor) -> None:
    """The forward's graph keeps nothing: it is never run backward (the recompute makes its own)."""


def _never_read(_: None) -> torch.Tensor:
    raise RuntimeError("fp8_attention: the forward's graph is not differentiable; its recompute is")


def _leaves(tensors: Sequence[Optional[torch.Tensor]], needs: Sequence[bool]) -> list[Optional[torch.Tensor]]:
    """The tensors as new autograd leaves, requiring grad where `needs` says."""
    return [t.detach().requires_grad_(need) if t is not None else None for t, need in zip(tensors, needs)]


class _FP8Attention(torch.autograd.Function):
    keeps_output = False  # a linear reading the output keeps its own quantized copy (ops/rebuild.py)

    @staticmethod
    def forward(ctx, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, args: _Args,
                *extras: Optional[torch.Tensor]) -> torch.Tensor:
        shapes = [query.shape, key.shape, value.shape]
        codes = _quantize_together(args.quantizers.qkv, (query, key, value))
        # Run as the backward's recompute will (and high-precision attention would): with a graph when one is
        # made, which may choose the kernel (torch's SDPA takes another for a mask that requires grad). That graph
        # saves nothing and is dropped at once (nor does an activation offload's hook see anything of it).
        needs = ctx.needs_input_grad if args.graph else (False,) * (4 + len(extras))
        with (torch.set_grad_enabled(args.graph), torch.autograd.graph.saved_tensors_hooks(_dropped, _never_read),
              args.rng or contextlib.nullcontext()):
            ctx.rng_state = _rng_state(query.device) if args.dropout else None
            out = args.attend(*_leaves(_dequantize_apart(codes, shapes, query.dtype), needs[:3]),
                              *_leaves(extras, needs[4:])).detach()
        if args.quantizers.out is not None:
            out, = _fake_quantize(args.quantizers.out, [out])
        ctx.args, ctx.shapes, ctx.dtype = args, shapes, query.dtype
        ctx.codes = stash(codes)  # the activation may go to host memory (cpu_offload)
        ctx.save_for_backward(*extras)
        if args.reduce_amax_in_backward:
            FP8GlobalStateManager.expect_backward_reduction(ctx)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[Any, ...]:
        args: _Args = ctx.args
        dout, = _fake_quantize(args.quantizers.dout, [grad_out.contiguous()])
        needs = ctx.needs_input_grad
        qkv = _leaves(_dequantize_apart(unstash(ctx.codes), ctx.shapes, ctx.dtype), needs[:3])
        extras = _leaves(ctx.saved_tensors, needs[4:])
        with torch.enable_grad(), _drawing_from(grad_out.device, ctx.rng_state):
            out = args.attend(*qkv, *extras)
        wanted = [t for t in (*qkv, *extras) if t is not None and t.requires_grad]
        found = dict(zip(map(id, wanted), torch.autograd.grad(out, wanted, dout, allow_unused=True)))
        dqkv = [found.get(id(t)) for t in qkv]
        extra_grads = [found.get(id(e)) if e is not None else None for e in extras]
        present = [i for i, g in enumerate(dqkv) if g is not None]
        if args.quantizers.dqkv is not None and present:
            for i, g in zip(present, _fake_quantize(args.quantizers.dqkv, [dqkv[i] for i in present])):
                dqkv[i] = g
        if args.reduce_amax_in_backward:
            # This is the first FP8 module of the step, so its backward is the last one to run.
            FP8GlobalStateManager.reduce_backward_amaxes(ctx)
        ctx.codes = ctx.rng_state = None
        return (*dqkv, None, *extra_grads)


def fp8_attention(attend: Attend, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  extras: Sequence[Optional[torch.Tensor]], quantizers: AttentionQuantizers, *,
                  rng: Optional[contextlib.AbstractContextManager] = None, dropout: bool = False,
                  reduce_amax_in_backward: bool = False) -> torch.Tensor:
    """attend(query, key, value, *extras) with Q, K, V (and dO; O and dQKV where `quantizers` has them) in FP8,
    keeping only the codes of Q, K, V for backward (see the module docstring).

    attend: the high-precision attention, run once in forward and once more in backward; every collective it
        runs (a context-parallel gather) runs again there, in the same order on every rank
    extras: further inputs of `attend` (a learnable softmax offset, an attention bias), kept as they are and
        differentiated when they require grad
    rng: the context dropout draws in (an RNG tracker's fork), entered in forward only: backward draws from the
        state saved inside it
    dropout: whether `attend` draws dropout masks (the RNG state is then saved)
    reduce_amax_in_backward: set for the step's first FP8 module; its backward reduces the backward amaxes
    """
    graph = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (query, key, value, *extras))
    args = _Args(attend, quantizers, rng, dropout, reduce_amax_in_backward, graph)
    return _FP8Attention.apply(query, key, value, args, *extras)
