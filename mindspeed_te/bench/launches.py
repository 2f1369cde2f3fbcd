"""Bench group "npu": device launches of the NPU path, counted on the torch_npu simulator, per module and per
step; the tests pin the same counts through these helpers."""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch

from mindspeed_te import fused_cast
from mindspeed_te.diagnostics import LaunchCounter
from mindspeed_te.kernels import BACKEND_ENV, SIMULATOR_ENV, get_backend, reset_backend
from mindspeed_te.modules.attention import DotProductAttention
from mindspeed_te.modules.grouped_linear import GroupedLinear
from mindspeed_te.modules.layernorm_linear import LayerNormLinear
from mindspeed_te.modules.linear import Linear
from mindspeed_te.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    HIF8DelayedScaling,
    MXFP4BlockScaling,
    MXFP8BlockScaling,
    Recipe,
)
from mindspeed_te.state import FP8GlobalStateManager, fp8_autocast


@contextmanager
def backend_environment(backend: str, simulator: Optional[str] = None, fused: bool = True) -> Iterator[Any]:
    """MINDSPEED_TE_BACKEND = `backend` (and MINDSPEED_TE_NPU_SIMULATOR = `simulator` when given) for the block,
    with the backend chosen afresh on the way in and out (it is read from the environment once); `fused=False`
    turns the CPU-only fused cast off, so the library takes the torch ops it would run on an NPU. Yields the
    backend."""
    saved = {name: os.environ.get(name) for name in (BACKEND_ENV, SIMULATOR_ENV)}
    os.environ[BACKEND_ENV] = backend
    if simulator is not None:
        os.environ[SIMULATOR_ENV] = simulator
    reset_backend()
    enabled, fused_cast.enabled = fused_cast.enabled, fused_cast.enabled and fused
    try:
        yield get_backend()
    finally:
        fused_cast.enabled = enabled
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        reset_backend()


@contextmanager
def npu_simulated(chip: str = "1", release: Optional[str] = None) -> Iterator[Any]:
    """The NPU backend on the torch_npu simulator for CPU tensors; yields the simulated torch_npu module.
    `chip`: "1" (the simulator's default, an Ascend 950PR) or a chip name such as "Ascend950DT"; `release`: the
    torch_npu release whose kernels it has (npu_sim.RELEASES; 2.14 when None). The CPU-only fused cast extension
    is off, so the library takes the torch ops it would run on an NPU."""
    name = "Ascend950PR" if chip == "1" and release else chip
    with backend_environment("npu", f"{name}@{release}" if release else chip, fused=False) as chosen:
        yield chosen.npu


def launch_recipes() -> dict[str, Recipe]:
    """Every recipe x format the launch counts cover (TE defaults otherwise; MXFP8 has no HiF8 form)."""
    recipes: dict[str, Recipe] = {}
    for fmt in (Format.E4M3, Format.HYBRID, Format.HIF8):
        recipes[f"delayed {fmt.name}"] = DelayedScaling(fp8_format=fmt)
        recipes[f"tensorwise {fmt.name}"] = Float8CurrentScaling(fp8_format=fmt)
        recipes[f"blockwise {fmt.name}"] = Float8BlockScaling(fp8_format=fmt)
        if fmt is not Format.HIF8:
            recipes[f"mxfp8 {fmt.name}"] = MXFP8BlockScaling(fp8_format=fmt)
    return recipes


def _second_layer_launches(recipe: Recipe, layer: torch.nn.Module, tokens: int, npu: Any, *args: Any
                           ) -> tuple[LaunchCounter, LaunchCounter]:
    """Launches of `layer(h, *args)` forward and backward in a training step, h of `tokens` rows from a
    Linear(256, 256) before it. The measured layer is the second of two, so its backward does not carry
    what runs once per step for all layers at the step's end, after the first layer's backward: the
    backward amax update (counted by `update_launches`) and the fold of the non-finite flag updates its
    quantizes noted (counted by `fold_launches`). Both run, uncounted, as in a training step. The second step
    is measured, so delayed scaling runs with real scales."""
    dtype = next(layer.parameters()).dtype
    first = Linear(256, 256, bias=True, params_dtype=dtype)
    x = torch.randn(tokens, 256, dtype=dtype)
    for _ in range(2):
        forward, backward = LaunchCounter(npu), LaunchCounter(npu)
        with fp8_autocast(fp8_recipe=recipe):
            h0 = first(x)
            h = h0.detach().requires_grad_()  # this layer's backward stops at h
            with forward:
                y = layer(h, *args)
        dy = torch.ones_like(y)
        layer.zero_grad(set_to_none=True)  # gradient accumulation into .grad is not the layer's work
        with backward:
            y.backward(dy)
        h0.backward(h.grad)  # the rest of the step
    return forward, backward


def linear_launches(recipe: Recipe, dtype: torch.dtype, npu: Any) -> tuple[LaunchCounter, LaunchCounter]:
    """Launches of one `Linear(256, 256, bias=True)` forward (weight quantization included) and backward in a
    training step, on 128 tokens (`_second_layer_launches`)."""
    return _second_layer_launches(recipe, Linear(256, 256, bias=True, params_dtype=dtype), 128, npu)


def microbatch_launches(recipe: Recipe, dtype: torch.dtype, npu: Any) -> LaunchCounter:
    """Launches of a later micro-batch's forward of `Linear(256, 256, bias=True)` on 128 tokens (TE's
    is_first_microbatch=False, as Megatron passes it: the weight's quantized form and the GEMM's bias are the
    step's first micro-batch's), in the second step. Each micro-batch's forward is an autocast region of its
    own, as in Megatron (its transformer block enters one)."""
    layer = Linear(256, 256, bias=True, params_dtype=dtype)
    x = torch.randn(128, 256, dtype=dtype, requires_grad=True)
    for _ in range(2):
        with fp8_autocast(fp8_recipe=recipe):
            layer(x, is_first_microbatch=True)
        with fp8_autocast(fp8_recipe=recipe), LaunchCounter(npu) as counter:
            layer(x, is_first_microbatch=False)
    return counter


def megatron_parameter_buffer(module: torch.nn.Module) -> None:
    """Lay the module's parameters out as Megatron's DDP does with the distributed optimizer: views of one
    contiguous buffer, in reverse order of registration (so a GroupedLinear's weights, without biases, are
    row blocks from the last expert's to the first's)."""
    params = list(module.parameters())
    buffer = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    offset = 0
    for p in reversed(params):
        view = buffer[offset : offset + p.numel()].view(p.shape)
        view.copy_(p.data)
        p.data = view
        offset += p.numel()


def weights_apart(module: torch.nn.Module) -> None:
    """Give each parameter storage of its own (as `.to()` into another dtype or device leaves them)."""
    for p in module.parameters():
        p.data = p.data.clone()


# How a GroupedLinear's weights lie: as the module lays them out (row blocks of one buffer, expert 0 first), in


# Megatron's parameter buffer (reverse order), or each on its own.


GROUPED_LAYOUTS: dict[str, Optional[Callable[[torch.nn.Module], None]]] = {
    "module": None, "megatron": megatron_parameter_buffer, "apart": weights_apart}


def grouped_launches(recipe: Recipe, dtype: torch.dtype, npu: Any, experts: int = 8, layout: str = "module"
                     ) -> tuple[LaunchCounter, LaunchCounter]:
    """Launches of one `GroupedLinear(experts, 256, 256)` forward (weight quantization included) and backward,
    32 tokens per expert, measured as `linear_launches` measures a Linear, its weights laid out as `layout`
    (`GROUPED_LAYOUTS`) says."""
    layer = GroupedLinear(experts, 256, 256, bias=False, params_dtype=dtype)
    arrange = GROUPED_LAYOUTS[layout]
    if arrange is not None:
        arrange(layer)
    return _second_layer_launches(recipe, layer, 32 * experts, npu, [32] * experts)


def norm_linear_launches(recipe: Recipe, npu: Any, normalization: str = "RMSNorm"
                         ) -> tuple[LaunchCounter, LaunchCounter]:
    """Launches of one `LayerNormLinear(256, 256, bias=True)` in bfloat16 with `normalization`, measured as
    `linear_launches` measures a Linear: the norm's kernel and its backward kernel on top."""
    layer = LayerNormLinear(256, 256, bias=True, params_dtype=torch.bfloat16, normalization=normalization)
    return _second_layer_launches(recipe, layer, 128, npu)


def attention_launches(npu: Any) -> tuple[LaunchCounter, LaunchCounter]:
    """Launches of a causal `DotProductAttention` (8 heads of 64, 2 x 256 tokens, bfloat16) forward and backward,
    in a second call (what is made once, such as a kernel's fixed mask, is made in the first)."""
    attn = DotProductAttention(8, 64, attn_mask_type="causal")
    g = torch.Generator().manual_seed(0)
    qkv = [torch.randn(256, 2, 8, 64, generator=g, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    for _ in range(2):
        forward, backward = LaunchCounter(npu), LaunchCounter(npu)
        with forward:
            out = attn(*qkv)
        dy = torch.ones_like(out)
        with backward:
            torch.autograd.grad(out, qkv, dy)  # into fresh tensors: accumulation into .grad is not attention's work
    return forward, backward


def update_launches(recipe: DelayedScaling, layers: int, npu: Any, steps: int = 2
                    ) -> tuple[LaunchCounter, LaunchCounter]:
    """Launches of the per-step delayed-scaling update (forward, backward) of `layers` Linear(256, 256), in
    step `steps` (the first makes the update's constants once; HIF8DelayedScaling updates its scales only at
    some steps, so the step says which kind is measured)."""
    model = torch.nn.Sequential(*(Linear(256, 256, bias=True) for _ in range(layers)))
    FP8GlobalStateManager.reset()
    for _ in range(steps):
        autocast = fp8_autocast(fp8_recipe=recipe)
        autocast.__enter__()
        out = model(torch.randn(32, 256))  # kept: its backward would run the backward update
        forward, backward = LaunchCounter(npu), LaunchCounter(npu)
        with forward:
            autocast.__exit__(None, None, None)
        with backward:
            FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=False)
        del out
    return forward, backward


def fold_launches(recipe: Recipe, layers: int, npu: Any) -> LaunchCounter:
    """Launches of the per-step fold of the non-finite flag updates the quantizes of a bf16 training step
    (forward and backward) of `layers` Linear(128, 128) noted (the count does not depend on the sizes: small
    layers keep the simulator quick), measured where the second step ends (the first makes the fold's index
    tensors once): the next outermost entry (the region's first module is a separate layer whose graph is
    dropped, so no backward ends the step before). The check is off, so that end is the fold alone (the
    check copies the folded flags to the host with a few ops of its own, without waiting)."""
    FP8GlobalStateManager.reset()
    FP8GlobalStateManager.quantization_state.nonfinite_check = False
    first = Linear(128, 128, bias=True, params_dtype=torch.bfloat16)
    model = torch.nn.Sequential(*(Linear(128, 128, bias=True, params_dtype=torch.bfloat16) for _ in range(layers)))
    for _ in range(2):
        with fp8_autocast(fp8_recipe=recipe):
            h = first(torch.randn(128, 128, dtype=torch.bfloat16)).detach().requires_grad_()
            out = model(h)
        out.backward(torch.ones_like(out))
        autocast = fp8_autocast(fp8_recipe=recipe)
        with LaunchCounter(npu) as counter:
            autocast.__enter__()
        autocast.__exit__(None, None, None)
    FP8GlobalStateManager.reset()
    return counter


# HIF8DelayedScaling with one warm-up step and scales updated every 2 steps (the counts do not depend on the


# intervals, the run time does): step 3 updates the scales, step 2 only accumulates.
HIF8_UPDATE_RECIPE = dict(amax_collect_interval=1, scale_update_interval=2)

HIF8_UPDATE_STEPS = {"scale update": 3, "accumulating": 2}


def bench_npu_launches() -> list[tuple[str, float, str]]:
    """Device launches (non-view aten ops + torch_npu kernels) of the NPU path on the simulator."""
    rows = []
    for chip in ("Ascend950PR", "Ascend950DT"):  # MXFP8 on both (the dual-axis quantize's chip gate)
        with npu_simulated(chip) as npu:
            for name, recipe in launch_recipes().items():
                kind = name.split()[0]
                if chip != "Ascend950PR" and kind != "mxfp8":
                    continue  # the same kernels on both chips
                for dtype in (torch.bfloat16, torch.float32):
                    forward, backward = linear_launches(recipe, dtype, npu)
                    detail = f"{name} {str(dtype).replace('torch.', '')} {chip} ({forward.npu_kernels} / " \
                             f"{backward.npu_kernels} torch_npu)"
                    short = "bf16" if dtype == torch.bfloat16 else "fp32"
                    rows.append((f"NPU launches, linear forward, {kind} {short}", float(forward.total), detail))
                    rows.append((f"NPU launches, linear backward, {kind} {short}", float(backward.total), detail))
                later = microbatch_launches(recipe, torch.bfloat16, npu)
                rows.append((f"NPU launches, later micro-batch forward, {kind}", float(later.total),
                             f"{name} bfloat16 {chip}, weight and bias kept from the first"))
    grouped = [("Ascend950PR", "blockwise E4M3", torch.bfloat16, "module"),
               ("Ascend950PR", "blockwise E4M3", torch.bfloat16, "megatron"),
               ("Ascend950PR", "blockwise E4M3", torch.bfloat16, "apart"),
               ("Ascend950PR", "blockwise HIF8", torch.bfloat16, "module"),
               ("Ascend950DT", "mxfp8 E4M3", torch.bfloat16, "module"),
               ("Ascend950PR", "mxfp8 E4M3", torch.bfloat16, "module"),
               ("1", "delayed E4M3", torch.bfloat16, "module"), ("1", "delayed E4M3", torch.bfloat16, "apart"),
               ("1", "delayed E4M3", torch.float32, "module")]
    where = {"module": "", "megatron": ", weights in Megatron's parameter buffer", "apart": ", weights apart"}
    for chip, name, dtype, layout in grouped:
        with npu_simulated(chip) as npu:
            forward, backward = grouped_launches(launch_recipes()[name], dtype, npu, layout=layout)
        detail = f"{name} {str(dtype).replace('torch.', '')}" + ("" if chip == "1" else f" {chip}") + ", 8 experts"
        detail += where[layout]
        rows.append(("NPU launches, GroupedLinear forward", float(forward.total), detail))
        rows.append(("NPU launches, GroupedLinear backward", float(backward.total), detail))
    for chip, name, normalization in (("Ascend950PR", "delayed HIF8", "RMSNorm"),
                                      ("Ascend950PR", "delayed HIF8", "LayerNorm"),
                                      ("Ascend950PR", "tensorwise E4M3", "RMSNorm"),
                                      ("Ascend950PR", "blockwise E4M3", "RMSNorm"),
                                      ("Ascend950DT", "mxfp8 E4M3", "RMSNorm"),
                                      ("Ascend950DT", "mxfp8 E4M3", "LayerNorm")):
        with npu_simulated(chip) as npu:
            forward, backward = norm_linear_launches(launch_recipes()[name], npu, normalization)
        detail = f"{name} bfloat16 {chip}, {normalization}"
        rows.append(("NPU launches, LayerNormLinear forward", float(forward.total), detail))
        rows.append(("NPU launches, LayerNormLinear backward", float(backward.total), detail))
    with npu_simulated() as npu:
        forward, backward = attention_launches(npu)
    rows.append(("NPU launches, attention forward", float(forward.total), "causal, 8 heads of 64, 2 x 256 tokens"))
    rows.append(("NPU launches, attention backward", float(backward.total), "causal, 8 heads of 64, 2 x 256 tokens"))
    with npu_simulated() as npu:
        for layers in (2, 32):
            forward, backward = update_launches(DelayedScaling(), layers, npu)
            rows.append(("NPU launches, delayed update per step", float(forward.total), f"{layers} layers, forward"))
            rows.append(("NPU launches, delayed update per step", float(backward.total), f"{layers} layers, backward"))
            for kind, step in HIF8_UPDATE_STEPS.items():
                forward, backward = update_launches(HIF8DelayedScaling(**HIF8_UPDATE_RECIPE), layers, npu, steps=step)
                for direction, counter in (("forward", forward), ("backward", backward)):
                    rows.append(("NPU launches, HiF8 delayed update per step", float(counter.total),
                                 f"{layers} layers, {direction}, step {step} ({kind})"))
            for name, recipe in launch_recipes().items():
                if name.startswith("delayed"):
                    continue  # no flag updates to fold: delayed scaling's amaxes reach the flags at the update
                rows.append(("NPU launches, non-finite fold per step", float(fold_launches(recipe, layers, npu).total),
                             f"{name}, {layers} layers"))
    FP8GlobalStateManager.reset()
    return rows


def bench_fp4_launches() -> list[tuple[str, float, str]]:
    """An MXFP4 Linear's launches against an MXFP8 one's, same shapes, per chip and dtype (the difference; the
    fp8_activations mode's counts beside)."""
    rows = []
    for chip in ("Ascend950PR", "Ascend950DT"):
        with npu_simulated(chip) as npu:
            for dtype in (torch.bfloat16, torch.float32):
                fp4, fp8 = (linear_launches(r, dtype, npu) for r in (MXFP4BlockScaling(), MXFP8BlockScaling()))
                pseudo = linear_launches(MXFP4BlockScaling(fp8_activations=True), dtype, npu)
                short = "bf16" if dtype == torch.bfloat16 else "fp32"
                for i, direction in enumerate(("forward", "backward")):
                    rows.append((f"NPU launches, linear {direction}, MXFP4 - MXFP8 {short}",
                                 float(fp4[i].total - fp8[i].total),
                                 f"{chip}: MXFP4 {fp4[i].total}, MXFP8 {fp8[i].total}, MXFP4 with FP8 activations "
                                 f"{pseudo[i].total}"))
    return rows
