"""Bench group "memory": bytes per parameter that training keeps, measured from the tensors that exist.

The linear layers of GPT transformer layers (mindspeed_te's LayerNormLinear / Linear, their norms included;
FP8 weights from fp8_model_init with current scaling) take one FusedAdam step; then the row counts, per
parameter and unsharded: the weights' storage (codes and scales for FP8 weights), the gradient (Megatron's
main_grad buffer, in --main-grads-dtype) and every tensor the optimizer holds (moments, master weights or
their remainders, scales). The baseline is Megatron's default bf16 training: bf16 weights, fp32 main grads,
fp32 master weights and fp32 moments, about 18 bytes. Issue 33's goal: at most 9 bytes with FP8 weights and
8-bit moments (1 + 2 + 4 + 1 + 1 for an FP8 weight; the bf16 norms and biases cost 10 with an fp32 master, 8
with a remainder, hence the two fp8-moment rows).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional, Union
from unittest import mock

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mindspeed_te.bench.gpt import megatron_world
from mindspeed_te.bench.layer import build_block
from mindspeed_te.bench.params import gpt_layers
from mindspeed_te.optimizers import FusedAdam
from mindspeed_te.quantized_tensor import QuantizedTensor

__all__ = ["bench_memory", "bench_activations", "bytes_per_parameter", "activation_bytes", "COMBINATIONS"]


@dataclass(frozen=True)
class Combination:
    label: str
    fp8_weights: bool
    grad_dtype: torch.dtype
    master: str  # "fp32", "fp16" or "remainder" (store_param_remainders: a bf16 weight's master is the weight and
    # an int16 remainder; an FP8 weight's stays fp32)
    moments: str  # FusedAdam's exp_avg_dtype / exp_avg_sq_dtype


COMBINATIONS = (
    Combination("bf16 weights + fp32 grads, master, moments", False, torch.float32, "fp32", "fp32"),
    Combination("bf16 weights + bf16 grads, fp32 master, bf16 moments", False, torch.bfloat16, "fp32", "bf16"),
    Combination("bf16 weights + bf16 grads, master remainders, bf16 moments", False, torch.bfloat16, "remainder",
                "bf16"),
    Combination("bf16 weights + bf16 grads, master remainders, fp8 moments", False, torch.bfloat16, "remainder",
                "fp8"),
    Combination("fp8 weights + bf16 grads, fp32 master, bf16 moments", True, torch.bfloat16, "fp32", "bf16"),
    Combination("fp8 weights + bf16 grads, fp32 master, fp8 moments", True, torch.bfloat16, "fp32", "fp8"),
    # store_param_remainders (Megatron's default): the bf16 norms and biases keep remainders, FP8 weights fp32
    Combination("fp8 weights + bf16 grads, fp32 master + remainders, fp8 moments", True, torch.bfloat16,
                "remainder", "fp8"),
    Combination("fp8 weights + bf16 grads, fp32 master + remainders, hif8 moments", True, torch.bfloat16,
                "remainder", "hif8"),
    Combination("fp8 weights + bf16 grads, fp32 master + remainders, mxfp8 moments", True, torch.bfloat16,
                "remainder", "mxfp8"),
    Combination("fp8 weights + bf16 grads, fp16 master, fp8 moments", True, torch.bfloat16, "fp16", "fp8"),
)


def _nbytes(t: Optional[torch.Tensor]) -> int:
    if t is None:
        return 0
    if isinstance(t, QuantizedTensor):
        return t._storage.nbytes()
    return t.numel() * t.element_size()


def bytes_per_parameter(combo: Combination, hidden: int = 256, layers: int = 2) -> dict[str, float]:
    """{"weights", "grads", "optimizer", "total"}: bytes per parameter after one step of `combo`."""
    torch.manual_seed(0)
    params = list(gpt_layers(hidden, layers, combo.fp8_weights).parameters())
    numel = sum(p.numel() for p in params)
    optimizer = FusedAdam(params, lr=1e-4, weight_decay=0.01, master_weights=True, use_decoupled_grad=True,
                          master_weight_dtype=torch.float16 if combo.master == "fp16" else torch.float32,
                          store_param_remainders=combo.master == "remainder",
                          exp_avg_dtype=combo.moments, exp_avg_sq_dtype=combo.moments)
    for p in params:
        p.decoupled_grad = torch.randn(p.shape).to(combo.grad_dtype) * 1e-3
    optimizer.step()
    state_bytes = 0
    for p in params:
        state_bytes += sum(_nbytes(t) for t in optimizer.state[p].values() if t is not p)
        state_bytes += sum(_nbytes(t) for t in optimizer._scales.get(p, {}).values())
    result = {"weights": sum(_nbytes(p) for p in params) / numel,
              "grads": sum(_nbytes(p.decoupled_grad) for p in params) / numel,
              "optimizer": state_bytes / numel}
    result["total"] = sum(result.values())
    return result


def bench_memory(hidden: int = 256, layers: int = 2) -> list[tuple[str, float, str]]:
    rows = []
    for combo in COMBINATIONS:
        b = bytes_per_parameter(combo, hidden, layers)
        rows.append((f"bytes per parameter, {combo.label}", b["total"],
                     f"{b['total']:.3f} = weights {b['weights']:.3f} + grads {b['grads']:.3f} + optimizer "
                     f"{b['optimizer']:.3f} bytes "
                     f"({layers} GPT layers hidden {hidden})"))
    return rows


class LiveStorages(TorchDispatchMode):
    """Every storage a torch op makes while this mode is on, held weakly: those still alive later are what
    someone keeps (for a layer's forward: what autograd saved for its backward)."""

    def __init__(self) -> None:
        super().__init__()
        self._made: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in inputs:  # views make nothing
                storage = t.untyped_storage()
                key = storage._cdata
                known = self._made.get(key)
                if known is None or known[0].expired():
                    self._made[key] = (StorageWeakRef(storage), storage.nbytes())
        return out

    def live_bytes(self, leave_out: tuple[torch.Tensor, ...] = ()) -> int:
        left = {t.untyped_storage()._cdata for t in leave_out}
        return sum(n for key, (ref, n) in self._made.items() if not ref.expired() and key not in left)


def activation_bytes(fp8: Optional[tuple[str, str]], offload: bool, seq: int = 1024, batch: int = 1,
                     hidden: int = 512, fp8_attention: Union[bool, str] = False) -> int:
    """Bytes that the first layer of a two-layer Megatron GPT block (TE spec, bf16) keeps for its backward
    during a later micro-batch (weights already quantized): every storage its forward made that is alive once
    the block's forward is done, less its output (the next layer's input) and, with --cpu-offloading of one
    layer, less what went to host memory. `fp8_attention`: config.fp8_dot_product_attention (the recipe's
    fp8_dpa); a string also sets NVTE_DPA_FP8_RECIPE to it (the recipe attention runs under) while the block is
    made, and restores it after. Needs `megatron_world`."""
    offload_args = dict(cpu_offloading=True, cpu_offloading_num_layers=1) if offload else {}
    env = {"NVTE_DPA_FP8_RECIPE": fp8_attention} if isinstance(fp8_attention, str) else {}
    with mock.patch.dict(os.environ, env):  # attention reads it when made
        block = build_block(2, fp8, moe=False, hidden=hidden, fp8_dot_product_attention=bool(fp8_attention),
                            **offload_args)
    x = torch.randn(seq, batch, hidden, dtype=torch.bfloat16, requires_grad=True)
    block.set_is_first_microbatch()
    block(x, attention_mask=None).float().sum().backward()  # quantized weights, FP8 metadata
    tracker = LiveStorages()
    layer = block.layers[0]
    outputs: list[torch.Tensor] = []

    def start(*_: Any) -> None:
        tracker.__enter__()

    def stop(_module: Any, _inputs: Any, out: Any) -> None:
        tracker.__exit__(None, None, None)
        outputs.append(out[0])

    hooks = (layer.register_forward_pre_hook(start), layer.register_forward_hook(stop))
    try:
        out = block(x, attention_mask=None)
    finally:
        for hook in hooks:
            hook.remove()
    schedule = block.config._cpu_offloading_context
    held = tracker.live_bytes(leave_out=tuple(outputs)) - (schedule.host_bytes if schedule is not None else 0)
    out.float().sum().backward()
    return held


# (label, --fp8-format and --fp8-recipe, one layer offloaded, config.fp8_dot_product_attention: True, or the
# NVTE_DPA_FP8_RECIPE attention runs under)
ACTIVATION_CASES = (("bf16", None, False, False),
                    ("hif8 delayed, bf16 attention", ("hif8", "delayed"), False, False),
                    ("mxfp8, bf16 attention", ("e4m3", "mxfp8"), False, False),
                    ("hif8 delayed + cpu offload", ("hif8", "delayed"), True, False),
                    ("mxfp8 + cpu offload", ("e4m3", "mxfp8"), True, False),
                    ("hif8 delayed + fp8 attention", ("hif8", "delayed"), False, True),
                    ("hybrid delayed + fp8 attention", ("hybrid", "delayed"), False, True),
                    ("e4m3 tensorwise + fp8 attention", ("e4m3", "tensorwise"), False, True),
                    ("mxfp8 + fp8 attention (current scaling)", ("e4m3", "mxfp8"), False, "Float8CurrentScaling"),
                    ("mxfp8 + fp8 attention (delayed scaling)", ("e4m3", "mxfp8"), False, "DelayedScaling"))


def bench_activations() -> list[tuple[str, float, str]]:
    """Per case: activation bytes a GPT layer keeps per micro-batch, as a ratio to bf16's."""
    with megatron_world():
        held = {label: activation_bytes(fp8, offload, fp8_attention=attention)
                for label, fp8, offload, attention in ACTIVATION_CASES}
    base = held.pop("bf16")
    return [(f"activation bytes per GPT layer, {label} / bf16", n / base,
             f"{n / 2**20:.2f} MiB vs {base / 2**20:.2f} MiB (hidden 512, seq 1024, micro-batch 1)")
            for label, n in held.items()]
