"""Bench group "linear": an FP8 linear's time, host overhead, GEMM cost and saved bytes against torch's."""
from __future__ import annotations

import torch

from mindspeed_te import fused_cast
from mindspeed_te.bench.quantize import forward_quantizer
from mindspeed_te.bench.report import best_time
from mindspeed_te.diagnostics import HostSyncCounter
from mindspeed_te.kernels import get_backend
from mindspeed_te.ops.linear import LinearQuantizers, fp8_linear
from mindspeed_te.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP4BlockScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)
from mindspeed_te.recipe_state import RecipeState


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
    # bf16 on both sides: the FP8 linear takes bf16 activations and weights and computes on bf16 dot products.
    bf16 = torch.bfloat16
    base = best_time(_torch_linear_step(size, size, size, bf16), repeats)
    ours = best_time(_linear_case(recipe, size, size, size, bf16)[0], repeats)
    rows.append(("fp8 linear fwd+bwd 2048^3 / bf16 nn.Linear", ours / base,
                 f"fp8 {ours * 1e3:.0f} ms, bf16 {base * 1e3:.0f} ms ({get_backend().name} backend)"))
    small_base = best_time(_torch_linear_step(64, 64, 64, bf16), repeats * 20)
    small = best_time(_linear_case(recipe, 64, 64, 64, bf16)[0], repeats * 20)
    rows.append(("host overhead 64x64 fwd+bwd / nn.Linear", small / small_base,
                 f"fp8 {small * 1e6:.0f} us, bf16 nn.Linear {small_base * 1e6:.0f} us"))
    rows.append(_per_tensor_gemm_row(repeats * 4))
    rows += _fp4_rows(repeats)
    for recipe in (DelayedScaling(fp8_format=Format.HIF8), Float8BlockScaling(), MXFP8BlockScaling()):
        x = torch.randn(1024, 1024, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(1024, 1024, dtype=torch.bfloat16, requires_grad=True)
        ratio = _saved_bytes(recipe, x, w) / ((x.numel() + w.numel()) * 2)
        rows.append(("bytes saved for backward / bf16 linear", ratio, type(recipe).__name__))
    with HostSyncCounter() as counter:
        _linear_case(DelayedScaling(fp8_format=Format.HIF8), 64, 64, 64)[0]()
    rows.append(("host syncs per fp8 linear fwd+bwd", float(counter.total), str(dict(counter.counts)) or "none"))
    return rows


def _fp4_rows(repeats: int, size: int = 1024) -> list[tuple[str, float, str]]:
    """The CPU emulation of an FP4 linear's forward + backward (each recipe's defaults) against the MXFP8 one,
    same shapes and bf16 tensors (issue 32's goal: at most 1.5x). The three take turns, one call each per round,
    and each keeps its best round: a load that comes and goes then weighs on all three alike."""
    steps = {name: _linear_case(recipe, size, size, size, torch.bfloat16)[0] for name, recipe in
             (("MXFP8", MXFP8BlockScaling()), ("NVFP4", NVFP4BlockScaling()), ("MXFP4", MXFP4BlockScaling()))}
    best = {name: best_time(step, 1) for name, step in steps.items()}
    for _ in range(2 * repeats - 1):
        for name, step in steps.items():
            best[name] = min(best[name], best_time(step, 1))
    fp8 = best.pop("MXFP8")
    return [(f"fp4 linear fwd+bwd {size}^3 / MXFP8, {name}", fp4 / fp8,
             f"{name} {fp4 * 1e3:.0f} ms, MXFP8 {fp8 * 1e3:.0f} ms ({get_backend().name} backend)")
            for name, fp4 in best.items()]


def _per_tensor_gemm_row(repeats: int, m: int = 512, k: int = 1024, n: int = 256) -> tuple[str, float, str]:
    """A per-tensor GEMM of a GPT's MLP (the float32 sum of two operands' decoded codes, then scales, to
    bfloat16) against torch's bf16 GEMM of the same shape: on the CPU the cost that decides the GPT step."""
    a, b = torch.randn(m, k), torch.randn(n, k)
    qa, qb = (forward_quantizer(Float8CurrentScaling(fp8_format=Format.E4M3)).quantize(t) for t in (a, b))
    a16, b16 = a.bfloat16(), b.bfloat16()
    backend = get_backend()
    ours = best_time(lambda: backend.gemm(qa, qb, out_dtype=torch.bfloat16), repeats)
    base = best_time(lambda: torch.mm(a16, b16.t()), repeats)
    return (f"per-tensor fp8 GEMM {m}x{k}x{n} / bf16 torch.mm", ours / base,
            f"fp8 {ours * 1e3:.2f} ms, bf16 {base * 1e3:.2f} ms ({backend.name} backend, "
            f"bf16 GEMM of our own: {'yes' if fused_cast.gemm_bf16_applies() else 'no'})")


def _saved_bytes(recipe, x: torch.Tensor, w: torch.Tensor) -> int:
    """Bytes the fp8 linear keeps for backward (its ctx holds quantized storages)."""
    fwd = RecipeState.create(recipe, forward=True, num_quantizers=3).make_quantizers()
    bwd = RecipeState.create(recipe, forward=False, num_quantizers=2).make_quantizers()
    y = fp8_linear(x, w, quantizers=LinearQuantizers(fwd[0], fwd[1], bwd[0]))
    return sum(t.nbytes() for t in y.grad_fn.saved)
