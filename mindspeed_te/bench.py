"""Benchmarks, reported as ratios against a baseline measured in the same run.

    python -m mindspeed_te.bench [--size-mib 64] [--repeats 5] [--only quantize]

Quantize throughput: the time of `Tensor.copy_` on the same tensor divided by the time of the quantize,
so 1.0x means "as fast as a memory copy" and higher is better. The copy writes into memory it has written
before; a quantize allocates its outputs, and glibc's default allocator hands freed heap tops above its trim
threshold back to the OS, so that each call can fault its outputs' pages in again (both layouts of a 64 MiB
tensor: two 16 MiB outputs). The "glibc defaults" rows show that cost; the target rows are measured after the
bench raises glibc's trim and mmap thresholds (mallopt), as a caching allocator (the NPU's) keeps memory mapped.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch

from mindspeed_te import fused_cast
from mindspeed_te.diagnostics import HostSyncCounter, LaunchCounter
from mindspeed_te.formats import hif8_encode
from mindspeed_te.kernels import BACKEND_ENV, SIMULATOR_ENV, get_backend, reset_backend
from mindspeed_te.modules.attention import DotProductAttention
from mindspeed_te.modules.grouped_linear import GroupedLinear
from mindspeed_te.modules.layernorm_linear import LayerNormLinear
from mindspeed_te.modules.linear import Linear
from mindspeed_te.ops.linear import LinearQuantizers, fp8_linear
from mindspeed_te.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    HIF8DelayedScaling,
    MXFP8BlockScaling,
    Recipe,
)
from mindspeed_te.recipe_state import RecipeState
from mindspeed_te.state import FP8GlobalStateManager, fp8_autocast

# name -> (target, True when the ratio must be at least the target / False when at most)
TARGETS = {
    "quantize current E4M3": (0.5, True),  # ratio to copy_
    "quantize blockwise 1x128 E4M3, both layouts": (0.5, True),
    "quantize blockwise 128x128 E4M3": (0.5, True),
    "quantize mxfp8 E4M3, both layouts": (0.5, True),
    "hif8_encode vs en_dtypes": (10.0, True),  # speed-up
    "fp8 linear fwd+bwd 2048^3 / fp32 nn.Linear": (1.25, False),
    "host overhead 64x64 fwd+bwd / nn.Linear": (3.0, False),
    "bytes saved for backward / bf16 linear": (0.55, False),
    "param all-gather bytes, fp8 / bf16 weights": (0.55, False),
    "param bytes, GPT layers, fp8_model_init / bf16": (0.55, False),
    "host syncs per fp8 linear fwd+bwd": (0, False),
    "NPU launches, linear forward, delayed": (6, False),
    "NPU launches, linear backward, delayed": (8, False),
    "NPU launches, linear forward, tensorwise": (4, False),
    "NPU launches, linear backward, tensorwise": (6, False),
    "NPU launches, linear forward, blockwise": (4, False),
    "NPU launches, linear backward, blockwise": (6, False),
    "NPU launches, linear forward, mxfp8": (4, False),
    "NPU launches, linear backward, mxfp8": (6, False),
    **{f"NPU launches, later micro-batch forward, {kind}": (6 if kind == "delayed" else 4, False)
       for kind in ("delayed", "tensorwise", "blockwise", "mxfp8")},
    "NPU launches, delayed update per step": (16, False),
    "NPU launches, HiF8 delayed update per step": (16, False),
    "NPU launches, non-finite fold per step": (4, False),
    **{f"GPT step {label} / bf16": (1.3, False) for label in ("delayed HiF8", "delayed E4M3", "delayed HYBRID",
                                                            "tensorwise E4M3", "blockwise E4M3", "mxfp8 E4M3")},
}


def best_time(fn: Callable[[], object], repeats: int) -> float:
    """Best wall time of `repeats` calls after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _quantizer(recipe, role: str = "input", columnwise: bool = False):
    """The forward quantizer of a recipe for one tensor role (input or weight)."""
    state = RecipeState.create(recipe, forward=True, num_quantizers=3)
    quantizer = state.make_quantizers()[0 if role == "input" else 1]
    quantizer.set_usage(rowwise=True, columnwise=columnwise)
    return quantizer


def quantize_cases() -> dict[str, Callable]:
    """The quantizes of a training step. A per-tensor quantize makes one copy (its columnwise form is the
    transposed view); blockwise 1x128 activations and MXFP8 tensors are made in both layouts (fprop reads the
    rowwise one, wgrad the columnwise one), 128x128 weights in one (it serves both). The rowwise-only
    cases show what the columnwise copy costs."""
    return {
        "quantize delayed E4M3": _quantizer(DelayedScaling(fp8_format=Format.E4M3)),
        "quantize delayed HiF8": _quantizer(DelayedScaling(fp8_format=Format.HIF8)),
        "quantize current E4M3": _quantizer(Float8CurrentScaling(fp8_format=Format.E4M3)),
        "quantize current HiF8": _quantizer(Float8CurrentScaling(fp8_format=Format.HIF8)),
        "quantize blockwise 1x128 E4M3, both layouts": _quantizer(Float8BlockScaling(), columnwise=True),
        "quantize blockwise 1x128 E4M3, rowwise only": _quantizer(Float8BlockScaling()),
        "quantize blockwise 128x128 E4M3": _quantizer(Float8BlockScaling(), role="weight"),
        "quantize mxfp8 E4M3, both layouts": _quantizer(MXFP8BlockScaling(), columnwise=True),
        "quantize mxfp8 E4M3, rowwise only": _quantizer(MXFP8BlockScaling()),
    }


def keep_freed_memory_mapped() -> bool:
    """Raise glibc's trim threshold (M_TRIM_THRESHOLD, -1) and fix its mmap threshold at its 32 MiB maximum
    (M_MMAP_THRESHOLD, -3) for this process, so freed outputs stay mapped for the next call. False where
    there is no glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(-1, 1 << 30)) and bool(libc.mallopt(-3, 1 << 25))


def bench_quantize(size_mib: int, repeats: int) -> list[tuple[str, float, str]]:
    numel = size_mib * 2**20 // 4
    x = torch.randn(numel // 4096, 4096)
    dst = torch.empty_like(x)
    cases = quantize_cases()
    copy_t = best_time(lambda: dst.copy_(x), repeats)  # allocates nothing: the allocator does not matter
    rows = [("copy_ baseline", 1.0, f"{copy_t * 1e3:.2f} ms")]
    for name in [name for name in cases if name.endswith("both layouts")]:
        t = best_time(lambda q=cases[name]: q(x), repeats)
        rows.append((f"{name}, glibc defaults", copy_t / t, f"{t * 1e3:.2f} ms"))
    if not keep_freed_memory_mapped():
        rows = rows[:1]  # not glibc: the rows below are measured with the platform's allocator as it is
    for name, quantizer in cases.items():
        t = best_time(lambda q=quantizer: q(x), repeats)
        rows.append((name, copy_t / t, f"{t * 1e3:.2f} ms"))
    return rows


def bench_hif8(size_mib: int, repeats: int) -> list[tuple[str, float, str]]:
    import numpy as np

    try:
        import en_dtypes
    except ImportError:
        return [("hif8_encode vs en_dtypes", float("nan"), "en_dtypes not installed")]
    numel = size_mib * 2**20 // 4
    x = torch.randn(numel)
    ours = best_time(lambda: hif8_encode(x, saturate=True), repeats)
    # en_dtypes is slow: time it on a sixteenth of the tensor and scale up.
    part = x[: numel // 16].numpy()
    theirs = best_time(lambda: np.clip(part, -32768, 32768).astype(en_dtypes.hifloat8), 1) * 16
    return [("hif8_encode vs en_dtypes", theirs / ours, f"ours {ours * 1e3:.1f} ms, en_dtypes {theirs * 1e3:.0f} ms")]


def _linear_case(recipe, m: int, k: int, n: int, dtype: torch.dtype = torch.float32):
    """A forward+backward closure of fp8_linear with persistent quantizers, and its inputs."""
    fwd = RecipeState.create(recipe, forward=True, num_quantizers=3)
    bwd = RecipeState.create(recipe, forward=False, num_quantizers=2)
    f, b = fwd.make_quantizers(), bwd.make_quantizers()
    quantizers = LinearQuantizers(f[0], f[1], b[0])
    x = torch.randn(m, k, dtype=dtype, requires_grad=True)
    w = torch.randn(n, k, dtype=dtype, requires_grad=True)
    dy = torch.randn(m, n, dtype=dtype)

    def step():
        fp8_linear(x, w, quantizers=quantizers).backward(dy)

    return step, x, w, dy


def _torch_linear_step(m: int, k: int, n: int, dtype: torch.dtype = torch.float32):
    layer = torch.nn.Linear(k, n, bias=False, dtype=dtype)
    x = torch.randn(m, k, dtype=dtype, requires_grad=True)
    dy = torch.randn(m, n, dtype=dtype)
    return lambda: layer(x).backward(dy)


def bench_linear(repeats: int, size: int = 2048) -> list[tuple[str, float, str]]:
    recipe = Float8CurrentScaling(fp8_format=Format.E4M3)
    rows = []
    base = best_time(_torch_linear_step(size, size, size), repeats)
    ours = best_time(_linear_case(recipe, size, size, size)[0], repeats)
    rows.append(("fp8 linear fwd+bwd 2048^3 / fp32 nn.Linear", ours / base,
                 f"fp8 {ours * 1e3:.0f} ms, fp32 {base * 1e3:.0f} ms ({get_backend().name} backend)"))
    small_base = best_time(_torch_linear_step(64, 64, 64), repeats * 20)
    small = best_time(_linear_case(recipe, 64, 64, 64)[0], repeats * 20)
    rows.append(("host overhead 64x64 fwd+bwd / nn.Linear", small / small_base,
                 f"fp8 {small * 1e6:.0f} us, nn.Linear {small_base * 1e6:.0f} us"))
    rows.append(_per_tensor_gemm_row(repeats * 4))
    for recipe in (DelayedScaling(fp8_format=Format.HIF8), Float8BlockScaling(), MXFP8BlockScaling()):
        x = torch.randn(1024, 1024, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(1024, 1024, dtype=torch.bfloat16, requires_grad=True)
        ratio = _saved_bytes(recipe, x, w) / ((x.numel() + w.numel()) * 2)
        rows.append(("bytes saved for backward / bf16 linear", ratio, type(recipe).__name__))
    with HostSyncCounter() as counter:
        _linear_case(DelayedScaling(fp8_format=Format.HIF8), 64, 64, 64)[0]()
    rows.append(("host syncs per fp8 linear fwd+bwd", float(counter.total), str(dict(counter.counts)) or "none"))
    return rows


def _per_tensor_gemm_row(repeats: int, m: int = 512, k: int = 1024, n: int = 256) -> tuple[str, float, str]:
    """A per-tensor GEMM of a GPT's MLP (the float32 sum of two operands' decoded codes, then scales, to
    bfloat16) against torch's bf16 GEMM of the same shape: on the CPU the cost that decides the GPT step."""
    a, b = torch.randn(m, k), torch.randn(n, k)
    qa, qb = (_quantizer(Float8CurrentScaling(fp8_format=Format.E4M3)).quantize(t) for t in (a, b))
    a16, b16 = a.bfloat16(), b.bfloat16()
    backend = get_backend()
    ours = best_time(lambda: backend.gemm(qa, qb, out_dtype=torch.bfloat16), repeats)
    base = best_time(lambda: torch.mm(a16, b16.t()), repeats)
    return (f"per-tensor fp8 GEMM {m}x{k}x{n} / bf16 torch.mm", ours / base,
            f"fp8 {ours * 1e3:.2f} ms, bf16 {base * 1e3:.2f} ms ({backend.name} backend, "
            f"bf16 GEMM of our own: {'yes' if fused_cast.gemm_bf16_applies() else 'no'})")


@contextmanager
def npu_simulated(chip: str = "1") -> Iterator[Any]:
    """The NPU backend on the torch_npu simulator for CPU tensors; yields the simulated torch_npu module.
    `chip`: "1" (the simulator's default, an Ascend 950PR) or a chip name such as "Ascend950DT". The CPU-only
    fused cast extension is off, so the library takes the torch ops it would run on an NPU."""
    saved = {name: os.environ.get(name) for name in (BACKEND_ENV, SIMULATOR_ENV)}
    os.environ[BACKEND_ENV], os.environ[SIMULATOR_ENV] = "npu", chip
    reset_backend()  # the backend is chosen from the environment once; choose again now and on the way out
    fused, fused_cast.enabled = fused_cast.enabled, False
    try:
        yield get_backend().npu
    finally:
        fused_cast.enabled = fused
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        reset_backend()


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
    check reads the folded flags with a few ops and one host read of its own)."""
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
    for chip in ("Ascend950PR", "Ascend950DT"):  # the DT has the dual-axis MX quantize
        with npu_simulated(chip) as npu:
            for name, recipe in launch_recipes().items():
                kind = name.split()[0]
                if chip != "Ascend950PR" and kind != "mxfp8":
                    continue  # the same kernels on both chips
                for dtype in (torch.bfloat16, torch.float32):
                    forward, backward = linear_launches(recipe, dtype, npu)
                    detail = f"{name} {str(dtype).replace('torch.', '')} {chip} ({forward.npu_kernels} / " \
                             f"{backward.npu_kernels} torch_npu)"
                    rows.append((f"NPU launches, linear forward, {kind}", float(forward.total), detail))
                    rows.append((f"NPU launches, linear backward, {kind}", float(backward.total), detail))
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


def _saved_bytes(recipe, x: torch.Tensor, w: torch.Tensor) -> int:
    """Bytes the fp8 linear keeps for backward (its ctx holds quantized storages)."""
    fwd = RecipeState.create(recipe, forward=True, num_quantizers=3).make_quantizers()
    bwd = RecipeState.create(recipe, forward=False, num_quantizers=2).make_quantizers()
    y = fp8_linear(x, w, quantizers=LinearQuantizers(fwd[0], fwd[1], bwd[0]))
    return sum(t.nbytes() for t in y.grad_fn.saved)


def report(rows: list[tuple[str, float, str]]) -> str:
    width = max([44] + [len(name) for name, *_ in rows])
    lines = [f"{'case':{width}s} {'ratio':>8s}  {'target':>10s}  detail"]
    for name, ratio, detail in rows:
        target = TARGETS.get(name)
        mark = ""
        if target is not None:
            value, at_least = target
            ok = ratio >= value if at_least else ratio <= value
            mark = f"{'>=' if at_least else '<='}{value:g} " + ("ok" if ok else "MISS")
        lines.append(f"{name:{width}s} {ratio:7.2f}x  {mark:>10s}  {detail}")
    return "\n".join(lines)


def _megatron_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mindspeed_te.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=64, help="tensor size for the quantize cases")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", choices=["quantize", "hif8", "linear", "npu", "params", "gpt"],
                        help="run one group of cases")
    args = parser.parse_args(argv)
    if args.size_mib < 1 or args.repeats < 1:
        parser.error("--size-mib and --repeats must be >= 1")
    kernels = fused_cast.simd_level() if fused_cast.available() else "off"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fused kernels: {kernels}")
    rows: list[tuple[str, float, str]] = []
    if args.only in (None, "linear"):
        rows += bench_linear(args.repeats)
    if args.only in (None, "npu"):
        rows += bench_npu_launches()
    if args.only in (None, "params"):
        from mindspeed_te.bench_params import bench_params

        rows += bench_params()
    if args.only in (None, "gpt"):
        from mindspeed_te.bench_gpt import RECIPES, bench_gpt

        missing = [(f"GPT step {label} / bf16", float("nan"), "megatron-core not installed")
                   for label in RECIPES if label != "bf16"]
        rows += bench_gpt(args.repeats) if _megatron_available() else missing
    # Last: they allocate tensors of --size-mib, and the quantize group raises glibc's trim threshold for the
    # rest of the process, which would change what the groups above measure.
    if args.only in (None, "quantize"):
        rows += bench_quantize(args.size_mib, args.repeats)
    if args.only in (None, "hif8"):
        rows += bench_hif8(args.size_mib, args.repeats)
    print(report(rows))


if __name__ == "__main__":
    main()
