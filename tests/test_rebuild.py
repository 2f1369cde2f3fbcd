"""A linear whose input is an activation's output (a GPT MLP's fc2) keeps no quantized copy of it: its wgrad
rebuilds the input from the activation's own saved input and quantizes it with the forward's scale. The results
are those of the linear that keeps the copy, bit for bit, and the bytes kept after the forward drop by the copy."""
from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

import mindspeed_te as te
from mindspeed_te import FP8GlobalStateManager
from mindspeed_te.bench.memory import LiveStorages
from mindspeed_te.ops import linear as linear_ops
from mindspeed_te.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)

TOKENS, HIDDEN, FFN = 256, 128, 512
RECIPES = {"hif8-delayed": lambda: DelayedScaling(fp8_format=Format.HIF8),
           "hybrid-delayed": lambda: DelayedScaling(fp8_format=Format.HYBRID),
           "e4m3-current": Float8CurrentScaling, "blockwise": Float8BlockScaling, "mxfp8": MXFP8BlockScaling,
           "nvfp4": lambda: NVFP4BlockScaling(disable_stochastic_rounding=True)}
ACTIVATIONS = {"gelu": lambda h: F.gelu(h), "gelu-tanh": lambda h: F.gelu(h, approximate="tanh"), "silu": F.silu}


def _mlp_steps(recipe_name: str, activation, steps: int = 3) -> list[torch.Tensor]:
    """fc1 -> activation -> fc2, forward and backward, a few steps (delayed scaling's scales move on)."""
    FP8GlobalStateManager.reset()
    torch.manual_seed(0)
    fc1 = te.Linear(HIDDEN, FFN, params_dtype=torch.bfloat16)
    fc2 = te.Linear(FFN, HIDDEN, params_dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    results = []
    for _ in range(steps):
        x = torch.randn(TOKENS, HIDDEN, generator=gen).bfloat16().requires_grad_()
        with te.fp8_autocast(fp8_recipe=RECIPES[recipe_name]()):
            y = fc2(activation(fc1(x)))
        y.float().square().sum().backward()
        results += [y.detach(), x.grad] + [p.grad.clone() for p in (*fc1.parameters(), *fc2.parameters())]
        for p in (*fc1.parameters(), *fc2.parameters()):
            p.grad = None
    return results


@pytest.fixture
def kept_copy(monkeypatch):
    """The linear as TE has it: the quantized input kept."""
    def use() -> None:
        monkeypatch.setattr(linear_ops, "rebuildable_input", lambda inp, x2d: None)
    return use


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("name", RECIPES)
def test_rebuilt_input_gives_the_kept_copys_bits(name, activation, kept_copy):
    rebuilt = _mlp_steps(name, ACTIVATIONS[activation])
    kept_copy()
    kept = _mlp_steps(name, ACTIVATIONS[activation])
    assert len(rebuilt) == len(kept)
    for a, b in zip(rebuilt, kept):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["hif8-delayed", "hybrid-delayed", "e4m3-current", "mxfp8"])
def test_rebuilt_input_gives_the_kept_copys_bits_on_the_npu(name, kept_copy):
    """The same on the NPU path (the torch_npu simulator), whose backward quantize of the rebuilt input takes
    other kernels (delayed scaling: one npu_quantize by the forward's stored scale_inv)."""
    from mindspeed_te.bench.launches import npu_simulated

    with npu_simulated("Ascend950PR"):
        rebuilt = _mlp_steps(name, ACTIVATIONS["gelu"])
        kept_copy()
        kept = _mlp_steps(name, ACTIVATIONS["gelu"])
    for a, b in zip(rebuilt, kept):
        assert torch.equal(a, b)


def _kept_bytes() -> int:
    """Bytes alive after fc2's forward that it made (fc1's output and the activation are older)."""
    FP8GlobalStateManager.reset()
    fc2 = te.Linear(FFN, HIDDEN, params_dtype=torch.bfloat16)
    h = torch.randn(TOKENS, FFN, dtype=torch.bfloat16, requires_grad=True)
    with te.fp8_autocast(fp8_recipe=MXFP8BlockScaling()):
        fc2(F.gelu(h)).sum().backward()  # the weight's codes, the recipe state
        a = F.gelu(h)
        tracker = LiveStorages()
        with tracker:
            y = fc2(a)
    kept = tracker.live_bytes(leave_out=(y,))
    y.float().sum().backward()
    return kept


def test_no_quantized_copy_is_kept(kept_copy):
    rebuilt = _kept_bytes()
    kept_copy()
    kept = _kept_bytes()
    # MXFP8's columnwise codes (1 byte each) and their scales (one per 32)
    assert kept - rebuilt >= TOKENS * FFN * (1 + 1 / 32)


def test_an_input_changed_in_place_is_refused():
    fc2 = te.Linear(FFN, HIDDEN, params_dtype=torch.bfloat16)
    h = torch.randn(TOKENS, FFN, dtype=torch.bfloat16, requires_grad=True)
    with te.fp8_autocast(fp8_recipe=Float8CurrentScaling()):
        source = h * 1.0
        y = fc2(F.silu(source))
    with torch.no_grad():
        source.add_(1.0)  # autograd would refuse SiLU's backward too; the linear's runs first and says why
    with pytest.raises(RuntimeError, match="modified in place"):
        y.sum().backward()


def test_other_inputs_and_hooks_keep_the_copy():
    from mindspeed_te.ops.rebuild import rebuildable_input

    h = torch.randn(8, 16, requires_grad=True)
    assert rebuildable_input(F.gelu(h), F.gelu(h)) is not None
    assert rebuildable_input(h * 2, h * 2) is None  # not an activation
    assert rebuildable_input(h, h) is None  # a leaf
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        a = F.gelu(h)
        assert rebuildable_input(a, a) is None  # the saved input would be unpacked here


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")
def test_megatron_fused_bias_gelu_output_is_rebuilt():
    """Megatron's bias-GeLU fusion (its MLP with bias_activation_fusion): an autograd function keeping its
    input and bias."""
    from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl

    from mindspeed_te.ops.rebuild import rebuildable_input

    h = torch.randn(TOKENS, FFN, dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(FFN, dtype=torch.bfloat16, requires_grad=True)
    out = bias_gelu_impl(h, bias)
    rebuilt = rebuildable_input(out, out)
    assert rebuilt is not None and torch.equal(rebuilt(), out.detach())


class _KeepsNothing(torch.autograd.Function):
    """An op whose backward needs nothing of its output, as FP8 attention's."""

    keeps_output = False

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def test_save_original_input_keeps_codes_after_an_op_that_keeps_no_output():
    """Megatron sets save_original_input on linear_proj because TE's attention keeps its output anyway; after an
    op that keeps nothing of it (ours, FP8 attention), the bf16 input would be the only copy: the linear keeps
    its quantized one instead (1 byte an element, not 2)."""
    def kept(make) -> int:
        FP8GlobalStateManager.reset()
        proj = te.Linear(FFN, HIDDEN, params_dtype=torch.bfloat16, save_original_input=True)
        h = torch.randn(TOKENS, FFN, dtype=torch.bfloat16, requires_grad=True)
        with te.fp8_autocast(fp8_recipe=Float8CurrentScaling()):
            proj(make(h)).sum().backward()
            tracker = LiveStorages()
            with tracker:
                y = proj(make(h))
            held = tracker.live_bytes(leave_out=(y,))
            y.float().sum().backward()
        return held

    plain, after_attention = kept(lambda t: t * 2), kept(_KeepsNothing.apply)
    assert plain >= 2 * TOKENS * FFN  # the bf16 input
    assert TOKENS * FFN <= after_attention <= plain - TOKENS * FFN / 2  # codes, and no bf16 input
