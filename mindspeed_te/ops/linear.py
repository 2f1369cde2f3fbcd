"""The FP8 linear autograd function every linear module uses.

Three GEMMs, each through the kernel backend with the recipe's formats:
    fprop  Y  = X · Wᵀ     (input rowwise,        weight rowwise)
    dgrad  dX = dY · W     (grad_output rowwise,  weight columnwise)
    wgrad  dW = dYᵀ · X    (grad_output columnwise, input columnwise)
Only the quantized input and weight are saved for backward, never their high-precision copies (unless
wgrad stays in high precision, which needs the real input, or `save_original_input` keeps it).
"""
from __future__ import annotations

from collections import OrderedDict
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from mindspeed_te.kernels import get_backend
from mindspeed_te.ops.cpu_offload import offloading, stash, unstash
from mindspeed_te.ops.rebuild import RebuiltInput, producer_drops_output, rebuildable_input
from mindspeed_te.ops.wgrad_store import WeightGradStore, WgradResult
from mindspeed_te.quantized_tensor import QuantizedTensor, dequantize_if_quantized
from mindspeed_te.quantizers import (
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    Float8RepeatQuantizer,
    Float8WarmupQuantizer,
    Quantizer,
)
from mindspeed_te.state import FP8GlobalStateManager
from mindspeed_te.tensor import QuantizedTensorStorage

__all__ = ["LinearQuantizers", "WeightCache", "fp8_linear", "saved_input_quantizers"]

Operand = Union[torch.Tensor, QuantizedTensorStorage]


@dataclass
class LinearQuantizers:
    """The quantizers of one linear: forward input and weight, backward grad_output."""

    input: Quantizer
    weight: Quantizer
    grad_output: Quantizer


class WeightCache:
    """Holds a weight's quantized form, and the bias in the form the backend's GEMM takes, between
    micro-batches of one step (TE's `is_first_microbatch`): True makes and stores, False reuses, None always
    makes and stores nothing."""

    def __init__(self) -> None:
        self.quantized: Optional[QuantizedTensorStorage] = None
        self.bias: Optional[torch.Tensor] = None

    def gemm_bias(self, bias: torch.Tensor, weight: QuantizedTensorStorage, is_first_microbatch: Optional[bool],
                  backend) -> torch.Tensor:
        """`backend.gemm_bias(bias, weight)`, made now or (is_first_microbatch False) taken from this step's
        store."""
        if is_first_microbatch is False and self.bias is not None:
            return self.bias
        converted = backend.gemm_bias(bias, weight)
        self.bias = converted if is_first_microbatch is not None else None
        return converted

    def cached(self, is_first_microbatch: Optional[bool]) -> Optional[QuantizedTensorStorage]:
        """The stored form when this micro-batch reuses it, else None (quantize now and `keep` it)."""
        return self.quantized if is_first_microbatch is False else None

    def keep(self, quantized: QuantizedTensorStorage, is_first_microbatch: Optional[bool]) -> None:
        self.quantized = quantized if is_first_microbatch is not None else None


def quantize_inputs_and_weights(xs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor],
                                qs: Sequence[LinearQuantizers], caches: Sequence[Optional[WeightCache]],
                                is_first_microbatch: Optional[bool], backend, row_blocks: bool = False
                                ) -> tuple[list[QuantizedTensorStorage], list[QuantizedTensorStorage]]:
    """The fprop operands of one or more GEMMs (a linear, or a grouped linear's experts): each input quantized
    now, each weight as stored when kept quantized (fp8_model_init: never quantized again) or cached for
    the step's later micro-batches, else quantized now; whatever is quantized now goes through one
    `quantize_many` call, so the backend batches the small ops of all of them (`quantize_row_blocks` with
    `row_blocks`: the inputs are row blocks of one tensor, a grouped linear's experts')."""
    stored = [w._storage if isinstance(w, QuantizedTensor) else (c.cached(is_first_microbatch) if c is not None
                                                                   else None) for w, c in zip(weights, caches)]
    fresh = [i for i, s in enumerate(stored) if s is None]
    quantizers = [q.input for q in qs] + [qs[i].weight for i in fresh]
    tensors = list(xs) + [weights[i] for i in fresh]
    outs = (backend.quantize_row_blocks(quantizers, tensors, len(xs)) if row_blocks
            else backend.quantize_many(quantizers, tensors))
    for i, qw in zip(fresh, outs[len(xs):]):
        stored[i] = qw
        if caches[i] is not None:
            caches[i].keep(qw, is_first_microbatch)
    return outs[: len(xs)], stored


@dataclass
class _LinearArgs:
    quantizers: Optional[LinearQuantizers]
    fp8_wgrad: bool
    weight_cache: Optional[WeightCache]
    is_first_microbatch: Optional[bool]
    fuse_wgrad_accumulation: bool
    reduce_amax_in_backward: bool
    wgrad_store: Optional[WeightGradStore] = None
    save_original_input: bool = False


def saved_input_quantizers(quantizers: Sequence[Quantizer], made: Sequence[QuantizedTensorStorage]
                           ) -> list[Quantizer]:
    """The quantizers backward applies to inputs kept in high precision (`save_original_input`, or rebuilt by
    ops/rebuild.py), made when the forward has quantized them into `made`, so that the wgrad reads exactly the
    codes the forward's GEMM read:
    - delayed scaling: a repeat of the forward's quantize, with the scale_inv stored beside its codes, since the
      per-step update rewrites the state's scale in place and may run before this backward (at the end of the
      autocast region, or for another micro-batch), and the forward recorded the amax;
    - HIF8DelayedScaling's warm-up: current scaling with the slot's target (the same input gives the same
      scale) that records no amax;
    - the other recipes keep no state between calls: their own quantizers.
    (TransformerEngine refuses save_original_input with delayed scaling.)"""
    out = list(quantizers)
    for i, (q, qx) in enumerate(zip(quantizers, made)):
        if isinstance(q, Float8Quantizer):
            out[i] = Float8RepeatQuantizer(qx.scale_inv, q.fp8_dtype, rowwise=False, columnwise=True)
        elif isinstance(q, Float8WarmupQuantizer):
            out[i] = Float8CurrentScalingQuantizer(q.fp8_dtype, q.target_max, rowwise=False, columnwise=True)
    return out


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], args: _LinearArgs):
        backend = get_backend(inp.device)
        x2d = inp if inp.dim() == 2 else inp.reshape(-1, inp.shape[-1])
        needs_wgrad = weight.requires_grad
        q = args.quantizers
        saved_x_quantizer: Optional[Quantizer] = None  # save_original_input: quantizes the input in backward
        if q is None:
            weight_hp = dequantize_if_quantized(weight)
            out = torch.nn.functional.linear(x2d, weight_hp, bias)
            saved_x, saved_w = x2d, weight_hp
        else:
            fp8_wgrad = args.fp8_wgrad and needs_wgrad
            keep_original = args.save_original_input and not producer_drops_output(inp)
            # an activation's output is rebuilt in backward, not kept (ops/rebuild.py)
            rebuilt = (rebuildable_input(inp, x2d) if fp8_wgrad and not keep_original and not offloading()
                       and getattr(q.input, "amax_reduction_group", None) is None else None)
            q.input.set_usage(rowwise=True, columnwise=fp8_wgrad and not keep_original and rebuilt is None)
            q.weight.set_usage(rowwise=True, columnwise=inp.requires_grad)
            (qx,), (qw,) = quantize_inputs_and_weights([x2d], [weight], [q], [args.weight_cache],
                                                       args.is_first_microbatch, backend)
            observe = FP8GlobalStateManager.get_operand_observer()  # e.g. the numerics report; off: one check
            if observe is not None:
                observe(weight, "input", x2d, qx)
                observe(weight, "weight", dequantize_if_quantized(weight), qw)
            if bias is not None:
                bias = (args.weight_cache.gemm_bias(bias, qw, args.is_first_microbatch, backend)
                        if args.weight_cache is not None else backend.gemm_bias(bias, qw))
            out = backend.gemm(qx, qw, out_dtype=inp.dtype, bias=bias)
            # Keep only what backward reads: the columnwise input, or the real input for a bf16 wgrad or with
            # save_original_input (backward then quantizes it for the FP8 wgrad, as the forward did).
            if rebuilt is not None:
                saved_x, saved_x_quantizer = rebuilt, saved_input_quantizers([q.input], [qx])[0]
            elif fp8_wgrad and not keep_original:
                qx.update_usage(rowwise=False, columnwise=True)
                saved_x = qx
            else:
                saved_x = x2d if needs_wgrad else None
                if fp8_wgrad:
                    saved_x_quantizer = saved_input_quantizers([q.input], [qx])[0]
            # The weight's backward GEMM (dgrad) reads only its columnwise form; keep the cached object whole.
            saved_w = qw.columnwise_only()
        ctx.args = args
        ctx.saved_x_quantizer = saved_x_quantizer
        if args.reduce_amax_in_backward:
            FP8GlobalStateManager.expect_backward_reduction(ctx)
        ctx.saved = (stash(saved_x), saved_w)  # the activation may go to host memory (cpu_offload)
        ctx.weight = weight
        ctx.input_shape = inp.shape
        ctx.input_dtype = inp.dtype
        ctx.has_bias = bias is not None
        return out if inp.dim() == 2 else out.reshape(*inp.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        args: _LinearArgs = ctx.args
        saved_x, saved_w = ctx.saved
        saved_x = unstash(saved_x)
        weight = ctx.weight
        backend = get_backend(grad_out.device)
        dy = grad_out if grad_out.dim() == 2 else grad_out.reshape(-1, grad_out.shape[-1])
        need_dx, need_dw, need_db = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        q = args.quantizers
        dx = dw = db = None
        if q is None:
            if need_dx:
                dx = dy @ saved_w.to(dy.dtype)
            if need_dw:
                dw = _wgrad_now_or_later(args, weight, dy, saved_x, backend)
        else:
            if isinstance(saved_x, RebuiltInput):
                saved_x = saved_x() if need_dw else None
            if need_dw and ctx.saved_x_quantizer is not None:
                ctx.saved_x_quantizer.set_usage(rowwise=False, columnwise=True)
                saved_x = backend.quantize(ctx.saved_x_quantizer, saved_x)
            fp8_wgrad = need_dw and isinstance(saved_x, QuantizedTensorStorage)
            q.grad_output.set_usage(rowwise=need_dx, columnwise=fp8_wgrad)
            qdy = backend.quantize(q.grad_output, dy) if (need_dx or fp8_wgrad) else None
            observe = FP8GlobalStateManager.get_operand_observer()
            if qdy is not None and observe is not None:
                observe(weight, "grad_output", dy, qdy)
            with backend.read_twice(qdy) if need_dx and fp8_wgrad else nullcontext():
                if need_dx:
                    dx = backend.gemm(qdy, saved_w, b_columnwise=True, out_dtype=ctx.input_dtype)
                if need_dw:
                    dw = _wgrad_now_or_later(args, weight, qdy if fp8_wgrad else dy, saved_x, backend)
            if args.reduce_amax_in_backward:
                # This is the first FP8 module of the step, so its backward is the last one to run.
                FP8GlobalStateManager.reduce_backward_amaxes(ctx)
        if need_db and ctx.has_bias:
            db = dy.sum(dim=0).to(weight.dtype)
        ctx.saved = ctx.saved_x_quantizer = None
        if dx is not None and dx.shape != ctx.input_shape:
            dx = dx.reshape(ctx.input_shape)
        return dx, dw, db, None


def _wgrad(weight: torch.Tensor, dy: Operand, x: Operand, fuse_wgrad_accumulation: bool,
           backend) -> Optional[torch.Tensor]:
    """dW = dYᵀ·X: an FP8 GEMM on quantized operands, else in high precision; with fused accumulation added
    into `weight.main_grad` (returning None)."""
    if not isinstance(x, QuantizedTensorStorage):
        return wgrad_high_precision(dy, x, weight, fuse_wgrad_accumulation)
    main_grad = _main_grad(weight) if fuse_wgrad_accumulation else None
    dw = backend.gemm(dy, x, a_columnwise=True, b_columnwise=True, out_dtype=weight.dtype, out=main_grad)
    return _finish_fused_wgrad(weight) if main_grad is not None else dw


def _wgrad_now_or_later(args: _LinearArgs, weight: torch.Tensor, dy: Operand, x: Operand,
                        backend) -> Optional[torch.Tensor]:
    """The weight gradient for autograd, or None after putting its GEMM in the module's WeightGradStore
    (delay_wgrad_compute: `backward_dw()` runs it later, with the same operands, so the same result)."""
    store = args.wgrad_store
    if store is None or not store.delay_wgrad_compute():
        return _wgrad(weight, dy, x, args.fuse_wgrad_accumulation, backend)

    def compute(dy: Operand, x: Operand) -> WgradResult:
        return [(weight, _wgrad(weight, dy, x, args.fuse_wgrad_accumulation, backend))]

    store.put((dy, x), compute)
    return None


def _main_grad(weight: torch.Tensor) -> torch.Tensor:
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        raise RuntimeError("fuse_wgrad_accumulation=True needs `weight.main_grad` (a float32, bfloat16 or float16 "
                           "buffer), as Megatron allocates with --gradient-accumulation-fusion")
    return main_grad


# Placeholder weight gradients by (shape, dtype, device), least recently used first: see _finish_fused_wgrad.
_DUMMY_WGRADS: OrderedDict[tuple, torch.Tensor] = OrderedDict()
# How many placeholders are kept: a transformer layer's linears have a handful of weight shapes (QKV, projection,
# FC1, FC2; MLA's down/up projections a few more), the same in every layer, so 8 serve a whole model's backward
# without an allocation, while a process that meets many shapes (tests, models built one after another) holds at
# most 8 weight-sized buffers instead of one per shape it ever saw.
DUMMY_WGRADS_KEPT = 8


def _finish_fused_wgrad(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """After accumulating into main_grad, what TransformerEngine returns: a weight carrying Megatron's
    `grad_added_to_main_grad` gets it set, and autograd a placeholder gradient of its shape, zeros when the weight
    asks for `zero_out_wgrad` (Megatron's --overlap-grad-reduce hook requires a grad, and adds it to main_grad only
    without the flag or with zero_out_wgrad); any other weight gets no grad.

    The placeholder is shared by the weights of one shape and kept for the DUMMY_WGRADS_KEPT shapes used last,
    not tied to each module: one per module would hold a weight-sized buffer per layer, one per shape holds a
    few (an evicted shape just gets a new one, as on its first use)."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    key = (tuple(weight.shape), weight.dtype, weight.device)
    dummy = _DUMMY_WGRADS.get(key)
    if dummy is None:
        dummy = _DUMMY_WGRADS[key] = torch.empty(key[0], dtype=weight.dtype, device=weight.device)
        while len(_DUMMY_WGRADS) > DUMMY_WGRADS_KEPT:
            _DUMMY_WGRADS.popitem(last=False)
    else:
        _DUMMY_WGRADS.move_to_end(key)
    return dummy.zero_() if getattr(weight, "zero_out_wgrad", False) else dummy


def wgrad_high_precision(dy: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor,
                         fuse_wgrad_accumulation: bool) -> Optional[torch.Tensor]:
    """dYᵀ·X in the activations' precision, or its float32 product added once into `weight.main_grad` (rounded
    once to main_grad's dtype when that is not float32, as TransformerEngine's GEMM accumulates) by the backend's
    GEMM, which on an NPU adds it in the kernel where torch_npu has one."""
    if fuse_wgrad_accumulation:
        get_backend(dy.device).gemm(dy, x2d, a_columnwise=True, b_columnwise=True, out=_main_grad(weight))
        return _finish_fused_wgrad(weight)
    return (dy.t() @ x2d.to(dy.dtype)).to(weight.dtype)


def fp8_linear(
    inp: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    quantizers: Optional[LinearQuantizers] = None,
    fp8_wgrad: bool = True,
    weight_cache: Optional[WeightCache] = None,
    is_first_microbatch: Optional[bool] = None,
    fuse_wgrad_accumulation: bool = False,
    reduce_amax_in_backward: bool = False,
    wgrad_store: Optional[WeightGradStore] = None,
    save_original_input: bool = False,
) -> torch.Tensor:
    """y = inp · weightᵀ + bias with quantized GEMMs (high precision when `quantizers` is None).

    fp8_wgrad: False keeps the weight-gradient GEMM in high precision (Megatron's --no-fp8-wgrad).
    weight_cache / is_first_microbatch: quantize the weight once per step and reuse it across micro-batches.
    fuse_wgrad_accumulation: add the weight gradient into `weight.main_grad` (float32) instead of returning it.
    reduce_amax_in_backward: set for the step's first FP8 module; its backward reduces the backward amaxes.
    wgrad_store: the module's WeightGradStore; when it delays wgrad compute, backward leaves the weight's
        gradient to `backward_dw()`.
    save_original_input: keep the input itself for backward, which quantizes it for the FP8 wgrad
        (TransformerEngine's option: no quantized copy is held when the input is saved elsewhere anyway); with
        delayed scaling too, unlike TE: backward divides by the forward's scale (`saved_input_quantizers`).
    """
    if inp.shape[-1] != weight.shape[-1]:
        raise ValueError(f"fp8_linear: input's last dim {inp.shape[-1]} != weight in_features {weight.shape[-1]}")
    args = _LinearArgs(quantizers, fp8_wgrad, weight_cache, is_first_microbatch, fuse_wgrad_accumulation,
                       reduce_amax_in_backward, wgrad_store, save_original_input)
    return _Linear.apply(inp, weight, bias, args)
