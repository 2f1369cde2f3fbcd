"""On a CUDA device (skipped without one): what the CPU suite cannot show. The quantizers give the same codes as on
the CPU (torch ops there, the C kernels here); the modules train with every recipe and agree with the CPU
reference run on the same inputs, E4M3/E5M2 per-tensor GEMMs going through `torch._scaled_mm`; a training step
makes no host synchronisation, and a NaN is still reported, naming its module, by the copy's event; activation
offload's accelerator path (side stream, pinned buffers) gives the same bits and frees device memory."""
from __future__ import annotations

import math
import re
import warnings

import pytest
import torch

import mindspeed_te as te
from mindspeed_te import FP8GlobalStateManager
from mindspeed_te.formats import FP4Dtype, FP8Dtype
from mindspeed_te.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP4BlockScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

RECIPES = {
    "hif8-delayed": lambda: DelayedScaling(fp8_format=Format.HIF8),
    "e4m3-delayed": lambda: DelayedScaling(fp8_format=Format.E4M3),
    "hybrid-delayed": lambda: DelayedScaling(fp8_format=Format.HYBRID),
    "e4m3-current": Float8CurrentScaling,
    "blockwise": Float8BlockScaling,
    "mxfp8": MXFP8BlockScaling,
    "mxfp4": MXFP4BlockScaling,
    # without stochastic rounding: its random bits come from each device's own generator
    "nvfp4": lambda: NVFP4BlockScaling(disable_stochastic_rounding=True),
}
# recipes whose three GEMMs take per-tensor E4M3/E5M2 operands: torch._scaled_mm on CUDA
SCALED_MM = {"e4m3-delayed", "hybrid-delayed", "e4m3-current"}
QUANTIZERS = {
    "e4m3-current": lambda: te.Float8CurrentScalingQuantizer(FP8Dtype.E4M3, FP8Dtype.E4M3.max),
    "hif8-current": lambda: te.Float8CurrentScalingQuantizer(FP8Dtype.HIF8, FP8Dtype.HIF8.max),
    "blockwise-1x128": lambda: te.Float8BlockQuantizer(FP8Dtype.E4M3, FP8Dtype.E4M3.max, block_scaling_dim=1),
    "blockwise-128x128": lambda: te.Float8BlockQuantizer(FP8Dtype.E4M3, FP8Dtype.E4M3.max, block_scaling_dim=2),
    "mxfp8": lambda: te.MXFP8Quantizer(FP8Dtype.E4M3, rounding="ceil"),
    "mxfp4": lambda: te.MXFP4Quantizer(FP4Dtype.E2M1),
    "nvfp4-rht": lambda: te.NVFP4Quantizer(FP4Dtype.E2M1, with_rht=True),
    "nvfp4-2d": lambda: te.NVFP4Quantizer(FP4Dtype.E2M1, with_2d_quantization=True),
}


def _built_on_cpu(make, device: str):
    """The module built on the CPU from one seed (the same weights for every device), then moved: CUDA's
    generator would draw other weights."""
    torch.manual_seed(0)
    return make().to(device)


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("name", QUANTIZERS)
def test_quantizers_give_the_cpu_codes(name):
    x = torch.randn(256, 512, generator=torch.Generator().manual_seed(1)) * 3
    x[3, 7] = 1e4  # a wide range inside one block and one tensor
    x[5, 0] = 4 * 448.0  # a block amax of 448·2^k: "ceil" MX scales need amax / 448 divided exactly
    if name == "nvfp4-rht":
        # The CPU rounds each Hadamard sum exactly once; a device sums in float32, exact only where a block's
        # values span few binades: bf16 values within 12 binades (8 + 12 + 4 bits for 16 terms fit float32's 24)
        gen = torch.Generator().manual_seed(2)
        magnitude = torch.exp2(torch.randint(0, 12, x.shape, generator=gen).float())
        mantissa = 1 + torch.randint(0, 128, x.shape, generator=gen).float() / 128
        x = (magnitude * mantissa * torch.sign(torch.randn(x.shape, generator=gen))).bfloat16()
    quantizer = QUANTIZERS[name]
    cpu, cuda = quantizer()(x), quantizer()(x.cuda())
    for columnwise in (False, True):
        assert torch.equal(cuda.dequantize(torch.float32, columnwise=columnwise).cpu(),
                           cpu.dequantize(torch.float32, columnwise=columnwise)), columnwise


def _train_linear(recipe_name: str, device: str, steps: int = 3) -> list[torch.Tensor]:
    """Forward and backward of a bf16 Linear with bias, a few steps (delayed scaling's history moves on)."""
    layer = _built_on_cpu(lambda: te.Linear(256, 512, bias=True, params_dtype=torch.bfloat16), device)
    gen = torch.Generator().manual_seed(2)
    results = []
    for _ in range(steps):
        x = torch.randn(128, 256, generator=gen).to(device, torch.bfloat16).requires_grad_()
        dy = torch.randn(128, 512, generator=gen).to(device, torch.bfloat16)
        with te.fp8_autocast(fp8_recipe=RECIPES[recipe_name]()):
            y = layer(x)
        y.backward(dy)
        results = [y.detach(), x.grad, layer.weight.grad.clone(), layer.bias.grad.clone()]
        layer.weight.grad = layer.bias.grad = None
    return results


@pytest.mark.parametrize("name", RECIPES)
def test_linear_trains_as_on_the_cpu(name, monkeypatch):
    calls = []
    scaled_mm = torch._scaled_mm

    def counted(*args, **kwargs):
        calls.append(args[0].dtype)
        return scaled_mm(*args, **kwargs)

    FP8GlobalStateManager.reset()
    cpu = _train_linear(name, "cpu")
    monkeypatch.setattr(torch, "_scaled_mm", counted)
    FP8GlobalStateManager.reset()
    cuda = _train_linear(name, "cuda")
    for what, a, b in zip(("output", "dgrad", "wgrad", "bias grad"), cuda, cpu):
        assert a.device.type == "cuda" and a.dtype == b.dtype, what
        # same codes and scales; only the GEMMs' accumulation order differs
        assert _relative_error(a, b) < 1e-2, what
    if name in SCALED_MM:
        assert len(calls) == 3 * 3  # fprop, dgrad and wgrad of each step
    else:
        assert not calls


def test_delayed_scaling_history_matches_the_cpu():
    """The amax history and scales (exact: a max and a power of two) after a few steps are the CPU's."""
    def scales(device: str) -> list[torch.Tensor]:
        FP8GlobalStateManager.reset()
        layer = _built_on_cpu(lambda: te.LayerNormLinear(256, 256, params_dtype=torch.bfloat16), device)
        gen = torch.Generator().manual_seed(5)
        recipe = DelayedScaling(fp8_format=Format.HIF8, amax_history_len=4)
        for _ in range(3):
            x = torch.randn(64, 256, generator=gen).to(device, torch.bfloat16).requires_grad_()
            with te.fp8_autocast(fp8_recipe=recipe):
                layer(x).float().square().sum().backward()
        return [layer.fp8_meta[key].amax_history.cpu() for key in ("scaling_fwd", "scaling_bwd")] + \
               [layer.fp8_meta[key].scale.cpu() for key in ("scaling_fwd", "scaling_bwd")]

    cpu, cuda = scales("cpu"), scales("cuda")
    for a, b in zip(cuda, cpu):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["hif8-delayed", "mxfp8"])
def test_layer_with_attention_and_mlp_trains_as_on_the_cpu(name):
    """LayerNormLinear (QKV) + DotProductAttention (causal, GQA) + Linear + LayerNormMLP, forward and backward."""
    def run(device: str) -> list[torch.Tensor]:
        FP8GlobalStateManager.reset()
        qkv, proj, mlp = _built_on_cpu(lambda: torch.nn.ModuleList([
            te.LayerNormLinear(256, 256 + 2 * 64, params_dtype=torch.bfloat16),
            te.Linear(256, 256, params_dtype=torch.bfloat16),
            te.LayerNormMLP(256, 1024, params_dtype=torch.bfloat16)]), device)
        attn = te.DotProductAttention(4, 64, num_gqa_groups=1, attn_mask_type="causal")
        x = torch.randn(128, 2, 256, generator=torch.Generator().manual_seed(3)).to(device, torch.bfloat16)
        x.requires_grad_()
        with te.fp8_autocast(fp8_recipe=RECIPES[name]()):
            q, k, v = qkv(x).split([256, 64, 64], dim=-1)
            a = attn(q.reshape(128, 2, 4, 64), k.reshape(128, 2, 1, 64), v.reshape(128, 2, 1, 64))
            h = x + proj(a)
            out = h + mlp(h)
        out.float().square().mean().backward()
        return [out.detach(), x.grad] + [p.grad for m in (qkv, proj, mlp) for p in m.parameters()]

    cpu, cuda = run("cpu"), run("cuda")
    for a, b in zip(cuda, cpu):
        # four quantized GEMMs in a row: a code flipped by another accumulation order moves the later ones
        assert _relative_error(a, b) < 0.1


def test_grouped_linear_trains_as_on_the_cpu():
    def run(device: str) -> list[torch.Tensor]:
        FP8GlobalStateManager.reset()
        layer = _built_on_cpu(lambda: te.GroupedLinear(4, 256, 128, bias=False, params_dtype=torch.bfloat16),
                              device)
        x = torch.randn(256, 256, generator=torch.Generator().manual_seed(4)).to(device, torch.bfloat16)
        x.requires_grad_()
        with te.fp8_autocast(fp8_recipe=MXFP8BlockScaling()):
            y = layer(x, [64, 32, 128, 32])
        y.float().square().sum().backward()
        return [y.detach(), x.grad] + [p.grad for p in layer.parameters()]

    cpu, cuda = run("cpu"), run("cuda")
    for a, b in zip(cuda, cpu):
        assert _relative_error(a, b) < 1e-2


class _TwoLayers:
    """Two named Linears, a step of two micro-batches in their own autocast regions (Megatron's pattern)."""

    def __init__(self, recipe) -> None:
        FP8GlobalStateManager.reset()
        self.recipe = recipe
        self.a = te.Linear(256, 256, name="a", params_dtype=torch.bfloat16, device="cuda")
        self.b = te.Linear(256, 256, name="b", params_dtype=torch.bfloat16, device="cuda")

    def step(self, bad: bool = False) -> None:
        for micro_batch in range(2):
            x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            with te.fp8_autocast(fp8_recipe=self.recipe):
                h = self.a(x)
                if bad and micro_batch == 1:
                    h = h.index_fill(0, torch.tensor([5], device="cuda"), math.nan)
                y = self.b(h)
            y.float().sum().backward()


@pytest.mark.parametrize("name", ["hif8-delayed", "e4m3-current", "mxfp8"])
def test_a_step_never_waits_for_the_device(name):
    """torch's sync debug mode raises at any host synchronisation (`.item()`, `.tolist()`, a blocking copy)."""
    model = _TwoLayers(RECIPES[name]())
    model.step()  # the first step makes the recipe states and their buffers
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            model.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_a_nan_is_reported_by_name_within_a_step():
    """The non-finite report's host copy is read once its CUDA event is done: at most one step late."""
    model = _TwoLayers(DelayedScaling(fp8_format=Format.HIF8))
    model.step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.step(bad=True)
        torch.cuda.synchronize()
        model.step()
        model.step()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert any(re.search(r"\bb input", m) for m in messages), messages


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_scaled_mm_gemm_adds_the_bias_for_every_output_dtype(out_dtype):
    """CUDA's `_scaled_mm` refuses a bias with a float32 output (Megatron's TE linears ask for one): the backend
    adds it to the product itself. Against the decoded operands' product in float64."""
    from mindspeed_te.kernels import get_backend

    gen = torch.Generator().manual_seed(6)
    quantizer = te.Float8CurrentScalingQuantizer(FP8Dtype.E4M3, FP8Dtype.E4M3.max)
    a, b = (quantizer(torch.randn(64, 128, generator=gen).cuda()) for _ in range(2))
    bias = torch.randn(64, generator=gen).cuda()
    out = get_backend(torch.device("cuda")).gemm(a, b, out_dtype=out_dtype, bias=bias)
    expected = a.dequantize(torch.float64) @ b.dequantize(torch.float64).t() + bias.double()
    assert out.dtype == out_dtype and _relative_error(out, expected) < 1e-2
